"""``fastdistill demo``: asynchronous on-policy distillation of a tiny student from a tiny teacher, end to end on CPU.

1. Builds a toy chat task in code (single-digit additions, counting, spelling short words backwards, each asked in
   three phrasings), a byte-level BPE tokenizer with a chat template, a TEACHER trained on every prompt with
   cross-entropy, and a fresh, smaller STUDENT with the same vocabulary. Held-out prompts are phrasings the student
   never trains on (of facts it meets in other phrasings).
2. Starts two real vLLM servers: the teacher (``--max-logprobs -1``) and the student (dev mode, fastdistill's
   ``gloo`` weight-transfer engine), with several cores pinned to one half of them and the trainer to the other.
3. Runs :class:`~fastdistill.train.AsyncDistillationTrainer` (rollout worker, queue, staleness, fused loss, weight
   sync after every step) with the held-out prompts as its ``eval_dataset``: at step 0, every ``eval_steps`` and at
   the end it measures the jsd per token of the student's greedy answers as scored by the teacher and their
   exact-answer accuracy (``eval/jsd``, ``eval/exact_match``).
4. Writes ``<output-dir>/report.json`` and ``<output-dir>/curves.png`` and prints where every second went.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers.utils import logging as hf_logging

from fastdistill.serve import VLLMServer
from fastdistill.sync import served_logprob_gap
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer
from fastdistill.train.evaluate import collect_scored_samples, eval_record

logger = logging.getLogger(__name__)

WORDS = ["cat", "dog", "sun", "tree", "bird", "fish", "milk", "star", "moon", "lamp", "book", "rain", "frog",
         "ship", "wolf", "bear", "cake", "door", "leaf", "rose"]


@dataclass(frozen=True)
class Example:
    """One toy chat exchange: a question and its deterministic answer."""

    question: str
    answer: str


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and step counts of one demo run."""

    teacher_steps: int = 300
    teacher_batch: int = 32
    teacher_lr: float = 3e-3
    student_hidden_size: int = 96
    student_intermediate_size: int = 192
    held_out: int = 32
    distill_epochs: float = 56.0
    batch_size: int = 32
    learning_rate: float = 5e-3
    warmup_ratio: float = 0.05
    temperature: float = 0.7  # rollouts closer to the greedy answers the held-out accuracy grades
    top_k: int = 8
    max_completion_length: int = 16
    max_staleness: int = 4
    eval_points: int = 8


QUICK = DemoSettings(teacher_steps=40, held_out=8, distill_epochs=0.3, batch_size=8, eval_points=2)

PHRASINGS = {
    "add": ("What is {a} + {b}?", "Add {a} and {b}.", "{a} plus {b} makes?"),
    "count": ("Count to {n}.", "Count from 1 to {n}.", "List the numbers 1 to {n}."),
    "reverse": ("Spell '{w}' backwards.", "Reverse the word '{w}'.", "Write '{w}' in reverse."),
}


def toy_task() -> list[list[Example]]:
    """Single-digit additions, counting to n and spelling short words backwards: 129 facts, each a list of the same
    question in three phrasings with one answer (387 examples)."""
    facts = [[Example(q.format(a=a, b=b), str(a + b)) for q in PHRASINGS["add"]] for a in range(10) for b in range(10)]
    facts += [[Example(q.format(n=n), " ".join(str(i) for i in range(1, n + 1))) for q in PHRASINGS["count"]]
              for n in range(1, 10)]
    facts += [[Example(q.format(w=word), word[::-1]) for q in PHRASINGS["reverse"]] for word in WORDS]
    return facts


def split_task(facts: list[list[Example]], held_out: int, rng: random.Random) -> tuple[list[Example], list[Example]]:
    """(training examples, held-out examples): one phrasing of ``held_out`` facts is held out; the student trains on
    every other prompt, so a held-out prompt asks a fact it has only met in other words."""
    chosen = set(rng.sample(range(len(facts)), held_out))
    train, held = [], []
    for index, phrasings in enumerate(facts):
        kept = rng.randrange(len(phrasings)) if index in chosen else None
        for which, example in enumerate(phrasings):
            (held if which == kept else train).append(example)
    return train, held


def prompt_ids(tokenizer: Any, example: Example) -> list[int]:
    """The chat-templated user turn followed by the assistant header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": example.question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def train_packed(model: torch.nn.Module, next_batch: Callable[[], list[tuple[list[int], list[int]]]], *,
                 steps: int, lr: float) -> list[float]:
    """Cross-entropy on the targets of ``steps`` batches of (prompt ids, target ids) pairs from ``next_batch()``,
    each batch packed in one row without padding (position ids restart per pair, prompt tokens untrained), AdamW
    with a one-cycle LR schedule. Returns the per-step losses (nats per target token)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    losses = []
    model.train()
    for _ in range(steps):
        ids, positions, labels = [], [], []
        for prompt, target in next_batch():
            ids += prompt + target
            positions += range(len(prompt) + len(target))
            labels += [-100] * len(prompt) + target
        loss = model(torch.tensor([ids]), position_ids=torch.tensor([positions]), labels=torch.tensor([labels]),
                     use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def train_on_answers(model: torch.nn.Module, tokenizer: Any, pairs: list[tuple[str, str]], *, steps: int,
                     batch: int, lr: float, rng: random.Random) -> list[float]:
    """Cross-entropy on the answers of (question, answer) chat pairs (prompt tokens untrained), ``batch`` random
    pairs packed per step (:func:`train_packed`). Returns the per-step losses."""

    def next_batch() -> list[tuple[list[int], list[int]]]:
        return [(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False),
                 tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id])
                for question, answer in rng.sample(pairs, batch)]

    return train_packed(model, next_batch, steps=steps, lr=lr)


def server_accuracy(url: str, tokenizer: Any, rows: list[dict[str, Any]], max_tokens: int) -> float:
    """Exact-answer accuracy of a server's greedy completions of ``rows`` (``{"prompt_ids", "answer"}``), graded
    like the trainer's ``eval/exact_match`` (the server scores its own answers: only the completions matter)."""
    samples = collect_scored_samples(url, {"default": url}, rows, top_k=1, max_tokens=max_tokens)
    record = eval_record(torch.zeros(1, 2, dtype=torch.float64), samples, ["default"],
                         answers=[row["answer"] for row in rows], tokenizer=tokenizer)
    return record["eval/exact_match"]


def core_layout() -> tuple[list[int] | None, list[int] | None]:
    """(the student server's cores, the cores the teacher server and the trainer share): disjoint halves of this
    process's cores, as on separate GPUs; (None, None) with a single core.

    The student server decodes all the time, while the teacher scores and the trainer steps in bursts, so the
    student gets a half of its own (the split layout of ``benchmarks/bench_e2e.py``, which trains faster than both
    servers on one core and the trainer on the other: ``--layout`` in benchmarks/RESULTS.md), and no weight sync waits
    for a server that shares its core with the teacher."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def smoothed(values: list[float], window: int = 9) -> list[float]:
    """Centred moving average of ``values`` over ``window`` points (fewer at the ends), NaN entries left out; NaN
    where a window holds none."""
    half = max(0, window // 2)
    out = []
    for i in range(len(values)):
        kept = [v for v in values[max(0, i - half): i + half + 1] if not math.isnan(v)]
        out.append(sum(kept) / len(kept) if kept else float("nan"))
    return out


def curves_figure(history: list[dict[str, float]], teacher_accuracy: float):
    """The demo's figure: training and held-out jsd per step, held-out accuracy against the teacher's, and per-step
    throughput and staleness (raw, faint, with a smoothed line over each); every legend sits below its panel."""
    import matplotlib  # optional (`fastdistill[demo]`): only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [h for h in history if "jsd" in h]
    steps = [h["step"] for h in trained]
    evals = [h for h in history if "eval/jsd" in h]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.8))
    left.plot(steps, [h["jsd"] for h in trained], label="train jsd/token (on-policy samples)")
    left.plot([h["step"] for h in evals], [h["eval/jsd"] for h in evals], "o--", label="held-out jsd/token")
    left.set_ylabel("nats per token")
    left.set_yscale("log")
    left.set_title("divergence to the teacher")
    middle.plot([h["step"] for h in evals], [100 * h.get("eval/exact_match", float("nan")) for h in evals], "o-",
                label="student (greedy)")
    middle.axhline(100 * teacher_accuracy, linestyle="--", color="gray", label="teacher")
    middle.set_ylim(-2, 102)
    middle.set_ylabel("% exact answers")
    middle.set_title("held-out accuracy")
    throughput = [h.get("perf/trained_tok_s_wall_clock", float("nan")) for h in trained]
    right.plot(steps, throughput, color="tab:blue", alpha=0.3, linewidth=0.8)
    right.plot(steps, smoothed(throughput), color="tab:blue", label="trained tokens/s (smoothed)")
    right.set_ylabel("trained tokens/s")
    staleness = right.twinx()  # optimizer steps: a scale of its own
    stale = [h.get("sample/staleness_mean", float("nan")) for h in trained]
    staleness.plot(steps, stale, color="tab:orange", alpha=0.3, linewidth=0.8)
    staleness.plot(steps, smoothed(stale), color="tab:orange", label="mean staleness, optimizer steps (smoothed)")
    staleness.set_ylabel("optimizer steps")
    right.set_title("throughput and staleness (faint: per step)")
    handles = right.get_legend_handles_labels()
    twin_handles = staleness.get_legend_handles_labels()
    for axes, (lines, labels) in ((left, left.get_legend_handles_labels()),
                                  (middle, middle.get_legend_handles_labels()),
                                  (right, (handles[0] + twin_handles[0], handles[1] + twin_handles[1]))):
        axes.set_xlabel("optimizer step")
        # below the x label, outside the plotting area: never over the data
        axes.legend(lines, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False,
                    fontsize="small")
    figure.tight_layout()
    return figure


def plot_curves(history: list[dict[str, float]], teacher_accuracy: float, path: Path) -> None:
    """Write :func:`curves_figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt  # optional, as in curves_figure

    figure = curves_figure(history, teacher_accuracy)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def run_demo(output_dir: Path, settings: DemoSettings, seed: int = 0) -> dict[str, Any]:
    """The whole demo; returns the report (also written to ``output_dir/report.json``)."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    output_dir.mkdir(parents=True, exist_ok=True)
    # a rerun starts afresh: the trainer refuses to append to an earlier run's ledgers
    shutil.rmtree(output_dir / "run", ignore_errors=True)
    rng = random.Random(seed)
    torch.manual_seed(seed)

    facts = toy_task()
    examples = [example for phrasings in facts for example in phrasings]
    corpus = ["user", "assistant"] + [text for ex in examples for text in (ex.question, ex.answer)]
    tokenizer = build_tokenizer(corpus)
    train_examples, held_out = split_task(facts, settings.held_out, rng)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    teacher = build_model(tiny_config(len(tokenizer), hidden_size=128, intermediate_size=256, **special), seed=seed)
    student = build_model(tiny_config(len(tokenizer), hidden_size=settings.student_hidden_size,
                                      intermediate_size=settings.student_intermediate_size, **special), seed=seed + 1)
    logger.info("task: %d training prompts, %d held-out prompts (new phrasings); vocabulary %d; teacher %s "
                "parameters, student %s", len(train_examples), len(held_out), len(tokenizer),
                f"{teacher.num_parameters():,}", f"{student.num_parameters():,}")

    phase = time.perf_counter()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    losses = train_on_answers(teacher, tokenizer, [(ex.question, ex.answer) for ex in examples],
                              steps=settings.teacher_steps, batch=settings.teacher_batch, lr=settings.teacher_lr,
                              rng=rng)
    teacher_s = time.perf_counter() - phase
    logger.info("teacher trained in %.0f s: loss %.2f -> %.3f", teacher_s, losses[0], sum(losses[-10:]) / 10)
    teacher_dir = save_pretrained_dir(teacher.eval(), tokenizer, output_dir / "models" / "teacher")
    student_dir = save_pretrained_dir(student, tokenizer, output_dir / "models" / "student")

    train_rows = [{"prompt": [{"role": "user", "content": ex.question}]} for ex in train_examples]
    held_rows = [{"prompt": [{"role": "user", "content": ex.question}], "answer": ex.answer} for ex in held_out]
    student_cores, shared_cores = core_layout()
    logs = output_dir / "logs"
    logs.mkdir(exist_ok=True)
    phase = time.perf_counter()
    student_server = VLLMServer(student_dir, role="student", weight_transfer_backend="gloo",
                                log_path=logs / "student.log", cpus=student_cores)
    teacher_server = VLLMServer(teacher_dir, role="teacher", log_path=logs / "teacher.log", cpus=shared_cores)
    with student_server, teacher_server:
        servers_s = time.perf_counter() - phase
        logger.info("vLLM servers up in %.0f s: student %s, teacher %s", servers_s, student_server.url,
                    teacher_server.url)
        if shared_cores:
            os.sched_setaffinity(0, shared_cores)
        torch.set_num_threads(1)
        teacher_urls = {"default": teacher_server.url}
        phase = time.perf_counter()
        held_ids = [{"prompt_ids": prompt_ids(tokenizer, ex), "answer": ex.answer} for ex in held_out]
        teacher_accuracy = server_accuracy(teacher_server.url, tokenizer, held_ids, settings.max_completion_length)
        teacher_eval_s = time.perf_counter() - phase
        steps_estimate = math.ceil(settings.distill_epochs * len(train_rows) / settings.batch_size)
        config = AsyncDistillationConfig(
            model_name_or_path=str(student_dir), output_dir=str(output_dir / "run"),
            vllm_server_base_url=student_server.url, teacher_server_urls=teacher_urls,
            learning_rate=settings.learning_rate, lr_scheduler_type="cosine", warmup_ratio=settings.warmup_ratio,
            num_train_epochs=settings.distill_epochs, per_device_train_batch_size=settings.batch_size,
            token_budget=0, teacher_top_k=settings.top_k, max_completion_length=settings.max_completion_length,
            max_staleness=settings.max_staleness, gradient_checkpointing=False, save_strategy="no",
            temperature=settings.temperature, export_final_model=False, seed=seed, heartbeat_stale_after_s=60.0,
            disable_tqdm=not sys.stderr.isatty(), eval_steps=max(1, steps_estimate // settings.eval_points),
        )
        (output_dir / "config.yaml").write_text(_yaml(config.to_masked_dict()))
        trainer = AsyncDistillationTrainer(config, train_dataset=train_rows, eval_dataset=held_rows,
                                           tokenizer=tokenizer)
        summary = trainer.train()
        history = trainer.metrics.history
        # the served weights are the trainer's: checked once at the end (verify_weight_sync would check every sync,
        # a server round trip each)
        phase = time.perf_counter()
        trainer.hf_model.eval()
        served_gap = served_logprob_gap(student_server.url, trainer.hf_model, [row["prompt_ids"] for row in held_ids])
        verify_s = time.perf_counter() - phase
    runtime = time.perf_counter() - started
    evals = [h for h in history if "eval/jsd" in h]
    first, last = evals[0], evals[-1]
    mean = lambda key: _mean([h[key] for h in history if key in h])  # noqa: E731
    report = {
        "jsd_before": first["eval/jsd"],
        "jsd_after": last["eval/jsd"],
        "jsd_reduction": 1.0 - last["eval/jsd"] / first["eval/jsd"] if first["eval/jsd"] > 0 else 0.0,
        "accuracy_before": first["eval/exact_match"],
        "accuracy_after": last["eval/exact_match"],
        "teacher_accuracy": teacher_accuracy,
        "held_out_curve": [{"step": h["step"], "jsd": h["eval/jsd"], "accuracy": h["eval/exact_match"]}
                           for h in evals],
        "trained_tokens_per_s": summary["trained_tokens_per_s"],
        "steps": summary["steps"],
        "model_version": summary["model_version"],
        "staleness_mean": mean("sample/staleness_mean"),
        "dropped_stale_total": sum(h.get("sample/dropped_stale_total", 0.0) for h in history),
        "served_logprob_gap": served_gap,
        "time_s": {
            "total": runtime, "teacher_training": teacher_s, "server_startup": servers_s,
            "teacher_accuracy": teacher_eval_s, "distillation": summary["time_s"]["total"], "final_check": verify_s,
            "rest": runtime - teacher_s - servers_s - teacher_eval_s - summary["time_s"]["total"] - verify_s,
        },
        "distillation_time_s": summary["time_s"],
        "settings": settings.__dict__,
    }
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    plot_curves(history, teacher_accuracy, output_dir / "curves.png")
    return report


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _yaml(values: dict[str, Any]) -> str:
    return yaml.safe_dump(values, sort_keys=False)


# How the distillation phases are named in the report (the trainer's PhaseClock names).
PHASE_NAMES = {"fwd_bwd": "forward+backward", "weight_sync": "weight sync", "sync_verify": "sync verification",
               "rollout_wait": "waiting for rollouts", "collect": "batching", "pack": "packing",
               "optimizer": "optimizer", "grad_clip": "grad clipping", "bookkeeping": "step metrics",
               "logging": "logging", "eval": "held-out evaluation", "startup": "start-up", "shutdown": "shut-down",
               "export": "export", "checkpoint": "checkpoints", "other": "unmeasured Python"}


def print_report(report: dict[str, Any], output_dir: Path) -> None:
    """The demo's result, on stdout (the program's output; progress goes to the ``fastdistill.demo`` logger)."""
    t = report["time_s"]
    print(f"[demo] held-out jsd {report['jsd_before']:.3f} -> {report['jsd_after']:.3f} nats/token "
          f"({report['jsd_reduction']:.0%} lower); accuracy {report['accuracy_before']:.0%} -> "
          f"{report['accuracy_after']:.0%} (teacher {report['teacher_accuracy']:.0%})")
    curve = ", ".join(f"{p['step']}: {p['jsd']:.2f}/{p['accuracy']:.0%}" for p in report["held_out_curve"])
    print(f"[demo] held-out jsd/accuracy by step: {curve}")
    print(f"[demo] {report['steps']} steps, {report['trained_tokens_per_s']:.0f} trained tokens/s, mean staleness "
          f"{report['staleness_mean']:.2f} optimizer steps, {report['dropped_stale_total']:.0f} stale samples dropped, "
          f"served-vs-trainer log-prob gap after the last sync {report['served_logprob_gap']:.1e}")
    print(f"[demo] time: total {t['total']:.0f} s = teacher training {t['teacher_training']:.0f} s + server startup "
          f"{t['server_startup']:.0f} s + teacher accuracy {t['teacher_accuracy']:.1f} s + distillation "
          f"{t['distillation']:.0f} s + final served-weights check {t['final_check']:.1f} s + setup {t['rest']:.1f} s")
    phases = {k: v for k, v in report["distillation_time_s"].items() if k != "total"}
    parts = ", ".join(f"{PHASE_NAMES.get(k, k)} {v:.1f} s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])
                      if v >= 0.05)
    print(f"[demo] distillation {report['distillation_time_s']['total']:.0f} s = {parts}")
    print(f"[demo] wrote {output_dir / 'report.json'} and {output_dir / 'curves.png'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastdistill demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("demo_output"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny run that only shows the pipeline works (tests)")
    args = parser.parse_args(argv)
    _show_progress()
    report = run_demo(args.output_dir, QUICK if args.quick else DemoSettings(), seed=args.seed)
    print_report(report, args.output_dir)
    if args.quick:
        return 0
    if not (report["jsd_after"] <= 0.5 * report["jsd_before"]
            and report["accuracy_after"] >= 0.8 * report["teacher_accuracy"]):
        logger.error("FAILED: distillation did not halve the held-out divergence and reach 80%% of the teacher's "
                     "accuracy")
        return 1
    return 0


def _show_progress() -> None:
    """Show the ``fastdistill`` loggers' INFO messages on stderr, unless a handler already does (``fastdistill demo``
    runs under the CLI's; ``python -m fastdistill.demo`` has none)."""
    package = logging.getLogger("fastdistill")
    if package.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fastdistill: %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET or package.level > logging.INFO:
        package.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
