"""The rollout worker's child process: one asyncio loop that keeps the student and teacher servers busy.

It dispatches prompts (:class:`~fastdistill.rollout.dispatch.PromptDispatcher`), runs each rollout through the one
rollout sequence (:class:`~fastdistill.rollout.sequence.Rollouts`), puts samples and drop notices into the bounded
sample queue and metrics into the metrics queue, beats, and stops on request — or by itself when its parent is gone
(a SIGKILLed trainer cannot ask). When nothing is left to dispatch it says so with a :class:`WorkerExhausted` notice.
"""

from __future__ import annotations

import asyncio
import os
import queue
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdistill.errors import VLLMError
from fastdistill.http_client import new_session
from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.dispatch import PromptDispatcher
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.http import RequestStats
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.rollout.sample import RolloutSample
from fastdistill.rollout.sequence import Redispatch, Rollouts, open_clients

POLL_S = 0.05  # how often the loop wakes up to beat, check stop and its parent, and retry a full queue, in seconds


@dataclass(frozen=True)
class WorkerExhausted:
    """In the sample queue: the worker has nothing left to dispatch and nothing in flight, after processing
    ``redo_seen`` redo ids. The consumer that sent exactly that many knows no more samples will come."""

    redo_seen: int


class RolloutCounters:
    """Request counters since the last metrics push (retries, failovers, per-replica errors) and the window of
    ``rollout/generated_tok_s``."""

    def __init__(self, stats: RequestStats, pools: Mapping[str, ReplicaPool]):
        self.stats = stats
        self.pools = pools
        self.window_start = time.monotonic()
        self._replica_errors_seen = {(label, r.index): 0 for label, pool in pools.items() for r in pool.replicas}

    def counters(self) -> dict[str, float]:
        """TRL's ``rollout/vllm_retry_total`` and ``rollout/failover_total``, counted since the previous call;
        ``rollout/replica_errors/<server>@<index>_total`` only where there were some."""
        payload = {"rollout/vllm_retry_total": float(self.stats.retries),
                   "rollout/failover_total": float(self.stats.failovers)}
        self.stats.retries = self.stats.failovers = 0
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


class ParentGone(RuntimeError):
    """The process that started the worker exited without stopping it."""


class RolloutLoop:
    """The child's asyncio loop: dispatch, collect, enqueue, account."""

    def __init__(self, config: RolloutConfig, rows: Sequence[Mapping[str, Any]], channels: Any,
                 parent_pid: int | None = None):
        self.config = config
        self.rows = rows
        self.channels = channels
        self.parent_pid = parent_pid
        self.dispatcher = PromptDispatcher(config, len(rows))
        self.redo_seen = 0
        self.announced_exhausted = False
        self.finished = 0  # rollouts that ended (delivered or failed), for the slow start

    def beat(self) -> None:
        """Write the heartbeat; raise :class:`ParentGone` when the parent died (the child was re-parented)."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            raise ParentGone(f"the parent process {self.parent_pid} is gone; the rollout worker stops")
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
        stats = RequestStats()
        async with new_session(connection_limit=2 * self.config.max_inflight_tasks) as session:
            student, teachers = open_clients(self.config, session=session, stats=stats)
            self.rollouts = Rollouts(self.config, self.rows, student, teachers,
                                     current_version=lambda: int(self.channels.model_version.value))
            self.counters = RolloutCounters(stats, self.rollouts.servers)
            await self.generate_loop()

    def take_redo(self) -> None:
        while True:
            try:
                requested = self.channels.redo.get_nowait()
            except queue.Empty:
                return
            self.dispatcher.redo(requested)
            self.redo_seen += len(requested)
            self.announced_exhausted = False

    async def generate_loop(self) -> None:
        """Keep ``max_inflight_tasks`` rollouts in flight until stopped; failed rollouts are counted and re-dispatched
        or dropped; a :class:`WorkerExhausted` notice goes out whenever nothing is left to do."""
        inflight: set[asyncio.Task] = set()
        try:
            while not self.channels.stop.is_set():
                self.beat()
                self.rollouts.check_servers()
                self.take_redo()
                while len(inflight) < self.inflight_cap():
                    dispatch = self.dispatcher.next()
                    if dispatch is None:  # past the cursor's end: only redo requests can come now
                        break
                    prompt_id, row_index, kept = dispatch
                    task = asyncio.create_task(self.rollouts.rollout(prompt_id, row_index, kept))
                    task.prompt_id, task.row_index = prompt_id, row_index  # type: ignore[attr-defined]
                    inflight.add(task)
                if not inflight:
                    if self.dispatcher.exhausted and not self.announced_exhausted:
                        self.rollouts.failures.check_any_succeeded()
                        if await self.put(WorkerExhausted(self.redo_seen)) is None:
                            return
                        self.announced_exhausted = True
                    await asyncio.sleep(POLL_S)  # the queue holds the whole lookahead, or nothing is left: wait
                    continue
                done, inflight = await asyncio.wait(inflight, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    await self.deliver(task, len(inflight))
        finally:
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    async def deliver(self, task: asyncio.Task, inflight: int) -> None:
        """Enqueue a finished rollout, or hand a failed one to :class:`~fastdistill.rollout.sequence.RolloutFailures`
        (re-dispatch or drop notice). Any exception other than a :class:`VLLMError`, and the failures' own stop,
        propagate and end the child."""
        self.finished += 1
        error = task.exception()
        prompt_id: int = task.prompt_id  # type: ignore[attr-defined]
        failures = self.rollouts.failures
        if isinstance(error, VLLMError):
            decision = failures.failed_with(prompt_id, task.row_index, error)  # type: ignore[attr-defined]
            if isinstance(decision, Redispatch):
                self.dispatcher.again(prompt_id, decision.kept)
            else:
                await self.put(decision)
            self.push_metrics({**self.counters.counters(), **failures.counters(), "rollout/inflight": float(inflight)})
            return
        if error is not None:
            raise error
        failures.succeeded(prompt_id)
        sample, metrics = task.result()
        backpressure_s = await self.put(sample)
        if backpressure_s is None:
            return
        metrics.update(self.counters.counters())
        metrics.update(failures.counters())
        metrics["rollout/generated_tok_s"] = self.counters.generated(int(sample.teacher_topk_ids.shape[0]))
        metrics.update({"rollout/inflight": float(inflight), "rollout/backpressure_s": backpressure_s})
        self.push_metrics(metrics)

    async def put(self, item: RolloutSample | DroppedPrompt | WorkerExhausted) -> float | None:
        """Put ``item`` into the bounded queue, beating while it is full. Returns the seconds waited, or None when a
        stop request came first (the item is dropped)."""
        waiting_since = time.monotonic()
        while True:
            if isinstance(item, RolloutSample):
                item.enqueued_at = time.time()
            try:
                self.channels.samples.put_nowait(item)
                return time.monotonic() - waiting_since
            except queue.Full:
                if self.channels.stop.is_set():
                    return None
                self.beat()
                await asyncio.sleep(POLL_S)


def child_main(config: RolloutConfig, rows: Sequence[Mapping[str, Any]], channels: Any, parent_pid: int) -> None:
    """Child entry point: run the loop; on failure report (type, message, traceback) and exit with code 1."""
    # On stop the parent may not drain the queues; do not block the exit on flushing them.
    channels.samples.cancel_join_thread()
    channels.metrics.cancel_join_thread()
    channels.redo.cancel_join_thread()
    try:
        loop = RolloutLoop(config, rows, channels, parent_pid)
        # a start-up slower than the heartbeat limit (imports on a loaded machine) must not read as a hang
        loop.beat()
        channels.ready.set()
        asyncio.run(loop.run())
    except ParentGone:
        return  # nobody is left to report to
    except BaseException as error:
        channels.errors.put((type(error).__name__, str(error), traceback.format_exc()))
        channels.failed.set()
        raise
