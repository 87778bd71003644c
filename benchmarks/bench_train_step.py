"""Training step on a GPU: the trainer's real step at the Qwen2.5-0.5B and -1.5B shapes, its cost split, its MFU,
its floor, and its correctness, in one offline run.

Per shape (random weights from the published configs, float32 master weights, bf16 compute as the trainer runs on a
GPU) and per K in ``--top-ks`` and loss backend in ``--backends`` (``auto`` and ``torch`` by default, in the same
run): ``AsyncDistillationTrainer`` trains from a teacher cache written in this process (a synthetic peaked bigram
teacher, completions of 512-2048 tokens packed into rows of ``token_budget`` tokens), and hooks time each step's
phases (backbone forward, the loss's forward + backward, the backbone's backward, the optimizer; the rest is the
step's wall clock minus those: cache reading, packing, gradient clipping, bookkeeping). It reports the step time,
trained tokens/s, the step's useful FLOPs (``fastdistill.train.flops``) as MFU against the datasheet's dense bf16 peak
and against a bf16 matmul rate measured in the same run, peak memory, the loss's share of the step, and the floor: a
plain causal-LM cross-entropy step on the same packed rows with the same model and optimizer (the ratio; the aim is
≤ 1.10×). Beside them, the loss alone at the step's trained positions with float32 inputs (float32 hidden states from
the last norm and the float32 master lm_head, which the trainer casts to bf16 before the loss) and with bf16 inputs.

Correctness, in the same run: the first configuration trains ``--loss-steps`` (20) steps and must lower the loss
(the mean of its last three steps below its first); a packed row's hidden states with the attention the trainer picks
(SDPA where flash-attn is absent) match each sample run alone within a derived bf16 bound, and the same with
``flash_attention_2`` when flash-attn is importable (skipped with the reason otherwise).

Guards (a GPU run): peak memory may grow at most ``PEAK_MEMORY_BOUND`` and the MFU against the measured rate may
fall at most ``MFU_BOUND`` against the last recorded GPU run of the same device and shape in
``benchmarks/train_step_baseline.json`` (``--record`` writes this run there); with no record yet it says so and
passes. The exit status is 1 when a correctness check or a guard fails.

    python benchmarks/bench_train_step.py                      # a CUDA machine: both shapes, K = 8 and 32
    python benchmarks/bench_train_step.py --tiny               # the CPU rehearsal: a tiny Qwen2, same code path
    python benchmarks/bench_train_step.py --predict            # the predicted cost split on an H200 (no GPU needed)

The trainer runs as it does on several GPUs: one rank in a process group this script creates (NCCL on a GPU, gloo in
the CPU rehearsal), the student FSDP2-sharded over it (bf16 parameters in compute, fp32 reductions), and the floor's
model sharded the same way. ``--no-group`` runs one plain process instead (autocast bf16, no FSDP2). Every
configuration and the floor start from the same random weights (a model built anew for each).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_parts import (  # noqa: E402
    SHAPES,
    WORKLOADS,
    CrossEntropyModel,
    PhaseTimer,
    build_model,
    cross_entropy_step,
    loss_input_dtypes,
    packed_attention_check,
    write_teacher_cache,
)
from train_step_predict import TOP_K_SHAPES, predicted_step_ms, prediction_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "bench_train_step.json"
BASELINE = ROOT / "benchmarks" / "train_step_baseline.json"
PEAK_MEMORY_BOUND = 1.10  # a shape's peak memory may grow by at most 10 % against the recorded GPU run
MFU_BOUND = 0.85  # its MFU against the measured matmul rate may fall by at most 15 %
FLOOR_AIM = 1.10  # a distillation step should cost at most this much more than the cross-entropy step
GPU_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
LOSS_STEPS = 20
WARMUP_STEPS = 1
MEASURED_STEPS = 3
LEARNING_RATE = 3e-4
PACKED_LENGTHS = {"gpu": [700, 1, 1300, 257], "tiny": [7, 1, 12, 5]}


# ------------------------------------------------------------------------------------------------ one configuration
def trainer_config(name: str, cache: Path, output: Path, backend: str, steps: int, workload: Any) -> Any:
    from fastdistill.train.config import AsyncDistillationConfig

    return AsyncDistillationConfig(
        model_name_or_path=f"in-process/{name}", output_dir=str(output), teacher_cache=str(cache),
        teacher_server_urls={"default": "http://127.0.0.1:9"}, vllm_server_base_url="http://127.0.0.1:9",
        max_steps=steps, token_budget=workload.token_budget, max_completion_length=workload.completion[1],
        loss_backend=backend, learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant", gradient_checkpointing=False, logging_steps=1, disable_tqdm=True,
        save_strategy="no", export_final_model=False)


def run_trainer(model: Any, tokenizer: Any, config: Any, device: torch.device, capture_rows: int = 0) -> dict:
    """Train ``config.max_steps`` steps with the trainer; per step its logged record and its phases (seconds), the
    peak memory (GiB, CUDA), the trainer's FLOPs model, and the packed rows of the last ``capture_rows`` steps."""
    from fastdistill.logit_head import causal_lm_parts
    from fastdistill.train import AsyncDistillationTrainer

    records: list[dict[str, float]] = []
    rows: list[Any] = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = AsyncDistillationTrainer(config, model=model, tokenizer=tokenizer,
                                       on_step_end=lambda step, logged: records.append(dict(logged)))
    timer = PhaseTimer(device)
    backbone, _ = causal_lm_parts(trainer.hf_model)
    timer.attach(trainer.model, backbone, trainer.hf_model.get_input_embeddings(), trainer.optimizer,
                 on_row=rows.append if capture_rows else None)
    try:
        trainer.train()
    finally:
        timer.detach()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    phases = [timer.phases(i) for i in range(len(timer.steps))]
    if len(records) != len(phases):
        raise RuntimeError(f"{len(records)} logged steps but {len(phases)} timed ones (logging_steps must be 1)")
    result = {"records": records, "phases": phases, "peak_gib": peak, "flops_model": trainer.mfu.flops_model,
              "rows": rows[-capture_rows:] if capture_rows else [], "autocast": trainer.train_step.autocast,
              "bf16": trainer.train_step.bf16}
    del trainer
    return result


def summarise(run: dict, first: int, rates: dict[str, float | None]) -> dict[str, Any]:
    """Medians over the steps from ``first`` on: step time (and its range) and its split, tokens/s, FLOPs and MFU
    against each of ``rates`` (FLOP/s, None: unknown)."""
    records, phases = run["records"][first:], run["phases"][first:]
    med = lambda values: statistics.median(values)  # noqa: E731
    step_s = med([r["perf/step_s"] for r in records])
    split = {name: med([p[name] for p in phases]) for name in phases[0]}
    split["rest"] = med([r["perf/step_s"] - sum(p.values()) for r, p in zip(records, phases, strict=True)])
    flops = [run["flops_model"].step(r["batch/forwarded_tokens_per_step"], r["batch/trained_tokens_per_step"],
                                     r["batch/attention_pairs_per_step"]) for r in records]
    total_flops = med([f.total for f in flops])
    steps = [r["perf/step_s"] for r in records]
    out = {"steps_measured": len(records), "step_s": step_s, "step_s_range": (min(steps), max(steps)),
           "split_s": split,
           "loss_share": split["loss"] / step_s, "compute_s": sum(v for k, v in split.items() if k != "rest"),
           "trained_tokens_per_step": med([r["batch/trained_tokens_per_step"] for r in records]),
           "forwarded_tokens_per_step": med([r["batch/forwarded_tokens_per_step"] for r in records]),
           "attention_pairs_per_step": med([r["batch/attention_pairs_per_step"] for r in records]),
           "samples_per_step": med([r["batch/samples_per_step"] for r in records]),
           "trained_tok_s": med([r["batch/trained_tokens_per_step"] / r["perf/step_s"] for r in records]),
           "step_tflop": total_flops / 1e12,
           "tflop_split": {"linear": med([f.linear for f in flops]) / 1e12, "head": med([f.head for f in flops]) / 1e12,
                           "attention": med([f.attention for f in flops]) / 1e12},
           "peak_gib": run["peak_gib"]}
    for label, rate in rates.items():
        out[f"mfu_{label}_pct"] = 100.0 * total_flops / step_s / rate if rate else None
    return out


def floor_run(rows: list[Any], config: Any, device: torch.device, shape: str, attention: str, steps: int, *,
              autocast: bool, bf16: bool) -> dict[str, Any]:
    """The cross-entropy floor on the packed ``rows`` a distillation run captured (one row per step): a model built
    like the trainer's (sharded the same way when a process group exists), an AdamW set up like the trainer's."""
    import torch.distributed as dist

    from fastdistill.logit_head import causal_lm_parts
    from fastdistill.train.model import shard_student

    hf_model = build_model(shape, device, attention)
    model = CrossEntropyModel(hf_model)
    if dist.is_initialized():
        shard_student(model, hf_model, bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(config.adam_beta1,
                                  config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay)
    timer = PhaseTimer(device)
    backbone, _ = causal_lm_parts(hf_model)
    timer.attach(model, backbone, hf_model.get_input_embeddings(), optimizer)
    walls = []
    try:
        for index, row in enumerate(rows[:steps + 1]):
            wall, _ = cross_entropy_step(model, optimizer, [row], autocast=autocast,
                                         max_grad_norm=config.max_grad_norm, device=device)
            if index:  # the first is a warm-up
                walls.append(wall)
    finally:
        timer.detach()
    phases = [timer.phases(i) for i in range(1, len(timer.steps))]
    split = {name: statistics.median(p[name] for p in phases) for name in phases[0]}
    step_s = statistics.median(walls)
    split["rest"] = statistics.median(wall - sum(p.values()) for wall, p in zip(walls, phases, strict=True))
    del model, hf_model, optimizer
    return {"steps_measured": len(walls), "step_s": step_s, "step_s_range": (min(walls), max(walls)), "split_s": split,
            "compute_s": sum(v for k, v in split.items() if k != "rest")}


def predicted_ms(shape: str, backend: str, summary: dict[str, Any], calibrated: bool = False) -> float | None:
    """The predicted step time on an H200 (``train_step_predict``, H200 rates; raw, or ``calibrated`` by the H200's
    factors) for the tokens this run's steps trained, with the loss design ``backend`` runs on a GPU (``auto``: the
    first design ``kernel_designs_allowed`` gives, else the torch path; ``ce``: the cross-entropy floor); None for a
    shape the prediction does not model (the tiny CPU rehearsal)."""
    from fastdistill.loss.routing import kernel_designs_allowed

    if shape not in TOP_K_SHAPES:
        return None
    design = backend if backend != "auto" else next(iter(kernel_designs_allowed("sparse")), "torch")
    return predicted_step_ms(shape, design, summary["forwarded_tokens_per_step"], summary["trained_tokens_per_step"],
                             summary["attention_pairs_per_step"], calibrated=calibrated)


# ------------------------------------------------------------------------------------------------ the run
def matmul_rate(device: torch.device) -> float:
    """A matmul rate measured now (FLOP/s; bf16 on a GPU, float32 on a CPU: the dtype the step's GEMMs run in), the
    denominator beside the datasheet's (``bench_kernels.matmul_rate``)."""
    from bench_kernels import matmul_rate as measure

    return measure(device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, work: Path, deadline: float,
              rates: dict[str, float | None]) -> dict[str, Any]:
    """Every (K, backend) of one shape, the floor, the loss-decrease check and the packed-attention checks."""
    from fastdistill.tiny import build_tokenizer
    from fastdistill.train.model import default_attention

    workload = WORKLOADS["tiny" if args.tiny else "gpu"]
    attention = default_attention(device)
    tokenizer = build_tokenizer()
    vocab = SHAPES[shape]["vocab_size"]
    mean_length = (sum(workload.prompt) + sum(workload.completion)) / 2
    rows_needed = 2 * (args.loss_steps + 2) * math.ceil(workload.token_budget / mean_length)  # twice what it trains
    out: dict[str, Any] = {"shape": shape, "config": SHAPES[shape], "attention": attention,
                           "workload": vars(workload), "runs": {}, "checks": {}}
    caches = {k: write_teacher_cache(work / f"{shape}-k{k}", tokenizer, vocab, k, rows_needed, workload)
              for k in args.top_ks}
    first = True
    for k in args.top_ks:
        for backend in args.backends:
            key = f"K={k} {backend}"
            if time.monotonic() > deadline:
                out["runs"][key] = {"status": "skipped", "detail": "out of budget"}
                continue
            steps = args.loss_steps if first else WARMUP_STEPS + MEASURED_STEPS
            config = trainer_config(shape, caches[k], work / f"out-{shape}-{k}-{backend}", backend, steps, workload)
            model = build_model(shape, device, attention)  # the same weights for every run; FSDP2 shards in place
            run = run_trainer(model, tokenizer, config, device, capture_rows=MEASURED_STEPS + 1 if first else 0)
            del model
            summary = summarise(run, max(WARMUP_STEPS, steps - MEASURED_STEPS), rates)
            summary["predicted_ms"] = predicted_ms(shape, backend, summary)
            summary["predicted_ms_calibrated"] = predicted_ms(shape, backend, summary, calibrated=True)
            out["runs"][key] = {"status": "ok", **summary}
            if first:
                losses = [r["loss"] for r in run["records"]]
                tail = statistics.mean(losses[-3:])
                out["checks"]["loss_decreases"] = {"status": "ok" if tail < losses[0] else "failed",
                                                   "steps": len(losses), "first": losses[0], "last3_mean": tail,
                                                   "losses": losses}
                rows, autocast, bf16 = run["rows"], run["autocast"], run["bf16"]
                del run
                gc.collect()
                floor = floor_run(rows, config, device, shape, attention, MEASURED_STEPS, autocast=autocast, bf16=bf16)
                out["floor"] = {"status": "ok", **floor, "of": key,
                                "predicted_ms": predicted_ms(shape, "ce", out["runs"][key]),
                                "predicted_ms_calibrated": predicted_ms(shape, "ce", out["runs"][key], True)}
                first = False
            run = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for value in out["runs"].values():
        if value.get("status") == "ok" and "floor" in out:
            value["vs_floor_step"] = value["step_s"] / out["floor"]["step_s"]
            value["vs_floor_compute"] = value["compute_s"] / out["floor"]["compute_s"]
            value["floor_aim_met"] = value["vs_floor_step"] <= FLOOR_AIM
    model = build_model(shape, device, attention)  # unsharded: the checks below read plain tensors
    trained = next((r["trained_tokens_per_step"] for r in out["runs"].values() if r.get("status") == "ok"), None)
    if trained:
        out["loss_inputs"] = loss_input_dtypes(model.get_output_embeddings().weight, int(trained), args.top_ks[0],
                                               device)
    lengths = PACKED_LENGTHS["tiny" if args.tiny else "gpu"]
    out["checks"]["packed_attention"] = packed_attention_check(model, lengths, device, attention)
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        out["checks"]["packed_flash_attention_2"] = packed_attention_check(model, lengths, device,
                                                                           "flash_attention_2")
    else:
        why = "no CUDA device" if device.type != "cuda" else "flash-attn is not importable"
        out["checks"]["packed_flash_attention_2"] = {"status": "skipped", "detail": why}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------ guards
def guard(result: dict, baseline_path: Path) -> dict[str, Any]:
    """Peak memory and MFU (measured rate) of each (shape, K, backend) against the last recorded GPU run of the same
    device; ``ok`` False when one moved past its bound."""
    device = result["machine"]["device"]
    if not result["machine"]["cuda"]:
        return {"ok": True, "detail": "not a GPU run: no guard applies", "violations": []}
    recorded = json.loads(baseline_path.read_text()) if baseline_path.exists() else {}
    base = recorded.get("devices", {}).get(device)
    if not base:
        return {"ok": True, "detail": f"no recorded GPU run for {device} yet in {baseline_path.name}: nothing to "
                                      "guard against (record one with --record)", "violations": []}
    violations = []
    for shape in result["shapes"]:
        for key, run in shape["runs"].items():
            old = base["runs"].get(f"{shape['shape']} {key}")
            if run.get("status") != "ok" or not old:
                continue
            if run["peak_gib"] > PEAK_MEMORY_BOUND * old["peak_gib"]:
                violations.append(f"{shape['shape']} {key}: peak {run['peak_gib']:.2f} GiB > {PEAK_MEMORY_BOUND} × "
                                  f"recorded {old['peak_gib']:.2f} GiB")
            if run["mfu_measured_pct"] < MFU_BOUND * old["mfu_measured_pct"]:
                violations.append(f"{shape['shape']} {key}: MFU {run['mfu_measured_pct']:.1f} % < {MFU_BOUND} × "
                                  f"recorded {old['mfu_measured_pct']:.1f} %")
    return {"ok": not violations, "against": base.get("date"), "violations": violations,
            "bounds": {"peak_memory": PEAK_MEMORY_BOUND, "mfu_measured": MFU_BOUND}}


def record_baseline(result: dict, baseline_path: Path) -> None:
    """Write this GPU run's peak memory and MFU per (shape, K, backend) as its device's record."""
    recorded = json.loads(baseline_path.read_text()) if baseline_path.exists() else {"devices": {}}
    recorded["devices"][result["machine"]["device"]] = {
        "date": result["date"], "commit": result["machine"]["commit"],
        "runs": {f"{s['shape']} {key}": {"peak_gib": r["peak_gib"], "mfu_measured_pct": r["mfu_measured_pct"]}
                 for s in result["shapes"] for key, r in s["runs"].items() if r.get("status") == "ok"}}
    baseline_path.write_text(json.dumps(recorded, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------ output
def fmt(value: Any, spec: str, unit: str = "") -> str:
    return "–" if value is None else format(value, spec) + unit


def table(result: dict) -> str:
    """The markdown table of a run: one line per (shape, K, backend) and the floor (milliseconds)."""
    lines = ["| shape | K | loss backend | step ms (min–max) | predicted ms (H200): raw / calibrated | backbone fwd | "
             "loss (fwd+bwd) | "
             "backbone bwd | optimizer | rest | loss share | trained tok/s | TFLOP/step | MFU measured | "
             "MFU datasheet | peak GiB | × CE floor |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    phases = ("backbone_fwd", "loss", "backbone_bwd", "optimizer", "rest")
    for shape in result["shapes"]:
        for key, run in shape["runs"].items():
            k, backend = key.split(" ", 1)
            head = f"| {shape['shape']} | {k[2:]} | {backend} |"
            if run.get("status") != "ok":
                lines.append(f"{head} {run.get('detail', run.get('status'))} |")
                continue
            split = " | ".join(f"{1e3 * run['split_s'][name]:.1f}" for name in phases)
            low, high = run["step_s_range"]
            lines.append(
                f"{head} {1e3 * run['step_s']:.1f} ({1e3 * low:.1f}–{1e3 * high:.1f}) | "
                f"{fmt(run.get('predicted_ms'), '.0f')} / {fmt(run.get('predicted_ms_calibrated'), '.0f')} | {split} | "
                f"{100 * run['loss_share']:.0f} % | "
                f"{run['trained_tok_s']:.0f} | {run['step_tflop']:.3g} | {fmt(run['mfu_measured_pct'], '.1f', ' %')} | "
                f"{fmt(run['mfu_datasheet_pct'], '.1f', ' %')} | {fmt(run['peak_gib'], '.2f')} | "
                f"{fmt(run.get('vs_floor_step'), '.2f')}× |")
        if "floor" in shape:
            floor = shape["floor"]
            split = " | ".join(f"{1e3 * floor['split_s'][name]:.1f}" for name in phases)
            low, high = floor["step_s_range"]
            lines.append(f"| {shape['shape']} | – | CE floor | {1e3 * floor['step_s']:.1f} ({1e3 * low:.1f}–"
                         f"{1e3 * high:.1f}) | {fmt(floor.get('predicted_ms'), '.0f')} / "
                         f"{fmt(floor.get('predicted_ms_calibrated'), '.0f')} | {split} | | | | | | | 1.00× |")
    return "\n".join(lines)


def machine(device: torch.device, rates: dict[str, float | None]) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    import transformers

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cuda": device.type == "cuda", "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit,
            "flash_attn": importlib.util.find_spec("flash_attn") is not None,
            "rates_tflops": {k: v / 1e12 if v else None for k, v in rates.items()}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the CPU rehearsal: a tiny Qwen2 and short samples")
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), help="default: both Qwen2.5 shapes (tiny: tiny)")
    p.add_argument("--top-ks", nargs="+", type=int, default=[8, 32])
    p.add_argument("--backends", nargs="+", default=["auto", "torch"])
    p.add_argument("--loss-steps", type=int, default=LOSS_STEPS, help="steps of the loss-decrease check")
    p.add_argument("--budget-s", type=float, default=220.0, help="no new configuration starts after this")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--baseline", type=Path, default=BASELINE, help="the recorded GPU runs the guards compare with")
    p.add_argument("--record", action="store_true", help="record this GPU run as its device's baseline")
    p.add_argument("--predict", action="store_true", help="print the predicted cost split on an H200 and exit")
    p.add_argument("--no-group", action="store_true", help="one plain process (autocast, no FSDP2) instead of one "
                   "rank in a process group with the student FSDP2-sharded")
    args = p.parse_args(argv)
    if args.loss_steps < WARMUP_STEPS + MEASURED_STEPS + 1:
        p.error(f"--loss-steps must be at least {WARMUP_STEPS + MEASURED_STEPS + 1}")
    args.shapes = args.shapes or (["tiny"] if args.tiny else list(GPU_SHAPES))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.predict:
        print(prediction_table())
        return 0
    started = time.monotonic()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not args.tiny:
        print("bench_train_step: no CUDA device; the real shapes need one (use --tiny for the CPU rehearsal)")
        return 2
    from fastdistill.train.flops import peak_flops

    rates = {"measured": matmul_rate(device), "datasheet": peak_flops(device, torch.bfloat16)}
    result: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "tiny": args.tiny,
                              "machine": machine(device, rates), "shapes": []}
    result["machine"]["process_group"] = None if args.no_group else ("nccl" if device.type == "cuda" else "gloo")
    with tempfile.TemporaryDirectory(prefix="bench_train_step_") as folder:
        if not args.no_group:
            import torch.distributed as dist

            dist.init_process_group(result["machine"]["process_group"], init_method=f"file://{folder}/rendezvous",
                                    rank=0, world_size=1)
        try:
            for shape in args.shapes:
                result["shapes"].append(run_shape(shape, args, device, Path(folder), started + args.budget_s, rates))
        finally:
            if not args.no_group:
                dist.destroy_process_group()
    checks = [c for s in result["shapes"] for c in s["checks"].values()]
    result["correct"] = all(c["status"] in ("ok", "skipped") for c in checks)
    result["guard"] = guard(result, args.baseline)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["table"] = table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(result["table"])
    for shape in result["shapes"]:
        for key, run in shape["runs"].items():
            if "vs_floor_step" in run:
                print(f"{shape['shape']} {key}: {run['vs_floor_step']:.2f}× the cross-entropy step "
                      f"({run['vs_floor_compute']:.2f}× in forward + backward + optimizer); aim ≤ {FLOOR_AIM}×: "
                      f"{'met' if run['floor_aim_met'] else 'not met'}")
        if "loss_inputs" in shape:
            li = shape["loss_inputs"]
            print(f"{shape['shape']} the loss alone (auto, K={li['top_k']}, {li['rows']} positions, bf16 autocast): "
                  f"float32 inputs (uncast) {li['float32_ms']:.1f} ms, bf16 inputs (the trainer's) "
                  f"{li['bfloat16_ms']:.1f} ms")
        for name, check in shape["checks"].items():
            print(f"{shape['shape']} {name}: {check['status']} {check.get('detail', '')}".rstrip())
    print(f"guard: {'ok' if result['guard']['ok'] else 'FAILED'} {result['guard'].get('detail', '')}".rstrip())
    for violation in result["guard"]["violations"]:
        print(f"  {violation}")
    print(f"wrote {args.json} in {result['elapsed_s']} s")
    if args.record and result["machine"]["cuda"] and result["correct"]:
        record_baseline(result, args.baseline)
        print(f"recorded this run in {args.baseline}")
    return 0 if result["correct"] and result["guard"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
