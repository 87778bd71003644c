"""Public loss API: :func:`sparse_jsd_loss`, input validation and backend dispatch."""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from .chunked import LossConfig, sparse_jsd_rows
from .options import BACKENDS, TAIL_MODES
from .outputs import SparseJSDOutput, summarize
from .reference import reference_sparse_jsd
from .routing import TRITON_DTYPES, route
from .support import _check_beta, canonical_mask


def sparse_jsd_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    lps: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    add_tail_bucket: bool = True,
    tail_mode: str = "exact",
    teacher_index: torch.Tensor | None = None,
    num_teachers: int = 1,
    backend: str = "auto",
    token_weights: torch.Tensor | None = None,
) -> SparseJSDOutput:
    """Sparse generalized JSD between the student (lm_head over ``hidden``) and a sparse teacher.

    Student logits ``z = softcap(logit_scale · (hidden @ weight.T + bias)) / temperature`` over the full
    vocabulary, never materialised beyond a bounded tile. Support per position: the valid slots of ``ids``
    (see :func:`fastdistill.narrow_support`) plus, with ``add_tail_bucket``, one bucket for the leftover mass.

    Args:
        hidden: ``(N, D)`` student hidden states of the trained positions.
        weight: ``(V, D)`` lm_head weight. bias: ``(V,)`` or None.
        ids: ``(N, S)`` integer candidate ids, -1 = empty slot. A repeated id counts once.
        lps: ``(N, S)`` teacher log-probs (nats) of the candidates.
        mask: ``(N, S)`` bool, slots to use. Positions with no usable slot are not scored.
        logit_scale, softcap: logit post-processing read from the model config (softcap(x) = c·tanh(x/c)).
        beta: 0 = forward KL(teacher‖student), 1 = reverse KL, otherwise β·KL(q‖m) + (1−β)·KL(p‖m),
            m = (1−β)·p + β·q.
        temperature: divides the student logits (the teacher is scored at the same temperature).
        add_tail_bucket: append the leftover mass log(1 − Σ p) on each side; otherwise renormalise both sides
            over the support.
        tail_mode: ``"exact"`` (student tail = log-sum-exp over the non-candidate vocabulary − full log-sum-exp)
            or ``"trl"`` (TRL's subtraction with clamp). The teacher tail is always the clamped subtraction.
        teacher_index: ``(N,)`` integer teacher index per position for per-teacher statistics, or None.
        num_teachers: number of teachers (rows of ``per_teacher``).
        backend: ``"auto"`` (for CUDA tensors in float32/bfloat16/float16 with triton installed: the fastest
            Triton design validated on a real GPU that fits the free memory — ``"triton-chunked"``, else
            ``"triton"`` — see :mod:`fastdistill.loss.routing`; otherwise the torch path), ``"torch"``
            (memory-bounded torch path), ``"reference"`` (dense float64-capable oracle; materialises N×V),
            ``"triton"`` (the fused kernels, always: CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``), ``"triton-chunked"`` (6·N·D·V FLOPs: cuBLAS fp32 logits per chunk of ≤ 4096 rows
            within 960 MiB, two Triton passes over them, gradients in the forward; only ``loss`` is differentiable,
            see :func:`fastdistill_kernels.chunked_logits_sparse_jsd`; same devices as ``"triton"``).
        token_weights: ``(N,)`` non-negative constants, or None: ``loss = Σ w_i · div_i`` (e.g. importance ratios
            for stale samples). The metrics (``jsd_sum``, ``per_teacher``, …) stay unweighted.

    Returns:
        :class:`SparseJSDOutput`.
    """
    _validate(hidden, weight, bias, ids, lps, mask, logit_scale, softcap, beta, temperature, add_tail_bucket,
              tail_mode, teacher_index, num_teachers, backend)
    _validate_weights(token_weights, hidden)
    cfg = LossConfig(logit_scale=logit_scale, softcap=softcap, beta=beta, temperature=temperature,
                     add_tail_bucket=add_tail_bucket, tail_mode=tail_mode)
    if backend == "reference":
        return reference_sparse_jsd(hidden, weight, ids, lps, mask, bias=bias, cfg=cfg,
                                    teacher_index=teacher_index, num_teachers=num_teachers,
                                    token_weights=token_weights)
    chunk_rows = None
    if backend == "auto":
        picked = route("sparse", ((hidden, weight),), k=ids.shape[1])
        backend, chunk_rows = picked.backend, picked.chunk_rows
    if backend == "triton-chunked":
        return _triton_chunked_sparse_jsd(hidden, weight, bias, ids, lps, mask, cfg, teacher_index, num_teachers,
                                          token_weights, chunk_rows=chunk_rows)
    if backend == "triton":
        return _triton_sparse_jsd(hidden, weight, bias, ids, lps, mask, cfg, teacher_index, num_teachers,
                                  token_weights)
    return torch_sparse_jsd(hidden, weight, bias, ids, lps, mask, cfg, teacher_index, num_teachers,
                            token_weights=token_weights)


def _triton_sparse_jsd(hidden, weight, bias, ids, lps, mask, cfg: LossConfig, teacher_index=None,
                       num_teachers=1, token_weights=None) -> SparseJSDOutput:
    """The fused Triton kernels on validated inputs: canonical slots, scored rows only, then the kernel op."""
    _check_triton_inputs(hidden, weight, "triton")
    from fastdistill_kernels import fused_sparse_jsd  # needs triton, an optional dependency: only on this path

    hidden, ids, lps, valid, teacher_index, token_weights = _scored_rows(hidden, ids, lps, mask, teacher_index,
                                                                        token_weights)
    div, ent, tent = fused_sparse_jsd(
        hidden, weight, ids, lps, valid, bias=bias, logit_scale=cfg.logit_scale, softcap=cfg.softcap, beta=cfg.beta,
        temperature=cfg.temperature, add_tail_bucket=cfg.add_tail_bucket, tail_mode=cfg.tail_mode,
    )
    loss = div.sum() if token_weights is None else (div * token_weights.to(div.dtype)).sum()
    return summarize(loss, div.detach(), ent, tent, teacher_index, num_teachers)


def _check_triton_inputs(hidden, weight, backend: str) -> None:
    """The Triton backends' requirements: triton installed, CUDA tensors (or the interpreter), a kernel dtype."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"backend={backend!r} needs the triton package: pip install 'fastdistill[gpu]'")
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend={backend!r} got {hidden.device.type} tensors: use CUDA tensors, or set "
                         "TRITON_INTERPRET=1 (before fastdistill_kernels is imported) to run the kernels in Triton's "
                         "CPU interpreter")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if x.dtype not in TRITON_DTYPES:
            raise ValueError(f"backend={backend!r} takes float32, bfloat16 or float16 {name}, got {x.dtype}; "
                             "use backend='torch' for other dtypes")


def _triton_chunked_sparse_jsd(hidden, weight, bias, ids, lps, mask, cfg: LossConfig, teacher_index=None,
                               num_teachers=1, token_weights=None, chunk_rows: int | None = None) -> SparseJSDOutput:
    """The chunked-logits Triton path (6·N·D·V FLOPs) on validated inputs; ``chunk_rows`` overrides the chunk."""
    _check_triton_inputs(hidden, weight, "triton-chunked")
    from fastdistill_kernels import chunked_logits_sparse_jsd  # needs triton (optional)

    hidden, ids, lps, valid, teacher_index, token_weights = _scored_rows(hidden, ids, lps, mask, teacher_index,
                                                                        token_weights)
    out = chunked_logits_sparse_jsd(
        hidden, weight, ids, lps, valid, bias=bias, logit_scale=cfg.logit_scale, softcap=cfg.softcap, beta=cfg.beta,
        temperature=cfg.temperature, add_tail_bucket=cfg.add_tail_bucket, tail_mode=cfg.tail_mode,
        row_weights=token_weights, chunk_rows=chunk_rows,
    )
    return summarize(out.loss, out.divergence.detach(), out.entropy, out.teacher_entropy, teacher_index,
                     num_teachers)


def torch_sparse_jsd(hidden, weight, bias, ids, lps, mask, cfg: LossConfig, teacher_index=None, num_teachers=1,
                     chunk_rows: int | None = None, token_weights=None) -> SparseJSDOutput:
    """The memory-bounded torch path on validated inputs (``chunk_rows`` overrides the tile height)."""
    hidden, ids, lps, valid, teacher_index, token_weights = _scored_rows(hidden, ids, lps, mask, teacher_index,
                                                                        token_weights)
    loss, div, ent, tent = _SparseJSD.apply(hidden, weight, bias, ids, lps, valid, cfg, chunk_rows, token_weights)
    return summarize(loss, div, ent, tent, teacher_index, num_teachers)


def _scored_rows(hidden, ids, lps, mask, teacher_index, token_weights=None):
    """Canonical slots, and only the rows that have one (no copy when every row is scored)."""
    valid = canonical_mask(ids, lps, mask)
    idx = valid.any(dim=1).nonzero().squeeze(1)
    if idx.numel() == ids.shape[0]:
        return hidden, ids, lps, valid, teacher_index, token_weights
    teacher_index = None if teacher_index is None else teacher_index[idx]
    token_weights = None if token_weights is None else token_weights[idx]
    return hidden.index_select(0, idx), ids[idx], lps[idx], valid[idx], teacher_index, token_weights


class _SparseJSD(torch.autograd.Function):
    """Loss and gradients in one pass over row chunks; backward only scales the saved gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, lps, valid, cfg, chunk_rows, token_weights=None):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        div, ent, tent, dh, dw, db = sparse_jsd_rows(
            hidden, weight, bias, ids, lps, valid, cfg,
            need_dh=need_dh, need_dw=need_dw, need_db=need_db, chunk_rows=chunk_rows, row_weights=token_weights,
        )
        save_gradients(ctx, (dh, dw, db), (hidden, weight, bias))
        ctx.mark_non_differentiable(div, ent, tent)
        loss = div.sum() if token_weights is None else (div * token_weights.to(div.dtype)).sum()
        return loss, div, ent, tent

    @staticmethod
    def backward(ctx, g_loss, *_):
        return (*saved_gradients(ctx, g_loss), None, None, None, None, None, None)


def save_gradients(ctx, grads: tuple, inputs: tuple) -> None:
    """For a loss whose forward already computed its input gradients (``grads``, None where not needed): save them
    and the dtypes of ``inputs`` (None entries allowed) for :func:`saved_gradients`."""
    ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
    ctx.grad_dtypes = tuple(None if x is None else x.dtype for x in inputs)
    ctx.has = tuple(g is not None for g in grads)


def saved_gradients(ctx, g_loss: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients :func:`save_gradients` kept, times the loss's upstream gradient, each in its input's dtype."""
    grads = []
    for saved, has, dtype in zip(ctx.saved_tensors, ctx.has, ctx.grad_dtypes, strict=True):
        if not has:
            grads.append(None)
            continue
        g = saved if _is_one(g_loss) else saved * g_loss.to(saved.dtype)
        grads.append(g.to(dtype))
    return grads


def _is_one(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.numel() == 1 and float(t) == 1.0


def _validate(hidden, weight, bias, ids, lps, mask, logit_scale, softcap, beta, temperature, add_tail_bucket,
              tail_mode, teacher_index, num_teachers, backend):
    def need_tensor(name, x):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")

    for name, x in (("hidden", hidden), ("weight", weight), ("ids", ids), ("lps", lps), ("mask", mask)):
        need_tensor(name, x)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (N, D), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be 2-D (V, D) with D = {hidden.shape[1]}, got shape {tuple(weight.shape)}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    V = weight.shape[0]
    if V == 0:
        raise ValueError("weight must have at least one vocabulary row (V = 0)")
    if bias is not None:
        need_tensor("bias", bias)
        if bias.shape != (V,):
            raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise ValueError(f"bias must be a floating-point tensor, got {bias.dtype}")
    N = hidden.shape[0]
    if ids.dim() != 2 or ids.shape[0] != N:
        raise ValueError(f"ids must be 2-D (N, S) with N = {N}, got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("ids must have at least one candidate slot (S = 0)")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if lps.shape != ids.shape:
        raise ValueError(f"lps must have the shape of ids {tuple(ids.shape)}, got {tuple(lps.shape)}")
    if not lps.is_floating_point():
        raise ValueError(f"lps must be a floating-point tensor, got {lps.dtype}")
    if mask.shape != ids.shape:
        raise ValueError(f"mask must have the shape of ids {tuple(ids.shape)}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    tensors = {"weight": weight, "ids": ids, "lps": lps, "mask": mask}
    if bias is not None:
        tensors["bias"] = bias
    if teacher_index is not None:
        need_tensor("teacher_index", teacher_index)
        tensors["teacher_index"] = teacher_index
    for name, x in tensors.items():
        if x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}; put all inputs on one device")

    _check_beta(beta)
    if not _is_number(temperature) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not _is_number(logit_scale) or not (math.isfinite(logit_scale) and logit_scale > 0):
        raise ValueError(f"logit_scale must be a finite number > 0, got {logit_scale!r}")
    if softcap is not None and (not _is_number(softcap) or not (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not isinstance(add_tail_bucket, bool):
        raise ValueError(f"add_tail_bucket must be a bool, got {add_tail_bucket!r}")
    if tail_mode not in TAIL_MODES:
        raise ValueError(f"tail_mode must be one of {TAIL_MODES}, got {tail_mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(num_teachers, int) or isinstance(num_teachers, bool) or num_teachers < 1:
        raise ValueError(f"num_teachers must be an int >= 1, got {num_teachers!r}")
    if not add_tail_bucket and ids.shape[1] == 1:
        raise ValueError(
            "add_tail_bucket=False with a single support slot (e.g. beta=1) renormalises both sides to a point "
            "mass, so the loss would be identically zero; keep add_tail_bucket=True"
        )

    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= V:
            raise ValueError(f"ids must lie in [-1, V) = [-1, {V}) (-1 = empty slot), got values in [{lo}, {hi}]"
                             + ("; a teacher whose vocabulary is padded beyond the student's: fold those candidates "
                                "into the tail first with fastdistill.fold_out_of_vocab(ids, lps, V)"
                                if hi >= V else ""))
        used = mask & (ids >= 0)
        bad = used & (torch.isnan(lps) | (lps == float("inf")))
        if bool(bad.any()):
            raise ValueError(
                f"lps has {int(bad.sum())} NaN or +inf teacher log-probs on used slots (mask set, id >= 0); "
                "drop those candidates (set their mask to False) before calling"
            )
    check_teacher_index(teacher_index, N, num_teachers)


def check_teacher_index(teacher_index: torch.Tensor | None, N: int, num_teachers: int) -> None:
    """Raise ValueError unless ``teacher_index`` is None or an ``(N,)`` integer tensor of values in
    ``[0, num_teachers)``."""
    if teacher_index is None:
        return
    if teacher_index.shape != (N,):
        raise ValueError(f"teacher_index must have shape ({N},), got {tuple(teacher_index.shape)}")
    if teacher_index.is_floating_point() or teacher_index.dtype == torch.bool:
        raise ValueError(f"teacher_index must be an integer tensor, got {teacher_index.dtype}")
    if N and (int(teacher_index.min()) < 0 or int(teacher_index.max()) >= num_teachers):
        raise ValueError(f"teacher_index values must lie in [0, num_teachers) = [0, {num_teachers}), got values in "
                         f"[{int(teacher_index.min())}, {int(teacher_index.max())}]")


def _validate_weights(token_weights, hidden) -> None:
    if token_weights is None:
        return
    if not isinstance(token_weights, torch.Tensor):
        raise ValueError(f"token_weights must be None or a torch.Tensor, got {type(token_weights).__name__}")
    N = hidden.shape[0]
    if token_weights.shape != (N,):
        raise ValueError(f"token_weights must have shape ({N},), got {tuple(token_weights.shape)}")
    if not token_weights.is_floating_point():
        raise ValueError(f"token_weights must be a floating-point tensor, got {token_weights.dtype}")
    if token_weights.device != hidden.device:
        raise ValueError(f"token_weights is on {token_weights.device} but hidden is on {hidden.device}; put all "
                         "inputs on one device")
    if token_weights.requires_grad:
        raise ValueError("token_weights must not require grad (they are constants, e.g. detached importance ratios)")
    if N and not bool((torch.isfinite(token_weights) & (token_weights >= 0)).all()):
        raise ValueError("token_weights must be finite and >= 0")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
