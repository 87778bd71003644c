"""Dense-teacher generalized JSD with 6·N·D_s·V_s student FLOPs: cuBLAS logits per row chunk, two Triton passes.

Per chunk of ``C`` rows:

1. ``xs = h_s @ W_sᵀ`` ``(C, V_s)`` and ``xt = h_t @ W_tᵀ`` ``(C, V_t)`` with ``torch.mm`` (cuBLAS on a GPU) into
   reused fp32 buffers (fp32 sums and output: never rounded to half precision).
2. :func:`_dense_stats_kernel`, one program per row: both sides' final logits
   ``z = softcap(scale·(x + b)) / T`` in fp32 and their online log-sum-exp and entropy over the student's
   vocabulary ``[0, V_s)``; the teacher's columns ``[V_s, V_t)`` of a padded vocabulary only give their
   log-sum-exp (the dropped mass ``exp(lse_pad − logaddexp(lse_t, lse_pad))``).
3. :func:`_dense_grad_out_kernel`, one program per row covering the whole row in tiles (no atomics): the per-element
   log-probs ``s = z_s − lse_s``, ``t = z_t − lse_t``, the divergence terms summed over the row (each term formed
   as a difference before the sum: ``q·(t − s)``, not ``Σq·t − Σq·s``) and, when a gradient is needed, the
   student's ``dL/dx`` written over ``xs`` in the compute dtype (the first half of each fp32 row, see
   :func:`~fastdistill_kernels.logits_chunk.gradient_view`; a second sweep of the row where the gradient needs a row sum
   first: β = 1 needs ``D``, 0 < β < 1 needs ``Σ g``). With ``g_v = ∂D/∂s_v``, ``dD/dz = g − p Σ g``:
   β = 0: ``p − q``; β = 1: ``p (s − t − D)``; else ``g = (1−β) p (s − log m)`` with
   ``log m = logaddexp(s + log(1−β), t + log β)``. Chain rule to the raw logits: times the row weight,
   ``scale / T`` and the softcap derivative ``1 − u²`` (``u = z·T / c``).
4. ``dh = dx @ W_s``, ``dW += dxᵀ @ h_s`` (in the compute dtype, fp32 sums inside each GEMM; or an fp32 accumulator
   with ``fp32_accumulator=True``) and ``db += Σ_rows dx`` with torch.

Gradients are computed in the forward with the token weights as the per-row upstream gradient; backward only
scales them by the scalar upstream gradient of the loss. Teacher inputs are constants.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .backward import gemm_into
from .config import device_guard
from .logits_chunk import (
    BUFFER_DTYPE,
    DEFAULT_CHUNK_BYTES,
    GPU_BLOCK_V,
    GPU_NUM_WARPS,
    INTERPRETER_BLOCK_V,
    MAX_CHUNK_ROWS,
    _final_logits,
    _raw_logits,
    chunk_row_bytes,
    gradient_view,
    online_update,
    save_forward_grads,
    scaled_forward_grads,
)

BETA_FORWARD, BETA_REVERSE, BETA_MIXED = 0, 1, 2  # constexpr divergence modes: β = 0, β = 1, 0 < β < 1


# --------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _dense_stats_kernel(XS, XT, BS, BT, LSE_S, ENT_S, LSE_T, ENT_T, LSE_PAD, V, VT,
                        s_scale, s_softcap, t_scale, t_softcap, inv_temp,
                        BLOCK_V: tl.constexpr, S_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr, T_BIAS: tl.constexpr,
                        T_SOFTCAP: tl.constexpr, PADDED: tl.constexpr):
    """One program per row: log-sum-exp and entropy of the student (row of ``XS``, ``(C, V)``) and of the teacher
    over ``[0, V)`` (row of ``XT``, ``(C, VT)``), and the teacher's log-sum-exp over ``[V, VT)`` when ``PADDED``."""
    row = tl.program_id(0).to(tl.int64)
    xs_row = XS + row * V
    xt_row = XT + row * VT
    neg_inf = float("-inf")
    ms = tl.full((), neg_inf, tl.float32)
    ss = tl.zeros((), tl.float32)
    ts = tl.zeros((), tl.float32)
    mt = tl.full((), neg_inf, tl.float32)
    st = tl.zeros((), tl.float32)
    tt = tl.zeros((), tl.float32)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        xs = tl.load(xs_row + cols, mask=inside, other=0.0).to(tl.float32)
        zs = _final_logits(xs, BS, cols, inside, s_scale, s_softcap, inv_temp, S_BIAS, S_SOFTCAP)
        ms, ss, ts = online_update(ms, ss, ts, zs, inside)
        xt = tl.load(xt_row + cols, mask=inside, other=0.0).to(tl.float32)
        zt = _final_logits(xt, BT, cols, inside, t_scale, t_softcap, inv_temp, T_BIAS, T_SOFTCAP)
        mt, st, tt = online_update(mt, st, tt, zt, inside)
    # lse = m + log s; entropy = Σ p (lse − z) = log s − t / s
    tl.store(LSE_S + row, ms + tl.log(ss))
    tl.store(ENT_S + row, tl.log(ss) - ts / ss)
    tl.store(LSE_T + row, mt + tl.log(st))
    tl.store(ENT_T + row, tl.log(st) - tt / st)
    if PADDED:
        mp = tl.full((), neg_inf, tl.float32)
        sp = tl.zeros((), tl.float32)
        tp = tl.zeros((), tl.float32)
        for v0 in range(V, VT, BLOCK_V):
            cols = v0 + offs
            inside = cols < VT
            xp = tl.load(xt_row + cols, mask=inside, other=0.0).to(tl.float32)
            zp = _final_logits(xp, BT, cols, inside, t_scale, t_softcap, inv_temp, T_BIAS, T_SOFTCAP)
            mp, sp, tp = online_update(mp, sp, tp, zp, inside)
        tl.store(LSE_PAD + row, mp + tl.log(sp))


@triton.jit
def log_mixture(s, t, log_1mb, log_b):
    """``log((1−β)·e^s + β·e^t)`` as a log-sum-exp of two terms: finite for finite s, t."""
    a = s + log_1mb
    b = t + log_b
    hi = tl.maximum(a, b)
    return hi + tl.log(1.0 + tl.exp(-tl.abs(a - b)))


@triton.jit
def _row_logprobs(xs_row, xt_row, BS, BT, cols, inside, lse_s, lse_t, s_scale, s_softcap, t_scale, t_softcap,
                  inv_temp, S_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr, T_BIAS: tl.constexpr,
                  T_SOFTCAP: tl.constexpr):
    """One tile of a row: the student's final logits ``zs`` and both sides' log-probs ``s``, ``t`` (fp32)."""
    xs = tl.load(xs_row + cols, mask=inside, other=0.0).to(tl.float32)
    zs = _final_logits(xs, BS, cols, inside, s_scale, s_softcap, inv_temp, S_BIAS, S_SOFTCAP)
    xt = tl.load(xt_row + cols, mask=inside, other=0.0).to(tl.float32)
    zt = _final_logits(xt, BT, cols, inside, t_scale, t_softcap, inv_temp, T_BIAS, T_SOFTCAP)
    return zs, zs - lse_s, zt - lse_t


@triton.jit
def _dense_grad_out_kernel(XS, XT, DX, BS, BT, LSE_S, LSE_T, ROW_W, DIV, V, VT, dx_stride,
                           s_scale, s_softcap, t_scale, t_softcap, inv_temp, beta, log_1mb, log_b,
                           BLOCK_V: tl.constexpr, MODE: tl.constexpr, NEED_GRAD: tl.constexpr,
                           HAS_ROW_W: tl.constexpr, S_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr,
                           T_BIAS: tl.constexpr, T_SOFTCAP: tl.constexpr):
    """One program per row: the row's divergence into ``DIV`` and, when ``NEED_GRAD``, ``dL/dx`` into ``DX`` (row
    stride ``dx_stride``, the GEMM dtype) from the fp32 raw logits ``XS``, ``XT``. ``DX`` may alias ``XS`` (each
    row's gradients in the first half of its fp32 storage, or in place): every store follows a barrier after the
    loads of its block, and lands on that block or earlier ones."""
    row = tl.program_id(0).to(tl.int64)
    xs_row = XS + row * V
    xt_row = XT + row * VT
    dx_row = DX + row * dx_stride
    lse_s = tl.load(LSE_S + row)
    lse_t = tl.load(LSE_T + row)
    offs = tl.arange(0, BLOCK_V)
    w = 1.0
    if HAS_ROW_W:
        w = tl.load(ROW_W + row).to(tl.float32)
    chain = w * s_scale * inv_temp
    div = tl.zeros((), tl.float32)
    sum_g = tl.zeros((), tl.float32)
    # sweep 1: the divergence (β = 0 also writes its gradient p − q here: it needs no row sum)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        zs, s, t = _row_logprobs(xs_row, xt_row, BS, BT, cols, inside, lse_s, lse_t, s_scale, s_softcap, t_scale,
                                 t_softcap, inv_temp, S_BIAS, S_SOFTCAP, T_BIAS, T_SOFTCAP)
        p = tl.exp(s)
        q = tl.exp(t)
        if MODE == 0:
            div += tl.sum(tl.where(inside, q * (t - s), 0.0), axis=0)
            if NEED_GRAD:
                dz = (p - q) * chain
                if S_SOFTCAP:
                    u = zs * (1.0 / (s_softcap * inv_temp))
                    dz = dz * (1.0 - u * u)
                tl.debug_barrier()
                tl.store(dx_row + cols, dz, mask=inside)
        elif MODE == 1:
            div += tl.sum(tl.where(inside, p * (s - t), 0.0), axis=0)
        else:
            log_m = log_mixture(s, t, log_1mb, log_b)
            term = beta * q * (t - log_m) + (1.0 - beta) * p * (s - log_m)
            div += tl.sum(tl.where(inside, term, 0.0), axis=0)
            sum_g += tl.sum(tl.where(inside, (1.0 - beta) * p * (s - log_m), 0.0), axis=0)
    tl.store(DIV + row, div)
    if NEED_GRAD and MODE != 0:
        tl.debug_barrier()  # every element is read before the gradient overwrites it
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            inside = cols < V
            zs, s, t = _row_logprobs(xs_row, xt_row, BS, BT, cols, inside, lse_s, lse_t, s_scale, s_softcap, t_scale,
                                     t_softcap, inv_temp, S_BIAS, S_SOFTCAP, T_BIAS, T_SOFTCAP)
            p = tl.exp(s)
            if MODE == 1:
                dz = p * (s - t - div)
            else:
                g = (1.0 - beta) * p * (s - log_mixture(s, t, log_1mb, log_b))
                dz = g - p * sum_g
            dz = dz * chain
            if S_SOFTCAP:
                u = zs * (1.0 / (s_softcap * inv_temp))
                dz = dz * (1.0 - u * u)
            tl.debug_barrier()
            tl.store(dx_row + cols, dz, mask=inside)


# --------------------------------------------------------------------------------------------------- launches


class DenseHeads(NamedTuple):
    """Both sides' logit post-processing: ``z = softcap(scale·(x + b)) / temperature`` (softcap None = off)."""

    student_scale: float
    student_softcap: float | None
    teacher_scale: float
    teacher_softcap: float | None
    temperature: float


class DenseStats(NamedTuple):
    """Per-row fp32 statistics of one chunk, ``(C,)`` each: log-sum-exp and entropy of the student and of the
    teacher over the student's vocabulary, and the teacher's log-sum-exp over its padded ids (None if unpadded)."""

    lse_s: torch.Tensor
    ent_s: torch.Tensor
    lse_t: torch.Tensor
    ent_t: torch.Tensor
    lse_pad: torch.Tensor | None


def _launch_options(device: torch.device) -> dict:
    """Vocabulary tile and warps: the interpreter's small tile on CPU, the GPU's elsewhere (``meta`` included)."""
    return dict(BLOCK_V=INTERPRETER_BLOCK_V if device.type == "cpu" else GPU_BLOCK_V, num_warps=GPU_NUM_WARPS)


def head_scalars(heads: DenseHeads) -> tuple[float, ...]:
    """The kernels' scalar arguments of both heads: scales, softcaps (1 when off) and 1 / temperature."""
    return (float(heads.student_scale), 1.0 if heads.student_softcap is None else float(heads.student_softcap),
            float(heads.teacher_scale), 1.0 if heads.teacher_softcap is None else float(heads.teacher_softcap),
            1.0 / float(heads.temperature))


def _flags(heads: DenseHeads, s_bias, t_bias) -> dict:
    return dict(S_BIAS=s_bias is not None, S_SOFTCAP=heads.student_softcap is not None, T_BIAS=t_bias is not None,
                T_SOFTCAP=heads.teacher_softcap is not None)


def launch_dense_stats(xs: torch.Tensor, xt: torch.Tensor, s_bias: torch.Tensor | None,
                       t_bias: torch.Tensor | None, heads: DenseHeads) -> DenseStats:
    """Run :func:`_dense_stats_kernel` over the raw logits ``xs`` ``(C, V_s)`` and ``xt`` ``(C, V_t)`` (contiguous)
    with biases ``(V_s,)`` / ``(V_t,)`` or None."""
    c, v = xs.shape
    vt = xt.shape[1]
    f32 = dict(dtype=torch.float32, device=xs.device)
    lse_s, ent_s, lse_t, ent_t = (torch.empty(c, **f32) for _ in range(4))
    lse_pad = torch.empty(c, **f32) if vt > v else None
    _dense_stats_kernel[(c,)](
        xs, xt, s_bias, t_bias, lse_s, ent_s, lse_t, ent_t, lse_pad, v, vt, *head_scalars(heads),
        PADDED=vt > v, **_flags(heads, s_bias, t_bias), **_launch_options(xs.device),
    )
    return DenseStats(lse_s, ent_s, lse_t, ent_t, lse_pad)


def beta_mode(beta: float) -> int:
    """The kernel's divergence mode for ``beta``: :data:`BETA_FORWARD`, :data:`BETA_REVERSE` or :data:`BETA_MIXED`."""
    return BETA_FORWARD if beta == 0.0 else BETA_REVERSE if beta == 1.0 else BETA_MIXED


def mixing_constants(beta: float) -> tuple[float, float, float]:
    """``(β, log(1−β), log β)`` as the kernels take them (the logs are 0 unless 0 < β < 1, where they are read)."""
    mixed = beta_mode(beta) == BETA_MIXED
    return float(beta), math.log1p(-beta) if mixed else 0.0, math.log(beta) if mixed else 0.0


def launch_dense_grad_out(xs: torch.Tensor, xt: torch.Tensor, dx: torch.Tensor | None, s_bias: torch.Tensor | None,
                          t_bias: torch.Tensor | None, lse_s: torch.Tensor, lse_t: torch.Tensor,
                          row_weights: torch.Tensor | None, heads: DenseHeads, beta: float) -> torch.Tensor:
    """Run :func:`_dense_grad_out_kernel`: the per-row divergence ``(C,)`` fp32 and, unless ``dx`` is None,
    ``dL/dx = w · dD/dx`` into ``dx`` ``(C, V_s)`` (unit column stride; may alias the fp32 ``xs``, see
    :func:`~fastdistill_kernels.logits_chunk.gradient_view`). ``xs`` ``(C, V_s)`` and ``xt`` ``(C, V_t)`` the fp32
    raw logits, ``lse_s``, ``lse_t`` ``(C,)`` fp32 from :func:`launch_dense_stats`, ``row_weights`` ``(C,)`` or
    None (``w`` = 1)."""
    c, v = xs.shape
    vt = xt.shape[1]
    div = torch.empty(c, dtype=torch.float32, device=xs.device)
    _dense_grad_out_kernel[(c,)](
        xs, xt, xs if dx is None else dx, s_bias, t_bias, lse_s, lse_t, row_weights, div, v, vt,
        v if dx is None else dx.stride(0), *head_scalars(heads), *mixing_constants(beta),
        MODE=beta_mode(beta), NEED_GRAD=dx is not None, HAS_ROW_W=row_weights is not None,
        **_flags(heads, s_bias, t_bias), **_launch_options(xs.device),
    )
    return div


# --------------------------------------------------------------------------------------------------- host side


def dense_chunk_row_bytes(student_vocab: int, teacher_vocab: int, student_dtype: torch.dtype = BUFFER_DTYPE,
                          teacher_dtype: torch.dtype = BUFFER_DTYPE) -> int:
    """Bytes of one row of both raw-logits buffers together (the chunked path's are :data:`BUFFER_DTYPE`)."""
    return chunk_row_bytes(student_vocab, student_dtype) + chunk_row_bytes(teacher_vocab, teacher_dtype)


def dense_chunk_rows_for(n_rows: int, student_vocab: int, teacher_vocab: int,
                         student_dtype: torch.dtype = BUFFER_DTYPE, teacher_dtype: torch.dtype = BUFFER_DTYPE,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk: at most :data:`MAX_CHUNK_ROWS` and ``n_rows``, both raw-logits buffers together within
    ``chunk_bytes`` (at least one row)."""
    row_bytes = dense_chunk_row_bytes(student_vocab, teacher_vocab, student_dtype, teacher_dtype)
    return max(1, min(MAX_CHUNK_ROWS, n_rows, chunk_bytes // row_bytes))


def dense_chunked_rows(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, heads: DenseHeads, beta: float,
                       row_weights, *, need_dh: bool, need_dw: bool, need_db: bool, chunk_rows: int,
                       fp32_accumulator: bool = False):
    """Per-row divergence, entropies, dropped teacher mass and the gradients of ``Σ w·div`` over row chunks (both
    sides' raw logits in fp32 buffers; ``fp32_accumulator`` as :func:`~fastdistill_kernels.logits_chunk.
    chunked_logits_rows`).

    Returns ``(div, entropy, teacher_entropy, dropped, dh, dw, db)``: ``(N,)`` fp32; dh ``(N, D_s)`` and dw
    ``(V_s, D_s)`` in the student's compute dtype, db ``(V_s,)`` fp32; None where not needed.
    """
    n, d = s_hidden.shape
    v, vt = s_weight.shape[0], t_weight.shape[0]
    dev = s_hidden.device
    need_grad = need_dh or need_dw or need_db
    div, ent, tent, dropped = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(4))
    dh = torch.empty(n, d, dtype=s_hidden.dtype, device=dev) if need_dh else None
    dw_dtype = torch.float32 if fp32_accumulator else s_hidden.dtype
    dw = torch.empty(v, d, dtype=dw_dtype, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    c0 = min(chunk_rows, n)
    xs_buf = torch.empty(c0, v, dtype=BUFFER_DTYPE, device=dev) if n else None
    xt_buf = torch.empty(c0, vt, dtype=BUFFER_DTYPE, device=dev) if n else None
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        c = rows.stop - start
        h, xs, xt = s_hidden[rows], xs_buf[:c], xt_buf[:c]
        _raw_logits(h, s_weight, xs)
        _raw_logits(t_hidden[rows], t_weight, xt)
        rw = None if row_weights is None else row_weights[rows]
        with device_guard(dev):  # Triton launches on the current device, not the tensors'
            st = launch_dense_stats(xs, xt, s_bias, t_bias, heads)
            dx = gradient_view(xs, s_hidden.dtype) if need_grad else None
            div[rows] = launch_dense_grad_out(xs, xt, dx, s_bias, t_bias, st.lse_s, st.lse_t, rw, heads, beta)
        ent[rows], tent[rows] = st.ent_s, st.ent_t
        if st.lse_pad is not None:
            dropped[rows] = torch.exp(st.lse_pad - torch.logaddexp(st.lse_t, st.lse_pad))
        if need_dh:
            gemm_into(dh[rows], dx, s_weight, accumulate=False)
        if need_dw:  # dW (=|+=) dxᵀ @ h_chunk: the first chunk writes it
            gemm_into(dw, dx.t(), h, accumulate=start > 0)
        if need_db:
            db += dx.sum(dim=0, dtype=torch.float32)
    xs_buf = xt_buf = xs = xt = dx = None  # the logits buffer is freed before an fp32 dW's cast
    if dw is not None:
        if n == 0:  # no chunk wrote it
            dw.zero_()
        dw = dw.to(s_hidden.dtype)
    return div, ent, tent, dropped, dh, dw, db


class DenseChunkedJSD(torch.autograd.Function):
    """Forward: loss, metrics and (token-weighted) gradients over chunks. Backward: scales the saved gradients by
    the scalar upstream gradient of the loss; a gradient into the per-row divergences raises."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, heads, beta, row_weights, chunk_rows,
                fp32_accumulator):
        need_dh, need_dw = ctx.needs_input_grad[:2]
        need_db = s_bias is not None and ctx.needs_input_grad[2]
        div, ent, tent, dropped, dh, dw, db = dense_chunked_rows(
            s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, heads, beta, row_weights,
            need_dh=need_dh, need_dw=need_dw, need_db=need_db, chunk_rows=chunk_rows,
            fp32_accumulator=fp32_accumulator)
        save_forward_grads(ctx, (dh, dw, db), (s_hidden, s_weight, s_bias))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(ent, tent, dropped)
        loss = div.sum() if row_weights is None else (div * row_weights.float()).sum()
        return loss, div.clone(), ent, tent, dropped

    @staticmethod
    def backward(ctx, grad_loss, grad_div, *_):
        if grad_div is not None:
            raise RuntimeError(
                "the chunked dense-teacher loss (backend='triton-chunked') computes its gradients in the forward "
                "pass for the returned weighted sum `loss` only; pass per-row weights as token_weights")
        return (*scaled_forward_grads(ctx, grad_loss), None, None, None, None, None, None, None, None)


class DenseChunkedLosses(NamedTuple):
    """Results of :func:`chunked_dense_teacher_jsd`: ``loss`` 0-dim fp32 ``Σ w·div`` (the only differentiable
    output); ``divergence``, ``entropy``, ``teacher_entropy`` (over the student's vocabulary, renormalised) and
    ``dropped`` (teacher mass on ids ≥ V_s) ``(N,)`` fp32, nats."""

    loss: torch.Tensor
    divergence: torch.Tensor
    entropy: torch.Tensor
    teacher_entropy: torch.Tensor
    dropped: torch.Tensor


def chunked_dense_teacher_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    heads: DenseHeads | None = None,
    beta: float = 0.0,
    row_weights: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fp32_accumulator: bool = False,
) -> DenseChunkedLosses:
    """Generalized JSD between the student's and a dense teacher's distributions over the student's vocabulary,
    both from hidden states and an lm_head, with 6·N·D_s·V_s student matmul FLOPs (+ 2·N·D_t·V_t for the teacher).

    Args:
        student_hidden: ``(N, D_s)``; student_weight ``(V_s, D_s)``; student_bias ``(V_s,)`` or None.
        teacher_hidden: ``(N, D_t)``; teacher_weight ``(V_t, D_t)``, ``V_t ≥ V_s``; teacher_bias ``(V_t,)`` or None
            (constants: detached). float32, bfloat16 or float16 on CUDA, or on CPU under ``TRITON_INTERPRET=1``;
            each side's hidden and weight are brought to their common dtype. Arithmetic in the kernels is fp32.
        heads: both sides' logit scale and softcap and the shared temperature; None = plain logits (1, off, 1).
        beta: 0 = KL(teacher‖student), 1 = KL(student‖teacher), else the generalized JSD.
        row_weights: ``(N,)`` non-negative constants or None: ``loss = Σ w·div``.
        chunk_rows: rows per chunk; default :func:`dense_chunk_rows_for` (≤ 4096 rows, the two fp32 buffers
            ≤ ``chunk_bytes``).
        fp32_accumulator: accumulate dW over the chunks in an fp32 ``(V_s, D_s)`` buffer, rounded once; default: in
            the student's compute dtype, fp32 sums inside each chunk's GEMM.

    Returns:
        :class:`DenseChunkedLosses`; ``loss.backward()`` gives the student's dh, dW, db.
    """
    if row_weights is not None and row_weights.shape != (student_hidden.shape[0],):
        raise ValueError(f"row_weights must have shape ({student_hidden.shape[0]},), got {tuple(row_weights.shape)}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None or an int >= 1, got {chunk_rows!r}")
    heads = heads if heads is not None else DenseHeads(1.0, None, 1.0, None, 1.0)
    sdt = torch.promote_types(student_hidden.dtype, student_weight.dtype)
    tdt = torch.promote_types(teacher_hidden.dtype, teacher_weight.dtype)
    rows = chunk_rows or dense_chunk_rows_for(student_hidden.shape[0], student_weight.shape[0],
                                              teacher_weight.shape[0], BUFFER_DTYPE, BUFFER_DTYPE, chunk_bytes)
    t_bias = None if teacher_bias is None else teacher_bias.detach().contiguous()
    out = DenseChunkedJSD.apply(
        student_hidden.to(sdt).contiguous(), student_weight.to(sdt).contiguous(),
        None if student_bias is None else student_bias.contiguous(),
        teacher_hidden.detach().to(tdt).contiguous(), teacher_weight.detach().to(tdt).contiguous(), t_bias,
        heads, float(beta), None if row_weights is None else row_weights.detach().contiguous(), max(1, int(rows)),
        bool(fp32_accumulator),
    )
    return DenseChunkedLosses(*out)
