"""Rollout worker: a CUDA-free child process that keeps the student and teacher vLLM servers busy.

The parent (:class:`RolloutWorker`) validates the dataset, spawns the child and watches it. The child runs one
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
dispatches given prompts again; ``stop()`` cancels in-flight requests instead of waiting for them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from fastdistill.auth import check_api_keys
from fastdistill.errors import ServerDownError
from fastdistill.rollout import dropped as drop_reasons
from fastdistill.rollout.adapters import adapter_name, generate_with_adapter
from fastdistill.rollout.client import Generation, StudentClient, TeacherClient
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.http import RequestStats, RetryPolicy, VLLMError, VLLMUnavailableError
from fastdistill.rollout.order import OnPolicyShare, epoch_order, prompt_cursor, route_rows
from fastdistill.rollout.replicas import ReplicaPool, normalize_urls
from fastdistill.rollout.sample import RolloutSample
from fastdistill.rollout.table import PromptTable

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
logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often the child's loop wakes up to beat, check stop and retry a full queue, in seconds


@dataclass(frozen=True)
class RolloutConfig:
    """Servers and sampling settings of the worker.

    Servers: ``student_url`` and each value of ``teacher_urls`` (teacher id -> URL) is one base URL or a sequence of
    replica URLs serving the same model; requests go to the replica with the fewest in flight, a replica that fails
    with a transient error is skipped for ``replica_cooldown_s`` (doubling while it keeps failing) and the request
    fails over to another replica. ``student_model`` is the ``model`` field of generation requests (default: the
    id the student's ``/v1/models`` reports). ``student_adapter_prefix`` (``lora_sync="adapter"``): generation
    requests of model version v >= 1 name the LoRA adapter ``"<prefix>-v<v>"`` instead, and the sample is stamped
    with the version its request used (see :func:`fastdistill.rollout.adapters.generate_with_adapter`).
    ``student_api_key`` and ``teacher_api_keys`` (teacher id -> key) are the servers' API keys, sent as bearer
    tokens (None: no key); they are left out of the repr.

    Sampling: ``teacher_top_k`` is K (the teacher arrays are K+1 wide); ``max_tokens`` bounds the completion length
    in tokens; ``eos_token_ids`` (add the pad id if generation can end on it) tell a finished completion from a
    clipped one for ``completions/clipped_ratio`` (without them, a completion is clipped when it has ``max_tokens``
    tokens).

    Teacher signal: ``teacher_signals`` maps a teacher id to ``"topk"`` (``prompt_logprobs``, the default for a
    teacher it does not name) or ``"hidden"`` (a ``fastdistill serve-teacher --signal hidden`` server, scored with
    :class:`~fastdistill.rollout.hidden.HiddenTeacherClient`: the sample carries the teacher's final hidden states
    in ``teacher_hidden``, in ``teacher_hidden_dtype``, and no candidates).

    Lookahead: at most ``max_inflight_tasks`` rollouts are in flight, reached by a slow start from
    ``initial_inflight_tasks`` (None: at once); ``max_lookahead`` (None: no such bound) caps rollouts in flight plus
    samples waiting in the queue, so that the worker never runs further ahead of the trainer than that.

    Order: ``seed`` seeds the per-epoch shuffle (epoch e uses ``default_rng((seed, e))``); ``start_index`` is the
    resume cursor (a ``prompt_id``, counting across epochs); ``end_index`` (None: endless) is the first prompt id the
    cursor does not dispatch (the run's last prompt + 1); ``skip_prompt_ids`` are prompt ids the worker never
    dispatches (on resume: prompts beyond the cursor that were already trained); ``skip_rows`` are dataset rows never
    dispatched in any epoch (prompts too long for a server); with ``on_policy`` (a run mixing in a teacher cache) the
    cursor dispatches only the prompt ids that :class:`~fastdistill.rollout.OnPolicyShare` selects.

    Failures: a rollout that failed because a server was unavailable (transient errors until ``retry`` gave up) is
    re-dispatched (only the scoring when the generation succeeded), up to ``max_rollout_attempts`` attempts per
    prompt; a request to a server whose replicas are all cooling down waits for the cooldown. A server with no
    successful answer for ``server_down_deadline_s`` seconds since its first failure stops the child with an error
    naming it. A prompt given up on (rejected by a server, or out of attempts) is put into the sample queue as a
    :class:`~fastdistill.rollout.dropped.DroppedPrompt` naming it, the reason and the server's message, so that the
    consumer can count it as done.
    ``max_consecutive_failures`` rollouts in a row rejected by a server or answered with a malformed body (a
    misconfiguration, not one bad prompt) stop the child with the last error.
    """

    student_url: str | Sequence[str]
    teacher_urls: Mapping[str, str | Sequence[str]]
    teacher_top_k: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_inflight_tasks: int = 128
    initial_inflight_tasks: int | None = None
    max_lookahead: int | None = None
    shuffle: bool = True
    seed: int = 0
    start_index: int = 0
    end_index: int | None = None
    skip_prompt_ids: frozenset[int] = frozenset()
    on_policy: OnPolicyShare | None = None
    skip_rows: frozenset[int] = frozenset()
    student_model: str | None = None
    student_adapter_prefix: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_consecutive_failures: int = 100
    max_rollout_attempts: int = 3
    server_down_deadline_s: float = 600.0
    replica_cooldown_s: float = 2.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    student_api_key: str | None = field(default=None, repr=False)
    teacher_api_keys: Mapping[str, str] | None = field(default=None, repr=False)
    teacher_signals: Mapping[str, str] | None = None
    teacher_hidden_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not self.teacher_urls:
            raise ValueError("teacher_urls is empty: at least one teacher is needed")
        for teacher_id, signal in (self.teacher_signals or {}).items():
            if teacher_id not in self.teacher_urls or signal not in ("topk", "hidden"):
                raise ValueError(f"teacher_signals maps teacher ids of teacher_urls to 'topk' or 'hidden', got "
                                 f"{teacher_id!r}: {signal!r}")
        if self.teacher_hidden_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"teacher_hidden_dtype must be 'bfloat16' or 'float32', got {self.teacher_hidden_dtype!r}")
        normalize_urls(self.student_url, "student_url")
        for teacher_id, urls in self.teacher_urls.items():
            normalize_urls(urls, f"teacher {teacher_id!r}")
        check_api_keys(self.student_api_key, self.teacher_api_keys, self.teacher_urls)
        positive = (
            "teacher_top_k",
            "max_tokens",
            "max_inflight_tasks",
            "max_consecutive_failures",
            "max_rollout_attempts",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {self.start_index}")
        if self.end_index is not None and self.end_index < self.start_index:
            raise ValueError(f"end_index must be None or >= start_index={self.start_index}, got {self.end_index}")
        if self.max_lookahead is not None and (not isinstance(self.max_lookahead, (int, np.integer))
                                               or self.max_lookahead < 1):
            raise ValueError(f"max_lookahead must be None or an int >= 1, got {self.max_lookahead!r}")
        if self.initial_inflight_tasks is not None and not 1 <= self.initial_inflight_tasks <= self.max_inflight_tasks:
            raise ValueError(f"initial_inflight_tasks must be None or in [1, max_inflight_tasks="
                             f"{self.max_inflight_tasks}], got {self.initial_inflight_tasks}")
        if self.server_down_deadline_s <= 0 or self.replica_cooldown_s < 0:
            raise ValueError(
                f"server_down_deadline_s must be > 0 and replica_cooldown_s >= 0, got {self.server_down_deadline_s} "
                f"and {self.replica_cooldown_s}"
            )
        if self.on_policy is not None and not isinstance(self.on_policy, OnPolicyShare):
            raise ValueError(f"on_policy must be None or an OnPolicyShare, got {self.on_policy!r}")
        bad = [i for i in self.skip_prompt_ids if not isinstance(i, (int, np.integer)) or i < 0]
        if bad:
            raise ValueError(f"skip_prompt_ids must be prompt ids >= 0, got {sorted(map(repr, bad))[:5]}")
        object.__setattr__(self, "skip_prompt_ids", frozenset(int(i) for i in self.skip_prompt_ids))
        object.__setattr__(self, "skip_rows", frozenset(int(i) for i in self.skip_rows))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    def student_model_for_version(self, version: int) -> str | None:
        """The ``model`` of a generation request made at model version ``version``: the adapter of that version
        with ``student_adapter_prefix`` (from version 1 on), else None (``student_model`` or the served model)."""
        if self.student_adapter_prefix is None or version < 1:
            return None
        return adapter_name(version, self.student_adapter_prefix)

    def student_replicas(self) -> tuple[str, ...]:
        """The student's replica URLs."""
        return normalize_urls(self.student_url, "student_url")

    def teacher_signal(self, teacher_id: str) -> str:
        """``"topk"`` or ``"hidden"``: what teacher ``teacher_id``'s server returns."""
        return (self.teacher_signals or {}).get(teacher_id, "topk")

    def teacher_replicas(self, teacher_id: str) -> tuple[str, ...]:
        """The replica URLs of teacher ``teacher_id``."""
        return normalize_urls(self.teacher_urls[teacher_id], f"teacher {teacher_id!r}")


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
        teacher_ids = list(config.teacher_urls)
        if isinstance(dataset, PromptTable):
            self._rows = dataset.routed(teacher_ids)
        else:
            self._rows = PromptTable.from_rows(dataset, teacher_ids=route_rows(dataset, teacher_ids))
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

    @property
    def samples(self) -> Any:
        """The bounded queue of :class:`RolloutSample`, with a :class:`DroppedPrompt` for every prompt given up on."""
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
            target=_child_main,
            args=(self.config, self._rows, self._channels),
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


def _child_main(config: RolloutConfig, rows: Sequence[Mapping[str, Any]], channels: _Channels) -> None:
    """Child entry point: run the loop; on failure report (type, message, traceback) and exit with code 1."""
    # On stop the parent may not drain the queues; do not block the exit on flushing them.
    channels.samples.cancel_join_thread()
    channels.metrics.cancel_join_thread()
    channels.redo.cancel_join_thread()
    try:
        loop = _RolloutLoop(config, rows, channels)
        # a start-up slower than the heartbeat limit (imports on a loaded machine) must not read as a hang
        loop.beat()
        channels.ready.set()
        asyncio.run(loop.run())
    except BaseException as error:
        channels.errors.put((type(error).__name__, str(error), traceback.format_exc()))
        channels.failed.set()
        raise


class _Metrics:
    """Counters since the last metrics push (reset on push) and the window of ``rollout/generated_tok_s``."""

    def __init__(self, stats: RequestStats, pools: Mapping[str, ReplicaPool]):
        self.stats = stats
        self.pools = pools
        self.failed = 0
        self.dropped = 0
        self.redispatched = 0
        self.window_start = time.monotonic()
        self._replica_errors_seen = {(label, r.index): 0 for label, pool in pools.items() for r in pool.replicas}

    def counters(self) -> dict[str, float]:
        """TRL's ``rollout/vllm_retry_total`` and ours, counted since the previous call; per-replica error counts
        ``rollout/replica_errors/<server>@<index>_total`` only where there were some."""
        payload = {
            "rollout/vllm_retry_total": float(self.stats.retries),
            "rollout/failover_total": float(self.stats.failovers),
            "rollout/failed_total": float(self.failed),
            "rollout/dropped_total": float(self.dropped),
            "rollout/redispatched_total": float(self.redispatched),
        }
        self.stats.retries = self.stats.failovers = self.failed = self.dropped = self.redispatched = 0
        for label, pool in self.pools.items():
            for replica in pool.replicas:
                key = (label, replica.index)
                new = replica.errors - self._replica_errors_seen[key]
                if new:
                    payload[f"rollout/replica_errors/{label}@{replica.index}_total"] = float(new)
                    self._replica_errors_seen[key] = replica.errors
        return payload

    def generated(self, tokens: int) -> tuple[float, float]:
        """``(tokens, seconds)`` since the previous sample: the windowed ``rollout/generated_tok_s``."""
        now = time.monotonic()
        window = (float(tokens), now - self.window_start)
        self.window_start = now
        return window


@dataclass(frozen=True)
class _Kept:
    """A student generation kept for re-scoring, with the policy version it was sampled under."""

    generation: Generation
    model_version: int


class _RolloutLoop:
    """The child's asyncio loop: dispatch, collect, enqueue, account."""

    def __init__(self, config: RolloutConfig, rows: Sequence[Mapping[str, Any]], channels: _Channels):
        self.config = config
        self.rows = rows
        self.channels = channels
        self.consecutive_failures = 0
        self.per_teacher_metric = len(config.teacher_urls) > 1
        self.cursor = prompt_cursor(len(rows), config.seed, config.start_index, config.shuffle)
        self.cursor_next = config.start_index  # the prompt id the cursor yields next
        self.skip = set(config.skip_prompt_ids)
        # Redo and re-dispatched prompts, before the cursor: (prompt id, the kept generation when only scoring failed)
        self.pending: collections.deque[tuple[int, _Kept | None]] = collections.deque()
        self.attempts: dict[int, int] = {}  # prompt id -> failed attempts so far
        self.orders: dict[int, np.ndarray] = {}  # epoch -> row order, for redo ids
        self.eos = frozenset(config.eos_token_ids)
        self.finished = 0  # rollouts that ended (delivered or failed), for the slow start

    def beat(self) -> None:
        self.channels.heartbeat.value = time.time()

    def inflight_cap(self) -> int:
        """The in-flight cap: ``max_inflight_tasks``, reached by a slow start from ``initial_inflight_tasks`` that
        grows by one per finished rollout, and with ``max_lookahead`` at most that many minus the samples waiting in
        the queue. A full pipeline from the first moment makes the first samples wait for the whole batch the server
        decodes together; the slow start delivers the first step's samples as soon as a synchronous wave would."""
        cap = self.config.max_inflight_tasks
        if self.config.initial_inflight_tasks is not None:
            cap = min(cap, self.config.initial_inflight_tasks + self.finished)
        if self.config.max_lookahead is not None:
            cap = min(cap, self.config.max_lookahead - self.queued())
        return cap

    def queued(self) -> int:
        """Samples waiting in the queue for the trainer. Where the platform cannot count a queue (macOS) this is 0:
        the queue then adds its size to the lookahead instead of stalling the worker."""
        try:
            return self.channels.samples.qsize()
        except NotImplementedError:
            return 0

    def push_metrics(self, metrics: dict[str, Any]) -> None:
        try:
            self.channels.metrics.put_nowait(metrics)
        except queue.Full:
            pass

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=2 * self.config.max_inflight_tasks)
        stats = RequestStats()
        async with aiohttp.ClientSession(connector=connector) as session:
            common = dict(retry=self.config.retry, session=session, replica_cooldown_s=self.config.replica_cooldown_s)
            self.student = StudentClient(
                self.config.student_replicas(), model=self.config.student_model, stats=stats,
                api_key=self.config.student_api_key, **common
            )
            teacher_keys = self.config.teacher_api_keys or {}
            self.teachers = {}
            for teacher_id in self.config.teacher_urls:
                replicas, key = self.config.teacher_replicas(teacher_id), teacher_keys.get(teacher_id)
                if self.config.teacher_signal(teacher_id) == "hidden":
                    from fastdistill.rollout.hidden import HiddenTeacherClient  # imports torch: only when needed

                    self.teachers[teacher_id] = HiddenTeacherClient(
                        replicas, dtype=self.config.teacher_hidden_dtype, stats=stats, api_key=key, **common)
                else:
                    self.teachers[teacher_id] = TeacherClient(replicas, stats=stats, api_key=key, **common)
            self.servers = {"student": self.student.pool}
            self.servers.update({teacher_id: client.pool for teacher_id, client in self.teachers.items()})
            self.metrics = _Metrics(stats, self.servers)
            await self.generate_loop()

    def next_prompt(self) -> tuple[int, int, _Kept | None] | None:
        """The next ``(prompt_id, row_index, kept generation)`` to dispatch: redo requests and re-dispatched rollouts
        first, then the cursor (skipping ids); None when the cursor reached ``end_index`` and nothing waits."""
        while True:
            try:
                requested = self.channels.redo.get_nowait()
            except queue.Empty:
                break
            for prompt_id in requested:
                if prompt_id >= self.cursor_next:
                    self.skip.add(prompt_id)  # dispatched now: the cursor must not dispatch it again
                self.pending.append((prompt_id, None))
        if self.pending:
            prompt_id, kept = self.pending.popleft()
            epoch, position = divmod(prompt_id, len(self.rows))
            if epoch not in self.orders:
                if len(self.orders) >= 4:  # redo ids cluster in a few recent epochs
                    self.orders.pop(next(iter(self.orders)))
                self.orders[epoch] = epoch_order(len(self.rows), self.config.seed, epoch, self.config.shuffle)
            return prompt_id, int(self.orders[epoch][position]), kept
        end = self.config.end_index
        while True:
            if end is not None and self.cursor_next >= end:
                return None
            prompt_id, row_index = next(self.cursor)
            self.cursor_next = prompt_id + 1
            if prompt_id in self.skip:
                self.skip.discard(prompt_id)
                continue
            if row_index in self.config.skip_rows:
                continue
            if self.config.on_policy is not None and not self.config.on_policy.selects(prompt_id):
                continue  # a mixed run takes this prompt from the teacher cache
            return prompt_id, row_index, None

    def check_servers(self) -> None:
        """Raise :class:`ServerDownError` for a server unreachable past ``server_down_deadline_s``."""
        deadline = self.config.server_down_deadline_s
        for name, pool in self.servers.items():
            down_for = pool.down_for_s()
            if down_for > deadline:
                what = "student" if name == "student" else f"teacher {name!r}"
                raise ServerDownError(
                    f"{what} at {', '.join(pool.urls)} has answered nothing successfully for {down_for:.0f} s, "
                    f"longer than server_down_deadline_s={deadline:g}; last error: {pool.last_error!r}"
                )

    async def generate_loop(self) -> None:
        """Keep ``max_inflight_tasks`` rollouts in flight until stopped; failed rollouts are counted and skipped."""
        inflight: set[asyncio.Task] = set()
        try:
            while not self.channels.stop.is_set():
                self.beat()
                self.check_servers()
                while len(inflight) < self.inflight_cap():
                    dispatch = self.next_prompt()
                    if dispatch is None:  # past end_index: only redo requests can come now
                        break
                    prompt_id, row_index, kept = dispatch
                    task = asyncio.create_task(self.rollout(prompt_id, row_index, kept))
                    task.prompt_id = prompt_id  # type: ignore[attr-defined]
                    task.row_index = row_index  # type: ignore[attr-defined]
                    inflight.add(task)
                if not inflight:  # the queue holds the whole lookahead, or nothing is left: wait
                    await asyncio.sleep(_POLL_S)
                    continue
                done, inflight = await asyncio.wait(inflight, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    await self.deliver(task, len(inflight))
        finally:
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    def is_clipped(self, completion: np.ndarray) -> bool:
        """Whether generation stopped at the length limit rather than on an eos (or pad) token."""
        if self.eos:
            return int(completion[-1]) not in self.eos
        return completion.shape[0] >= self.config.max_tokens

    async def rollout(
        self, prompt_id: int, row_index: int, kept: _Kept | None = None
    ) -> tuple[RolloutSample, dict[str, Any]]:
        """Generate (unless ``kept`` holds the generation of an attempt whose scoring failed) and score one row.

        Returns the sample and its metrics (seconds, tokens). When the teacher is unavailable the raised
        :class:`VLLMUnavailableError` carries the generation (``.kept``), so that a re-dispatch only scores."""
        row = self.rows[row_index]
        teacher_id = row["teacher_id"]
        started = time.monotonic()
        if kept is None:
            try:
                generation, model_version = await generate_with_adapter(
                    self.student,
                    row["prompt_ids"],
                    current_version=lambda: int(self.channels.model_version.value),
                    model_for_version=self.config.student_model_for_version,
                    max_tokens=self.config.max_tokens,
                    temperature=self.config.temperature,
                    top_p=self.config.top_p,
                    top_k=self.config.top_k,
                    min_p=self.config.min_p,
                    repetition_penalty=self.config.repetition_penalty,
                )
            except VLLMError as error:
                error.server = "student"  # type: ignore[attr-defined]
                raise
            kept = _Kept(generation, model_version)
        generation, model_version = kept.generation, kept.model_version
        scoring_started = time.monotonic()
        try:
            if self.config.teacher_signal(teacher_id) == "hidden":
                scores = await self.teachers[teacher_id].score(row["prompt_ids"], generation.token_ids)
            else:
                scores = await self.teachers[teacher_id].score(
                    row["prompt_ids"], generation.token_ids, top_k=self.config.teacher_top_k
                )
        except VLLMError as error:
            error.server = f"teacher {teacher_id}"  # type: ignore[attr-defined]
            if isinstance(error, VLLMUnavailableError):
                error.kept = kept  # type: ignore[attr-defined]
            raise
        finished = time.monotonic()
        completion_length = generation.token_ids.shape[0]
        sample = RolloutSample.assemble(row["prompt_ids"], generation, scores, model_version=model_version,
                                        teacher_id=teacher_id, prompt_id=prompt_id, dataset_index=row_index,
                                        prompt=row["prompt"])
        metrics: dict[str, Any] = {
            "rollout/duration_s": finished - started,
            "rollout/score_s": finished - scoring_started,
            "completions/mean_length": float(completion_length),
            "completions/max_length": float(completion_length),
            "completions/min_length": float(completion_length),
        }
        if completion_length:
            metrics["completions/clipped_ratio"] = float(self.is_clipped(generation.token_ids))
        if self.per_teacher_metric:
            metrics[f"teacher_score_s/{teacher_id}"] = finished - scoring_started
        return sample, metrics

    async def deliver(self, task: asyncio.Task, inflight: int) -> None:
        """Enqueue a finished rollout, or count it as failed when it raised a :class:`VLLMError`.

        A rollout failed by an unavailable server is re-dispatched (up to ``max_rollout_attempts``). Any other
        exception, or ``max_consecutive_failures`` rejected or malformed rollouts in a row, is fatal: it propagates
        and ends the child."""
        self.finished += 1
        error = task.exception()
        prompt_id: int = task.prompt_id  # type: ignore[attr-defined]
        if isinstance(error, VLLMError):
            self.metrics.failed += 1
            logger.warning("rollout of prompt %d failed: %s", prompt_id, error)
            attempts = self.attempts.get(prompt_id, 0) + 1
            if isinstance(error, VLLMUnavailableError) and attempts < self.config.max_rollout_attempts:
                self.attempts[prompt_id] = attempts
                self.pending.append((prompt_id, getattr(error, "kept", None)))  # keep a generation that succeeded
                self.metrics.redispatched += 1
            else:
                self.attempts.pop(prompt_id, None)
                self.metrics.dropped += 1
                await self.put(self.dropped(prompt_id, task.row_index, error))  # type: ignore[attr-defined]
            if not isinstance(error, VLLMUnavailableError):
                self.consecutive_failures += 1
            self.push_metrics({**self.metrics.counters(), "rollout/inflight": float(inflight)})
            if self.consecutive_failures >= self.config.max_consecutive_failures:
                raise RuntimeError(
                    f"{self.consecutive_failures} rollouts in a row were rejected or answered with a malformed "
                    f"body; last: {error}"
                ) from error
            return
        if error is not None:
            raise error
        self.consecutive_failures = 0
        self.attempts.pop(prompt_id, None)
        sample, metrics = task.result()
        backpressure_s = await self.put(sample)
        if backpressure_s is None:
            return
        metrics.update(self.metrics.counters())
        metrics["rollout/generated_tok_s"] = self.metrics.generated(int(sample.teacher_topk_ids.shape[0]))
        metrics.update({"rollout/inflight": float(inflight), "rollout/backpressure_s": backpressure_s})
        self.push_metrics(metrics)

    def dropped(self, prompt_id: int, row_index: int, error: VLLMError) -> DroppedPrompt:
        """The notice of a prompt given up on after ``error``."""
        if isinstance(error, VLLMUnavailableError):
            reason = drop_reasons.UNAVAILABLE
            message = f"{self.config.max_rollout_attempts} attempts failed; last: {error}"
        else:
            reason = drop_reasons.REJECTED
            message = getattr(error, "server_message", None) or str(error)
        return DroppedPrompt(prompt_id=prompt_id, dataset_index=row_index, reason=reason, message=message,
                             server=getattr(error, "server", None))

    async def put(self, sample: RolloutSample | DroppedPrompt) -> float | None:
        """Put ``sample`` (or a drop notice) into the bounded queue, beating while it is full. Returns the seconds
        waited, or None when a stop request came first (the sample is dropped)."""
        waiting_since = time.monotonic()
        while True:
            if isinstance(sample, RolloutSample):
                sample.enqueued_at = time.time()
            try:
                self.channels.samples.put_nowait(sample)
                return time.monotonic() - waiting_since
            except queue.Full:
                if self.channels.stop.is_set():
                    return None
                self.beat()
                await asyncio.sleep(_POLL_S)
