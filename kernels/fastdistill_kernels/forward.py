"""Forward kernel: per-row log-sum-exps (all / non-candidate columns), entropy and candidate logits.

Grid ``(vocabulary split, row block)``, the split on the fast axis. Each program walks its split's vocabulary
tiles, recomputes the logits tile ``h @ Wᵀ`` in fp32 and folds it into online statistics. Each split writes its
partials to ``(N, splits)`` buffers and a small torch epilogue merges them: no locks, no atomics, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .candidates import SortedCandidates, first_at_or_after, next_ids
from .config import TileConfig, dot_precision, interpreting, vocab_splits
from .tiles import logit_tile

MAX_GRID_Y = 65535  # CUDA's limit on grid axes 1 and 2


@triton.jit(do_not_specialize=["first_row_block"])
def _forward_kernel(H, W, B, SORTED_IDS, Z_SORTED, PART_MAX, PART_SUM, PART_ENT, PART_MAX_NC, PART_SUM_NC,
                    N, V, D, S, search_steps, n_vocab_tiles, tiles_per_split, n_splits, first_row_block,
                    logit_scale, softcap, inv_temp,
                    BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    # The vocabulary split is the fast grid axis: the programs resident at a time cover a few row blocks (their
    # hidden states stay in L2) × every split, rather than every row block of one split (all of H cycling L2).
    # More row blocks than grid axis 1 takes (65,535) are launched in slabs starting at first_row_block.
    split = tl.program_id(0)
    row_block = first_row_block + tl.program_id(1)
    rows = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    in_rows = rows < N
    neg_inf = float("-inf")
    # Online statistics, shifted by the running max m: s = Σ e^(z−m), t = Σ e^(z−m)·(z−m).
    m = tl.full((BLOCK_ROWS,), neg_inf, tl.float32)
    s = tl.zeros((BLOCK_ROWS,), tl.float32)
    t = tl.zeros((BLOCK_ROWS,), tl.float32)
    m_nc = tl.full((BLOCK_ROWS,), neg_inf, tl.float32)
    s_nc = tl.zeros((BLOCK_ROWS,), tl.float32)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, n_vocab_tiles)
    # Per-row cursor into the sorted candidate ids: the first one in this split, then advanced tile by tile.
    ptr = first_at_or_after(SORTED_IDS, rows, in_rows, S, first_tile * BLOCK_VOCAB, search_steps)
    nxt = next_ids(SORTED_IDS, rows, in_rows, S, ptr)
    offs_v = tl.arange(0, BLOCK_VOCAB)
    for tile in range(first_tile, last_tile):
        cols = (tile * BLOCK_VOCAB + offs_v).to(tl.int64)
        z = logit_tile(H, W, B, rows, cols, N, V, D, logit_scale, softcap, inv_temp,
                       BLOCK_ROWS, BLOCK_VOCAB, BLOCK_D, HAS_BIAS, HAS_SOFTCAP, UPCAST, DOT_PRECISION)
        in_vocab = cols[None, :] < V
        z = tl.where(in_vocab, z, neg_inf)

        m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: every tile holds at least one in-vocabulary column
        rescale = tl.exp(m - m_new)
        y = tl.where(in_vocab, z - m_new[:, None], 0.0)
        e = tl.where(in_vocab, tl.exp(y), 0.0)
        t = rescale * (t + tl.where(s > 0, m - m_new, 0.0) * s) + tl.sum(e * y, axis=1)
        s = rescale * s + tl.sum(e, axis=1)
        m = m_new

        # Candidates of this tile, one per row per trip: read each row's next candidate logit from the tile
        # (stored in sorted order), then mask its column out of the non-candidate statistics.
        tile_start = tile * BLOCK_VOCAB
        hit = nxt < tile_start + BLOCK_VOCAB  # ids are >= tile_start: earlier ones were consumed by earlier tiles
        while tl.max(hit.to(tl.int32), axis=0) > 0:
            match = offs_v[None, :] == (nxt - tile_start)[:, None]
            tl.store(Z_SORTED + rows * S + ptr, tl.sum(tl.where(match, z, 0.0), axis=1), mask=hit)
            z = tl.where(match, neg_inf, z)
            ptr += hit.to(tl.int32)
            nxt = next_ids(SORTED_IDS, rows, in_rows, S, ptr)
            hit = nxt < tile_start + BLOCK_VOCAB

        m_nc_new = tl.maximum(m_nc, tl.max(z, axis=1))
        shift_nc = tl.where(m_nc_new == neg_inf, 0.0, m_nc_new)  # a row whose columns so far are all candidates
        s_nc = s_nc * tl.exp(m_nc - shift_nc) + tl.sum(tl.exp(z - shift_nc[:, None]), axis=1)
        m_nc = m_nc_new

    out = rows * n_splits + split
    tl.store(PART_MAX + out, m, mask=in_rows)
    tl.store(PART_SUM + out, s, mask=in_rows)
    tl.store(PART_ENT + out, t, mask=in_rows)
    tl.store(PART_MAX_NC + out, m_nc, mask=in_rows)
    tl.store(PART_SUM_NC + out, s_nc, mask=in_rows)


@dataclass
class RowStats:
    """Per-row results of the forward pass (fp32, on the input device).

    Attributes:
        z_cand: ``(N, S)`` candidate logits (0 on invalid slots).
        lse: ``(N,)`` log-sum-exp of the logits over the vocabulary.
        m_nc, s_nc: ``(N,)`` max over the non-candidate columns (0 when there are none) and Σ exp(z − m_nc) over
            them; lse_nc = m_nc + log s_nc.
        entropy: ``(N,)`` full-vocabulary student entropy (nats).
    """

    z_cand: torch.Tensor
    lse: torch.Tensor
    m_nc: torch.Tensor
    s_nc: torch.Tensor
    entropy: torch.Tensor

    @property
    def lse_nc(self) -> torch.Tensor:
        """``(N,)`` log-sum-exp over the non-candidate columns (−inf for a row whose candidates are all of V)."""
        return self.m_nc + torch.log(self.s_nc)


def forward_stats(hidden, weight, bias, cands: SortedCandidates, *, logit_scale: float, softcap: float | None,
                  temperature: float, cfg: TileConfig) -> RowStats:
    """Run the forward kernel over ``hidden`` ``(N, D)`` and ``weight`` ``(V, D)`` (same dtype, contiguous) with
    ``bias`` ``(V,)`` or None and the per-row sorted candidates ``cands``, and merge the vocabulary splits."""
    n, d = hidden.shape
    v = weight.shape[0]
    n_slots = cands.ids.shape[1]
    dev = hidden.device
    n_row_blocks = triton.cdiv(n, cfg.block_rows)
    n_vocab_tiles = triton.cdiv(v, cfg.block_vocab)
    splits, tiles_per_split = vocab_splits(cfg, n_row_blocks, n_vocab_tiles, dev)
    z_sorted = torch.zeros(n, n_slots, dtype=torch.float32, device=dev)
    parts = [torch.empty(n, splits, dtype=torch.float32, device=dev) for _ in range(5)]
    part_max, part_sum, part_ent, part_max_nc, part_sum_nc = parts
    for first in range(0, n_row_blocks, MAX_GRID_Y):  # one launch unless there are more than 65,535 row blocks
        _forward_kernel[(splits, min(n_row_blocks - first, MAX_GRID_Y))](
            hidden, weight, bias, cands.ids, z_sorted, part_max, part_sum, part_ent, part_max_nc, part_sum_nc,
            n, v, d, n_slots, cands.search_steps, n_vocab_tiles, tiles_per_split, splits, first,
            float(logit_scale), 1.0 if softcap is None else float(softcap), 1.0 / float(temperature),
            BLOCK_ROWS=cfg.block_rows, BLOCK_VOCAB=cfg.block_vocab, BLOCK_D=cfg.block_d,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, UPCAST=interpreting(),
            DOT_PRECISION=dot_precision(hidden.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    # Merge the splits. Every split saw at least one column, so part_max is finite.
    m = part_max.amax(dim=1)
    scale = torch.exp(part_max - m[:, None])
    s = (part_sum * scale).sum(dim=1)
    t = (scale * (part_ent + (part_max - m[:, None]) * part_sum)).sum(dim=1)
    m_nc = part_max_nc.amax(dim=1)
    m_nc = torch.where(torch.isfinite(m_nc), m_nc, torch.zeros_like(m_nc))
    s_nc = (part_sum_nc * torch.exp(part_max_nc - m_nc[:, None])).sum(dim=1)
    return RowStats(z_cand=cands.from_sorted(z_sorted), lse=m + torch.log(s), m_nc=m_nc, s_nc=s_nc,
                    entropy=torch.log(s) - t / s)
