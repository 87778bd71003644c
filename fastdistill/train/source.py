"""Where rank 0 gets scored samples: the rollout worker's queue (with staleness handling), synchronous waves, or a
fixed list (tests and offline replays).

A source's ``next(model_version)`` returns a :class:`~fastdistill.rollout.RolloutSample` to train, or a
:class:`~fastdistill.rollout.dropped.DroppedPrompt` for a prompt the rollout gave up on, and keeps the queue and
staleness metrics under TRL 1.16's names (``sample/staleness_mean``, ``sample/dropped_stale_total``, …), counted in
optimizer steps (:class:`~fastdistill.train.staleness.PolicySteps`). Under ``stale_policy="drop"`` a sample more
than ``max_staleness`` steps old is dropped and, when the worker supports it,
its prompt is sent back to be generated again, so that every prompt is still trained exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from fastdistill.errors import SourceExhausted
from fastdistill.rollout import OnPolicyShare, Rollouts, RolloutSample, WorkerExhausted, open_clients, prompt_cursor
from fastdistill.rollout.dispatch import PromptDispatcher
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.prompt_table import routed_table

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
        if len(cache) == 0:
            raise ValueError("the teacher cache holds no rows")
        cursor: Iterator[tuple[int, int]] = prompt_cursor(len(cache), seed, start_index, shuffle)
        # a share annealed to 1 leaves no prompt to the cache past its horizon: end there rather than search forever
        ends = [end for end in (end_index, on_policy.settled_from(on_policy=False) if on_policy else None)
                if end is not None]
        if ends:
            cursor = itertools.takewhile(lambda item: item[0] < min(ends), cursor)
        cursor = ((prompt_id, row) for prompt_id, row in cursor if prompt_id not in skip_prompt_ids and not (
            on_policy is not None and on_policy.selects(prompt_id)))
        super().__init__(dataclasses.replace(cache[row], prompt_id=prompt_id, teacher_id=teacher_id)
                         for prompt_id, row in cursor)


def pad_candidates(sample: RolloutSample, width: int) -> RolloutSample:
    """``sample`` with its candidate arrays padded to ``width`` slots per position with empty slots (id -1, log-prob
    -inf, which every loss ignores); unchanged when already that wide. Raises ValueError when it is wider."""
    have = sample.teacher_topk_ids.shape[1]
    if have == width:
        return sample
    if have > width:
        raise ValueError(f"sample (prompt_id={sample.prompt_id}) has {have} candidate slots per position, more than "
                         f"the {width} of this run")
    extra = ((0, 0), (0, width - have))
    return dataclasses.replace(
        sample, teacher_topk_ids=np.pad(sample.teacher_topk_ids, extra, constant_values=-1),
        teacher_topk_logprobs=np.pad(sample.teacher_topk_logprobs, extra, constant_values=-np.inf))


class MixedSource:
    """GKD's ``lmbda``: the prompt ids ``share`` selects come on-policy from the rollout worker (``online``, a
    :class:`WorkerSource`), the others from the teacher cache (``cached``, a :class:`CacheSource` that skips the
    on-policy ids). ``next`` takes from the online source while it has given fewer samples than the share selects among
    as many prompt ids from ``first_prompt`` (the resume point) on, so every stretch of samples (a step's) holds its
    share, and from the other once one runs dry. Logs ``sample/on_policy_frac`` (the share of on-policy samples).

    ``candidate_width``: every sample is padded to that many candidate slots (:func:`pad_candidates`), so that
    on-policy samples (K + 1 slots) and the rows of a sampled cache (S slots) pack into one row; None: unchanged."""

    def __init__(self, online: Any, cached: CacheSource, share: OnPolicyShare, first_prompt: int = 0,
                 candidate_width: int | None = None):
        self.online, self.cached, self.share, self.first_prompt = online, cached, share, first_prompt
        self.candidate_width = candidate_width
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
            if self.candidate_width is not None and isinstance(item, RolloutSample):
                item = pad_candidates(item, self.candidate_width)
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


def sample_staleness(policy: Any, model_version: int, sample: RolloutSample) -> int:
    """Optimizer steps between the weights that generated ``sample`` and the trainer's: from ``policy``
    (:class:`~fastdistill.train.staleness.PolicySteps`), or ``model_version − sample.model_version`` without one."""
    if policy is not None:
        return policy.staleness(sample.model_version)
    return model_version - sample.model_version


def token_staleness(policy: Any, sample: RolloutSample) -> np.ndarray | None:
    """Each completion token's staleness in optimizer steps (int64 (L,)) from ``sample.token_versions``: the served
    spans' when the rollout has them, else stamped with the trainer's estimate
    (:meth:`~fastdistill.train.staleness.PolicySteps.token_versions`); None without ``policy``."""
    if policy is None:
        return None
    if sample.token_versions is None:
        length = int(sample.teacher_topk_ids.shape[0])
        sample.token_versions = policy.token_versions(sample.model_version, sample.generation_started_at,
                                                      sample.generation_ended_at, length)
    return policy.staleness_array(sample.token_versions)


def record_token_staleness(metrics: dict[str, list[Any]], staleness: np.ndarray | None) -> None:
    """``sample/stale_token_frac`` (the tokens generated by weights at least one optimizer step old) and
    ``sample/token_staleness_mean``, both token-weighted rates over the step."""
    if staleness is None or not staleness.size:
        return
    metrics.setdefault("sample/stale_token_frac", []).append((float((staleness > 0).sum()), float(staleness.size)))
    metrics.setdefault("sample/token_staleness_mean", []).append((float(staleness.sum()), float(staleness.size)))


class WorkerSource:
    """Samples from a :class:`~fastdistill.rollout.RolloutWorker` queue on rank 0.

    ``next`` blocks until a usable sample (or a drop notice) arrives, checking the worker's health every ``poll_s``
    seconds (a dead or hung worker raises). ``wait_s`` accumulates the seconds spent blocked on an empty queue.
    ``policy`` (:class:`~fastdistill.train.staleness.PolicySteps`) gives a sample's staleness in optimizer steps
    and its tokens' (:func:`token_staleness`); without it one version counts as one step (``next``'s
    ``model_version`` minus the sample's). ``staleness_unit``: what the ``max_staleness`` bound reads, the sample's
    staleness at dispatch (``"sample"``) or the mean of its tokens' (``"token"``).
    """

    def __init__(
        self,
        worker: Any,
        *,
        max_staleness: int,
        stale_policy: str,
        heartbeat_stale_after_s: float,
        poll_s: float = 1.0,
        policy: Any = None,
        staleness_unit: str = "sample",
    ):
        self.worker = worker
        self.policy = policy
        self.staleness_unit = staleness_unit
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.heartbeat_stale_after_s = heartbeat_stale_after_s
        self.poll_s = poll_s
        self.metrics: dict[str, list[Any]] = {}
        self.wait_s = 0.0
        self.dropped_stale_total = 0
        self.exhausted = False  # the worker said nothing is left, and no redo is outstanding

    def _metric(self, key: str, value: Any) -> None:
        self.metrics.setdefault(key, []).append(value)

    def next(self, model_version: int) -> RolloutSample | DroppedPrompt:
        while True:
            if self.exhausted:
                raise SourceExhausted
            sample = self._get()
            if isinstance(sample, WorkerExhausted):
                # the stream ends once every child said so after the last redo it was sent
                self.exhausted = self.worker.ended_by(sample)
                continue
            if isinstance(sample, DroppedPrompt):
                return sample
            staleness = sample_staleness(self.policy, model_version, sample)
            tokens = token_staleness(self.policy, sample)
            bound = float(tokens.mean()) if self.staleness_unit == "token" and tokens is not None and tokens.size \
                else staleness
            if bound > self.max_staleness and self.stale_policy == "drop":
                self.dropped_stale_total += 1
                self._metric("sample/dropped_stale_total", 1.0)
                redo = getattr(self.worker, "redo", None)
                if redo is not None:
                    redo([sample.prompt_id])
                continue
            self._metric("sample/staleness_mean", float(staleness))
            self._metric("sample/staleness_max", float(staleness))
            record_token_staleness(self.metrics, tokens)
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
    """``async_mode=False``: rollouts happen only between optimizer steps, with the weights the server serves (the
    current ones with ``weight_sync_steps=1``; with ``k > 1`` the waves between two syncs are up to ``k − 1`` steps
    old, and ``sample/staleness_mean`` says so: ``policy``, as in :class:`WorkerSource`).

    ``next`` serves samples from the current wave; when it is empty it runs the next ``wave_size`` prompts of the
    dispatcher (:class:`~fastdistill.rollout.dispatch.PromptDispatcher`, the worker's order and skips) through the
    one rollout sequence (:class:`~fastdistill.rollout.Rollouts`: every teacher signal, the same failure handling
    as the worker) and stamps them with the trainer's version. A wave is one optimizer step whatever the batcher
    (:attr:`ends_step_with_wave`: the collector ends the window once :attr:`wave_consumed`, flushing what its batcher
    holds), so no sample is trained after a newer weight sync and nothing is regenerated; generation and training
    simply never overlap (the baseline the asynchronous pipeline is measured against). A prompt given up on comes
    out as a :class:`DroppedPrompt`; rollouts that keep failing raise
    :class:`~fastdistill.errors.RolloutsFailingError` as in the worker; when the dispatcher is exhausted,
    :class:`SourceExhausted`.
    """

    def __init__(self, rows: Any, rollout_config: Any, wave_size: int, policy: Any = None):
        self.policy = policy
        self.rows = routed_table(rows, list(rollout_config.teacher_urls))
        self.config = rollout_config
        self.wave_size = wave_size
        self.dispatcher = PromptDispatcher(rollout_config, len(rows))
        self.wave: list[RolloutSample | DroppedPrompt] = []
        self.metrics: dict[str, list[Any]] = {}
        self._worker_metrics: list[dict[str, Any]] = []
        self.wait_s = 0.0
        self._model_version = 0
        # One event loop and one set of clients for the whole run: their connections are kept alive between waves,
        # as the worker's are, so the baseline pays no per-step connection setup.
        self._loop = asyncio.new_event_loop()
        self._rollouts: Any = None

    ends_step_with_wave = True  # the window collector ends a step with each wave (see WindowCollector.collect)

    @property
    def wave_consumed(self) -> bool:
        """Every item of the current wave has been served (the next :meth:`next` generates a new wave)."""
        return not self.wave

    def next(self, model_version: int) -> RolloutSample | DroppedPrompt:
        if not self.wave:
            batch = []
            while len(batch) < self.wave_size and (item := self.dispatcher.next()) is not None:
                batch.append(item[:2])
            if not batch:
                if self._rollouts is not None:
                    self._rollouts.failures.check_any_succeeded()
                raise SourceExhausted
            started = time.perf_counter()
            self._model_version = model_version
            self.wave = self._loop.run_until_complete(self._generate(batch))
            self.wait_s += time.perf_counter() - started
        sample = self.wave.pop(0)
        if isinstance(sample, DroppedPrompt):
            return sample
        staleness = float(sample_staleness(self.policy, model_version, sample))
        record_token_staleness(self.metrics, token_staleness(self.policy, sample))
        self.metrics.setdefault("sample/staleness_mean", []).append(staleness)
        self.metrics.setdefault("sample/staleness_max", []).append(staleness)
        return sample

    def close(self) -> None:
        """Close the clients' connections and the event loop."""
        if self._loop.is_closed():
            return
        if self._rollouts is not None:
            for client in (self._rollouts.student, *self._rollouts.teachers.values()):
                self._loop.run_until_complete(client.close())
            self._rollouts = None
        self._loop.close()

    async def _generate(self, batch: list[tuple[int, int]]) -> list[RolloutSample | DroppedPrompt]:
        if self._rollouts is None:
            student, teachers = open_clients(self.config)
            self._rollouts = Rollouts(self.config, self.rows, student, teachers,
                                      current_version=lambda: self._model_version,
                                      current_step=lambda: 0 if self.policy is None else self.policy.step)
        results = await self._rollouts.wave(batch, on_metrics=self._worker_metrics.append)
        self._worker_metrics.append(self._rollouts.failures.counters())
        for sample in results:
            if isinstance(sample, RolloutSample):
                sample.enqueued_at = time.time()
        return results

    def drain_worker_metrics(self) -> list[dict[str, float]]:
        """The rollouts' metrics (TRL's names, as the worker pushes them) since the last call."""
        drained, self._worker_metrics = self._worker_metrics, []
        return drained
