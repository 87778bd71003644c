"""A teacher with another tokenizer (a cross-tokenizer teacher): what the rollout, the packer, the loss and the
trainer share, below all of them (numpy and the tokenizers only: no torch, no servers).

- :mod:`~fastdistill.cross_tokenizer.alignment`: token bytes, byte spans, aligned groups, the teacher's rendering.
- :mod:`~fastdistill.cross_tokenizer.vocabulary`: the vocabulary map between the two and the tokenizer pair.
- :mod:`~fastdistill.cross_tokenizer.targets`: the per-student-position targets the losses read.
- :mod:`~fastdistill.cross_tokenizer.config`: the config rules both configs check.

The rollout's scoring step is :mod:`fastdistill.rollout.cross_scoring`, the losses
:mod:`fastdistill.loss.cross_losses`, the trainer's side :mod:`fastdistill.train.cross_teachers`
(docs/cross_tokenizer.md).
"""

from fastdistill.cross_tokenizer.alignment import (
    Alignment,
    StudentCompletion,
    TeacherSequence,
    TokenizerBytes,
    align_byte_spans,
    byte_offsets_from_char_offsets,
    render_teacher_sequence,
    spans_from_token_bytes,
    student_completion_spans,
    teacher_completion_ids,
    teacher_prompt_ids,
)
from fastdistill.cross_tokenizer.config import check_teacher_tokenizers
from fastdistill.cross_tokenizer.targets import (
    CrossTokenizerTargets,
    build_targets,
    concatenate_targets,
    realised_logprobs,
)
from fastdistill.cross_tokenizer.vocabulary import TokenizerPair, VocabularyMap, load_tokenizer_pair, model_vocab_size

__all__ = [
    "Alignment",
    "CrossTokenizerTargets",
    "StudentCompletion",
    "TeacherSequence",
    "TokenizerBytes",
    "TokenizerPair",
    "VocabularyMap",
    "align_byte_spans",
    "build_targets",
    "byte_offsets_from_char_offsets",
    "check_teacher_tokenizers",
    "concatenate_targets",
    "load_tokenizer_pair",
    "model_vocab_size",
    "realised_logprobs",
    "render_teacher_sequence",
    "spans_from_token_bytes",
    "student_completion_spans",
    "teacher_completion_ids",
    "teacher_prompt_ids",
]
