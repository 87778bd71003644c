"""Dense-teacher generalized JSD with no logits in memory: both lm_heads fused into the kernels' tiles.

The student's final logits ``zs = softcap(scale_s·(h_s W_sᵀ + b_s)) / T`` and the teacher's ``zt`` (its own head,
bias, scale and softcap; the same temperature) are computed tile by tile, two tile matmuls per vocabulary tile, and
never leave the kernel. Over the student's vocabulary ``[0, V)``:

Forward, grid ``(vocabulary split, row block)`` as the sparse forward: each program walks its split's tiles and folds
both tiles into online statistics per row, shifted by each side's running max ``m``:

    Σ e^(z−m),  Σ e^(z−m)·(z−m)                 each side: log-sum-exp and entropy
    Σ e^(zt−m_t)·(zt − zs),  Σ e^(zs−m_s)·(zs − zt)   the teacher- and the student-weighted logit gap

and a torch epilogue merges the splits (no atomics: deterministic). Then, with E the expectation under the teacher
q or the student p,

    β = 0:  D = KL(q‖p) = E_q[zt − zs] − (lse_t − lse_s)
    β = 1:  D = KL(p‖q) = E_p[zs − zt] − (lse_s − lse_t)

are the same pass. 0 < β < 1 mixes the normalised log-probs (log m = logaddexp(s + log(1−β), t + log β)), so it
needs both log-sum-exps first: a second pass over the tiles sums each row's D and ``Σg`` (below) from split
partials. The teacher's columns ``[V, V_t)`` of a padded teacher vocabulary only give their log-sum-exp (the dropped
mass), from torch GEMMs over those few columns in row chunks.

Backward, grid ``(row block, vocabulary tile)`` as the sparse backward: both tiles recomputed, the student's
``dL/dx`` formed from the per-row statistics and the per-row upstream gradient (with ``s = zs − lse_s``,
``t = zt − lse_t``, ``p = e^s``: β = 0 ``p − q``; β = 1 ``p (s − t − D)``; else ``g − p Σg`` with
``g = (1−β) p (s − log m)``), times ``scale_s / T`` and the softcap derivative, then folded into dh, dW and db by
:func:`fastdistill_kernels.backward.accumulate_tile`: fp32 atomics ("fused") or vocabulary chunks of a workspace
and torch GEMMs ("deterministic").

Matmul FLOPs per row (``D_s``, ``D_t`` the hidden sizes): forward 2·V·(D_s + D_t), twice for 0 < β < 1; backward
2·V·(D_s + D_t) to recompute the tiles and 4·V·D_s for dh and dW. So 8·V·D_s for the student (10 for 0 < β < 1)
against the chunked-logits variant's 6, in exchange for no ``(rows, V)`` buffer at all. The teacher inputs are
constants: they get no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .backward import BACKWARD_MODES, accumulate_tile, tiled_backward
from .config import TileConfig, dense_default_config, device_guard, dot_precision, interpreting, vocab_splits
from .dense_chunk import (
    BETA_MIXED,
    BETA_REVERSE,
    DenseHeads,
    beta_mode,
    head_scalars,
    log_mixture,
    mixing_constants,
)
from .forward import MAX_GRID_Y
from .ops import DTYPES
from .tiles import logit_tile

N_PARTS = 8  # forward partials per (row, split): (max, Σe, Σe·y, Σe·gap) for the student, then for the teacher
PAD_CHUNK_BYTES = 2**26  # fp32 logits of the padded teacher columns per row chunk (64 MiB)


# --------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _online_rows(m, s, e, a, z, gap, keep):
    """Fold a ``(rows, cols)`` tile of logits ``z`` (columns where ``keep``) into per-row online statistics shifted
    by the running max ``m``: ``s = Σ e^(z−m)``, ``e = Σ e^(z−m)·(z−m)``, ``a = Σ e^(z−m)·gap``. Every tile keeps at
    least one column, so the new max is finite."""
    z = tl.where(keep, z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    rescale = tl.exp(m - m_new)
    y = tl.where(keep, z - m_new[:, None], 0.0)
    w = tl.where(keep, tl.exp(y), 0.0)
    e = rescale * (e + tl.where(s > 0, m - m_new, 0.0) * s) + tl.sum(w * y, axis=1)
    a = rescale * a + tl.sum(w * gap, axis=1)
    s = rescale * s + tl.sum(w, axis=1)
    return m_new, s, e, a


@triton.jit
def _both_tiles(HS, WS, BS, HT, WT, BT, rows, cols, N, V, DS, DT, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
                BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr, S_BIAS: tl.constexpr,
                S_SOFTCAP: tl.constexpr, T_BIAS: tl.constexpr, T_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                S_DOT: tl.constexpr, T_DOT: tl.constexpr):
    """The student's and the teacher's fp32 final-logit tiles ``(BLOCK_ROWS, BLOCK_VOCAB)`` at ``rows`` × ``cols``
    (the teacher's weight read at its first ``V`` rows only)."""
    zs = logit_tile(HS, WS, BS, rows, cols, N, V, DS, s_scale, s_softcap, inv_temp,
                    BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, S_BIAS, S_SOFTCAP, UPCAST, S_DOT)
    zt = logit_tile(HT, WT, BT, rows, cols, N, V, DT, t_scale, t_softcap, inv_temp,
                    BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, T_BIAS, T_SOFTCAP, UPCAST, T_DOT)
    return zs, zt


@triton.jit
def _split_program(first_row_block, N, n_vocab_tiles, tiles_per_split, BLOCK_ROWS: tl.constexpr):
    """Grid ``(vocabulary split, row block)``, the split on the fast axis (as in the sparse forward: the programs
    resident at a time share a few row blocks' hidden states in L2): this program's split, rows (int64), which of
    them exist, and its tiles ``[first_tile, last_tile)``."""
    split = tl.program_id(0)
    row_block = first_row_block + tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    first_tile = split * tiles_per_split
    return split, rows, rows < N, first_tile, tl.minimum(first_tile + tiles_per_split, n_vocab_tiles)


@triton.jit(do_not_specialize=["first_row_block"])
def _dense_forward_kernel(HS, WS, BS, HT, WT, BT, PARTS, N, V, DS, DT, n_vocab_tiles, tiles_per_split, n_splits,
                          first_row_block, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
                          BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
                          S_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr, T_BIAS: tl.constexpr,
                          T_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, S_DOT: tl.constexpr, T_DOT: tl.constexpr):
    """Online statistics of both sides over one split's tiles into ``PARTS`` ``(8, N, n_splits)``."""
    split, rows, in_rows, first_tile, last_tile = _split_program(first_row_block, N, n_vocab_tiles, tiles_per_split,
                                                                 BLOCK_ROWS)
    m_s = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    s_s = tl.zeros((BLOCK_ROWS,), tl.float32)
    e_s = tl.zeros((BLOCK_ROWS,), tl.float32)
    a_s = tl.zeros((BLOCK_ROWS,), tl.float32)
    m_t = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    s_t = tl.zeros((BLOCK_ROWS,), tl.float32)
    e_t = tl.zeros((BLOCK_ROWS,), tl.float32)
    a_t = tl.zeros((BLOCK_ROWS,), tl.float32)
    offs_v = tl.arange(0, BLOCK_VOCAB)
    for tile in range(first_tile, last_tile):
        cols = (tile * BLOCK_VOCAB + offs_v).to(tl.int64)
        zs, zt = _both_tiles(HS, WS, BS, HT, WT, BT, rows, cols, N, V, DS, DT, s_scale, s_softcap, t_scale,
                             t_softcap, inv_temp, BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, S_BIAS, S_SOFTCAP, T_BIAS,
                             T_SOFTCAP, UPCAST, S_DOT, T_DOT)
        keep = cols[None, :] < V
        gap = tl.where(keep, zs - zt, 0.0)
        m_s, s_s, e_s, a_s = _online_rows(m_s, s_s, e_s, a_s, zs, gap, keep)
        m_t, s_t, e_t, a_t = _online_rows(m_t, s_t, e_t, a_t, zt, -gap, keep)
    out = PARTS + rows * n_splits + split
    plane = N * n_splits
    tl.store(out, m_s, mask=in_rows)
    tl.store(out + plane, s_s, mask=in_rows)
    tl.store(out + 2 * plane, e_s, mask=in_rows)
    tl.store(out + 3 * plane, a_s, mask=in_rows)
    tl.store(out + 4 * plane, m_t, mask=in_rows)
    tl.store(out + 5 * plane, s_t, mask=in_rows)
    tl.store(out + 6 * plane, e_t, mask=in_rows)
    tl.store(out + 7 * plane, a_t, mask=in_rows)


@triton.jit(do_not_specialize=["first_row_block"])
def _dense_mixed_kernel(HS, WS, BS, HT, WT, BT, LSE_S, LSE_T, PART_DIV, PART_G, N, V, DS, DT, n_vocab_tiles,
                        tiles_per_split, n_splits, first_row_block, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
                        beta, log_1mb, log_b,
                        BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
                        S_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr, T_BIAS: tl.constexpr, T_SOFTCAP: tl.constexpr,
                        UPCAST: tl.constexpr, S_DOT: tl.constexpr, T_DOT: tl.constexpr):
    """0 < β < 1: one split's per-row sums of the divergence terms and of ``g = (1−β) p (s − log m)`` into
    ``PART_DIV`` and ``PART_G`` ``(N, n_splits)``."""
    split, rows, in_rows, first_tile, last_tile = _split_program(first_row_block, N, n_vocab_tiles, tiles_per_split,
                                                                 BLOCK_ROWS)
    lse_s = tl.load(LSE_S + rows, mask=in_rows, other=0.0)
    lse_t = tl.load(LSE_T + rows, mask=in_rows, other=0.0)
    div = tl.zeros((BLOCK_ROWS,), tl.float32)
    sum_g = tl.zeros((BLOCK_ROWS,), tl.float32)
    offs_v = tl.arange(0, BLOCK_VOCAB)
    for tile in range(first_tile, last_tile):
        cols = (tile * BLOCK_VOCAB + offs_v).to(tl.int64)
        zs, zt = _both_tiles(HS, WS, BS, HT, WT, BT, rows, cols, N, V, DS, DT, s_scale, s_softcap, t_scale,
                             t_softcap, inv_temp, BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, S_BIAS, S_SOFTCAP, T_BIAS,
                             T_SOFTCAP, UPCAST, S_DOT, T_DOT)
        keep = cols[None, :] < V
        s = zs - lse_s[:, None]
        t = zt - lse_t[:, None]
        log_m = log_mixture(s, t, log_1mb, log_b)
        g = tl.where(keep, (1.0 - beta) * tl.exp(s) * (s - log_m), 0.0)
        div += tl.sum(tl.where(keep, beta * tl.exp(t) * (t - log_m), 0.0) + g, axis=1)
        sum_g += tl.sum(g, axis=1)
    out = rows * n_splits + split
    tl.store(PART_DIV + out, div, mask=in_rows)
    tl.store(PART_G + out, sum_g, mask=in_rows)


# first_tile: not specialised, as in the sparse backward (chunk offsets would otherwise compile twice)
@triton.jit(do_not_specialize=["first_tile"])
def _dense_backward_kernel(HS, WS, BS, HT, WT, BT, LSE_S, LSE_T, ROW_C, GRAD_ROWS, DH, DW, DB, WORKSPACE,
                           N, V, DS, DT, first_tile, ws_stride, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
                           beta, log_1mb, log_b,
                           BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
                           MODE: tl.constexpr, S_BIAS: tl.constexpr, S_SOFTCAP: tl.constexpr, T_BIAS: tl.constexpr,
                           T_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, S_DOT: tl.constexpr, T_DOT: tl.constexpr,
                           FUSED: tl.constexpr, NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
                           NEED_DB: tl.constexpr):
    """One tile's ``dL/dx`` for the student's raw logits, folded into dh, dW, db. ``ROW_C`` holds D (β = 1) or Σg
    (0 < β < 1) per row; ``GRAD_ROWS`` the per-row upstream gradient."""
    row_block = tl.program_id(0)
    tile = first_tile + tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_VOCAB)
    cols = (tile * BLOCK_VOCAB + offs_v).to(tl.int64)
    in_rows = rows < N
    inside = in_rows[:, None] & (cols[None, :] < V)
    zs, zt = _both_tiles(HS, WS, BS, HT, WT, BT, rows, cols, N, V, DS, DT, s_scale, s_softcap, t_scale, t_softcap,
                         inv_temp, BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, S_BIAS, S_SOFTCAP, T_BIAS, T_SOFTCAP, UPCAST,
                         S_DOT, T_DOT)
    s = zs - tl.load(LSE_S + rows, mask=in_rows, other=0.0)[:, None]
    t = zt - tl.load(LSE_T + rows, mask=in_rows, other=0.0)[:, None]
    p = tl.exp(s)
    if MODE == 0:
        dz = p - tl.exp(t)
    elif MODE == 1:
        dz = p * (s - t - tl.load(ROW_C + rows, mask=in_rows, other=0.0)[:, None])
    else:
        g = (1.0 - beta) * p * (s - log_mixture(s, t, log_1mb, log_b))
        dz = g - p * tl.load(ROW_C + rows, mask=in_rows, other=0.0)[:, None]
    grad_rows = tl.load(GRAD_ROWS + rows, mask=in_rows, other=0.0)
    dz = dz * (grad_rows * (s_scale * inv_temp))[:, None]
    if S_SOFTCAP:
        u = zs * (1.0 / (s_softcap * inv_temp))
        dz = dz * (1.0 - u * u)
    dx = tl.where(inside, dz, 0.0)
    accumulate_tile(dx, True, HS, WS, DH, DW, DB, WORKSPACE, rows, cols, in_rows, inside,
                    tl.program_id(1) * BLOCK_VOCAB + offs_v, V, DS, ws_stride,
                    BLOCK_D, UPCAST, S_DOT, FUSED, NEED_DH, NEED_DW, NEED_DB)


# --------------------------------------------------------------------------------------------------- launches


class DenseForward(NamedTuple):
    """Per-row fp32 results of the forward passes, ``(N,)`` each: the divergence (nats), both log-sum-exps and
    entropies over the student's vocabulary, the backward's row constant (D for β = 1, Σg for 0 < β < 1, else 0)
    and the teacher's dropped mass on ids ≥ V."""

    div: torch.Tensor
    lse_s: torch.Tensor
    lse_t: torch.Tensor
    ent_s: torch.Tensor
    ent_t: torch.Tensor
    row_c: torch.Tensor
    dropped: torch.Tensor


def _meta(s_hidden, t_hidden, s_bias, t_bias, heads: DenseHeads, cfg: TileConfig) -> dict:
    return dict(BLOCK_ROWS=cfg.block_rows, BLOCK_VOCAB=cfg.block_vocab, BLOCK_D=cfg.block_d,
                S_BIAS=s_bias is not None, S_SOFTCAP=heads.student_softcap is not None, T_BIAS=t_bias is not None,
                T_SOFTCAP=heads.teacher_softcap is not None, UPCAST=interpreting(),
                S_DOT=dot_precision(s_hidden.dtype), T_DOT=dot_precision(t_hidden.dtype),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _merge(m: torch.Tensor, s: torch.Tensor, e: torch.Tensor, a: torch.Tensor):
    """Merge ``(N, splits)`` online partials: ``(lse, entropy, a / s)`` per row (the weighted mean of the gap)."""
    top = m.amax(dim=1, keepdim=True)  # finite: every split saw at least one column
    w = torch.exp(m - top)
    total = (w * s).sum(dim=1)
    ent_sum = (w * (e + (m - top) * s)).sum(dim=1)
    return top.squeeze(1) + torch.log(total), torch.log(total) - ent_sum / total, (w * a).sum(dim=1) / total


def padded_teacher_lse(t_hidden: torch.Tensor, t_weight: torch.Tensor, t_bias: torch.Tensor | None, v: int,
                       heads: DenseHeads, chunk_bytes: int = PAD_CHUNK_BYTES) -> torch.Tensor | None:
    """``(N,)`` fp32 log-sum-exp of the teacher's final logits over its ids ``[v, V_t)`` (None when ``V_t = v``),
    from fp32 torch GEMMs in row chunks of at most ``chunk_bytes`` of logits."""
    n, vt = t_hidden.shape[0], t_weight.shape[0]
    if vt == v:
        return None
    w_pad = t_weight[v:].float()
    b_pad = None if t_bias is None else t_bias[v:].float()
    out = torch.empty(n, dtype=torch.float32, device=t_hidden.device)
    rows = max(1, chunk_bytes // (4 * (vt - v)))
    for r0 in range(0, n, rows):
        x = t_hidden[r0:r0 + rows].float() @ w_pad.t()
        if b_pad is not None:
            x += b_pad
        x *= heads.teacher_scale
        if heads.teacher_softcap is not None:
            x = torch.tanh(x / heads.teacher_softcap) * heads.teacher_softcap
        out[r0:r0 + rows] = torch.logsumexp(x / heads.temperature, dim=1)
    return out


def dense_forward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, heads: DenseHeads, beta: float,
                  cfg: TileConfig) -> DenseForward:
    """Run the forward kernel (and the mixed pass for 0 < β < 1) over all rows and merge the splits."""
    n, ds = s_hidden.shape
    dt = t_hidden.shape[1]
    v = s_weight.shape[0]
    dev = s_hidden.device
    n_row_blocks = triton.cdiv(n, cfg.block_rows)
    n_vocab_tiles = triton.cdiv(v, cfg.block_vocab)
    splits, tiles_per_split = vocab_splits(cfg, n_row_blocks, n_vocab_tiles, dev)
    meta = _meta(s_hidden, t_hidden, s_bias, t_bias, heads, cfg)
    parts = torch.empty(N_PARTS, n, splits, dtype=torch.float32, device=dev)
    for first in range(0, n_row_blocks, MAX_GRID_Y):  # one launch unless there are more than 65,535 row blocks
        _dense_forward_kernel[(splits, min(n_row_blocks - first, MAX_GRID_Y))](
            s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, parts, n, v, ds, dt, n_vocab_tiles,
            tiles_per_split, splits, first, *head_scalars(heads), **meta)
    lse_s, ent_s, gap_p = _merge(*parts[:4])  # gap_p = E_p[zs − zt]
    lse_t, ent_t, gap_q = _merge(*parts[4:])  # gap_q = E_q[zt − zs]
    mode = beta_mode(beta)
    if mode == BETA_MIXED:
        part_div, part_g = (torch.empty(n, splits, dtype=torch.float32, device=dev) for _ in range(2))
        for first in range(0, n_row_blocks, MAX_GRID_Y):
            _dense_mixed_kernel[(splits, min(n_row_blocks - first, MAX_GRID_Y))](
                s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, lse_s, lse_t, part_div, part_g, n, v, ds, dt,
                n_vocab_tiles, tiles_per_split, splits, first, *head_scalars(heads), *mixing_constants(beta), **meta)
        div, row_c = part_div.sum(dim=1), part_g.sum(dim=1)
    elif mode == BETA_REVERSE:
        div = gap_p - (lse_s - lse_t)
        row_c = div
    else:
        div = gap_q - (lse_t - lse_s)
        row_c = torch.zeros_like(div)
    lse_pad = padded_teacher_lse(t_hidden, t_weight, t_bias, v, heads)
    dropped = torch.zeros_like(div) if lse_pad is None else torch.exp(lse_pad - torch.logaddexp(lse_t, lse_pad))
    return DenseForward(div, lse_s, lse_t, ent_s, ent_t, row_c, dropped)


def dense_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, fwd_lse_s, fwd_lse_t, row_c, grad_rows,
                   heads: DenseHeads, beta: float, *, mode: str, need_dh: bool, need_dw: bool, need_db: bool,
                   cfg: TileConfig):
    """``(dh, dW, db)`` of ``Σ grad_rows · D`` for the student (None where not needed): fp32 in the fused mode,
    dh and dW in the student's dtype in the deterministic one (see :func:`~fastdistill_kernels.backward.
    tiled_backward`)."""
    ds = s_hidden.shape[1]
    meta = _meta(s_hidden, t_hidden, s_bias, t_bias, heads, cfg)

    def launch(grid, rows, first_tile, ws, ws_stride, dh, dw, db):
        _dense_backward_kernel[grid](
            s_hidden[rows], s_weight, s_bias, t_hidden[rows], t_weight, t_bias, fwd_lse_s[rows], fwd_lse_t[rows],
            row_c[rows], grad_rows[rows], dh, dw, db, ws, rows.stop - rows.start, s_weight.shape[0], ds,
            t_hidden.shape[1], first_tile, ws_stride, *head_scalars(heads),
            *mixing_constants(beta), MODE=beta_mode(beta), FUSED=mode == "fused", NEED_DH=need_dh, NEED_DW=need_dw,
            NEED_DB=need_db, **meta)

    return tiled_backward(s_hidden, s_weight, launch, mode=mode, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
                          cfg=cfg)


class FusedDenseJSD(torch.autograd.Function):
    """Forward: per-row divergence and metrics; saves O(N) statistics besides the inputs. Backward: recomputes both
    logit tiles and accumulates the student's dh, dW, db for any per-row upstream gradient."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, heads: DenseHeads, beta: float,
                backward_mode: str, cfg: TileConfig):
        if s_hidden.shape[0] == 0:  # nothing to launch
            out = DenseForward(*(s_hidden.new_zeros(0, dtype=torch.float32) for _ in range(7)))
        else:
            with device_guard(s_hidden.device):  # Triton launches on the current device, not the tensors'
                out = dense_forward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, heads, beta, cfg)
        ctx.save_for_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, out.lse_s, out.lse_t, out.row_c)
        ctx.heads, ctx.beta, ctx.backward_mode, ctx.cfg = heads, beta, backward_mode, cfg
        ctx.mark_non_differentiable(out.ent_s, out.ent_t, out.dropped)
        return out.div, out.ent_s, out.ent_t, out.dropped

    @staticmethod
    def backward(ctx, grad_div, *_):
        s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, lse_s, lse_t, row_c = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and s_bias is not None
        if grad_div is None or s_hidden.shape[0] == 0:
            grads = [torch.zeros_like(x) if need else None
                     for x, need in zip((s_hidden, s_weight, s_bias), (need_dh, need_dw, need_db), strict=True)]
        else:
            with device_guard(s_hidden.device):  # autograd may run backward on another current device
                grads = dense_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, lse_s, lse_t, row_c,
                                       grad_div.float().contiguous(), ctx.heads, ctx.beta, mode=ctx.backward_mode,
                                       need_dh=need_dh, need_dw=need_dw, need_db=need_db, cfg=ctx.cfg)
            grads = [None if g is None else g.to(x.dtype)
                     for g, x in zip(grads, (s_hidden, s_weight, s_bias), strict=True)]
        return (*grads, None, None, None, None, None, None, None)


class DenseRowLosses(NamedTuple):
    """Per-row results of :func:`fused_dense_teacher_jsd`, each ``(N,)`` fp32 in nats (``dropped`` a probability).

    Attributes:
        divergence: differentiable w.r.t. the student's hidden states, weight and bias.
        entropy: the student's entropy at the temperature (detached).
        teacher_entropy: the teacher's entropy over the student's vocabulary, renormalised (detached).
        dropped: the teacher's probability on ids ≥ V_s before renormalising (detached; 0 unpadded).
    """

    divergence: torch.Tensor
    entropy: torch.Tensor
    teacher_entropy: torch.Tensor
    dropped: torch.Tensor


def fused_dense_teacher_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    heads: DenseHeads | None = None,
    beta: float = 0.0,
    backward_mode: str = "deterministic",
    config: TileConfig | None = None,
) -> DenseRowLosses:
    """Per-row generalized JSD between the student's and a dense teacher's distributions over the student's
    vocabulary, both from hidden states and an lm_head, with no logits in memory.

    Args:
        student_hidden: ``(N, D_s)``; student_weight ``(V_s, D_s)``; student_bias ``(V_s,)`` or None.
        teacher_hidden: ``(N, D_t)``; teacher_weight ``(V_t, D_t)``, ``V_t ≥ V_s``; teacher_bias ``(V_t,)`` or None
            (constants: detached). float32, bfloat16 or float16 on CUDA, or on CPU under ``TRITON_INTERPRET=1``; each
            side's hidden and weight are brought to their common dtype. Arithmetic in the kernels is fp32.
        heads: both sides' logit scale and softcap and the shared temperature; None = plain logits.
        beta: 0 = KL(teacher‖student), 1 = KL(student‖teacher), else the generalized JSD.
        backward_mode: "deterministic" (vocabulary chunks of an (N, chunk) dL/dx workspace within
            ``config.workspace_bytes`` and torch GEMMs: the same inputs give the same bits) or "fused" (fp32
            atomics, no workspace, summation order not fixed).
        config: tile sizes; default :func:`fastdistill_kernels.config.dense_default_config` for the device and the
            student's dtype.

    Returns:
        :class:`DenseRowLosses`; any per-row weighting of ``divergence`` backpropagates.
    """
    _validate(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
              backward_mode)
    heads = heads if heads is not None else DenseHeads(1.0, None, 1.0, None, 1.0)
    sdt = torch.promote_types(student_hidden.dtype, student_weight.dtype)
    tdt = torch.promote_types(teacher_hidden.dtype, teacher_weight.dtype)
    out = FusedDenseJSD.apply(
        student_hidden.to(sdt).contiguous(), student_weight.to(sdt).contiguous(),
        None if student_bias is None else student_bias.contiguous(),
        teacher_hidden.detach().to(tdt).contiguous(), teacher_weight.detach().to(tdt).contiguous(),
        None if teacher_bias is None else teacher_bias.detach().contiguous(),
        heads, float(beta), backward_mode, config or dense_default_config(student_hidden.device, sdt),
    )
    return DenseRowLosses(*out)


def _validate(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, backward_mode) -> None:
    """Raise ValueError for inputs the kernels do not take."""
    if s_hidden.device.type == "cpu" and not interpreting():
        raise ValueError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run them on the CPU")
    for name, x in (("student_hidden", s_hidden), ("student_weight", s_weight), ("teacher_hidden", t_hidden),
                    ("teacher_weight", t_weight)):
        if x.dtype not in DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16 for the Triton kernels, got {x.dtype}")
    for side, h, w, b in (("student", s_hidden, s_weight, s_bias), ("teacher", t_hidden, t_weight, t_bias)):
        if h.dim() != 2 or w.dim() != 2 or w.shape[1] != h.shape[1]:
            raise ValueError(f"{side} hidden (N, D) and weight (V, D) disagree: {tuple(h.shape)}, {tuple(w.shape)}")
        if b is not None and b.shape != (w.shape[0],):
            raise ValueError(f"{side} bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    if t_hidden.shape[0] != s_hidden.shape[0]:
        raise ValueError(f"teacher_hidden has {t_hidden.shape[0]} rows, student_hidden {s_hidden.shape[0]}")
    if t_weight.shape[0] < s_weight.shape[0]:
        raise ValueError(f"teacher_weight has {t_weight.shape[0]} vocabulary rows, fewer than the student's "
                         f"{s_weight.shape[0]}")
    if backward_mode not in BACKWARD_MODES:
        raise ValueError(f"backward_mode must be one of {BACKWARD_MODES}, got {backward_mode!r}")
