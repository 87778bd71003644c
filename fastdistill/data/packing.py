"""One rank's samples to one padding-free packed row, with the trained positions already selected.

Layout (S samples, sample s with prompt length P_s ≥ 1 and completion length L_s, starting at row offset o_s):
- ``input_ids`` is the samples' ``input_ids`` concatenated, T = Σ (P_s + L_s) tokens, no padding;
- ``position_ids`` restart at 0 for every sample: they carry the sample boundaries (transformers' masks and its
  flash-attention varlen path read them from there);
- completion token j of sample s sits at ``o_s + P_s + j`` and is predicted by the hidden state at
  ``o_s + P_s + j − 1``: that index is a *target position*, paired with the teacher's candidate row j.
This is the layout of TRL 1.16's ``compute_loss`` ("drop the first element, shift by one": the logits at j score
the token at j + 1, kept where the completion mask at j + 1 is set) with the untrained positions (prompts, and the
cross-sample boundary) never materialised.

A hidden-state teacher's samples carry no candidates but the teacher's final hidden states (``teacher_hidden``):
their candidate rows are empty (-1 / -inf, so the sparse loss scores none of them) and their hidden rows are kept
per teacher in ``PackedRow.teacher_hidden``, row i aligned with the i-th target whose ``teacher_index`` is that
teacher.

Student queries (``RolloutSample.query_*``, for the student-side estimators) follow the targets like the candidate
rows: ``PackedRow.query_ids`` row i holds the S query ids of the i-th target, with their rollout log-probs and the
teacher's. Every sample of a row has them (with one S) or none has; a hidden-state teacher's targets have NaN
teacher log-probs there (the trainer computes them from the teacher head), and ``query_teacher_logprobs`` is None
when no sample of the row has them.

A cross-tokenizer teacher's samples (``RolloutSample.cross_targets``: a teacher with another tokenizer) carry no
candidates either (their candidate rows are empty too) but per completion position the targets of the
cross-tokenizer losses; ``PackedRow.cross_*`` holds them row by row with the targets, joined by
:func:`~fastdistill.cross_tokenizer.concatenate_targets` (group ids unique within the row). A row may mix
them with other teachers' samples (several teachers): those targets get group -1 and empty target rows. An aligned
group with a position that is not trained (``completion_mask`` 0) is left out as a whole (group -1 on its
positions): the losses compare whole groups. ``cross_*`` are None when no sample of the row has cross targets.

The backbone must be called with these ``position_ids``, ``use_cache=False`` and NO attention mask: transformers
isolates packed samples only when it can infer them from ``position_ids`` (``masking_utils``), which it skips
when an attention mask or a cache is given (``docs/data.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cross_tokenizer import CrossTokenizerTargets, concatenate_targets
from ..loss.support import fold_out_of_vocab
from ..rollout.sample import RolloutSample, hidden_tensor


@dataclass
class PackedRow:
    """One rank's packed row. T = tokens, S = samples, M = trained targets, K+1 = candidate slots."""

    input_ids: torch.Tensor  # int64 (1, T)
    position_ids: torch.Tensor  # int64 (1, T), restarting at 0 per sample
    target_positions: torch.Tensor  # int64 (M,), t whose hidden state predicts input_ids[t+1], a completion token
    candidate_ids: torch.Tensor  # int64 (M, K+1), teacher candidates for that token, -1 = empty
    candidate_logprobs: torch.Tensor  # float32 (M, K+1), teacher log-probs (nats), -inf = empty
    actual_ids: torch.Tensor  # int64 (M,), the realised token input_ids[t+1]
    teacher_index: torch.Tensor  # int64 (M,), index into pack_row's teacher_ids
    rollout_logprobs: torch.Tensor  # float32 (M,), rollout policy's log-prob of actual_ids
    token_sample: torch.Tensor  # int64 (M,), which sample (0..S-1) each target belongs to
    model_versions: torch.Tensor  # int64 (S,), policy version each sample was generated with
    prompt_ids: list[int]  # (S,), each sample's prompt_id
    # candidates at or beyond pack_row's vocab_size, removed from candidate_ids (F = how many slots were folded)
    folded_ids: torch.Tensor  # int64 (F,), their ids
    folded_teacher: torch.Tensor  # int64 (F,), their teacher index
    # hidden-state teachers: teacher index -> (M_i, D_i) float32/bfloat16 final hidden states, row i for the i-th
    # target of that teacher (in target order); empty for top-K teachers
    teacher_hidden: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    # student queries (None without): S ids per target, the rollout policy's log-prob at each and the teacher's
    query_ids: torch.Tensor | None = None  # int64 (M, S)
    query_behaviour_logprobs: torch.Tensor | None = None  # float32 (M, S), log μ (nats)
    query_teacher_logprobs: torch.Tensor | None = None  # float32 (M, S), log π_T; NaN on hidden-teacher targets
    # cross-tokenizer targets (None without; CrossTokenizerTargets' fields per target, W = K+1 teacher slots): the
    # aligned group (unique within the row; -1 on other teachers' targets and excluded tokens), its first target
    cross_group_index: torch.Tensor | None = None  # int64 (M,)
    cross_group_start: torch.Tensor | None = None  # bool (M,)
    cross_shared_ids: torch.Tensor | None = None  # int64 (M, W), student ids of the shared teacher candidates, -1
    cross_shared_logprobs: torch.Tensor | None = None  # float32 (M, W), their teacher log-probs, -inf
    cross_unshared_logprobs: torch.Tensor | None = None  # float32 (M, K), ranked unshared teacher log-probs, -inf
    cross_continuation_logprob: torch.Tensor | None = None  # float32 (M,), log c_t at group starts, else 0
    cross_group_logprob: torch.Tensor | None = None  # float32 (M,), the group's teacher log-prob at starts, else 0
    # int64 (M,): the policy version that generated each target's token (the sample's token_versions, else its
    # model_version); None in rows built without them
    token_versions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """T, tokens forwarded."""
        return int(self.input_ids.shape[1])

    @property
    def num_samples(self) -> int:
        """S, samples packed."""
        return len(self.prompt_ids)

    @property
    def num_trained(self) -> int:
        """M, target positions (completion tokens with ``completion_mask`` 1)."""
        return int(self.target_positions.shape[0])

    def to(self, device: torch.device | str) -> PackedRow:
        """A copy with every tensor on ``device``; host-to-accelerator copies are non-blocking (asynchronous from
        pinned memory). Copies to the CPU block, so the values are ready when this returns."""
        non_blocking = torch.device(device).type != "cpu"
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        moved["teacher_hidden"] = {index: hidden.to(device, non_blocking=non_blocking)
                                   for index, hidden in self.teacher_hidden.items()}
        return dataclasses.replace(self, **moved)

    @property
    def num_cross_groups(self) -> int:
        """The aligned groups of cross-tokenizer targets in the row (0 without)."""
        return 0 if self.cross_group_start is None else int(self.cross_group_start.sum())

    def hidden_targets(self, index: int) -> torch.Tensor:
        """int64 (M_i,): the targets of teacher ``index`` (rows of ``teacher_hidden[index]`` in order)."""
        return (self.teacher_index == index).nonzero().squeeze(1)


def pack_row(samples: Sequence[RolloutSample], teacher_ids: Sequence[str], *,
             vocab_size: int | None = None) -> PackedRow:
    """Concatenate ``samples`` into one :class:`PackedRow` (layout in the module docstring).

    ``teacher_ids`` lists every teacher id in a fixed order; ``teacher_index`` refers to it. Completion positions
    whose ``completion_mask`` is 0 are forwarded but not targets (as in TRL).

    ``vocab_size``: the student's vocabulary size (its lm_head rows), or None. Teacher candidates at or beyond it
    (a teacher whose embedding is padded beyond the student's serves such ids) are folded: their slots become
    empty (-1 / -inf, see :func:`fastdistill.fold_out_of_vocab`), so their teacher mass goes to the tail bucket,
    and they are listed in ``folded_ids`` / ``folded_teacher``.

    Samples of a hidden-state teacher (``teacher_hidden`` set, no candidates) get empty candidate rows of the
    row's width and their hidden rows go to ``teacher_hidden`` (see the module docstring).

    Student queries (``query_*``) become ``PackedRow.query_*`` rows aligned with the targets (see the module
    docstring).

    Cross-tokenizer samples (``cross_targets`` set, no candidates) get empty candidate rows too and their targets
    go to ``PackedRow.cross_*`` (see the module docstring).

    Raises ValueError for an empty list, a malformed sample (array shapes or dtypes that disagree, an empty prompt,
    a prompt position marked as completion), a ``teacher_id`` not in ``teacher_ids``, candidate widths (K+1) that
    differ between top-K samples, a teacher with samples of two kinds (top-K, hidden-state, cross-tokenizer), or
    hidden widths that differ between samples of one teacher, or a trained completion token at or beyond
    ``vocab_size``; for student queries on some samples but not others, query widths (S) that differ, or a query id
    outside ``[0, vocab_size)``; and for cross targets whose widths (W, K) differ between samples or with a shared
    id outside ``[0, vocab_size)``.
    """
    if len(samples) == 0:
        raise ValueError("pack_row needs at least one sample, got an empty list")
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                   or vocab_size < 1):
        raise ValueError(f"vocab_size must be None or an int >= 1, got {vocab_size!r}")
    teacher_to_index = _teacher_index_map(teacher_ids)
    width = None
    hidden_width: dict[str, int | str | None] = {}  # teacher id -> D_t of its hidden states, "cross", None: top-K
    for s, sample in enumerate(samples):
        _check_sample(s, sample)
        if sample.teacher_id not in teacher_to_index:
            raise ValueError(
                f"sample {s} (prompt_id={sample.prompt_id}): unknown teacher_id {sample.teacher_id!r}; "
                f"known teacher ids: {list(teacher_to_index)}"
            )
        this = (int(sample.teacher_hidden.shape[1]) if sample.teacher_hidden is not None
                else "cross" if sample.cross_targets is not None else None)
        first = hidden_width.setdefault(sample.teacher_id, this)
        if first != this:
            def kind(d: int | str | None) -> str:
                return ("top-K candidates" if d is None else "cross-tokenizer targets" if d == "cross"
                        else f"hidden states of width {d}")

            raise ValueError(f"sample {s} (prompt_id={sample.prompt_id}) of teacher {sample.teacher_id!r} has "
                             f"{kind(this)}, an earlier sample of that teacher has {kind(first)}")
        if this is not None:
            continue
        sample_width = sample.teacher_topk_ids.shape[1]
        if width is None:
            width = sample_width
        elif sample_width != width:
            raise ValueError(
                f"sample {s} (prompt_id={sample.prompt_id}) has {sample_width} candidate slots per position, "
                f"sample 0 has {width}: every sample of a row needs the same K+1"
            )

    width = max(width or 0, 1)  # a row of hidden-state samples only still has one (empty) candidate slot

    lengths = np.array([sample.input_ids.shape[0] for sample in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)  # [0, o_1, ..., T]
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])

    input_ids = np.concatenate([sample.input_ids for sample in samples]).astype(np.int64)
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    prompt_lengths = np.array([sample.prompt_length for sample in samples], dtype=np.int64)
    completion_lengths = lengths - prompt_lengths
    # Row index of every completion token (sample by sample), then only those with completion_mask 1.
    completion_starts = np.zeros(len(samples), dtype=np.int64)
    np.cumsum(completion_lengths[:-1], out=completion_starts[1:])
    token_at = np.arange(int(completion_lengths.sum()), dtype=np.int64) + np.repeat(
        offsets[:-1] + prompt_lengths - completion_starts, completion_lengths
    )
    keep = np.concatenate([sample.completion_mask[sample.prompt_length :] == 1 for sample in samples])
    token_at = token_at[keep]
    token_sample = np.repeat(np.arange(len(samples), dtype=np.int64), completion_lengths)[keep]
    sample_teacher = np.array([teacher_to_index[sample.teacher_id] for sample in samples], dtype=np.int64)
    teacher_index = torch.from_numpy(sample_teacher[token_sample])
    actual_ids = torch.from_numpy(input_ids[token_at])
    candidate_ids = torch.from_numpy(
        np.concatenate([_candidates(sample, width, -1, np.int64) for sample in samples])[keep]
    )
    candidate_logprobs = torch.from_numpy(
        np.concatenate([_candidates(sample, width, -np.inf, np.float32) for sample in samples])[keep]
    )
    teacher_hidden = {}
    for teacher_id, hidden_size in hidden_width.items():
        if not isinstance(hidden_size, int):
            continue
        mine = [(hidden_tensor(sample.teacher_hidden), sample.completion_mask[sample.prompt_length :] == 1)
                for sample in samples if sample.teacher_id == teacher_id]
        teacher_hidden[teacher_to_index[teacher_id]] = torch.cat([h[torch.from_numpy(k)] for h, k in mine])
    query_ids, query_behaviour, query_teacher = _pack_queries(samples, keep, vocab_size)
    cross = _pack_cross_targets(samples, keep, vocab_size)
    folded_ids = folded_teacher = torch.zeros(0, dtype=torch.int64)
    if vocab_size is not None:
        _check_actual_ids(actual_ids, token_sample, samples, vocab_size)
        original_ids = candidate_ids
        candidate_ids, candidate_logprobs, folded = fold_out_of_vocab(candidate_ids, candidate_logprobs, vocab_size)
        folded_ids = original_ids[folded]
        folded_teacher = teacher_index[:, None].expand_as(folded)[folded]

    return PackedRow(
        input_ids=torch.from_numpy(input_ids)[None],
        position_ids=torch.from_numpy(position_ids)[None],
        target_positions=torch.from_numpy(token_at - 1),
        candidate_ids=candidate_ids,
        candidate_logprobs=candidate_logprobs,
        actual_ids=actual_ids,
        teacher_index=teacher_index,
        rollout_logprobs=torch.from_numpy(
            np.concatenate([sample.rollout_logprobs for sample in samples]).astype(np.float32)[keep]
        ),
        token_sample=torch.from_numpy(token_sample),
        model_versions=torch.tensor([int(sample.model_version) for sample in samples], dtype=torch.int64),
        prompt_ids=[int(sample.prompt_id) for sample in samples],
        folded_ids=folded_ids,
        folded_teacher=folded_teacher,
        teacher_hidden=teacher_hidden,
        query_ids=query_ids,
        query_behaviour_logprobs=query_behaviour,
        query_teacher_logprobs=query_teacher,
        token_versions=torch.from_numpy(np.concatenate([
            np.full(sample.teacher_topk_ids.shape[0], sample.model_version, np.int64) if sample.token_versions is None
            else np.asarray(sample.token_versions, np.int64) for sample in samples])[keep]),
        **cross,
    )


def _pack_cross_targets(samples: Sequence[RolloutSample], keep: np.ndarray, vocab_size: int | None
                        ) -> dict[str, torch.Tensor]:
    """The row's ``cross_*`` fields (empty dict without cross targets): every sample's targets (empty ones for the
    others) joined by :func:`concatenate_targets`, the trained positions kept, groups with an untrained position
    left out."""
    have = [sample.cross_targets for sample in samples if sample.cross_targets is not None]
    if not have:
        return {}
    shapes = {(t.shared_ids.shape[1], t.unshared_logprobs.shape[1]) for t in have}
    if len(shapes) > 1:
        raise ValueError(f"the samples' cross-tokenizer targets have different (W, K) widths {sorted(shapes)}: "
                         "every sample of a row needs the same teacher_top_k")
    (width, top_k), = shapes
    parts = [sample.cross_targets if sample.cross_targets is not None
             else _empty_cross_targets(sample.teacher_topk_ids.shape[0], width, top_k) for sample in samples]
    joined = concatenate_targets(parts)
    shared_ids = joined.shared_ids.astype(np.int64)
    if vocab_size is not None and bool((shared_ids >= vocab_size).any()):
        raise ValueError(f"a cross-tokenizer target's shared id {int(shared_ids.max())} is outside the student's "
                         f"vocabulary [0, {vocab_size}): build the vocabulary map with the student's lm_head rows")
    group = joined.group_index.astype(np.int64)
    # a group with an untrained position is left out whole (its start or its continuation would be missing)
    partial = np.unique(group[(~keep) & (group >= 0)])
    if partial.size:
        group = np.where(np.isin(group, partial), -1, group)
    start = joined.group_start & (group >= 0)
    float_fields = {"cross_shared_logprobs": joined.shared_logprobs, "cross_unshared_logprobs":
                    joined.unshared_logprobs, "cross_continuation_logprob": joined.continuation_logprob,
                    "cross_group_logprob": joined.group_logprob}
    out = {"cross_group_index": torch.from_numpy(group[keep]), "cross_group_start": torch.from_numpy(start[keep]),
           "cross_shared_ids": torch.from_numpy(np.ascontiguousarray(shared_ids[keep]))}
    out.update({name: torch.from_numpy(np.ascontiguousarray(array[keep].astype(np.float32)))
                for name, array in float_fields.items()})
    return out


def _empty_cross_targets(length: int, width: int, top_k: int) -> CrossTokenizerTargets:
    """The cross targets of a sample without any: L rows outside every group."""
    return CrossTokenizerTargets(
        group_index=np.full(length, -1, np.int32), group_start=np.zeros(length, bool),
        shared_ids=np.full((length, width), -1, np.int32), shared_logprobs=np.full((length, width), -np.inf,
                                                                                    np.float32),
        unshared_logprobs=np.full((length, top_k), -np.inf, np.float32), continuation_logprob=np.zeros(length,
                                                                                                     np.float32),
        group_logprob=np.zeros(length, np.float32))


def _pack_queries(samples: Sequence[RolloutSample], keep: np.ndarray, vocab_size: int | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The row's (M, S) query ids (int64), rollout and teacher log-probs (float32), or Nones without queries."""
    has = [sample.query_ids is not None for sample in samples]
    if not any(has):
        return None, None, None
    if not all(has):
        raise ValueError(f"samples {[s for s, h in enumerate(has) if h]} carry student queries and samples "
                         f"{[s for s, h in enumerate(has) if not h]} do not: a row needs queries on all or none "
                         "(student_queries is a run setting)")
    widths = {int(sample.query_ids.shape[1]) for sample in samples}
    if len(widths) > 1:
        raise ValueError(f"the samples' student queries have different widths {sorted(widths)}: every sample of "
                         "a row needs the same num_student_queries")
    ids = np.concatenate([sample.query_ids for sample in samples]).astype(np.int64)[keep]
    behaviour = np.concatenate([sample.query_behaviour_logprobs for sample in samples]).astype(np.float32)[keep]
    outside = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
    if outside.any():
        bad = int(ids[outside][0])
        raise ValueError(f"a student query id {bad} is outside the student's vocabulary [0, {vocab_size}): the "
                         "queries are ids of the rollout student's own distribution")
    teacher = None
    if any(sample.query_teacher_logprobs is not None for sample in samples):
        teacher = torch.from_numpy(np.concatenate([
            sample.query_teacher_logprobs if sample.query_teacher_logprobs is not None
            else np.full(sample.query_ids.shape, np.nan, np.float32) for sample in samples]).astype(np.float32)[keep])
    return torch.from_numpy(ids), torch.from_numpy(behaviour), teacher


def _candidates(sample: RolloutSample, width: int, empty: float, dtype: type) -> np.ndarray:
    """The sample's (L, width) candidate array: its own for a top-K teacher, all ``empty`` for a hidden-state or a
    cross-tokenizer one."""
    if sample.teacher_hidden is None and sample.cross_targets is None:
        array = sample.teacher_topk_ids if empty == -1 else sample.teacher_topk_logprobs
        return array.astype(dtype)
    return np.full((sample.teacher_topk_ids.shape[0], width), empty, dtype=dtype)


def _check_actual_ids(actual_ids: torch.Tensor, token_sample: np.ndarray, samples: Sequence[RolloutSample],
                      vocab_size: int) -> None:
    """The trained tokens are the student's own samples, so they must be rows of its lm_head."""
    beyond = (actual_ids >= vocab_size).nonzero()
    if beyond.numel():
        first = int(beyond[0, 0])
        sample = samples[int(token_sample[first])]
        raise ValueError(
            f"sample (prompt_id={sample.prompt_id}) has completion token {int(actual_ids[first])}, beyond the "
            f"student's vocabulary of {vocab_size} tokens (lm_head rows): the student cannot have produced it"
        )


def _teacher_index_map(teacher_ids: Sequence[str]) -> dict[str, int]:
    if isinstance(teacher_ids, str):
        raise ValueError(f"teacher_ids must be a sequence of ids, not the string {teacher_ids!r}")
    ids = list(teacher_ids)
    if not ids:
        raise ValueError("teacher_ids is empty: list every teacher id (one for a single teacher)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"teacher_ids has duplicates: {ids}")
    return {teacher_id: index for index, teacher_id in enumerate(ids)}


def _check_sample(s: int, sample: RolloutSample) -> None:
    """Shapes and dtypes that ``pack_row`` relies on; raises ValueError naming the sample."""

    def fail(message: str) -> None:
        raise ValueError(f"sample {s} (prompt_id={getattr(sample, 'prompt_id', '?')}) is malformed: {message}")

    if not isinstance(sample, RolloutSample):
        fail(f"expected a RolloutSample, got {type(sample).__name__}")
    arrays = ("input_ids", "completion_mask", "teacher_topk_ids", "teacher_topk_logprobs", "rollout_logprobs")
    for name in arrays:
        if not isinstance(getattr(sample, name), np.ndarray):
            fail(f"{name} must be a numpy array, got {type(getattr(sample, name)).__name__}")
    ids, mask, cand, lps, roll = (getattr(sample, name) for name in arrays)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        fail(f"input_ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if cand.ndim != 2 or cand.dtype.kind not in "iu":
        fail(f"teacher_topk_ids must be a 2-D (L, K+1) integer array, got {cand.dtype} {cand.shape}")
    hidden = sample.teacher_hidden
    if hidden is not None and sample.cross_targets is not None:
        fail("a sample carries teacher_hidden or cross_targets, not both (a cross-tokenizer teacher serves top-K)")
    if hidden is not None:
        if not isinstance(hidden, np.ndarray) or hidden.ndim != 2 or hidden.dtype not in (np.float32, np.uint16):
            fail("teacher_hidden must be None or a 2-D (L, D_t) float32 or uint16 (bfloat16 bits) array, got "
                 f"{getattr(hidden, 'dtype', type(hidden).__name__)} {getattr(hidden, 'shape', '')}")
        if hidden.shape[0] != cand.shape[0] or hidden.shape[1] < 1 or cand.shape[1] != 0:
            fail(f"teacher_hidden has shape {hidden.shape} for {cand.shape[0]} completion rows; a hidden-state "
                 "sample needs one row per completion token and no candidates (teacher_topk_ids (L, 0))")
    elif sample.cross_targets is not None:
        _check_cross_sample(sample, cand.shape, fail)
    elif cand.shape[1] < 1:
        fail(f"teacher_topk_ids has no candidate slots (shape {cand.shape})")
    if lps.shape != cand.shape or lps.dtype.kind != "f":
        fail(f"teacher_topk_logprobs is {lps.dtype} {lps.shape}, teacher_topk_ids is {cand.shape}; need equal shapes")
    completion_length = cand.shape[0]
    prompt_length = ids.shape[0] - completion_length
    if prompt_length < 1:
        fail(
            f"input_ids has {ids.shape[0]} tokens for {completion_length} completion rows of teacher_topk_ids; "
            "need a prompt of at least one token"
        )
    if mask.shape != ids.shape:
        fail(f"completion_mask has shape {mask.shape}, input_ids {ids.shape}")
    if not np.isin(mask, (0, 1)).all() or mask[:prompt_length].any():
        fail(f"completion_mask must be 0/1 and 0 on the {prompt_length} prompt positions")
    if roll.shape != (completion_length,):
        fail(f"rollout_logprobs has shape {roll.shape}, expected ({completion_length},)")
    queries = (sample.query_ids, sample.query_behaviour_logprobs, sample.query_teacher_logprobs)
    if queries[0] is None:
        if queries[1] is not None or queries[2] is not None:
            fail("query_behaviour_logprobs / query_teacher_logprobs are set without query_ids")
        return
    for name, array, kinds in zip(("query_ids", "query_behaviour_logprobs", "query_teacher_logprobs"), queries,
                                  ("iu", "f", "f"), strict=True):
        if name == "query_teacher_logprobs" and array is None:
            continue  # a hidden-state teacher's sample
        if (not isinstance(array, np.ndarray) or array.ndim != 2 or array.dtype.kind not in kinds
                or array.shape[0] != completion_length or array.shape[1] < 1
                or array.shape != queries[0].shape):
            fail(f"{name} must be a 2-D (L, S) {'integer' if kinds == 'iu' else 'float'} array with L = "
                 f"{completion_length} like query_ids {getattr(queries[0], 'shape', None)}, got "
                 f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}")


def _check_cross_sample(sample: RolloutSample, candidate_shape: tuple[int, ...], fail: Any) -> None:
    """A cross-tokenizer sample: no candidates, no queries, and targets with one row per completion token."""
    targets = sample.cross_targets
    length = candidate_shape[0]
    if not isinstance(targets, CrossTokenizerTargets):
        fail(f"cross_targets must be None or a CrossTokenizerTargets, got {type(targets).__name__}")
    if candidate_shape[1] != 0 or sample.query_ids is not None:
        fail(f"a cross-tokenizer sample has no candidates (teacher_topk_ids (L, 0)) and no student queries, got "
             f"teacher_topk_ids {candidate_shape}{' and query_ids' if sample.query_ids is not None else ''}")
    shapes = {name: getattr(targets, name).shape for name in (
        "group_index", "group_start", "shared_ids", "shared_logprobs", "unshared_logprobs", "continuation_logprob",
        "group_logprob")}
    width, top_k = shapes["shared_ids"][1:] or (0,), shapes["unshared_logprobs"][1:] or (0,)
    expected = {"group_index": (length,), "group_start": (length,), "shared_ids": (length, *width),
                "shared_logprobs": (length, *width), "unshared_logprobs": (length, *top_k),
                "continuation_logprob": (length,), "group_logprob": (length,)}
    wrong = {name: shape for name, shape in shapes.items() if shape != expected[name]}
    if wrong or len(shapes["shared_ids"]) != 2 or len(shapes["unshared_logprobs"]) != 2:
        fail(f"cross_targets must have {length} rows (one per completion token; (L,), (L, W) and (L, K) arrays), "
             f"got {shapes}")
