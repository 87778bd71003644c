"""Teacher cache size: bytes on disk per completion token, by K, for a small and a large vocabulary.

For each vocabulary (32000: uint16 ids; 151936, Qwen's: int32 ids) and K in {8, 32, 128}, synthetic rows (prompt
and completion lengths drawn uniformly; candidates drawn at random, the realised token outside the top-K at half
the positions) are encoded by ``fastdistill.cache.score.encode_shard`` and written as real safetensors shards of
``--rows-per-shard`` rows; the figure is the shards' total size on disk (headers included; the JSON records and
the manifest, a few hundred bytes per shard, are not counted) divided by the completion tokens they hold. The
layout is fixed-width, so the figure does not depend on the values drawn, only on the lengths: about
(K + 1) * (id bytes + log-prob bytes) per completion token, plus the prompt and completion ids themselves spread
over the completion tokens.

Sampled-mode rows (``--candidates sampled``, S in {4, 12, 32}) are measured the same way: S slots of id, uint8
count and float16 teacher log-prob per completion token, about S * (id bytes + 3), every slot counted (the layout
pads to S whether or not the draws repeat).

DistillKit's published figures for its compressed top-K logit format are printed alongside: about 300 bytes per
token at K = 128, about 114 at its budget setting.

Scoring throughput against a real teacher server, and training from a cache against online training (speed and
held-out result), are measured by ``benchmarks/bench_cache_train.py``.

    python benchmarks/bench_cache.py                         # table + benchmarks/results/bench_cache.json
    python benchmarks/bench_cache.py --rows 200 --json /tmp/bench_cache.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from fastdistill.cache.format import CacheSettings, id_dtype_for, write_safetensors
from fastdistill.cache.sampled import SampledScores
from fastdistill.cache.score import CompletionRow, encode_shard
from fastdistill.rollout.decode import TeacherScores

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_cache.json"
TOP_KS = (8, 32, 128)
NUM_SAMPLES = (4, 12, 32)
VOCAB_SIZES = (32000, 151936)
DISTILLKIT_BYTES_PER_TOKEN = {"K=128, compressed": 300, "budget setting": 114}


def synthetic_rows(count: int, vocab_size: int, top_k: int, prompt_lengths: tuple[int, int],
                   completion_lengths: tuple[int, int], seed: int) -> tuple[list[CompletionRow], list[TeacherScores]]:
    """``count`` rows with uniform lengths (inclusive ranges) and their (L, K+1) candidates in the scorer's layout."""
    rng = np.random.default_rng(seed)
    rows, scores = [], []
    for index in range(count):
        prompt = rng.integers(0, vocab_size, rng.integers(prompt_lengths[0], prompt_lengths[1] + 1)).tolist()
        completion = rng.integers(0, vocab_size, rng.integers(completion_lengths[0], completion_lengths[1] + 1))
        ids = rng.integers(0, vocab_size, (len(completion), top_k + 1)).astype(np.int32)
        inside = rng.random(len(completion)) < 0.5  # the realised token in the top-K: its extra slot is empty
        ids[inside, top_k] = -1
        logprobs = -np.sort(rng.exponential(2.0, (len(completion), top_k + 1)), axis=1).astype(np.float32)
        logprobs[inside, top_k] = -np.inf
        rows.append(CompletionRow(index, prompt, completion.tolist()))
        scores.append(TeacherScores(ids, logprobs))
    return rows, scores


def sampled_scores(rows: list[CompletionRow], vocab_size: int, num_samples: int, seed: int) -> list[SampledScores]:
    """(L, S) sampled candidates for ``rows``: S draws per position from a random peaked distribution, merged."""
    rng = np.random.default_rng(seed)
    scores = []
    for row in rows:
        length = len(row.completion_ids)
        draws = np.minimum(rng.geometric(0.3, (length, num_samples)) - 1, vocab_size - 1)  # repeats, like a teacher
        ids = np.full((length, num_samples), -1, np.int32)
        counts = np.zeros((length, num_samples), np.uint8)
        for position, drawn in enumerate(draws):
            values, found = np.unique(drawn, return_counts=True)
            ids[position, : len(values)], counts[position, : len(values)] = values, found
        logprobs = np.where(ids >= 0, -rng.exponential(2.0, ids.shape), -np.inf).astype(np.float32)
        scores.append(SampledScores(ids, counts, logprobs))
    return scores


def measure(vocab_size: int, top_k: int, rows: int, rows_per_shard: int, prompt_lengths: tuple[int, int],
            completion_lengths: tuple[int, int], seed: int, num_samples: int | None = None) -> dict[str, float]:
    """Bytes on disk per completion token (and per token) of ``rows`` synthetic rows written as shards: top-K
    candidates, or ``num_samples`` sampled ones (then ``top_k`` is ignored)."""
    sampled = {} if num_samples is None else dict(num_samples=num_samples, proposal_temperature=1.0, seed=seed)
    settings = CacheSettings(teacher_model="synthetic", tokenizer_fingerprint="-", vocab_size=vocab_size,
                             top_k=0 if sampled else top_k, candidate_mode="sampled" if sampled else "topk",
                             id_dtype=id_dtype_for(vocab_size), logprob_dtype="float16",
                             rows_per_shard=rows_per_shard, dataset_rows=rows, **sampled)
    all_rows, all_scores = synthetic_rows(rows, vocab_size, max(top_k, 1), prompt_lengths, completion_lengths, seed)
    if sampled:
        all_scores = sampled_scores(all_rows, vocab_size, num_samples, seed)
    total_bytes = completion_tokens = tokens = 0
    with tempfile.TemporaryDirectory() as folder:
        for shard in range(settings.num_shards):
            start, stop = settings.row_range(shard)
            arrays = encode_shard(all_rows[start:stop], all_scores[start:stop], settings)
            path = Path(folder) / f"shard-{shard:05d}.safetensors"
            write_safetensors(path, arrays, {"shard": str(shard)})
            total_bytes += path.stat().st_size
            completion_tokens += arrays["candidate_ids"][1].shape[0]
            tokens += arrays["input_ids"][1].shape[0]
    slot_bytes = np.dtype(settings.id_dtype).itemsize + 2 + (1 if sampled else 0)
    return {"vocab_size": vocab_size, "id_dtype": settings.id_dtype,
            **({"num_samples": num_samples} if sampled else {"top_k": top_k}), "rows": rows,
            "completion_tokens": completion_tokens, "tokens": tokens, "bytes": total_bytes,
            "bytes_per_completion_token": total_bytes / completion_tokens,
            "candidate_bytes_per_completion_token": settings.candidate_width * slot_bytes}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--rows-per-shard", type=int, default=128)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--completion-lengths", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    results = [measure(vocab, k, args.rows, args.rows_per_shard, tuple(args.prompt_lengths),
                       tuple(args.completion_lengths), args.seed) for vocab in VOCAB_SIZES for k in TOP_KS]
    print(f"{'vocab':>8} {'ids':>6} {'K':>4} {'bytes/completion token':>23} {'of which candidates':>20}")
    for entry in results:
        print(f"{entry['vocab_size']:>8} {entry['id_dtype']:>6} {entry['top_k']:>4} "
              f"{entry['bytes_per_completion_token']:>23.1f} {entry['candidate_bytes_per_completion_token']:>20}")
    sampled = [measure(vocab, 0, args.rows, args.rows_per_shard, tuple(args.prompt_lengths),
                       tuple(args.completion_lengths), args.seed, num_samples=s) for vocab in VOCAB_SIZES
               for s in NUM_SAMPLES]
    print(f"{'vocab':>8} {'ids':>6} {'S':>4} {'bytes/completion token':>23} {'of which candidates':>20}  (sampled)")
    for entry in sampled:
        print(f"{entry['vocab_size']:>8} {entry['id_dtype']:>6} {entry['num_samples']:>4} "
              f"{entry['bytes_per_completion_token']:>23.1f} {entry['candidate_bytes_per_completion_token']:>20}")
    print("DistillKit (published): " + ", ".join(f"{name}: ~{value} bytes/token"
                                                 for name, value in DISTILLKIT_BYTES_PER_TOKEN.items()))
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
              "settings": {key: value if not isinstance(value, Path) else str(value) for key, value in
                           vars(args).items()},
              "logprob_dtype": "float16", "results": results, "sampled_results": sampled,
              "distillkit_bytes_per_token": DISTILLKIT_BYTES_PER_TOKEN}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
