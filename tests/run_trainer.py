"""Run the trainer on synthetic samples (a helper for tests that need separate processes, e.g. torchrun).

``python tests/run_trainer.py spec.json``: the spec holds ``student_dir``, ``output_dir``, ``num_samples``, ``seed`` and
``config`` (fields of AsyncDistillationConfig), optionally ``eval_samples`` (that many more samples form the held-out
set; the servers' part of the evaluation is replaced by them). The samples are scored by a tiny teacher built from
``seed``, so every process (and every rank) sees the same ones.
"""

from __future__ import annotations

import json
import sys

import torch

from fastdistill.tiny import build_model, build_tokenizer, tiny_config
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.trainer import AsyncDistillationTrainer
from fastdistill_testing.synthetic import synthetic_samples


def teacher_and_samples(num_samples: int, seed: int, teacher_ids: list[str]):
    tokenizer = build_tokenizer()
    teacher = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=seed + 100).eval()
    return synthetic_samples(teacher, len(tokenizer), num_samples, teacher_ids=teacher_ids, seed=seed)


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(open(spec_path).read())
    config = AsyncDistillationConfig(model_name_or_path=spec["student_dir"], output_dir=spec["output_dir"],
                                     **spec["config"])
    held_out = spec.get("eval_samples", 0)
    samples = teacher_and_samples(spec["num_samples"] + held_out, spec["seed"], config.teacher_ids)
    samples, eval_samples = samples[: spec["num_samples"]], samples[spec["num_samples"]:]
    eval_rows = None
    if held_out:  # the held-out samples stand in for what the servers would answer
        import fastdistill.train.evaluate as evaluate

        evaluate.collect_scored_samples = lambda *args, **kwargs: eval_samples
        eval_rows = [{"prompt_ids": s.input_ids[: s.prompt_length].tolist(), "teacher_id": s.teacher_id}
                     for s in eval_samples]
    trainer = AsyncDistillationTrainer(config, samples=samples, eval_dataset=eval_rows)
    summary = trainer.train()
    if trainer.dist.is_main:
        print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
