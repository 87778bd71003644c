"""The teacher's scoring answer on the wire: the scoring plugin's compact reply against stock ``prompt_logprobs`` JSON.

Per (K, L, P), one body of each kind for the same scores, side by side in one run:

- ``stock``: ``prompt_logprobs=K`` as vLLM's OpenAI server sends it (bench_worker_ceiling.py's construction: one
  ``{token_id_str: {"logprob", "rank", "decoded_token"}}`` object per sequence token, prompt rows included, K + 1
  entries where the realised token is outside the top-K), decoded by the client's msgspec path
  (:func:`~fastdistill.rollout.decode.scores_from_body`, prompt rows skipped);
- ``compact``: the plugin's answer (:mod:`fastdistill.scoring_wire`: one base64 float32 matrix, completion rows
  only) with the same top-K and realised tokens and no query ids, decoded by
  :func:`~fastdistill.rollout.decode.scores_from_compact_body`;
- ``compact+S``: the same plus S query log-probs per row (what the student-query estimators ask for).

Bytes per scored position (the whole body over L) and the client's decode CPU time (``time.process_time``, median of
rounds) in µs per scored position. ``compact`` is checked to decode to exactly the stock answer's TeacherScores, and
``compact+S`` to carry the query log-probs it was built with. No server is needed: the bodies are constructed.

    python benchmarks/bench_scoring_reply.py                          # K = 8, 32, 128; L = 1024, P = 256
    python benchmarks/bench_scoring_reply.py --top-k 8 --lengths 16 --prompt-lengths 8 --min-round-s 0.01
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_worker_ceiling import cpu_s_per_call, machine, teacher_body  # noqa: E402

from fastdistill.rollout.decode import scores_from_body, scores_from_compact_body  # noqa: E402
from fastdistill.scoring_wire import FIXED_COLUMNS, REPLY_FIELD, reply, row_width  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_scoring_reply.json"


def compact_body(stock: bytes, prompt_length: int, top_k: int, query_logprobs: np.ndarray | None) -> bytes:
    """The plugin's answer carrying the scores of the stock answer ``stock`` (its completion rows), plus
    ``query_logprobs`` float32 (L, S) when given, in the same envelope."""
    body = json.loads(stock)
    choice = body["choices"][0]
    rows = choice.pop("prompt_logprobs")[prompt_length:]
    num_queries = 0 if query_logprobs is None else query_logprobs.shape[1]
    matrix = np.zeros((len(rows), row_width(top_k, num_queries)), dtype=np.float32)
    ids = matrix.view(np.int32)
    for row, entry in enumerate(rows):
        candidates = [(int(token), value["logprob"], value["rank"]) for token, value in entry.items()]
        realised = candidates[0]  # vLLM lists the realised token first
        ranked = sorted(candidates[1:] if len(candidates) > top_k else candidates, key=lambda item: item[2])
        matrix[row, 0], ids[row, 1] = realised[1], realised[2]
        matrix[row, FIXED_COLUMNS:FIXED_COLUMNS + top_k] = [logprob for _, logprob, _ in ranked]
        ids[row, FIXED_COLUMNS + top_k:FIXED_COLUMNS + 2 * top_k] = [token for token, _, _ in ranked]
    if query_logprobs is not None:
        matrix[:, FIXED_COLUMNS + 2 * top_k:] = query_logprobs
    choice["prompt_logprobs"] = None
    choice[REPLY_FIELD] = reply(matrix, top_k, num_queries)
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def bench_row(top_k: int, completion_length: int, prompt_length: int, num_queries: int,
              min_round_s: float) -> dict[str, Any]:
    """Body bytes and decode µs per scored position of each kind for one (K, L, P)."""
    stock, sequence = teacher_body(prompt_length, completion_length, top_k)
    realised = np.asarray(sequence[prompt_length:], dtype=np.int32)
    queries = (-8 * np.random.default_rng(1).random((completion_length, num_queries))).astype(np.float32)
    bodies = {"stock": stock, "compact": compact_body(stock, prompt_length, top_k, None),
              f"compact+{num_queries}": compact_body(stock, prompt_length, top_k, queries)}
    decoders = {
        "stock": lambda body: scores_from_body("bench", body, prompt_length, completion_length, top_k),
        "compact": lambda body: scores_from_compact_body("bench", body, realised, top_k, 0),
        f"compact+{num_queries}": lambda body: scores_from_compact_body("bench", body, realised, top_k, num_queries),
    }
    reference = decoders["stock"](stock)
    row: dict[str, Any] = {"top_k": top_k, "completion_length": completion_length, "prompt_length": prompt_length,
                           "num_queries": num_queries, "bytes_per_position": {}, "us_per_position": {}, "agrees": {}}
    for name, decode in decoders.items():
        scores = decode(bodies[name])
        agrees = (np.array_equal(scores.candidate_ids, reference.candidate_ids)
                  and np.array_equal(scores.logprobs, reference.logprobs))
        if name.startswith("compact+"):
            agrees = agrees and np.array_equal(scores.query_logprobs, queries)
        row["agrees"][name] = bool(agrees)
        row["bytes_per_position"][name] = len(bodies[name]) / completion_length
        seconds = cpu_s_per_call(lambda d=decode, b=bodies[name]: d(b), min_round_s)
        row["us_per_position"][name] = seconds / completion_length * 1e6
    print(f"  K={top_k} L={completion_length} P={prompt_length}: "
          + ", ".join(f"{name} {row['bytes_per_position'][name]:.0f} B {row['us_per_position'][name]:.2f} µs"
                      for name in decoders) + " per position", flush=True)
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    names = list(rows[0]["us_per_position"])
    print("\nTeacher scoring answer per scored position: body bytes and client decode CPU µs")
    print("| K | L | P | " + " | ".join(f"{name} B" for name in names) + " | "
          + " | ".join(f"{name} µs" for name in names) + " | stock / compact µs | agree |")
    print("|---:|---:|---:|" + "---:|" * (2 * len(names)) + "---:|:---:|")
    for row in rows:
        size, cost = row["bytes_per_position"], row["us_per_position"]
        print(f"| {row['top_k']} | {row['completion_length']} | {row['prompt_length']} | "
              + " | ".join(f"{size[name]:.0f}" for name in names) + " | "
              + " | ".join(f"{cost[name]:.2f}" for name in names)
              + f" | {cost['stock'] / cost['compact']:.1f}x | {'yes' if all(row['agrees'].values()) else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-k", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024], help="completion lengths")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[256],
                        help="prompt lengths, one per completion length")
    parser.add_argument("--num-queries", type=int, default=8, help="S, query ids per position of compact+S")
    parser.add_argument("--min-round-s", type=float, default=0.3, help="CPU seconds per timing round (3 rounds)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    args = parser.parse_args()
    if len(args.prompt_lengths) != len(args.lengths):
        parser.error("give one prompt length per completion length")
    rows = [bench_row(top_k, length, prompt, args.num_queries, args.min_round_s)
            for top_k in args.top_k for length, prompt in zip(args.lengths, args.prompt_lengths, strict=True)]
    print_table(rows)
    result = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
