"""Rollout worker: a CUDA-free child process that keeps the student and teacher vLLM servers busy.

The parent (:class:`RolloutWorker`) validates the dataset, spawns the child and watches it; the child
(:mod:`fastdistill.rollout.child`) stops by itself when the parent dies. The child runs one
asyncio loop over the dataset (a :class:`PromptTable` of already tokenised prompts, routed) with at most
``max_inflight_tasks`` rollouts in flight (and, with ``max_lookahead``, at most that many in flight and queued
together); one rollout = student generate, then teacher score. Scored samples go into
the bounded ``samples`` queue, per-rollout metrics into ``metrics_queue`` (TRL 1.16's names).

Differences from TRL 1.16's ``AsyncRolloutWorker``: rows are routed to teachers and validated in the
parent before anything starts; every server may be several replicas (balanced, with failover); a rollout that fails
with a :class:`VLLMError` is counted (``rollout/failed_total``) instead of killing the worker, and re-dispatched when
the cause was an unavailable server; a server that stays unreachable past ``server_down_deadline_s`` is a clear
error; the heartbeat is written during every wait, backpressure included; epochs are shuffled with a per-epoch seed,
the cursor (``start_index``) resumes mid-epoch, ``skip_prompt_ids`` are never dispatched and :meth:`RolloutWorker.redo`
dispatches given prompts again; ``stop()`` cancels in-flight requests instead of waiting for them; when nothing is
left to dispatch a :class:`~fastdistill.rollout.child.WorkerExhausted` notice says so.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastdistill.errors import ServerDownError
from fastdistill.rollout.child import WorkerExhausted, child_main
from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.order import routed_table

__all__ = ["RolloutConfig", "RolloutWorker", "ServerDownError", "WorkerExhausted"]

# Environment variables of torch.distributed / torchrun that must not leak into the child.
_DISTRIBUTED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
)


@dataclass
class _Channels:
    """What parent and child share (all from the spawn context)."""

    samples: Any  # mp.Queue[RolloutSample | DroppedPrompt], bounded
    metrics: Any  # mp.Queue[dict[str, float | tuple[float, float]]], bounded; full means the payload is dropped
    redo: Any  # mp.Queue[list[int]] of prompt ids to dispatch again, unbounded
    errors: Any  # mp.Queue[tuple[str, str, str]] of (type name, message, traceback), maxsize 1
    model_version: Any  # mp.Value("q")
    heartbeat: Any  # mp.Value("d"), time.time() of the child's last beat
    stop: Any  # mp.Event
    ready: Any  # mp.Event
    failed: Any  # mp.Event


class RolloutWorker:
    """Parent-side controller of the rollout child process.

    ``dataset``: a :class:`~fastdistill.rollout.PromptTable`, or rows ``{"prompt_ids": list[int], "teacher_id": str
    (needed with several teachers), "prompt": any (optional, copied to the sample)}``; either way the worker keeps
    (and sends the child) a routed ``PromptTable``. Consume ``samples`` (``RolloutSample``) and ``metrics_queue``
    (dicts).
    """

    def __init__(
        self,
        config: RolloutConfig,
        dataset: Sequence[Mapping[str, Any]],
        *,
        queue_maxsize: int = 256,
        ready_timeout_s: float = 120.0,
    ):
        if queue_maxsize < 1:
            raise ValueError(f"queue_maxsize must be >= 1 (the queue is bounded), got {queue_maxsize}")
        self._rows = routed_table(dataset, list(config.teacher_urls))
        self.config = config
        self._ready_timeout_s = ready_timeout_s
        context = mp.get_context("spawn")
        self._context = context
        self._channels = _Channels(
            samples=context.Queue(maxsize=queue_maxsize),
            metrics=context.Queue(maxsize=4096),
            redo=context.Queue(),
            errors=context.Queue(maxsize=1),
            model_version=context.Value("q", 0),
            heartbeat=context.Value("d", 0.0),
            stop=context.Event(),
            ready=context.Event(),
            failed=context.Event(),
        )
        self._process: Any = None
        self._child_error: str | None = None  # the child's failure report, kept once read from the queue
        self.redo_sent = 0  # prompt ids sent with redo(): a WorkerExhausted notice that saw fewer is out of date

    @property
    def samples(self) -> Any:
        """The bounded queue of :class:`RolloutSample`, with a :class:`DroppedPrompt` for every prompt given up on and a
        :class:`WorkerExhausted` notice whenever nothing is left to dispatch (compare its ``redo_seen`` with
        :attr:`redo_sent`)."""
        return self._channels.samples

    @property
    def metrics_queue(self) -> Any:
        """Queue of metric dicts (dropped when full): TRL 1.16's keys and ours, one dict per finished or
        failed rollout. ``*_total`` values are counts since the previous dict (sum them); ``rollout/generated_tok_s``
        is a ``(tokens, seconds)`` pair since the previous sample (its rate is Σ tokens / Σ seconds)."""
        return self._channels.metrics

    def redo(self, prompt_ids: Sequence[int]) -> None:
        """Make the child dispatch these prompt ids again, ahead of the cursor (e.g. samples dropped as stale).

        An id the cursor has not reached yet is dispatched now and skipped by the cursor later, so it still runs
        once. Works before and after :meth:`start`."""
        ids = [int(prompt_id) for prompt_id in prompt_ids]
        if any(prompt_id < 0 for prompt_id in ids):
            raise ValueError(f"redo: prompt ids must be >= 0, got {ids[:10]}")
        if ids:
            self._channels.redo.put(ids)
            self.redo_sent += len(ids)

    @property
    def model_version(self) -> int:
        return int(self._channels.model_version.value)

    @model_version.setter
    def model_version(self, version: int) -> None:
        """Set the policy version stamped on rollouts dispatched from now on."""
        with self._channels.model_version.get_lock():
            self._channels.model_version.value = int(version)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def start(self) -> None:
        """Spawn the child without CUDA or torch.distributed settings; wait until its loop is built."""
        if self._process is not None:
            raise RuntimeError("the rollout worker was already started")
        self._channels.heartbeat.value = time.time()
        self._process = self._context.Process(
            target=child_main,
            args=(self.config, self._rows, self._channels, os.getpid()),
            name="fastdistill-rollout-worker",
            daemon=True,
        )
        with _child_environment():
            self._process.start()
        deadline = time.monotonic() + self._ready_timeout_s
        while not self._channels.ready.wait(0.1):
            if not self._process.is_alive():
                self.check_health(stale_after_s=float("inf"))
                raise RuntimeError(f"rollout worker child exited during start (exit code {self._process.exitcode})")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rollout worker child not ready after {self._ready_timeout_s:.0f} s")

    def check_health(self, stale_after_s: float) -> None:
        """Raise RuntimeError if the child failed (with its traceback), died, or has not beaten for
        ``stale_after_s`` seconds."""
        channels = self._channels
        if channels.failed.is_set():
            if self._child_error is None:
                try:
                    type_name, message, child_traceback = channels.errors.get(timeout=5.0)
                    self._child_error = f"{type_name}: {message}\n{child_traceback}"
                except queue.Empty:
                    self._child_error = "no error report arrived"
            raise RuntimeError(f"rollout worker child failed: {self._child_error}")
        if self._process is not None and not self._process.is_alive() and not channels.stop.is_set():
            raise RuntimeError(f"rollout worker child died (exit code {self._process.exitcode})")
        silence_s = time.time() - channels.heartbeat.value
        if silence_s > stale_after_s:
            raise RuntimeError(
                f"rollout worker heartbeat stale: last beat {silence_s:.1f} s ago (limit {stale_after_s:g} s); the "
                f"child (pid {self.pid}) is alive but its loop is not running: hung, stopped or starved of CPU"
            )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the child to stop (in-flight rollouts are cancelled); terminate, then kill, if it does not exit."""
        self._channels.stop.set()
        process = self._process
        if process is None:
            return
        process.join(timeout_s)
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)


@contextmanager
def _child_environment() -> Iterator[None]:
    """Temporarily hide GPUs and torch.distributed variables so that a process spawned now inherits neither.

    This edits the parent's ``os.environ`` for the duration of ``Process.start()``; other threads reading the
    environment meanwhile would see the change."""
    changes = {name: None for name in os.environ if name in _DISTRIBUTED_ENV or name.startswith("TORCHELASTIC_")}
    changes["CUDA_VISIBLE_DEVICES"] = ""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
