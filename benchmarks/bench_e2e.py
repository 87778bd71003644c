"""End to end: throughput and time to quality of fastdistill async vs fastdistill synchronous vs TRL 1.16, same
servers, data and steps.

The setup is the CPU anchor of the comparison with TRL: a tiny tied Qwen2 student (hidden 128, 2 layers), a
teacher of the same shape fine-tuned on the task (``--tasks``, see ``e2e_tasks.py``: ``short``, "What is A plus B?"
→ "A+B=C." (A, B in 0..29), completions up to 32 tokens; ``long``, the answer followed by 128 numbers counted on from
it, about 450 tokens, cut at 160), 256 training prompts, batch 8, 40 steps, top-K 8, β = 0, fp32, one trainer
thread. Each task has its own models and servers; its runs are interleaved. Inference and training get
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
(``make bench-e2e``: 5 repeats of both tasks → ``benchmarks/results/e2e.json``).

Time to quality (``e2e_quality.py``): every contender saves its student every ``--snapshot-steps`` steps and at the
last one, from the same hook at a step's end, on the same clock (the snapshot's start from the process start, every
earlier snapshot's cost taken off: they cost nothing on the clock). After each run one evaluator scores its snapshots:
pushed into the student server one by one, their greedy completions of the held-out prompts at the task's full
horizon (``max_completion_length``, whatever horizon the run trained on), scored by the teacher server, the jsd per
token computed locally. The targets are TRL's and sync's median final held-out jsd (``--targets-from`` takes them
from an earlier JSON instead, for runs without TRL); per contender and target, the wall time from process start and
the generated tokens at the first snapshot at or below it, median over repeats (a repeat that never gets there
counts as later than any; null when the median does not get there).

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_clock import clock_report, fastdistill_clock, spread, steady_report, steady_state, trl_clock  # noqa: E402
from e2e_quality import (  # noqa: E402
    generated_tokens_by_step,
    ratio_or_none,
    read_snapshots,
    snapshot_clock,
    time_to_quality,
)
from e2e_tasks import TASKS, Task  # noqa: E402


def anchor_task(seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training pairs, held-out pairs) of the short task: 256 and 32 questions "What is A plus B?" → "A+B=C."."""
    return TASKS["short"].pairs(seed)


def build_models(workdir: Path, pairs: list[tuple[str, str]], teacher_steps: int, seed: int,
                 vocab_size: int = 400, teacher_batch: int = 32) -> tuple[Path, Path]:
    """Tokenizer, a fine-tuned teacher and an untrained student (tied Qwen2, hidden 128, 2 layers), saved."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastdistill.demo import train_on_answers
    from fastdistill.tiny import build_tokenizer, save_pretrained_dir

    corpus = ["user", "assistant"] + [text for pair in pairs for text in pair]
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)

    def model(init_seed: int) -> Qwen2ForCausalLM:
        torch.manual_seed(init_seed)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                             max_position_embeddings=512, use_cache=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")

    student, teacher = model(seed), model(seed)  # the teacher starts from the student, like the anchor
    losses = train_on_answers(teacher, tokenizer, pairs, steps=teacher_steps, batch=teacher_batch, lr=3e-3,
                              rng=random.Random(seed))
    print(f"[bench_e2e] teacher trained: final loss {losses[-1]:.3f}", flush=True)
    dirs = (save_pretrained_dir(student, tokenizer, workdir / "student"),
            save_pretrained_dir(teacher.eval(), tokenizer, workdir / "teacher"))
    (workdir / MODELS_MARKER).write_text(json.dumps({"teacher_steps": teacher_steps, "seed": seed,
                                                     "vocab_size": vocab_size, "teacher_batch": teacher_batch,
                                                     "teacher_final_loss": losses[-1],
                                                     "teacher_final_loss_mean_last_20": sum(losses[-20:]) / 20}))
    return dirs


MODELS_MARKER = "models.json"


def reuse_models(workdir: Path, teacher_steps: int, seed: int, vocab_size: int = 400) -> tuple[Path, Path]:
    """The student and teacher that ``build_models`` saved in an earlier run's ``workdir``, refused unless they were
    built with the same ``teacher_steps``, ``seed`` and tokenizer vocabulary bound."""
    marker = workdir / MODELS_MARKER
    if not marker.is_file():
        raise SystemExit(f"--models-from {workdir}: no {MODELS_MARKER} (not a bench_e2e workdir with built models)")
    built = json.loads(marker.read_text())
    wanted = (teacher_steps, seed, vocab_size)
    if (built["teacher_steps"], built["seed"], built.get("vocab_size", 400)) != wanted:
        raise SystemExit(f"--models-from {workdir}: built with teacher_steps={built['teacher_steps']}, "
                         f"seed={built['seed']}, vocab_size={built.get('vocab_size', 400)}; this run asks for "
                         f"{teacher_steps}, {seed}, {vocab_size}")
    print(f"[bench_e2e] models from {workdir} (teacher final loss {built['teacher_final_loss']:.3f})", flush=True)
    return workdir / "student", workdir / "teacher"


def run_fastdistill(name: str, workdir: Path, student_dir: Path, urls: dict[str, str], prompts: list, args,
                    trainer_cpus: set[int] | None, async_mode: bool, extra: dict[str, Any],
                    task: Task) -> dict[str, Any]:
    """One ``fastdistill train`` run in a subprocess (``e2e_ours_run.py``: the same run plus snapshots; ``extra``:
    config fields on top of ``--ours``); returns its summary plus its clock (``run_clock``), steady-state phases
    (``steady_state``) and the cumulative generated tokens at each step's end."""
    output_dir = workdir / name
    dataset = workdir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = {
        "model_name_or_path": str(student_dir), "output_dir": str(output_dir), "train_dataset": str(dataset),
        "vllm_server_base_url": urls["student"], "teacher_server_urls": {"default": urls["teacher"]},
        "per_device_train_batch_size": args.batch_size, "max_steps": args.steps, "token_budget": 0,
        "max_completion_length": task.max_completion_length, "teacher_top_k": 8, "beta": 0.0,
        "learning_rate": task.learning_rate,
        "dtype": "float32",
        "max_staleness": 4, "weight_sync_steps": 1, "save_strategy": "no", "disable_tqdm": True,
        "async_mode": async_mode, "seed": args.seed,
    }
    config.update(yaml.safe_load(args.ours) or {})
    config.update(extra)
    (workdir / f"{name}.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, str(ROOT / "benchmarks" / "e2e_ours_run.py"), str(workdir / f"{name}.yaml"),
               str(args.snapshot_steps)]
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
    summary["process"] = process
    generated, total = [], 0.0
    for s in steps:  # per step: the samples trained, dropped as stale and discarded in it
        total += (s["batch/samples_per_step"] + s.get("sample/dropped_stale_total", 0.0)
                  + s.get("sample/discarded_total", 0.0))
        generated.append(total)
    summary["generated_tokens_by_step"] = generated_tokens_by_step(
        [s["batch/trained_tokens_per_step"] for s in steps], [s["batch/samples_per_step"] for s in steps], generated)
    return summary


def run_trl(name: str, workdir: Path, student_dir: Path, urls: dict[str, str], prompts: list, args,
            trainer_cpus: set[int] | None, task: Task) -> dict[str, Any]:
    """One TRL run (``e2e_trl_run.py``) in a subprocess; returns its result plus its clock (``run_clock``) and the
    cumulative generated tokens at each step's end."""
    output_dir = workdir / name
    spec = {"student_dir": str(student_dir), "output_dir": str(output_dir), "prompts": prompts,
            "student_url": urls["student"], "teacher_url": urls["teacher"], "batch_size": args.batch_size,
            "steps": args.steps, "max_completion_length": task.max_completion_length, "top_k": 8,
            "learning_rate": task.learning_rate, "seed": args.seed, "snapshot_every": args.snapshot_steps}
    (workdir / f"{name}.json").write_text(json.dumps(spec))
    process = _run([sys.executable, str(ROOT / "benchmarks" / "e2e_trl_run.py"), str(workdir / f"{name}.json")],
                   trainer_cpus, workdir / f"{name}.log")
    result = json.loads((output_dir / "trl_result.json").read_text())
    result["generated_samples"] = result["trained_samples"] + result["dropped_stale_total"]
    result["final_dir"] = str(output_dir / "final")
    result["clock"] = trl_clock(process, result, args.warmup_steps)
    result["process"] = process
    result["generated_tokens_by_step"] = generated_tokens_by_step(result["step_tokens"], result["step_samples"],
                                                                  result["step_generated_samples"])
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


def score_snapshots(run: dict[str, Any], snapshot_dir: Path, student_dir: Path, urls: dict[str, str],
                    held_rows: list[dict], max_tokens: int) -> list[dict[str, Any]]:
    """The one evaluator of every contender's snapshots: each pushed into the student server (a weight sync of its
    own, after the run), its greedy completions of ``held_rows`` up to ``max_tokens`` (the full horizon) scored by
    the teacher server, the jsd per token computed locally. Returns the run's curve: per snapshot ``step``,
    ``seconds`` and ``generated_tokens`` on the run's clock (``snapshot_clock``), ``held_out_jsd`` and the mean
    completion length."""
    from transformers import AutoModelForCausalLM

    from fastdistill.sync import VLLMWeightSync
    from fastdistill.train.evaluate import collect_scored_samples, divergence_per_token

    records = read_snapshots(snapshot_dir)
    curve = snapshot_clock(records, run["process"][0], run["generated_tokens_by_step"])
    if not curve or curve[-1]["step"] != len(run["generated_tokens_by_step"]):
        raise RuntimeError(f"{snapshot_dir}: no snapshot of the last step")
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    sync = VLLMWeightSync(urls["student"], backend="gloo")
    sync.init()
    try:
        for version, (record, point) in enumerate(zip(records, curve, strict=True), start=1):
            model.load_state_dict(torch.load(record["path"], weights_only=True))
            sync.push(model, version)
            samples = collect_scored_samples(urls["student"], {"default": urls["teacher"]}, held_rows, top_k=8,
                                             max_tokens=max_tokens)
            with torch.no_grad():
                point["held_out_jsd"] = divergence_per_token(model, samples, ["default"])
            point["completion_tokens_mean"] = sum(len(s.completion_ids) for s in samples) / len(samples)
    finally:
        sync.close()
    return curve


def warm_up(urls: dict[str, str], rows: list[dict], max_tokens: int) -> None:
    """A few rounds of generation and scoring before the measured runs, so that the first run does not pay for the
    servers' first requests."""
    from fastdistill.train.evaluate import collect_scored_samples

    for _ in range(3):
        collect_scored_samples(urls["student"], {"default": urls["teacher"]}, rows, top_k=8, max_tokens=max_tokens)


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=YAML`` (``--async-variant``, ``--sync-variant``) → (NAME, the YAML mapping of config fields)."""
    name, sep, fields = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=YAML with NAME an identifier, got {text!r}")
    mapping = yaml.safe_load(fields)
    if not isinstance(mapping, dict) or not mapping:
        raise argparse.ArgumentTypeError(f"{name}: expected a non-empty YAML mapping of config fields, got {fields!r}")
    return name, mapping


def run_task(task: Task, args, variants: dict[str, tuple[bool, dict[str, Any]]], workdir: Path) -> dict[str, Any]:
    """Every chosen contender of one task, ``--repeats`` times interleaved, on one pair of servers; returns the
    task's report (clocks, steady phases, time to quality, runs)."""
    from transformers import AutoTokenizer

    from fastdistill.serve import VLLMServer

    workdir.mkdir(parents=True, exist_ok=True)
    teacher_steps = args.teacher_steps if args.teacher_steps is not None else task.teacher_steps
    train_pairs, held_pairs = task.pairs(args.seed)
    if args.models_from:
        models = args.models_from / task.name
        if task.name == "short" and not (models / MODELS_MARKER).is_file():
            models = args.models_from  # a workdir of the single-task benchmark
        student_dir, teacher_dir = reuse_models(models, teacher_steps, args.seed, task.vocab_size)
    else:
        student_dir, teacher_dir = build_models(workdir, train_pairs, teacher_steps, args.seed, task.vocab_size,
                                                task.teacher_batch)
    teacher_info = json.loads((student_dir.parent / MODELS_MARKER).read_text())
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    prompts = [[{"role": "user", "content": q}] for q, _ in train_pairs]
    held_rows = [{"prompt_ids": tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)} for q, _ in held_pairs]
    answer_tokens = [len(tokenizer(a)["input_ids"]) + 1 for _, a in train_pairs]  # + the end-of-sequence token
    cores = sorted(os.sched_getaffinity(0))
    student_cores, other_cores = (cores[:1], cores[1:2]) if len(cores) >= 2 else (None, None)
    trainer_cpus = set(other_cores) if other_cores else None
    teacher_cores = student_cores if args.layout == "servers-together" else other_cores
    if args.anchor_servers:  # the anchor's launch: only the model's OpenMP thread is bound, vLLM's default executor
        servers = [dict(env={"VLLM_CPU_OMP_THREADS_BIND": str(c[0])} if c else None, one_process=False)
                   for c in (student_cores, teacher_cores)]
    else:
        servers = [dict(cpus=c) for c in (student_cores, teacher_cores)]
    horizon = task.max_completion_length
    results: dict[str, Any] = {}
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with VLLMServer(student_dir, role="student", weight_transfer_backend="gloo",
                    log_path=workdir / "student_server.log", **servers[0]) as student, \
            VLLMServer(teacher_dir, role="teacher", log_path=workdir / "teacher_server.log", **servers[1]) as teacher:
        urls = {"student": student.url, "teacher": teacher.url}
        warm_up(urls, held_rows, horizon)

        def ours(async_mode: bool, extra: dict[str, Any]):
            return lambda tag: run_fastdistill(tag, workdir, student_dir, urls, prompts, args, trainer_cpus,
                                               async_mode, extra, task)

        runners = {"async": ours(True, {}), "sync": ours(False, {}),
                   "trl": lambda tag: run_trl(tag, workdir, student_dir, urls, prompts, args, trainer_cpus, task),
                   **{name: ours(async_mode, fields) for name, (async_mode, fields) in variants.items()}}
        chosen = [name for name in runners
                  if not (name == "trl" and args.skip_trl) and not (args.only and name not in args.only)]
        for repeat in range(args.repeats):  # interleaved, so that a slow spell of the machine hits every contender
            for name in chosen:
                tag = (name if args.repeats == 1 else f"{name}{repeat + 1}").replace(":", "-")
                print(f"[bench_e2e] {task.name}: running {tag} ...", flush=True)
                load = os.getloadavg()[0]
                run = runners[name](tag)
                run["load_average_1min"] = (load, os.getloadavg()[0])
                run["curve"] = score_snapshots(run, workdir / tag / "snapshots", student_dir, urls, held_rows,
                                               horizon)
                run["held_out_jsd"] = run["curve"][-1]["held_out_jsd"]  # the final student's
                run["wasted_fraction"] = 1.0 - run["trained_samples"] / max(run["generated_samples"], 1.0)
                results.setdefault(name, []).append(run)
                clock = run["clock"]
                print(f"[bench_e2e] {task.name} {tag}: steady {clock['steady_tokens_per_s']:.1f} / whole "
                      f"{clock['whole_tokens_per_s']:.1f} trained tok/s, held-out jsd {run['held_out_jsd']:.3f}, "
                      f"process {clock['whole_s']:.1f} s, load {load:.1f}-{os.getloadavg()[0]:.1f}", flush=True)
                print("    curve (step: s, jsd): " + ", ".join(f"{p['step']}: {p['seconds']:.1f}, "
                                                                f"{p['held_out_jsd']:.3f}" for p in run["curve"]),
                      flush=True)

    loads = [value for runs in results.values() for run in runs for value in run["load_average_1min"]]
    print(f"\n=== task {task.name}: completions {sum(answer_tokens) / len(answer_tokens):.1f} tokens on average "
          f"(teacher's), horizon {horizon}, teacher final CE {teacher_info['teacher_final_loss']:.3f}")
    report: dict[str, Any] = {
        "task": task.name, "started": started_at, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1min": spread(loads), "max_completion_length": horizon,
        "teacher_answer_tokens_mean": sum(answer_tokens) / len(answer_tokens), "teacher": teacher_info,
    }
    report.update(clock_report(results, args.warmup_steps))
    report["steady_phases"] = steady_report(results)
    report["time_to_quality"] = quality_report(results, args.targets.get(task.name) if args.targets else None)
    report["runs"] = results
    load = report["load_average_1min"]
    print(f"machine load (1-min load average at each run's start and end): median {load['median']:.1f}, range "
          f"{load['min']:.1f}-{load['max']:.1f} on {os.cpu_count()} cores")
    return report


def quality_report(results: dict[str, list[dict[str, Any]]], targets: dict[str, float] | None) -> dict[str, Any]:
    """Print and return time to quality (``e2e_quality.time_to_quality``) over every contender's curves, with the
    ratios of each fastdistill contender's time to a target over the target owner's own time to it and whole run.
    ``targets`` (name → jsd) replaces the targets of the curves (an earlier run's, for runs without TRL)."""
    curves = {name: [run["curve"] for run in runs] for name, runs in results.items()}
    quality = time_to_quality(curves, targets)
    print("\nTime to quality: wall time from process start (snapshot costs taken off) to the first snapshot at or "
          "below the target held-out jsd, median over repeats (- : not reached); generated tokens until then")
    print("targets: " + ", ".join(f"{name} = {value:.3f}" for name, value in quality["targets"].items()))
    print(f"{'run':<14}" + "".join(f"{name + ' s':>16}{'tokens':>10}{'each s':>34}{'stays s':>9}"
                                   for name in quality["targets"]))
    for name in curves:
        cells = ""
        for target in quality["targets"]:
            seconds, tokens = quality["seconds"][name][target], quality["generated_tokens"][name][target]
            stays = quality["sustained_seconds"][name][target]
            each = ", ".join("-" if v is None else f"{v:.1f}" for v in quality["each"][name][target])
            cells += (f"{'-' if seconds is None else f'{seconds:.1f}':>16}"
                      f"{'-' if tokens is None else f'{tokens:.0f}':>10}{each:>34}"
                      f"{'-' if stays is None else f'{stays:.1f}':>9}")
        print(f"{name:<14}{cells}")
    print("(stays: from when on every later snapshot stays at or below the target, median over repeats)")
    ratios: dict[str, Any] = {}
    for name in curves:
        if name != "async" and not name.startswith("async:"):
            continue
        for target, owner in (("trl_final", "trl"), ("sync_final", "sync")):
            if target not in quality["targets"] or owner not in curves:
                continue
            mine = quality["seconds"][name][target]
            theirs = quality["seconds"][owner][target]
            whole = statistics.median(run["clock"]["whole_s"] for run in results[owner])
            ratios[f"{name}_{target}"] = {"over_owner_time_to_target": ratio_or_none(mine, theirs),
                                          "over_owner_whole_run": ratio_or_none(mine, whole)}
            print(f"{name} to {target}: {ratio_or_none(mine, theirs) or float('nan'):.2f}x {owner}'s time to it, "
                  f"{ratio_or_none(mine, whole) or float('nan'):.2f}x {owner}'s whole run")
    quality["ratios"] = ratios
    return quality


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["short"],
                        help="the tasks to run, each with its own models and servers (e2e_tasks.py)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--teacher-steps", type=int, default=None,
                        help="the teacher's fine-tuning steps (default: the task's, 400)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="k: the steady state of every contender is its steps after the first k (the pipeline "
                             "filling)")
    parser.add_argument("--snapshot-steps", type=int, default=4,
                        help="save the student every this many steps (and at the last one) for time to quality")
    parser.add_argument("--targets-from", type=Path, default=None,
                        help="take the time-to-quality targets from this earlier --json (per task) instead of this "
                             "run's TRL and sync")
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
                        help="reuse the students and teachers an earlier run built in this workdir (same --seed and "
                             "--teacher-steps) instead of training the teachers again")
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
    if args.snapshot_steps < 1:
        parser.error("--snapshot-steps must be >= 1")
    args.targets = None
    if args.targets_from:
        earlier = json.loads(args.targets_from.read_text())
        args.targets = {task: quality["targets"] for task, quality in earlier.get("time_to_quality_detail",
                                                                                  {}).items()}
        missing = [task for task in args.tasks if task not in args.targets]
        if missing:
            parser.error(f"--targets-from {args.targets_from}: no targets for the tasks {missing}")

    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fastdistill-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[bench_e2e] workdir {workdir}", flush=True)
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tasks = {name: run_task(TASKS[name], args, variants, workdir / name) for name in args.tasks}
    first = tasks[args.tasks[0]]
    loads = [value for report in tasks.values() for value in report["load_average_1min"]["each"]]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "started": started_at,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, no GPU", "load_average_1min": spread(loads),
        "steps": args.steps, "warmup_steps": args.warmup_steps, "layout": args.layout,
        "anchor_servers": args.anchor_servers, "batch_size": args.batch_size, "repeats": args.repeats,
        "snapshot_steps": args.snapshot_steps, "tasks_run": args.tasks,
        "statistic": "median over repeats; ratios: median of the per-repeat paired ratios",
        "ours": yaml.safe_load(args.ours) or {}, "variants": {name: fields for name, (_, fields) in variants.items()},
        "models_from": str(args.models_from) if args.models_from else None, "workdir": str(workdir),
        "targets_from": str(args.targets_from) if args.targets_from else None,
        "clocks": {"steady": f"tokens of steps {args.warmup_steps + 1}..N / (end of step N - end of step "
                             f"{args.warmup_steps})", "whole": "all trained tokens / (process end - process start)",
                   "time_to_quality": "wall-clock seconds from the trainer process's start to the first snapshot at "
                                      "or below the target held-out jsd, earlier snapshots' costs taken off"},
        # {task: {contender: {target: median seconds or null}}}
        "time_to_quality": {name: task["time_to_quality"]["seconds"] for name, task in tasks.items()},
        "time_to_quality_tokens": {name: task["time_to_quality"]["generated_tokens"] for name, task in tasks.items()},
        "time_to_quality_detail": {name: task["time_to_quality"] for name, task in tasks.items()},
    }
    # the first task's throughput tables at the top level, as before; every task's in "tasks"
    report.update({key: first[key] for key in ("contenders", "ratios", "held_out_jsd_vs_sync", "steady_phases")})
    report["tasks"] = tasks
    load = report["load_average_1min"]
    print(f"machine load over all tasks: median {load['median']:.1f}, range {load['min']:.1f}-{load['max']:.1f} on "
          f"{os.cpu_count()} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
