"""The training loop: rank 0 pulls scored samples, every rank trains its packed row, weights flow back to vLLM.

One step = ``gradient_accumulation_steps`` micro-batches. Rank 0 takes samples from the rollout worker (or any
source), drops stale ones, fills micro-batches with the batcher (one row per rank) and scatters each rank its rows.
Every rank packs its rows (no padding, ``position_ids`` restart per sample), runs the backbone with no attention
mask and the fused sparse-JSD loss on the trained positions, scaled by the window's token count across ranks
(a token mean over the whole step, SPEC §2). After the optimizer step, every ``weight_sync_steps`` steps the weights
are pushed into the student's vLLM server and the model version advances.

Launch with ``torchrun --nproc-per-node N`` (FSDP2 ``fully_shard`` per decoder layer and the root; gloo on CPU,
NCCL on GPU) or as a plain single process (no sharding).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fastdistill.data.batching import FixedCountBatcher, TokenBudgetBatcher, balance_by_squared_length
from fastdistill.data.batching import microbatch_metrics as batch_metrics
from fastdistill.data.packing import PackedRow, pack_row
from fastdistill.loss import (
    SparseJSDOutput,
    narrow_support,
    reverse_kl_pg_loss,
    scored_positions,
    sparse_jsd_loss,
    window_loss_scale,
    window_token_count,
)
from fastdistill.rollout import RolloutSample
from fastdistill.train.checkpoint import (
    RolloutState,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.metrics import MetricsLogger
from fastdistill.train.source import ListSource, SourceExhausted, SynchronousSource, WorkerSource

WRAPPER_PREFIX = "model."  # state-dict prefix that DistillationModel adds in front of the Hugging Face names


# ----------------------------------------------------------------------------------------------------- model


def lm_head_settings(model_config: Any) -> tuple[float, float | None]:
    """``(logit_scale, softcap)`` read from a Hugging Face config, as TRL does (1.0 and None when absent)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    logit_scale = getattr(text_config, "logit_scale", None) or 1.0
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return float(logit_scale), (float(softcap) if softcap else None)


class DistillationModel(nn.Module):
    """A causal LM plus the fused loss, in one ``forward`` so that FSDP2 gathers the lm_head for the loss.

    ``forward`` takes a packed row and the narrowed support of its trained positions and returns the
    :class:`~fastdistill.SparseJSDOutput` (loss = sum over scored positions)."""

    def __init__(self, model: nn.Module, config: AsyncDistillationConfig):
        super().__init__()
        self.model = model
        self.logit_scale, self.softcap = lm_head_settings(model.config)
        self.loss_kwargs = {
            "beta": config.beta,
            "temperature": config.teacher_temperature,
            "add_tail_bucket": config.add_tail_bucket,
            "tail_mode": config.tail_mode,
            "num_teachers": len(config.teacher_ids),
            "backend": config.loss_backend,
        }
        self.sampling_temperature = config.temperature
        self.ratio_clip = config.importance_ratio_clip
        self.loss_type = config.loss_type
        self.pg_importance_ratio = config.pg_importance_ratio
        self.pg_ratio_clip = config.pg_ratio_clip

    def forward(self, row: PackedRow, ids: torch.Tensor, lps: torch.Tensor, mask: torch.Tensor,
                stale: torch.Tensor | None = None) -> tuple[Any, dict[str, float]]:
        """Loss output and importance metrics. ``stale``: (M,) bool, trained positions of samples kept beyond
        ``max_staleness`` (``stale_policy="importance"``); their losses are weighted by the clipped ratio
        π_θ(y)/μ(y) of the current student to the rollout policy on the sampled token (a constant)."""
        causal_lm = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model  # LoRA
        hidden = causal_lm.base_model(
            input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden[0].index_select(0, row.target_positions)
        head = causal_lm.get_output_embeddings()
        weights, metrics = None, {}
        if stale is not None and bool(stale.any()):
            weights, metrics = self._importance_weights(hidden, head, row, stale)
        if self.loss_type == "reverse_kl_pg":
            return self._policy_gradient(hidden, head, row, weights, metrics)
        out = sparse_jsd_loss(
            hidden, head.weight, ids, lps, mask, bias=head.bias, logit_scale=self.logit_scale,
            softcap=self.softcap, teacher_index=row.teacher_index, token_weights=weights, **self.loss_kwargs,
        )
        return out, metrics

    def _policy_gradient(self, hidden: torch.Tensor, head: nn.Module, row: PackedRow,
                         weights: torch.Tensor | None, metrics: dict[str, float]) -> tuple[Any, dict[str, float]]:
        """``reverse_kl_pg`` on the positions whose sampled token the teacher scored; returns a
        :class:`SparseJSDOutput`-shaped result (``jsd_sum`` holds the reverse-KL estimate) and its metrics."""
        match = (row.candidate_ids == row.actual_ids[:, None]) & torch.isfinite(row.candidate_logprobs)
        scored = match.any(dim=1).nonzero().squeeze(1)
        teacher = torch.where(match, row.candidate_logprobs, float("-inf")).amax(dim=1)
        out = reverse_kl_pg_loss(
            hidden.index_select(0, scored), head.weight, row.actual_ids[scored], teacher[scored], bias=head.bias,
            logit_scale=self.logit_scale, softcap=self.softcap, temperature=self.loss_kwargs["temperature"],
            rollout_logprobs=row.rollout_logprobs[scored] if self.pg_importance_ratio else None,
            ratio_clip=self.pg_ratio_clip, token_weights=None if weights is None else weights[scored],
        )
        with torch.no_grad():
            estimate = out.reverse_kl
            per_teacher = torch.zeros(self.loss_kwargs["num_teachers"], 3, dtype=torch.float64, device=hidden.device)
            per_row = torch.stack([torch.ones_like(estimate), estimate, torch.zeros_like(estimate)], dim=1).double()
            per_teacher.index_add_(0, row.teacher_index[scored], per_row)
        count = max(int(out.num_tokens), 1)
        metrics = {**metrics, "pg/advantage_mean": float(out.advantage_sum) / count,
                   "pg/advantage_std": math.sqrt(max(0.0, float(out.advantage_sq_sum) / count
                                                     - (float(out.advantage_sum) / count) ** 2))}
        if self.pg_importance_ratio:
            metrics.update({"pg/ratio_mean": float(out.ratio_sum) / count, "pg/ratio_max": float(out.ratio_max),
                            "pg/clip_frac": float(out.clipped) / count})
        zero = out.reverse_kl_sum * 0.0
        return SparseJSDOutput(loss=out.loss, jsd_sum=out.reverse_kl_sum, entropy_sum=zero,
                               teacher_entropy_sum=zero, num_tokens=out.num_tokens, per_teacher=per_teacher), metrics

    @torch.no_grad()
    def _importance_weights(self, hidden: torch.Tensor, head: nn.Module, row: PackedRow,
                            stale: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """(M,) weights: 1 on fresh positions, min(exp(log π_θ(y) − μ(y)), clip) on stale ones; π_θ at the
        sampling temperature over the full vocabulary (top-p/top-k truncation is not modelled)."""
        index = stale.nonzero().squeeze(1)
        logprob = torch.empty(index.numel(), dtype=torch.float32, device=hidden.device)
        for start in range(0, index.numel(), 256):  # bounded (256 × V) logits tiles
            rows = index[start : start + 256]
            logits = torch.nn.functional.linear(hidden[rows].float(), head.weight.float(),
                                                None if head.bias is None else head.bias.float()) * self.logit_scale
            if self.softcap is not None:
                logits = self.softcap * torch.tanh(logits / self.softcap)
            logits = logits / self.sampling_temperature
            actual = row.actual_ids[rows]
            logprob[start : start + rows.numel()] = (
                logits.gather(1, actual[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1))
        ratio = torch.exp(logprob - row.rollout_logprobs[index].float())
        weights = torch.ones(stale.shape[0], dtype=torch.float32, device=hidden.device)
        weights[index] = ratio.clamp(max=self.ratio_clip)
        metrics = {"sample/importance_ratio_mean": float(ratio.mean()),
                   "sample/importance_ratio_max": float(ratio.max()),
                   "sample/importance_clip_frac": float((ratio > self.ratio_clip).float().mean()),
                   "sample/importance_tokens_total": float(index.numel())}
        return weights, metrics


def default_attention(device: torch.device) -> str:
    """``flash_attention_2`` on CUDA when flash-attn is installed (varlen kernels over the packed row, boundaries
    from ``position_ids``), else ``sdpa`` (transformers turns packed ``position_ids`` into a block-diagonal mask)."""
    import importlib.util

    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (modules whose class is in ``model._no_split_modules``), each sharded on its own."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


# ----------------------------------------------------------------------------------------------------- helpers


@dataclass
class Distributed:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Distributed:
    """Join the process group torchrun describes (gloo on CPU, NCCL on GPU), or run as one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Distributed(rank, world_size, device)


def make_scheduler(optimizer: torch.optim.Optimizer, config: AsyncDistillationConfig, total_steps: int) -> Any:
    """LambdaLR for linear / cosine decay after warmup, constant, or constant after warmup."""
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if config.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if config.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    if config.lr_scheduler_type == "constant":
        warmup = 0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------- trainer


class AsyncDistillationTrainer:
    """Asynchronous on-policy distillation of the student at ``config.model_name_or_path``.

    Args:
        config: the run's :class:`AsyncDistillationConfig`.
        train_dataset: rows ``{"prompt": messages | str, "teacher_id"?}`` or ``{"prompt_ids": [...]}``; defaults
            to ``config.train_dataset`` loaded from JSON/JSONL. Needed on rank 0 only.
        model, tokenizer: already loaded ones (else loaded from ``model_name_or_path``).
        samples: a finite iterable of :class:`~fastdistill.rollout.RolloutSample` to train on instead of a rollout
            worker (offline replays and tests); no server is contacted unless weight sync is configured.
        weight_sync: an object with ``init()``, ``push(model, version) -> dict`` and ``close()``; default: vLLM's
            weight-transfer API on the student server (``config.weight_sync_backend``).
    """

    def __init__(
        self,
        config: AsyncDistillationConfig,
        *,
        train_dataset: Sequence[dict[str, Any]] | None = None,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        samples: Sequence[RolloutSample] | None = None,
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
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.hf_model = model if model is not None else self._load_model()
        self.model = self._wrap(self.hf_model)  # with LoRA, also replaces self.hf_model by the peft model
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay,
        )
        self._samples = samples
        self.rows = None
        if samples is None and self.dist.is_main:
            self.rows = self._tokenized_rows(train_dataset)
        num_prompts = len(samples) if samples is not None else (len(self.rows) if self.rows is not None else 0)
        num_prompts = self._broadcast(num_prompts)
        self.num_prompts = num_prompts
        self.max_steps = config.resolved_max_steps(num_prompts, self.dist.world_size)
        # Prompts to train: every prompt of every epoch (a fractional last epoch rounds up); unbounded with max_steps.
        self.total_prompts = math.ceil(config.num_train_epochs * num_prompts) if config.max_steps == -1 else math.inf
        self.scheduler = make_scheduler(self.optimizer, config, self.max_steps)
        from fastdistill.train.flops import peak_flops

        compute_dtype = torch.bfloat16 if self._use_bf16() else next(self.hf_model.parameters()).dtype
        self.peak_flops = peak_flops(self.dist.device, compute_dtype)  # None on CPU: no MFU metrics
        self.weight_sync = weight_sync
        # the logged divergence: the sparse JSD, or the sampled reverse-KL estimate of reverse_kl_pg
        self._divergence_name = "jsd" if config.loss_type == "jsd" else "reverse_kl"
        self.worker = None
        self._pending_sync = None  # the background push under weight_sync_overlap
        self._sync_thread = None
        self.step = 0
        self.model_version = 0
        self.rollout_state = RolloutState()

    # ------------------------------------------------------------------------------------------------ setup

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.config.model_name_or_path,
                                                  trust_remote_code=self.config.trust_remote_code)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _load_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        kwargs = dict(self.config.model_init_kwargs or {})
        kwargs.setdefault("trust_remote_code", self.config.trust_remote_code)
        dtype = self.config.dtype
        kwargs.setdefault("dtype", "auto" if dtype == "auto" else getattr(torch, dtype))
        kwargs.setdefault("attn_implementation", default_attention(self.dist.device))
        return AutoModelForCausalLM.from_pretrained(self.config.model_name_or_path, **kwargs)

    def _use_bf16(self) -> bool:
        return self.config.bf16 if self.config.bf16 is not None else self.dist.device.type == "cuda"

    def _wrap(self, hf_model: nn.Module) -> nn.Module:
        hf_model.config.use_cache = False
        if self.config.lora_r > 0:
            from fastdistill.train.lora import apply_lora

            hf_model = self.hf_model = apply_lora(
                hf_model, r=self.config.lora_r, alpha=self.config.lora_alpha, dropout=self.config.lora_dropout,
                target_modules=self.config.lora_target_modules)
            if self.config.gradient_checkpointing:
                hf_model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need a grad input
        if self.config.gradient_checkpointing:
            if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf_model.train()
        wrapped = DistillationModel(hf_model, self.config).to(self.dist.device)
        if self.dist.world_size > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      if self._use_bf16() else MixedPrecisionPolicy())
            for layer in decoder_layers(hf_model):
                fully_shard(layer, mp_policy=policy)
            fully_shard(wrapped, mp_policy=policy)
        return wrapped

    def _tokenized_rows(self, rows: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
        from fastdistill.data.prompts import tokenize_prompts

        if rows is None:
            if self.config.train_dataset is None:
                raise ValueError("no training data: pass train_dataset= or set config.train_dataset to a JSON/JSONL "
                                 "file of rows {'prompt': ..., 'teacher_id': ...}")
            rows = load_rows(self.config.train_dataset)
        return tokenize_prompts(rows, self.tokenizer, chat_template_kwargs=self.config.chat_template_kwargs)

    def _broadcast(self, value: Any) -> Any:
        if self.dist.world_size == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    # ---------------------------------------------------------------------------------------------- the run

    def train(self) -> dict[str, Any]:
        """Run until every prompt of ``num_train_epochs`` is trained (or ``max_steps``); return a summary."""
        config = self.config
        resume = self._resume_path()
        if resume is not None:
            state = load_checkpoint(resume, self.model, self.optimizer, self.scheduler)
            self.step, self.model_version, self.rollout_state = state.step, state.model_version, state.rollout
            if self.dist.is_main:
                _truncate_trained_log(self.output_dir / "trained_prompts.jsonl", self.step)
        self.metrics = MetricsLogger(
            self.output_dir, total_steps=self.max_steps, is_main=self.dist.is_main, report_to=config.report_to,
            run_name=config.run_name, config=config.to_dict(), disable_progress=config.disable_tqdm,
            initial_step=self.step,
        )
        started = time.perf_counter()
        trained_tokens = 0
        try:
            self._start_pipeline()
            last_step_end = time.perf_counter()
            while self.step < self.max_steps:
                window = self._next_window()
                if window is None:
                    break
                record = self._train_step(window)
                trained_tokens += int(record.get("batch/trained_tokens_per_step", 0))
                self.step += 1
                if self.step % config.weight_sync_steps == 0:
                    record.update(self._sync_weights())
                now = time.perf_counter()
                record["perf/step_s"] = now - last_step_end
                record["perf/trained_tok_s_wall_clock"] = record.get("batch/trained_tokens_per_step", 0) / max(
                    record["perf/step_s"], 1e-9)
                record.update(self._mfu(record))
                last_step_end = now
                if self.step % config.logging_steps == 0 or self.step == self.max_steps:
                    self.metrics.update(record)
                    logged = self.metrics.log(self.step)
                    if self.on_step_end is not None and self.dist.is_main:
                        self.on_step_end(self.step, logged)
                if config.save_strategy == "steps" and self.step % config.save_steps == 0:
                    self.save()
            elapsed = time.perf_counter() - started
            if config.export_final_model and config.lora_r > 0:
                from fastdistill.train.lora import export_merged

                export_merged(self.hf_model, self.tokenizer, self.output_dir / "final", self.dist.is_main)
            elif config.export_final_model:
                export_hf(self.model, self.hf_model, self.tokenizer, self.output_dir / "final", WRAPPER_PREFIX)
        finally:
            stopping = time.perf_counter()
            self._stop_pipeline()
            self.metrics.close()
            self.shutdown_s = time.perf_counter() - stopping
        summary = {"steps": self.step, "model_version": self.model_version, "train_seconds": elapsed,
                "wall_seconds": time.perf_counter() - started, "shutdown_s": self.shutdown_s,
                "dropped_stale_total": getattr(getattr(self, "source", None), "dropped_stale_total", 0),
                "trained_tokens": trained_tokens, "trained_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
                "prompt_index": self.rollout_state.prompt_index}
        if self.dist.is_main:
            (self.output_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
        return summary

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
        """Weight-sync group, cold sync (version → version + 1), then the rollout worker on rank 0."""
        config = self.config
        if self.weight_sync is None and config.weight_sync_backend != "none" and self._samples is None:
            from fastdistill.sync import VLLMWeightSync

            backend = config.weight_sync_backend
            if backend == "auto":
                backend = "nccl" if self.dist.device.type == "cuda" else "gloo"
            one_call = config.weight_sync_one_call if config.weight_sync_one_call is not None else backend == "gloo"
            self.weight_sync = VLLMWeightSync(config.vllm_server_base_url, backend=backend, one_call=one_call,
                                              is_sender=self.dist.is_main, timeout_s=config.weight_sync_timeout)
        if self.dist.is_main:
            self.token_budget = self._resolve_token_budget()
            self._batcher = self._new_batcher()
            self._oversize_prompts: set[int] = set()
            self._discarded_total = 0
            self._oversize_reported = 0  # oversize drops already logged (batchers replaced by _flush included)
            self._oversize_of_old_batchers = 0
        if self.weight_sync is not None:
            self.weight_sync.init()
            self._sync_weights()
        if self._samples is not None:
            self.source = ListSource(self._samples) if self.dist.is_main else None
            return
        if self.dist.is_main and not config.async_mode:
            self._check_servers()
            self.source = SynchronousSource(self.rows, self._rollout_config(),
                                            config.samples_per_step(self.dist.world_size))
        elif self.dist.is_main:
            self.worker = self._make_worker()
            self.worker.model_version = self.model_version  # the version the cold sync just made the server serve
            self.worker.start()
            self.source = WorkerSource(
                self.worker, max_staleness=config.max_staleness, stale_policy=config.stale_policy,
                heartbeat_stale_after_s=config.heartbeat_stale_after_s,
            )

    def _resolve_token_budget(self) -> int:
        """``token_budget``, or the student server's ``max_model_len`` when None (0 for offline samples)."""
        if self.config.token_budget is not None:
            return self.config.token_budget
        return self._served_max_model_len() if self._samples is None else 0

    def _new_batcher(self) -> Any:
        if self.token_budget > 0:
            return TokenBudgetBatcher(self.token_budget, self.dist.world_size)
        return FixedCountBatcher(self.config.per_device_train_batch_size, self.dist.world_size)

    def _served_max_model_len(self) -> int:
        from fastdistill.rollout import StudentClient

        async def query() -> int:
            async with StudentClient(self.config.vllm_server_base_url) as client:
                await client.wait_until_healthy(self.config.vllm_server_timeout)
                return (await client.served_model()).max_model_len

        return asyncio.run(query())

    def _make_worker(self) -> Any:
        from fastdistill.rollout import RolloutWorker

        self._check_servers()
        return RolloutWorker(self._rollout_config(), self.rows,
                             queue_maxsize=self.config.resolved_queue_maxsize(self.dist.world_size))

    def _rollout_config(self) -> Any:
        from fastdistill.rollout import RetryPolicy, RolloutConfig

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
            skip_prompt_ids=frozenset(self.rollout_state.trained_after),
            eos_token_ids=eos_ids,
            retry=RetryPolicy(request_timeout_s=config.request_timeout),
        )

    def _check_servers(self) -> None:
        """Before any rollout: the servers are up and every teacher tokenizes like the student."""
        from fastdistill.rollout import StudentClient, TeacherClient, check_shared_vocabulary

        config = self.config

        async def check() -> None:
            async with StudentClient(config.vllm_server_base_url) as student:
                await student.wait_until_healthy(config.vllm_server_timeout)
                teachers = {}
                try:
                    for teacher_id, urls in config.teacher_server_urls.items():
                        teachers[teacher_id] = TeacherClient(urls)
                        await teachers[teacher_id].wait_until_healthy(config.vllm_server_timeout)
                    await check_shared_vocabulary(student, teachers)
                finally:
                    for teacher in teachers.values():
                        await teacher.close()

        asyncio.run(check())

    def _stop_pipeline(self) -> None:
        if self._pending_sync is not None:
            self._pending_sync.result()
            self._pending_sync = None
        if self._sync_thread is not None:
            self._sync_thread.shutdown()
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        if isinstance(getattr(self, "source", None), SynchronousSource):
            self.source.close()
        if self.weight_sync is not None:
            self.weight_sync.close()

    def _sync_weights(self) -> dict[str, float]:
        if self.weight_sync is None:
            return {}
        if self.config.weight_sync_overlap and self.model_version > 0:
            return self._sync_weights_in_background()
        timings = dict(self.weight_sync.push(self._servable(), self.model_version + 1) or {})
        self.model_version += 1
        if self.worker is not None:
            self.worker.model_version = self.model_version
        if self.config.verify_weight_sync and self.rows:
            timings["sync/served_logprob_gap"] = self._served_gap()
        return timings

    def _servable(self) -> Any:
        """What the server should serve: the model itself, or with LoRA its merged weights (``NamedTensors``)."""
        if self.config.lora_r > 0:
            from fastdistill.sync import NamedTensors
            from fastdistill.train.lora import merged_named_weights

            return NamedTensors(merged_named_weights(self.hf_model))
        return self.hf_model

    def _sync_weights_in_background(self) -> dict[str, float]:
        """``weight_sync_overlap``: snapshot the weights now, push them from a thread while the next step collects
        and trains; the worker stamps rollouts with the new version once the server has it. Returns the previous
        push's timings plus how long this step waited for it (``perf/weight_sync_wait_s``)."""
        from concurrent.futures import ThreadPoolExecutor

        from fastdistill.sync import NamedTensors, iter_named_weights

        started = time.perf_counter()
        timings = dict(self._pending_sync.result() or {}) if self._pending_sync is not None else {}
        timings["perf/weight_sync_wait_s"] = time.perf_counter() - started
        servable = self._servable()
        snapshot = servable if isinstance(servable, NamedTensors) else NamedTensors(
            [(name, tensor.clone()) for name, tensor in iter_named_weights(servable)])
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
        from fastdistill.sync import served_logprob_gap

        if self.dist.world_size > 1:
            raise ValueError("verify_weight_sync needs a single trainer process")
        probes = [row["prompt_ids"] for row in self.rows[:2] if len(row["prompt_ids"]) >= 2]
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            return served_logprob_gap(self.config.vllm_server_base_url, self.hf_model, probes)
        finally:
            self.hf_model.train(was_training)

    # ---------------------------------------------------------------------------------------- micro-batches

    def _next_window(self) -> list[tuple[list[RolloutSample], bool]] | None:
        """This rank's rows for the next step: a list of (samples, ghost) per micro-batch; None when done.

        A ghost row (a rank left without samples in a final, partial micro-batch) runs with zero loss weight so that
        every rank makes the same collective calls."""
        window = self._collect_window() if self.dist.is_main else None
        if self.dist.is_main:
            self._window_microbatches = window
            self._window_prompt_ids = sorted(s.prompt_id for mb in window for row in mb for s in row)
        if self.dist.world_size == 1:
            return None if not window else [(mb[0], False) for mb in window]
        scattered: list[Any] = [None]
        inputs = None
        if self.dist.is_main:
            inputs = [None] * self.dist.world_size if not window else [
                [(mb[rank] or next(r for r in mb if r), not mb[rank]) for mb in window]
                for rank in range(self.dist.world_size)
            ]
        dist.scatter_object_list(scattered, inputs, src=0)
        return scattered[0]

    def _collect_window(self) -> list[list[list[RolloutSample]]]:
        """Rank 0: up to ``gradient_accumulation_steps`` micro-batches (each: one list of samples per rank).

        A prompt whose sample is longer than the token budget is dropped by the batcher and never trained (TRL's
        rule); it counts as done, so that the run still ends after the last trainable prompt."""
        window: list[list[list[RolloutSample]]] = []
        collected = 0
        limit = self._prompt_limit()
        while len(window) < self.config.gradient_accumulation_steps:
            done = self.rollout_state.count_below(limit) + sum(1 for p in self._oversize_prompts if p < limit)
            pending = self._batcher.pending
            if self.total_prompts - done - collected <= len(pending):
                if pending:  # the last prompts: a final, partial micro-batch
                    window.append(self._flush())
                break
            try:
                sample = self.source.next(self.model_version)
            except SourceExhausted:
                if pending:
                    window.append(self._flush())
                break
            prompt_id = sample.prompt_id
            if (prompt_id >= self.total_prompts or self.rollout_state.is_trained(prompt_id)
                    or prompt_id in self._oversize_prompts or any(s.prompt_id == prompt_id for s in pending)):
                self._discarded_total += 1
                continue
            dropped_before = self._oversize_dropped()
            microbatch = self._batcher.add(sample)
            if self._oversize_dropped() > dropped_before:
                self._oversize_prompts.add(prompt_id)
            if microbatch is not None:
                collected += sum(len(row) for row in microbatch)
                window.append(microbatch)
        return window

    def _oversize_dropped(self) -> int:
        """Samples the batchers of this run dropped for exceeding the token budget."""
        current = self._batcher.dropped_oversize_total if self.token_budget > 0 else 0
        return self._oversize_of_old_batchers + current

    def _prompt_limit(self) -> int:
        return self.total_prompts if self.total_prompts != math.inf else 2**62

    def _flush(self) -> list[list[RolloutSample]]:
        pending = self._batcher.pending
        self._oversize_of_old_batchers = self._oversize_dropped()
        self._batcher = self._new_batcher()
        rows = balance_by_squared_length(pending, self.dist.world_size)
        return rows + [[] for _ in range(self.dist.world_size - len(rows))]

    # ---------------------------------------------------------------------------------------- one step

    def _train_step(self, window: list[tuple[list[RolloutSample], bool]]) -> dict[str, float]:
        config = self.config
        device = self.dist.device
        rows, supports, counts = [], [], []
        for samples, ghost in window:
            row = pack_row(samples, self.teacher_ids).to(device)
            support = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, config.beta)
            rows.append(row)
            supports.append(support)
            counts.append(0 if ghost else self._scored_count(row, support))
        window_tokens = window_token_count(counts)
        scale = window_loss_scale(window_tokens)
        num_teachers = len(self.teacher_ids)
        # Σ over this rank: [tokens, jsd, entropy, teacher entropy, forwarded tokens, trained tokens, samples,
        #                   then (tokens, jsd, teacher entropy) per teacher]
        stats = torch.zeros(7 + 3 * num_teachers, dtype=torch.float64)
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
            stats[7:] += out.per_teacher.detach().double().cpu().flatten()
        fwd_bwd_s = time.perf_counter() - fwd_bwd_started
        grad_norm = None
        if config.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
        optimizer_started = time.perf_counter()
        self.optimizer.step()
        optimizer_s = time.perf_counter() - optimizer_started
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.dist.world_size > 1:
            stats = stats.to(device)
            dist.all_reduce(stats)
            stats = stats.cpu()
        if self.dist.is_main:
            self._mark_trained()
        return self._step_record(stats, window, grad_norm, fwd_bwd_s, optimizer_s)

    def _scored_count(self, row: PackedRow, support: tuple[torch.Tensor, ...]) -> int:
        """Positions the loss will score: those with teacher signal (jsd), or whose sampled token the teacher
        scored (reverse_kl_pg)."""
        if self.config.loss_type == "reverse_kl_pg":
            match = (row.candidate_ids == row.actual_ids[:, None]) & torch.isfinite(row.candidate_logprobs)
            return int(match.any(dim=1).sum())
        return int(scored_positions(*support))

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
        for prompt_id in self._window_prompt_ids:
            self.rollout_state.add(prompt_id)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "trained_prompts.jsonl", "a") as log:
            log.write(json.dumps({"step": self.step + 1, "prompt_ids": self._window_prompt_ids}) + "\n")

    def _step_record(self, stats: torch.Tensor, window: Any, grad_norm: Any, fwd_bwd_s: float,
                     optimizer_s: float) -> dict[str, float]:
        tokens = max(float(stats[0]), 1.0)
        record: dict[str, Any] = {
            "loss": float(stats[1]) / tokens,
            self._divergence_name: float(stats[1]) / tokens,
            "entropy": float(stats[2]) / tokens,
            "teacher_entropy": float(stats[3]) / tokens,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "model_version": float(self.model_version),
            "batch/microbatches_per_step": float(len(window)),
            "batch/forwarded_tokens_per_step": float(stats[4]),
            "batch/trained_tokens_per_step": float(stats[5]),
            "batch/samples_per_step": float(stats[6]),
            "perf/fwd_bwd_s": fwd_bwd_s,
            "perf/optimizer_s": optimizer_s,
            "perf/forwarded_tok_s_fwd_bwd": float(stats[4]) / max(fwd_bwd_s, 1e-9),
        }
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if len(self.teacher_ids) > 1:
            per_teacher = stats[7:].view(-1, 3)
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
        record: dict[str, Any] = {"perf/rollout_wait_s": self.source.wait_s,
                                  "sample/discarded_total": float(self._discarded_total)}
        self.source.wait_s = 0.0
        self._discarded_total = 0
        for key, values in self.source.metrics.items():
            for value in values:
                self.metrics.add(key, value)
        self.source.metrics = {}
        for payload in self.source.drain_worker_metrics():
            self.metrics.update(payload)
        for microbatch in self._window_microbatches:
            self.metrics.update(batch_metrics(microbatch, self.token_budget or None))
        if self.token_budget > 0:
            dropped = self._oversize_dropped()
            record["batch/dropped_oversize_total"] = float(dropped - self._oversize_reported)
            self._oversize_reported = dropped
        return record


def _truncate_trained_log(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step`` (trained by a run that died before its next checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON list or a JSONL file (one object per line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"dataset file {str(path)!r} must hold a list of objects (JSON) or one object per line "
                         "(JSONL)")
    return rows
