"""Where a run's time goes: the phase clock adds up, and a training run attributes every second."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from fastdistill.train import timing
from fastdistill.train.timing import PhaseClock

HERE = Path(__file__).parent


class FakeTime:
    """perf_counter that advances only when told (no dependence on the machine's speed)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_nested_phases_count_each_second_once(fake_time):
    clock = PhaseClock()
    clock.start()
    with clock.phase("startup"):
        fake_time.now += 2.0
        with clock.phase("weight_sync"):
            fake_time.now += 3.0
        fake_time.now += 1.0
    fake_time.now += 0.5  # between phases: "other"
    with clock.phase("collect"):
        fake_time.now += 4.0
    clock.move("collect", "rollout_wait", 2.5)
    clock.stop()
    totals = clock.totals()
    assert totals == {"collect": 1.5, "startup": 3.0, "weight_sync": 3.0, "rollout_wait": 2.5, "other": 0.5,
                      "total": 10.5}
    assert sum(v for k, v in totals.items() if k != "total") == totals["total"]


def test_a_phase_that_raises_is_still_counted(fake_time):
    clock = PhaseClock()
    clock.start()
    with pytest.raises(RuntimeError, match="boom"), clock.phase("eval"):
        fake_time.now += 1.0
        raise RuntimeError("boom")
    assert clock.take_step() == {"eval": 1.0}
    assert clock.take_step() == {}


def test_move_never_takes_more_than_the_phase_holds(fake_time):
    clock = PhaseClock()
    clock.start()
    with clock.phase("collect"):
        fake_time.now += 1.0
    clock.move("collect", "rollout_wait", 5.0)
    assert clock.take_step() == {"collect": 0.0, "rollout_wait": 1.0}


def test_totals_need_a_started_clock():
    with pytest.raises(RuntimeError, match="never started"):
        PhaseClock().totals()


def test_a_training_run_attributes_every_second(tmp_path):
    """The summary's phases add up to the run and each step's perf/*_s phases add up to its perf/step_s."""
    sys.path.insert(0, str(HERE))
    from run_trainer import teacher_and_samples

    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.trainer import AsyncDistillationTrainer

    tokenizer = build_tokenizer()
    student = save_pretrained_dir(build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7),
                                  tokenizer, tmp_path / "student")
    samples = teacher_and_samples(12, seed=3, teacher_ids=["default"])
    config = AsyncDistillationConfig(
        model_name_or_path=str(student), output_dir=str(tmp_path / "run"), weight_sync_backend="none",
        num_train_epochs=1, per_device_train_batch_size=4, gradient_checkpointing=False, disable_tqdm=True,
        save_strategy="steps", save_steps=2, token_budget=0, export_final_model=True)
    summary = AsyncDistillationTrainer(config, samples=samples).train()
    assert json.loads((tmp_path / "run" / "train_summary.json").read_text())["time_s"] == summary["time_s"]
    times = summary["time_s"]
    for phase in ("startup", "collect", "pack", "fwd_bwd", "grad_clip", "optimizer", "bookkeeping", "logging",
                  "checkpoint", "export", "shutdown"):
        assert times[phase] >= 0.0, phase
    assert math.isclose(sum(v for k, v in times.items() if k != "total"), times["total"], rel_tol=1e-9)
    assert 0.0 < times["total"] <= summary["wall_seconds"]  # the clock runs inside the summary's span
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for record in metrics:
        phases = sum(v for k, v in record.items() if k.startswith("perf/") and k.endswith("_s")
                     and k not in ("perf/step_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s",
                                   "perf/weight_sync_transfer_s", "perf/weight_sync_wait_s"))
        assert math.isclose(phases, record["perf/step_s"], rel_tol=1e-9, abs_tol=1e-12), record
