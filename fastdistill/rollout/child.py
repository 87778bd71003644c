"""The rollout worker's child process: one asyncio loop that keeps the student and teacher servers busy.

It dispatches prompts (:class:`~fastdistill.rollout.dispatch.PromptDispatcher`), runs each rollout through the one
rollout sequence (:class:`~fastdistill.rollout.sequence.Rollouts`), puts samples and drop notices into the bounded
sample queue and metrics into the metrics queue, beats, and stops on request — or by itself when its parent is gone
(a SIGKILLed trainer cannot ask). When nothing is left to dispatch it says so with a :class:`WorkerExhausted` notice.

A worker may run several such children (``rollout_processes``): each dispatches the prompt ids it owns, all put into
the one sample queue, and their in-flight and lookahead caps hold for all of them together
(:class:`~fastdistill.rollout.processes.SharedCounts`).
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

from fastdistill.errors import RolloutsFailingError, VLLMError
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
    """In the sample queue: child ``process`` of the worker has nothing left to dispatch and nothing in flight, after
    processing ``redo_seen`` redo ids. A consumer that sent it exactly that many knows no more samples will come from
    it (:meth:`~fastdistill.rollout.RolloutWorker.ended_by`)."""

    redo_seen: int
    process: int = 0


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
        self.process = getattr(channels, "process", 0)
        self.shared = getattr(channels, "shared", None)  # SharedCounts with several processes, else None
        self.dispatcher = PromptDispatcher(config, len(rows), self.process, config.rollout_processes)
        self.redo_seen = 0
        self.announced_exhausted = False
        self.finished = 0  # rollouts that ended (delivered or failed), for the slow start

    def beat(self) -> None:
        """Write the heartbeat; raise :class:`ParentGone` when the parent died (the child was re-parented)."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            raise ParentGone(f"the parent process {self.parent_pid} is gone; the rollout worker stops")
        self.channels.heartbeat.value = time.time()

    def inflight_cap(self, finished: int | None = None) -> int:
        """The in-flight cap: ``max_inflight_tasks``, reached by a slow start from ``initial_inflight_tasks`` that
        grows by one per finished rollout (``finished``, by default this loop's), and with ``max_lookahead`` at most
        that many minus the samples waiting in the queue. A full pipeline from the first moment makes the first
        samples wait for the whole batch the server decodes together; the slow start delivers the first step's
        samples as soon as a synchronous wave would. With several processes it caps all of them together."""
        cap = self.config.max_inflight_tasks
        if self.config.initial_inflight_tasks is not None:
            cap = min(cap, self.config.initial_inflight_tasks + (self.finished if finished is None else finished))
        if self.config.max_lookahead is not None:
            cap = min(cap, self.config.max_lookahead - self.queued())
        return cap

    def room(self, inflight: int) -> int:
        """How many rollouts to dispatch now, with ``inflight`` of this process in flight (the others' count too
        with several processes: :meth:`SharedCounts.reserve`)."""
        if self.shared is None:
            return self.inflight_cap() - inflight
        return self.shared.reserve(self.process, inflight, not self.dispatcher.exhausted, self.inflight_cap)

    def check_run_failing(self) -> bool:
        """At the end of this process's prompts: raise :class:`RolloutsFailingError` when the whole run dropped
        prompts and scored none (with several processes: once every process is idle, on all of their counts).
        False when the other processes' counts could not be read this time (ask again)."""
        failures = self.rollouts.failures
        if self.shared is None:
            failures.check_any_succeeded()
            return True
        settled = self.shared.settle(self.process, failures.samples_total, failures.dropped_total)
        if settled is None:
            return False
        idle, scored, dropped = settled
        if idle and scored == 0 and dropped:
            error = failures.last_error  # this process's, when it dropped any
            last = f"; last ({getattr(error, 'server', None) or 'a server'}): {error}" if error is not None else ""
            raise RolloutsFailingError(f"every rollout of this run failed ({dropped} prompts dropped, none scored)"
                                       f"{last}") from error
        return True

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
                                     current_version=lambda: int(self.channels.model_version.value),
                                     current_step=lambda: int(self.channels.trained_steps.value))
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
                for _ in range(self.room(len(inflight))):
                    dispatch = self.dispatcher.next()
                    if dispatch is None:  # past the cursor's end: only redo requests can come now
                        break
                    prompt_id, row_index, kept = dispatch
                    task = asyncio.create_task(self.rollouts.rollout(prompt_id, row_index, kept))
                    task.prompt_id, task.row_index = prompt_id, row_index  # type: ignore[attr-defined]
                    inflight.add(task)
                self.publish(len(inflight))
                if not inflight:
                    if self.dispatcher.exhausted and not self.announced_exhausted and self.check_run_failing():
                        if await self.put(WorkerExhausted(self.redo_seen, self.process)) is None:
                            return
                        self.announced_exhausted = True
                    await asyncio.sleep(POLL_S)  # the queue holds the whole lookahead, or nothing is left: wait
                    continue
                done, inflight = await asyncio.wait(inflight, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    await self.deliver(task, len(inflight))
                self.publish(len(inflight))
        finally:
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    def publish(self, inflight: int) -> None:
        """Tell the other processes this one's rollouts in flight and finished (nothing to do alone)."""
        if self.shared is not None:
            self.shared.publish(self.process, inflight, self.finished)

    async def deliver(self, task: asyncio.Task, inflight: int) -> None:
        """Enqueue a finished rollout, or hand a failed one to :class:`~fastdistill.rollout.sequence.RolloutFailures`
        (re-dispatch or drop notice). Any exception other than a :class:`VLLMError`, and the failures' own stop,
        propagate and end the child."""
        self.finished += 1
        error = task.exception()
        prompt_id: int = task.prompt_id  # type: ignore[attr-defined]
        failures = self.rollouts.failures
        if self.shared is not None:
            inflight = self.shared.total_inflight()  # rollout/inflight is the worker's, all processes together
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
        sample, metrics = task.result()
        if isinstance(sample, DroppedPrompt):  # a completion a cross-tokenizer teacher cannot score: counted
            await self.put(sample)
            self.push_metrics({**self.counters.counters(), **failures.counters(), "rollout/inflight": float(inflight)})
            return
        failures.succeeded(prompt_id)
        backpressure_s = await self.put(sample)
        if backpressure_s is None:
            return
        metrics.update(self.counters.counters())
        metrics.update(failures.counters())
        tokens, seconds = self.counters.generated(int(sample.teacher_topk_ids.shape[0]))
        # Σ tokens / Σ seconds over every process's windows is the worker's rate when each process's seconds count
        # 1/P: the P processes' windows cover the same wall time
        metrics["rollout/generated_tok_s"] = (tokens, seconds / self.config.rollout_processes)
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
        channels.errors.put((type(error).__name__, str(error), traceback.format_exc(), getattr(channels, "process", 0)))
        channels.failed.set()
        raise
