"""The cross-tokenizer tests' tokenizers; they live in :mod:`fastdistill.testing.cross_tokenizer` (with the
offline sample builder), re-exported here for the test modules that import them by this name."""

from fastdistill.testing.cross_tokenizer import (
    TEACHER_CHAT_TEMPLATE,
    TEACHER_CORPUS,
    TEACHER_SPECIAL,
    TEXTS,
    lossy_tokenizer,
    sentencepiece_tokenizer,
    student_tokenizer,
    teacher_tokenizer,
)

__all__ = ["TEACHER_CHAT_TEMPLATE", "TEACHER_CORPUS", "TEACHER_SPECIAL", "TEXTS", "lossy_tokenizer",
           "sentencepiece_tokenizer", "student_tokenizer", "teacher_tokenizer"]
