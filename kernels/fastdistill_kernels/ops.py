"""The fused loss as a torch.autograd.Function and its functional entry point :func:`fused_sparse_jsd`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .backward import BACKWARD_MODES, backward_grads
from .buckets import bucket_divergence, logit_gradients
from .candidates import SortedCandidates, sort_candidates
from .config import TileConfig, default_config, device_guard, interpreting
from .forward import forward_stats

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TAIL_MODES = ("exact", "trl")


@dataclass(frozen=True)
class LossSettings:
    """Scalar settings of the loss (see :func:`fused_sparse_jsd`)."""

    logit_scale: float
    softcap: float | None
    beta: float
    temperature: float
    add_tail_bucket: bool
    tail_mode: str

    def bucket_kwargs(self) -> dict:
        return dict(beta=self.beta, add_tail_bucket=self.add_tail_bucket, tail_mode=self.tail_mode)


class RowLosses(NamedTuple):
    """Per-row results of :func:`fused_sparse_jsd`, each ``(N,)`` fp32 in nats.

    Attributes:
        divergence: differentiable w.r.t. hidden, weight and bias.
        entropy: the student's full-vocabulary entropy at the temperature (detached).
        teacher_entropy: the teacher's entropy over support + tail (detached).
    """

    divergence: torch.Tensor
    entropy: torch.Tensor
    teacher_entropy: torch.Tensor


class FusedSparseJSD(torch.autograd.Function):
    """Forward: kernel statistics and per-row divergence; saves O(N·S) besides the inputs. Backward: recomputes
    the logit tiles and accumulates dh, dW, db for any per-row upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, teacher_logprobs, valid, settings: LossSettings, backward_mode: str,
                filter_eps: float | None, cfg: TileConfig):
        covers_vocab = valid.sum(dim=1) >= weight.shape[0]
        cands = sort_candidates(ids, valid, weight.shape[0])
        if hidden.shape[0] == 0:  # nothing to launch; the loss is an empty sum
            z_cand, lse, m_nc, s_nc, div, entropy, teacher_entropy = (
                hidden.new_zeros(0, dtype=torch.float32) for _ in range(7))  # distinct tensors: outputs differ
        else:
            with device_guard(hidden.device):  # Triton launches on the current device, not the tensors'
                stats = forward_stats(hidden, weight, bias, cands, logit_scale=settings.logit_scale,
                                      softcap=settings.softcap, temperature=settings.temperature, cfg=cfg)
            z_cand, lse, m_nc, s_nc, entropy = stats.z_cand, stats.lse, stats.m_nc, stats.s_nc, stats.entropy
            div, teacher_entropy = bucket_divergence(z_cand, lse, stats.lse_nc, teacher_logprobs, valid,
                                                     covers_vocab, **settings.bucket_kwargs())
        ctx.save_for_backward(hidden, weight, bias, cands.ids, cands.order, z_cand, lse, m_nc, s_nc,
                              teacher_logprobs, valid, covers_vocab)
        ctx.search_steps = cands.search_steps
        ctx.settings, ctx.backward_mode, ctx.filter_eps, ctx.cfg = settings, backward_mode, filter_eps, cfg
        ctx.mark_non_differentiable(entropy, teacher_entropy)
        return div, entropy, teacher_entropy

    @staticmethod
    def backward(ctx, grad_div, _grad_entropy, _grad_teacher_entropy):
        (hidden, weight, bias, sorted_ids, order, z_cand, lse, m_nc, s_nc, teacher_logprobs, valid,
         covers_vocab) = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and bias is not None
        if hidden.shape[0] == 0:
            grads = [torch.zeros_like(x) if need else None
                     for x, need in zip((hidden, weight, bias), (need_dh, need_dw, need_db), strict=True)]
            return (*grads, None, None, None, None, None, None, None)
        s = ctx.settings
        grad_rows = grad_div.float()
        coef_nc, cand_grad = logit_gradients(z_cand, lse, m_nc, s_nc, teacher_logprobs, valid, covers_vocab,
                                             grad_rows, **s.bucket_kwargs())
        cands = SortedCandidates(ids=sorted_ids, order=order, search_steps=ctx.search_steps)
        with device_guard(hidden.device):  # autograd may run backward on another current device
            dh, dw, db = backward_grads(
                hidden, weight, bias, cands, m_nc, coef_nc.contiguous(), cand_grad.contiguous(), grad_rows.abs(),
                logit_scale=s.logit_scale, softcap=s.softcap, temperature=s.temperature, mode=ctx.backward_mode,
                filter_eps=ctx.filter_eps, need_dh=need_dh, need_dw=need_dw, need_db=need_db, cfg=ctx.cfg,
            )
        grads = [None if g is None else g.to(x.dtype)
                 for g, x in zip((dh, dw, db), (hidden, weight, bias), strict=True)]
        return (*grads, None, None, None, None, None, None, None)


def fused_sparse_jsd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    valid: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    add_tail_bucket: bool = True,
    tail_mode: str = "exact",
    backward_mode: str = "deterministic",
    filter_eps: float | None = None,
    config: TileConfig | None = None,
) -> RowLosses:
    """Per-row sparse generalized JSD of the student ``softcap(logit_scale·(hidden @ weightᵀ + bias)) / T``
    against a sparse teacher, without materialising the ``(N, V)`` logits.

    Args:
        hidden: ``(N, D)``; weight ``(V, D)``; bias ``(V,)`` or None. float32, bfloat16 or float16 on CUDA, or on
            CPU under ``TRITON_INTERPRET=1``; hidden and weight are brought to their common dtype.
        ids: ``(N, S)`` integer candidate ids; only slots where ``valid`` is set are read.
        teacher_logprobs: ``(N, S)`` teacher log-probs (nats), finite where ``valid``.
        valid: ``(N, S)`` bool, canonical: distinct ids within a row, at least one valid slot per row.
        logit_scale, softcap, temperature: logit post-processing (softcap(x) = c·tanh(x/c)).
        beta: 0 = KL(teacher‖student), 1 = KL(student‖teacher), else the generalized JSD (TRL convention).
        add_tail_bucket, tail_mode: leftover-mass bucket, "exact" (non-candidate log-sum-exp) or "trl"
            (clamped subtraction); without it both sides renormalise over the support.
        backward_mode: "deterministic" (per vocabulary chunk, an (N, chunk) dL/dx workspace within
            ``config.workspace_bytes`` and torch GEMMs; the same inputs give the same bits) or "fused" (fp32
            atomics, no workspace, summation order not fixed).
        filter_eps: skip backward tiles whose every |dL/dx| < filter_eps · |row's upstream gradient| (tiles with
            candidates are always kept); None = exact. Saves work in the fused mode only: the deterministic mode
            writes such tiles as zeros and its GEMMs stay dense, so there the filter only adds its bounded error.
        config: tile sizes; default: :func:`fastdistill_kernels.config.default_config` for the device and dtype.

    Returns:
        :class:`RowLosses`; ``divergence.sum()`` is the loss, and any per-row weighting of it backpropagates.
    """
    _validate(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode, backward_mode, filter_eps)
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    settings = LossSettings(logit_scale=float(logit_scale), softcap=None if softcap is None else float(softcap),
                            beta=float(beta), temperature=float(temperature), add_tail_bucket=bool(add_tail_bucket),
                            tail_mode=tail_mode)
    out = FusedSparseJSD.apply(
        hidden.to(dtype).contiguous(), weight.to(dtype).contiguous(), None if bias is None else bias.contiguous(),
        ids, teacher_logprobs.float(), valid, settings, backward_mode, filter_eps,
        config or default_config(hidden.device, dtype),
    )
    return RowLosses(*out)


def validate_loss_inputs(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode) -> None:
    """Raise ValueError for inputs no Triton entry point takes: device, dtypes, shapes, ``valid``'s dtype, tail
    mode (shared by :func:`fused_sparse_jsd` and the chunked-logits path)."""
    if hidden.device.type == "cpu" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run them on the CPU")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if x.dtype not in DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16 for the Triton kernels, got {x.dtype}")
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden (N, D) and weight (V, D) disagree: {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not (ids.shape == teacher_logprobs.shape == valid.shape) or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids, teacher_logprobs and valid must all be (N={hidden.shape[0]}, S), got "
                         f"{tuple(ids.shape)}, {tuple(teacher_logprobs.shape)}, {tuple(valid.shape)}")
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
    if tail_mode not in TAIL_MODES:
        raise ValueError(f"tail_mode must be one of {TAIL_MODES}, got {tail_mode!r}")


def _validate(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode, backward_mode, filter_eps):
    validate_loss_inputs(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode)
    if backward_mode not in BACKWARD_MODES:
        raise ValueError(f"backward_mode must be one of {BACKWARD_MODES}, got {backward_mode!r}")
    if filter_eps is not None and not (math.isfinite(filter_eps) and filter_eps > 0):
        raise ValueError(f"filter_eps must be None or a finite number > 0, got {filter_eps!r}")
