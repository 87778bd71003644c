"""Candidate support: TRL's β-dependent narrowing and the canonical (deduplicated) slot mask."""

from __future__ import annotations

import torch


def narrow_support(
    candidate_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    actual_ids: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the candidate support a generalized JSD with coefficient ``beta`` is computed over.

    Args:
        candidate_ids: ``(..., W)`` integer, the teacher's rank-sorted candidates per position (slot 0 is the
            teacher's top-1), padded with -1. With the TRL wire protocol W = K+1: the top-K plus the realised
            token when it is outside the top-K.
        teacher_logprobs: ``(..., W)`` float, the teacher's log-probs of those candidates (nats).
        actual_ids: ``(...)`` integer, the realised (sampled) token at each position.
        beta: in [0, 1].

    Returns:
        ``(ids, logprobs, mask)``, each ``(..., S)``:

        - β = 0: S = W, the whole row (top-K ∪ realised), mask = ``ids != -1``;
        - 0 < β < 1: S = 2, ``[teacher top-1, realised]``; the realised slot is valid only when the teacher
          reported it and is masked when it equals the top-1 (counted once);
        - β = 1: S = 1, ``[realised]``, valid only when the teacher reported it.

        The realised token's teacher log-prob is the largest reported one among matching valid slots.
    """
    _check_beta(beta)
    if candidate_ids.shape != teacher_logprobs.shape:
        raise ValueError(
            f"teacher_logprobs must have the shape of candidate_ids {tuple(candidate_ids.shape)}, "
            f"got {tuple(teacher_logprobs.shape)}"
        )
    if candidate_ids.dim() < 1 or actual_ids.shape != candidate_ids.shape[:-1]:
        raise ValueError(
            f"actual_ids must have shape {tuple(candidate_ids.shape[:-1])} (candidate_ids without its last "
            f"dimension), got {tuple(actual_ids.shape)}"
        )
    if candidate_ids.is_floating_point() or candidate_ids.is_complex() or candidate_ids.dtype == torch.bool:
        raise ValueError(f"candidate_ids must be an integer tensor, got {candidate_ids.dtype}")
    if actual_ids.is_floating_point() or actual_ids.is_complex() or actual_ids.dtype == torch.bool:
        raise ValueError(f"actual_ids must be an integer tensor, got {actual_ids.dtype}")
    if not teacher_logprobs.is_floating_point():
        raise ValueError(f"teacher_logprobs must be a floating-point tensor, got {teacher_logprobs.dtype}")
    if candidate_ids.shape[-1] == 0:
        raise ValueError("candidate_ids must have at least one candidate slot (last dimension is 0)")

    valid_wide = candidate_ids != -1
    if beta == 0.0:
        return candidate_ids, teacher_logprobs, valid_wide

    actual = actual_ids.to(candidate_ids.dtype).unsqueeze(-1)
    matches = (candidate_ids == actual) & valid_wide
    neg_inf = torch.tensor(float("-inf"), dtype=teacher_logprobs.dtype, device=teacher_logprobs.device)
    actual_lp = torch.where(matches, teacher_logprobs, neg_inf).amax(dim=-1, keepdim=True)
    actual_valid = matches.any(dim=-1, keepdim=True)
    if beta == 1.0:
        return actual, actual_lp, actual_valid

    ids = torch.cat([candidate_ids[..., :1], actual], dim=-1)
    lps = torch.cat([teacher_logprobs[..., :1], actual_lp], dim=-1)
    same = ids[..., 1:] == ids[..., :1]
    mask = torch.cat([valid_wide[..., :1], actual_valid & ~same], dim=-1)
    return ids, lps, mask


def fold_out_of_vocab(
    candidate_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Remove the candidates the student cannot produce: ids at or beyond ``vocab_size`` (the student's lm_head
    rows), as served by a teacher whose embedding is padded beyond the student's.

    Their slots become empty (id -1, log-prob -inf), so the loss never sees them; with ``add_tail_bucket=True``
    their teacher mass lands in the teacher's tail bucket (the tail is 1 − Σ of the remaining candidates), without
    it the remaining candidates are renormalised as usual. Apply it before :func:`narrow_support`: a folded
    top-1 leaves β in (0, 1) with the realised token only.

    Args:
        candidate_ids: ``(..., W)`` integer candidate ids, -1 = empty slot.
        teacher_logprobs: ``(..., W)`` float, their teacher log-probs (nats).
        vocab_size: the student's vocabulary size V (int >= 1).

    Returns:
        ``(ids, logprobs, folded)``: copies of the inputs with the folded slots emptied, and the ``(..., W)`` bool
        mask of the folded slots. The inputs are returned unchanged (no copy) when nothing is folded.
    """
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if candidate_ids.shape != teacher_logprobs.shape:
        raise ValueError(
            f"teacher_logprobs must have the shape of candidate_ids {tuple(candidate_ids.shape)}, "
            f"got {tuple(teacher_logprobs.shape)}"
        )
    if candidate_ids.is_floating_point() or candidate_ids.is_complex() or candidate_ids.dtype == torch.bool:
        raise ValueError(f"candidate_ids must be an integer tensor, got {candidate_ids.dtype}")
    if not teacher_logprobs.is_floating_point():
        raise ValueError(f"teacher_logprobs must be a floating-point tensor, got {teacher_logprobs.dtype}")
    folded = candidate_ids >= vocab_size
    if not bool(folded.any()):
        return candidate_ids, teacher_logprobs, folded
    ids = candidate_ids.masked_fill(folded, -1)
    logprobs = teacher_logprobs.masked_fill(folded, float("-inf"))
    return ids, logprobs, folded


def canonical_mask(ids: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The slots that take part in the loss: ``(N, S)`` bool.

    A slot counts when its mask is set, its id is not -1 and its teacher log-prob is finite (-inf means the
    teacher gives the token no mass, which the tail already accounts for). A repeated id counts once: its
    first qualifying slot wins and later ones are masked.
    """
    valid = mask & (ids >= 0) & torch.isfinite(teacher_logprobs)
    if ids.shape[-1] < 2:
        return valid
    # Sort each row by id (invalid slots pushed past every real id), then drop a slot whose id equals its
    # predecessor's. A stable sort keeps the earliest slot first among equal ids.
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(valid, ids.long(), torch.full_like(ids, big, dtype=torch.long))
    sorted_ids, order = torch.sort(keyed, dim=-1, stable=True)
    repeat = torch.zeros_like(valid)
    repeat[..., 1:] = sorted_ids[..., 1:] == sorted_ids[..., :-1]
    is_repeat = torch.zeros_like(valid).scatter_(-1, order, repeat)
    return valid & ~is_repeat


def _check_beta(beta: float) -> None:
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not (0.0 <= float(beta) <= 1.0):
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
