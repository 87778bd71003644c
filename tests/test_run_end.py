"""How a run ends: the export and a final checkpoint come before the last evaluation, a failed evaluation is counted
rather than fatal, and a non-finite loss stops the run before the optimizer steps (no servers: synthetic samples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_cases import offline_config, synthetic_run_samples, tiny_student_dir

import fastdistill.train.evaluate as evaluate
from fastdistill.errors import NonFiniteLossError, VLLMUnavailableError
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.trainer import AsyncDistillationTrainer

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def samples():
    return synthetic_run_samples(16)


def config(student_dir, output_dir, **overrides) -> AsyncDistillationConfig:
    return offline_config(student_dir, output_dir, **{**dict(per_device_train_batch_size=4), **overrides})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_rows(samples):
    return [{"prompt_ids": s.input_ids[: s.prompt_length].tolist(), "teacher_id": s.teacher_id} for s in samples]


def test_a_failing_final_evaluation_loses_neither_the_export_nor_the_checkpoint(tmp_path, student_dir, samples,
                                                                                   monkeypatch):
    """The servers answer the first evaluation (one of its three rows failed) and none of the last; the run still
    ends with its final model, a checkpoint of its last step (save_steps=3 does not divide 4) and both
    evaluations' counts; the export and the checkpoint exist before the last evaluation starts."""
    held_out = samples[:3]
    calls = []
    out = tmp_path / "run"

    def collect(*args, **kwargs):
        calls.append([p.name for p in out.iterdir()])
        if len(calls) == 1:
            return held_out[1:]  # row 0's rollout failed
        raise VLLMUnavailableError("the student server went away")

    monkeypatch.setattr(evaluate, "collect_scored_samples", collect)
    trainer = AsyncDistillationTrainer(
        config(student_dir, out, export_final_model=True, save_strategy="steps", save_steps=3),
        samples=samples, eval_dataset=eval_rows(held_out))
    summary = trainer.train()
    assert summary["steps"] == 4 and len(calls) == 2
    assert {"final", "checkpoint-3", "checkpoint-4"} <= set(calls[1])  # before the last evaluation
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/samples_total" in r]
    assert [(r["step"], r["eval/samples_total"], r["eval/failed_total"]) for r in evals] == [(0, 2.0, 1.0),
                                                                                             (4, 0.0, 3.0)]
    assert "eval/jsd" in evals[0] and "eval/jsd" not in evals[1]  # nothing scored: no divergence is made up


def test_a_non_finite_loss_stops_before_the_optimizer_steps(tmp_path, student_dir, samples):
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path / "run"), samples=samples)
    head = trainer.hf_model.get_output_embeddings().weight
    with torch.no_grad():
        head[3, 0] = float("nan")
    before = {name: p.detach().clone() for name, p in trainer.hf_model.named_parameters()}
    with pytest.raises(NonFiniteLossError, match=r"step 1: the loss is not finite .*did not step"):
        trainer.train()
    for name, p in trainer.hf_model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, equal_nan=True, msg=name)
    trained = tmp_path / "run" / "trained_prompts.jsonl"
    assert not trained.exists() or read_jsonl(trained) == []


def served():
    from fastdistill.rollout import ServedModel

    return {"student": ServedModel("s", 40), "a": ServedModel("ta", 64), "b": ServedModel("tb", 34)}


def test_eval_rows_are_checked_like_training_rows(tmp_path, student_dir, samples):
    """A held-out row that cannot fit a server is a ConfigError naming it, or with skip_long_prompts left out of every
    evaluation and counted (it once failed the evaluation, and the run with it, at its first step)."""
    from fastdistill.errors import ConfigError

    rows = [{"prompt_ids": [5] * length, "teacher_id": teacher}
            for length, teacher in [(10, "a"), (30, "a"), (25, "b")]]
    refusing = AsyncDistillationTrainer(config(student_dir, tmp_path / "a", max_completion_length=11),
                                        samples=samples, eval_dataset=rows)
    with pytest.raises(ConfigError, match=r"^eval_dataset: 2 of 3 rows do not fit the servers: row 1 needs 41 tokens "
                       r"with max_completion_length=11, but the student server serves max_model_len=40\. .*"
                       r"skip_long_prompts=True"):
        refusing.evaluator.check_rows(served())
    skipping = AsyncDistillationTrainer(config(student_dir, tmp_path / "b", max_completion_length=11,
                                               skip_long_prompts=True), samples=samples, eval_dataset=rows)
    skipping.evaluator.check_rows(served())
    assert [len(row["prompt_ids"]) for row in skipping.evaluator.rows] == [10] and skipping.evaluator.too_long == 2
    with pytest.raises(ConfigError, match="3 of 3 rows do not fit"):
        AsyncDistillationTrainer(config(student_dir, tmp_path / "c", max_completion_length=40, skip_long_prompts=True),
                                 samples=samples, eval_dataset=rows).evaluator.check_rows(served())
