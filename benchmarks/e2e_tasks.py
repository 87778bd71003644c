"""The tasks of benchmarks/bench_e2e.py: question/answer pairs, the completion horizon and the teacher's training.

``short``: "What is A plus B?" → "A+B=C." (A, B in 0..29), about 8 completion tokens. ``long``: "What is A plus B?
Count on." → "A+B=C. C+1 C+2 … C+128.": the answer is stated in the first tokens and a long deterministic
continuation follows from it. The task's byte-level BPE (515 entries) spells numbers digit by digit, so an answer is
about 450 tokens and the 160-token horizon cuts every completion: the trained and the held-out completions are 160
tokens long, the answer in their first ≈ 9. Both split 900 questions into 256 training and 32 held-out ones by
``seed``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One benchmark task: its pairs' builder and the settings that depend on the completion length."""

    name: str
    max_completion_length: int  # the training horizon and the held-out evaluation's (full) horizon
    vocab_size: int  # upper bound of the byte-level BPE tokenizer trained on the task's text
    teacher_steps: int  # default steps of the teacher's fine-tuning (build_models)
    teacher_batch: int  # pairs packed in one row per step of it (a row's attention is quadratic in its length)
    count_on: int  # numbers counted on after the answer (0: the answer alone)
    # every contender's learning rate (linear decay): at 1e-3 every trainer's held-out jsd on the long task falls for
    # about 20 steps and then blows up (sync 0.73 at step 12, 3.24 at step 40); at 3e-4 it falls at every snapshot
    learning_rate: float = 1e-3

    def answer(self, a: int, b: int) -> str:
        c = a + b
        head = f"{a}+{b}={c}."
        if not self.count_on:
            return head
        return head + " " + " ".join(str(c + i) for i in range(1, self.count_on + 1)) + "."

    def question(self, a: int, b: int) -> str:
        return f"What is {a} plus {b}?" + (" Count on." if self.count_on else "")

    def pairs(self, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(training pairs, held-out pairs): 256 and 32 of the 900 questions, shuffled by ``seed``."""
        pairs = [(self.question(a, b), self.answer(a, b)) for a in range(30) for b in range(30)]
        random.Random(seed).shuffle(pairs)
        return pairs[:256], pairs[256:288]


TASKS = {
    "short": Task("short", max_completion_length=32, vocab_size=400, teacher_steps=400, teacher_batch=32, count_on=0),
    "long": Task("long", max_completion_length=160, vocab_size=640, teacher_steps=400, teacher_batch=8,
                 count_on=128, learning_rate=3e-4),
}
