"""Where rank 0 gets scored samples: the rollout worker's queue (with staleness handling), synchronous waves, or a
fixed list (tests and offline replays).

A source's ``next(model_version)`` returns a :class:`~fastdistill.rollout.RolloutSample` to train, or a
:class:`~fastdistill.rollout.dropped.DroppedPrompt` for a prompt the rollout gave up on, and keeps the queue and
staleness metrics under TRL 1.16's names (``sample/staleness_mean``, ``sample/dropped_stale_total``, …). Under
``stale_policy="drop"`` a sample older than ``max_staleness`` versions is dropped and, when the worker supports it,
its prompt is sent back to be generated again, so that every prompt is still trained exactly once.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Iterable, Iterator
from typing import Any

from fastdistill.rollout import OnPolicyShare, RolloutSample, VLLMError, VLLMUnavailableError
from fastdistill.rollout.dropped import REJECTED, UNAVAILABLE, DroppedPrompt
from fastdistill.train.collector import SourceExhausted

__all__ = ["CacheSource", "ListSource", "MixedSource", "SourceExhausted", "SynchronousSource", "WorkerSource"]

logger = logging.getLogger(__name__)


class ListSource:
    """Samples (and drop notices) from an iterable, in order (tests and offline replays). Never stale."""

    def __init__(self, samples: Iterable[RolloutSample | DroppedPrompt]):
        self._samples: Iterator[RolloutSample | DroppedPrompt] = iter(samples)
        self.metrics: dict[str, Any] = {}
        self.wait_s = 0.0

    def next(self, model_version: int) -> RolloutSample | DroppedPrompt:
        try:
            return next(self._samples)
        except StopIteration as error:
            raise SourceExhausted from error

    def drain_worker_metrics(self) -> list[dict[str, float]]:
        return []


class CacheSource(ListSource):
    """Rows of an offline teacher cache (:class:`~fastdistill.cache.TeacherCache`), visited epoch after epoch in the
    rollout worker's order (:func:`~fastdistill.rollout.prompt_cursor`: ``seed``, ``shuffle``) from prompt
    ``start_index`` up to ``end_index`` (None: endless), skipping ``skip_prompt_ids`` (prompts a resumed run already
    trained). Each sample carries its ``prompt_id`` and ``teacher_id``; rows are read from the memory-mapped shards
    only when taken."""

    def __init__(self, cache: Any, *, seed: int, shuffle: bool, start_index: int, end_index: int | None,
                 skip_prompt_ids: frozenset[int], teacher_id: str, on_policy: OnPolicyShare | None = None):
        import dataclasses

        from fastdistill.rollout import prompt_cursor

        if len(cache) == 0:
            raise ValueError("the teacher cache holds no rows")
        cursor: Iterator[tuple[int, int]] = prompt_cursor(len(cache), seed, start_index, shuffle)
        if end_index is not None:
            cursor = itertools.takewhile(lambda item: item[0] < end_index, cursor)
        cursor = ((prompt_id, row) for prompt_id, row in cursor if prompt_id not in skip_prompt_ids and not (
            on_policy is not None and on_policy.selects(prompt_id)))
        super().__init__(dataclasses.replace(cache[row], prompt_id=prompt_id, teacher_id=teacher_id)
                         for prompt_id, row in cursor)


class MixedSource:
    """GKD's ``lmbda``: the prompt ids ``share`` selects come on-policy from the rollout worker (``online``, a
    :class:`WorkerSource`), the others from the teacher cache (``cached``, a :class:`CacheSource` that skips the
    on-policy ids). ``next`` takes from the online source while it has given fewer samples than the share selects among
    as many prompt ids from ``first_prompt`` (the resume point) on, so every stretch of samples (a step's) holds its
    share, and from the other once one runs dry. Logs ``sample/on_policy_frac`` (the share of on-policy samples)."""

    def __init__(self, online: Any, cached: CacheSource, share: OnPolicyShare, first_prompt: int = 0):
        self.online, self.cached, self.share, self.first_prompt = online, cached, share, first_prompt
        self.taken = self.online_taken = 0
        self._dry: set[int] = set()
        self._fractions: list[tuple[float, float]] = []

    def next(self, model_version: int) -> RolloutSample | DroppedPrompt:
        first = self.first_prompt
        want_online = self.online_taken < self.share.count(first + self.taken + 1) - self.share.count(first)
        for source in ((self.online, self.cached) if want_online else (self.cached, self.online)):
            if id(source) in self._dry:
                continue
            try:
                item = source.next(model_version)
            except SourceExhausted:
                self._dry.add(id(source))
                continue
            self.taken += 1
            self.online_taken += source is self.online
            self._fractions.append((float(source is self.online), 1.0))
            return item
        raise SourceExhausted

    @property
    def wait_s(self) -> float:
        return self.online.wait_s + self.cached.wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:  # the trainer resets it after every step
        self.online.wait_s = value
        self.cached.wait_s = 0.0

    @property
    def metrics(self) -> dict[str, list[Any]]:
        merged: dict[str, list[Any]] = {key: list(values) for key, values in self.online.metrics.items()}
        if self._fractions:
            merged["sample/on_policy_frac"] = list(self._fractions)
        return merged

    @metrics.setter
    def metrics(self, value: dict[str, list[Any]]) -> None:  # the trainer clears it after every step
        self.online.metrics = value
        self._fractions = []

    @property
    def dropped_stale_total(self) -> int:
        return getattr(self.online, "dropped_stale_total", 0)

    def drain_worker_metrics(self) -> list[dict[str, float]]:
        return self.online.drain_worker_metrics()


class WorkerSource:
    """Samples from a :class:`~fastdistill.rollout.RolloutWorker` queue on rank 0.

    ``next`` blocks until a usable sample (or a drop notice) arrives, checking the worker's health every ``poll_s``
    seconds (a dead or hung worker raises). ``wait_s`` accumulates the seconds spent blocked on an empty queue.
    """

    def __init__(
        self,
        worker: Any,
        *,
        max_staleness: int,
        stale_policy: str,
        heartbeat_stale_after_s: float,
        poll_s: float = 1.0,
    ):
        self.worker = worker
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.heartbeat_stale_after_s = heartbeat_stale_after_s
        self.poll_s = poll_s
        self.metrics: dict[str, list[Any]] = {}
        self.wait_s = 0.0
        self.dropped_stale_total = 0

    def _metric(self, key: str, value: Any) -> None:
        self.metrics.setdefault(key, []).append(value)

    def next(self, model_version: int) -> RolloutSample | DroppedPrompt:
        while True:
            sample = self._get()
            if isinstance(sample, DroppedPrompt):
                return sample
            staleness = model_version - sample.model_version
            if staleness > self.max_staleness and self.stale_policy == "drop":
                self.dropped_stale_total += 1
                self._metric("sample/dropped_stale_total", 1.0)
                redo = getattr(self.worker, "redo", None)
                if redo is not None:
                    redo([sample.prompt_id])
                continue
            self._metric("sample/staleness_mean", float(staleness))
            self._metric("sample/staleness_max", float(staleness))
            if sample.enqueued_at is not None:
                self._metric("sample/time_in_queue_s", max(0.0, time.time() - sample.enqueued_at))
            return sample

    def _get(self) -> RolloutSample | DroppedPrompt:
        started = time.perf_counter()
        try:
            while True:
                try:
                    sample = self.worker.samples.get(timeout=self.poll_s)
                    break
                except queue.Empty:
                    self.worker.check_health(self.heartbeat_stale_after_s)
        finally:
            self.wait_s += time.perf_counter() - started
        try:
            self._metric("sample/rollout_queue_size", float(self.worker.samples.qsize()))
        except NotImplementedError:  # macOS queues cannot count
            pass
        return sample

    def drain_worker_metrics(self) -> list[dict[str, float]]:
        """Everything the worker pushed to its metrics queue since the last call."""
        drained = []
        while True:
            try:
                drained.append(self.worker.metrics_queue.get_nowait())
            except queue.Empty:
                return drained


class SynchronousSource:
    """``async_mode=False``: rollouts happen only between optimizer steps, with the weights of the current version.

    ``next`` serves samples from the current wave; when it is empty it generates and scores the next ``wave_size``
    prompts of the cursor (all in flight at once, through the same clients as the worker) and stamps them with the
    trainer's version. With the fixed-count batcher a wave is exactly one step, so nothing is stale and nothing is
    wasted; generation and training simply never overlap (the baseline the asynchronous pipeline is measured
    against). A prompt whose request a server refuses, or that stays unavailable through the clients' retries, comes
    out as a :class:`DroppedPrompt`; the cursor stops at ``rollout_config.end_index`` (then :class:`SourceExhausted`).
    """

    def __init__(self, rows: list[dict[str, Any]], rollout_config: Any, wave_size: int):
        import asyncio

        from fastdistill.rollout import prompt_cursor

        self.rows = rows
        self.config = rollout_config
        self.wave_size = wave_size
        end = rollout_config.end_index
        self.cursor = (
            (prompt_id, row) for prompt_id, row in prompt_cursor(len(rows), rollout_config.seed,
                                                                 rollout_config.start_index, rollout_config.shuffle)
            if prompt_id not in rollout_config.skip_prompt_ids and row not in rollout_config.skip_rows
        )
        if end is not None:
            self.cursor = itertools.takewhile(lambda item: item[0] < end, self.cursor)
        self.wave: list[RolloutSample | DroppedPrompt] = []
        self.metrics: dict[str, list[Any]] = {}
        self.wait_s = 0.0
        # One event loop and one set of clients for the whole run: their connections are kept alive between waves,
        # as the worker's are, so the baseline pays no per-step connection setup.
        self._loop = asyncio.new_event_loop()
        self._clients: tuple[Any, dict[str, Any]] | None = None

    def next(self, model_version: int) -> RolloutSample | DroppedPrompt:
        if not self.wave:
            batch = list(itertools.islice(self.cursor, self.wave_size))
            if not batch:
                raise SourceExhausted
            started = time.perf_counter()
            self.wave = self._loop.run_until_complete(self._generate(batch, model_version))
            self.wait_s += time.perf_counter() - started
        sample = self.wave.pop(0)
        if isinstance(sample, DroppedPrompt):
            return sample
        self.metrics.setdefault("sample/staleness_mean", []).append(float(model_version - sample.model_version))
        return sample

    def close(self) -> None:
        """Close the clients' connections and the event loop."""
        if self._loop.is_closed():
            return
        if self._clients is not None:
            student, teachers = self._clients
            for client in (student, *teachers.values()):
                self._loop.run_until_complete(client.close())
            self._clients = None
        self._loop.close()

    async def _generate(self, batch: list[tuple[int, int]], model_version: int) -> list[RolloutSample | DroppedPrompt]:
        import asyncio

        from fastdistill.rollout import StudentClient, TeacherClient
        from fastdistill.rollout.adapters import generate_with_adapter

        config = self.config
        if self._clients is None:
            keys = config.teacher_api_keys or {}
            teachers = {tid: TeacherClient(urls, retry=config.retry, api_key=keys.get(tid))
                        for tid, urls in config.teacher_urls.items()}
            self._clients = (StudentClient(config.student_url, retry=config.retry, api_key=config.student_api_key),
                             teachers)
        student, teachers = self._clients

        async def one(prompt_id: int, index: int) -> RolloutSample | DroppedPrompt:
            row = self.rows[index]
            teacher_id = row["teacher_id"] if len(teachers) > 1 else next(iter(teachers))
            server = "student"
            try:
                generation, version = await generate_with_adapter(
                    student, row["prompt_ids"], current_version=lambda: model_version,
                    model_for_version=config.student_model_for_version, max_tokens=config.max_tokens,
                    temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                    repetition_penalty=config.repetition_penalty)
                server = f"teacher {teacher_id}"
                scores = await teachers[teacher_id].score(row["prompt_ids"], generation.token_ids,
                                                          top_k=config.teacher_top_k)
            except VLLMError as error:
                reason = UNAVAILABLE if isinstance(error, VLLMUnavailableError) else REJECTED
                logger.warning("rollout of prompt %d failed: %s", prompt_id, error)
                return DroppedPrompt(prompt_id=prompt_id, dataset_index=index, reason=reason, server=server,
                                     message=getattr(error, "server_message", None) or str(error))
            sample = RolloutSample.assemble(row["prompt_ids"], generation, scores, model_version=version,
                                            teacher_id=teacher_id, prompt_id=prompt_id, dataset_index=index,
                                            prompt=row.get("prompt"))
            sample.enqueued_at = time.time()
            return sample

        return list(await asyncio.gather(*(one(p, i) for p, i in batch)))

    def drain_worker_metrics(self) -> list[dict[str, float]]:
        return []
