"""Dense-teacher generalized JSD: the student's and the teacher's full-vocabulary distributions, both from hidden
states and an lm_head, never materialised beyond row chunks.

Per chunk of ``c`` scored rows the torch path computes the student's ``(c, V)`` and the teacher's ``(c, V)`` logits
once, turns them into log-probs in place, evaluates the divergence per row in log space and, in the same pass, the
student's ``dL/dz`` in closed form (below), which two GEMMs fold into ``dh`` and ``dW``. Backward only scales the
stored gradients: 6·N·D_s·V FLOPs for the student (logits, dh, dW) and 2·N·D_t·V for the teacher (logits once).

Closed forms, with s = log p (student), t = log q (teacher), both normalised over the student's vocabulary, and
``g_v = ∂D/∂s_v`` (s treated as free coordinates; through the log-softmax ``dD/dz_v = g_v − p_v Σ_u g_u``):

- β = 0, D = Σ q (t − s): ``dD/dz = p − q``.
- β = 1, D = Σ p (s − t): ``g = p (s − t + 1)``, so ``dD/dz = p (s − t − D)``.
- otherwise, log m = logaddexp(s + log(1−β), t + log β), D = β Σ q (t − log m) + (1−β) Σ p (s − log m):
  ``g = (1−β) p (s − log m)`` (the terms through log m cancel because m = βq + (1−β)p).

Every log-prob is a finite logit minus a finite log-sum-exp, so no log(0) appears, and p·(…) where p underflows
is an exact 0.

On a GPU the torch path works as the sparse one (:mod:`fastdistill.loss.chunked`): tiles of 512 MiB each (four of
them), bf16 inputs as bf16 GEMM operands with fp32 results, ``dL/dz`` rounded once to bf16 for the gradient GEMMs
(:mod:`fastdistill.loss.gemm`; the precision policy of docs/loss.md), row blocks of 128 MiB in the reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .api import (
    _check_triton_inputs,
    _is_number,
    _validate_weights,
    check_teacher_index,
    save_gradients,
    saved_gradients,
    torch_sparse_jsd,
)
from .chunked import LossConfig, default_chunk_rows
from .gemm import gemm_into, half_operands
from .options import BACKENDS
from .outputs import DenseJSDOutput, summarize_dense
from .reference import reference_dense_teacher_jsd
from .routing import route
from .support import _check_beta
from .tile_rows import log_mixture, row_logsumexp, rowdot, rowdot_exp_diff


@dataclass(frozen=True)
class Head:
    """Logit post-processing of one side: ``z = softcap(scale · (h Wᵀ + b)) / T`` (softcap(x) = c·tanh(x/c))."""

    scale: float
    softcap: float | None
    temperature: float

    def logits(self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """Final logits of ``h`` ``(c, D)`` against ``w`` ``(V', D)`` into ``out`` ``(c, V')`` (fp32 or fp64;
        ``h``, ``w`` in its dtype, or bf16 operands of an fp32-output GEMM, :func:`fastdistill.loss.gemm.gemm_into`)."""
        if b is None:
            gemm_into(out, h, w.t())
        elif h.dtype == out.dtype:
            torch.addmm(b, h, w.t(), out=out)
        else:
            gemm_into(out, h, w.t())
            out.add_(b)
        if self.softcap is None:
            return out.mul_(self.scale / self.temperature)
        c = self.softcap
        return out.mul_(self.scale / c).tanh_().mul_(c / self.temperature)


def dense_teacher_jsd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    teacher_index: torch.Tensor | None = None,
    num_teachers: int = 1,
    backend: str = "auto",
    chunk_rows: int | None = None,
    student_top_k: int | None = None,
) -> DenseJSDOutput:
    """Generalized JSD between the student's and the teacher's full-vocabulary distributions at each position.

    Both sides are lm_heads over hidden states: ``z = softcap(logit_scale · (h Wᵀ + b)) / temperature``, with
    each side's own scale and softcap and the same temperature. The teacher's vocabulary may be padded beyond the
    student's (``V_t ≥ V_s``): its probability on ids ≥ V_s is dropped and the rest renormalised (the student
    cannot produce those ids; see ``teacher_dropped_mass_sum``). The teacher inputs are constants: they are
    detached, so they never receive a gradient.

    Args:
        student_hidden: ``(N, D_s)`` student hidden states of the trained positions.
        student_weight: ``(V_s, D_s)`` student lm_head weight; ``student_bias`` ``(V_s,)`` or None.
        teacher_hidden: ``(N, D_t)`` teacher final hidden states of the same positions.
        teacher_weight: ``(V_t, D_t)`` teacher lm_head weight, ``V_t ≥ V_s``; ``teacher_bias`` ``(V_t,)`` or None.
        student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap: each model's logit
            post-processing, read from its config.
        beta: 0 = forward KL(teacher‖student), 1 = reverse KL(student‖teacher), otherwise
            β·KL(q‖m) + (1−β)·KL(p‖m) with m = (1−β)·p + β·q (p student, q teacher), as :func:`sparse_jsd_loss`.
        temperature: divides both sides' logits.
        mask: ``(N,)`` bool, positions to score, or None (all).
        token_weights: ``(N,)`` non-negative constants, or None: ``loss = Σ w_i · div_i``; metrics unweighted.
        teacher_index: ``(N,)`` integer teacher index per position for ``per_teacher``, or None.
        num_teachers: number of teachers (rows of ``per_teacher``).
        backend: ``"torch"`` (memory-bounded row chunks, gradients in the forward), ``"reference"`` (dense,
            materialises ``(N, V)``; the oracle of the tests), ``"triton"`` (both lm_heads fused into the kernels'
            tiles, no logits in memory, :func:`fastdistill_kernels.dense_fused.fused_dense_teacher_jsd`),
            ``"triton-chunked"`` (cuBLAS logits per row chunk and two Triton passes,
            :func:`fastdistill_kernels.dense_chunk.chunked_dense_teacher_jsd`), or ``"auto"``: for CUDA tensors in
            float32/bfloat16/float16, the fastest Triton design validated on a real GPU that fits the free memory
            (``"triton-chunked"``, else ``"triton"``; :mod:`fastdistill.loss.routing`, as for
            :func:`sparse_jsd_loss`), else ``"torch"``.
            The Triton backends take CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``; ``student_top_k``
            stays on the torch path.
        chunk_rows: rows per chunk of the torch path, or None (tiles of at most 32 MiB, at most 256 rows).
        student_top_k: None (the full-vocabulary divergence), or k: the divergence over the student's own top-k
            tokens per position (by its final logits; a selection without gradient) plus one tail bucket per side,
            with the teacher's (renormalised) log-probs on them — :func:`sparse_jsd_loss` with those candidates,
            ``add_tail_bucket=True`` and ``tail_mode="exact"``. ``teacher_entropy_sum`` is then over the k buckets
            and the tail, as there.

    Returns:
        :class:`DenseJSDOutput`; ``loss`` is differentiable in the student's hidden states, weight and bias.
    """
    _validate_dense(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                    student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap, beta, temperature,
                    mask, teacher_index, num_teachers, backend, chunk_rows)
    V = student_weight.shape[0]
    if student_top_k is not None and (not isinstance(student_top_k, int) or isinstance(student_top_k, bool)
                                      or not 1 <= student_top_k <= V):
        raise ValueError(f"student_top_k must be None or an int in [1, V_s] = [1, {V}], got {student_top_k!r}")
    _validate_weights(token_weights, student_hidden)
    student = Head(float(student_logit_scale), None if student_softcap is None else float(student_softcap),
                   float(temperature))
    teacher = Head(float(teacher_logit_scale), None if teacher_softcap is None else float(teacher_softcap),
                   float(temperature))
    t_hidden, t_weight = teacher_hidden.detach(), teacher_weight.detach()
    t_bias = None if teacher_bias is None else teacher_bias.detach()
    if backend == "reference":
        return reference_dense_teacher_jsd(student_hidden, student_weight, student_bias, t_hidden, t_weight, t_bias,
                                           student=student, teacher=teacher, beta=float(beta), mask=mask,
                                           token_weights=token_weights, teacher_index=teacher_index,
                                           num_teachers=num_teachers, student_top_k=student_top_k)
    if mask is not None:
        idx = mask.nonzero().squeeze(1)
        if idx.numel() != mask.numel():
            student_hidden, t_hidden = student_hidden.index_select(0, idx), t_hidden.index_select(0, idx)
            teacher_index = None if teacher_index is None else teacher_index[idx]
            token_weights = None if token_weights is None else token_weights[idx]
    if student_top_k is not None:
        return _student_top_k_jsd(student_hidden, student_weight, student_bias, t_hidden, t_weight, t_bias, student,
                                  teacher, float(beta), student_top_k, chunk_rows, token_weights, teacher_index,
                                  num_teachers)
    if backend == "auto":
        picked = route("dense", ((student_hidden, student_weight), (t_hidden, t_weight)), chunk_rows)
        backend, chunk_rows = picked.backend, picked.chunk_rows or chunk_rows
    if backend in ("triton", "triton-chunked"):
        return _triton_dense(student_hidden, student_weight, student_bias, t_hidden, t_weight, t_bias, student,
                             teacher, float(beta), backend, chunk_rows, token_weights, teacher_index, num_teachers)
    loss, div, ent, tent, dropped = _DenseJSD.apply(student_hidden, student_weight, student_bias, t_hidden, t_weight,
                                                    t_bias, student, teacher, float(beta), chunk_rows, token_weights)
    return summarize_dense(loss, div, ent, tent, dropped, teacher_index, num_teachers)


def _triton_dense(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student: Head, teacher: Head,
                  beta: float, backend: str, chunk_rows, token_weights, teacher_index,
                  num_teachers) -> DenseJSDOutput:
    """A Triton backend on scored rows (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``): ``"triton"``, the fused
    kernels (any per-row weighting backpropagates), or ``"triton-chunked"``, the chunked-logits path (gradients of
    the token-weighted sum computed in its forward)."""
    _check_triton_inputs(s_hidden, s_weight, backend)
    _check_triton_inputs(t_hidden, t_weight, backend)
    # the kernels need triton, an optional dependency: imported only on this path
    from fastdistill_kernels.dense_chunk import DenseHeads, chunked_dense_teacher_jsd
    from fastdistill_kernels.dense_fused import fused_dense_teacher_jsd

    heads = DenseHeads(student.scale, student.softcap, teacher.scale, teacher.softcap, student.temperature)
    kw = dict(student_bias=s_bias, teacher_bias=t_bias, heads=heads, beta=beta)
    if backend == "triton":
        div, ent, tent, dropped = fused_dense_teacher_jsd(s_hidden, s_weight, t_hidden, t_weight, **kw)
        loss = div.sum() if token_weights is None else (div * token_weights.to(div.dtype)).sum()
    else:
        loss, div, ent, tent, dropped = chunked_dense_teacher_jsd(s_hidden, s_weight, t_hidden, t_weight, **kw,
                                                                  row_weights=token_weights, chunk_rows=chunk_rows)
    return summarize_dense(loss, div.detach(), ent, tent, dropped, teacher_index, num_teachers)


def _student_top_k_jsd(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student: Head, teacher: Head,
                       beta: float, k: int, chunk_rows, token_weights, teacher_index, num_teachers) -> DenseJSDOutput:
    """The ``student_top_k`` objective on scored rows: a no-grad pass picks the candidates, then the sparse torch
    path (8·N·D_s·V_s FLOPs for the student in all: one extra logits GEMM for the selection)."""
    ids, lps, dropped = student_top_k_support(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student,
                                              teacher, k, chunk_rows)
    cfg = LossConfig(logit_scale=student.scale, softcap=student.softcap, beta=beta, temperature=student.temperature,
                     add_tail_bucket=True, tail_mode="exact")
    out = torch_sparse_jsd(s_hidden, s_weight, s_bias, ids, lps, torch.ones_like(ids, dtype=torch.bool), cfg,
                           teacher_index, num_teachers, chunk_rows=chunk_rows, token_weights=token_weights)
    return DenseJSDOutput(**vars(out), teacher_dropped_mass_sum=dropped.sum())


@torch.no_grad()
def student_top_k_support(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student: Head, teacher: Head,
                          k: int, chunk_rows: int | None = None):
    """Per row, the student's top-k token ids ``(n, k)`` (int64), the teacher's log-probs of them ``(n, k)``
    (renormalised over the student's vocabulary) and the teacher's dropped mass on ids ≥ V_s ``(n,)``; one
    ``(rows, V_s)`` tile per side at a time."""
    n, V, Vt = s_hidden.shape[0], s_weight.shape[0], t_weight.shape[0]
    any64 = torch.float64 in (s_hidden.dtype, s_weight.dtype, t_hidden.dtype, t_weight.dtype)
    cdt = torch.float64 if any64 else torch.float32
    dev = s_hidden.device
    ws, bs = s_weight.to(cdt), None if s_bias is None else s_bias.to(cdt)
    wt, bt = t_weight[:V].to(cdt), None if t_bias is None else t_bias[:V].to(cdt)
    wt_pad, bt_pad = t_weight[V:].to(cdt), None if t_bias is None else t_bias[V:].to(cdt)
    rows_per_chunk = max(1, min(chunk_rows or default_chunk_rows(max(V, Vt), cdt), max(n, 1)))
    ids = torch.empty(n, k, dtype=torch.long, device=dev)
    lps = torch.empty(n, k, dtype=cdt, device=dev)
    dropped = torch.zeros(n, dtype=cdt, device=dev)
    S, T = (torch.empty(rows_per_chunk, V, dtype=cdt, device=dev) for _ in range(2))
    pad = torch.empty(rows_per_chunk, Vt - V, dtype=cdt, device=dev) if Vt > V else None
    for start in range(0, n, rows_per_chunk):
        end = min(start + rows_per_chunk, n)
        rows, c = slice(start, end), end - start
        ids[rows] = student.logits(s_hidden[rows].to(cdt), ws, bs, out=S[:c]).topk(k, dim=1).indices
        t = teacher.logits(t_hidden[rows].to(cdt), wt, bt, out=T[:c])
        lse_t = row_logsumexp(t)
        lps[rows] = t.gather(1, ids[rows]) - lse_t.unsqueeze(1)
        if pad is not None:
            lse_pad = row_logsumexp(teacher.logits(t_hidden[rows].to(cdt), wt_pad, bt_pad, out=pad[:c]))
            dropped[rows] = torch.exp(lse_pad - torch.logaddexp(lse_t, lse_pad))
    return ids, lps, dropped


GPU_DENSE_TILE_BYTES = 2**29  # each of the four (rows, V) fp32 tiles of the torch path on a GPU


def dense_rows(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student: Head, teacher: Head, beta: float, *,
               need_dh: bool, need_dw: bool, need_db: bool, chunk_rows: int | None = None, row_weights=None):
    """Per-row divergence, entropies and dropped teacher mass over scored rows, and the gradients of
    ``Σ w·div`` (``w = row_weights``, default 1) with respect to the student's hidden states, weight and bias.

    Returns ``(div, entropy, teacher_entropy, dropped, dh, dw, db)``: ``(n,)`` tensors and gradients (or None when
    not asked for), all in the compute dtype (float64 when any input is float64, else float32).
    """
    n = s_hidden.shape[0]
    V = s_weight.shape[0]
    Vt = t_weight.shape[0]
    any64 = torch.float64 in (s_hidden.dtype, s_weight.dtype, t_hidden.dtype, t_weight.dtype)
    cdt = torch.float64 if any64 else torch.float32
    dev = s_hidden.device
    on_gpu = dev.type == "cuda"
    s_half, t_half = half_operands(s_hidden, s_weight), half_operands(t_hidden, t_weight)  # bf16 operands (GPU)
    ws = s_weight if s_half else s_weight.to(cdt)
    bs = None if s_bias is None else s_bias.to(cdt)
    wt, wt_pad = (t_weight[:V], t_weight[V:]) if t_half else (t_weight[:V].to(cdt), t_weight[V:].to(cdt))
    bt = None if t_bias is None else t_bias[:V].to(cdt)
    bt_pad = None if t_bias is None else t_bias[V:].to(cdt)
    tile_rows = default_chunk_rows(max(V, Vt), cdt, GPU_DENSE_TILE_BYTES if on_gpu else None, on_gpu=on_gpu)
    rows_per_chunk = max(1, min(chunk_rows or tile_rows, max(n, 1)))
    need_grad = need_dh or need_dw or need_db

    div = torch.empty(n, dtype=cdt, device=dev)
    ent = torch.empty(n, dtype=cdt, device=dev)
    tent = torch.empty(n, dtype=cdt, device=dev)
    dropped = torch.zeros(n, dtype=cdt, device=dev)
    dh = torch.empty(n, s_hidden.shape[1], dtype=cdt, device=dev) if need_dh else None
    dw = torch.zeros(V, s_weight.shape[1], dtype=cdt, device=dev) if need_dw else None
    db = torch.zeros(V, dtype=cdt, device=dev) if need_db else None
    # Four (rows, V) tiles, allocated once and reused by every chunk: student log-probs S, teacher log-probs T,
    # and two work tiles A, B (probabilities, the mixture, the logit gradient).
    S, T, A, B = (torch.empty(rows_per_chunk, V, dtype=cdt, device=dev) for _ in range(4))
    pad = torch.empty(rows_per_chunk, Vt - V, dtype=cdt, device=dev) if Vt > V else None
    # dL/dz rounded once to the bf16 GEMM operands (gemm.py)
    G16 = torch.empty(rows_per_chunk, V, dtype=s_hidden.dtype, device=dev) if s_half and need_grad else None

    for start in range(0, n, rows_per_chunk):
        end = min(start + rows_per_chunk, n)
        rows, c = slice(start, end), end - start
        h = s_hidden[rows] if s_half else s_hidden[rows].to(cdt)
        ht = t_hidden[rows] if t_half else t_hidden[rows].to(cdt)
        s, t, a, b = S[:c], T[:c], A[:c], B[:c]
        student.logits(h, ws, bs, out=s)
        teacher.logits(ht, wt, bt, out=t)
        lse_s = row_logsumexp(s)
        lse_t = row_logsumexp(t)
        if pad is not None:
            lse_pad = row_logsumexp(teacher.logits(ht, wt_pad, bt_pad, out=pad[:c]))
            dropped[rows] = torch.exp(lse_pad - torch.logaddexp(lse_t, lse_pad))
        s.sub_(lse_s.unsqueeze(1))
        t.sub_(lse_t.unsqueeze(1))
        p = torch.exp(s, out=a)
        ent[rows] = -rowdot(p, s)
        q = torch.exp(t, out=b)
        tent[rows] = -rowdot(q, t)
        # Each divergence is a row sum of per-element differences (Σ q·(t − s), not Σ q·t − Σ q·s): the two sums
        # are of the size of |log p| and would cancel to a fraction of their fp32 rounding.
        if beta == 0.0:
            div[rows] = rowdot(q, t.sub_(s))  # tile T now holds t − s
            grad = p.sub_(q) if need_grad else None  # dD/dz = p − q, in tile A
        elif beta == 1.0:
            s_minus_t = torch.sub(s, t, out=b)  # overwrites q (tile B)
            d = rowdot(p, s_minus_t)
            div[rows] = d
            grad = s_minus_t.sub_(d.unsqueeze(1)).mul_(p) if need_grad else None  # dD/dz = p (s − t − D)
        else:
            log_m = log_mixture(s, t, beta, out=b)  # overwrites q (tile B)
            # Σ q·(t − log m) needs q again: exp(t) recomputed in row blocks rather than kept in a fifth tile
            q_term = rowdot_exp_diff(t, log_m)
            s_minus_log_m = log_m.neg_().add_(s)
            div[rows] = beta * q_term + (1.0 - beta) * rowdot(p, s_minus_log_m)
            grad = None
            if need_grad:  # g = (1−β) p (s − log m), dD/dz = g − p Σ g, in tile B
                g = s_minus_log_m.mul_(p).mul_(1.0 - beta)
                grad = g.addcmul_(p, g.sum(dim=1, keepdim=True), value=-1.0)
        if not need_grad:
            continue
        # chain rule to the raw logits x = h Wᵀ + b: dz/dx = (scale / T) · (1 − u²), u = z·T/c under a softcap
        factor = torch.full((c,), student.scale / student.temperature, dtype=cdt, device=dev)
        if row_weights is not None:
            factor = factor * row_weights[rows].to(cdt)
        if student.softcap is not None:
            u = p if grad is not p else t  # a free tile: A when the gradient is in B, else T (t no longer needed)
            torch.add(s, lse_s.unsqueeze(1), out=u).mul_(student.temperature / student.softcap)
            grad.mul_(u.square_().neg_().add_(1.0))
        if G16 is not None:  # dL/dz scaled and rounded once to bf16 in one pass, dh and dW summed in fp32
            g16 = torch.mul(grad, factor.unsqueeze(1), out=G16[:c])
            if need_db:
                db.add_(torch.sum(g16, dim=0, dtype=cdt))
            if need_dh:
                gemm_into(dh[rows], g16, ws)
            if need_dw:
                gemm_into(dw, g16.t(), h, accumulate=True)
            continue
        grad.mul_(factor.unsqueeze(1))
        if need_db:
            db.add_(grad.sum(dim=0))
        if need_dh:
            torch.mm(grad, ws, out=dh[rows])
        if need_dw:
            dw.addmm_(grad.t(), h)
    return div, ent, tent, dropped, dh, dw, db


class _DenseJSD(torch.autograd.Function):
    """Loss and student gradients in one pass over row chunks; backward only scales the saved gradients."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student, teacher, beta, chunk_rows,
                token_weights):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = s_bias is not None and ctx.needs_input_grad[2]
        div, ent, tent, dropped, dh, dw, db = dense_rows(
            s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, student, teacher, beta, need_dh=need_dh,
            need_dw=need_dw, need_db=need_db, chunk_rows=chunk_rows, row_weights=token_weights,
        )
        save_gradients(ctx, (dh, dw, db), (s_hidden, s_weight, s_bias))
        ctx.mark_non_differentiable(div, ent, tent, dropped)
        loss = div.sum() if token_weights is None else (div * token_weights.to(div.dtype)).sum()
        return loss, div, ent, tent, dropped

    @staticmethod
    def backward(ctx, g_loss, *_):
        return (*saved_gradients(ctx, g_loss), None, None, None, None, None, None, None, None)


def _validate_dense(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, s_scale, s_softcap, t_scale, t_softcap,
                    beta, temperature, mask, teacher_index, num_teachers, backend, chunk_rows) -> None:
    def need_tensor(name, x):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")

    for name, x in (("student_hidden", s_hidden), ("student_weight", s_weight), ("teacher_hidden", t_hidden),
                    ("teacher_weight", t_weight)):
        need_tensor(name, x)
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if s_hidden.dim() != 2:
        raise ValueError(f"student_hidden must be 2-D (N, D_s), got shape {tuple(s_hidden.shape)}")
    N = s_hidden.shape[0]
    if t_hidden.dim() != 2 or t_hidden.shape[0] != N:
        raise ValueError(f"teacher_hidden must be 2-D (N, D_t) with N = {N}, got shape {tuple(t_hidden.shape)}")
    for name, w, h in (("student_weight", s_weight, s_hidden), ("teacher_weight", t_weight, t_hidden)):
        D = h.shape[1]
        if w.dim() != 2 or w.shape[1] != D:
            raise ValueError(f"{name} must be 2-D (V, D) with D = {D}, got shape {tuple(w.shape)}")
    V, Vt = s_weight.shape[0], t_weight.shape[0]
    if V == 0:
        raise ValueError("student_weight must have at least one vocabulary row (V = 0)")
    if Vt < V:
        raise ValueError(f"teacher_weight has {Vt} vocabulary rows, fewer than the student's {V}: the teacher must "
                         "cover the student's vocabulary (ids >= V_s of a padded teacher are dropped, not the reverse)")
    tensors = {"student_weight": s_weight, "teacher_hidden": t_hidden, "teacher_weight": t_weight}
    for name, b, rows in (("student_bias", s_bias, V), ("teacher_bias", t_bias, Vt)):
        if b is None:
            continue
        need_tensor(name, b)
        if b.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {tuple(b.shape)}")
        if not b.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {b.dtype}")
        tensors[name] = b
    if mask is not None:
        need_tensor("mask", mask)
        if mask.shape != (N,):
            raise ValueError(f"mask must have shape ({N},), got {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
        tensors["mask"] = mask
    if teacher_index is not None:
        need_tensor("teacher_index", teacher_index)
        tensors["teacher_index"] = teacher_index
    for name, x in tensors.items():
        if x.device != s_hidden.device:
            raise ValueError(f"{name} is on {x.device} but student_hidden is on {s_hidden.device}; put all inputs "
                             "on one device")

    _check_beta(beta)
    if not _is_number(temperature) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    for name, scale in (("student_logit_scale", s_scale), ("teacher_logit_scale", t_scale)):
        if not _is_number(scale) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {scale!r}")
    for name, cap in (("student_softcap", s_softcap), ("teacher_softcap", t_softcap)):
        if cap is not None and (not _is_number(cap) or not (math.isfinite(cap) and cap > 0)):
            raise ValueError(f"{name} must be None or a finite number > 0, got {cap!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None or an int >= 1, got {chunk_rows!r}")
    if not isinstance(num_teachers, int) or isinstance(num_teachers, bool) or num_teachers < 1:
        raise ValueError(f"num_teachers must be an int >= 1, got {num_teachers!r}")
    check_teacher_index(teacher_index, N, num_teachers)
