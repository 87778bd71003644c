"""Per-row sorted candidate lists: built once per call in torch, walked by the kernels with one cursor per row.

Each row's valid candidate ids are sorted ascending (invalid and out-of-vocabulary slots pushed to the end as
``INT32_MAX``, which no column ever equals). A kernel finds, per row, the first entry at or after a column with a
vectorised binary search (:func:`first_at_or_after`), then walks the lists tile by tile: while any row's next id
falls inside the current vocabulary tile, every row at once handles its next candidate (:func:`next_ids`). The trip
count per tile is the largest number of candidates one row has in it (usually 0–2 at K = 64 over 1,188 tiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT32_MAX = 2**31 - 1
_SENTINEL = tl.constexpr(INT32_MAX)  # the same value, readable inside @triton.jit functions


@dataclass
class SortedCandidates:
    """Candidate ids sorted per row (all on the input device).

    Attributes:
        ids: ``(N, S)`` int32, each row ascending; ``INT32_MAX`` on invalid slots and ids outside ``[0, V)``.
        order: ``(N, S)`` int64, the slot of each sorted entry: ``ids[n, k] = original_ids[n, order[n, k]]``.
        search_steps: binary-search steps that locate any column in a row of ``S`` entries
            (``S.bit_length()``).
    """

    ids: torch.Tensor
    order: torch.Tensor
    search_steps: int

    def to_sorted(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, S)`` per-slot values in sorted order (contiguous)."""
        return x.gather(1, self.order).contiguous()

    def from_sorted(self, x_sorted: torch.Tensor) -> torch.Tensor:
        """``(N, S)`` sorted-order values back in slot order."""
        return torch.empty_like(x_sorted).scatter_(1, self.order, x_sorted)


def sort_candidates(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> SortedCandidates:
    """Sort the valid slots of ``ids`` ``(N, S)`` per row (one O(N·S log S) sort).

    ``valid`` ``(N, S)`` bool must be canonical (each id at most once per row): the kernels treat every entry as a
    distinct candidate column. Valid slots whose id lies outside ``[0, vocab_size)`` are treated as invalid (their
    logit stays 0 and they receive no gradient).
    """
    ids = ids.long()
    inside = valid & (ids >= 0) & (ids < vocab_size)
    keyed = torch.where(inside, ids, torch.full_like(ids, INT32_MAX))
    sorted_ids, order = torch.sort(keyed, dim=1, stable=True)
    return SortedCandidates(ids=sorted_ids.to(torch.int32).contiguous(), order=order.contiguous(),
                            search_steps=max(1, ids.shape[1].bit_length()))


@triton.jit
def first_at_or_after(SORTED, rows, in_rows, S, col, search_steps):
    """``(BLOCK_ROWS,)`` int32 per-row index of the first sorted id ``>= col`` (``S`` if none): a binary search
    vectorised over the rows, ``search_steps`` loads."""
    lo = tl.zeros(rows.shape, tl.int32)
    hi = tl.full(rows.shape, 0, tl.int32) + S
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        v = tl.load(SORTED + rows * S + mid, mask=in_rows & (mid < S), other=_SENTINEL)
        right = v < col
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def next_ids(SORTED, rows, in_rows, S, ptr):
    """``(BLOCK_ROWS,)`` int32: each row's sorted id at its cursor ``ptr`` (``INT32_MAX`` past the end)."""
    return tl.load(SORTED + rows * S + ptr, mask=in_rows & (ptr < S), other=_SENTINEL)
