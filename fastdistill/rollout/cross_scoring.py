"""The scoring step of a rollout whose teacher has its own tokenizer (a cross-tokenizer teacher).

The student generated token ids in its vocabulary; the teacher cannot score those ids. So, per rollout:

1. :func:`~fastdistill.cross_tokenizer.render_teacher_sequence`: the row's conversation through the teacher's chat
   template (a string prompt: tokenized as it is), the completion's text (the student's tokens without its special
   tokens) tokenized by the teacher, and the byte-offset alignment of the two tokenizations into groups;
2. the teacher's own length limit: teacher prompt + completion + the one token a scoring request asks for must fit
   the teacher server's ``max_model_len`` (known from ``GET /v1/models``, asked once per client);
3. :meth:`~fastdistill.rollout.TeacherClient.score` of the teacher's ids, top-K per teacher position;
4. :func:`~fastdistill.cross_tokenizer.build_targets`: what the loss needs per student position.

A rollout that fails 1 or 2 raises :class:`UnscorableRollout` with its drop reason (``unaligned`` / ``too_long``):
a property of that completion (a completion cut inside a multi-byte character, text the teacher's normaliser
changes), so the rollout becomes a drop notice and does not count as a server's rejection.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdistill.cross_tokenizer import (
    CrossTokenizerTargets,
    TokenizerPair,
    build_targets,
    load_tokenizer_pair,
    render_teacher_sequence,
)
from fastdistill.errors import AlignmentError
from fastdistill.rollout import dropped as drop_reasons


class UnscorableRollout(Exception):
    """A rollout a cross-tokenizer teacher cannot score: ``reason`` (a drop reason of
    :mod:`fastdistill.rollout.dropped`) and a ``message`` saying why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class CrossTokenizerScorer:
    """Scores the student's completions with one cross-tokenizer teacher.

    ``pair``: the two tokenizers' bytes and vocabulary map; ``top_k``: K (the targets are K + 1 wide);
    ``chat_template_kwargs``: passed to the teacher's chat template."""

    pair: TokenizerPair
    top_k: int
    chat_template_kwargs: Mapping[str, Any] | None = None

    async def score(self, client: Any, prompt: Any, completion_ids: np.ndarray) -> tuple[CrossTokenizerTargets,
                                                                                          dict[str, float]]:
        """The targets of one completion (student ids, int (L,)) for the row's ``prompt`` (chat messages or a
        string), scored by ``client`` (a :class:`~fastdistill.rollout.TeacherClient`), and the metrics
        ``rollout/teacher_tokens`` (the teacher's completion length) and ``rollout/align_s`` (seconds spent
        rendering, aligning and building the targets, the request excluded).

        Raises:
            UnscorableRollout: ``unaligned`` (no prompt to render, or an :class:`AlignmentError`), ``too_long``
                (the teacher's rendering does not fit its ``max_model_len``).
            VLLMError: the teacher's request failed.
        """
        started = time.monotonic()
        if prompt is None:
            raise UnscorableRollout(drop_reasons.UNALIGNED,
                                    "the row has no 'prompt' (chat messages or a string) to render for a teacher with "
                                    "its own tokenizer: prompt_ids alone are the student's tokens")
        try:
            sequence = render_teacher_sequence(self.pair.student, self.pair.teacher, prompt, completion_ids,
                                               chat_template_kwargs=self.chat_template_kwargs)
        except AlignmentError as error:
            raise UnscorableRollout(drop_reasons.UNALIGNED, str(error)) from error
        rendered = time.monotonic()
        teacher_length = int(sequence.completion_ids.shape[0])
        needed = len(sequence.prompt_ids) + teacher_length + 1  # the scoring request asks for one more token
        limit = (await client.served_model()).max_model_len
        if needed > limit:
            raise UnscorableRollout(drop_reasons.TOO_LONG,
                                    f"the teacher's rendering needs {needed} tokens > max_model_len={limit} (its "
                                    f"prompt {len(sequence.prompt_ids)} + completion {teacher_length} + 1)")
        scores = await client.score(sequence.prompt_ids, sequence.completion_ids, top_k=self.top_k)
        answered = time.monotonic()
        targets = build_targets(sequence.alignment, sequence.completion_ids, scores.candidate_ids, scores.logprobs,
                                self.pair.vocab, top_k=self.top_k)
        align_s = (rendered - started) + (time.monotonic() - answered)
        return targets, {"rollout/teacher_tokens": float(teacher_length), "rollout/align_s": align_s}


def cross_tokenizer_scorers(config: Any) -> dict[str, CrossTokenizerScorer]:
    """One :class:`CrossTokenizerScorer` per teacher of ``config.teacher_tokenizers`` (a
    :class:`~fastdistill.rollout.RolloutConfig`), tokenizers read from their folders (once per process)."""
    return {teacher_id: CrossTokenizerScorer(load_tokenizer_pair(str(config.student_tokenizer), str(folder)),
                                             top_k=config.teacher_top_k,
                                             chat_template_kwargs=config.chat_template_kwargs)
            for teacher_id, folder in (config.teacher_tokenizers or {}).items()}


__all__ = ["CrossTokenizerScorer", "UnscorableRollout", "cross_tokenizer_scorers"]
