"""Host-side index of the candidates that fall in each (row block, vocabulary tile) of the kernels' grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass
class CandidateCSR:
    """Candidates grouped by tile: tile ``t = row_block · n_vocab_tiles + vocab_tile`` owns entries
    ``offsets[t] : offsets[t + 1]`` of ``rows``, ``cols`` and ``slots`` (all int32 on the input device).

    Attributes:
        offsets: ``(n_row_blocks · n_vocab_tiles + 1,)`` start of each tile's entries.
        rows: ``(nnz,)`` row of each candidate. cols: ``(nnz,)`` its vocabulary id. slots: ``(nnz,)`` its slot.
        n_vocab_tiles: vocabulary tiles per row block.
    """

    offsets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor
    n_vocab_tiles: int


def build_candidate_csr(ids: torch.Tensor, valid: torch.Tensor, block_rows: int, block_vocab: int,
                        vocab_size: int) -> CandidateCSR:
    """Bucket the valid slots of ``ids`` ``(N, S)`` by tile with one sort: O(N·S) work.

    ``valid`` ``(N, S)`` bool must be canonical (each id at most once per row): the kernels treat every entry as
    a distinct candidate column.
    """
    n_row_blocks, n_vocab_tiles = triton.cdiv(ids.shape[0], block_rows), triton.cdiv(vocab_size, block_vocab)
    row, slot = valid.nonzero(as_tuple=True)
    col = ids[row, slot].long()
    tile = (row // block_rows) * n_vocab_tiles + col // block_vocab
    order = torch.argsort(tile, stable=True)
    counts = torch.bincount(tile, minlength=n_row_blocks * n_vocab_tiles)
    offsets = torch.zeros(n_row_blocks * n_vocab_tiles + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    return CandidateCSR(offsets=offsets, rows=row[order].int(), cols=col[order].int(), slots=slot[order].int(),
                        n_vocab_tiles=n_vocab_tiles)
