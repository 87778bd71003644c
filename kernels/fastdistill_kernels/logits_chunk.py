"""The 6·N·D·V variant ("chunked logits"): GEMM a chunk of raw logits, two Triton passes over it, GEMM the gradients.

Per chunk of ``C`` rows (``C × V`` raw logits within a memory budget, :func:`chunk_rows_for`):

1. ``x = h_chunk @ Wᵀ`` with ``torch.mm`` (cuBLAS on a GPU) into a reused fp32 ``(C, V)`` buffer: half-precision
   operands, fp32 sums and fp32 output (bf16 logits would move each probability by up to |z|·2⁻⁹ relative).
2. :func:`_chunk_stats_kernel`, one program per row: ``z = softcap(logit_scale·(x + b)) / T`` in fp32, the
   candidates' logits ``z_cand`` (gathered at the candidate ids, whose buffer entries are then overwritten with a
   −inf sentinel), and the online non-candidate statistics ``m_nc`` (max), ``s_nc = Σ exp(z − m_nc)`` and
   ``t_nc = Σ exp(z − m_nc)·(z − m_nc)``: the quantities of the fused forward kernel. A torch epilogue (O(C·S))
   makes ``lse`` and the entropy, and :func:`~fastdistill_kernels.buckets.bucket_divergence` /
   :func:`~fastdistill_kernels.buckets.logit_gradients` the divergence and ``(coef_nc, cand_grad)``.
3. :func:`_chunk_grad_out_kernel` writes ``dL/dx`` for the raw logits in the compute dtype over the buffer (the
   first half of each fp32 row, :func:`gradient_view`):
   ``exp(z − m_nc)·coef_nc`` at non-candidates, ``cand_grad`` at candidates, times ``logit_scale / T`` and the
   softcap derivative ``1 − u²`` (``u = z·T / c``); the per-row token weight is already in ``coef_nc`` /
   ``cand_grad``.
4. ``dh_chunk = dx @ W``, ``dW += dxᵀ @ h_chunk`` and ``db += Σ_rows dx`` with torch: dW in the compute dtype,
   fp32 sums inside each GEMM and one rounding per chunk (``fp32_accumulator=True``: an fp32 ``(V, D)`` buffer).

Gradients are computed in the forward with the token weights as the per-row upstream gradient; backward only
scales them in place by the scalar upstream gradient of the weighted sum (read on the device, no host wait:
:func:`scale_in_place`) and hands them over (as Liger's
fused-linear losses do): no dW-sized copy, and one backward per forward. Only the returned ``loss`` is
differentiable: a backward through the per-row divergences (a non-scalar upstream) raises.
Matmul FLOPs: 2·N·D·V (logits) + 4·N·D·V (dh, dW), against 8·N·D·V for the no-logits kernels (which recompute
the logits in backward); memory beyond the gradients: the fp32 ``(C, V)`` buffer (docs/kernels-memory.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import backward
from .backward import gemm_into, mixed_mm_supported
from .buckets import bucket_divergence, logit_gradients
from .config import device_guard, interpreting
from .ops import validate_loss_inputs

MAX_CHUNK_ROWS = 4096  # rows per chunk at most (Liger and the design: 4096-row chunks of logits)
# The fp32 (C, V) raw-logits buffer (dL/dx written over it) takes at most 960 MiB: C = 1655 at V = 152064, so the
# chunked path stays within its gradients + 1 GiB (docs/kernels-memory.md).
DEFAULT_CHUNK_BYTES = 960 * 2**20
BUFFER_DTYPE = torch.float32  # the raw-logits buffer's dtype, whatever the operands' (dL/dx is written over it)
GPU_BLOCK_V, GPU_NUM_WARPS = 2048, 8  # vocabulary columns per step of a row program on a GPU
INTERPRETER_BLOCK_V = 64  # small blocks in the CPU interpreter, so that tiny test vocabularies span several


# --------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _final_logits(x, B, cols, mask, logit_scale, softcap, inv_temp, HAS_BIAS: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr):
    """fp32 ``softcap(logit_scale·(x + b[cols])) · inv_temp``; softcap(y) = c·(2·sigmoid(2y/c) − 1) = c·tanh(y/c)
    (libdevice's tanh is unavailable in the interpreter)."""
    if HAS_BIAS:
        x = x + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    x = x * logit_scale
    if HAS_SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0)
    return x * inv_temp


@triton.jit
def online_update(m, s, t, z, keep):
    """One tile of the online statistics ``m`` (max), ``s = Σ e^(z−m)``, ``t = Σ e^(z−m)·(z−m)`` over ``keep``."""
    neg_inf = float("-inf")
    z = tl.where(keep, z, neg_inf)
    m_new = tl.maximum(m, tl.max(z, axis=0))
    shift = tl.where(m_new == neg_inf, 0.0, m_new)
    y = tl.where(keep, z - shift, 0.0)
    e = tl.where(keep, tl.exp(y), 0.0)
    rescale = tl.exp(m - shift)
    t = rescale * (t + tl.where(s > 0, m - shift, 0.0) * s) + tl.sum(e * y, axis=0)
    s = rescale * s + tl.sum(e, axis=0)
    return m_new, s, t


@triton.jit
def _chunk_stats_kernel(X, B, IDS, Z_CAND, M_NC, S_NC, T_NC, V, S, logit_scale, softcap, inv_temp,
                        BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr):
    """One program per row of the ``(C, V)`` raw logits ``X``: candidate logits, then non-candidate statistics."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * V
    neg_inf = float("-inf")
    slots = tl.arange(0, BLOCK_S)
    ids = tl.load(IDS + row * S + slots, mask=slots < S, other=-1)  # -1: invalid slot
    is_cand = ids >= 0
    cand_cols = tl.where(is_cand, ids, 0).to(tl.int64)
    xc = tl.load(x_row + cand_cols, mask=is_cand, other=0.0).to(tl.float32)
    zc = _final_logits(xc, B, cand_cols, is_cand, logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
    tl.store(Z_CAND + row * S + slots, tl.where(is_cand, zc, 0.0), mask=slots < S)
    tl.debug_barrier()  # every candidate is read before the sentinel overwrites it
    tl.store(x_row + cand_cols, tl.full((BLOCK_S,), neg_inf, tl.float32), mask=is_cand)
    tl.debug_barrier()  # the sentinels are visible to every thread of the row program

    # Online statistics over the non-candidate columns, shifted by the running max m: s = Σ e^(z−m),
    # t = Σ e^(z−m)·(z−m). m stays −inf while every column so far is a candidate.
    m = tl.full((), neg_inf, tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        x = tl.load(x_row + cols, mask=inside, other=neg_inf).to(tl.float32)
        keep = x != neg_inf  # in the vocabulary and not a candidate
        z = _final_logits(x, B, cols, inside, logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
        m, s, t = online_update(m, s, t, z, keep)
    tl.store(M_NC + row, tl.where(m == neg_inf, 0.0, m))
    tl.store(S_NC + row, s)
    tl.store(T_NC + row, t)


@triton.jit
def _chunk_grad_out_kernel(X, DX, B, IDS, Z_CAND, M_NC, COEF_NC, CAND_GRAD, V, S, dx_stride, logit_scale, softcap,
                           inv_temp, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_SOFTCAP: tl.constexpr):
    """One program per row: ``dL/dx`` from the fp32 raw logits ``X`` (candidates hold the −inf sentinel) into
    ``DX`` (row stride ``dx_stride``, the GEMM dtype). ``DX`` may alias ``X``: each row's gradients in the first
    half of its fp32 storage (``dx_stride = 2·V`` half-precision elements), or in place (same dtype)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * V
    dx_row = DX + row * dx_stride
    neg_inf = float("-inf")
    m_nc = tl.load(M_NC + row)
    coef_nc = tl.load(COEF_NC + row)
    chain = logit_scale * inv_temp
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        x = tl.load(x_row + cols, mask=inside, other=neg_inf).to(tl.float32)
        keep = x != neg_inf
        z = _final_logits(x, B, cols, inside, logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
        dz = tl.exp(tl.where(keep, z - m_nc, neg_inf)) * coef_nc
        if HAS_SOFTCAP:
            u = z * (1.0 / (softcap * inv_temp))
            dz = dz * (1.0 - u * u)
        # an aliased store of this block lands on logits of this block or earlier ones: all threads read first
        tl.debug_barrier()
        tl.store(dx_row + cols, tl.where(keep, dz * chain, 0.0), mask=inside)  # rounded to DX's dtype
    tl.debug_barrier()  # the dense pass wrote 0 at the candidates: order the candidate stores after it
    slots = tl.arange(0, BLOCK_S)
    ids = tl.load(IDS + row * S + slots, mask=slots < S, other=-1)
    is_cand = ids >= 0
    dzc = tl.load(CAND_GRAD + row * S + slots, mask=is_cand, other=0.0)
    if HAS_SOFTCAP:
        uc = tl.load(Z_CAND + row * S + slots, mask=is_cand, other=0.0) * (1.0 / (softcap * inv_temp))
        dzc = dzc * (1.0 - uc * uc)
    tl.store(dx_row + tl.where(is_cand, ids, 0).to(tl.int64), dzc * chain, mask=is_cand)


# --------------------------------------------------------------------------------------------------- launches


class ChunkStats(NamedTuple):
    """Per-row statistics of one chunk (fp32): ``z_cand`` ``(C, S)`` (0 on invalid slots); ``m_nc``, ``s_nc``,
    ``t_nc`` ``(C,)``: non-candidate max (0 when there is none), Σ exp(z − m_nc) and Σ exp(z − m_nc)·(z − m_nc)."""

    z_cand: torch.Tensor
    m_nc: torch.Tensor
    s_nc: torch.Tensor
    t_nc: torch.Tensor


def _block_sizes(n_slots: int, device: torch.device) -> dict:
    """Constexpr block sizes and launch options of both kernels for ``device`` (the interpreter's on CPU; the GPU's
    elsewhere, ``meta`` included, so that an AOT compile records the launch a GPU would make)."""
    block_v = INTERPRETER_BLOCK_V if device.type == "cpu" else GPU_BLOCK_V
    return dict(BLOCK_V=block_v, BLOCK_S=triton.next_power_of_2(max(1, n_slots)), num_warps=GPU_NUM_WARPS)


def _scalars(logit_scale: float, softcap: float | None, temperature: float) -> tuple[float, float, float]:
    return float(logit_scale), 1.0 if softcap is None else float(softcap), 1.0 / float(temperature)


def launch_chunk_stats(x: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, *, logit_scale: float,
                       softcap: float | None, temperature: float) -> ChunkStats:
    """Run :func:`_chunk_stats_kernel` over the raw logits ``x`` ``(C, V)`` (contiguous; overwritten with −inf at
    the candidates) with ``ids`` ``(C, S)`` int32 candidate ids, −1 on invalid slots, and ``bias`` ``(V,)``."""
    c, v = x.shape
    s = ids.shape[1]
    stats = ChunkStats(torch.zeros(c, s, dtype=torch.float32, device=x.device),
                       *(torch.empty(c, dtype=torch.float32, device=x.device) for _ in range(3)))
    _chunk_stats_kernel[(c,)](
        x, bias, ids, stats.z_cand, stats.m_nc, stats.s_nc, stats.t_nc, v, s,
        *_scalars(logit_scale, softcap, temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, **_block_sizes(s, x.device),
    )
    return stats


def launch_chunk_grad_out(x: torch.Tensor, dx: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                          z_cand: torch.Tensor, m_nc: torch.Tensor, coef_nc: torch.Tensor, cand_grad: torch.Tensor, *,
                          logit_scale: float, softcap: float | None, temperature: float) -> None:
    """Run :func:`_chunk_grad_out_kernel`: ``dx`` ``(C, V)`` (unit column stride; may alias ``x``, see
    :func:`gradient_view`) gets ``dL/dx`` from the fp32 raw logits ``x`` ``(C, V)`` as
    :func:`launch_chunk_stats` left them. ``z_cand``, ``cand_grad`` ``(C, S)`` and ``m_nc``, ``coef_nc`` ``(C,)``
    fp32; ``ids`` and ``bias`` as :func:`launch_chunk_stats`."""
    c, v = x.shape
    s = ids.shape[1]
    _chunk_grad_out_kernel[(c,)](
        x, dx, bias, ids, z_cand, m_nc, coef_nc, cand_grad, v, s, dx.stride(0),
        *_scalars(logit_scale, softcap, temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, **_block_sizes(s, x.device),
    )


# --------------------------------------------------------------------------------------------------- host side


def chunk_row_bytes(vocab_size: int, dtype: torch.dtype = BUFFER_DTYPE) -> int:
    """Bytes of one row of the ``(C, V)`` raw-logits buffer in ``dtype`` (the chunked path's: :data:`BUFFER_DTYPE`,
    whatever the operands' dtype)."""
    return vocab_size * (torch.finfo(dtype).bits // 8)


def chunk_rows_for(n_rows: int, vocab_size: int, dtype: torch.dtype = BUFFER_DTYPE,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk: at most :data:`MAX_CHUNK_ROWS` and ``n_rows``, and the ``(C, V)`` buffer in ``dtype`` (the
    chunked path's: :data:`BUFFER_DTYPE`) within ``chunk_bytes`` (at least one row)."""
    return max(1, min(MAX_CHUNK_ROWS, n_rows, chunk_bytes // chunk_row_bytes(vocab_size, dtype)))


def _raw_logits(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = h @ weightᵀ`` ``(c, V)`` fp32, never rounded to half precision (rounding logits of magnitude |z| to
    bf16 moves each probability by up to |z|·2⁻⁹ relative): a plain GEMM for fp32 operands, cuBLAS's mixed GEMM
    (half-precision operands, fp32 output: ``mm`` or ``addmm`` with ``out_dtype``) where torch has it, else fp32
    GEMMs of upcast weight row blocks (exact products and fp32 sums: the same numerics; the CPU's path)."""
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    elif mixed_mm_supported(h.device, h.dtype):
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    elif backward.mixed_addmm_supported(h.device, h.dtype):  # beta = 0: out's old contents are not read
        torch.addmm(out, h, weight.t(), beta=0, out_dtype=torch.float32, out=out)
    else:
        h32 = h.float()
        step = max(1, backward.UPCAST_BLOCK_ELEMS // max(1, h.shape[0], weight.shape[1]))
        for v0 in range(0, weight.shape[0], step):
            out[:, v0:v0 + step] = h32 @ weight[v0:v0 + step].float().t()


def gradient_view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``(C, V)`` matrix of ``dtype`` in which :func:`launch_chunk_grad_out` writes ``dL/dx`` over the fp32 raw
    logits ``x`` ``(C, V)`` (contiguous): ``x`` itself for fp32, else the first half of each row's storage (row
    stride 2·V elements), so the gradient GEMMs read half-precision operands without a second buffer."""
    if dtype == torch.float32:
        return x
    return x.view(dtype)[:, : x.shape[1]]


def _row_metrics(stats: ChunkStats, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, lse_nc, entropy)`` ``(C,)`` from a chunk's statistics (the candidates' terms added in torch)."""
    z_cand, m_nc, s_nc, t_nc = stats
    lse_nc = m_nc + torch.log(s_nc)  # −inf for a row whose candidates are the whole vocabulary
    lse = torch.logaddexp(lse_nc, torch.logsumexp(z_cand.masked_fill(~valid, float("-inf")), dim=1))
    p_cand = torch.where(valid, torch.exp(z_cand - lse.unsqueeze(1)), torch.zeros_like(z_cand))
    ent_c = (p_cand * torch.where(valid, lse.unsqueeze(1) - z_cand, torch.zeros_like(z_cand))).sum(dim=1)
    ent_nc = torch.exp(m_nc - lse) * ((lse - m_nc) * s_nc - t_nc)  # Σ_nc p·(lse − z)
    return lse, lse_nc, ent_nc + ent_c


def chunked_logits_rows(hidden, weight, bias, ids, teacher_logprobs, valid, row_weights, settings: dict, *,
                        need_dh: bool, need_dw: bool, need_db: bool, chunk_rows: int, fp32_accumulator: bool = False):
    """Per-row losses and the gradients of ``Σ w·div`` (``w`` = ``row_weights``, default 1) over chunks.

    Args: as :func:`chunked_logits_sparse_jsd` (hidden/weight already in their common dtype, contiguous);
        ``settings`` holds ``logit_scale, softcap, temperature, beta, add_tail_bucket, tail_mode``.

        fp32_accumulator: accumulate dW over the chunks in an fp32 ``(V, D)`` buffer (rounded once at the end)
            instead of in the compute dtype (one rounding per chunk, fp32 sums inside each GEMM).

    Returns:
        ``(div, entropy, teacher_entropy, dh, dw, db)``: ``(N,)`` fp32 nats; dh ``(N, D)`` and dw ``(V, D)`` in the
        compute dtype, db ``(V,)`` fp32; None where not needed.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    logit_kw = {k: settings[k] for k in ("logit_scale", "softcap", "temperature")}
    bucket_kw = {k: settings[k] for k in ("beta", "add_tail_bucket", "tail_mode")}
    need_grad = need_dh or need_dw or need_db
    ids32 = torch.where(valid, ids, torch.full_like(ids, -1)).to(torch.int32).contiguous()
    covers = valid.sum(dim=1) >= v
    div, ent, tent = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(3))
    dh = torch.empty(n, d, dtype=hidden.dtype, device=dev) if need_dh else None
    dw = torch.empty(v, d, dtype=torch.float32 if fp32_accumulator else hidden.dtype, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    buf = torch.empty(min(chunk_rows, n), v, dtype=BUFFER_DTYPE, device=dev) if n else None
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        h, x = hidden[rows], buf[: min(chunk_rows, n - start)]
        _raw_logits(h, weight, x)
        with device_guard(dev):  # Triton launches on the current device, not the tensors'
            stats = launch_chunk_stats(x, bias, ids32[rows], **logit_kw)
        lse, lse_nc, ent[rows] = _row_metrics(stats, valid[rows])
        d_rows, tent[rows] = bucket_divergence(stats.z_cand, lse, lse_nc, teacher_logprobs[rows], valid[rows],
                                               covers[rows], **bucket_kw)
        div[rows] = d_rows.detach()
        if not need_grad:
            continue
        upstream = torch.ones_like(lse) if row_weights is None else row_weights[rows].float()
        coef_nc, cand_grad = logit_gradients(stats.z_cand, lse, stats.m_nc, stats.s_nc, teacher_logprobs[rows],
                                             valid[rows], covers[rows], upstream, **bucket_kw)
        dx = gradient_view(x, hidden.dtype)
        with device_guard(dev):
            launch_chunk_grad_out(x, dx, bias, ids32[rows], stats.z_cand, stats.m_nc, coef_nc.contiguous(),
                                  cand_grad.contiguous(), **logit_kw)
        if need_dh:
            gemm_into(dh[rows], dx, weight, accumulate=False)
        if need_dw:  # dW (=|+=) dxᵀ @ h_chunk: the first chunk writes it
            gemm_into(dw, dx.t(), h, accumulate=start > 0)
        if need_db:
            db += dx.sum(dim=0, dtype=torch.float32)
    buf = x = dx = None  # the logits buffer is freed before an fp32 dW's cast
    if dw is not None:
        if n == 0:  # no chunk wrote it
            dw.zero_()
        dw = dw.to(hidden.dtype)
    return div, ent, tent, dh, dw, db



def save_forward_grads(ctx, grads: tuple, inputs: tuple) -> None:
    """Keep the gradients a chunked forward already computed (``grads``, None where not needed), each in the dtype
    of its entry of ``inputs`` (None entries allowed), for :func:`scaled_forward_grads`. Kept on ``ctx`` rather
    than saved for backward: the backward hands these very tensors to autograd."""
    ctx.forward_grads = [None if g is None or x is None else g.to(x.dtype) for g, x in zip(grads, inputs, strict=True)]


SCALE_BLOCK = 4096  # elements per program of _scale_in_place (the interpreter takes 2**16: fewer programs)


@triton.jit
def _scale_in_place(G, SCALE, n, BLOCK: tl.constexpr):
    """``G[i] = G[i] · SCALE[0]`` for i < n, in fp32, rounded once to G's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    scale = tl.load(SCALE).to(tl.float32)
    g = tl.load(G + offs, mask=inside).to(tl.float32)
    tl.store(G + offs, (g * scale).to(G.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


def scale_in_place(g: torch.Tensor, scale: torch.Tensor) -> None:
    """Multiply the contiguous ``g`` in place by the one-element tensor ``scale`` on its device, in fp32 (a
    half-precision ``g`` is rounded once, as by a Python-float multiply), without reading ``scale`` on the host."""
    if not g.is_contiguous():
        raise ValueError("scale_in_place needs a contiguous tensor")
    block = 2**16 if interpreting() else SCALE_BLOCK
    with device_guard(g.device):
        _scale_in_place[(triton.cdiv(g.numel(), block),)](g, scale.detach().reshape(1).float(), g.numel(),
                                                         BLOCK=block, num_warps=8)


def scaled_forward_grads(ctx, grad_loss: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The gradients :func:`save_forward_grads` kept, scaled in place by the scalar loss's upstream gradient and
    handed over without a copy: a second backward through the same loss raises. The upstream gradient stays on the
    device (no host read, so no wait for the GPU per micro-batch): every gradient is scaled, 1 included."""
    grads = ctx.forward_grads
    if grads is None:
        raise RuntimeError(
            "a second backward through the same chunked loss: its forward-computed gradients were handed to autograd "
            "(scaled in place, without a copy) by the first backward; recompute the loss instead of retain_graph")
    ctx.forward_grads = None
    if grad_loss is None:
        return [None] * len(grads)
    for g in grads:
        if g is not None:
            scale_in_place(g, grad_loss)
    return grads


class ChunkedLogitsSparseJSD(torch.autograd.Function):
    """Forward: loss, metrics and (unit-upstream, token-weighted) gradients over chunks. Backward: scales the
    saved gradients by the scalar upstream gradient of the loss; a gradient into the per-row divergences raises."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, teacher_logprobs, valid, row_weights, settings: dict,
                chunk_rows: int):
        need_dh, need_dw = ctx.needs_input_grad[:2]
        need_db = bias is not None and ctx.needs_input_grad[2]
        div, ent, tent, dh, dw, db = chunked_logits_rows(
            hidden, weight, bias, ids, teacher_logprobs, valid, row_weights, settings,
            need_dh=need_dh, need_dw=need_dw, need_db=need_db, chunk_rows=chunk_rows,
            fp32_accumulator=settings["fp32_accumulator"])
        save_forward_grads(ctx, (dh, dw, db), (hidden, weight, bias))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(ent, tent)
        loss = div.sum() if row_weights is None else (div * row_weights.float()).sum()
        return loss, div.clone(), ent, tent

    @staticmethod
    def backward(ctx, grad_loss, grad_div, _grad_ent, _grad_tent):
        if grad_div is not None:
            raise RuntimeError(
                "the chunked-logits loss (backend='triton-chunked') computes its gradients in the forward pass for "
                "the returned weighted sum `loss` only; a gradient through the per-row divergences (a non-scalar "
                "upstream gradient) is not supported: pass per-row weights as token_weights, or use "
                "backend='triton' / fused_sparse_jsd, which take any per-row upstream gradient")
        return (*scaled_forward_grads(ctx, grad_loss), None, None, None, None, None, None)


class ChunkedLosses(NamedTuple):
    """Results of :func:`chunked_logits_sparse_jsd`.

    Attributes:
        loss: 0-dim fp32, ``Σ_n w_n · divergence_n`` (nats); the only differentiable output.
        divergence: ``(N,)`` fp32 per-row divergence (nats); a backward through it raises.
        entropy: ``(N,)`` the student's full-vocabulary entropy at the temperature (detached).
        teacher_entropy: ``(N,)`` the teacher's entropy over support + tail (detached).
    """

    loss: torch.Tensor
    divergence: torch.Tensor
    entropy: torch.Tensor
    teacher_entropy: torch.Tensor


def chunked_logits_sparse_jsd(
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
    row_weights: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fp32_accumulator: bool = False,
) -> ChunkedLosses:
    """Sparse generalized JSD of the student ``softcap(logit_scale·(hidden @ weightᵀ + bias)) / T`` against a sparse
    teacher, with 6·N·D·V matmul FLOPs: logits per row chunk (cuBLAS), two Triton passes, gradient GEMMs.

    Args:
        hidden: ``(N, D)``; weight ``(V, D)``; bias ``(V,)`` or None. float32, bfloat16 or float16 on CUDA, or on
            CPU under ``TRITON_INTERPRET=1``; hidden and weight are brought to their common dtype (the dtype of the
            raw-logits buffer and of the dh / dW GEMM operands).
        ids: ``(N, S)`` integer candidate ids; only slots where ``valid`` is set are read.
        teacher_logprobs: ``(N, S)`` teacher log-probs (nats), finite where ``valid``.
        valid: ``(N, S)`` bool, canonical: distinct ids within a row, at least one valid slot per row.
        logit_scale, softcap, temperature, beta, add_tail_bucket, tail_mode: as :func:`fastdistill_kernels.
            fused_sparse_jsd`.
        row_weights: ``(N,)`` non-negative constants or None: ``loss = Σ w·div``; folded into the gradient that
            the forward computes (the only per-row upstream gradient this op supports).
        chunk_rows: rows per chunk; default :func:`chunk_rows_for` (≤ 4096 rows, the fp32 buffer ≤ ``chunk_bytes``).
        fp32_accumulator: accumulate dW over the chunks in an fp32 ``(V, D)`` buffer, rounded once (+4·V·D bytes
            at the peak); default: dW accumulates in the compute dtype, fp32 sums inside each chunk's GEMM.

    Returns:
        :class:`ChunkedLosses`. ``loss.backward()`` (any scalar upstream gradient, once) gives dh, dW, db in
        their inputs' dtypes.
    """
    _validate(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode, row_weights, chunk_rows)
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    settings = dict(logit_scale=float(logit_scale), softcap=None if softcap is None else float(softcap),
                    temperature=float(temperature), beta=float(beta), add_tail_bucket=bool(add_tail_bucket),
                    tail_mode=tail_mode, fp32_accumulator=bool(fp32_accumulator))
    rows = chunk_rows or chunk_rows_for(hidden.shape[0], weight.shape[0], BUFFER_DTYPE, chunk_bytes)
    out = ChunkedLogitsSparseJSD.apply(
        hidden.to(dtype).contiguous(), weight.to(dtype).contiguous(), None if bias is None else bias.contiguous(),
        ids, teacher_logprobs.float(), valid, None if row_weights is None else row_weights.detach(), settings,
        max(1, int(rows)),
    )
    return ChunkedLosses(*out)


def _validate(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode, row_weights, chunk_rows):
    validate_loss_inputs(hidden, weight, bias, ids, teacher_logprobs, valid, tail_mode)
    if row_weights is not None and row_weights.shape != (hidden.shape[0],):
        raise ValueError(f"row_weights must have shape ({hidden.shape[0]},), got {tuple(row_weights.shape)}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None or an int >= 1, got {chunk_rows!r}")
