"""Bytes and seconds per weight sync of a LoRA run: merged full weights (``lora_sync="merged"``) against the adapter
alone (``lora_sync="adapter"``), on the same tiny model, in one run.

Builds a tiny Qwen3 (``fastdistill.tiny``; ``--hidden-size``, ``--layers``, ``--intermediate-size``) with rank
``--rank`` adapters on every linear layer, and starts two real vLLM student servers side by side (vLLM from
``$FASTDISTILL_VLLM_PYTHON``): one plain (gloo weight transfer) for the merged sync, one with runtime LoRA for the
adapter sync. Each mode then makes ``--syncs`` timed syncs, each after a simulated training step (every adapter
matrix moves), and checks that the server serves the trainer's log-probs after the last one (a sync that did not
take fails the run). Reported per mode: bytes per sync (merged: the tensors sent; adapter: the tensors and the
folder on disk), median and min seconds per sync and, for the adapter, the median gather / write / load split.

    python benchmarks/bench_lora_sync.py                      # table + benchmarks/results/bench_lora_sync.json
    python benchmarks/bench_lora_sync.py --syncs 5 --hidden-size 256 --layers 4 --json /tmp/lora_sync.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from fastdistill.rollout.adapters import adapter_name
from fastdistill.serve import VLLMServer
from fastdistill.sync import (
    VLLMWeightSync,
    served_logprob_gap,
    served_sampled_logprob_gap,
    weight_manifest,
)
from fastdistill.sync.adapter import AdapterWeightSync
from fastdistill.sync.lora import merged_weights
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.lora import apply_lora

# fastdistill_testing (the test harness: at the repository root, not installed with the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastdistill_testing.vllm_server import start_together  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_lora_sync.json"
PROBES = [[1, 5, 9, 30, 7, 100, 3, 44, 2, 1, 60], list(range(3, 40))]
TOLERANCE = 1e-4  # fp32 server against the fp32 trainer


def training_step(peft_model: torch.nn.Module, seed: int) -> None:
    """Move every adapter matrix, as an optimizer step of a LoRA run does (the base weights stay)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _summary(seconds: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "syncs": len(seconds)}


def measure_merged(url: str, peft_model: torch.nn.Module, syncs: int) -> dict[str, Any]:
    """``syncs`` merged pushes (gloo, one call) into the plain server at ``url``; bytes and seconds per sync. Raises
    if the served log-probs differ from the trainer's after the last push."""
    timings = []
    with VLLMWeightSync(url, one_call=True, timeout_s=300) as sync:
        sent_bytes = sum(spec.nbytes
                         for spec in weight_manifest(merged_weights(peft_model), dtype=sync.dtype))
        for index in range(syncs):
            training_step(peft_model, seed=1000 + index)
            timings.append(sync.push(merged_weights(peft_model), index + 1)["perf/weight_sync_s"])
    gap = served_logprob_gap(url, peft_model.eval(), PROBES)
    if gap > TOLERANCE:
        raise RuntimeError(f"merged sync did not take: served log-probs differ by {gap:.2e}")
    return {"bytes": sent_bytes, **_summary(timings), "served_gap": gap}


def measure_adapter(url: str, peft_model: torch.nn.Module, adapter_dir: Path, syncs: int,
                    prefix: str = "fastdistill-bench") -> dict[str, Any]:
    """``syncs`` adapter pushes into the LoRA-enabled server at ``url`` (adapters under ``adapter_dir``, names
    ``prefix``-v<N>); bytes and seconds per sync. Raises if the newest adapter's log-probs differ from the
    trainer's after the last push."""
    rank = next(iter(peft_model.peft_config.values())).r
    sync = AdapterWeightSync(url, adapter_dir, keep_versions=2, lora_rank=rank, prefix=prefix, timeout_s=300)
    sync.init()
    metrics = []
    for index in range(syncs):
        training_step(peft_model, seed=2000 + index)
        metrics.append(sync.push(peft_model, index + 1))
    sync.close()
    name = adapter_name(syncs, prefix)
    model = peft_model.eval()
    gap = max(served_logprob_gap(url, model, PROBES, name), served_sampled_logprob_gap(url, model, PROBES, name))
    if gap > TOLERANCE:
        raise RuntimeError(f"adapter sync did not take: served log-probs differ by {gap:.2e}")
    folder = adapter_dir / f"v{syncs}"
    return {
        "bytes": int(metrics[-1]["perf/weight_sync_bytes"]),
        "folder_bytes": sum(file.stat().st_size for file in folder.iterdir()),
        **_summary([m["perf/weight_sync_s"] for m in metrics]),
        **{f"median_{part}_s": statistics.median(m[f"perf/weight_sync_{part}_s"] for m in metrics)
           for part in ("gather", "write", "load")},
        "served_gap": gap,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), hidden_size=args.hidden_size, num_layers=args.layers,
                         intermediate_size=args.intermediate_size, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    base = build_model(config, seed=0).float()
    with tempfile.TemporaryDirectory(prefix="bench-lora-sync-") as scratch:
        root = Path(scratch)
        folder = save_pretrained_dir(base, tokenizer, root / "model")
        lora_rank = min(rank for rank in (1, 8, 16, 32, 64, 128, 256, 320, 512) if rank >= args.rank)
        plain = VLLMServer(folder, role="student", weight_transfer_backend="gloo", log_path=root / "plain.log",
                           max_model_len=256)
        lora = VLLMServer(folder, role="student", weight_transfer_backend="gloo", log_path=root / "lora.log",
                          max_model_len=256, max_lora_rank=lora_rank, max_loras=2,
                          env={"VLLM_CPU_OMP_THREADS_BIND": "1"} if (os.cpu_count() or 1) > 1 else {})
        start_together(plain, lora)
        try:
            peft_model = apply_lora(copy.deepcopy(base), r=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                                    target_modules="all-linear")
            merged = measure_merged(plain.url, copy.deepcopy(peft_model), args.syncs)
            adapter = measure_adapter(lora.url, copy.deepcopy(peft_model), root / "adapters", args.syncs)
        finally:
            plain.stop()
            lora.stop()
    parameters = sum(p.numel() for p in base.parameters())
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "model": {"hidden_size": args.hidden_size, "layers": args.layers, "intermediate_size": args.intermediate_size,
                  "parameters": parameters, "lora_rank": args.rank, "dtype": "float32"},
        "merged": merged,
        "adapter": adapter,
        "bytes_ratio": merged["bytes"] / adapter["bytes"],
        "seconds_ratio": merged["median_s"] / adapter["median_s"],
    }


def print_table(result: dict[str, Any]) -> None:
    model = result["model"]
    print(f"LoRA weight sync, tiny Qwen3 ({model['parameters'] / 1e6:.2f} M parameters, hidden {model['hidden_size']}, "
          f"{model['layers']} layers), rank {model['lora_rank']} on every linear layer, fp32, "
          f"{result['merged']['syncs']} syncs per mode")
    print(f"{'mode':<10}{'bytes/sync':>14}{'median s':>12}{'min s':>10}   notes")
    merged, adapter = result["merged"], result["adapter"]
    print(f"{'merged':<10}{merged['bytes']:>14,}{merged['median_s']:>12.4f}{merged['min_s']:>10.4f}   "
          f"gloo one-call broadcast; served gap {merged['served_gap']:.1e}")
    print(f"{'adapter':<10}{adapter['bytes']:>14,}{adapter['median_s']:>12.4f}{adapter['min_s']:>10.4f}   "
          f"folder {adapter['folder_bytes']:,} B; gather {adapter['median_gather_s']:.4f} s, write "
          f"{adapter['median_write_s']:.4f} s, load {adapter['median_load_s']:.4f} s; served gap "
          f"{adapter['served_gap']:.1e}")
    print(f"merged / adapter: {result['bytes_ratio']:.1f}x the bytes, {result['seconds_ratio']:.1f}x the seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per mode")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    args = parser.parse_args()
    if args.syncs < 1 or args.rank < 1:
        parser.error("--syncs and --rank must be >= 1")
    result = run(args)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
