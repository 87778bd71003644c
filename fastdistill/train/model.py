"""The student as the trainer sees it: a Hugging Face causal LM wrapped with the fused loss, loaded, and sharded.

:class:`DistillationModel` runs the backbone and the loss in one ``forward`` so that FSDP2 gathers the lm_head for the
loss. :func:`load_student` loads the model and tokenizer; :func:`prepare_student` applies LoRA, gradient
checkpointing, the master-weight rule and FSDP2.

Master weights: full fine-tuning keeps float32 master weights. An AdamW update is about the learning rate (1e-6 is
common for distillation), far below half a bfloat16 ulp of a typical weight (2^-9 relative: about 4e-5 for a weight
of 0.02), so bfloat16 master weights mostly never change. bfloat16 compute comes from autocast (one process) or
FSDP2's ``MixedPrecisionPolicy`` (several ranks) instead, with ``bf16=True`` (the default on CUDA).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import Any, NamedTuple

import torch
from torch import nn

from fastdistill.data.packing import PackedRow
from fastdistill.logit_head import causal_lm_parts, logit_head_from_config
from fastdistill.loss import (
    SparseJSDOutput,
    importance_ratios,
    query_reverse_kl_loss,
    reverse_kl_pg_loss,
    sampled_token_logprobs,
    sparse_jsd_loss,
)
from fastdistill.loss.dense import dense_teacher_jsd_loss
from fastdistill.loss.freshness import freshness_weights
from fastdistill.loss.opd_levers import packed_position_weights, packed_topd_advantages
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.config_checks import QUERY_LOSS_TYPES, SAMPLED_TOKEN_LOSS_TYPES
from fastdistill.train.cross_teachers import (
    CrossTeacher,
    combined_output,
    combined_pg_stats,
    cross_tokenizer_loss,
    cross_tokenizer_rows,
)
from fastdistill.train.lora import apply_lora
from fastdistill.train.teacher_head import TeacherHead

logger = logging.getLogger(__name__)

WRAPPER_PREFIX = "model."  # state-dict prefix that DistillationModel adds in front of the Hugging Face names


# ----------------------------------------------------------------------------------------------------- model


class HeadOperands(NamedTuple):
    """The lm_head as the losses read it: ``weight`` ``(V, D)`` and ``bias`` ``(V,)`` or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def loss_operands(hidden: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, HeadOperands]:
    """``hidden`` ``(M, D)`` and the lm_head in the dtype the losses compute in: under autocast (bfloat16 compute on
    one process) both are cast to the autocast dtype, the operands FSDP2's ``MixedPrecisionPolicy`` gives the loss on
    several ranks. Autocast does not reach into the losses' own autograd functions, so without the cast they would
    get the float32 residual stream and the float32 master head and run their GEMMs in float32. The casts are
    differentiable: the gradients reach the float32 parameters."""
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return hidden, HeadOperands(head.weight, head.bias)
    dtype = torch.get_autocast_dtype(device)
    bias = None if head.bias is None else head.bias.to(dtype)
    return hidden.to(dtype), HeadOperands(head.weight.to(dtype), bias)


class DistillationModel(nn.Module):
    """A causal LM plus the fused loss, in one ``forward`` so that FSDP2 gathers the lm_head for the loss.

    ``forward`` takes a packed row and the narrowed support of its trained positions and returns the
    :class:`~fastdistill.SparseJSDOutput` (loss = sum over scored positions).

    ``teacher_heads`` (teacher index -> :class:`~fastdistill.train.teacher_head.TeacherHead`) holds the heads of
    hidden-state teachers: a plain attribute, so they are neither parameters (never trained) nor in the state dict
    (never checkpointed). Their positions are scored with :func:`~fastdistill.loss.dense.dense_teacher_jsd_loss`
    and the top-K teachers' with :func:`~fastdistill.sparse_jsd_loss`; the two sums add. Each head is used in the
    student's compute dtype (the common dtype of its hidden states and lm_head), converted once on first use, so
    that the dense kernels see one dtype on both sides.

    ``logit_head`` is the student's :class:`~fastdistill.logit_head.LogitHead`, read from its config by
    :func:`~fastdistill.logit_head.logit_head_from_config` (a ConfigError for a family whose head it cannot
    reproduce)."""

    def __init__(self, model: nn.Module, config: AsyncDistillationConfig):
        super().__init__()
        self.model = model
        self.logit_head = logit_head_from_config(model.config)
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
        # the stabilizer of the policy-gradient family, judging the policy's move against the rollout's top-k
        # sampling distribution; decoupled PPO's proximal policy is the step-start weights, which are the weights of
        # every micro-batch's forward (the optimizer steps once, after them all), so the detached log-probs of that
        # forward are π_prox: no extra forward pass
        self.pg_stabilizer = {"stabilizer": config.pg_stabilizer, "clip_eps": config.pg_clip_eps,
                              "m2po_budget": config.m2po_budget,
                              "sampling_top_k": config.top_k if config.top_k >= 1 else None}
        # IW-OPD position weights (gamma, or None without) and TOP-D's alpha (loss_type "topd_pg")
        self.position_gamma = config.position_weight_gamma if config.position_weighting == "iw_opd" else None
        self.topd_alpha = config.topd_alpha
        self.freshness_scale = config.freshness_scale if config.freshness_weight else None
        self.teacher_heads: dict[int, TeacherHead] = {}
        # cross-tokenizer teachers (teacher index -> CrossTeacher: its vocabulary map's shared ids and the hybrid's
        # weights), set like teacher_heads by whoever loads the model (load_cross_teachers); plain attribute
        self.cross_teachers: dict[int, CrossTeacher] = {}
        self.cross_tokenizer_loss = config.cross_tokenizer_loss

    def forward(self, row: PackedRow, ids: torch.Tensor, lps: torch.Tensor, mask: torch.Tensor,
                stale: torch.Tensor | None = None, divergence: bool = False,
                drifting: torch.Tensor | None = None) -> tuple[Any, dict[str, float]]:
        """Loss output and importance metrics. ``stale``: (M,) bool, trained positions of samples kept beyond
        ``max_staleness`` (``stale_policy="importance"``, or every stale one with ``"importance_all"``); their losses
        are weighted by the clipped ratio π_θ(y)/μ(y) of the current student to the rollout policy on the sampled
        token (a constant, at the sampling temperature: :func:`~fastdistill.loss.importance_ratios`). ``drifting``:
        (M,) bool, positions of stale samples that take their freshness weight (``freshness_weight``,
        :func:`~fastdistill.loss.freshness.freshness_weights`), times any other weight.
        ``divergence``: the sparse JSD whatever ``loss_type`` is (held-out evaluation)."""
        backbone, head = causal_lm_parts(self.model)
        hidden = backbone(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).last_hidden_state
        hidden, head = loss_operands(hidden[0].index_select(0, row.target_positions), head)
        weights, metrics = None, {}
        if stale is not None and bool(stale.any()):
            weights, metrics = self._importance_weights(hidden, head, row, stale)
        if drifting is not None and self.freshness_scale is not None and bool(drifting.any()):
            weights, metrics = self._freshness_weights(hidden, head, row, drifting, weights, metrics)
        sampled = None  # log π_T of the sampled tokens, computed once for the position weights and the loss
        if self.position_gamma is not None and not divergence:
            sampled = self._sampled_teacher_logprobs(hidden, head, row)
            weights, metrics = self._position_weights(row, sampled, weights, metrics)
        cross = cross_tokenizer_rows(row, self.cross_teachers)
        if cross is not None and bool(cross.any()):
            return self._with_cross_tokenizer(hidden, head, row, ids, lps, mask, weights, metrics, cross, divergence)
        if self.loss_type in SAMPLED_TOKEN_LOSS_TYPES and not divergence:
            return self._policy_gradient(hidden, head, row, weights, metrics, teacher=sampled)
        if self.loss_type in QUERY_LOSS_TYPES and not divergence:
            return self._query_estimator(hidden, head, row, weights, metrics)
        if not row.teacher_hidden:
            out = sparse_jsd_loss(
                hidden, head.weight, ids, lps, mask, bias=head.bias, logit_scale=self.logit_head.scale,
                softcap=self.logit_head.softcap, teacher_index=row.teacher_index, token_weights=weights,
                **self.loss_kwargs,
            )
            return out, metrics
        return self._mixed_jsd(hidden, head, row, ids, lps, mask, weights), metrics

    def _with_cross_tokenizer(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow, ids: torch.Tensor,
                              lps: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
                              metrics: dict[str, float], cross: torch.Tensor,
                              divergence: bool) -> tuple[Any, dict[str, float]]:
        """A row with cross-tokenizer targets (``cross`` (M,) bool): their loss
        (:func:`~fastdistill.train.cross_teachers.cross_tokenizer_loss`: the group policy gradient with
        ``reverse_kl_pg``, else ``cross_tokenizer_loss``) plus the other teachers' targets' own loss; the fields
        add (a :class:`~fastdistill.train.cross_teachers.CrossTokenizerOutput`)."""
        pg = self.loss_type == "reverse_kl_pg" and not divergence
        kw = self.loss_kwargs
        cross_out, cross_pg = cross_tokenizer_loss(
            hidden, head, row, self.cross_teachers, loss="reverse_kl_pg" if pg else self.cross_tokenizer_loss,
            num_teachers=kw["num_teachers"], beta=kw["beta"], temperature=kw["temperature"],
            logit_scale=self.logit_head.scale, softcap=self.logit_head.softcap, backend=kw["backend"],
            sampling_temperature=self.sampling_temperature, importance_ratio=self.pg_importance_ratio,
            ratio_clip=self.pg_ratio_clip)
        if bool(cross.all()):
            if pg:
                metrics = {**metrics, **pg_metrics(cross_pg, int(cross_pg.num_tokens), self.pg_importance_ratio)}
            return combined_output([cross_out]), metrics
        if pg:
            out, metrics = self._policy_gradient(hidden, head, row, weights, metrics, cross_pg=cross_pg)
        else:
            out = self._mixed_jsd(hidden, head, row, ids, lps, mask, weights, exclude=cross)
        return combined_output([out, cross_out]), metrics

    def _mixed_jsd(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow, ids: torch.Tensor,
                   lps: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
                   exclude: torch.Tensor | None = None) -> SparseJSDOutput:
        """The JSD of a row with hidden-state teachers: the sparse loss on the top-K teachers' targets plus, per
        hidden-state teacher, the dense loss with its head on its targets; every field is the sum of the parts.
        ``exclude`` (M,) bool: targets scored elsewhere (cross-tokenizer ones), left out of the sparse loss."""
        kw = self.loss_kwargs
        dense_index = torch.tensor(sorted(row.teacher_hidden), dtype=torch.long, device=hidden.device)
        sparse = ~torch.isin(row.teacher_index, dense_index)
        topk = (sparse if exclude is None else sparse & ~exclude).nonzero().squeeze(1)
        parts: list[SparseJSDOutput] = []
        if topk.numel():
            parts.append(sparse_jsd_loss(
                hidden.index_select(0, topk), head.weight, ids[topk], lps[topk], mask[topk], bias=head.bias,
                logit_scale=self.logit_head.scale, softcap=self.logit_head.softcap,
                teacher_index=row.teacher_index[topk],
                token_weights=None if weights is None else weights[topk], **kw))
        compute_dtype = torch.promote_types(hidden.dtype, head.weight.dtype)
        for index, teacher_hidden in sorted(row.teacher_hidden.items()):
            teacher = self._teacher_head(index, compute_dtype)
            targets = row.hidden_targets(index)
            with torch.autocast(hidden.device.type, enabled=False):  # the dense loss computes in float32 itself
                parts.append(dense_teacher_jsd_loss(
                    hidden.index_select(0, targets), head.weight, teacher_hidden.to(compute_dtype), teacher.weight,
                    student_bias=head.bias, teacher_bias=teacher.bias, student_logit_scale=self.logit_head.scale,
                    student_softcap=self.logit_head.softcap, teacher_logit_scale=teacher.logit_scale,
                    teacher_softcap=teacher.softcap, beta=kw["beta"], temperature=kw["temperature"],
                    token_weights=None if weights is None else weights[targets],
                    teacher_index=row.teacher_index[targets], num_teachers=kw["num_teachers"],
                    backend=kw["backend"]))
        loss = parts[0].loss
        for part in parts[1:]:
            loss = loss + part.loss
        return SparseJSDOutput(
            loss=loss, jsd_sum=sum(p.jsd_sum.double() for p in parts),
            entropy_sum=sum(p.entropy_sum.double() for p in parts),
            teacher_entropy_sum=sum(p.teacher_entropy_sum.double() for p in parts),
            num_tokens=sum(p.num_tokens for p in parts),
            per_teacher=sum(p.per_teacher.double() for p in parts))

    def _teacher_head(self, index: int, dtype: torch.dtype) -> TeacherHead:
        """Teacher ``index``'s head in ``dtype`` (the student's compute dtype), converted once: the stored head is
        replaced, so a float32 checkpoint head does not stay beside its bfloat16 copy."""
        if index not in self.teacher_heads:
            raise ValueError(f"teacher index {index} sent hidden states but has no teacher head loaded")
        teacher = self.teacher_heads[index]
        if teacher.weight.dtype != dtype:
            teacher = self.teacher_heads[index] = teacher.to(dtype)
        return teacher

    def _policy_gradient(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow,
                         weights: torch.Tensor | None, metrics: dict[str, float],
                         cross_pg: Any = None, teacher: torch.Tensor | None = None) -> tuple[Any, dict[str, float]]:
        """``reverse_kl_pg`` (or ``topd_pg``: TOP-D's advantages, the row's samples the group) on the positions
        whose sampled token the teacher scored (``teacher``: their log π_T when already computed); returns a
        :class:`SparseJSDOutput`-shaped result (``jsd_sum`` holds the reverse-KL estimate) and its metrics (over
        these positions and, given ``cross_pg``, the cross-tokenizer groups' statistics too)."""
        if teacher is None:
            teacher = self._sampled_teacher_logprobs(hidden, head, row)
        scored = torch.isfinite(teacher).nonzero().squeeze(1)
        ratio = self.pg_importance_ratio
        advantages = None
        if self.loss_type == "topd_pg":
            advantages = packed_topd_advantages(teacher[scored], row.rollout_logprobs[scored],
                                                row.token_sample[scored], self.topd_alpha)
        out = reverse_kl_pg_loss(
            hidden.index_select(0, scored), head.weight, row.actual_ids[scored], teacher[scored], bias=head.bias,
            logit_scale=self.logit_head.scale, softcap=self.logit_head.softcap,
            temperature=self.loss_kwargs["temperature"], sampling_temperature=self.sampling_temperature,
            rollout_logprobs=row.rollout_logprobs[scored] if ratio else None,
            ratio_clip=self.pg_ratio_clip, token_weights=None if weights is None else weights[scored],
            advantages=advantages, **self.pg_stabilizer,
        )
        stats = out if cross_pg is None else combined_pg_stats([out, cross_pg])
        metrics = {**metrics, **pg_metrics(stats, int(stats.num_tokens), ratio)}
        return self._as_output(out, row.teacher_index[scored]), metrics

    def _query_estimator(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow,
                         weights: torch.Tensor | None, metrics: dict[str, float]) -> tuple[Any, dict[str, float]]:
        """``reverse_kl_mc`` / ``reverse_kl_student_topk``: :func:`~fastdistill.loss.query_reverse_kl_loss` on the
        row's student queries, at the positions whose every query the teacher scored (a hidden-state teacher's from
        its head); returns a :class:`SparseJSDOutput`-shaped result (``jsd_sum`` holds the reverse-KL estimate)."""
        if row.query_ids is None:
            raise ValueError(f"loss_type={self.loss_type!r} reads student queries, and this row's samples carry none "
                             "(the rollout's student_queries comes from loss_type: were the samples made by another "
                             "run?)")
        teacher = row.query_teacher_logprobs
        if teacher is None:
            teacher = torch.full(row.query_ids.shape, float("nan"), device=hidden.device)
        teacher = self._hidden_teacher_logprobs(row, row.query_ids, teacher,
                                                torch.promote_types(hidden.dtype, head.weight.dtype))
        behaviour = row.query_behaviour_logprobs
        scored = (torch.isfinite(teacher).all(dim=1) & torch.isfinite(behaviour).all(dim=1)).nonzero().squeeze(1)
        estimator = "multi_sample" if self.loss_type == "reverse_kl_mc" else "student_topk"
        extra = dict(self.pg_stabilizer, ratio_clip=self.pg_ratio_clip) if estimator == "multi_sample" else {}
        out = query_reverse_kl_loss(
            hidden.index_select(0, scored), head.weight, row.query_ids[scored], behaviour[scored], teacher[scored],
            estimator=estimator, bias=head.bias, logit_scale=self.logit_head.scale, softcap=self.logit_head.softcap,
            temperature=self.loss_kwargs["temperature"], sampling_temperature=self.sampling_temperature,
            token_weights=None if weights is None else weights[scored], **extra,
        )
        metrics = {**metrics, **pg_metrics(out, int(out.num_queries), estimator == "multi_sample")}
        if estimator == "student_topk":
            metrics["pg/support_mass_mean"] = float(out.support_mass_sum) / max(int(out.num_tokens), 1)
        return self._as_output(out, row.teacher_index[scored]), metrics

    @torch.no_grad()
    def _sampled_teacher_logprobs(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow) -> torch.Tensor:
        """(M,) log π_T of each position's sampled token: its top-K slot (−inf where the teacher did not return it),
        or from the teacher's head for a hidden-state teacher's targets."""
        match = (row.candidate_ids == row.actual_ids[:, None]) & torch.isfinite(row.candidate_logprobs)
        teacher = torch.where(match, row.candidate_logprobs, float("-inf")).amax(dim=1)
        return self._hidden_teacher_logprobs(row, row.actual_ids[:, None], teacher[:, None],
                                             torch.promote_types(hidden.dtype, head.weight.dtype))[:, 0]

    @torch.no_grad()
    @torch.no_grad()
    def _freshness_weights(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow, drifting: torch.Tensor,
                           weights: torch.Tensor | None,
                           metrics: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        """``weights`` (None: 1) times each drifting sample's freshness weight exp(−drift / ``freshness_scale``),
        drift = mean |log π_θ(y) − log μ(y)| over its positions (π_θ at the sampling temperature, as the importance
        ratio's), and the weights' and drifts' means over those positions."""
        index = drifting.nonzero().squeeze(1)
        current = sampled_token_logprobs(hidden.index_select(0, index), head.weight, row.actual_ids[index].long(),
                                         bias=head.bias, logit_scale=self.logit_head.scale,
                                         softcap=self.logit_head.softcap, temperature=self.sampling_temperature)
        fresh, drift = freshness_weights(current, row.rollout_logprobs[index], row.token_sample[index],
                                         self.freshness_scale)
        out = torch.ones(drifting.shape[0], dtype=torch.float32, device=hidden.device)
        out[index] = fresh.float()
        metrics = {**metrics, "sample/freshness_weight_mean": float(fresh.mean()),
                   "sample/freshness_weight_min": float(fresh.min()),
                   "sample/freshness_drift_mean": float(drift.mean()),
                   "sample/freshness_tokens_total": float(index.numel())}
        return out if weights is None else weights * out, metrics

    def _position_weights(self, row: PackedRow, teacher: torch.Tensor, weights: torch.Tensor | None,
                          metrics: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        """``weights`` (None: 1) times IW-OPD's position weights of the row's samples (``teacher`` (M,): log π_T of
        the sampled tokens; :func:`~fastdistill.loss.opd_levers.packed_position_weights`), their mean and minimum."""
        position = packed_position_weights(teacher, row.rollout_logprobs, row.token_sample,
                                           self.position_gamma).float()
        if position.numel():
            metrics = {**metrics, "sample/position_weight_mean": float(position.mean()),
                       "sample/position_weight_min": float(position.min())}
        return position if weights is None else weights * position, metrics

    @torch.no_grad()
    def _hidden_teacher_logprobs(self, row: PackedRow, ids: torch.Tensor, teacher: torch.Tensor,
                                 compute_dtype: torch.dtype) -> torch.Tensor:
        """``teacher`` (M, S) with the rows of hidden-state teachers' targets replaced by log π_T at ``ids``
        (M, S), from the teacher's head on its hidden states (full vocabulary in row chunks, the loss temperature,
        autocast off as for the dense loss; the head in the student's compute dtype, as :meth:`_mixed_jsd` uses
        it)."""
        if not row.teacher_hidden:
            return teacher
        teacher = teacher.clone()
        with torch.autocast(teacher.device.type, enabled=False):
            for index, teacher_hidden in sorted(row.teacher_hidden.items()):
                head = self._teacher_head(index, compute_dtype)
                targets = row.hidden_targets(index)
                teacher[targets] = sampled_token_logprobs(
                    teacher_hidden.to(compute_dtype), head.weight, ids[targets], bias=head.bias,
                    logit_scale=head.logit_scale, softcap=head.softcap, temperature=self.loss_kwargs["temperature"],
                ).to(teacher.dtype)
        return teacher

    def _as_output(self, out: Any, teacher_index: torch.Tensor) -> SparseJSDOutput:
        """A policy-gradient or query-estimator output as the :class:`SparseJSDOutput` the step sums (``jsd_sum``:
        the reverse-KL estimate; per teacher: positions and that estimate)."""
        with torch.no_grad():
            estimate = out.reverse_kl
            per_teacher = torch.zeros(self.loss_kwargs["num_teachers"], 3, dtype=torch.float64,
                                      device=estimate.device)
            per_row = torch.stack([torch.ones_like(estimate), estimate, torch.zeros_like(estimate)], dim=1).double()
            per_teacher.index_add_(0, teacher_index, per_row)
        zero = out.reverse_kl_sum * 0.0
        return SparseJSDOutput(loss=out.loss, jsd_sum=out.reverse_kl_sum, entropy_sum=zero,
                               teacher_entropy_sum=zero, num_tokens=out.num_tokens, per_teacher=per_teacher)

    @torch.no_grad()
    def _importance_weights(self, hidden: torch.Tensor, head: HeadOperands, row: PackedRow,
                            stale: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """(M,) weights: 1 on fresh positions, min(π_θ(y)/μ(y), clip) on stale ones, the ratio of
        :func:`~fastdistill.loss.importance_ratios` (π_θ at the sampling temperature over the full vocabulary)."""
        index = stale.nonzero().squeeze(1)
        ratio = importance_ratios(hidden.index_select(0, index), head.weight, row.actual_ids[index],
                                  row.rollout_logprobs[index], bias=head.bias, logit_scale=self.logit_head.scale,
                                  softcap=self.logit_head.softcap, sampling_temperature=self.sampling_temperature)
        weights = torch.ones(stale.shape[0], dtype=torch.float32, device=hidden.device)
        weights[index] = ratio.clamp(max=self.ratio_clip)
        metrics = {"sample/importance_ratio_mean": float(ratio.mean()),
                   "sample/importance_ratio_max": float(ratio.max()),
                   "sample/importance_clip_frac": float((ratio > self.ratio_clip).float().mean()),
                   "sample/importance_tokens_total": float(index.numel())}
        return weights, metrics


def pg_metrics(out: Any, entries: int, ratio: bool) -> dict[str, float]:
    """``pg/*`` metrics of a policy-gradient or query-estimator output over its ``entries`` (positions × draws):
    the advantage's mean and std, and with the importance ratio its mean, max and the fractions clipped and masked."""
    count = max(entries, 1)
    mean = float(out.advantage_sum) / count
    metrics = {"pg/advantage_mean": mean,
               "pg/advantage_std": math.sqrt(max(0.0, float(out.advantage_sq_sum) / count - mean**2))}
    if ratio:
        metrics.update({"pg/ratio_mean": float(out.ratio_sum) / count, "pg/ratio_max": float(out.ratio_max),
                        "pg/clip_frac": float(out.clipped) / count,
                        "pg/mask_frac": float(out.masked if out.masked is not None else 0.0) / count})
    return metrics


def default_attention(device: torch.device) -> str:
    """``flash_attention_2`` on CUDA when flash-attn is installed (varlen kernels over the packed row, boundaries
    from ``position_ids``), else ``sdpa`` (transformers turns packed ``position_ids`` into a block-diagonal mask)."""

    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (modules whose class is in ``model._no_split_modules``), each sharded on its own."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


# ----------------------------------------------------------------------------------------------------- loading


def load_tokenizer(config: AsyncDistillationConfig) -> Any:
    """The student's tokenizer (its eos token doubles as the pad token when it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(config: AsyncDistillationConfig, device: torch.device) -> nn.Module:
    """The student causal LM in ``config.dtype`` (``model_init_kwargs`` override), with ``default_attention``."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(config.model_init_kwargs or {})
    kwargs.setdefault("trust_remote_code", config.trust_remote_code)
    kwargs.setdefault("dtype", "auto" if config.dtype == "auto" else getattr(torch, config.dtype))
    kwargs.setdefault("attn_implementation", default_attention(device))
    return AutoModelForCausalLM.from_pretrained(config.model_name_or_path, **kwargs)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_master_weights(model: nn.Module, config: AsyncDistillationConfig) -> torch.dtype | None:
    """Warn loudly when full fine-tuning would train bfloat16/float16 master weights; return their dtype then, else
    None. (LoRA adapters are created in float32 by peft whatever the base model's dtype.)"""
    if config.lora_r > 0:
        return None
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    low = sorted(str(d).removeprefix("torch.") for d in dtypes if d in LOW_PRECISION)
    if not low:
        return None
    lr = config.learning_rate
    logger.warning(
        "Full fine-tuning with %s master weights (dtype=%r): an AdamW update of about lr=%g is far below half a %s "
        "ulp of a typical weight (2^-9 relative for bfloat16), so most weights will never change. Load float32 master "
        "weights (dtype: float32) and compute in bfloat16 with bf16: true (autocast on one process, FSDP2 mixed "
        "precision on several), or train LoRA adapters (lora_r > 0).", "/".join(low), config.dtype, lr, low[0])
    return next(d for d in dtypes if d in LOW_PRECISION)


def prepare_student(hf_model: nn.Module, config: AsyncDistillationConfig, device: torch.device, shard: bool,
                    bf16: bool) -> tuple[DistillationModel, nn.Module]:
    """LoRA adapters (``lora_r > 0``), gradient checkpointing, train mode and, with ``shard`` (a process group
    exists), FSDP2 ``fully_shard`` per decoder layer and on the root (bf16 parameters in compute, fp32 reductions
    when ``bf16``).
    Returns the wrapped model and the (possibly peft-wrapped) Hugging Face model."""
    hf_model.config.use_cache = False
    if config.lora_r > 0:
        hf_model = apply_lora(hf_model, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                              target_modules=config.lora_target_modules)
        if config.gradient_checkpointing:
            hf_model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need a grad input
    if config.gradient_checkpointing:
        if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model.train()
    wrapped = DistillationModel(hf_model, config).to(device)
    if shard:
        shard_student(wrapped, hf_model, bf16)
    return wrapped, hf_model


def shard_student(root: nn.Module, hf_model: nn.Module, bf16: bool) -> None:
    """FSDP2 ``fully_shard`` over the default process group: each decoder layer of ``hf_model`` on its own, then
    ``root`` (the module whose forward runs the step, holding ``hf_model``) for the rest (embeddings, final norm,
    lm_head). With ``bf16``: bf16 parameters in compute, fp32 gradient reductions."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for layer in decoder_layers(hf_model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
