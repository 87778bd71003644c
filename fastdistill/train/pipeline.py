"""Assembling the rollout side of a run (rank 0): server checks, prompt-length checks, the rollout settings, the
source, and the hidden-state teachers' heads (every rank).

The trainer calls these in order at start-up; each takes what it needs explicitly, so each is testable alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from fastdistill.adapter_names import ADAPTER_PREFIX
from fastdistill.cache import CacheError, TeacherCache
from fastdistill.data.sources import prepare_prompts
from fastdistill.errors import ConfigError
from fastdistill.rollout import (
    OnPolicyShare,
    RetryPolicy,
    RolloutConfig,
    RolloutWorker,
    check_shared_vocabulary,
    epoch_order,
    open_clients,
)
from fastdistill.rollout.dropped import TOO_LONG, DroppedPrompt
from fastdistill.rollout.horizon import HorizonSchedule
from fastdistill.train.checkpoint import RolloutState
from fastdistill.train.ledger import DROPPED_PROMPTS_FILE
from fastdistill.train.source import CacheSource, ListSource, MixedSource, SynchronousSource, WorkerSource
from fastdistill.train.teacher_head import load_hidden_teacher_head, teacher_head_folder

logger = logging.getLogger(__name__)

def open_cache(config: Any, tokenizer: Any) -> Any:
    """The ``teacher_cache`` folder, its shards checked against the manifest's checksums, its tokenizer against the
    student's and its loss settings against the run's (ConfigError otherwise)."""
    if len(config.teacher_ids) != 1:
        raise ConfigError(f"teacher_cache holds one teacher's scores; teacher_server_urls names "
                          f"{len(config.teacher_ids)} teachers ({config.teacher_ids})")
    try:
        cache = TeacherCache(config.teacher_cache)
    except CacheError as error:
        raise ConfigError(f"teacher_cache: {error}") from error
    cache.check_tokenizer(tokenizer)
    cache.check_loss_settings(beta=config.beta, add_tail_bucket=config.add_tail_bucket)
    return cache


def training_rows(config: Any, rows: Any, tokenizer: Any) -> Any:
    """The tokenised training prompts (a :class:`~fastdistill.data.PromptTable`) of ``rows`` (anything
    ``train_dataset`` accepts), else of ``config.train_dataset``."""
    if rows is None:
        if config.train_dataset is None:
            raise ValueError("no training data: pass train_dataset= (a datasets.Dataset or a list of rows "
                             "{'prompt': ..., 'teacher_id': ...}) or set config.train_dataset to a file, a dataset "
                             "folder or a Hugging Face dataset name")
        rows = config.train_dataset
    return prepare_prompts(rows, tokenizer, what="train_dataset", split=config.dataset_train_split,
                           dataset_config=config.dataset_config, chat_template_kwargs=config.chat_template_kwargs)


def server_settings(config: Any) -> dict[str, Any]:
    """The :class:`~fastdistill.rollout.RolloutConfig` fields that say how to reach ``config``'s servers: URLs, API
    keys, each teacher's signal and hidden-state dtype, and the retry policy with the run's ``request_timeout``."""
    return dict(student_url=config.vllm_server_base_url, teacher_urls=config.teacher_server_urls,
                student_api_key=config.vllm_server_api_key, teacher_api_keys=config.teacher_api_keys,
                teacher_signals={teacher_id: config.teacher_signal_of(teacher_id)
                                 for teacher_id in config.teacher_server_urls},
                teacher_hidden_dtype=config.teacher_hidden_dtype,
                retry=RetryPolicy(request_timeout_s=config.request_timeout))


def server_clients(config: Any) -> tuple[Any, dict[str, Any]]:
    """The student's client and one client per teacher (by its signal) for ``config``'s servers, from the one client
    factory (:func:`~fastdistill.rollout.open_clients`); the caller closes them."""
    return open_clients(RolloutConfig(**server_settings(config)))


async def served_teacher(client: Any, signal: str) -> tuple[Any, int | None]:
    """What a teacher server serves: its :class:`~fastdistill.rollout.ServedModel` and, for a hidden-state teacher
    (``signal`` ``"hidden"``), the width of the hidden states it sends (one one-token request), else None."""
    served = await client.served_model()
    return served, (await client.served_width() if signal == "hidden" else None)


def check_servers(config: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """Before any rollout: the servers are up, every teacher tokenizes like the student and, when the loss reads
    teacher log-probs at student query ids, each top-K teacher runs the scoring plugin. Returns each server's
    :class:`~fastdistill.rollout.ServedModel` (``"student"`` and the teacher ids) and each hidden-state teacher's
    served width (:func:`served_teacher`), which its head is checked against."""

    async def check() -> tuple[dict[str, Any], dict[str, int]]:
        widths: dict[str, int] = {}
        student, teachers = server_clients(config)
        try:
            await student.wait_until_healthy(config.vllm_server_timeout)
            served = {"student": await student.served_model()}
            for teacher_id, teacher in teachers.items():
                signal = config.teacher_signal_of(teacher_id)
                await teacher.wait_until_healthy(config.vllm_server_timeout)
                served[teacher_id], width = await served_teacher(teacher, signal)
                if signal == "topk" and config.student_queries != "none":
                    await teacher.check_query_scoring()  # the loss reads log-probs at query ids
                if width is not None:
                    widths[teacher_id] = width
            await check_shared_vocabulary(student, teachers, teacher_tokenizers=own_tokenizers(config))
        finally:
            for client in (student, *teachers.values()):
                await client.close()
        return served, widths

    return asyncio.run(check())


def student_route(config: Any) -> str:
    """How the rollout asks the student for completions (``RolloutConfig.student_route``): ``"generate"`` when
    ``staleness_unit`` is ``"token"`` and the student serves ``/inference/v1/generate`` (started with
    ``--enable-scale-out``), whose weight-version spans give each token's version; else ``"completions"`` (the
    trainer then estimates token versions from the sync times). Logs which."""
    if config.staleness_unit != "token":
        return "completions"

    async def probe() -> bool:
        student, teachers = server_clients(config)
        try:
            return await student.serves_generate_route()
        finally:
            for client in (student, *teachers.values()):
                await client.close()

    if asyncio.run(probe()):
        logger.info("staleness_unit 'token': each token's version comes from the student's weight-version spans "
                    "(/inference/v1/generate)")
        return "generate"
    logger.info("staleness_unit 'token': the student does not serve /inference/v1/generate (start it with "
                "--enable-scale-out for exact versions), so each token's version is estimated from the sync times")
    return "completions"


def served_hidden_teachers(config: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """Each hidden-state teacher's :class:`~fastdistill.rollout.ServedModel` and served width
    (:func:`served_teacher`), asked without the other start-up checks (held-out evaluation of a saved model)."""

    async def probe() -> tuple[dict[str, Any], dict[str, int]]:
        served, widths = {}, {}
        student, teachers = server_clients(config)
        try:
            for teacher_id in config.hidden_teacher_ids:
                served[teacher_id], widths[teacher_id] = await served_teacher(teachers[teacher_id], "hidden")
        finally:
            for client in (student, *teachers.values()):
                await client.close()
        return served, widths

    return asyncio.run(probe())


def own_tokenizers(config: Any) -> dict[str, Any]:
    """Teacher id -> its own tokenizer, loaded from ``config.teacher_tokenizers`` (the cross-tokenizer teachers)."""
    folders = getattr(config, "teacher_tokenizers", None) or {}
    if not folders:
        return {}
    from transformers import AutoTokenizer  # as train.model loads it: not on `import fastdistill.train`

    return {teacher_id: AutoTokenizer.from_pretrained(str(folder)) for teacher_id, folder in folders.items()}


def limits_exceeded(prompt_lengths: Sequence[int], teacher_ids: Sequence[str], served: Mapping[str, Any],
                    completion: int, own_tokenizer: Collection[str] = ()) -> dict[int, tuple[str, int, int]]:
    """Row -> ``(server, needed tokens, its max_model_len)`` for the rows whose prompt plus ``completion`` tokens
    cannot fit the student's ``max_model_len``, or their teacher's (which scores prompt + completion and asks for one
    more token). A teacher in ``own_tokenizer`` counts in its own tokens, which only its rendering of each rollout
    tells: the rollout checks those (a ``too_long`` drop), not this bound."""
    limits = {}
    for index, (prompt, teacher_id) in enumerate(zip(prompt_lengths, teacher_ids, strict=True)):
        checks = [("student", prompt + completion, served["student"].max_model_len)]
        if teacher_id not in own_tokenizer:
            checks.append((f"teacher {teacher_id}", prompt + completion + 1, served[teacher_id].max_model_len))
        for server, needed, limit in checks:
            if needed > limit:
                limits[index] = (server, needed, limit)
                break
    return limits


def long_prompt_drops(rows: Any, teacher_ids: Sequence[str], served: Mapping[str, Any], config: Any, *,
                      total_prompts: int | None, rollout_state: RolloutState,
                      on_policy: OnPolicyShare | None) -> tuple[frozenset[int], list[DroppedPrompt]]:
    """The dataset rows whose prompt plus ``max_completion_length`` cannot fit a server (:func:`limits_exceeded`)
    and the drop notices of their prompts in this run.

    Without ``skip_long_prompts`` any such row is a :class:`ConfigError`; with it, the rows are never dispatched and
    each of their prompts that this run would generate (not those a mixed run's cache serves), not yet trained,
    counts as done in ``rollout_state`` and gets a ``too_long`` notice."""
    completion = config.max_completion_length
    # from the table's lengths and codes, not its rows: that would read every prompt
    routes = [rows.teacher_id(i) if len(teacher_ids) > 1 else teacher_ids[0] for i in range(len(rows))]
    limits = limits_exceeded(rows.lengths.tolist(), routes, served, completion, config.cross_tokenizer_teacher_ids)
    if not limits:
        return frozenset(), []
    longest = max(limits, key=lambda i: int(rows.lengths[i]))
    server, needed, limit = limits[longest]
    what = (f"{len(limits)} of {len(rows)} prompts do not fit the servers: the longest has {int(rows.lengths[longest])}"
            f" tokens (row {longest}); with max_completion_length={completion} it needs {needed} tokens, but the "
            f"{server} server serves max_model_len={limit}")
    if len(limits) == len(rows):
        raise ConfigError(f"{what}. No prompt can be trained: lower max_completion_length or raise the servers' "
                          "--max-model-len.")
    if not config.skip_long_prompts:
        raise ConfigError(f"{what}. Lower max_completion_length, raise the servers' --max-model-len, or set "
                          "skip_long_prompts=True to skip these prompts (they are listed in "
                          f"{DROPPED_PROMPTS_FILE}).")
    logger.warning("%s; skipping them (skip_long_prompts=True)", what)
    skip = frozenset(limits)
    drops = []
    if total_prompts is not None:  # their prompts in this run are done, once
        num_rows = len(rows)
        for epoch in range(math.ceil(total_prompts / num_rows)):
            order = epoch_order(num_rows, config.seed, epoch, config.shuffle)
            for position in np.nonzero(np.isin(order, list(skip)))[0]:
                prompt_id = epoch * num_rows + int(position)
                if on_policy is not None and not on_policy.selects(prompt_id):
                    continue  # the teacher cache serves this prompt: nothing is generated for it
                if prompt_id < total_prompts and not rollout_state.is_trained(prompt_id):
                    rollout_state.add(prompt_id)
                    row = int(order[position])
                    server, needed, limit = limits[row]
                    drops.append(DroppedPrompt(prompt_id=prompt_id, dataset_index=row, reason=TOO_LONG, server=server,
                                               message=f"needs {needed} tokens > max_model_len={limit} (prompt + "
                                               f"max_completion_length={completion})"))
    return skip, drops


def eos_token_ids(hf_model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids a completion may end on: the model's generation config's eos ids and the tokenizer's."""
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = (tokenizer.eos_token_id, *ids)
    return ids


def rollout_config(config: Any, *, world_size: int, rollout_state: RolloutState, total_prompts: int | None,
                   skip_rows: frozenset[int], on_policy: OnPolicyShare | None, eos_ids: tuple[int, ...],
                   adapter_sync: bool, horizon: HorizonSchedule | None = None,
                   student_route: str = "completions") -> RolloutConfig:
    """The rollout settings of a run: servers, keys and signals, sampling, the horizon (``horizon``: its schedule,
    :func:`~fastdistill.rollout.horizon.horizon_schedule`; None: ``max_completion_length``), lookahead, the resume
    cursor and its skips, failure handling, the student queries its ``loss_type`` reads and the student route
    (:func:`student_route`)."""
    inflight = config.resolved_max_inflight_tasks(world_size)
    return RolloutConfig(
        **server_settings(config),
        teacher_top_k=config.teacher_top_k,
        max_tokens=config.max_completion_length,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=-1 if config.top_k == 0 else config.top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        max_inflight_tasks=inflight,
        initial_inflight_tasks=min(config.samples_per_step(world_size), inflight),
        max_lookahead=config.resolved_max_lookahead(world_size),
        shuffle=config.shuffle,
        seed=config.seed,
        start_index=rollout_state.prompt_index,
        end_index=total_prompts,
        skip_prompt_ids=frozenset(rollout_state.trained_after),
        skip_rows=skip_rows,
        on_policy=on_policy,
        eos_token_ids=eos_ids,
        student_adapter_prefix=ADAPTER_PREFIX if adapter_sync else None,
        student_queries=config.student_queries,  # from loss_type: "samples" (reverse_kl_mc), "topk", or "none"
        num_student_queries=config.num_student_queries,
        rollout_processes=config.rollout_processes,
        teacher_tokenizers=getattr(config, "teacher_tokenizers", None),
        student_tokenizer=str(config.model_name_or_path) if getattr(config, "teacher_tokenizers", None) else None,
        chat_template_kwargs=config.chat_template_kwargs,
        horizon=horizon,
        student_route=student_route,
    )


def cache_source(cache: Any, config: Any, rollout_state: RolloutState, total_prompts: int | None,
                 on_policy: OnPolicyShare | None) -> CacheSource:
    """The teacher cache's rows from the resume point on (the off-policy share with ``lmbda`` > 0)."""
    return CacheSource(cache, seed=config.seed, shuffle=config.shuffle, start_index=rollout_state.prompt_index,
                       end_index=total_prompts, skip_prompt_ids=frozenset(rollout_state.trained_after),
                       teacher_id=config.teacher_ids[0], on_policy=on_policy)


def open_source(config: Any, *, world_size: int, samples: Any, cache: Any, offline: bool, rows: Any,
                rollouts: RolloutConfig | None, rollout_state: RolloutState, total_prompts: int | None,
                on_policy: OnPolicyShare | None, model_version: int, policy: Any = None) -> tuple[Any, Any]:
    """Rank 0's source of samples and, for an asynchronous run, its started rollout worker (else None): the given
    samples, the teacher cache alone, synchronous waves, or the worker's queue (mixed with the cache when ``lmbda``
    > 0). The worker starts stamping rollouts with ``model_version``, the version the cold sync made the server
    serve; ``policy`` (:class:`~fastdistill.train.staleness.PolicySteps`) turns versions into optimizer steps and
    holds the steps trained so far (the worker's start for a horizon's schedule)."""
    if samples is not None:
        return ListSource(samples), None
    if cache is not None and offline:
        return cache_source(cache, config, rollout_state, total_prompts, on_policy), None
    if not config.async_mode:
        return SynchronousSource(rows, rollouts, config.samples_per_step(world_size), policy=policy), None
    worker = RolloutWorker(rollouts, rows, queue_maxsize=config.resolved_queue_maxsize(world_size))
    worker.model_version = model_version
    worker.trained_steps = 0 if policy is None else policy.step
    worker.start()
    source: Any = WorkerSource(worker, max_staleness=config.max_staleness, stale_policy=config.stale_policy,
                               heartbeat_stale_after_s=config.heartbeat_stale_after_s, policy=policy,
                               staleness_unit=config.staleness_unit)
    if cache is not None:
        source = MixedSource(source, cache_source(cache, config, rollout_state, total_prompts, on_policy), on_policy,
                             first_prompt=rollout_state.prompt_index,
                             candidate_width=max(cache.candidate_width, config.teacher_top_k + 1))
    return source, worker


def load_teacher_heads(config: Any, dist: Any, served: Mapping[str, Any] | None, widths: Mapping[str, int], *,
                       vocab_size: int, dtype: Any) -> dict[int, Any]:
    """Every rank: teacher index -> the lm_head of each hidden-state teacher, in ``dtype`` on the training device
    (not parameters: never trained, never saved). Rank 0 picks the folders (``teacher_model_paths``, else the id the
    teacher server reports when it is a local folder); every rank checks that each head covers the student's
    ``vocab_size`` rows and takes the width its server sends (rank 0's ``widths``, broadcast so that a mismatch stops
    every rank rather than leaving the others at their next collective); ConfigError otherwise."""
    hidden_ids = config.hidden_teacher_ids
    if not hidden_ids:
        return {}
    folders = None
    if dist.is_main:
        folders = {teacher_id: teacher_head_folder(teacher_id, config.teacher_model_paths,
                                                   served[teacher_id].name if served is not None else None)
                   for teacher_id in hidden_ids}
    folders, widths = dist.broadcast((folders, dict(widths)))
    return {config.teacher_ids.index(teacher_id): load_hidden_teacher_head(
        teacher_id, folder, vocab_size=vocab_size, dtype=dtype, device=dist.device, served_width=widths.get(teacher_id))
        for teacher_id, folder in folders.items()}
