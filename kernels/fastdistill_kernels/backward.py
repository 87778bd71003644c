"""Backward kernel: recompute logit tiles, form dL/dx for the raw logits x = h·Wᵀ + b, fold it into dh, dW, db.

Grid ``(row block, vocabulary tile)``. Per tile (see :func:`fastdistill_kernels.buckets.logit_gradients`):

    dL/dz = exp(z − m_nc[row]) · coef_nc[row]     non-candidate columns
          = cand_grad[row, slot]                  candidate columns (placed through the CSR)
    dL/dx = dL/dz · logit_scale / T · (1 − u²)    u = tanh(logit_scale·x/c) = z·T/c, only with a softcap

Two ways to accumulate:
  "fused":          dh[rows] += dx @ W[cols] and dW[cols] += dxᵀ @ h[rows] with fp32 atomics, D looped in
                    BLOCK_D chunks; no workspace, non-deterministic summation order. The atomics are relaxed
                    (independent adds that need no ordering; the kernel's completion orders them for the
                    consumer), so they compile to fence-free reductions (RED) rather than acq_rel ATOM + MEMBAR.
  "deterministic":  the kernel writes dx for a chunk of rows into a (chunk, V) workspace in the GEMM dtype, then
                    torch GEMMs dh = dx @ W and dW += dxᵀ @ h (fp32 accumulator).

Gradient filtering (``filter_eps``): a tile whose every |dL/dx| is below ``filter_eps · |upstream grad of its
row|`` contributes nothing; tiles holding candidates are never skipped.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .config import TileConfig, dot_precision, interpreting
from .csr import CandidateCSR
from .tiles import logit_tile

BACKWARD_MODES = ("deterministic", "fused")


# first_row_block is the row chunk's offset (0, 8, 16, … row blocks): not specialised, or chunks whose offset is a
# multiple of 16 and the others would compile to two kernels with identical code.
@triton.jit(do_not_specialize=["first_row_block"])
def _backward_kernel(H, W, B, OFFSETS, CAND_ROWS, CAND_COLS, CAND_SLOTS, M_NC, COEF_NC, CAND_GRAD, ROW_SCALE,
                     DH, DW, DB, WORKSPACE,
                     N, V, D, S, n_vocab_tiles, first_row_block, logit_scale, softcap, inv_temp, filter_eps,
                     BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, FILTER: tl.constexpr, FUSED: tl.constexpr,
                     NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr):
    row_block = first_row_block + tl.program_id(0)
    tile = tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = (tile * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)).to(tl.int64)
    in_rows = rows < N
    inside = in_rows[:, None] & (cols[None, :] < V)
    z = logit_tile(H, W, B, rows, cols, N, V, D, logit_scale, softcap, inv_temp,
                   BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, HAS_BIAS, HAS_SOFTCAP, UPCAST, DOT_PRECISION)

    m_nc = tl.load(M_NC + rows, mask=in_rows, other=0.0)
    coef_nc = tl.load(COEF_NC + rows, mask=in_rows, other=0.0)
    dz = tl.exp(z - m_nc[:, None]) * coef_nc[:, None]
    csr_index = row_block * n_vocab_tiles + tile
    cand_start = tl.load(OFFSETS + csr_index)
    cand_end = tl.load(OFFSETS + csr_index + 1)
    for j in range(cand_start, cand_end):
        r = tl.load(CAND_ROWS + j).to(tl.int64)
        hit = (rows[:, None] == r) & (cols[None, :] == tl.load(CAND_COLS + j))
        dz = tl.where(hit, tl.load(CAND_GRAD + r * S + tl.load(CAND_SLOTS + j)), dz)
    if HAS_SOFTCAP:
        u = z * (1.0 / (softcap * inv_temp))
        dz = dz * (1.0 - u * u)
    dx = tl.where(inside, dz * (logit_scale * inv_temp), 0.0)

    if FILTER:
        row_scale = tl.load(ROW_SCALE + rows, mask=in_rows, other=0.0)
        large = tl.abs(dx) >= filter_eps * row_scale[:, None]
        keep = (cand_end > cand_start) | (tl.sum(tl.sum(large.to(tl.int32), axis=1), axis=0) > 0)
    else:
        keep = True

    if FUSED:
        if keep:
            offs_d = tl.arange(0, BLOCK_D)
            if UPCAST:
                dx_op = dx
            else:  # tensor cores: the gradient tile rounds to the GEMM dtype, accumulation stays fp32
                dx_op = dx.to(W.dtype.element_ty)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + offs_d
                if NEED_DH:
                    w = tl.load(W + cols[:, None] * D + d[None, :], mask=(cols[:, None] < V) & (d[None, :] < D),
                                other=0.0)
                    if UPCAST:
                        w = w.to(tl.float32)
                    tl.atomic_add(DH + rows[:, None] * D + d[None, :], tl.dot(dx_op, w, input_precision=DOT_PRECISION),
                                  mask=in_rows[:, None] & (d[None, :] < D), sem="relaxed")
                if NEED_DW:
                    h = tl.load(H + rows[:, None] * D + d[None, :], mask=in_rows[:, None] & (d[None, :] < D),
                                other=0.0)
                    if UPCAST:
                        h = h.to(tl.float32)
                    tl.atomic_add(DW + cols[:, None] * D + d[None, :],
                                  tl.dot(tl.trans(dx_op), h, input_precision=DOT_PRECISION),
                                  mask=(cols[:, None] < V) & (d[None, :] < D), sem="relaxed")
            if NEED_DB:
                tl.atomic_add(DB + cols, tl.sum(dx, axis=0), mask=cols < V, sem="relaxed")
    else:
        local_rows = rows - first_row_block * BLOCK_ROWS
        tl.store(WORKSPACE + local_rows[:, None] * V + cols[None, :], tl.where(keep, dx, 0.0), mask=inside)


def backward_grads(hidden, weight, bias, csr: CandidateCSR, m_nc, coef_nc, cand_grad, row_scale, *,
                   logit_scale: float, softcap: float | None, temperature: float, mode: str,
                   filter_eps: float | None, need_dh: bool, need_dw: bool, need_db: bool, cfg: TileConfig):
    """Gradients of the loss w.r.t. ``hidden`` ``(N, D)``, ``weight`` ``(V, D)`` and ``bias`` ``(V,)``.

    ``m_nc``, ``coef_nc``, ``row_scale`` ``(N,)`` and ``cand_grad`` ``(N, S)`` are fp32 and already carry the
    per-row upstream gradient (``row_scale`` = its absolute value, used by the filter only).

    Returns ``(dh, dw, db)``: fp32 tensors (dh in the input dtype in deterministic mode), None where not needed.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    fused = mode == "fused"
    dw = torch.zeros(v, d, dtype=torch.float32, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    if fused:
        dh = torch.zeros(n, d, dtype=torch.float32, device=dev) if need_dh else None
        chunk_rows, workspace = n, None
    else:
        dh = torch.empty(n, d, dtype=hidden.dtype, device=dev) if need_dh else None
        chunk_rows = triton.cdiv(min(cfg.workspace_rows, n), cfg.block_rows) * cfg.block_rows
        workspace = torch.empty(chunk_rows, v, dtype=hidden.dtype, device=dev)
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        _backward_kernel[(triton.cdiv(end - start, cfg.block_rows), csr.n_vocab_tiles)](
            hidden, weight, bias, csr.offsets, csr.rows, csr.cols, csr.slots, m_nc, coef_nc, cand_grad, row_scale,
            dh, dw, db, workspace,
            n, v, d, cand_grad.shape[1], csr.n_vocab_tiles, start // cfg.block_rows,
            float(logit_scale), 1.0 if softcap is None else float(softcap), 1.0 / float(temperature),
            0.0 if filter_eps is None else float(filter_eps),
            BLOCK_ROWS=cfg.block_rows, BLOCK_VOCAB=cfg.block_vocab, BLOCK_D=cfg.block_d,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, UPCAST=interpreting(),
            DOT_PRECISION=dot_precision(hidden.dtype), FILTER=filter_eps is not None, FUSED=fused,
            NEED_DH=need_dh, NEED_DW=need_dw, NEED_DB=need_db, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if fused:
            continue
        dx = workspace[: end - start]
        if need_dh:
            torch.mm(dx, weight, out=dh[start:end])
        if need_dw:
            _accumulate_dw(dw, dx, hidden[start:end])
        if need_db:
            db += dx.sum(dim=0, dtype=torch.float32)
    return dh, dw, db


# fp32 elements of one upcast block of the dW fallback (64 MiB): bounds its extra memory whatever V and the chunk.
UPCAST_BLOCK_ELEMS = 2**24


def _accumulate_dw(dw: torch.Tensor, dx: torch.Tensor, h: torch.Tensor) -> None:
    """``dw += dxᵀ @ h`` into the fp32 accumulator ``dw`` for half-precision or fp32 operands."""
    if dx.dtype == torch.float32:
        dw.addmm_(dx.t(), h)
    elif mixed_addmm_supported(dx.device, dx.dtype):  # half-precision GEMM, fp32 output (cuBLAS sums in fp32)
        torch.addmm(dw, dx.t(), h, out_dtype=torch.float32, out=dw)
    else:
        accumulate_dw_upcast(dw, dx, h, UPCAST_BLOCK_ELEMS)


def accumulate_dw_upcast(dw: torch.Tensor, dx: torch.Tensor, h: torch.Tensor,
                         block_elems: int = UPCAST_BLOCK_ELEMS) -> None:
    """``dw += dxᵀ @ h`` as fp32 GEMMs of upcast operands, ``dx`` ``(c, V)`` taken in column blocks of at most
    ``block_elems`` elements. Half-precision products are exact in fp32 and the sums are fp32 either way, so this
    matches the mixed-precision GEMM's numerics; only an fp32 copy of ``h`` and of one block is extra memory."""
    h32 = h.float()
    cols = max(1, block_elems // max(1, dx.shape[0]))
    for v0 in range(0, dx.shape[1], cols):
        dw[v0:v0 + cols].addmm_(dx[:, v0:v0 + cols].t().float(), h32)


@functools.cache
def mixed_addmm_supported(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``torch.addmm(dw, a, b, out_dtype=torch.float32, out=dw)`` works for ``dtype`` operands and an fp32
    ``dw`` on ``device`` (the ``addmm.dtype_out`` overload: CUDA in torch >= 2.8; absent on CPU and in older
    releases). Tried once per (device, dtype) on 2×2 tensors, and the result checked."""
    try:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
        out = torch.ones(2, 2, device=device)
        torch.addmm(out, a.to(dtype), a.to(dtype), out_dtype=torch.float32, out=out)
        return out.dtype == torch.float32 and torch.equal(out.cpu(), torch.ones(2, 2) + a.cpu() @ a.cpu())
    except (TypeError, RuntimeError):  # unknown keyword (old torch), or no kernel for this backend / dtype
        return False
