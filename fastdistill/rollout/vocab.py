"""Startup check that every teacher tokenizes like the student, so candidate ids mean the same tokens (a teacher
with its own tokenizer: like that tokenizer, which the worker aligns its completions with).

TRL never checks this: a teacher with another tokenizer silently trains the student on wrong tokens.
Probing the servers' ``/tokenize`` with varied text (ASCII, digits, code, accents, CJK, emoji, chat
markers) catches a different vocabulary or merge table before any sample is generated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from fastdistill.errors import VocabularyMismatchError
from fastdistill.rollout.client import StudentClient, TeacherClient

PROBE_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "def main():\n    return {'key': [1, 2, 3]}\n",
    "Ünïcödé wörds: café, naïve, Straße, façade.",
    "中文字符和日本語のテキスト",
    "emoji 🙂🚀 and symbols ∑ ∫ ≤ ≥",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
)


async def check_shared_vocabulary(
    student: StudentClient,
    teachers: Mapping[str, TeacherClient],
    probes: Sequence[str] = PROBE_TEXTS,
    teacher_tokenizers: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`VocabularyMismatchError` naming the first teacher whose tokenization of a probe text
    differs from the student's; return None when every teacher agrees on every probe.

    A teacher in ``teacher_tokenizers`` (teacher id -> its own loaded tokenizer: a cross-tokenizer teacher) is
    compared with that tokenizer instead (``add_special_tokens=False``, as ``/tokenize`` is asked): the worker
    renders and aligns its completions with it, so the server must tokenize exactly as it does."""
    own = dict(teacher_tokenizers or {})
    expected = await asyncio.gather(*(student.tokenize(text) for text in probes))
    for teacher_id, teacher in teachers.items():
        got = await asyncio.gather(*(teacher.tokenize(text) for text in probes))
        local = own.get(teacher_id)
        wants = expected if local is None else [list(local(text, add_special_tokens=False)["input_ids"])
                                                for text in probes]
        for text, want, have in zip(probes, wants, got, strict=True):
            if want == have:
                continue
            shown = (f"{text!r} tokenizes to {have[:12]}{'…' if len(have) > 12 else ''} on the teacher but "
                     f"{want[:12]}{'…' if len(want) > 12 else ''}")
            if local is None:
                raise VocabularyMismatchError(
                    f"teacher {teacher_id!r} ({teacher.base_url}) does not share the student's vocabulary "
                    f"({student.base_url}): {shown} on the student. Distillation compares token ids, so teacher "
                    "and student must use the same tokenizer (or give the teacher its own in teacher_tokenizers)."
                )
            raise VocabularyMismatchError(
                f"teacher {teacher_id!r} ({teacher.base_url}) does not tokenize like its own tokenizer "
                f"({getattr(local, 'name_or_path', '?')!r}, teacher_tokenizers): {shown} with that tokenizer. The "
                "worker aligns the teacher's tokens with that tokenizer, so it must be the served model's."
            )
