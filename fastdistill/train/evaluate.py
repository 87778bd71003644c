"""Held-out evaluation through the servers: the student answers, the teacher scores, the trainer's model measures.

``collect_scored_samples`` runs the same two calls as a rollout (student generation, teacher scoring) for a list of
prompts; ``divergence_stats`` measures a model's generalized JSD on those samples without a gradient (sparse over a
top-K teacher's candidates, over the full vocabulary for a hidden-state teacher; its share of them on one rank of
several), and ``eval_record`` turns the sums into the ``eval/...`` metrics. The trainer's
``eval_steps`` evaluation, ``fastdistill eval`` (:func:`evaluate_saved_model`) and the demo all go through these.
Greedy decoding (``temperature=0``) makes before/after comparisons deterministic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fastdistill.auth import student_api_key_from_env, teacher_api_keys_with_env
from fastdistill.data.packing import pack_row
from fastdistill.data.sources import load_prompt_source, prepare_prompts
from fastdistill.errors import ConfigError, RolloutsFailingError, ServerDownError, VLLMError
from fastdistill.logit_head import causal_lm_parts, logit_head_from_config
from fastdistill.loss import narrow_support, sparse_jsd_loss
from fastdistill.rollout import RetryPolicy, RolloutConfig, RolloutSample
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.prompt_table import routed_table
from fastdistill.rollout.sequence import run_wave
from fastdistill.sync import served_logprob_gap
from fastdistill.train.cross_teachers import load_cross_teachers
from fastdistill.train.distributed import Distributed, broadcast_samples
from fastdistill.train.model import DistillationModel, load_model, load_tokenizer
from fastdistill.train.pipeline import limits_exceeded, load_teacher_heads, served_hidden_teachers
from fastdistill.train.teacher_head import TeacherHead

logger = logging.getLogger(__name__)

# Rollouts in flight at once during an evaluation (each holds up to two connections): the rollout worker's default
# cap, RolloutConfig.max_inflight_tasks, unless the run sets max_inflight_tasks.
EVAL_MAX_INFLIGHT = RolloutConfig.__dataclass_fields__["max_inflight_tasks"].default


def collect_scored_samples(
    student_url: str,
    teacher_urls: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    top_k: int,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    student_api_key: str | None = None,
    teacher_api_keys: Mapping[str, str] | None = None,
    student_model: str | None = None,
    teacher_signals: Mapping[str, str] | None = None,
    hidden_dtype: str = "bfloat16",
    retry: Any = None,
    teacher_tokenizers: Mapping[str, str] | None = None,
    student_tokenizer: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_inflight_tasks: int = EVAL_MAX_INFLIGHT,
) -> list[RolloutSample]:
    """One scored sample per row ``{"prompt_ids", "teacher_id"?}``, through the one rollout sequence
    (:class:`~fastdistill.rollout.Rollouts`): the student server's completion (greedy by default; request seed
    ``seed + row``) scored by the row's teacher (the first teacher when the row names none). ``teacher_urls`` maps
    teacher id to a URL or a list of replica URLs; API keys as in :class:`~fastdistill.train.AsyncDistillationConfig`
    (a key not given is read as the trainer reads it: its environment variable, else the key file ``fastdistill
    serve-*`` generated).
    ``student_model`` names what the student generates with (a LoRA adapter's name; None: the served model).
    ``teacher_signals`` maps a teacher id to ``"hidden"`` for a hidden-state teacher (its samples carry
    ``teacher_hidden`` in ``hidden_dtype``); unnamed teachers are top-K. ``teacher_tokenizers`` maps a
    cross-tokenizer teacher to its tokenizer folder (its samples carry ``cross_targets``; rows then need their
    ``prompt`` messages, which the teacher renders with its own chat template), with the student's tokenizer folder
    ``student_tokenizer`` and the chat template's ``chat_template_kwargs``. At most ``max_inflight_tasks`` rows are
    in flight at once (default :data:`EVAL_MAX_INFLIGHT`), whatever the number of rows.

    A row whose rollout fails (a server rejects it, or stays unavailable through the retries) is logged and left out:
    the samples (``prompt_id`` = ``dataset_index`` = the row's index) are those of the rows that succeeded, in row
    order, so ``len(rows) - len(result)`` rows failed."""
    if not rows:
        return []
    # keys not given come from the environment, else from the key files `fastdistill serve-*` generated
    student_api_key = student_api_key if student_api_key is not None else student_api_key_from_env()
    teacher_api_keys = teacher_api_keys_with_env(teacher_urls, teacher_api_keys)
    config = RolloutConfig(
        student_url=student_url, teacher_urls=dict(teacher_urls), teacher_top_k=top_k, max_tokens=max_tokens,
        temperature=temperature, generation_seed=seed, student_model=student_model, student_api_key=student_api_key,
        teacher_api_keys=teacher_api_keys, teacher_signals=teacher_signals, teacher_hidden_dtype=hidden_dtype,
        max_inflight_tasks=min(len(rows), max_inflight_tasks), max_consecutive_failures=len(rows) + 1,
        retry=retry if retry is not None else RetryPolicy(),
        **({"teacher_tokenizers": dict(teacher_tokenizers), "student_tokenizer": student_tokenizer,
            "chat_template_kwargs": chat_template_kwargs} if teacher_tokenizers else {}))
    first = next(iter(teacher_urls))
    table = routed_table([{**row, "teacher_id": row.get("teacher_id") or first} for row in rows],
                         list(teacher_urls))
    results = asyncio.run(run_wave(config, table, [(index, index) for index in range(len(rows))]))
    for result in results:
        if isinstance(result, DroppedPrompt):
            logger.warning("evaluation row %d failed (%s by %s): %s", result.dataset_index, result.reason,
                           result.server, result.message)
    return [result for result in results if isinstance(result, RolloutSample)]


def collect_held_out(config: Any, rows: Sequence[Mapping[str, Any]], *,
                     student_model: str | None = None) -> list[RolloutSample]:
    """:func:`collect_scored_samples` with the servers, keys, signals, top-K, completion length, seed, request
    timeout and in-flight cap (``max_inflight_tasks``; -1, automatic: :data:`EVAL_MAX_INFLIGHT`) of ``config`` (an
    :class:`~fastdistill.train.AsyncDistillationConfig`)."""
    inflight = config.max_inflight_tasks if config.max_inflight_tasks != -1 else EVAL_MAX_INFLIGHT

    return collect_scored_samples(
        config.vllm_server_base_url, config.teacher_server_urls, rows, top_k=config.teacher_top_k,
        max_tokens=config.max_completion_length, seed=config.seed, student_api_key=config.vllm_server_api_key,
        teacher_api_keys=config.teacher_api_keys, student_model=student_model,
        teacher_signals={t: config.teacher_signal_of(t) for t in config.teacher_ids},
        hidden_dtype=config.teacher_hidden_dtype, retry=RetryPolicy(request_timeout_s=config.request_timeout),
        teacher_tokenizers=config.teacher_tokenizers,
        student_tokenizer=str(config.model_name_or_path) if config.teacher_tokenizers else None,
        chat_template_kwargs=config.chat_template_kwargs, max_inflight_tasks=inflight)


@torch.no_grad()
def divergence_per_token(model: torch.nn.Module, samples: Sequence[RolloutSample], teacher_ids: Sequence[str], *,
                         beta: float = 0.0, temperature: float = 1.0, add_tail_bucket: bool = True) -> float:
    """Mean over scored completion tokens of the sparse generalized JSD between ``model`` (a Hugging Face causal
    LM, its logit head read by :func:`~fastdistill.logit_head.logit_head_from_config`) and the teacher candidates of
    ``samples`` (nats/token); candidates beyond the model's vocabulary are folded into the teacher's tail
    (:func:`~fastdistill.data.pack_row`). Cross-tokenizer samples (``cross_targets``) have no candidates in the
    student's vocabulary and are left out (:func:`divergence_stats` with the trainer's model scores them)."""
    samples = [s for s in samples if len(s.completion_ids) > 0 and s.cross_targets is None]
    if not samples:
        raise ValueError("no sample has a completion token to score (cross-tokenizer samples are left out)")
    logit_head = logit_head_from_config(model.config)
    backbone, head = causal_lm_parts(model)
    row = pack_row(samples, teacher_ids, vocab_size=head.weight.shape[0]).to(next(model.parameters()).device)
    hidden = backbone(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).last_hidden_state[0]
    ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, beta)
    out = sparse_jsd_loss(hidden.index_select(0, row.target_positions).float(), head.weight.float(), ids, lps, mask,
                          bias=None if head.bias is None else head.bias.float(), logit_scale=logit_head.scale,
                          softcap=logit_head.softcap, beta=beta, temperature=temperature,
                          add_tail_bucket=add_tail_bucket)
    return float(out.jsd_sum) / max(int(out.num_tokens), 1)


def divergence_stats(model: torch.nn.Module, samples: Sequence[RolloutSample], teacher_ids: Sequence[str], *,
                     beta: float, device: torch.device, vocab_size: int | None = None, rank: int = 0,
                     world_size: int = 1, group: int = 8, bf16: bool = False) -> torch.Tensor:
    """(num_teachers, 2) float64 ``[scored tokens, jsd sum]`` per teacher of this rank's share of ``samples``
    (every ``world_size``-th one from ``rank``), ``group`` samples per packed row.

    ``model`` is a :class:`~fastdistill.train.model.DistillationModel` (its ``divergence=True`` forward). Every rank
    runs the same number of forwards (a rank with fewer samples runs zero-weight copies) because FSDP's gathers are
    collective; samples without a completion token are skipped. Teacher candidates at or beyond ``vocab_size`` (the
    student's lm_head rows) are folded into the teacher's tail. A cross-tokenizer teacher's samples count their
    aligned groups and the model's ``cross_tokenizer_loss`` (hybrid or ULD, whatever ``loss_type``) per group. Sum
    the result over ranks."""
    scored = [s for s in samples if len(s.completion_ids) > 0]
    mine = scored[rank::world_size]
    chunks = math.ceil(math.ceil(len(scored) / world_size) / group) if scored else 0
    stats = torch.zeros(len(teacher_ids), 2, dtype=torch.float64)
    for index in range(chunks):
        chunk = mine[index * group:(index + 1) * group]
        row = pack_row(chunk or scored[:1], list(teacher_ids), vocab_size=vocab_size).to(device)
        ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, beta)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out, _ = model(row, ids, lps, mask, divergence=True)
        if chunk:
            stats += out.per_teacher.detach().double().cpu()[:, :2]
    return stats


def completion_texts(samples: Sequence[RolloutSample], tokenizer: Any) -> list[str]:
    """Each sample's completion decoded without special tokens and stripped of surrounding white space."""
    return [tokenizer.decode(s.completion_ids.tolist(), skip_special_tokens=True).strip() for s in samples]


def eval_record(stats: torch.Tensor, samples: Sequence[RolloutSample], teacher_ids: Sequence[str], *,
                answers: Sequence[str | None] | None = None, tokenizer: Any = None,
                failed: int | None = None) -> dict[str, float]:
    """The ``eval/...`` metrics from summed :func:`divergence_stats` (all ranks) and the samples (each sample's
    ``dataset_index`` is its row): ``eval/jsd`` (nats per scored token), ``eval/teacher_jsd/<id>`` with several
    teachers, ``eval/completion_length_mean``, ``eval/samples_total``, ``eval/failed_total`` (rows whose rollout
    failed, when ``failed`` is given) and, when rows carry a reference ``answer`` (``answers``, by row),
    ``eval/exact_match``: the fraction of the scored rows with an answer whose greedy completion, decoded, equals it
    (both stripped of surrounding white space)."""
    tokens = float(stats[:, 0].sum())
    record = {"eval/samples_total": float(len(samples))}
    if tokens > 0:  # no scored token (every row failed): no divergence to report
        record["eval/jsd"] = float(stats[:, 1].sum()) / tokens
    if samples:
        record["eval/completion_length_mean"] = sum(len(s.completion_ids) for s in samples) / len(samples)
    if failed is not None:
        record["eval/failed_total"] = float(failed)
    if len(teacher_ids) > 1:
        for index, teacher_id in enumerate(teacher_ids):
            if stats[index, 0] > 0:
                record[f"eval/teacher_jsd/{teacher_id}"] = float(stats[index, 1] / stats[index, 0])
    if answers is not None and any(a is not None for a in answers):
        if tokenizer is None:
            raise ValueError("exact-match needs the tokenizer to decode the completions")
        texts = completion_texts(samples, tokenizer)
        row_answers = [answers[sample.dataset_index] for sample in samples]
        graded = [text == str(answer).strip() for text, answer in zip(texts, row_answers, strict=True)
                  if answer is not None]
        if graded:  # rows with an answer whose rollout failed are in eval/failed_total, not graded
            record["eval/exact_match"] = sum(graded) / len(graded)
    return record


def prepare_eval_rows(source: Any, tokenizer: Any, teacher_ids: Sequence[str], *, split: str = "test",
                      dataset_config: str | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Held-out rows as evaluation needs them: ``{"prompt_ids", "teacher_id", "prompt", "answer"}`` — each row's
    prompt tokenised like a training row, routed to its teacher (``teacher_id`` column, or the only teacher), and its
    optional reference ``answer`` (a string column) kept for ``eval/exact_match``.

    ``source`` is anything ``eval_dataset`` accepts (a ``datasets.Dataset``, a list of row dicts, a file, a dataset
    folder or name; ``split`` and ``dataset_config`` apply to folders and names). Raises ConfigError naming the
    column and row."""
    what = "eval_dataset"
    rows = load_prompt_source(source, split=split, dataset_config=dataset_config, what=what)
    table = prepare_prompts(rows, tokenizer, what=what, split=split, dataset_config=dataset_config,
                            chat_template_kwargs=chat_template_kwargs)
    try:
        routed = table.routed(list(teacher_ids))
    except ValueError as error:
        raise ConfigError(f"{what}: {error}") from error
    if isinstance(rows, list):
        answers = [row.get("answer") for row in rows]
    else:
        answers = rows["answer"] if "answer" in rows.column_names else [None] * len(rows)
    prepared = []
    for index, answer in enumerate(answers):
        if answer is not None and not isinstance(answer, str):
            raise ConfigError(f"{what}: row {index}: 'answer' must be a string, got {answer!r:.100}")
        prepared.append({**routed[index], "answer": answer})
    return prepared


def held_out_rows(config: Any, rows: Any, tokenizer: Any) -> list[dict[str, Any]] | None:
    """The tokenised held-out rows of ``rows``, else of ``config.eval_dataset``, each routed to its teacher, with
    their optional ``answer`` (None without an eval dataset)."""
    if rows is None:
        if config.eval_dataset is None:
            return None
        rows = config.eval_dataset
    return prepare_eval_rows(rows, tokenizer, config.teacher_ids, split=config.dataset_test_split,
                             dataset_config=config.dataset_config, chat_template_kwargs=config.chat_template_kwargs)


def fitting_eval_rows(eval_rows: list[dict[str, Any]], teacher_ids: Sequence[str], served: Mapping[str, Any],
                      config: Any) -> tuple[list[dict[str, Any]], int]:
    """Held-out rows are checked like training rows: ``(the rows that fit, how many were left out)``. A row whose
    prompt plus ``max_completion_length`` cannot fit a server is a :class:`ConfigError`, or with
    ``skip_long_prompts`` left out of every evaluation (``eval/too_long_total``)."""
    completion = config.max_completion_length
    routes = [row.get("teacher_id") or teacher_ids[0] for row in eval_rows]
    limits = limits_exceeded([len(row["prompt_ids"]) for row in eval_rows], routes, served, completion,
                             config.cross_tokenizer_teacher_ids)
    if not limits:
        return eval_rows, 0
    index = max(limits, key=lambda i: len(eval_rows[i]["prompt_ids"]))
    server, needed, limit = limits[index]
    what = (f"eval_dataset: {len(limits)} of {len(eval_rows)} rows do not fit the servers: row {index} needs "
            f"{needed} tokens with max_completion_length={completion}, but the {server} server serves "
            f"max_model_len={limit}")
    everything = len(limits) == len(eval_rows)
    if not config.skip_long_prompts or everything:
        raise ConfigError(f"{what}. Lower max_completion_length, raise the servers' --max-model-len, shorten the "
                          "held-out prompts" + ("" if everything else ", or set skip_long_prompts=True to leave them "
                                                "out"))
    logger.warning("%s; leaving them out of every evaluation (skip_long_prompts=True)", what)
    return [row for i, row in enumerate(eval_rows) if i not in limits], len(limits)


class RunEvaluator:
    """Held-out on-policy evaluation during a run (collective: every rank calls it).

    ``rows`` (rank 0's :func:`prepare_eval_rows`; None elsewhere) are checked against the servers like training rows
    (:meth:`check_rows`). Each evaluation: rank 0 asks the student server for a greedy completion of every row (up to
    ``max_completion_length`` tokens) and the row's teacher to score it; each rank measures its share with the
    trainer's current weights. The served weights are those of the last sync (with ``lora_sync="adapter"`` the
    newest adapter generates). A row whose rollout fails is counted (``eval/failed_total``); an evaluation that fails
    as a whole (a server down) counts every row as failed and the run goes on."""

    def __init__(self, config: Any, dist: Any, rows: list[dict[str, Any]] | None, tokenizer: Any, *,
                 vocab_size: int, bf16: bool):
        self.config, self.dist, self.rows, self.tokenizer = config, dist, rows, tokenizer
        self.vocab_size = vocab_size
        self.bf16 = bf16 and not dist.sharded
        self.enabled = dist.broadcast(bool(rows))
        self.too_long = 0  # rows left out for not fitting a server (skip_long_prompts)
        self.last_step: int | None = None

    def check_rows(self, served: Mapping[str, Any]) -> None:
        """Rank 0: drop or refuse rows that cannot fit a server (:func:`fitting_eval_rows`)."""
        if self.rows:
            self.rows, self.too_long = fitting_eval_rows(self.rows, self.config.teacher_ids, served, self.config)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, hf_model: torch.nn.Module, step: int, *,
                 student_model: str | None = None) -> dict[str, float]:
        """The ``eval/...`` metrics on rank 0 (``{}`` elsewhere): ``eval/jsd`` (the sparse generalized JSD at
        ``beta``, the dense one for a hidden-state teacher's rows, nats per scored token), ``eval/teacher_jsd/<id>``
        with several teachers, ``eval/completion_length_mean``, ``eval/samples_total``, ``eval/failed_total``,
        ``eval/too_long_total`` (when rows were left out) and ``eval/exact_match`` when the rows carry an ``answer``
        (:func:`eval_record`). ``model`` is the :class:`~fastdistill.train.model.DistillationModel`, ``hf_model``
        the model it wraps; ``student_model`` names what generates (an adapter; None: the served model)."""
        config, dist = self.config, self.dist
        samples = None
        if dist.is_main:
            try:
                samples = collect_held_out(config, self.rows, student_model=student_model)
            except (VLLMError, ServerDownError, RolloutsFailingError) as error:
                # the run goes on (and the other ranks with it): every row of this evaluation counts as failed
                logger.error("evaluation at step %d failed, every held-out row is counted in eval/failed_total: %s",
                             step, error)
                samples = []
        samples = broadcast_samples(dist, samples)  # the arrays as tensors, not pickles
        was_training = hf_model.training
        hf_model.eval()
        try:
            stats = divergence_stats(model, samples, config.teacher_ids, beta=config.beta, device=dist.device,
                                     vocab_size=self.vocab_size, rank=dist.rank, world_size=dist.world_size,
                                     bf16=self.bf16)
        finally:
            hf_model.train(was_training)
        stats = dist.all_reduce_sum(stats)
        self.last_step = step
        if not dist.is_main:
            return {}
        answers = [row.get("answer") for row in self.rows]
        record = eval_record(stats, samples, config.teacher_ids, answers=answers, tokenizer=self.tokenizer,
                             failed=len(self.rows) - len(samples))
        if self.too_long:
            record["eval/too_long_total"] = float(self.too_long)
        return record


# A served model that is not the evaluated one shows gaps of whole nats; the same weights agree to ~1e-6 in fp32 and
# to ~1e-2 with a bf16 server.
SERVED_MODEL_GAP_WARNING = 0.1


def hidden_teacher_heads(config: Any, *, vocab_size: int, dtype: torch.dtype,
                         device: torch.device) -> dict[int, TeacherHead]:
    """Teacher index -> :class:`~fastdistill.train.teacher_head.TeacherHead` of each hidden-state teacher of
    ``config`` (an :class:`~fastdistill.train.AsyncDistillationConfig`), as the trainer loads them: the folder from
    ``teacher_model_paths`` or the one its server serves, at least ``vocab_size`` rows (the student's head), the width
    its server sends (asked with one one-token request per teacher), in ``dtype`` on ``device``: pass the student's
    compute dtype (the dense loss uses one dtype on both sides; :class:`~fastdistill.train.model.DistillationModel`
    converts a head in another dtype once, on first use). Empty without hidden teachers; ConfigError naming the
    teacher otherwise."""
    if not config.hidden_teacher_ids:
        return {}
    served, widths = served_hidden_teachers(config)
    return load_teacher_heads(config, Distributed(rank=0, world_size=1, device=device), served, widths,
                              vocab_size=vocab_size, dtype=dtype)


def evaluate_saved_model(config: Any, rows: Any = None, *, model_dir: str | None = None,
                         show_completions: bool = True) -> dict[str, Any]:
    """Held-out evaluation of a saved model (what ``fastdistill eval`` runs): the student server
    (``config.vllm_server_base_url``, which should serve that model) answers every row greedily, the row's teacher
    scores it, and the model loaded from ``model_dir`` (default ``config.model_name_or_path``) measures the sparse
    generalized JSD at ``config.beta`` (on a hidden-state teacher's rows the full-vocabulary one, with the teacher
    head loaded as the trainer loads it: :func:`hidden_teacher_heads`, before any row is generated).

    ``config`` is an :class:`~fastdistill.train.AsyncDistillationConfig` (servers, keys, ``teacher_top_k``,
    ``teacher_signal``, ``teacher_model_paths``, ``teacher_hidden_dtype``, ``max_completion_length``,
    ``loss_backend``, ``dtype``, ``chat_template_kwargs``); ``rows`` anything
    ``eval_dataset`` accepts (default: ``config.eval_dataset``, its ``dataset_test_split``). Returns the ``eval/...``
    metrics of :func:`eval_record`, ``served_logprob_gap`` (max |served − local| log-prob on two prompts: a large
    value means the server does not serve ``model_dir``, and a warning is logged), and with ``show_completions`` one
    entry per row (dataset index, teacher, decoded completion, answer)."""
    if model_dir is not None:
        config = dataclasses.replace(config, model_name_or_path=str(model_dir))
    if rows is None:
        if config.eval_dataset is None:
            raise ConfigError("no held-out rows: pass --dataset FILE (or set eval_dataset in the config)")
        rows = config.eval_dataset
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(config)
    model = load_model(config, device).to(device).eval()
    head = model.get_output_embeddings().weight
    distillation = DistillationModel(model, config)
    distillation.teacher_heads = hidden_teacher_heads(config, vocab_size=head.shape[0], dtype=head.dtype,
                                                      device=device)
    distillation.cross_teachers = load_cross_teachers(config, tokenizer, vocab_size=head.shape[0], device=device)
    teacher_ids = config.teacher_ids
    prepared = prepare_eval_rows(rows, tokenizer, teacher_ids, split=config.dataset_test_split,
                                 dataset_config=config.dataset_config,
                                 chat_template_kwargs=config.chat_template_kwargs)
    samples = collect_held_out(config, prepared)
    if not samples:
        raise RolloutsFailingError(f"the rollout of every one of the {len(prepared)} held-out rows failed (the "
                                   "warnings above name each server's answer)")
    with torch.no_grad():
        stats = divergence_stats(distillation, samples, teacher_ids, beta=config.beta, device=device,
                                 vocab_size=head.shape[0])
        probes = [s.input_ids.tolist() for s in samples[:2]]
        gap = served_logprob_gap(config.vllm_server_base_url, model, probes, api_key=config.vllm_server_api_key)
    if gap > SERVED_MODEL_GAP_WARNING:
        logger.warning("the student server at %s does not seem to serve %s: its log-probs differ from the local "
                       "model's by up to %.3g nats; the divergence was measured with %s's weights on another model's "
                       "completions", config.vllm_server_base_url, config.model_name_or_path, gap,
                       config.model_name_or_path)
    answers = [row["answer"] for row in prepared]
    result: dict[str, Any] = {"model": str(config.model_name_or_path), "student_url": config.vllm_server_base_url,
                              "teacher_urls": dict(config.teacher_server_urls), "beta": config.beta,
                              "teacher_top_k": config.teacher_top_k,
                              "max_completion_length": config.max_completion_length}
    result.update(eval_record(stats, samples, teacher_ids, answers=answers, tokenizer=tokenizer,
                              failed=len(prepared) - len(samples)))
    result["served_logprob_gap"] = gap
    if show_completions:
        texts = completion_texts(samples, tokenizer)
        result["completions"] = [
            {"dataset_index": sample.dataset_index, "teacher_id": sample.teacher_id, "completion": text,
             "answer": prepared[sample.dataset_index]["answer"]}
            for sample, text in zip(samples, texts, strict=True)]
    return result
