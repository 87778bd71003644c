"""Backward kernel: recompute logit tiles, form dL/dx for the raw logits x = h·Wᵀ + b, fold it into dh, dW, db.

Grid ``(row block, vocabulary tile)``. Per tile (see :func:`fastdistill_kernels.buckets.logit_gradients`):

    dL/dz = exp(z − m_nc[row]) · coef_nc[row]     non-candidate columns
          = cand_grad[row, slot]                  candidate columns (one per row per trip, from the sorted lists)
    dL/dx = dL/dz · logit_scale / T · (1 − u²)    u = tanh(logit_scale·x/c) = z·T/c, only with a softcap

Each program finds its rows' first candidate in the tile by a binary search of their sorted ids
(:mod:`fastdistill_kernels.candidates`), then places the candidates' gradients one per row per trip.

Two ways to accumulate:
  "fused":          dh[rows] += dx @ W[cols] and dW[cols] += dxᵀ @ h[rows] with fp32 atomics, D looped in
                    BLOCK_D chunks; no workspace, non-deterministic summation order. The atomics are relaxed
                    (independent adds that need no ordering; the kernel's completion orders them for the
                    consumer), so they compile to fence-free reductions (RED) rather than acq_rel ATOM + MEMBAR.
  "deterministic":  chunks of the vocabulary: the kernel writes dx for every row × the chunk's columns into an
                    (N, chunk) workspace in the GEMM dtype (at most ``TileConfig.workspace_bytes``), then torch
                    GEMMs write dW[chunk] = dxᵀ @ h and db[chunk] = Σ_rows dx once each (no accumulation over
                    chunks) and accumulate dh += dx @ W[chunk] into an fp32 (N, D) buffer. Fixed shapes and
                    summation order: the same inputs give the same bits.

Gradient filtering (``filter_eps``): a tile whose every |dL/dx| is below ``filter_eps · |upstream grad of its
row|`` contributes nothing; tiles holding candidates are never skipped. In the fused mode a skipped tile does no
dh / dW work (the saving); in the deterministic mode it is only written as zeros to the workspace, and the GEMMs
are dense whatever it holds: the filter adds its bounded error there and saves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .candidates import SortedCandidates, first_at_or_after, next_ids
from .config import TileConfig, dot_precision, interpreting
from .tiles import logit_tile

BACKWARD_MODES = ("deterministic", "fused")


# first_tile is the vocabulary chunk's first tile (0 in the fused mode): not specialised, or chunks whose offset is
# a multiple of 16 and the others would compile to two kernels with identical code. ws_stride (the workspace's row
# stride, a multiple of BLOCK_VOCAB) is the same for every chunk and specialised: its divisibility by 16 lets the
# workspace stores vectorise.
@triton.jit(do_not_specialize=["first_tile"])
def _backward_kernel(H, W, B, SORTED_IDS, CAND_GRAD_SORTED, M_NC, COEF_NC, ROW_SCALE,
                     DH, DW, DB, WORKSPACE,
                     N, V, D, S, search_steps, first_tile, ws_stride, logit_scale, softcap, inv_temp, filter_eps,
                     BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, FILTER: tl.constexpr, FUSED: tl.constexpr,
                     NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr):
    row_block = tl.program_id(0)
    tile = first_tile + tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    tile_start = tile * BLOCK_VOCAB
    offs_v = tl.arange(0, BLOCK_VOCAB)
    cols = (tile_start + offs_v).to(tl.int64)
    in_rows = rows < N
    inside = in_rows[:, None] & (cols[None, :] < V)
    z = logit_tile(H, W, B, rows, cols, N, V, D, logit_scale, softcap, inv_temp,
                   BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, HAS_BIAS, HAS_SOFTCAP, UPCAST, DOT_PRECISION)

    m_nc = tl.load(M_NC + rows, mask=in_rows, other=0.0)
    coef_nc = tl.load(COEF_NC + rows, mask=in_rows, other=0.0)
    dz = tl.exp(z - m_nc[:, None]) * coef_nc[:, None]
    # Candidates of this tile, one per row per trip, their gradients read in sorted order.
    ptr = first_at_or_after(SORTED_IDS, rows, in_rows, S, tile_start, search_steps)
    nxt = next_ids(SORTED_IDS, rows, in_rows, S, ptr)
    hit = nxt < tile_start + BLOCK_VOCAB
    has_cand = tl.max(hit.to(tl.int32), axis=0) > 0
    while tl.max(hit.to(tl.int32), axis=0) > 0:
        grad = tl.load(CAND_GRAD_SORTED + rows * S + ptr, mask=hit, other=0.0)
        dz = tl.where(offs_v[None, :] == (nxt - tile_start)[:, None], grad[:, None], dz)
        ptr += hit.to(tl.int32)
        nxt = next_ids(SORTED_IDS, rows, in_rows, S, ptr)
        hit = nxt < tile_start + BLOCK_VOCAB
    if HAS_SOFTCAP:
        u = z * (1.0 / (softcap * inv_temp))
        dz = dz * (1.0 - u * u)
    dx = tl.where(inside, dz * (logit_scale * inv_temp), 0.0)

    if FILTER:
        row_scale = tl.load(ROW_SCALE + rows, mask=in_rows, other=0.0)
        large = tl.abs(dx) >= filter_eps * row_scale[:, None]
        keep = has_cand | (tl.sum(tl.sum(large.to(tl.int32), axis=1), axis=0) > 0)
    else:
        keep = True

    accumulate_tile(dx, keep, H, W, DH, DW, DB, WORKSPACE, rows, cols, in_rows, inside,
                    tl.program_id(1) * BLOCK_VOCAB + offs_v, V, D, ws_stride,
                    BLOCK_D, UPCAST, DOT_PRECISION, FUSED, NEED_DH, NEED_DW, NEED_DB)


@triton.jit
def accumulate_tile(dx, keep, H, W, DH, DW, DB, WORKSPACE, rows, cols, in_rows, inside, local_cols, V, D, ws_stride,
                    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr,
                    NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr):
    """Fold one fp32 ``dL/dx`` tile ``dx`` ``(BLOCK_ROWS, BLOCK_VOCAB)`` (0 outside ``inside``) of rows ``rows`` and
    vocabulary columns ``cols`` into the gradients: ``FUSED``: ``dh[rows] += dx @ W[cols]``, ``dW[cols] += dxᵀ @
    h[rows]``, ``db[cols] += Σ_rows dx`` with relaxed fp32 atomics, D in ``BLOCK_D`` steps (nothing when ``keep`` is
    false); else the tile (zeros when not ``keep``) into ``WORKSPACE`` at columns ``local_cols`` of its chunk."""
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
        tl.store(WORKSPACE + rows[:, None] * ws_stride + local_cols[None, :], tl.where(keep, dx, 0.0), mask=inside)


def vocab_chunk_tiles(cfg: TileConfig, n_rows: int, n_vocab_tiles: int, itemsize: int) -> int:
    """Vocabulary tiles per chunk of the deterministic backward: the ``(n_rows, chunk)`` workspace of
    ``itemsize``-byte elements within ``cfg.workspace_bytes``, at least one tile, at most the whole vocabulary."""
    per_tile = max(1, n_rows) * cfg.block_vocab * itemsize
    return max(1, min(n_vocab_tiles, cfg.workspace_bytes // per_tile))


def backward_grads(hidden, weight, bias, cands: SortedCandidates, m_nc, coef_nc, cand_grad, row_scale, *,
                   logit_scale: float, softcap: float | None, temperature: float, mode: str,
                   filter_eps: float | None, need_dh: bool, need_dw: bool, need_db: bool, cfg: TileConfig):
    """Gradients of the loss w.r.t. ``hidden`` ``(N, D)``, ``weight`` ``(V, D)`` and ``bias`` ``(V,)``.

    ``cands`` are the per-row sorted candidates; ``m_nc``, ``coef_nc``, ``row_scale`` ``(N,)`` and ``cand_grad``
    ``(N, S)`` (slot order) are fp32 and already carry the per-row upstream gradient (``row_scale`` = its absolute
    value, used by the filter only).

    Returns ``(dh, dw, db)`` as :func:`tiled_backward` (fp32 in the fused mode; dh, dw in hidden's dtype in the
    deterministic mode), None where not needed.
    """
    d = hidden.shape[1]
    cand_grad_sorted = cands.to_sorted(cand_grad)

    def launch(grid, rows, first_tile, ws, ws_stride, dh, dw, db):
        _backward_kernel[grid](
            hidden[rows], weight, bias, cands.ids[rows], cand_grad_sorted[rows], m_nc[rows], coef_nc[rows],
            row_scale[rows], dh, dw, db, ws,
            rows.stop - rows.start, weight.shape[0], d, cands.ids.shape[1], cands.search_steps, first_tile, ws_stride,
            float(logit_scale), 1.0 if softcap is None else float(softcap), 1.0 / float(temperature),
            0.0 if filter_eps is None else float(filter_eps),
            BLOCK_ROWS=cfg.block_rows, BLOCK_VOCAB=cfg.block_vocab, BLOCK_D=cfg.block_d,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, UPCAST=interpreting(),
            DOT_PRECISION=dot_precision(hidden.dtype), FILTER=filter_eps is not None, FUSED=mode == "fused",
            NEED_DH=need_dh, NEED_DW=need_dw, NEED_DB=need_db, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    return tiled_backward(hidden, weight, launch, mode=mode, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
                          cfg=cfg)


def deterministic_blocks(cfg: TileConfig, n_rows: int, d: int, n_vocab_tiles: int, itemsize: int) -> tuple[int, int]:
    """``(rows per row block, vocabulary tiles per chunk)`` of the deterministic backward within
    ``cfg.workspace_bytes``: a row block's fp32 dh accumulator (rows·D·4 bytes) takes at most half of it (all rows
    when that fits, else equal blocks rounded up to ``block_rows``), its ``(rows, chunk)`` workspace of
    ``itemsize``-byte elements the rest (at least one tile)."""
    per_row = 4 * max(1, d)
    most = max(cfg.block_rows, (cfg.workspace_bytes // 2) // per_row // cfg.block_rows * cfg.block_rows)
    n_blocks = triton.cdiv(max(1, n_rows), most)
    rows = min(max(1, n_rows), triton.cdiv(triton.cdiv(max(1, n_rows), n_blocks), cfg.block_rows) * cfg.block_rows)
    left = dataclasses.replace(cfg, workspace_bytes=cfg.workspace_bytes - rows * per_row)
    return rows, vocab_chunk_tiles(left, rows, n_vocab_tiles, itemsize)


def tiled_backward(hidden, weight, launch, *, mode: str, need_dh: bool, need_dw: bool, need_db: bool,
                   cfg: TileConfig):
    """Drive a backward kernel of grid ``(row block, vocabulary tile)`` that ends in :func:`accumulate_tile`, for
    ``hidden`` ``(N, D)`` and ``weight`` ``(V, D)``: call ``launch(grid, rows, first_tile, workspace,
    workspace_row_stride, dh, dw, db)`` for the row range ``rows`` (a slice) and the vocabulary chunk from
    ``first_tile``.

    Fused mode: one launch over all rows and the whole vocabulary into fp32 ``dh``, ``dw``, ``db`` (the atomics'
    accumulators). Deterministic mode (no (V, D) fp32 buffer): per row block and vocabulary chunk
    (:func:`deterministic_blocks`) the kernel writes the ``(rows, chunk)`` workspace (``dh``, ``dw``, ``db`` passed
    as None), then torch GEMMs with fp32 sums fold it in: ``dh[rows]`` accumulates over the chunks in an fp32 row
    block (none when one chunk covers the vocabulary) and is rounded once; ``dW[chunk]`` lands in the GEMM dtype,
    written by the first row block and added to by the others (one rounding per row block).

    Returns ``(dh, dw, db)``: fused mode fp32; deterministic mode dh ``(N, D)`` and dw ``(V, D)`` in hidden's dtype,
    db ``(V,)`` fp32; None where not needed.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    n_vocab_tiles = triton.cdiv(v, cfg.block_vocab)
    if mode == "fused":
        dh = torch.zeros(n, d, dtype=torch.float32, device=dev) if need_dh else None
        dw = torch.zeros(v, d, dtype=torch.float32, device=dev) if need_dw else None
        db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
        launch((triton.cdiv(n, cfg.block_rows), n_vocab_tiles), slice(0, n), 0, None, 0, dh, dw, db)
        return dh, dw, db
    dh = torch.empty(n, d, dtype=hidden.dtype, device=dev) if need_dh else None
    dw = torch.empty(v, d, dtype=hidden.dtype, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    block_rows, chunk_tiles = deterministic_blocks(cfg, n, d, n_vocab_tiles, hidden.element_size())
    one_chunk = chunk_tiles >= n_vocab_tiles
    # row stride chunk_tiles · BLOCK_VOCAB for every chunk (the last one uses the left part of each row)
    workspace = torch.empty(min(n, block_rows), chunk_tiles * cfg.block_vocab, dtype=hidden.dtype, device=dev)
    dh_acc = None
    for r0 in range(0, n, block_rows):
        rows = slice(r0, min(r0 + block_rows, n))
        h = hidden[rows]
        if need_dh and not one_chunk:
            dh_acc = torch.zeros(h.shape[0], d, dtype=torch.float32, device=dev)
        for first_tile in range(0, n_vocab_tiles, chunk_tiles):
            c0 = first_tile * cfg.block_vocab
            c1 = min(c0 + chunk_tiles * cfg.block_vocab, v)
            ws = workspace[: h.shape[0], : c1 - c0]
            grid = (triton.cdiv(h.shape[0], cfg.block_rows), min(chunk_tiles, n_vocab_tiles - first_tile))
            launch(grid, rows, first_tile, ws, workspace.stride(0), None, None, None)
            if need_dh:
                if one_chunk:
                    gemm_into(dh[rows], ws, weight, accumulate=False)
                else:
                    addmm_fp32(dh_acc, ws, weight[c0:c1])
            if need_dw:
                gemm_into(dw[c0:c1], ws.t(), h, accumulate=r0 > 0)
            if need_db:
                db[c0:c1] += ws.sum(dim=0, dtype=torch.float32)
        if dh_acc is not None:
            dh[rows] = dh_acc
    return dh, dw, db


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) with fp32 sums and one rounding to ``out``'s dtype per
    call: a half-precision ``out`` takes the GEMM in its own dtype (cuBLAS accumulates in fp32, split-K partial sums
    included (:func:`fp32_split_k`), and adds ``out`` in fp32), emulated on CPU by fp32 GEMMs of upcast blocks; an
    fp32 ``out`` goes through :func:`addmm_fp32`."""
    if out.dtype == torch.float32:
        if not accumulate:
            out.zero_()
        addmm_fp32(out, a, b)
    elif out.device.type != "cpu":
        with fp32_split_k():
            if accumulate:
                out.addmm_(a, b)
            else:
                torch.mm(a, b, out=out)
    else:
        if not accumulate:
            out.zero_()
        addmm_upcast(out, a, b, UPCAST_BLOCK_ELEMS)


REDUCTION_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def fp32_split_k():
    """Within the block, cuBLAS combines the split-K partial sums of a half-precision-output GEMM in fp32, as the
    precision policy asks (docs/loss.md): torch lets it combine them in the output's half precision by default
    (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` / ``..._fp16_...``, True), one more
    rounding per split. Both flags are switched off and restored after, their split-K setting included where torch
    has it (≥ 2.10). The flags are process-wide: a GEMM another thread launches meanwhile also sums in fp32."""
    flags = torch.backends.cuda.matmul
    saved = []
    for name in REDUCTION_FLAGS:
        try:
            saved.append((name, (getattr(flags, name), getattr(flags, name + "_split_k"))))
        except AttributeError:  # torch < 2.10: one bool
            saved.append((name, getattr(flags, name)))
    try:
        for name in REDUCTION_FLAGS:
            setattr(flags, name, False)
        yield
    finally:
        for name, value in saved:
            setattr(flags, name, value)


# fp32 elements of one upcast block of the GEMM fallback (64 MiB): bounds its extra memory whatever the shapes.
UPCAST_BLOCK_ELEMS = 2**24


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into the fp32 accumulator ``acc`` for half-precision or fp32 operands: a plain fp32 GEMM,
    a mixed-precision GEMM (half-precision operands, fp32 output) where torch has it, else upcast blocks."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif mixed_addmm_supported(a.device, a.dtype):  # cuBLAS sums in fp32
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        addmm_upcast(acc, a, b, UPCAST_BLOCK_ELEMS)


def addmm_upcast(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block_elems: int = UPCAST_BLOCK_ELEMS) -> None:
    """``acc += a @ b`` as fp32 GEMMs of upcast operands, ``a`` ``(m, k)`` taken in blocks of rows and columns so
    that each upcast block of ``a`` and ``b`` and each fp32 partial sum holds at most ``block_elems`` elements (at
    least one row / column). Half-precision products are exact in fp32 and the sums are fp32 either way, so this
    matches the mixed-precision GEMM's numerics; a half-precision ``acc`` is summed in an fp32 block and rounded
    once per row block, as cuBLAS rounds once per GEMM. Extra memory: three blocks, never an fp32 copy of an
    operand or of ``acc``."""
    m, k = a.shape
    n = b.shape[1]
    cols = max(1, min(k, block_elems // max(1, n)))  # a (cols, n) block of b
    rows = max(1, block_elems // max(1, cols, n))  # (rows, cols) of a, (rows, n) of the sum
    for r0 in range(0, m, rows):
        out = acc[r0:r0 + rows]
        total = out if out.dtype == torch.float32 else out.float()
        for c0 in range(0, k, cols):
            total.addmm_(a[r0:r0 + rows, c0:c0 + cols].float(), b[c0:c0 + cols].float())
        if total is not out:
            out.copy_(total)


def accumulate_dw_upcast(dw: torch.Tensor, dx: torch.Tensor, h: torch.Tensor,
                         block_elems: int = UPCAST_BLOCK_ELEMS) -> None:
    """``dw += dxᵀ @ h`` (``dx`` ``(c, V)``) through :func:`addmm_upcast`: column blocks of ``dx``."""
    addmm_upcast(dw, dx.t(), h, block_elems)


@functools.cache
def mixed_mm_supported(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32, out=out)`` works for ``dtype`` operands on ``device`` (the
    ``mm.dtype_out`` overload: CUDA in torch >= 2.8, absent on CPU). Tried once per (device, dtype), result checked."""
    try:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
        out = torch.empty(2, 2, device=device)
        torch.mm(a.to(dtype), a.to(dtype), out_dtype=torch.float32, out=out)
        return out.dtype == torch.float32 and torch.equal(out.cpu(), a.cpu() @ a.cpu())
    except (TypeError, RuntimeError, NotImplementedError):
        return False


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
