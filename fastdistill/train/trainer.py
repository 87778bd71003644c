"""The training loop: rank 0 pulls scored samples, every rank trains its packed row, weights flow back to vLLM.

One step = ``gradient_accumulation_steps`` micro-batches. Rank 0's :class:`~fastdistill.train.collector.
WindowCollector` takes samples from the rollout worker (or any source), drops stale ones, fills micro-batches (one row
per rank) and decides when the run is over; rank 0 scatters each rank its rows. Every rank packs its rows (no
padding, ``position_ids`` restart per sample), runs the backbone with no attention mask and the fused sparse-JSD loss
on the trained positions, scaled by the window's token count across ranks (a token mean over the whole step). After
the optimizer step, every ``weight_sync_steps`` steps the weights are pushed into the student's vLLM server and the
model version advances.

Launch with ``torchrun --nproc-per-node N`` (FSDP2 ``fully_shard`` per decoder layer and the root; gloo on CPU,
NCCL on GPU) or as a plain single process (no sharding).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fastdistill.data.batching import FixedCountBatcher, TokenBudgetBatcher
from fastdistill.data.batching import microbatch_metrics as batch_metrics
from fastdistill.data.packing import PackedRow, pack_row
from fastdistill.loss import narrow_support, scored_positions, window_loss_scale, window_token_count
from fastdistill.rollout import OnPolicyShare, PromptTable, RolloutSample
from fastdistill.rollout.dropped import TOO_LONG, DroppedPrompt
from fastdistill.train.checkpoint import RolloutState, export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from fastdistill.train.collector import Window, WindowCollector
from fastdistill.train.config import AsyncDistillationConfig, ConfigError
from fastdistill.train.distributed import broadcast_samples, init_distributed, scatter_samples
from fastdistill.train.ledger import DROPPED_PROMPTS_FILE, RunLedger, data_identity, resume_problem
from fastdistill.train.metrics import MetricsLogger
from fastdistill.train.model import (
    WRAPPER_PREFIX,
    DistillationModel,
    check_master_weights,
    load_model,
    load_tokenizer,
    prepare_student,
)
from fastdistill.train.schedule import LRSchedule
from fastdistill.train.source import CacheSource, ListSource, MixedSource, SynchronousSource, WorkerSource
from fastdistill.train.timing import PhaseClock

__all__ = ["AsyncDistillationTrainer", "DistillationModel"]

logger = logging.getLogger(__name__)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class AsyncDistillationTrainer:
    """Asynchronous on-policy distillation of the student at ``config.model_name_or_path``.

    Args:
        config: the run's :class:`AsyncDistillationConfig`.
        train_dataset: a ``datasets.Dataset`` (columns ``prompt`` (messages or text), ``messages`` or
            ``prompt_ids``, optional ``teacher_id``; see docs/data.md) or a list of rows ``{"prompt": messages | str,
            "teacher_id"?}`` / ``{"prompt_ids": [...]}``; defaults to ``config.train_dataset`` (a file, a dataset
            folder or a Hugging Face dataset name, split ``config.dataset_train_split``). Needed on rank 0 only.
        eval_dataset: held-out rows of the same kinds; defaults to ``config.eval_dataset`` (split
            ``config.dataset_test_split``). Evaluated at the start, every ``config.eval_steps`` steps and at the end
            (see :meth:`evaluate`).
        model, tokenizer: already loaded ones (else loaded from ``model_name_or_path``).
        samples: a finite iterable of :class:`~fastdistill.rollout.RolloutSample` (and
            :class:`~fastdistill.rollout.dropped.DroppedPrompt` notices) to train on instead of a rollout worker
            (offline replays and tests); no server is contacted unless weight sync is configured.
        weight_sync: an object with ``init()``, ``push(model, version) -> dict`` and ``close()``; default: vLLM's
            weight-transfer API on the student server (``config.weight_sync_backend``).
        on_step_end: called on rank 0 with ``(step, metrics)`` every time metrics are logged.

    With ``max_steps=-1`` the run trains every prompt of ``num_train_epochs`` epochs once (or lists it in
    ``<output_dir>/dropped_prompts.jsonl``) and then ends; the learning-rate schedule's length is estimated from the
    samples per step seen so far and is exact on the last step.
    """

    def __init__(
        self,
        config: AsyncDistillationConfig,
        *,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        samples: Sequence[RolloutSample | DroppedPrompt] | None = None,
        weight_sync: Any = None,
        on_step_end: Callable[[int, dict[str, float]], None] | None = None,
    ):
        self.config = config
        self.dist = init_distributed()
        if config.weight_sync_overlap and self.dist.world_size > 1:
            raise ValueError("weight_sync_overlap=True needs a single trainer process (its snapshot is gathered on the "
                             "training thread, but a sharded push would run collectives from another thread)")
        _seed_everything(config.seed)
        self.output_dir = Path(config.output_dir)
        self.teacher_ids = config.teacher_ids
        self.on_step_end = on_step_end
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
        hf_model = model if model is not None else load_model(config, self.dist.device)
        # teacher candidates at or beyond the student's lm_head rows are folded into the teacher's tail
        self.student_vocab_size = int(hf_model.get_output_embeddings().weight.shape[0])
        self._warned_out_of_vocab: set[str] = set()
        self.master_weights_warning = check_master_weights(hf_model, config)
        self.model, self.hf_model = prepare_student(hf_model, config, self.dist.device, self.dist.world_size,
                                                    self._use_bf16())
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay,
        )
        self._samples = samples
        self.rows = None
        self.cache = self._open_cache() if config.teacher_cache is not None and self.dist.is_main else None
        # no server is asked for samples: given samples, or a teacher cache without on-policy share
        offline = samples is not None or (config.teacher_cache is not None and not config.mixes_on_policy)
        self._offline = offline
        self._served_hidden_widths: dict[str, int] = {}  # hidden-state teacher id -> served width (rank 0)
        if self.cache is not None and not offline:  # a mixed run generates from the cached prompts
            self.rows = PromptTable.from_rows([{"prompt_ids": s.input_ids[:s.prompt_length].tolist()}
                                               for s in self.cache])
        elif not offline and self.dist.is_main:
            self.rows = self._tokenized_rows(train_dataset)
        if samples is not None:
            num_prompts = len(samples)
        elif self.cache is not None:
            num_prompts = len(self.cache)
        else:
            num_prompts = len(self.rows) if self.rows is not None else 0
        self.num_prompts = self.dist.broadcast(num_prompts)
        self.eval_rows = self._eval_rows(eval_dataset) if self.dist.is_main else None
        self.has_eval = self.dist.broadcast(bool(self.eval_rows))
        self._last_eval_step: int | None = None
        # With max_steps=-1: an estimate (exact for the fixed-count batcher), corrected as rows are packed.
        self.max_steps = config.resolved_max_steps(self.num_prompts, self.dist.world_size)
        # Prompts to train: every prompt of every epoch (a fractional last epoch rounds up); unbounded with max_steps.
        self.total_prompts = (math.ceil(config.num_train_epochs * self.num_prompts) if config.max_steps == -1
                              else None)
        self.on_policy = self._on_policy_share() if config.mixes_on_policy else None
        warmup = config.warmup_steps or math.ceil(config.warmup_ratio * self.max_steps)
        self.scheduler = LRSchedule(self.optimizer, config.lr_scheduler_type, self.max_steps, warmup)
        from fastdistill.train.flops import peak_flops

        compute_dtype = torch.bfloat16 if self._use_bf16() else next(self.hf_model.parameters()).dtype
        self.peak_flops = peak_flops(self.dist.device, compute_dtype)  # None on CPU: no MFU metrics
        self.weight_sync = weight_sync
        # the logged divergence: the sparse JSD, or the sampled reverse-KL estimate of reverse_kl_pg
        self._divergence_name = "jsd" if config.loss_type == "jsd" else "reverse_kl"
        self.worker = None
        self.source: Any = None
        self.collector: WindowCollector | None = None
        self._pending_sync = None  # the background push under weight_sync_overlap
        self._sync_thread = None
        self.step = 0
        self.model_version = 0
        self.rollout_state = RolloutState()
        self._session_steps = 0  # steps trained by this process (for the step-count estimate)
        self._session_samples = 0
        self.dropped_total = 0
        self.clock = PhaseClock()  # where the run's seconds go (train_summary.json "time_s", perf/*_s per step)
        self._window_wait_s = 0.0  # rank 0: seconds the last window collection waited for rollouts
        self._student_model_name: str | None = None  # the student server's model id (known after the server check)

    # ------------------------------------------------------------------------------------------------ setup

    def _use_bf16(self) -> bool:
        return self.config.bf16 if self.config.bf16 is not None else self.dist.device.type == "cuda"

    def _open_cache(self) -> Any:
        """Rank 0: the ``teacher_cache`` folder, its shards checked against the manifest's checksums and its tokenizer
        against the student's (ConfigError otherwise)."""
        from fastdistill.cache import CacheError, TeacherCache

        if len(self.teacher_ids) != 1:
            raise ConfigError(f"teacher_cache holds one teacher's scores; teacher_server_urls names "
                              f"{len(self.teacher_ids)} teachers ({self.teacher_ids})")
        try:
            cache = TeacherCache(self.config.teacher_cache)
        except CacheError as error:
            raise ConfigError(f"teacher_cache: {error}") from error
        cache.check_tokenizer(self.tokenizer)
        cache.check_loss_settings(beta=self.config.beta, add_tail_bucket=self.config.add_tail_bucket)
        return cache

    def _tokenized_rows(self, rows: Any) -> PromptTable:
        from fastdistill.data.sources import prepare_prompts

        if rows is None:
            if self.config.train_dataset is None:
                raise ValueError("no training data: pass train_dataset= (a datasets.Dataset or a list of rows "
                                 "{'prompt': ..., 'teacher_id': ...}) or set config.train_dataset to a file, a dataset "
                                 "folder or a Hugging Face dataset name")
            rows = self.config.train_dataset
        config = self.config
        return prepare_prompts(rows, self.tokenizer, what="train_dataset", split=config.dataset_train_split,
                               dataset_config=config.dataset_config, chat_template_kwargs=config.chat_template_kwargs)

    def _eval_rows(self, rows: Any) -> list[dict[str, Any]] | None:
        """Rank 0: the tokenised held-out rows, each routed to its teacher, with their optional ``answer`` (None
        without an eval dataset)."""
        from fastdistill.train.evaluate import prepare_eval_rows

        config = self.config
        if rows is None:
            if config.eval_dataset is None:
                return None
            rows = config.eval_dataset
        return prepare_eval_rows(rows, self.tokenizer, self.teacher_ids, split=config.dataset_test_split,
                                 dataset_config=config.dataset_config,
                                 chat_template_kwargs=config.chat_template_kwargs)

    # ---------------------------------------------------------------------------------------------- the run

    def train(self) -> dict[str, Any]:
        """Run until every prompt of ``num_train_epochs`` is trained or dropped (or ``max_steps``); return a
        summary."""
        config = self.config
        resume = self._resume_path()
        ledger = RunLedger(self.output_dir)
        data = None
        if self.dist.is_main:  # the data a checkpoint of this run records, and checks on resume
            data = data_identity(config, samples=self._samples, cache=self.cache, rows=self.rows)
        # rank 0 judges; every rank raises its verdict (the others would otherwise wait in the next collective)
        problem = self.dist.broadcast(resume_problem(ledger, resume, data, config.resume_from_checkpoint)
                                      if self.dist.is_main else None)
        if problem is not None:
            raise ConfigError(problem)
        if resume is not None:
            state = load_checkpoint(resume, self.model, self.optimizer, self.scheduler)
            self.step, self.model_version, self.rollout_state = state.step, state.model_version, state.rollout
            if self.dist.is_main:
                ledger.truncate(self.step)
        self.rollout_state.data = data.to_json() if data is not None else None
        self.metrics = MetricsLogger(
            self.output_dir, total_steps=self.max_steps, is_main=self.dist.is_main, report_to=config.report_to,
            run_name=config.run_name, config=config.to_dict(), disable_progress=config.disable_tqdm,
            initial_step=self.step,
        )
        started = time.perf_counter()
        clock = self.clock
        clock.start()
        clock.take_step()
        trained_tokens = 0
        try:
            with clock.phase("startup"):
                self._start_pipeline()
            if self.has_eval and self.step == 0:
                with clock.phase("eval"):
                    self.metrics.update(self.evaluate())
                with clock.phase("logging"):
                    self._log_metrics()
            clock.take_step()  # a step's phases run from the previous step's end to its own
            last_step_end = time.perf_counter()
            while config.max_steps == -1 or self.step < config.max_steps:
                with clock.phase("collect"):
                    mine = self._next_window()
                clock.move("collect", "rollout_wait", self._window_wait_s)
                if mine is None:
                    break
                rows, total_steps = mine
                if total_steps != self.scheduler.total_steps:
                    self.scheduler.total_steps = total_steps
                    self.metrics.set_total(total_steps)
                record = self._train_step(rows)
                trained_tokens += int(record.get("batch/trained_tokens_per_step", 0))
                self.step += 1
                if self.step % config.weight_sync_steps == 0:
                    record.update(self._sync_weights())
                now = time.perf_counter()
                record["perf/step_s"] = now - last_step_end
                record["perf/trained_tok_s_wall_clock"] = record.get("batch/trained_tokens_per_step", 0) / max(
                    record["perf/step_s"], 1e-9)
                record.update(self._mfu(record))
                record.update(self._phase_record(record["perf/step_s"]))
                last_step_end = now
                self.metrics.update(record)  # every step: values between two logging steps are reduced together
                last = self.step == self.scheduler.total_steps  # the schedule's length is exact on the last step
                evaluate = self.has_eval and (last or (config.eval_steps is not None
                                                       and self.step % config.eval_steps == 0))
                if evaluate:
                    with clock.phase("eval"):
                        self.metrics.update(self.evaluate())
                if evaluate or self.step % config.logging_steps == 0:
                    with clock.phase("logging"):
                        self._log_metrics()
                if config.save_strategy == "steps" and self.step % config.save_steps == 0:
                    with clock.phase("checkpoint"):
                        self.save()
            if self.has_eval and self._last_eval_step != self.step:  # a source that ended without notice
                with clock.phase("eval"):
                    self.metrics.update(self.evaluate())
            if self.metrics.has_values():  # the last step, when it is not a logging step
                with clock.phase("logging"):
                    self._log_metrics()
            elapsed = time.perf_counter() - started
            with clock.phase("export"):
                if config.export_final_model and config.lora_r > 0:
                    from fastdistill.train.lora import export_merged

                    export_merged(self.hf_model, self.tokenizer, self.output_dir / "final", self.dist.is_main)
                elif config.export_final_model:
                    export_hf(self.model, self.hf_model, self.tokenizer, self.output_dir / "final", WRAPPER_PREFIX)
        finally:
            stopping = time.perf_counter()
            try:
                with clock.phase("shutdown"):
                    self._stop_pipeline()
            finally:
                self.metrics.close()
                self.shutdown_s = time.perf_counter() - stopping
                clock.stop()
        summary = {"steps": self.step, "model_version": self.model_version, "train_seconds": elapsed,
                   "wall_seconds": time.perf_counter() - started, "shutdown_s": self.shutdown_s,
                   "dropped_stale_total": getattr(self.source, "dropped_stale_total", 0),
                   "dropped_prompts_total": self.dropped_total,
                   "trained_tokens": trained_tokens, "trained_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
                   "prompt_index": self.rollout_state.prompt_index, "time_s": self.clock.totals()}
        if self.dist.is_main:
            (self.output_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
            if self.dropped_total:
                logger.warning("%d prompt(s) were not trained; they are listed in %s", self.dropped_total,
                               self.output_dir / DROPPED_PROMPTS_FILE)
        return summary

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out on-policy evaluation (collective: every rank calls it). Rank 0 asks the student server for a
        greedy completion of every eval row (up to ``max_completion_length`` tokens) and the row's teacher to score
        it; each rank measures its share with the trainer's current weights. The served weights are those of the last
        sync (``weight_sync_steps``; with ``lora_sync="adapter"`` the newest adapter generates). Returns
        ``eval/jsd`` (the sparse generalized JSD at ``beta``, the dense one for a hidden-state teacher's rows, nats
        per scored token), ``eval/teacher_jsd/<id>`` with
        several teachers, ``eval/completion_length_mean``, ``eval/samples_total`` and ``eval/exact_match`` when the
        rows carry an ``answer`` (:func:`~fastdistill.train.evaluate.eval_record`)."""
        from fastdistill.train import evaluate as held_out

        config = self.config
        samples = None
        if self.dist.is_main:
            samples = held_out.collect_scored_samples(
                config.vllm_server_base_url, config.teacher_server_urls, self.eval_rows,
                top_k=config.teacher_top_k, max_tokens=config.max_completion_length, seed=config.seed,
                student_api_key=config.vllm_server_api_key, teacher_api_keys=config.teacher_api_keys,
                student_model=getattr(self.weight_sync, "served_model_name", None),
                teacher_signals={t: config.teacher_signal_of(t) for t in self.teacher_ids},
                hidden_dtype=config.teacher_hidden_dtype)
        samples = broadcast_samples(self.dist, samples)  # the arrays as tensors, not pickles
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            stats = held_out.divergence_stats(
                self.model, samples, self.teacher_ids, beta=config.beta, device=self.dist.device,
                vocab_size=self.student_vocab_size, rank=self.dist.rank, world_size=self.dist.world_size,
                bf16=self._use_bf16() and self.dist.world_size == 1)
        finally:
            self.hf_model.train(was_training)
        stats = self.dist.all_reduce_sum(stats)
        self._last_eval_step = self.step
        if not self.dist.is_main:
            return {}
        answers = [row.get("answer") for row in self.eval_rows]
        return held_out.eval_record(stats, samples, self.teacher_ids, answers=answers, tokenizer=self.tokenizer)

    def _log_metrics(self) -> None:
        logged = self.metrics.log(self.step)
        if self.on_step_end is not None and self.dist.is_main:
            self.on_step_end(self.step, logged)

    def _mfu(self, record: dict[str, float]) -> dict[str, float]:
        """``perf/mfu_fwd_bwd`` and ``perf/mfu_wall_clock`` in % of the devices' dense peak (when it is known)."""
        from fastdistill.train.flops import flops_per_token

        tokens, samples = record.get("batch/forwarded_tokens_per_step", 0.0), record.get("batch/samples_per_step", 0.0)
        if self.peak_flops is None or not tokens or not samples:
            return {}
        flops = flops_per_token(self.hf_model.config, tokens / samples) * tokens
        total_peak = self.peak_flops * self.dist.world_size
        return {"perf/mfu_fwd_bwd": 100.0 * flops / max(record["perf/fwd_bwd_s"], 1e-9) / total_peak,
                "perf/mfu_wall_clock": 100.0 * flops / max(record["perf/step_s"], 1e-9) / total_peak}

    def _phase_record(self, step_s: float) -> dict[str, float]:
        """``perf/<phase>_s`` for the phases of this step's window (from the previous step's end: its evaluation,
        logging and checkpoint, then this step's collection, packing, ... weight sync) and ``perf/other_s``, the
        step's seconds no phase measured, so that they add up to ``perf/step_s``."""
        phases = self.clock.take_step()
        record = {f"perf/{name}_s": seconds for name, seconds in phases.items()}
        record["perf/other_s"] = step_s - sum(phases.values())
        return record

    def _resume_path(self) -> Path | None:
        value = self.config.resume_from_checkpoint
        if value is None:
            return None
        if value in ("latest", "true", "True"):
            return latest_checkpoint(self.output_dir)
        path = Path(value)
        if not path.is_dir():
            raise FileNotFoundError(f"resume_from_checkpoint={value!r} is not a checkpoint folder")
        return path

    def save(self) -> Path:
        """Write ``checkpoint-<step>`` (collective)."""
        return save_checkpoint(self.output_dir, self.step, self.model, self.optimizer, self.scheduler,
                               self.model_version, self.rollout_state, self.config.save_total_limit)

    # ---------------------------------------------------------------------------------------- pipeline parts

    def _start_pipeline(self) -> None:
        """Rank 0: server checks and the window collector; all ranks: weight-sync group and cold sync (version →
        version + 1); then rank 0's source (the rollout worker, synchronous waves or the given samples)."""
        config = self.config
        skip_rows: frozenset[int] = frozenset()
        if self.dist.is_main:
            served = self._check_servers() if not self._offline else None
            if served is not None:
                self._student_model_name = served["student"].name
            token_budget = config.token_budget
            if token_budget is None:  # the student server's max_model_len (no bound for offline samples)
                token_budget = served["student"].max_model_len if served is not None else 0
            self.token_budget = token_budget
            self.collector = WindowCollector(
                total_prompts=self.total_prompts, world_size=self.dist.world_size,
                microbatches_per_step=config.gradient_accumulation_steps, make_batcher=self._new_batcher,
                state=self.rollout_state, token_budget=token_budget if token_budget > 0 else None)
            if served is not None:
                skip_rows = self._skip_long_prompts(served)
        self._load_teacher_heads(served if self.dist.is_main else None)
        if self.weight_sync is None and not self._offline:
            from fastdistill.sync import weight_sync_from_config

            self.weight_sync = weight_sync_from_config(config, device_type=self.dist.device.type,
                                                       is_sender=self.dist.is_main)
        if self.weight_sync is not None:
            self.weight_sync.init()
            self._sync_weights()
        if not self.dist.is_main:
            return
        if self._samples is not None:
            self.source = ListSource(self._samples)
        elif self.cache is not None and self._offline:
            self.source = self._cache_source()
        elif not config.async_mode:
            self.source = SynchronousSource(self.rows, self._rollout_config(skip_rows),
                                            config.samples_per_step(self.dist.world_size))
        else:
            from fastdistill.rollout import RolloutWorker

            self.worker = RolloutWorker(self._rollout_config(skip_rows), self.rows,
                                        queue_maxsize=config.resolved_queue_maxsize(self.dist.world_size))
            self.worker.model_version = self.model_version  # the version the cold sync just made the server serve
            self.worker.start()
            self.source = WorkerSource(
                self.worker, max_staleness=config.max_staleness, stale_policy=config.stale_policy,
                heartbeat_stale_after_s=config.heartbeat_stale_after_s,
            )
            if self.cache is not None:
                self.source = MixedSource(self.source, self._cache_source(), self.on_policy,
                                          first_prompt=self.rollout_state.prompt_index,
                                          candidate_width=max(self.cache.candidate_width, config.teacher_top_k + 1))

    def _load_teacher_heads(self, served: dict[str, Any] | None) -> None:
        """Every rank: the lm_head of each hidden-state teacher, in the student head's dtype on the training device,
        into ``DistillationModel.teacher_heads`` (not parameters: never trained, never saved). Rank 0 picks the
        folders (``teacher_model_paths``, else the id the teacher server reports when it is a local folder) and
        checks that each head covers the student's vocabulary and takes the width its server sends
        (:func:`~fastdistill.train.teacher_head.load_hidden_teacher_head`); ConfigError otherwise."""
        hidden_ids = self.config.hidden_teacher_ids
        if not hidden_ids:
            return
        from fastdistill.train.teacher_head import load_hidden_teacher_head, teacher_head_folder

        folders = None
        if self.dist.is_main:
            folders = {teacher_id: teacher_head_folder(teacher_id, self.config.teacher_model_paths,
                                                       served[teacher_id].name if served is not None else None)
                       for teacher_id in hidden_ids}
        # rank 0's served widths (from _check_servers; empty offline) go with the folders, so that every rank runs
        # the same checks and a mismatch stops all of them rather than leaving the others at their next collective
        folders, widths = self.dist.broadcast((folders, self._served_hidden_widths))
        dtype = self.hf_model.get_output_embeddings().weight.dtype
        self.model.teacher_heads = {
            self.teacher_ids.index(teacher_id): load_hidden_teacher_head(
                teacher_id, folder, vocab_size=self.student_vocab_size, dtype=dtype, device=self.dist.device,
                served_width=widths.get(teacher_id))
            for teacher_id, folder in folders.items()}

    def _on_policy_share(self) -> OnPolicyShare:
        """The prompts a mixed run generates on-policy: ``lmbda`` of them, or a share annealed from ``lmbda`` to
        ``lmbda_final`` over the run's prompts (every prompt of every epoch with ``max_steps=-1``, else
        ``max_steps`` × batch × GA × world, an estimate under a token budget; later prompts keep ``lmbda_final``)."""
        config = self.config
        if config.lmbda_final is None:
            return OnPolicyShare(config.lmbda)
        horizon = self.total_prompts or config.max_steps * config.samples_per_step(self.dist.world_size)
        return OnPolicyShare(config.lmbda, config.lmbda_final, max(1, horizon))

    def _cache_source(self) -> CacheSource:
        """Rank 0: the teacher cache's rows from the resume point on (the off-policy share with ``lmbda`` > 0)."""
        config = self.config
        return CacheSource(self.cache, seed=config.seed, shuffle=config.shuffle,
                           start_index=self.rollout_state.prompt_index, end_index=self.total_prompts,
                           skip_prompt_ids=frozenset(self.rollout_state.trained_after), teacher_id=self.teacher_ids[0],
                           on_policy=self.on_policy)

    def _new_batcher(self) -> Any:
        if self.token_budget > 0:
            return TokenBudgetBatcher(self.token_budget, self.dist.world_size)
        return FixedCountBatcher(self.config.per_device_train_batch_size, self.dist.world_size)

    def _rollout_config(self, skip_rows: frozenset[int] = frozenset()) -> Any:
        from fastdistill.rollout import RetryPolicy, RolloutConfig
        from fastdistill.rollout.adapters import ADAPTER_PREFIX

        config = self.config
        eos = getattr(self.hf_model.generation_config, "eos_token_id", None) if hasattr(
            self.hf_model, "generation_config") else None
        eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids = (self.tokenizer.eos_token_id, *eos_ids)
        return RolloutConfig(
            student_url=config.vllm_server_base_url,
            teacher_urls=config.teacher_server_urls,
            teacher_top_k=config.teacher_top_k,
            max_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=-1 if config.top_k == 0 else config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            max_inflight_tasks=config.resolved_max_inflight_tasks(self.dist.world_size),
            initial_inflight_tasks=min(config.samples_per_step(self.dist.world_size),
                                       config.resolved_max_inflight_tasks(self.dist.world_size)),
            max_lookahead=config.resolved_max_lookahead(self.dist.world_size),
            shuffle=config.shuffle,
            seed=config.seed,
            start_index=self.rollout_state.prompt_index,
            end_index=self.total_prompts,
            skip_prompt_ids=frozenset(self.rollout_state.trained_after),
            skip_rows=skip_rows,
            on_policy=self.on_policy,
            eos_token_ids=eos_ids,
            student_api_key=config.vllm_server_api_key,
            student_adapter_prefix=ADAPTER_PREFIX if self._adapter_sync else None,
            teacher_api_keys=config.teacher_api_keys,
            teacher_signals={teacher_id: config.teacher_signal_of(teacher_id) for teacher_id in self.teacher_ids},
            teacher_hidden_dtype=config.teacher_hidden_dtype,
            retry=RetryPolicy(request_timeout_s=config.request_timeout),
        )

    def _check_servers(self) -> dict[str, Any]:
        """Before any rollout: the servers are up and every teacher tokenizes like the student; each hidden-state
        teacher's served width goes to ``_served_hidden_widths`` (one one-token request). Returns each server's
        :class:`~fastdistill.rollout.ServedModel` (``"student"`` and the teacher ids)."""
        from fastdistill.rollout import StudentClient, TeacherClient, check_shared_vocabulary
        from fastdistill.rollout.hidden import HiddenTeacherClient

        config = self.config
        teacher_keys = config.teacher_api_keys or {}

        async def check() -> dict[str, Any]:
            async with StudentClient(config.vllm_server_base_url, api_key=config.vllm_server_api_key) as student:
                await student.wait_until_healthy(config.vllm_server_timeout)
                served = {"student": await student.served_model()}
                teachers = {}
                try:
                    for teacher_id, urls in config.teacher_server_urls.items():
                        hidden = config.teacher_signal_of(teacher_id) == "hidden"
                        client = HiddenTeacherClient if hidden else TeacherClient
                        teachers[teacher_id] = client(urls, api_key=teacher_keys.get(teacher_id))
                        await teachers[teacher_id].wait_until_healthy(config.vllm_server_timeout)
                        served[teacher_id] = await teachers[teacher_id].served_model()
                        if hidden:  # checked against the teacher head's width before any rollout
                            self._served_hidden_widths[teacher_id] = await teachers[teacher_id].served_width()
                    await check_shared_vocabulary(student, teachers)
                finally:
                    for teacher in teachers.values():
                        await teacher.close()
                return served

        return asyncio.run(check())

    def _skip_long_prompts(self, served: dict[str, Any]) -> frozenset[int]:
        """Rank 0: the dataset rows whose prompt plus ``max_completion_length`` cannot fit the student's
        ``max_model_len``, or the row's teacher's (which scores prompt + completion and asks for one more token).

        Without ``skip_long_prompts`` any such row is a :class:`ConfigError`; with it, the rows are never dispatched,
        each of their prompts in this run counts as done and is listed in ``dropped_prompts.jsonl``."""
        config = self.config
        completion = config.max_completion_length
        teacher_ids = self.teacher_ids
        limits: dict[int, tuple[str, int, int]] = {}  # row -> (server, needed tokens, its max_model_len)
        for index, prompt in enumerate(self.rows.lengths.tolist()):  # not the rows: that would read every prompt
            teacher_id = self.rows.teacher_id(index) if len(teacher_ids) > 1 else teacher_ids[0]
            checks = [("student", prompt + completion, served["student"].max_model_len),
                      (f"teacher {teacher_id}", prompt + completion + 1, served[teacher_id].max_model_len)]
            for server, needed, limit in checks:
                if needed > limit:
                    limits[index] = (server, needed, limit)
                    break
        if not limits:
            return frozenset()
        longest = max(limits, key=lambda i: len(self.rows[i]["prompt_ids"]))
        server, needed, limit = limits[longest]
        what = (f"{len(limits)} of {len(self.rows)} prompts do not fit the servers: the longest has "
                f"{len(self.rows[longest]['prompt_ids'])} tokens (row {longest}); with max_completion_length="
                f"{completion} it needs {needed} tokens, but the {server} server serves max_model_len={limit}")
        if len(limits) == len(self.rows):
            raise ConfigError(f"{what}. No prompt can be trained: lower max_completion_length or raise the servers' "
                              "--max-model-len.")
        if not config.skip_long_prompts:
            raise ConfigError(f"{what}. Lower max_completion_length, raise the servers' --max-model-len, or set "
                              "skip_long_prompts=True to skip these prompts (they are listed in "
                              f"{DROPPED_PROMPTS_FILE}).")
        logger.warning("%s; skipping them (skip_long_prompts=True)", what)
        skip = frozenset(limits)
        if self.total_prompts is not None:  # their prompts in this run are done, once
            from fastdistill.rollout import epoch_order

            num_rows = len(self.rows)
            drops = []
            for epoch in range(math.ceil(self.total_prompts / num_rows)):
                order = epoch_order(num_rows, config.seed, epoch, config.shuffle)
                positions = np.nonzero(np.isin(order, list(skip)))[0]
                for position in positions:
                    prompt_id = epoch * num_rows + int(position)
                    if prompt_id < self.total_prompts and not self.rollout_state.is_trained(prompt_id):
                        self.rollout_state.add(prompt_id)
                        row = int(order[position])
                        server, needed, limit = limits[row]
                        drops.append(DroppedPrompt(prompt_id=prompt_id, dataset_index=row, reason=TOO_LONG,
                                                   server=server, message=f"needs {needed} tokens > max_model_len="
                                                   f"{limit} (prompt + max_completion_length={completion})"))
            self._record_drops(drops, step=self.step)
        return skip

    def _record_drops(self, drops: list[DroppedPrompt], step: int) -> None:
        """Rank 0: log each dropped prompt once and append it to ``dropped_prompts.jsonl`` with the step whose window
        was being collected (so that a resume from an earlier checkpoint forgets it)."""
        if not drops:
            return
        self.dropped_total += len(drops)
        for drop in drops:
            if drop.reason != TOO_LONG:  # those are summarised in one warning
                logger.warning("prompt %s (dataset row %d) will not be trained: %s by %s: %s", drop.prompt_id,
                               drop.dataset_index, drop.reason, drop.server or "the batcher", drop.message)
        RunLedger(self.output_dir).append_drops(step, drops)

    def _stop_pipeline(self) -> None:
        """Stop everything that was started, each part even when an earlier one raises (an error
        propagates once all have run): the background push, the rollout worker, the synchronous source's clients and
        the weight-sync group."""
        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            if self.weight_sync is not None:
                stack.callback(self.weight_sync.close)
            if isinstance(self.source, SynchronousSource):
                stack.callback(self.source.close)
            if self.worker is not None:
                stack.callback(self._stop_worker)
            if self._sync_thread is not None:
                stack.callback(self._sync_thread.shutdown)
            if self._pending_sync is not None:
                pending, self._pending_sync = self._pending_sync, None
                stack.callback(pending.result)

    def _stop_worker(self) -> None:
        worker, self.worker = self.worker, None
        worker.stop()

    @property
    def _adapter_sync(self) -> bool:
        """Whether syncs send the LoRA adapter alone and generations name it (``lora_sync="adapter"``)."""
        return self.config.lora_r > 0 and self.config.lora_sync == "adapter"

    def _sync_weights(self) -> dict[str, float]:
        if self.weight_sync is None:
            return {}
        if self.config.weight_sync_overlap and self.model_version > 0:
            return self._sync_weights_in_background()
        with self.clock.phase("weight_sync"):
            timings = dict(self.weight_sync.push(self._servable(), self.model_version + 1) or {})
        self.model_version += 1
        if self.worker is not None:
            self.worker.model_version = self.model_version
        if self.config.verify_weight_sync and self.rows:
            with self.clock.phase("sync_verify"):
                timings["sync/served_logprob_gap"] = self._served_gap()
        return timings

    def _servable(self) -> Any:
        """What the server should serve: the model itself, or with LoRA its merged weights (a stream that merges one
        tensor at a time), or with ``lora_sync="adapter"`` a copy of the adapter."""
        if self._adapter_sync:
            from fastdistill.sync.lora import adapter_weights

            return adapter_weights(self.hf_model)
        if self.config.lora_r > 0:
            from fastdistill.sync.lora import merged_weights

            return merged_weights(self.hf_model)
        return self.hf_model

    def _sync_weights_in_background(self) -> dict[str, float]:
        """``weight_sync_overlap``: snapshot the weights now, push them from a thread while the next step collects
        and trains; the worker stamps rollouts with the new version once the server has it. Returns the previous
        push's timings plus how long this step waited for it (``perf/weight_sync_wait_s``)."""
        from concurrent.futures import ThreadPoolExecutor

        from fastdistill.sync import snapshot_weights

        started = time.perf_counter()
        with self.clock.phase("weight_sync"):  # waiting for the previous push, then the snapshot
            timings = dict(self._pending_sync.result() or {}) if self._pending_sync is not None else {}
            timings["perf/weight_sync_wait_s"] = time.perf_counter() - started
            # the LoRA stream is lazy: merge now, not during training; an adapter is a copy
            servable = self._servable()
            snapshot = servable if self._adapter_sync else snapshot_weights(servable)
        self.model_version += 1
        version = self.model_version
        if self._sync_thread is None:
            self._sync_thread = ThreadPoolExecutor(1, thread_name_prefix="fastdistill-weight-sync")

        def push() -> dict[str, float]:
            result = self.weight_sync.push(snapshot, version)
            if self.worker is not None:
                self.worker.model_version = version
            return result

        self._pending_sync = self._sync_thread.submit(push)
        return timings

    def _served_gap(self) -> float:
        """Max |served − trainer| log-prob on two training prompts (world size 1: the check runs a full forward)."""
        from fastdistill.sync import served_logprob_gap, served_sampled_logprob_gap

        if self.dist.world_size > 1:
            raise ValueError("verify_weight_sync needs a single trainer process")
        probes = [row["prompt_ids"] for row in self.rows[:2] if len(row["prompt_ids"]) >= 2]
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            adapter = getattr(self.weight_sync, "served_model_name", None)
            if adapter is not None:  # the adapter's check takes the generation path (see the function)
                return served_sampled_logprob_gap(self.config.vllm_server_base_url, self.hf_model, probes, adapter,
                                                  api_key=self.config.vllm_server_api_key)
            return served_logprob_gap(self.config.vllm_server_base_url, self.hf_model, probes,
                                      served_model_name=self._student_model_name,
                                      api_key=self.config.vllm_server_api_key)
        finally:
            self.hf_model.train(was_training)

    # ---------------------------------------------------------------------------------------- micro-batches

    def _next_window(self) -> tuple[list[tuple[list[RolloutSample], bool]], int] | None:
        """This rank's rows for the next step, a list of ``(samples, ghost)`` per micro-batch, and the schedule's
        step count; None when the run is over.

        A ghost row (a rank left without samples in a final, partial micro-batch) runs with zero loss weight so that
        every rank makes the same collective calls."""
        per_rank = None
        self._window_wait_s = 0.0
        if self.dist.is_main:
            waited = self.source.wait_s
            window = self.collector.collect(self.source, self.model_version)
            self._window_wait_s = self.source.wait_s - waited
            self._record_drops(self.collector.take_drops(), step=self.step + 1)
            self._window = window
            if window is not None:
                total_steps = self._planned_steps(window)
                per_rank = [([(mb[rank] or next(r for r in mb if r), not mb[rank]) for mb in window.microbatches],
                             total_steps) for rank in range(self.dist.world_size)]
            else:
                per_rank = [None] * self.dist.world_size
        return scatter_samples(self.dist, per_rank)  # the arrays as tensors, not pickles

    def _planned_steps(self, window: Window) -> int:
        """Rank 0: the schedule's step count. ``max_steps`` when set; else exact on the last window, and otherwise
        the steps so far plus the prompts left at the samples per step seen so far in this process."""
        if self.config.max_steps != -1:
            return self.config.max_steps
        if window.last:
            return self.step + 1
        samples_per_step = (self._session_samples + window.num_samples) / (self._session_steps + 1)
        left = self.collector.remaining() - window.num_samples
        return self.step + 1 + max(1, math.ceil(left / samples_per_step))

    # ---------------------------------------------------------------------------------------- one step

    def _train_step(self, window: list[tuple[list[RolloutSample], bool]]) -> dict[str, float]:
        config = self.config
        device = self.dist.device
        clock = self.clock
        rows, supports, counts = [], [], []
        with clock.phase("pack"):
            for samples, ghost in window:
                row = pack_row(samples, self.teacher_ids, vocab_size=self.student_vocab_size)
                if not ghost:
                    self._warn_out_of_vocab(row)
                row = row.to(device)
                support = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, config.beta)
                rows.append(row)
                supports.append(support)
                counts.append(0 if ghost else self._scored_count(row, support))
            window_tokens = window_token_count(counts)  # a collective with several ranks
        scale = window_loss_scale(window_tokens)
        num_teachers = len(self.teacher_ids)
        # Σ over this rank: [tokens, jsd, entropy, teacher entropy, forwarded tokens, trained tokens, samples,
        #                   folded teacher candidates, then (tokens, jsd, teacher entropy) per teacher]
        stats = torch.zeros(8 + 3 * num_teachers, dtype=torch.float64)
        fwd_bwd_started = time.perf_counter()
        for row, (ids, lps, mask), (_, ghost) in zip(rows, supports, window, strict=True):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self._use_bf16() and
                                self.dist.world_size == 1):
                out, importance = self.model(row, ids, lps, mask, self._stale_positions(row))
            (out.loss * (0.0 if ghost else scale)).backward()
            if ghost:
                continue
            if importance and self.dist.is_main:
                self.metrics.update(importance)
            stats[0] += float(out.num_tokens)
            stats[1] += float(out.jsd_sum)
            stats[2] += float(out.entropy_sum)
            stats[3] += float(out.teacher_entropy_sum)
            stats[4] += row.num_tokens
            stats[5] += row.num_trained
            stats[6] += row.num_samples
            stats[7] += row.folded_ids.numel()
            stats[8:] += out.per_teacher.detach().double().cpu().flatten()
        fwd_bwd_s = time.perf_counter() - fwd_bwd_started
        clock.add("fwd_bwd", fwd_bwd_s)
        grad_norm = None
        with clock.phase("grad_clip"):
            if config.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
        learning_rate = self.scheduler.apply(self.step)
        optimizer_started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - optimizer_started
        clock.add("optimizer", optimizer_s)
        with clock.phase("bookkeeping"):  # the step's statistics, trained-prompt log and metrics
            stats = self.dist.all_reduce_sum(stats)
            if self.dist.is_main:
                self._mark_trained()
            record = self._step_record(stats, window, grad_norm, fwd_bwd_s, optimizer_s)
        record["learning_rate"] = learning_rate
        return record

    def _warn_out_of_vocab(self, row: PackedRow) -> None:
        """Warn once per teacher whose candidates reach beyond the student's vocabulary (they are folded into the
        teacher's tail and counted in ``sample/teacher_out_of_vocab_total``)."""
        if row.folded_ids.numel() == 0:
            return
        for index in row.folded_teacher.unique().tolist():
            teacher_id = self.teacher_ids[index]
            if teacher_id in self._warned_out_of_vocab:
                continue
            self._warned_out_of_vocab.add(teacher_id)
            largest = int(row.folded_ids[row.folded_teacher == index].max())
            logger.warning(
                "teacher %r returned candidate ids up to %d, but the student's vocabulary has %d tokens (lm_head "
                "rows): the teacher's vocabulary is at least %d tokens, padded beyond the student's. Those "
                "candidates are folded into the teacher's tail bucket (the student cannot produce them) and "
                "counted in sample/teacher_out_of_vocab_total; warned once per teacher.",
                teacher_id, largest, self.student_vocab_size, largest + 1)

    def _scored_count(self, row: PackedRow, support: tuple[torch.Tensor, ...]) -> int:
        """Positions the loss will score: those with teacher signal (jsd), or whose sampled token the teacher
        scored (reverse_kl_pg)."""
        if self.config.loss_type == "reverse_kl_pg":
            match = (row.candidate_ids == row.actual_ids[:, None]) & torch.isfinite(row.candidate_logprobs)
            return int(match.any(dim=1).sum())
        # hidden-state teachers' targets have empty candidate rows; the dense loss scores every one of them
        dense = sum(int(row.hidden_targets(index).numel()) for index in row.teacher_hidden)
        return int(scored_positions(*support)) + dense

    def _stale_positions(self, row: PackedRow) -> torch.Tensor | None:
        """(M,) bool: positions of samples older than ``max_staleness`` (kept only under ``stale_policy=
        "importance"``), or None."""
        if self.config.stale_policy != "importance":
            return None
        staleness = self.model_version - row.model_versions
        return (staleness > self.config.max_staleness)[row.token_sample]

    def _mark_trained(self) -> None:
        """Rank 0: record the step's prompts (all ranks' rows) as trained, in memory and in
        ``trained_prompts.jsonl`` (one line per step: the evidence that every prompt is trained exactly once)."""
        prompt_ids = self._window.prompt_ids
        for prompt_id in prompt_ids:
            self.rollout_state.add(prompt_id)
        self._session_steps += 1
        self._session_samples += len(prompt_ids)
        RunLedger(self.output_dir).append_trained(self.step + 1, prompt_ids)

    def _step_record(self, stats: torch.Tensor, window: Any, grad_norm: Any, fwd_bwd_s: float,
                     optimizer_s: float) -> dict[str, float]:
        tokens = max(float(stats[0]), 1.0)
        record: dict[str, Any] = {
            "loss": float(stats[1]) / tokens,
            self._divergence_name: float(stats[1]) / tokens,
            "entropy": float(stats[2]) / tokens,
            "teacher_entropy": float(stats[3]) / tokens,
            "model_version": float(self.model_version),
            "batch/microbatches_per_step": float(len(window)),
            "batch/forwarded_tokens_per_step": float(stats[4]),
            "batch/trained_tokens_per_step": float(stats[5]),
            "batch/samples_per_step": float(stats[6]),
            "sample/teacher_out_of_vocab_total": float(stats[7]),
            "perf/fwd_bwd_s": fwd_bwd_s,
            "perf/optimizer_s": optimizer_s,
            "perf/forwarded_tok_s_fwd_bwd": float(stats[4]) / max(fwd_bwd_s, 1e-9),
        }
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if len(self.teacher_ids) > 1:
            per_teacher = stats[8:].view(-1, 3)
            for index, teacher_id in enumerate(self.teacher_ids):
                count = float(per_teacher[index, 0])
                record[f"teacher_token_frac/{teacher_id}"] = count / tokens
                if count:
                    record[f"teacher_{self._divergence_name}/{teacher_id}"] = float(per_teacher[index, 1]) / count
                    record[f"teacher_entropy/{teacher_id}"] = float(per_teacher[index, 2]) / count
        if self.dist.is_main:
            record.update(self._rank0_metrics())
        return record

    def _rank0_metrics(self) -> dict[str, Any]:
        """Rank 0's share of the step's record: the source's and the worker's metrics, the collector's counters and
        the window's packing metrics (ghost rows left out)."""
        counters = self.collector.take_counters()
        dropped = counters.dropped
        record: dict[str, Any] = {"perf/rollout_wait_s": self.source.wait_s,
                                  "sample/discarded_total": float(counters.discarded_total),
                                  "sample/dropped_prompts_total": float(sum(dropped.values()))}
        for reason, count in dropped.items():
            record[f"sample/dropped_prompts_{reason}_total"] = float(count)
        if self.token_budget > 0:
            record["batch/dropped_oversize_total"] = float(dropped.get("oversize", 0))
        self.source.wait_s = 0.0
        for key, values in self.source.metrics.items():
            for value in values:
                self.metrics.add(key, value)
        self.source.metrics = {}
        for payload in self.source.drain_worker_metrics():
            self.metrics.update(payload)
        for microbatch in self._window.microbatches:
            self.metrics.update(batch_metrics([row for row in microbatch if row], self.token_budget or None))
        return record
