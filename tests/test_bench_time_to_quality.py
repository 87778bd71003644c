"""Time to quality in benchmarks/bench_e2e.py (benchmarks/e2e_quality.py, e2e_tasks.py) on synthetic curves and
snapshot records (no servers): the snapshot clock (earlier snapshots' costs taken off), generated tokens with thrown
away samples, the first crossing, medians with runs that never reach a target, the report's shape, the snapshotter's
files and the tasks' text."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


quality = load("e2e_quality")
tasks = load("e2e_tasks")


def curve(seconds, jsds, tokens=None):
    tokens = tokens or [100.0 * (i + 1) for i in range(len(seconds))]
    return [{"step": 4 * (i + 1), "seconds": s, "generated_tokens": t, "held_out_jsd": j}
            for i, (s, j, t) in enumerate(zip(seconds, jsds, tokens, strict=True))]


def test_the_snapshot_clock_takes_every_earlier_snapshots_cost_off():
    records = [{"step": 4, "time": 1010.0, "cost_s": 0.5}, {"step": 8, "time": 1020.0, "cost_s": 0.25},
               {"step": 10, "time": 1030.0, "cost_s": 1.0}]
    tokens = [10.0 * (i + 1) for i in range(10)]
    points = quality.snapshot_clock(records, 1000.0, tokens)
    assert [p["seconds"] for p in points] == [10.0, 19.5, 29.25]
    assert [p["generated_tokens"] for p in points] == [40.0, 80.0, 100.0]
    assert [p["step"] for p in points] == [4, 8, 10]
    with pytest.raises(ValueError, match="snapshot of step 11, but the run has 10 steps"):
        quality.snapshot_clock([{"step": 11, "time": 1001.0, "cost_s": 0.0}], 1000.0, tokens)
    with pytest.raises(ValueError, match="before the process started"):
        quality.snapshot_clock([{"step": 1, "time": 999.0, "cost_s": 0.0}], 1000.0, tokens)


def test_generated_tokens_count_thrown_away_samples_at_the_mean_sample_length():
    # step 1: 8 samples, 80 tokens, none dropped; step 2: 8 samples, 160 tokens, 4 dropped by then
    got = quality.generated_tokens_by_step([80.0, 160.0], [8.0, 8.0], [8.0, 20.0])
    assert got == pytest.approx([80.0, 240.0 + 4 * 240.0 / 16])
    with pytest.raises(ValueError, match="generated samples"):
        quality.generated_tokens_by_step([80.0], [8.0], [7.0])
    with pytest.raises(ValueError, match="different lengths"):
        quality.generated_tokens_by_step([80.0], [8.0, 8.0], [8.0])


def test_the_first_crossing_is_the_first_snapshot_at_or_below_the_target():
    points = curve([5.0, 10.0, 15.0, 20.0], [3.0, 2.5, 2.6, 2.4])
    assert quality.first_crossing(points, 2.5)["seconds"] == 10.0  # at the target counts
    assert quality.first_crossing(points, 2.45)["seconds"] == 20.0  # not the later rise, the first point below
    assert quality.first_crossing(points, 2.0) is None


def test_the_sustained_crossing_is_where_the_curve_stays_at_or_below_the_target():
    points = curve([5.0, 10.0, 15.0, 20.0], [2.4, 2.7, 2.5, 2.45])
    assert quality.sustained_crossing(points, 2.5)["seconds"] == 15.0  # the dip at 5 s does not last
    assert quality.sustained_crossing(points, 2.7)["seconds"] == 5.0
    assert quality.sustained_crossing(points, 2.44) is None  # the last snapshot is above
    report = quality.time_to_quality({"sync": [points]})
    assert report["sustained_each"]["sync"]["sync_final"] == [20.0]  # the target is its final 2.45
    assert report["each"]["sync"]["sync_final"] == [5.0]


def test_the_median_counts_a_target_not_reached_as_later_than_any():
    assert quality.median_or_none([3.0, None, 1.0]) == 3.0
    assert quality.median_or_none([None, None, 1.0]) is None
    assert quality.median_or_none([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert quality.median_or_none([1.0, 2.0, None, None]) is None  # a middle value not reached
    assert quality.median_or_none([1.0, 2.0, 3.0, None]) == 2.5
    with pytest.raises(ValueError):
        quality.median_or_none([])


def test_time_to_quality_targets_the_median_finals_of_trl_and_sync():
    curves = {
        "trl": [curve([10, 20, 30], [3.0, 2.8, 2.7]), curve([10, 20, 30], [3.0, 2.9, 2.9]),
                curve([10, 20, 30], [3.0, 2.6, 2.8])],  # finals 2.7, 2.9, 2.8: median 2.8
        "sync": [curve([8, 16, 24], [2.9, 2.6, 2.5])] * 3,  # final 2.5
        "async": [curve([5, 10, 15], [2.9, 2.7, 2.6], [50, 100, 150]),
                  curve([5, 10, 15], [2.8, 2.5, 2.4], [50, 100, 150]),
                  curve([5, 10, 15], [3.0, 2.9, 2.85], [50, 100, 150])],
    }
    report = quality.time_to_quality(curves)
    assert report["targets"] == pytest.approx({"trl_final": 2.8, "sync_final": 2.5})
    assert report["each"]["async"]["trl_final"] == [10, 5, None]
    assert report["seconds"]["async"]["trl_final"] == 10  # median of 5, 10, never
    assert report["generated_tokens"]["async"]["trl_final"] == 100
    assert report["each"]["async"]["sync_final"] == [None, 10, None]
    assert report["seconds"]["async"]["sync_final"] is None
    assert report["steps"]["async"]["sync_final"] == [None, 8, None]
    assert report["each"]["trl"]["trl_final"] == [20, None, 20]
    assert report["seconds"]["trl"]["trl_final"] == 20
    assert report["seconds"]["sync"]["sync_final"] == 24
    assert report["seconds"]["sync"]["trl_final"] == 16
    json.dumps(report)  # the shape bench_e2e writes: plain numbers and None
    assert set(report["seconds"]) == {"trl", "sync", "async"}
    assert all(set(row) == {"trl_final", "sync_final"} for row in report["seconds"].values())


def test_given_targets_replace_the_runs_own_and_a_missing_owner_leaves_its_target_out():
    curves = {"async": [curve([5, 10], [2.9, 2.4])], "sync": [curve([8, 16], [2.9, 2.6])]}
    assert quality.time_to_quality(curves)["targets"] == {"sync_final": 2.6}
    report = quality.time_to_quality(curves, {"trl_final": 2.95, "sync_final": 2.5})
    assert report["seconds"]["async"] == {"trl_final": 5, "sync_final": 10}
    assert report["seconds"]["sync"] == {"trl_final": 8, "sync_final": None}
    with pytest.raises(ValueError, match="unknown targets"):
        quality.time_to_quality(curves, {"final": 2.5})
    assert quality.ratio_or_none(5.0, 10.0) == 0.5
    assert quality.ratio_or_none(None, 10.0) is None and quality.ratio_or_none(5.0, None) is None


def test_the_snapshotter_saves_every_nth_step_and_the_last(tmp_path):
    model = torch.nn.Linear(3, 2)
    snapshot = quality.Snapshotter(tmp_path / "snaps", every=4, last_step=10)
    for step in range(1, 11):
        snapshot(step, model)
    records = quality.read_snapshots(tmp_path / "snaps")
    assert [r["step"] for r in records] == [4, 8, 10]
    assert all(r["cost_s"] >= 0.0 and not math.isnan(r["time"]) for r in records)
    saved = torch.load(records[-1]["path"], weights_only=True)
    assert torch.equal(saved["weight"], model.weight.detach())
    with pytest.raises(ValueError):
        quality.Snapshotter(tmp_path / "other", every=0, last_step=10)


def test_the_tasks_text_and_split():
    short, long = tasks.TASKS["short"], tasks.TASKS["long"]
    train, held = short.pairs(0)
    assert len(train) == 256 and len(held) == 32 and not set(train) & set(held)
    assert ("What is 3 plus 4?", "3+4=7.") in train + held
    train, held = long.pairs(0)
    question, answer = next(pair for pair in train + held if pair[0] == "What is 3 plus 4? Count on.")
    assert answer == "3+4=7. " + " ".join(str(n) for n in range(8, 8 + 128)) + "."
    assert long.max_completion_length > 128 + 8
