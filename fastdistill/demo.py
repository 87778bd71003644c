"""``fastdistill demo``: asynchronous on-policy distillation of a tiny student from a tiny teacher, end to end on CPU.

1. Builds a toy chat task in code (single-digit additions, counting, spelling short words backwards), a byte-level
   BPE tokenizer with a chat template, a TEACHER trained on the task with cross-entropy (seconds on 2 cores), and a
   fresh STUDENT with the same vocabulary.
2. Starts two real vLLM servers: the teacher (``--max-logprobs -1``) and the student (dev mode, fastdistill's
   ``gloo`` weight-transfer engine), with several cores pinned to one half of them and the trainer to the other.
3. Measures the student on held-out prompts (jsd per token on its own greedy answers as scored by the teacher, and
   exact-answer accuracy), runs :class:`~fastdistill.train.AsyncDistillationTrainer` (rollout worker, queue,
   staleness, fused loss, weight sync after every step), and measures again.
4. Writes ``<output-dir>/report.json`` and ``<output-dir>/curves.png`` and prints where the time went.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

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

    teacher_steps: int = 200
    teacher_batch: int = 32
    teacher_lr: float = 3e-3
    held_out: int = 24
    distill_epochs: float = 40.0
    batch_size: int = 16
    learning_rate: float = 3e-3
    top_k: int = 8
    max_completion_length: int = 16
    max_staleness: int = 4


QUICK = DemoSettings(teacher_steps=40, held_out=8, distill_epochs=1.0, batch_size=8)


def toy_task() -> list[Example]:
    """Single-digit additions, counting to n and spelling short words backwards (129 examples)."""
    additions = [Example(f"What is {a} + {b}?", str(a + b)) for a in range(10) for b in range(10)]
    counts = [Example(f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1))) for n in range(1, 10)]
    reversals = [Example(f"Spell '{word}' backwards.", word[::-1]) for word in WORDS]
    return additions + counts + reversals


def prompt_ids(tokenizer: Any, example: Example) -> list[int]:
    """The chat-templated user turn followed by the assistant header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": example.question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def train_on_answers(model: torch.nn.Module, tokenizer: Any, pairs: list[tuple[str, str]], *, steps: int,
                     batch: int, lr: float, rng: random.Random) -> list[float]:
    """Cross-entropy on the answers of (question, answer) chat pairs (prompt tokens untrained), in packed rows
    without padding, with a one-cycle LR schedule. Returns the per-step losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    losses = []
    model.train()
    for _ in range(steps):
        ids, positions, labels = [], [], []
        for question, answer in rng.sample(pairs, batch):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            target = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
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


def server_accuracy(student_url: str, tokenizer: Any, examples: list[Example], rows: list[dict]) -> float:
    """Fraction of prompts whose greedy completion from the server decodes to exactly the reference answer."""
    import asyncio

    from fastdistill.rollout import StudentClient

    async def answers() -> list[list[int]]:
        async with StudentClient(student_url) as client:
            results = await asyncio.gather(*(client.generate(row["prompt_ids"], max_tokens=16, temperature=0.0)
                                             for row in rows))
            return [r.token_ids.tolist() for r in results]

    decoded = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in asyncio.run(answers())]
    return sum(a == ex.answer for a, ex in zip(decoded, examples, strict=True)) / len(examples)


def core_layout() -> tuple[list[int] | None, list[int] | None]:
    """(the student server's cores, the cores the teacher server and the trainer share): disjoint halves of this
    process's cores, as on separate GPUs; (None, None) with a single core.

    The student server decodes all the time, while the teacher scores and the trainer steps in bursts, so the
    student gets a half of its own (the split layout of ``benchmarks/bench_e2e.py``). Measured on 2 cores against
    both servers on one core and the trainer on the other: about 1.5x the trained tokens per second, and no weight sync
    waiting for a server that shares its core with the teacher."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def plot_curves(history: list[dict[str, float]], held_out: list[tuple[int, float]], path: Path) -> None:
    """Training jsd per step and held-out jsd before/after, plus throughput, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [h.get("jsd", float("nan")) for h in history], label="train jsd/token (on-policy samples)")
    left.plot([s for s, _ in held_out], [v for _, v in held_out], "o--", label="held-out jsd/token")
    left.set_xlabel("optimizer step")
    left.set_ylabel("nats per token")
    left.set_yscale("log")
    left.legend()
    left.set_title("divergence to the teacher")
    right.plot(steps, [h.get("perf/trained_tok_s_wall_clock", float("nan")) for h in history],
               label="trained tokens/s")
    right.plot(steps, [h.get("sample/staleness_mean", float("nan")) for h in history], label="staleness (versions)")
    right.set_xlabel("optimizer step")
    right.legend()
    right.set_title("throughput and staleness")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run_demo(output_dir: Path, settings: DemoSettings, seed: int = 0) -> dict[str, Any]:
    """The whole demo; returns the report (also written to ``output_dir/report.json``)."""
    from transformers.utils import logging as hf_logging

    from fastdistill.serve import VLLMServer
    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer
    from fastdistill.train.evaluate import collect_scored_samples, divergence_per_token

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    output_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    torch.manual_seed(seed)

    examples = toy_task()
    corpus = ["user", "assistant"] + [text for ex in examples for text in (ex.question, ex.answer)]
    tokenizer = build_tokenizer(corpus)
    shuffled = rng.sample(examples, len(examples))
    held_out, train_examples = shuffled[: settings.held_out], shuffled[settings.held_out:]
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    teacher = build_model(tiny_config(len(tokenizer), hidden_size=128, intermediate_size=256, **special), seed=seed)
    student = build_model(tiny_config(len(tokenizer), **special), seed=seed + 1)
    logger.info("task: %d training prompts, %d held out; vocabulary %d; teacher %s parameters, student %s",
                len(train_examples), len(held_out), len(tokenizer), f"{teacher.num_parameters():,}",
                f"{student.num_parameters():,}")

    phase = time.perf_counter()
    losses = train_on_answers(teacher, tokenizer, [(ex.question, ex.answer) for ex in examples],
                              steps=settings.teacher_steps, batch=settings.teacher_batch, lr=settings.teacher_lr,
                              rng=rng)
    teacher_s = time.perf_counter() - phase
    logger.info("teacher trained in %.0f s: loss %.2f -> %.3f", teacher_s, losses[0], sum(losses[-10:]) / 10)
    teacher_dir = save_pretrained_dir(teacher.eval(), tokenizer, output_dir / "models" / "teacher")
    student_dir = save_pretrained_dir(student, tokenizer, output_dir / "models" / "student")

    train_rows = [{"prompt": [{"role": "user", "content": ex.question}]} for ex in train_examples]
    held_rows = [{"prompt_ids": prompt_ids(tokenizer, ex)} for ex in held_out]
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

        def held_out_jsd(model: torch.nn.Module) -> float:
            samples = collect_scored_samples(student_server.url, teacher_urls, held_rows, top_k=settings.top_k,
                                             max_tokens=settings.max_completion_length)
            return divergence_per_token(model, samples, ["default"])

        student.eval()
        jsd_before = held_out_jsd(student)
        accuracy_before = server_accuracy(student_server.url, tokenizer, held_out, held_rows)
        teacher_accuracy = server_accuracy(teacher_server.url, tokenizer, held_out, held_rows)
        logger.info("before: held-out jsd %.3f nats/token, student accuracy %.0f%% (teacher %.0f%%)", jsd_before,
                    100 * accuracy_before, 100 * teacher_accuracy)

        config = AsyncDistillationConfig(
            model_name_or_path=str(student_dir), output_dir=str(output_dir / "run"),
            vllm_server_base_url=student_server.url, teacher_server_urls=teacher_urls,
            learning_rate=settings.learning_rate, lr_scheduler_type="constant",
            num_train_epochs=settings.distill_epochs,
            per_device_train_batch_size=settings.batch_size, token_budget=0, teacher_top_k=settings.top_k,
            max_completion_length=settings.max_completion_length, max_staleness=settings.max_staleness,
            gradient_checkpointing=False, save_strategy="no", export_final_model=False, seed=seed,
            heartbeat_stale_after_s=60.0, verify_weight_sync=True, disable_tqdm=not sys.stderr.isatty(),
        )
        (output_dir / "config.yaml").write_text(_yaml(config.to_dict()))
        trainer = AsyncDistillationTrainer(config, train_dataset=train_rows, tokenizer=tokenizer)
        summary = trainer.train()
        history = trainer.metrics.history
        trainer.hf_model.eval()
        jsd_after = held_out_jsd(trainer.hf_model)
        accuracy_after = server_accuracy(student_server.url, tokenizer, held_out, held_rows)
    runtime = time.perf_counter() - started
    mean = lambda key: _mean([h[key] for h in history if key in h])  # noqa: E731
    report = {
        "jsd_before": jsd_before,
        "jsd_after": jsd_after,
        "jsd_reduction": 1.0 - jsd_after / jsd_before if jsd_before > 0 else 0.0,
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "teacher_accuracy": teacher_accuracy,
        "trained_tokens_per_s": summary["trained_tokens_per_s"],
        "steps": summary["steps"],
        "model_version": summary["model_version"],
        "staleness_mean": mean("sample/staleness_mean"),
        "dropped_stale_total": sum(h.get("sample/dropped_stale_total", 0.0) for h in history),
        "max_served_logprob_gap": max((h.get("sync/served_logprob_gap", 0.0) for h in history), default=None),
        "time_s": {
            "total": runtime, "teacher_training": teacher_s, "server_startup": servers_s,
            "distillation": summary["train_seconds"],
            "rollout_wait": sum(h.get("perf/rollout_wait_s", 0.0) for h in history),
            "forward_backward": sum(h.get("perf/fwd_bwd_s", 0.0) for h in history),
            "optimizer": sum(h.get("perf/optimizer_s", 0.0) for h in history),
            "weight_sync": sum(h.get("perf/weight_sync_s", 0.0) for h in history),
        },
        "settings": settings.__dict__,
    }
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    plot_curves(history, [(0, jsd_before), (summary["steps"], jsd_after)], output_dir / "curves.png")
    return report


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _yaml(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False)


def print_report(report: dict[str, Any], output_dir: Path) -> None:
    """The demo's result, on stdout (the program's output; progress goes to the ``fastdistill.demo`` logger)."""
    t = report["time_s"]
    print(f"[demo] held-out jsd {report['jsd_before']:.3f} -> {report['jsd_after']:.3f} nats/token "
          f"({report['jsd_reduction']:.0%} lower); accuracy {report['accuracy_before']:.0%} -> "
          f"{report['accuracy_after']:.0%} (teacher {report['teacher_accuracy']:.0%})")
    print(f"[demo] {report['steps']} steps, {report['trained_tokens_per_s']:.0f} trained tokens/s, mean staleness "
          f"{report['staleness_mean']:.2f} versions, {report['dropped_stale_total']:.0f} stale samples dropped, "
          f"max served-vs-trainer log-prob gap after a sync {report['max_served_logprob_gap']:.1e}")
    print(f"[demo] time: total {t['total']:.0f} s = teacher training {t['teacher_training']:.0f} s + server startup "
          f"{t['server_startup']:.0f} s + distillation {t['distillation']:.0f} s (waiting for rollouts "
          f"{t['rollout_wait']:.1f} s, forward+backward {t['forward_backward']:.1f} s, optimizer {t['optimizer']:.1f} "
          f"s, weight sync {t['weight_sync']:.1f} s) + evaluation")
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
    if not (report["jsd_after"] <= 0.5 * report["jsd_before"] and report["accuracy_after"] > report["accuracy_before"]):
        logger.error("FAILED: distillation did not halve the held-out divergence and raise the accuracy")
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
