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

Each run starts with a cold weight sync of the same initial student, so the runs are independent. Measured per run:
trained tokens per second over the whole ``train()`` call, the held-out jsd afterwards (the final student's greedy
answers to 32 held-out prompts, scored by the teacher; lower is better), the fraction of generated samples thrown
away, and the shutdown time. With ``--repeats N`` the contenders run interleaved N times; the table shows medians,
and the async/sync and async/TRL ratios are the medians of the per-repeat ratios (each repeat runs its contenders
back to back, which cancels the machine's drift between repeats). ``--json FILE`` writes the numbers
(``make bench-e2e``: 5 repeats → ``benchmarks/results/e2e.json``).

Steady state: besides the whole-run numbers, every fastdistill run is measured over its steps after the first
``--warmup-steps`` (the pipeline filling), from the per-step records of ``metrics.jsonl``; start-up (servers
connected, worker started, first weight sync) and shut-down lie outside every step, so they are excluded, and their
share of the whole run is printed. Per mode, the seconds per step of each phase: rollout wait (in sync mode the
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
    return (save_pretrained_dir(student, tokenizer, workdir / "student"),
            save_pretrained_dir(teacher.eval(), tokenizer, workdir / "teacher"))


def run_fastdistill(name: str, workdir: Path, student_dir: Path, urls: dict[str, str], prompts: list, args,
                    trainer_cpus: set[int] | None, async_mode: bool) -> dict[str, Any]:
    """One ``fastdistill train`` run in a subprocess; returns its summary plus the per-step metrics."""
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
    (workdir / f"{name}.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "fastdistill.cli", "train", "--config", str(workdir / f"{name}.yaml")]
    _run(command, trainer_cpus, workdir / f"{name}.log")
    summary = json.loads((output_dir / "train_summary.json").read_text())
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    summary["generated_samples"] = (sum(s["batch/samples_per_step"] for s in steps) + summary["dropped_stale_total"]
                                    + sum(s.get("sample/discarded_total", 0.0) for s in steps))
    summary["trained_samples"] = sum(s["batch/samples_per_step"] for s in steps)
    summary["final_dir"] = str(output_dir / "final")
    summary["steady"] = steady_state(steps, summary["time_s"], args.warmup_steps)
    return summary


def run_trl(name: str, workdir: Path, student_dir: Path, urls: dict[str, str], prompts: list, args,
            trainer_cpus: set[int] | None) -> dict[str, Any]:
    output_dir = workdir / name
    spec = {"student_dir": str(student_dir), "output_dir": str(output_dir), "prompts": prompts,
            "student_url": urls["student"], "teacher_url": urls["teacher"], "batch_size": args.batch_size,
            "steps": args.steps, "max_completion_length": 32, "top_k": 8, "learning_rate": 1e-3, "seed": args.seed}
    (workdir / f"{name}.json").write_text(json.dumps(spec))
    _run([sys.executable, str(ROOT / "benchmarks" / "e2e_trl_run.py"), str(workdir / f"{name}.json")], trainer_cpus,
         workdir / f"{name}.log")
    result = json.loads((output_dir / "trl_result.json").read_text())
    result["trained_tokens_per_s"] = result["trained_tokens"] / result["wall_seconds"]
    result["generated_samples"] = result["trained_samples"] + result["dropped_stale_total"]
    result["final_dir"] = str(output_dir / "final")
    return result


def _run(command: list[str], cpus: set[int] | None, log: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=pin, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed; log {log}:\n" + log.read_text()[-3000:])


STEADY_PHASES = ("rollout_wait", "fwd_bwd", "optimizer", "weight_sync")


def steady_state(steps: list[dict[str, Any]], time_s: dict[str, float], warmup_steps: int) -> dict[str, Any]:
    """Steady-state numbers of one fastdistill run from its per-step records (``metrics.jsonl``, logging every
    step) past the first ``warmup_steps``: trained tokens/s, seconds per step of each phase of ``STEADY_PHASES``
    (``perf/<phase>_s``) and ``rest`` (the step's other seconds), generation and scoring seconds per step (the
    rollout wait split by the worker's mean ``rollout/score_s`` / ``rollout/duration_s``; meaningful where the
    trainer waits for whole waves, the synchronous mode), and the share of the run's wall time (``time_s``, the
    summary's phases) spent in start-up and shut-down."""
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
        "trained_tokens_per_s": sum(step["batch/trained_tokens_per_step"] for step in kept) / seconds,
        "step_s": seconds / len(kept),
        "phases_s": phases,
        "generation_s": phases["rollout_wait"] * (1.0 - score_share),
        "scoring_s": phases["rollout_wait"] * score_share,
        "startup_shutdown_share": (time_s.get("startup", 0.0) + time_s.get("shutdown", 0.0)) / time_s["total"],
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
    """Print the steady-state table (medians over repeats, per mode: tok/s and seconds per step of each phase) and,
    with both modes, the overlap limit from the synchronous run's phases beside the measured async/sync (the median
    of the repeats' paired ratios) and their quotient, the efficiency. Returns those numbers."""
    modes = [name for name in ("async", "sync") if name in results]
    if not modes:
        return {}
    report: dict[str, Any] = {}
    print("\nSteady state (steps after the warm-up; start-up and shut-down excluded), medians over repeats, "
          "seconds per step")
    columns = ("tok/s", "step", "gen", "score", *STEADY_PHASES[1:], "rest")
    print(f"{'mode':<7}" + "".join(f"{c:>12}" for c in columns) + f"{'start+stop share':>18}"
          + "   (gen + score = rollout wait)")
    for name in modes:
        runs = [run["steady"] for run in results[name]]

        def median(get, runs=runs):
            return statistics.median(get(run) for run in runs)

        row = {"trained_tokens_per_s": median(lambda r: r["trained_tokens_per_s"]),
               "step_s": median(lambda r: r["step_s"]), "generation_s": median(lambda r: r["generation_s"]),
               "scoring_s": median(lambda r: r["scoring_s"]),
               **{f"{p}_s": median(lambda r, p=p: r["phases_s"][p]) for p in (*STEADY_PHASES, "rest")},
               "startup_shutdown_share": median(lambda r: r["startup_shutdown_share"])}
        report[f"{name}_steady"] = row
        cells = [row["trained_tokens_per_s"], row["step_s"], row["generation_s"], row["scoring_s"],
                 *(row[f"{p}_s"] for p in STEADY_PHASES[1:]), row["rest_s"]]
        print(f"{name:<7}" + "".join(f"{c:>12.3f}" for c in cells) + f"{row['startup_shutdown_share']:>18.1%}")
    if len(modes) == 2:
        limits = [overlap_limit(run["steady"]) for run in results["sync"]]
        paired = [a["steady"]["trained_tokens_per_s"] / b["steady"]["trained_tokens_per_s"]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="steps left out of the steady-state numbers (the pipeline filling)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every contender this many times, interleaved, and report medians")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--only", choices=("async", "sync", "trl"), nargs="*", default=None, help="run just these")
    parser.add_argument("--ours", default="{}", help="YAML mapping of extra config fields for fastdistill's runs")
    parser.add_argument("--layout", choices=("split", "servers-together"), default="split",
                        help="split: student server | teacher server + trainer; servers-together: both vLLM servers "
                             "on one core, the trainer on the other (where vLLM-CPU pins both servers by default, the "
                             "anchor's layout)")
    parser.add_argument("--anchor-servers", action="store_true",
                        help="launch the servers as the anchor run did (vLLM's default multi-process executor, only "
                             "the model's OpenMP thread pinned) instead of fastdistill's defaults (one engine process, "
                             "every server process pinned)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import tempfile

    from fastdistill.serve import VLLMServer

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fastdistill-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    train_pairs, held_pairs = anchor_task(args.seed)
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
    with VLLMServer(student_dir, role="student", weight_transfer_backend="gloo",
                    log_path=workdir / "student_server.log", **servers[0]) as student, \
            VLLMServer(teacher_dir, role="teacher", log_path=workdir / "teacher_server.log", **servers[1]) as teacher:
        urls = {"student": student.url, "teacher": teacher.url}
        warm_up(urls, held_rows)
        runners = {
            "async": lambda tag: run_fastdistill(tag, workdir, student_dir, urls, prompts, args, trainer_cpus, True),
            "sync": lambda tag: run_fastdistill(tag, workdir, student_dir, urls, prompts, args, trainer_cpus, False),
            "trl": lambda tag: run_trl(tag, workdir, student_dir, urls, prompts, args, trainer_cpus),
        }
        chosen = [name for name in runners
                  if not (name == "trl" and args.skip_trl) and not (args.only and name not in args.only)]
        for repeat in range(args.repeats):  # interleaved, so that a slow spell of the machine hits every contender
            for name in chosen:
                tag = name if args.repeats == 1 else f"{name}{repeat + 1}"
                print(f"[bench_e2e] running {tag} ...", flush=True)
                started = time.perf_counter()
                run = runners[name](tag)
                run["held_out_jsd"] = held_out_jsd(run["final_dir"], urls, held_rows)
                run["wasted_fraction"] = 1.0 - run["trained_samples"] / max(run["generated_samples"], 1.0)
                results.setdefault(name, []).append(run)
                print(f"[bench_e2e] {tag}: {run['trained_tokens_per_s']:.1f} trained tok/s, held-out jsd "
                      f"{run['held_out_jsd']:.3f}, {time.perf_counter() - started:.0f} s", flush=True)

    fields = ("trained_tokens_per_s", "held_out_jsd", "wasted_fraction", "shutdown_s", "wall_seconds")
    medians = {name: {field: statistics.median(run[field] for run in runs) for field in fields}
               for name, runs in results.items()}
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, no GPU", "steps": args.steps,
        "layout": args.layout, "anchor_servers": args.anchor_servers, "batch_size": args.batch_size,
        "repeats": args.repeats, "statistic": "median over repeats", "ours": yaml.safe_load(args.ours) or {},
    }
    for name, median in medians.items():
        report.update({f"{name}_trained_tokens_per_s": median["trained_tokens_per_s"],
                       f"{name}_final_jsd": median["held_out_jsd"],
                       f"{name}_wasted_fraction": median["wasted_fraction"],
                       f"{name}_shutdown_s": median["shutdown_s"]})
    report["runs"] = results
    print()
    print(f"{'run':<8}{'trained tok/s':>15}{'held-out jsd':>14}{'wasted':>9}{'shutdown s':>12}{'wall s':>9}"
          + ("   (medians; each run: tok/s, jsd)" if args.repeats > 1 else ""))
    for name, median in medians.items():
        each = ", ".join(f"{run['trained_tokens_per_s']:.0f}/{run['held_out_jsd']:.3f}" for run in results[name])
        print(f"{name:<8}{median['trained_tokens_per_s']:>15.1f}{median['held_out_jsd']:>14.3f}"
              f"{median['wasted_fraction']:>9.1%}{median['shutdown_s']:>12.2f}{median['wall_seconds']:>9.1f}"
              + (f"   {each}" if args.repeats > 1 else ""))
    for other in ("sync", "trl"):
        if "async" in medians and other in medians:
            # Each repeat runs the contenders back to back, so its ratio is measured under the same machine state;
            # the median of those paired ratios is robust to the machine's drift between repeats.
            paired = [a["trained_tokens_per_s"] / b["trained_tokens_per_s"]
                      for a, b in zip(results["async"], results[other], strict=True)]
            report[f"async_over_{other}"] = statistics.median(paired)
            report[f"async_over_{other}_per_repeat"] = paired
            report[f"async_over_{other}_of_medians"] = (medians["async"]["trained_tokens_per_s"]
                                                        / medians[other]["trained_tokens_per_s"])
            print(f"async / {other} throughput: {statistics.median(paired):.2f}x (median of the repeats' ratios "
                  f"{', '.join(f'{r:.2f}' for r in paired)}; ratio of the medians "
                  f"{report[f'async_over_{other}_of_medians']:.2f}x)")
    report.update(steady_report(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
