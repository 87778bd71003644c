"""What the cross-tokenizer losses need, per student completion position: the targets of one sample.

:func:`build_targets` turns one sample's teacher answer (top-K per *teacher* position, with the realised token), its
:class:`~fastdistill.cross_tokenizer.alignment.Alignment` and the
:class:`~fastdistill.cross_tokenizer.vocabulary.VocabularyMap` into compact arrays indexed by *student* position, so
they pack, batch and travel exactly like the same-tokenizer sample's ``teacher_topk_*`` arrays. Only the first
student token of each aligned group carries a distribution target (the teacher's candidates at the group's first
teacher token: both are predicted from the same text prefix); every token carries its group index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdistill.cross_tokenizer.alignment import Alignment
from fastdistill.cross_tokenizer.vocabulary import VocabularyMap


@dataclass(frozen=True)
class CrossTokenizerTargets:
    """The cross-tokenizer loss targets of one sample, per student completion position. L = student completion
    length, W = the teacher's candidate slots (K+1), K = its ranked top-K.

    Attributes:
        group_index: int32 ``(L,)``, the aligned group of each student token (0 … G−1), -1 where excluded (special
            tokens such as the trailing eos).
        group_start: bool ``(L,)``, the first student token of each group: the rows with a distribution target.
        shared_ids: int32 ``(L, W)``, at group starts the student ids of the teacher's candidates (at the group's
            first teacher token) that the student's vocabulary shares, -1 elsewhere (teacher candidates with the same
            bytes are merged into one slot, their probabilities added).
        shared_logprobs: float32 ``(L, W)``, their teacher log-probs (nats), -inf on empty slots.
        unshared_logprobs: float32 ``(L, K)``, at group starts the teacher log-probs of the unshared candidates among
            its ranked top-K, sorted descending, -inf padded (the ranked top-K's unshared members are exactly the
            teacher's most probable unshared tokens; the realised token outside the top-K is not ranked and stays out).
        continuation_logprob: float32 ``(L,)``, at group starts Σ of the teacher's log-probs of its realised tokens
            after the group's first (0 for a one-token teacher side; GOLD's "observed" merge scale), else 0.
        group_logprob: float32 ``(L,)``, at group starts Σ of the teacher's log-probs of all its realised tokens in
            the group (the group's text under the teacher), else 0.
    """

    group_index: np.ndarray
    group_start: np.ndarray
    shared_ids: np.ndarray
    shared_logprobs: np.ndarray
    unshared_logprobs: np.ndarray
    continuation_logprob: np.ndarray
    group_logprob: np.ndarray

    @property
    def num_groups(self) -> int:
        return int(self.group_start.sum())


def realised_logprobs(token_ids: np.ndarray, candidate_ids: np.ndarray, candidate_logprobs: np.ndarray) -> np.ndarray:
    """float64 ``(L,)``: the log-prob of ``token_ids[j]`` in row j of the teacher's candidates (the largest among
    matching slots); ValueError naming the first row that does not report it (the top-K wire rows always do)."""
    match = (candidate_ids == token_ids[:, None]) & np.isfinite(candidate_logprobs)
    missing = ~match.any(axis=1)
    if bool(missing.any()):
        row = int(np.argmax(missing))
        raise ValueError(f"the teacher's candidates at teacher position {row} do not include its realised token "
                         f"{int(token_ids[row])}: the cross-tokenizer targets need every realised token's log-prob")
    return np.where(match, candidate_logprobs.astype(np.float64), -np.inf).max(axis=1)


def build_targets(alignment: Alignment, teacher_ids: np.ndarray, teacher_candidate_ids: np.ndarray,
                  teacher_candidate_logprobs: np.ndarray, vocab: VocabularyMap, *, top_k: int) -> CrossTokenizerTargets:
    """The per-student-position targets of one sample.

    Args:
        alignment: the student's completion tokens ↔ the teacher's (``Ls`` and ``Lt`` tokens).
        teacher_ids: int ``(Lt,)``, the teacher's completion tokens.
        teacher_candidate_ids / teacher_candidate_logprobs: ``(Lt, W)`` the teacher's answer for them: the ranked
            top-K in slots ``< top_k``, then the realised token when it is outside the top-K; -1 / -inf empty.
            The float targets come out float32 (float64 for float64 log-probs).
        vocab: the vocabulary map. ``top_k``: K, the ranked slots (``≤ W``).

    Returns:
        :class:`CrossTokenizerTargets` with ``L = Ls`` rows.
    """
    teacher_ids = np.asarray(teacher_ids, dtype=np.int64)
    cand = np.asarray(teacher_candidate_ids, dtype=np.int64)
    lps = np.asarray(teacher_candidate_logprobs)
    out_dtype = np.float64 if lps.dtype == np.float64 else np.float32
    lps = lps.astype(np.float64)
    n_t = alignment.teacher_group.shape[0]
    if teacher_ids.shape != (n_t,) or cand.ndim != 2 or cand.shape[0] != n_t or lps.shape != cand.shape:
        raise ValueError(f"teacher arrays must be ({n_t},) ids and ({n_t}, W) candidates for the aligned teacher "
                         f"completion, got {teacher_ids.shape}, {cand.shape}, {lps.shape}")
    width = cand.shape[1]
    if not 0 < top_k <= width:
        raise ValueError(f"top_k must lie in [1, W] = [1, {width}], got {top_k}")
    if cand.size and int(cand.max()) >= vocab.teacher_vocab_size:
        raise ValueError(f"teacher candidate id {int(cand.max())} is outside the map's {vocab.teacher_vocab_size} ids: "
                         "build the map with teacher_vocab_size = the teacher model's vocabulary size (its lm_head "
                         "rows, which may exceed its tokenizer's length)")
    n_s, groups = alignment.student_group.shape[0], alignment.num_groups

    realised = realised_logprobs(teacher_ids, cand, lps)
    in_group = alignment.teacher_group >= 0
    group_lp = np.zeros(groups, dtype=np.float64)
    np.add.at(group_lp, alignment.teacher_group[in_group], realised[in_group])
    t_first, s_first = alignment.teacher_first, alignment.student_first

    rows_ids, rows_lps = cand[t_first], lps[t_first]  # (G, W): the teacher's answer at each group's first token
    usable = (rows_ids >= 0) & np.isfinite(rows_lps)
    mapped = np.where(usable, vocab.teacher_to_student[np.clip(rows_ids, 0, None)], -1)
    shared_ids, shared_lps = _merge_same_ids(mapped, np.where(mapped >= 0, rows_lps, -np.inf))
    unshared = np.where(usable & (mapped < 0), rows_lps, -np.inf)[:, :top_k]
    unshared = -np.sort(-unshared, axis=1)

    out_shared_ids = np.full((n_s, width), -1, dtype=np.int32)
    out_shared_lps = np.full((n_s, width), -np.inf, dtype=out_dtype)
    out_unshared = np.full((n_s, top_k), -np.inf, dtype=out_dtype)
    continuation = np.zeros(n_s, dtype=out_dtype)
    group_logprob = np.zeros(n_s, dtype=out_dtype)
    start = np.zeros(n_s, dtype=bool)
    start[s_first] = True
    out_shared_ids[s_first], out_shared_lps[s_first], out_unshared[s_first] = shared_ids, shared_lps, unshared
    continuation[s_first] = group_lp - realised[t_first]
    group_logprob[s_first] = group_lp
    return CrossTokenizerTargets(group_index=alignment.student_group.astype(np.int32), group_start=start,
                                 shared_ids=out_shared_ids, shared_logprobs=out_shared_lps,
                                 unshared_logprobs=out_unshared, continuation_logprob=continuation,
                                 group_logprob=group_logprob)


def _merge_same_ids(ids: np.ndarray, lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows where several slots hold the same student id (teacher tokens with the same bytes) keep it once, in its
    first slot, with the slots' probabilities added; the others become empty. Vectorised over rows."""
    ids = ids.astype(np.int32)
    if ids.size == 0:
        return ids, lps
    big = np.iinfo(np.int32).max
    keys = np.where(ids >= 0, ids, big)
    order = np.argsort(keys, axis=1, kind="stable")
    ordered = np.take_along_axis(keys, order, axis=1)
    repeat = np.zeros(ordered.shape, dtype=bool)
    repeat[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != big)
    if not repeat.any():
        return ids, lps
    rows, width = ids.shape
    flat_lps = np.take_along_axis(lps.astype(np.float64), order, axis=1).ravel()
    firsts = np.flatnonzero(~repeat.ravel())  # every segment of equal ids (row-major: segments never span rows)
    merged = np.logaddexp.reduceat(flat_lps, firsts)
    out_ids = np.full(rows * width, -1, dtype=np.int32)
    out_lps = np.full(rows * width, -np.inf, dtype=lps.dtype)
    # the stable sort puts each id's earliest slot first in its segment
    target = (firsts // width) * width + order.ravel()[firsts]
    out_ids[target] = ordered.ravel()[firsts]
    out_lps[target] = merged
    empty = out_ids == big
    out_ids[empty], out_lps[empty] = -1, -np.inf
    return out_ids.reshape(rows, width), out_lps.reshape(rows, width)


def concatenate_targets(targets: list[CrossTokenizerTargets]) -> CrossTokenizerTargets:
    """Several samples' targets as one, rows in order, group ids renumbered to stay unique (a packed row or a
    batch). The samples must share W and K."""
    if not targets:
        raise ValueError("concatenate_targets needs at least one sample's targets")
    offsets = np.cumsum([0] + [t.num_groups for t in targets[:-1]])
    group_index = np.concatenate([np.where(t.group_index >= 0, t.group_index + off, -1)
                                  for t, off in zip(targets, offsets, strict=True)]).astype(np.int32)
    fields = ("group_start", "shared_ids", "shared_logprobs", "unshared_logprobs", "continuation_logprob",
              "group_logprob")
    return CrossTokenizerTargets(group_index=group_index,
                                 **{name: np.concatenate([getattr(t, name) for t in targets]) for name in fields})
