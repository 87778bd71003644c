"""The student ↔ teacher vocabulary map and the tokenizer pair it is read from.

:class:`VocabularyMap` pairs the student and teacher token ids whose bytes coincide (special tokens excluded): the
tokens "both vocabularies share", where the loss compares probabilities directly (generalized JSD); every other
token only takes part through its probability's rank (the sorted-probability ULD loss). :class:`TokenizerPair` reads
two tokenizers once (their bytes per id and the map between them), sized by the models' vocabularies
(:func:`model_vocab_size`); :func:`load_tokenizer_pair` caches one per pair of folders in a process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fastdistill.cross_tokenizer.alignment import TokenizerBytes


@dataclass(frozen=True)
class VocabularyMap:
    """The student ↔ teacher token pairs whose bytes coincide.

    Attributes:
        teacher_to_student: int32 ``(V_t,)``, the student id with the same bytes as teacher id u, or -1.
        student_shared: bool ``(V_s,)``, the student ids some teacher id maps to.

    ``V_s`` / ``V_t`` are the vocabulary sizes the losses see (lm_head rows, which may exceed the tokenizer's length:
    the extra rows are unshared). Student ids with the same bytes: the lowest is paired; teacher ids with the same
    bytes all map to it (:func:`build_targets` adds their probabilities).
    """

    teacher_to_student: np.ndarray
    student_shared: np.ndarray

    @property
    def num_shared(self) -> int:
        """The number of shared (paired) tokens."""
        return int((self.teacher_to_student >= 0).sum())

    @property
    def teacher_vocab_size(self) -> int:
        return int(self.teacher_to_student.shape[0])

    @property
    def student_vocab_size(self) -> int:
        return int(self.student_shared.shape[0])

    @classmethod
    def from_token_bytes(cls, student: TokenizerBytes, teacher: TokenizerBytes, *,
                         student_vocab_size: int | None = None,
                         teacher_vocab_size: int | None = None) -> VocabularyMap:
        """Pair the ids of two tokenizers by bytes; ``*_vocab_size`` (default: the tokenizer's length) pads with
        unshared ids for an lm_head with more rows than the tokenizer has tokens."""
        v_s = len(student.pieces) if student_vocab_size is None else int(student_vocab_size)
        v_t = len(teacher.pieces) if teacher_vocab_size is None else int(teacher_vocab_size)
        if v_s < len(student.pieces) or v_t < len(teacher.pieces):
            raise ValueError(f"vocabulary sizes ({v_s}, {v_t}) must be at least the tokenizers' lengths "
                             f"({len(student.pieces)}, {len(teacher.pieces)})")
        by_bytes: dict[bytes, int] = {}
        for token_id, piece in enumerate(student.pieces):
            if piece:
                by_bytes.setdefault(piece, token_id)
        teacher_to_student = np.full(v_t, -1, dtype=np.int32)
        for token_id, piece in enumerate(teacher.pieces):
            if piece and piece in by_bytes:
                teacher_to_student[token_id] = by_bytes[piece]
        student_shared = np.zeros(v_s, dtype=bool)
        student_shared[teacher_to_student[teacher_to_student >= 0]] = True
        return cls(teacher_to_student=teacher_to_student, student_shared=student_shared)

    @classmethod
    def empty(cls, student_vocab_size: int, teacher_vocab_size: int) -> VocabularyMap:
        """No shared token: every token goes to the ULD term (the plain sorted-probability ULD loss)."""
        return cls(teacher_to_student=np.full(int(teacher_vocab_size), -1, dtype=np.int32),
                   student_shared=np.zeros(int(student_vocab_size), dtype=bool))

    def gold_weights(self) -> tuple[float, float]:
        """GOLD's adaptive hybrid weights ``(w_shared, w_unshared) = (n / V_t, 1 − n / V_t)``, n = shared tokens."""
        shared = self.num_shared / max(1, self.teacher_vocab_size)
        return shared, 1.0 - shared


def model_vocab_size(path: str | Path, tokenizer: Any) -> int:
    """The vocabulary size a model folder's logits have: its ``config.json``'s ``vocab_size`` (lm_head rows, which
    may exceed the tokenizer's length) when the folder has one (``text_config`` for multimodal configs), else
    ``len(tokenizer)``; never less than ``len(tokenizer)``."""
    size = len(tokenizer)
    config = Path(path) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        declared = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
        if isinstance(declared, int):
            size = max(size, declared)
    return size


@dataclass(frozen=True)
class TokenizerPair:
    """A student and a teacher tokenizer read once for cross-tokenizer distillation: their bytes per id and the
    vocabulary map between them (``vocab``, sized by the models' vocabularies). The rollout worker uses all three to
    build targets; the trainer uses ``vocab`` (``student_shared``, ``gold_weights``)."""

    student: TokenizerBytes
    teacher: TokenizerBytes
    vocab: VocabularyMap

    @classmethod
    def load(cls, student_tokenizer: Any, teacher_tokenizer: str | Path, *, student_vocab_size: int | None = None,
             trust_remote_code: bool = False) -> TokenizerPair:
        """The pair for a loaded student tokenizer and a teacher tokenizer folder (or hub id, read from the local
        cache only). The teacher's vocabulary size is :func:`model_vocab_size` of that folder; the student's is
        ``student_vocab_size`` (its lm_head rows) or its tokenizer's length."""
        from transformers import AutoTokenizer  # not at import: the torch-free rollout child imports this module

        teacher = AutoTokenizer.from_pretrained(str(teacher_tokenizer), trust_remote_code=trust_remote_code)
        student_bytes, teacher_bytes = TokenizerBytes.of(student_tokenizer), TokenizerBytes.of(teacher)
        vocab = VocabularyMap.from_token_bytes(student_bytes, teacher_bytes, student_vocab_size=student_vocab_size,
                                               teacher_vocab_size=model_vocab_size(teacher_tokenizer, teacher))
        return cls(student=student_bytes, teacher=teacher_bytes, vocab=vocab)


@lru_cache(maxsize=8)
def load_tokenizer_pair(student_tokenizer: str, teacher_tokenizer: str) -> TokenizerPair:
    """The :class:`TokenizerPair` of two tokenizer folders, read once per process (evaluation waves reuse it). The
    student's vocabulary size is its folder's model vocabulary (:func:`model_vocab_size`), as the teacher's."""
    from transformers import AutoTokenizer  # not at import: the torch-free rollout child imports this module

    student = AutoTokenizer.from_pretrained(student_tokenizer)
    return TokenizerPair.load(student, teacher_tokenizer,
                              student_vocab_size=model_vocab_size(student_tokenizer, student))
