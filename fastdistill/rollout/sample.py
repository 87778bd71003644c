"""What one rollout produces: the prompt, the student's completion and the teacher's candidates for it.

Field names follow TRL 1.16's ``RolloutSample`` (its async distillation trainer's sample) where they exist, with two
layout changes that keep the pickled sample small: token arrays are int32 (not int64), and the teacher arrays cover
completion positions only (TRL pads every prompt row with -1 / -inf). :meth:`RolloutSample.to_trl_layout` rebuilds
TRL's full-length int64 layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from fastdistill.cross_tokenizer import CrossTokenizerTargets
    from fastdistill.rollout.client import Generation, TeacherScores
    from fastdistill.rollout.hidden import TeacherHiddenStates


@dataclass(slots=True)
class RolloutSample:
    """One scored rollout. P = prompt length, L = completion length, K = teacher top-K.

    - ``input_ids``: int32 (P+L,), prompt ids then completion ids.
    - ``completion_mask``: int32 (P+L,), 0 on prompt positions, 1 on completion positions.
    - ``teacher_topk_ids`` / ``teacher_topk_logprobs``: int32 / float32 (L, K+1). Row j holds the teacher's
      candidates for completion token j (``input_ids[P+j]``): top-K by rank, then the realised token when it is
      outside the top-K; empty slots are -1 / -inf. Log-probs are natural logs.
      A hidden-state teacher (``teacher_hidden`` set) gives no candidates: both arrays are (L, 0).
    - ``teacher_hidden``: None for a top-K teacher; for a hidden-state teacher (L, D_t), row j the teacher's final
      hidden state that predicts completion token j: float32, or uint16 holding bfloat16 bit patterns (numpy has no
      bfloat16; :func:`hidden_tensor` views them as a torch bfloat16 tensor).
    - ``rollout_logprobs``: float32 (L,), the student server's log-prob of each sampled completion token.
    - ``prompt``: the dataset row's ``prompt`` entry when it has one (for logging), else None.
    - ``completion``: decoded completion text; None here (the worker has no tokenizer).
    - ``model_version``: the policy version read when the rollout was dispatched.
    - ``generation_started_at`` / ``generation_ended_at``: wall-clock seconds (``time.time()``) the student's request
      was sent and answered; None where no student generated (a cache row).
    - ``token_versions``: None, or int64 (L,), the policy version that generated each completion token: the served
      weight-version spans' (``RolloutConfig.student_route="generate"``: :func:`token_versions_from_spans`), else
      the trainer derives it from the versions served while the request ran
      (:meth:`~fastdistill.train.staleness.PolicySteps.token_versions`); None reads as ``model_version`` for every
      token.
    - ``prompt_id``: position in the worker's (epoch, shuffled order) stream; resuming at ``start_index=prompt_id``
      dispatches this row again. ``dataset_index``: the row's index in the dataset.
    - ``enqueued_at``: wall-clock seconds (``time.time()``) of the put into the sample queue.
    - ``query_ids`` / ``query_behaviour_logprobs`` / ``query_teacher_logprobs``: None, or int32 / float32 / float32
      (L, S) for the student-side estimators (``RolloutConfig.student_queries``): row j holds S ids for completion
      position j (draws from the rollout policy μ with the realised token in column 0, or the rollout student's
      top-S), log μ at them (the distribution the student server sampled from) and the teacher's log π_T at them.
      A hidden-state teacher gives no log-probs at the query ids: its samples keep ``query_teacher_logprobs`` None
      and the trainer computes log π_T at the query ids from the teacher head on ``teacher_hidden``.
    - ``cross_targets``: None, or for a teacher with its own tokenizer the
      :class:`~fastdistill.cross_tokenizer.CrossTokenizerTargets` of the completion (L rows, per student
      position); such a sample's ``teacher_topk_ids`` / ``teacher_topk_logprobs`` are (L, 0), like a hidden-state
      teacher's, and it carries no ``teacher_hidden`` and no queries.
    """

    input_ids: np.ndarray
    completion_mask: np.ndarray
    teacher_topk_ids: np.ndarray
    teacher_topk_logprobs: np.ndarray
    rollout_logprobs: np.ndarray
    model_version: int
    teacher_id: str
    prompt_id: int
    dataset_index: int
    prompt: Any = None
    completion: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    enqueued_at: float | None = None
    teacher_hidden: np.ndarray | None = None
    query_ids: np.ndarray | None = None
    query_behaviour_logprobs: np.ndarray | None = None
    query_teacher_logprobs: np.ndarray | None = None
    cross_targets: CrossTokenizerTargets | None = None
    generation_started_at: float | None = None
    generation_ended_at: float | None = None
    token_versions: np.ndarray | None = None

    @classmethod
    def assemble(cls, prompt_ids: Sequence[int] | np.ndarray, generation: Generation,
                 scores: TeacherScores | TeacherHiddenStates | CrossTokenizerTargets, *,
                 model_version: int, teacher_id: str, prompt_id: int, dataset_index: int,
                 prompt: Any = None) -> RolloutSample:
        """The sample of one rollout: the prompt, the student's :class:`Generation` and the teacher's
        :class:`TeacherScores` (or a hidden-state teacher's :class:`TeacherHiddenStates`) of it, plus where it
        came from.

        With student queries (``generation.query_ids`` set, (L, S)) the sample carries them with their rollout
        log-probs and, from a top-K teacher, the teacher's log-probs at them (``scores.query_logprobs``, (L, S));
        a hidden-state teacher's samples leave ``query_teacher_logprobs`` None (the trainer's teacher head gives
        them). A teacher with its own tokenizer gives the sample's :class:`CrossTokenizerTargets` (L rows) as
        ``scores``: the sample carries them in ``cross_targets`` and (L, 0) candidate arrays. Raises ValueError for
        arrays whose shapes disagree, or a top-K teacher's scores without query log-probs for a generation with
        queries (or with them for one without)."""
        prompt_array = np.asarray(prompt_ids, dtype=np.int32)
        length = generation.token_ids.shape[0]
        hidden = getattr(scores, "hidden", None)
        cross = scores if hasattr(scores, "group_start") else None  # CrossTokenizerTargets (no import here)
        if cross is not None:
            if cross.group_index.shape[0] != length:
                raise ValueError(f"the cross-tokenizer targets have {cross.group_index.shape[0]} rows for {length} "
                                 "completion tokens")
            candidate_ids, logprobs = np.zeros((length, 0), np.int32), np.zeros((length, 0), np.float32)
        elif hidden is not None:
            if hidden.shape[0] != length:
                raise ValueError(f"the teacher's hidden states have {hidden.shape[0]} rows for {length} completion "
                                 "tokens")
            candidate_ids, logprobs = np.zeros((length, 0), np.int32), np.zeros((length, 0), np.float32)
        else:
            candidate_ids, logprobs = scores.candidate_ids, scores.logprobs
        query_ids, behaviour, teacher = _queries(generation, scores, length, hidden is not None or cross is not None)
        return cls(
            input_ids=np.concatenate([prompt_array, generation.token_ids]),
            completion_mask=np.concatenate([np.zeros(prompt_array.shape[0], np.int32), np.ones(length, np.int32)]),
            teacher_topk_ids=candidate_ids,
            teacher_topk_logprobs=logprobs,
            rollout_logprobs=generation.logprobs,
            model_version=model_version,
            teacher_id=teacher_id,
            prompt_id=prompt_id,
            dataset_index=dataset_index,
            prompt=prompt,
            teacher_hidden=None if hidden is None else hidden_array(hidden),
            query_ids=query_ids,
            query_behaviour_logprobs=behaviour,
            query_teacher_logprobs=teacher,
            cross_targets=cross,
        )

    @property
    def prompt_length(self) -> int:
        """P, the number of prompt tokens."""
        return int(self.input_ids.shape[0] - self.teacher_topk_ids.shape[0])

    @property
    def completion_ids(self) -> np.ndarray:
        """int32 (L,), the sampled completion tokens."""
        return self.input_ids[self.prompt_length :]

    def to_trl_layout(self) -> dict[str, np.ndarray]:
        """TRL's full-length arrays (top-K teachers only): int64 ``input_ids`` / ``completion_mask`` (P+L,), int64
        ``teacher_topk_ids`` and float32 ``teacher_topk_logprobs`` (P+L, K+1) whose P prompt rows are -1 / -inf."""
        prompt_length = self.prompt_length
        width = self.teacher_topk_ids.shape[1]
        ids = np.full((prompt_length + self.teacher_topk_ids.shape[0], width), -1, dtype=np.int64)
        logprobs = np.full(ids.shape, -np.inf, dtype=np.float32)
        ids[prompt_length:] = self.teacher_topk_ids
        logprobs[prompt_length:] = self.teacher_topk_logprobs
        return {
            "input_ids": self.input_ids.astype(np.int64),
            "completion_mask": self.completion_mask.astype(np.int64),
            "teacher_topk_ids": ids,
            "teacher_topk_logprobs": logprobs,
        }


def _queries(generation: Generation, scores: Any, length: int,
             hidden_teacher: bool) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The sample's (query ids int32, log μ float32, log π_T float32 or None) (L, S) each, or three Nones; checked."""
    ids, behaviour = generation.query_ids, generation.query_logprobs
    teacher = getattr(scores, "query_logprobs", None)
    if ids is None and behaviour is None:
        if teacher is not None:
            raise ValueError("the teacher's scores carry query log-probs for a generation without query ids")
        return None, None, None
    if ids is None or behaviour is None or ids.ndim != 2 or behaviour.shape != ids.shape or ids.shape[0] != length:
        raise ValueError(f"the generation's query_ids {getattr(ids, 'shape', None)} and query_logprobs "
                         f"{getattr(behaviour, 'shape', None)} must both be (L, S) for its {length} tokens")
    if teacher is None and not hidden_teacher:
        raise ValueError(f"the teacher's scores carry no log-probs at the {ids.shape[1]} query ids per position "
                         "(score them with TeacherClient.score(..., query_ids=...))")
    if teacher is not None and teacher.shape != ids.shape:
        raise ValueError(f"the teacher's query log-probs have shape {teacher.shape}, the query ids {ids.shape}")
    return (ids.astype(np.int32, copy=False), behaviour.astype(np.float32, copy=False),
            None if teacher is None else teacher.astype(np.float32, copy=False))


def hidden_array(hidden: torch.Tensor) -> np.ndarray:
    """A (L, D) float32 or bfloat16 CPU tensor as the numpy array :class:`RolloutSample` keeps: float32 as is,
    bfloat16 as uint16 bit patterns (which pickle as plain bytes between processes)."""
    import torch  # not at the top: the rollout worker's child imports this module and must start without torch

    hidden = hidden.detach().cpu().contiguous()
    if hidden.dtype == torch.bfloat16:
        return hidden.view(torch.int16).numpy().view(np.uint16).copy()
    if hidden.dtype != torch.float32:
        raise ValueError(f"teacher hidden states must be float32 or bfloat16, got {hidden.dtype}")
    return hidden.numpy().copy()


def hidden_tensor(array: np.ndarray) -> torch.Tensor:
    """The torch tensor of a :class:`RolloutSample`'s ``teacher_hidden``: float32, or bfloat16 from uint16 bits."""
    import torch  # torch-free module (see hidden_array)

    if array.dtype == np.uint16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    if array.dtype != np.float32:
        raise ValueError(f"teacher_hidden must be float32 or uint16 (bfloat16 bits), got {array.dtype}")
    return torch.from_numpy(np.ascontiguousarray(array))


def token_versions_from_spans(spans: Sequence[tuple[str, int, int]], model_version: int) -> np.ndarray:
    """int64 (L,): each output token's policy version from the generate route's weight-version spans
    (``(label, start, end)``, contiguous from 0). A weight sync labels its version ``str(version)``; a label that is
    not an integer (vLLM's initial ``"default"``: weights no sync of this run replaced, the base model under LoRA
    adapters) reads as ``model_version``, the version the request was dispatched on."""
    versions = np.empty(spans[-1][2] if spans else 0, dtype=np.int64)
    for label, start, end in spans:
        versions[start:end] = int(label) if label.lstrip("-").isdigit() else model_version
    return versions
