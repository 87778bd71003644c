"""Startup check that every teacher tokenizes like the student, so candidate ids mean the same tokens.

TRL never checks this: a teacher with another tokenizer silently trains the student on wrong tokens.
Probing the servers' ``/tokenize`` with varied text (ASCII, digits, code, accents, CJK, emoji, chat
markers) catches a different vocabulary or merge table before any sample is generated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

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
) -> None:
    """Raise :class:`VocabularyMismatchError` naming the first teacher whose tokenization of a probe text
    differs from the student's; return None when every teacher agrees on every probe."""
    expected = await asyncio.gather(*(student.tokenize(text) for text in probes))
    for teacher_id, teacher in teachers.items():
        got = await asyncio.gather(*(teacher.tokenize(text) for text in probes))
        for text, want, have in zip(probes, expected, got, strict=True):
            if want != have:
                raise VocabularyMismatchError(
                    f"teacher {teacher_id!r} ({teacher.base_url}) does not share the student's vocabulary "
                    f"({student.base_url}): {text!r} tokenizes to {have[:12]}{'…' if len(have) > 12 else ''} "
                    f"on the teacher but {want[:12]}{'…' if len(want) > 12 else ''} on the student. Distillation "
                    "compares token ids, so teacher and student must use the same tokenizer."
                )
