"""The training loop: rank 0 pulls scored samples, every rank trains its packed row, weights flow back to vLLM.

One step = ``gradient_accumulation_steps`` micro-batches. Rank 0's :class:`~fastdistill.train.collector.
WindowCollector` takes samples from the rollout worker (or any source), drops stale ones, fills micro-batches (one row
per rank) and decides when the run is over; rank 0 scatters each rank its rows. Every rank packs its rows (no
padding, ``position_ids`` restart per sample), runs the backbone with no attention mask and the fused sparse-JSD loss
on the trained positions, scaled by the window's token count across ranks (a token mean over the whole step). After
the optimizer step, every ``weight_sync_steps`` steps the weights are pushed into the student's vLLM server and the
model version advances (staleness is counted in optimizer steps: :mod:`fastdistill.train.staleness`).

Launch with ``torchrun --nproc-per-node N`` (FSDP2 ``fully_shard`` per decoder layer and the root; gloo on CPU,
NCCL on GPU) or as a plain single process (no sharding).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fastdistill.data.batching import FixedCountBatcher, TokenBudgetBatcher
from fastdistill.rollout import OnPolicyShare, RolloutSample
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.horizon import horizon_schedule
from fastdistill.sync import weight_sync_from_config
from fastdistill.train import pipeline
from fastdistill.train.checkpoint import RolloutState, export_final_model, save_checkpoint
from fastdistill.train.collector import WindowCollector
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.cross_teachers import load_cross_teachers
from fastdistill.train.distributed import check_world_size, init_distributed, scatter_samples
from fastdistill.train.evaluate import RunEvaluator, held_out_rows
from fastdistill.train.flops import StepMfu, peak_flops
from fastdistill.train.ledger import DROPPED_PROMPTS_FILE, RunLedger, data_identity, resume_run
from fastdistill.train.metrics import MetricsLogger, rank0_step_metrics
from fastdistill.train.model import DistillationModel, check_master_weights, load_model, load_tokenizer, prepare_student
from fastdistill.train.schedule import LRSchedule
from fastdistill.train.source import SynchronousSource
from fastdistill.train.step import TrainStep, step_record
from fastdistill.train.syncing import WeightSyncSchedule
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
        self.dist = init_distributed(timeout_s=config.ddp_timeout, heartbeat_timeout_s=config.rank_heartbeat_timeout_s)
        # options that need one unsharded process, refused before any work
        check_world_size(config, self.dist.world_size, self.dist.sharded)
        _seed_everything(config.seed)
        self.output_dir = Path(config.output_dir)
        self.teacher_ids = config.teacher_ids
        self.on_step_end = on_step_end
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
        hf_model = model if model is not None else load_model(config, self.dist.device)
        # teacher candidates at or beyond the student's lm_head rows are folded into the teacher's tail
        self.student_vocab_size = int(hf_model.get_output_embeddings().weight.shape[0])
        self.master_weights_warning = check_master_weights(hf_model, config)
        self.model, self.hf_model = prepare_student(hf_model, config, self.dist.device, self.dist.sharded,
                                                    self._use_bf16())
        # cross-tokenizer teachers: each one's vocabulary map against the student's lm_head rows, loaded once
        self.model.cross_teachers = load_cross_teachers(config, self.tokenizer, vocab_size=self.student_vocab_size,
                                                        device=self.dist.device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay)
        self._samples = samples
        self.cache = (pipeline.open_cache(config, self.tokenizer) if config.teacher_cache is not None
                      and self.dist.is_main else None)
        # no server is asked for samples: given samples, or a teacher cache without on-policy share
        self._offline = samples is not None or (config.teacher_cache is not None and not config.mixes_on_policy)
        self.rows = None  # rank 0: the prompts the rollouts generate from (a mixed run: the cached prompts)
        if self.cache is not None and not self._offline:
            self.rows = self.cache.prompt_table()
        elif not self._offline and self.dist.is_main:
            self.rows = pipeline.training_rows(config, train_dataset, self.tokenizer)
        num_prompts = len(samples if samples is not None else self.cache if self.cache is not None else
                          self.rows if self.rows is not None else ())
        self.num_prompts = self.dist.broadcast(num_prompts)
        self.evaluator = RunEvaluator(
            config, self.dist, held_out_rows(config, eval_dataset, self.tokenizer) if self.dist.is_main
            else None, self.tokenizer, vocab_size=self.student_vocab_size, bf16=self._use_bf16())
        self.has_eval = self.evaluator.enabled
        self._last_save_step: int | None = None
        # With max_steps=-1: an estimate (exact for the fixed-count batcher), corrected as rows are packed.
        self.max_steps = config.resolved_max_steps(self.num_prompts, self.dist.world_size)
        # Prompts to train: every prompt of every epoch (a fractional last epoch rounds up); unbounded with max_steps.
        self.total_prompts = (math.ceil(config.num_train_epochs * self.num_prompts) if config.max_steps == -1
                              else None)
        self.on_policy = self._on_policy_share() if config.mixes_on_policy else None
        warmup = config.warmup_steps or math.ceil(config.warmup_ratio * self.max_steps)
        self.scheduler = LRSchedule(self.optimizer, config.lr_scheduler_type, self.max_steps, warmup)
        compute_dtype = torch.bfloat16 if self._use_bf16() else next(self.hf_model.parameters()).dtype
        self.mfu = StepMfu(self.hf_model, peak_flops(self.dist.device, compute_dtype), self.dist.world_size)
        # the logged divergence: the sparse JSD, or the sampled reverse-KL estimate of reverse_kl_pg
        self._divergence_name = "jsd" if config.loss_type == "jsd" else "reverse_kl"
        self.worker = None
        self.source: Any = None
        self.collector: WindowCollector | None = None
        self.step = 0
        self.rollout_state = RolloutState()
        self.dropped_total = 0
        self.clock = PhaseClock()  # where the run's seconds go (train_summary.json "time_s", perf/*_s per step)
        self._window_wait_s = 0.0  # rank 0: seconds the last window collection waited for rollouts
        self.syncs = WeightSyncSchedule(weight_sync, config, self.hf_model, clock=self.clock)
        self.train_step = TrainStep(self.model, self.optimizer, self.scheduler, config, self.dist, self.teacher_ids,
                                    vocab_size=self.student_vocab_size, bf16=self._use_bf16(), clock=self.clock,
                                    policy=self.syncs.policy)

    @property
    def model_version(self) -> int:
        """The policy version the student server serves (advanced by every weight sync)."""
        return self.syncs.model_version

    @model_version.setter
    def model_version(self, version: int) -> None:
        self.syncs.model_version = version

    @property
    def weight_sync(self) -> Any:
        return self.syncs.weight_sync

    @weight_sync.setter
    def weight_sync(self, weight_sync: Any) -> None:
        self.syncs.weight_sync = weight_sync

    # ------------------------------------------------------------------------------------------------ setup

    def _use_bf16(self) -> bool:
        return self.config.bf16 if self.config.bf16 is not None else self.dist.device.type == "cuda"

    # ---------------------------------------------------------------------------------------------- the run

    def train(self) -> dict[str, Any]:
        """Run until every prompt of ``num_train_epochs`` is trained or dropped (or ``max_steps``); return a
        summary."""
        config = self.config
        state = resume_run(config, self.dist, self.model, self.optimizer, self.scheduler, data=(
            data_identity(config, samples=self._samples, cache=self.cache, rows=self.rows) if self.dist.is_main
            else None))
        self.step, self.model_version, self.rollout_state = state.step, state.model_version, state.rollout
        self.syncs.policy.step = self.step
        self.metrics = MetricsLogger(
            self.output_dir, total_steps=self.max_steps, is_main=self.dist.is_main, report_to=config.report_to,
            run_name=config.run_name, config=config.to_masked_dict(), disable_progress=config.disable_tqdm,
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
                record.update(self.syncs.after_step(self.step))
                now = time.perf_counter()
                record["perf/step_s"] = now - last_step_end
                record["perf/trained_tok_s_wall_clock"] = record.get("batch/trained_tokens_per_step", 0) / max(
                    record["perf/step_s"], 1e-9)
                record.update(self.mfu.record(record, self._window if self.dist.is_main else None))
                record.update(clock.step_record(record["perf/step_s"]))
                last_step_end = now
                self.metrics.update(record)  # every step: values between two logging steps are reduced together
                # the last step's evaluation runs after the export and the final checkpoint (the schedule's length is
                # exact on the last step), so that an evaluation that fails cannot lose the run's end
                last = self.step == self.scheduler.total_steps
                evaluate = self.has_eval and not last and (config.eval_steps is not None
                                                            and self.step % config.eval_steps == 0)
                if evaluate:
                    with clock.phase("eval"):
                        self.metrics.update(self.evaluate())
                if (evaluate or self.step % config.logging_steps == 0) and not (last and self.has_eval):
                    with clock.phase("logging"):  # the last step's record is logged with its evaluation
                        self._log_metrics()
                if config.save_strategy == "steps" and self.step % config.save_steps == 0:
                    with clock.phase("checkpoint"):
                        self.save()
            elapsed = time.perf_counter() - started
            with clock.phase("export"):
                export_final_model(config, self.model, self.hf_model, self.tokenizer, self.output_dir / "final",
                                   self.dist.is_main)
            if config.save_strategy == "steps" and self.step > 0 and self._last_save_step != self.step:
                with clock.phase("checkpoint"):  # the end is resumable, whatever save_steps
                    self.save()
            if self.has_eval and self.evaluator.last_step != self.step:
                with clock.phase("eval"):
                    self.metrics.update(self.evaluate())
            if self.metrics.has_values():  # the last step, when it is not a logging step
                with clock.phase("logging"):
                    self._log_metrics()
        except RuntimeError as error:  # a collective that failed because another rank is gone: say which
            lost = self.dist.lost_rank_error(error) if self.dist.world_size > 1 else None
            if lost is None:
                raise
            raise lost from error
        finally:
            stopping = time.perf_counter()
            try:
                with clock.phase("shutdown"):
                    self._stop_pipeline()
            finally:
                self.metrics.close()
                self.shutdown_s = time.perf_counter() - stopping
                clock.stop()
                # the process group this trainer made; the propagating error is marked for the other ranks
                self.dist.close(sys.exc_info()[1])
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

    def evaluate(self) -> dict[str, float]:
        """Held-out on-policy evaluation with the trainer's current weights (collective: every rank calls it); see
        :class:`~fastdistill.train.evaluate.RunEvaluator`."""
        return self.evaluator(self.model, self.hf_model, self.step,
                              student_model=getattr(self.weight_sync, "served_model_name", None))

    def _log_metrics(self) -> None:
        logged = self.metrics.log(self.step)
        if self.on_step_end is not None and self.dist.is_main:
            self.on_step_end(self.step, logged)

    def save(self) -> Path:
        """Write ``checkpoint-<step>`` (collective)."""
        self._last_save_step = self.step
        return save_checkpoint(self.output_dir, self.step, self.model, self.optimizer, self.scheduler,
                               self.model_version, self.rollout_state, self.config.save_total_limit)

    # ---------------------------------------------------------------------------------------- pipeline parts

    def _start_pipeline(self) -> None:
        """Rank 0: server checks, prompt-length checks and the window collector; all ranks: the hidden-state teachers'
        heads, the weight-sync group and the cold sync (version → version + 1); then rank 0's source (the rollout
        worker, synchronous waves, the teacher cache or the given samples)."""
        config = self.config
        served, widths, skip_rows = None, {}, frozenset()
        if self.dist.is_main:
            if not self._offline:
                served, widths = pipeline.check_servers(config)
                self.syncs.student_model_name = served["student"].name
                self.syncs.probes = [row["prompt_ids"] for row in self.rows[:2]]
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
                self.evaluator.check_rows(served)
        self.model.teacher_heads = pipeline.load_teacher_heads(
            config, self.dist, served, widths, vocab_size=self.student_vocab_size,
            dtype=torch.bfloat16 if self._use_bf16() and self.dist.sharded else
            self.hf_model.get_output_embeddings().weight.dtype)  # bf16 weights under FSDP; one process autocasts
        if self.weight_sync is None and not self._offline:
            self.weight_sync = weight_sync_from_config(config, device_type=self.dist.device.type,
                                                       is_sender=self.dist.is_main)
        self.syncs.start()
        if not self.dist.is_main:
            return
        rollouts = None
        if not self._offline:
            rollouts = pipeline.rollout_config(
                config, world_size=self.dist.world_size, rollout_state=self.rollout_state,
                total_prompts=self.total_prompts, skip_rows=skip_rows, on_policy=self.on_policy,
                eos_ids=pipeline.eos_token_ids(self.hf_model, self.tokenizer), adapter_sync=self.syncs.adapter_sync,
                horizon=horizon_schedule(config, total_steps=self.max_steps),
                student_route=pipeline.student_route(config))
        self.source, self.worker = pipeline.open_source(
            config, world_size=self.dist.world_size, samples=self._samples, cache=self.cache, offline=self._offline,
            rows=self.rows, rollouts=rollouts, rollout_state=self.rollout_state, total_prompts=self.total_prompts,
            on_policy=self.on_policy, model_version=self.model_version, policy=self.syncs.policy)
        if self.worker is not None:  # what the worker stamps rollouts with, and its horizon's step
            self.syncs.on_served = partial(setattr, self.worker, "model_version")
            self.syncs.on_trained = partial(setattr, self.worker, "trained_steps")

    def _skip_long_prompts(self, served: dict[str, Any]) -> frozenset[int]:
        """Rank 0: the rows too long for a server (:func:`~fastdistill.train.pipeline.long_prompt_drops`), their
        prompts in this run recorded as dropped."""
        skip, drops = pipeline.long_prompt_drops(self.rows, self.teacher_ids, served, self.config,
                                                 total_prompts=self.total_prompts, rollout_state=self.rollout_state,
                                                 on_policy=self.on_policy)
        self._record_drops(drops, step=self.step)
        return skip

    def _on_policy_share(self) -> OnPolicyShare:
        """The prompts a mixed run generates on-policy: ``lmbda`` of them, or a share annealed from ``lmbda`` to
        ``lmbda_final`` over the run's prompts (every prompt of every epoch with ``max_steps=-1``, else
        ``max_steps`` × batch × GA × world, an estimate under a token budget; later prompts keep ``lmbda_final``)."""
        config = self.config
        if config.lmbda_final is None:
            return OnPolicyShare(config.lmbda)
        horizon = self.total_prompts or config.max_steps * config.samples_per_step(self.dist.world_size)
        return OnPolicyShare(config.lmbda, config.lmbda_final, max(1, horizon))

    def _new_batcher(self) -> Any:
        if self.token_budget > 0:
            return TokenBudgetBatcher(self.token_budget, self.dist.world_size)
        return FixedCountBatcher(self.config.per_device_train_batch_size, self.dist.world_size)

    def _record_drops(self, drops: list[DroppedPrompt], step: int) -> None:
        """Rank 0: count the dropped prompts and list them in ``dropped_prompts.jsonl`` (:class:`RunLedger`)."""
        if drops:
            self.dropped_total += len(drops)
            RunLedger(self.output_dir).append_drops(step, drops)

    def _stop_pipeline(self) -> None:
        """Stop everything that was started, each part even when an earlier one raises (an error propagates once all
        have run): the background push, the rollout worker, the synchronous source's clients and the weight-sync
        group."""
        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            self.syncs.close(stack)
            if isinstance(self.source, SynchronousSource):
                stack.callback(self.source.close)
            if self.worker is not None:
                stack.callback(self._stop_worker)

    def _stop_worker(self) -> None:
        worker, self.worker = self.worker, None
        worker.stop()

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
                total_steps = self.collector.planned_steps(window, self.step, self.config.max_steps)
                per_rank = [([(mb[rank] or next(r for r in mb if r), not mb[rank]) for mb in window.microbatches],
                             total_steps) for rank in range(self.dist.world_size)]
            else:
                per_rank = [None] * self.dist.world_size
        return scatter_samples(self.dist, per_rank)  # the arrays as tensors, not pickles

    # ---------------------------------------------------------------------------------------- one step

    def _train_step(self, window: list[tuple[list[RolloutSample], bool]]) -> dict[str, float]:
        """Train this rank's rows of the window (:class:`~fastdistill.train.step.TrainStep`); rank 0 marks the
        step's prompts trained. Returns the step's metrics."""
        result = self.train_step(window, self.step, self.model_version)
        for ratios in result.importance:
            self.metrics.update(ratios)
        with self.clock.phase("bookkeeping"):  # the trained-prompt log and rank 0's metrics
            if self.dist.is_main:
                self._mark_trained()
            record = step_record(result, self.teacher_ids, self._divergence_name, self.model_version, len(window))
            if self.dist.is_main:
                record.update(self._rank0_metrics())
        return record

    def _mark_trained(self) -> None:
        """Rank 0: record the step's prompts (all ranks' rows) as trained, in memory and in
        ``trained_prompts.jsonl`` (one line per step: the evidence that every prompt is trained exactly once)."""
        self.collector.mark_trained(self._window)
        RunLedger(self.output_dir).append_trained(self.step + 1, self._window.prompt_ids)

    def _rank0_metrics(self) -> dict[str, Any]:
        """Rank 0's share of the step's record (:func:`~fastdistill.train.metrics.rank0_step_metrics`)."""
        return rank0_step_metrics(self.metrics, self.collector, self.source, self._window, self.token_budget)
