"""One rollout, written once: generate with the student, score with the row's teacher by its signal, assemble.

The rollout worker's child loop, the synchronous source (``async_mode=False``) and held-out evaluation all run
rollouts through :class:`Rollouts`; the teacher clients of every signal are built by :func:`teacher_client` (and
:func:`open_clients`). What happens to a failed rollout is decided in one place too, :class:`RolloutFailures`:

- a server that stayed unavailable through the client's retries: the prompt is dispatched again (only the scoring
  when the generation succeeded), up to ``max_rollout_attempts`` attempts, then dropped as ``unavailable``;
- a server that rejected the request (a 4xx other than 429) or answered a malformed body: the prompt is dropped as
  ``rejected``; ``max_consecutive_failures`` such drops in a row (a misconfiguration, not one bad prompt) raise
  :class:`~fastdistill.errors.RolloutsFailingError` with the server's last error;
- a server with no successful answer for ``server_down_deadline_s``: :class:`~fastdistill.errors.ServerDownError`;
- a completion a teacher with its own tokenizer cannot score (:class:`~fastdistill.rollout.cross_scoring.
  UnscorableRollout`: not valid UTF-8, not round-tripped by the teacher's tokenizer, too long for the teacher):
  dropped as ``unaligned`` / ``too_long`` at once. That is a property of the completion, not of a server, so it
  neither counts towards ``max_consecutive_failures`` nor resets the count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from fastdistill.errors import ConfigError, RolloutsFailingError, ServerDownError, VLLMError, VLLMUnavailableError
from fastdistill.http_client import new_session
from fastdistill.rollout import dropped as drop_reasons
from fastdistill.rollout.adapters import generate_with_adapter
from fastdistill.rollout.client import Generation, StudentClient, TeacherClient
from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.cross_scoring import UnscorableRollout, cross_tokenizer_scorers
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.http import RequestStats, RetryPolicy
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.rollout.sample import RolloutSample, token_versions_from_spans

logger = logging.getLogger(__name__)


def teacher_client(signal: str, urls: str | Sequence[str], *, hidden_dtype: str = "bfloat16", **kwargs: Any) -> Any:
    """The client of a teacher server by its signal: :class:`~fastdistill.rollout.TeacherClient` for ``"topk"``
    (``prompt_logprobs``), :class:`~fastdistill.rollout.hidden.HiddenTeacherClient` for ``"hidden"`` (a ``fastdistill
    serve-teacher --signal hidden`` server; imports torch, so only when asked for). ``kwargs`` go to the client
    (``api_key``, ``retry``, ``session``, ``stats``, ``replica_cooldown_s``)."""
    if signal == "hidden":
        from fastdistill.rollout.hidden import HiddenTeacherClient

        return HiddenTeacherClient(urls, dtype=hidden_dtype, **kwargs)
    if signal != "topk":
        raise ValueError(f"unknown teacher signal {signal!r}")
    return TeacherClient(urls, **kwargs)


def open_clients(config: RolloutConfig, *, session: aiohttp.ClientSession | None = None,
                 stats: RequestStats | None = None) -> tuple[StudentClient, dict[str, Any]]:
    """The student client and one client per teacher (by its signal) for ``config``'s servers, keys and retries."""
    common: dict[str, Any] = dict(retry=config.retry, session=session, replica_cooldown_s=config.replica_cooldown_s,
                                  stats=stats)
    student = StudentClient(config.student_replicas(), model=config.student_model, api_key=config.student_api_key,
                            route=config.student_route, **common)
    keys = config.teacher_api_keys or {}
    teachers = {teacher_id: teacher_client(config.teacher_signal(teacher_id), config.teacher_replicas(teacher_id),
                                           hidden_dtype=config.teacher_hidden_dtype, api_key=keys.get(teacher_id),
                                           **common)
                for teacher_id in config.teacher_urls}
    return student, teachers


def is_clipped(completion: Any, eos_token_ids: frozenset[int], max_tokens: int) -> bool:
    """Whether generation of ``completion`` (token ids, (L,), L >= 1) stopped at the length limit rather than on an
    eos (or pad) token; without eos ids, whether it has ``max_tokens`` tokens."""
    if eos_token_ids:
        return int(completion[-1]) not in eos_token_ids
    return completion.shape[0] >= max_tokens


def student_queries(config: RolloutConfig) -> dict[str, Any]:
    """The generation keywords that ask the student server for ``config``'s query ids (none without queries)."""
    if config.student_queries == "none":
        return {}
    return {"queries": config.student_queries, "num_queries": config.num_student_queries}


@dataclass(frozen=True)
class Kept:
    """A student generation kept for re-scoring, with the policy version it was sampled under, its request's
    ``max_tokens`` and the wall-clock seconds (``time.time()``) its request was sent and answered."""

    generation: Generation
    model_version: int
    max_tokens: int
    started_at: float | None = None
    ended_at: float | None = None


@dataclass(frozen=True)
class Redispatch:
    """A failed rollout to dispatch again; ``kept`` holds its generation when only the scoring failed."""

    prompt_id: int
    row_index: int
    kept: Kept | None


class RolloutFailures:
    """What a failed rollout becomes (a :class:`Redispatch` or a :class:`DroppedPrompt`), and the counters
    ``rollout/failed_total``, ``rollout/dropped_total``, ``rollout/redispatched_total`` since the last
    :meth:`counters` call. Raises :class:`RolloutsFailingError` at ``max_consecutive_failures`` rejections in a row."""

    def __init__(self, config: RolloutConfig):
        self.config = config
        self.attempts: dict[int, int] = {}  # prompt id -> failed attempts so far
        self.consecutive = 0
        self.failed = self.dropped = self.redispatched = 0
        self.samples_total = self.dropped_total = 0  # over the whole run
        self.last_error: Exception | None = None

    def succeeded(self, prompt_id: int) -> None:
        self.consecutive = 0
        self.samples_total += 1
        self.attempts.pop(prompt_id, None)

    def check_any_succeeded(self) -> None:
        """At the end of the prompts: raise :class:`RolloutsFailingError` when rollouts were dropped and none ever
        succeeded (a run shorter than ``max_consecutive_failures`` whose every rollout fails must not end as if it
        had trained)."""
        if self.samples_total == 0 and self.dropped_total:
            error = self.last_error
            raise RolloutsFailingError(
                f"every rollout of this run failed ({self.dropped_total} prompts dropped, none scored); last "
                f"({getattr(error, 'server', None) or 'a server'}): {error}") from error

    def failed_with(self, prompt_id: int, row_index: int, error: VLLMError) -> Redispatch | DroppedPrompt:
        """Count a rollout that raised ``error`` (a :class:`VLLMError` carrying ``.server`` and, when the teacher
        was unavailable, ``.kept``) and decide what comes of its prompt."""
        self.failed += 1
        logger.warning("rollout of prompt %d failed: %s", prompt_id, error)
        attempts = self.attempts.get(prompt_id, 0) + 1
        unavailable = isinstance(error, VLLMUnavailableError)
        if unavailable and attempts < self.config.max_rollout_attempts:
            self.attempts[prompt_id] = attempts
            self.redispatched += 1
            return Redispatch(prompt_id, row_index, getattr(error, "kept", None))
        self.attempts.pop(prompt_id, None)
        self.dropped += 1
        self.dropped_total += 1
        self.last_error = error
        if unavailable:
            reason = drop_reasons.UNAVAILABLE
            message = f"{self.config.max_rollout_attempts} attempts failed; last: {error}"
        else:
            reason = drop_reasons.REJECTED
            message = getattr(error, "server_message", None) or str(error)
            self.consecutive += 1
            if self.consecutive >= self.config.max_consecutive_failures:
                raise RolloutsFailingError(
                    f"{self.consecutive} rollouts in a row were rejected or answered with a malformed body; last "
                    f"({getattr(error, 'server', None) or 'a server'}): {error}") from error
        return DroppedPrompt(prompt_id=prompt_id, dataset_index=row_index, reason=reason, message=message,
                             server=getattr(error, "server", None))

    def unscorable(self, prompt_id: int, row_index: int, teacher_id: str, error: UnscorableRollout) -> DroppedPrompt:
        """Count a rollout whose completion the cross-tokenizer teacher ``teacher_id`` cannot score and return its
        drop notice (no retry: another attempt scores the same completion)."""
        self.failed += 1
        self.dropped += 1
        self.dropped_total += 1
        self.attempts.pop(prompt_id, None)
        error.server = f"teacher {teacher_id}"  # type: ignore[attr-defined]
        self.last_error = error
        logger.info("prompt %d dropped (%s): %s", prompt_id, error.reason, error.message)
        return DroppedPrompt(prompt_id=prompt_id, dataset_index=row_index, reason=error.reason,
                             message=error.message, server=f"teacher {teacher_id}")

    def counters(self) -> dict[str, float]:
        payload = {"rollout/failed_total": float(self.failed), "rollout/dropped_total": float(self.dropped),
                   "rollout/redispatched_total": float(self.redispatched)}
        self.failed = self.dropped = self.redispatched = 0
        return payload


class Rollouts:
    """Rollouts of the rows of a :class:`~fastdistill.data.PromptTable` (or rows ``{"prompt_ids", "teacher_id",
    "prompt"?}``, already routed) through ``student`` and ``teachers`` (:func:`open_clients`).

    ``current_version()`` is the policy version a generation is stamped with (read just before its request; with an
    adapter sync it also picks the adapter the request names); ``current_step()`` the training steps trained so far,
    which set a horizon's ``max_tokens`` (:meth:`RolloutConfig.max_tokens_at`). :meth:`rollout` runs one;
    :meth:`wave` runs a list of prompts to the end (all in flight at once, failures re-dispatched or dropped by
    :class:`RolloutFailures`)."""

    def __init__(self, config: RolloutConfig, rows: Sequence[Mapping[str, Any]], student: StudentClient,
                 teachers: Mapping[str, Any], *, current_version: Callable[[], int],
                 current_step: Callable[[], int] = lambda: 0):
        self.config = config
        self.rows = rows
        self.student = student
        self.teachers = dict(teachers)
        self.current_version = current_version
        self.current_step = current_step
        self.failures = RolloutFailures(config)
        self.servers: dict[str, ReplicaPool] = {"student": student.pool}
        self.servers.update({teacher_id: client.pool for teacher_id, client in self.teachers.items()})
        self.eos = frozenset(config.eos_token_ids)
        self.per_teacher_metric = len(self.teachers) > 1
        self.cross = cross_tokenizer_scorers(config)  # teacher id -> its scorer, for teachers with own tokenizers
        if self.cross and getattr(rows, "prompts", ()) is None:
            raise ConfigError(f"teachers {sorted(self.cross)} have their own tokenizers (teacher_tokenizers) but the "
                              "rows carry no 'prompt' (only prompt_ids, the student's tokens): give the rows their "
                              "conversations (chat messages or strings) to render for those teachers")

    def is_clipped(self, completion: Any, max_tokens: int | None = None) -> bool:
        """Whether ``completion`` stopped at its limit (``max_tokens``, None: the config's) rather than on an eos."""
        return is_clipped(completion, self.eos, self.config.max_tokens if max_tokens is None else max_tokens)

    async def rollout(self, prompt_id: int, row_index: int,
                      kept: Kept | None = None) -> tuple[RolloutSample | DroppedPrompt, dict[str, Any]]:
        """Generate (unless ``kept`` holds the generation of an attempt whose scoring failed) and score one row.

        Returns the sample and its metrics (seconds, tokens), or the drop notice of a completion a cross-tokenizer
        teacher cannot score (:meth:`RolloutFailures.unscorable`, already counted) and no metrics. A
        :class:`VLLMError` raised here names its server (``.server``: ``"student"`` or ``"teacher <id>"``); when the
        teacher was unavailable it carries the generation (``.kept``), so that a re-dispatch only scores."""
        config = self.config
        row = self.rows[row_index]
        teacher_id = row["teacher_id"]
        started = time.monotonic()
        # the horizon of a training rollout (held-out evaluation's config has none: max_tokens); a kept generation
        # keeps the limit it was generated with
        max_tokens = config.max_tokens_at(self.current_step()) if kept is None else kept.max_tokens
        if kept is None:
            seed = None if config.generation_seed is None else config.generation_seed + row_index
            sent_at = time.time()
            try:
                generation, model_version = await generate_with_adapter(
                    self.student, row["prompt_ids"], current_version=self.current_version,
                    model_for_version=config.student_model_for_version, max_tokens=max_tokens,
                    temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                    repetition_penalty=config.repetition_penalty, seed=seed, **student_queries(config))
            except VLLMError as error:
                error.server = "student"  # type: ignore[attr-defined]
                raise
            kept = Kept(generation, model_version, max_tokens, sent_at, time.time())
        generation, model_version = kept.generation, kept.model_version
        scoring_started = time.monotonic()
        extra: dict[str, float] = {}
        try:
            if teacher_id in self.cross:
                try:
                    scores, extra = await self.cross[teacher_id].score(self.teachers[teacher_id], row.get("prompt"),
                                                                       generation.token_ids)
                except UnscorableRollout as error:
                    return self.failures.unscorable(prompt_id, row_index, teacher_id, error), {}
            elif config.teacher_signal(teacher_id) == "hidden":
                scores = await self.teachers[teacher_id].score(row["prompt_ids"], generation.token_ids)
            else:
                # the teacher also scores the student's query ids (its top-K stays: held-out JSD and mixing)
                queried = {} if generation.query_ids is None else {"query_ids": generation.query_ids}
                scores = await self.teachers[teacher_id].score(row["prompt_ids"], generation.token_ids,
                                                               top_k=config.teacher_top_k, **queried)
        except VLLMError as error:
            error.server = f"teacher {teacher_id}"  # type: ignore[attr-defined]
            if isinstance(error, VLLMUnavailableError):
                error.kept = kept  # type: ignore[attr-defined]
            raise
        finished = time.monotonic()
        length = generation.token_ids.shape[0]
        sample = RolloutSample.assemble(row["prompt_ids"], generation, scores, model_version=model_version,
                                        teacher_id=teacher_id, prompt_id=prompt_id, dataset_index=row_index,
                                        prompt=row.get("prompt"))
        sample.generation_started_at, sample.generation_ended_at = kept.started_at, kept.ended_at
        if generation.version_spans is not None:
            sample.token_versions = token_versions_from_spans(generation.version_spans, model_version)
        metrics: dict[str, Any] = {
            "rollout/duration_s": finished - started,
            "rollout/score_s": finished - scoring_started,
            "completions/mean_length": float(length),
            "completions/max_length": float(length),
            "completions/min_length": float(length),
            "rollout/horizon": float(max_tokens),
            **extra,
        }
        if length:
            metrics["completions/clipped_ratio"] = float(self.is_clipped(generation.token_ids, max_tokens))
        if self.per_teacher_metric:
            metrics[f"teacher_score_s/{teacher_id}"] = finished - scoring_started
        return sample, metrics

    def check_servers(self) -> None:
        """Raise :class:`ServerDownError` for a server unreachable past ``server_down_deadline_s``."""
        deadline = self.config.server_down_deadline_s
        for name, pool in self.servers.items():
            down_for = pool.down_for_s()
            if down_for > deadline:
                what = "student" if name == "student" else f"teacher {name!r}"
                raise ServerDownError(
                    f"{what} at {', '.join(pool.urls)} has answered nothing successfully for {down_for:.0f} s, "
                    f"longer than server_down_deadline_s={deadline:g}; last error: {pool.last_error!r}")

    async def wave(self, batch: Sequence[tuple[int, int]],
                   on_metrics: Callable[[dict[str, Any]], None] | None = None) -> list[RolloutSample | DroppedPrompt]:
        """Run every ``(prompt_id, row_index)`` of ``batch`` to a sample or a drop notice, in ``batch``'s order.

        At most ``max_inflight_tasks`` rollouts are in flight at once (each holds up to two connections: a long batch
        must not open a socket per row); a rollout failed by an unavailable server is dispatched again (only its
        scoring when the generation succeeded). Raises :class:`RolloutsFailingError` / :class:`ServerDownError` as
        the worker does. ``on_metrics`` receives each sample's metrics."""
        results: dict[int, RolloutSample | DroppedPrompt] = {}
        todo = [Redispatch(prompt_id, row_index, None) for prompt_id, row_index in batch]
        slots = asyncio.Semaphore(self.config.max_inflight_tasks)

        async def bounded(item: Redispatch) -> tuple[RolloutSample | DroppedPrompt, dict[str, Any]]:
            async with slots:
                return await self.rollout(item.prompt_id, item.row_index, item.kept)

        while todo:
            self.check_servers()
            outcomes = await asyncio.gather(*(bounded(item) for item in todo), return_exceptions=True)
            retry = []
            for item, outcome in zip(todo, outcomes, strict=True):
                if isinstance(outcome, VLLMError):
                    decision = self.failures.failed_with(item.prompt_id, item.row_index, outcome)
                    if isinstance(decision, Redispatch):
                        retry.append(decision)
                    else:
                        results[item.prompt_id] = decision
                elif isinstance(outcome, BaseException):
                    raise outcome
                elif isinstance(outcome[0], DroppedPrompt):
                    results[item.prompt_id] = outcome[0]
                else:
                    sample, metrics = outcome
                    self.failures.succeeded(item.prompt_id)
                    results[item.prompt_id] = sample
                    if on_metrics is not None:
                        on_metrics(metrics)
            todo = retry
        return [results[prompt_id] for prompt_id, _ in batch]


async def run_wave(config: RolloutConfig, rows: Sequence[Mapping[str, Any]], batch: Sequence[tuple[int, int]], *,
                   model_version: int = 0) -> list[RolloutSample | DroppedPrompt]:
    """One :meth:`Rollouts.wave` with clients opened for it and closed after (evaluation, one-off scoring)."""
    async with new_session(connection_limit=2 * config.max_inflight_tasks) as session:
        student, teachers = open_clients(config, session=session)
        rollouts = Rollouts(config, rows, student, teachers, current_version=lambda: model_version)
        return await rollouts.wave(batch)


__all__ = ["Kept", "Redispatch", "is_clipped", "RetryPolicy", "RolloutFailures", "Rollouts", "open_clients", "run_wave",
           "student_queries",
           "teacher_client"]
