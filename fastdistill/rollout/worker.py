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

With ``rollout_processes`` = P > 1 the parent spawns P such children over the same dataset and the same sample
queue. Child c dispatches only the prompt ids :func:`~fastdistill.rollout.dispatch.owner_of` gives it (a fixed
function of the id), so every prompt still has exactly one process that dispatches, re-dispatches and drops it;
:meth:`RolloutWorker.redo` sends each id to its owner. Every child beats, watches its parent and says "nothing left"
on its own; the stream ends once all of them have (:meth:`RolloutWorker.ended_by`). The in-flight cap, the slow start
and ``max_lookahead`` hold for all children together (:class:`~fastdistill.rollout.processes.SharedCounts`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastdistill.rollout.child import WorkerExhausted, child_main
from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.dispatch import owner_of
from fastdistill.rollout.processes import SharedCounts
from fastdistill.rollout.prompt_table import routed_table

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
    """What the parent shares with one child (all from the spawn context): every child's view has the same queues,
    version, events and counts, and its own redo queue, heartbeat and ready event."""

    samples: Any  # mp.Queue[RolloutSample | DroppedPrompt | WorkerExhausted], bounded, shared by every child
    metrics: Any  # mp.Queue[dict[str, float | tuple[float, float]]], bounded; full means the payload is dropped
    redo: Any  # mp.Queue[list[int]] of this child's prompt ids to dispatch again, unbounded
    errors: Any  # mp.Queue[tuple[str, str, str, int]] of (type name, message, traceback, process), a slot per child
    model_version: Any  # mp.Value("q")
    trained_steps: Any  # mp.Value("q"), the trainer's optimizer steps (a horizon's schedule)
    heartbeat: Any  # mp.Value("d"), time.time() of this child's last beat
    stop: Any  # mp.Event
    ready: Any  # mp.Event, this child's loop is built
    failed: Any  # mp.Event, some child failed
    process: int = 0  # this child's index among the worker's rollout_processes
    shared: SharedCounts | None = None  # with several children: their counts


class RolloutWorker:
    """Parent-side controller of the rollout child process.

    ``dataset``: a :class:`~fastdistill.data.PromptTable`, or rows ``{"prompt_ids": list[int], "teacher_id": str
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
        self.processes = config.rollout_processes
        self._ready_timeout_s = ready_timeout_s
        context = mp.get_context("spawn")
        self._context = context
        first = _Channels(
            samples=context.Queue(maxsize=queue_maxsize),
            metrics=context.Queue(maxsize=4096),
            redo=context.Queue(),
            errors=context.Queue(maxsize=self.processes),
            model_version=context.Value("q", 0),
            trained_steps=context.Value("q", 0),
            heartbeat=context.Value("d", 0.0),
            stop=context.Event(),
            ready=context.Event(),
            failed=context.Event(),
            shared=SharedCounts(context, self.processes) if self.processes > 1 else None,
        )
        self._children = [first] + [
            dataclasses.replace(first, redo=context.Queue(), heartbeat=context.Value("d", 0.0), ready=context.Event(),
                                process=process) for process in range(1, self.processes)]
        self._channels = first  # what is shared, and the first child's own
        self._processes: list[Any] = []
        self._process: Any = None  # the first child (the only one by default)
        self._child_error: str | None = None  # the first failure report, kept once read from the queue
        self.redo_sent = 0  # prompt ids sent with redo(), to every child
        self._redo_sent_to = [0] * self.processes  # ... to each: a WorkerExhausted notice that saw fewer is out of date
        self._redo_seen_by: dict[int, int] = {}  # child -> redo_seen of its latest WorkerExhausted notice

    @property
    def samples(self) -> Any:
        """The bounded queue of :class:`RolloutSample`, with a :class:`DroppedPrompt` for every prompt given up on and a
        :class:`WorkerExhausted` notice whenever a child has nothing left to dispatch (pass it to :meth:`ended_by`)."""
        return self._channels.samples

    def ended_by(self, notice: WorkerExhausted) -> bool:
        """Record a child's "nothing left" notice; True when the stream has ended: every child's latest notice
        counts every redo id sent to that child (a redo sent after a notice makes it out of date until the child
        says so again)."""
        self._redo_seen_by[notice.process] = notice.redo_seen
        return all(self._redo_seen_by.get(process) == sent for process, sent in enumerate(self._redo_sent_to))

    @property
    def metrics_queue(self) -> Any:
        """Queue of metric dicts (dropped when full): TRL 1.16's keys and ours, one dict per finished or
        failed rollout. ``*_total`` values are counts since the previous dict (sum them); ``rollout/generated_tok_s``
        is a ``(tokens, seconds)`` pair since the previous sample (its rate is Σ tokens / Σ seconds)."""
        return self._channels.metrics

    def redo(self, prompt_ids: Sequence[int]) -> None:
        """Make the child that owns each of these prompt ids dispatch it again, ahead of its cursor (e.g. samples
        dropped as stale).

        An id the cursor has not reached yet is dispatched now and skipped by the cursor later, so it still runs
        once. Works before and after :meth:`start`."""
        ids = [int(prompt_id) for prompt_id in prompt_ids]
        if any(prompt_id < 0 for prompt_id in ids):
            raise ValueError(f"redo: prompt ids must be >= 0, got {ids[:10]}")
        by_owner: dict[int, list[int]] = {}
        for prompt_id in ids:
            by_owner.setdefault(owner_of(prompt_id, self.processes), []).append(prompt_id)
        for process, owned in by_owner.items():
            self._children[process].redo.put(owned)
            self._redo_sent_to[process] += len(owned)
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
    def trained_steps(self) -> int:
        return int(self._channels.trained_steps.value)

    @trained_steps.setter
    def trained_steps(self, step: int) -> None:
        """Set the training steps trained so far (the horizon of rollouts dispatched from now on)."""
        with self._channels.trained_steps.get_lock():
            self._channels.trained_steps.value = int(step)

    @property
    def pid(self) -> int | None:
        """The first child's pid (None before :meth:`start`)."""
        return None if self._process is None else self._process.pid

    @property
    def pids(self) -> list[int]:
        """Every child's pid, in process order (empty before :meth:`start`)."""
        return [process.pid for process in self._processes]

    def is_alive(self) -> bool:
        """Whether any child is running."""
        return any(process.is_alive() for process in self._processes)

    def _name(self, process: int) -> str:
        return "child" if self.processes == 1 else f"child {process} of {self.processes}"

    def start(self) -> None:
        """Spawn the children without CUDA or torch.distributed settings; wait until every loop is built."""
        if self._processes:
            raise RuntimeError("the rollout worker was already started")
        for channels in self._children:
            channels.heartbeat.value = time.time()
            self._processes.append(self._context.Process(
                target=child_main,
                args=(self.config, self._rows, channels, os.getpid()),
                name=f"fastdistill-rollout-worker-{channels.process}",
                daemon=True,
            ))
        self._process = self._processes[0]
        with _child_environment():
            for process in self._processes:
                process.start()
        deadline = time.monotonic() + self._ready_timeout_s
        for channels, process in zip(self._children, self._processes, strict=True):
            while not channels.ready.wait(0.1):
                if not process.is_alive():
                    self.check_health(stale_after_s=float("inf"))
                    raise RuntimeError(f"rollout worker {self._name(channels.process)} exited during start (exit "
                                       f"code {process.exitcode})")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rollout worker {self._name(channels.process)} not ready after "
                                       f"{self._ready_timeout_s:.0f} s")

    def check_health(self, stale_after_s: float) -> None:
        """Raise RuntimeError if a child failed (with its traceback), died, or has not beaten for
        ``stale_after_s`` seconds."""
        channels = self._channels
        if channels.failed.is_set():
            if self._child_error is None:
                try:
                    type_name, message, child_traceback, process = channels.errors.get(timeout=5.0)
                    self._child_error = f"{self._name(process)} failed: {type_name}: {message}\n{child_traceback}"
                except queue.Empty:
                    self._child_error = "child failed: no error report arrived"
            raise RuntimeError(f"rollout worker {self._child_error}")
        for child, process in zip(self._children, self._processes, strict=False):  # none before start()
            if not process.is_alive() and not channels.stop.is_set():
                raise RuntimeError(f"rollout worker {self._name(child.process)} (pid {process.pid}) died (exit code "
                                   f"{process.exitcode})")
        for child in self._children:
            silence_s = time.time() - child.heartbeat.value
            if silence_s > stale_after_s:
                pid = self._processes[child.process].pid if self._processes else None
                raise RuntimeError(
                    f"rollout worker heartbeat stale: last beat {silence_s:.1f} s ago (limit {stale_after_s:g} s); "
                    f"the {self._name(child.process)} (pid {pid}) is alive but its loop is not running: hung, "
                    "stopped or starved of CPU"
                )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the children to stop (in-flight rollouts are cancelled); terminate, then kill, those that do not exit
        within ``timeout_s`` (one deadline for all)."""
        self._channels.stop.set()
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
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
