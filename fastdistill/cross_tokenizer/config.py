"""The config rules of a cross-tokenizer teacher that every config naming one follows (the rollout's
:class:`~fastdistill.rollout.RolloutConfig` and the trainer's ``AsyncDistillationConfig`` both call
:func:`check_teacher_tokenizers`; each adds the rules of its own options)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastdistill.errors import ConfigError


def check_teacher_tokenizers(teacher_tokenizers: Any, teacher_ids: Sequence[str], *, hidden_ids: Sequence[str],
                             student_queries: str, signal_option: tuple[str, Any],
                             queries_option: tuple[str, Any]) -> list[str]:
    """Check ``teacher_tokenizers`` (teacher id → the teacher's tokenizer folder) against the config's teachers.

    Args:
        teacher_tokenizers: the config's value (None or an empty mapping: no cross-tokenizer teacher).
        teacher_ids: the config's teacher ids, in configuration order.
        hidden_ids: the teachers served as hidden states.
        student_queries: what the rollout asks the student server for per position (``"none"`` or a query kind).
        signal_option / queries_option: ``(field name, value)`` of the config's options that set ``hidden_ids`` /
            ``student_queries``, for the message.

    Returns:
        The cross-tokenizer teachers, in ``teacher_ids`` order.

    Raises:
        ConfigError: naming ``teacher_tokenizers`` for a value that is not a mapping of known teacher ids to
            non-empty folder strings, and naming the other option for a hidden-state cross-tokenizer teacher (its
            hidden states feed a head over its own vocabulary) or student queries (log-probs at student token ids,
            which a teacher with another vocabulary does not score).
    """
    if teacher_tokenizers is None or (isinstance(teacher_tokenizers, Mapping) and not teacher_tokenizers):
        return []
    if not isinstance(teacher_tokenizers, Mapping):
        raise ConfigError("teacher_tokenizers must be None or a mapping of teacher id to the teacher's tokenizer "
                          f"folder, got {teacher_tokenizers!r}")
    unknown = sorted(map(str, set(teacher_tokenizers) - set(teacher_ids)))
    if unknown:
        raise ConfigError(f"teacher_tokenizers names {unknown}, which are not teachers: the teachers are "
                          f"{list(teacher_ids)}")
    for teacher_id, folder in teacher_tokenizers.items():
        if not isinstance(folder, str) or not folder:
            raise ConfigError(f"teacher_tokenizers[{teacher_id!r}] must be a tokenizer folder (a non-empty string), "
                              f"got {folder!r}")
    cross = [teacher_id for teacher_id in teacher_ids if teacher_id in teacher_tokenizers]
    hidden = [teacher_id for teacher_id in cross if teacher_id in hidden_ids]
    if hidden:
        which = (f"teacher {hidden[0]!r} is a hidden-state teacher and has its own tokenizer" if len(hidden) == 1 else
                 f"teachers {hidden} are hidden-state teachers and have their own tokenizers")
        name, value = signal_option
        raise ConfigError(f"{name} must be 'topk' for the teachers of teacher_tokenizers, got {value!r}: {which} "
                          "(teacher_tokenizers): its hidden states feed a head over its own vocabulary, not the "
                          "student's; serve it with top-K log-probs")
    if student_queries != "none":
        name, value = queries_option
        raise ConfigError(f"{name}={value!r} asks the teacher for log-probs at student token ids, which teachers "
                          f"{cross} (teacher_tokenizers) do not have: a teacher with another vocabulary scores its "
                          "own tokens")
    return cross


__all__ = ["check_teacher_tokenizers"]
