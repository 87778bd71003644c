"""Smoke test of benchmarks/bench_estimators.py at tiny sizes (``--quick``): it runs, prints its tables, and the JSON
holds every estimator at every lag with finite held-out divergences and gradient figures. No performance figure is
asserted (three steps say nothing about the estimators, and the machine may be busy)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_estimators.py"
ESTIMATORS = ["dense_fkl", "topk_fkl", "teacher_sampled_fkl", "dense_rkl", "topk_rkl", "realised_rkl",
              "single_sample_rkl", "single_sample_is", "multi_sample_rkl", "student_topk_rkl", "ppo_clip",
              "decoupled_ppo", "m2po", "ppo_clip_rollout_adv"]
KEYS = ("held_out_forward_kl", "held_out_reverse_kl", "on_policy_reverse_kl")


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@pytest.mark.slow
def test_bench_estimators_quick(tmp_path):
    out, png = tmp_path / "estimators.json", tmp_path / "plot.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--lags", "0", "2", "--grad-lags", "0", "2", "--json", str(out),
           "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "held-out KL(S‖T)" in proc.stdout and "gradient at fixed weights" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "bench_estimators"
    assert list(report["summary"]) == ESTIMATORS == list(report["estimators"])
    for name, info in report["estimators"].items():
        assert info["family"] == ("forward" if name.endswith("_fkl") else "reverse")
        assert info["implementation"].startswith("local reference" if name == "ppo_clip_rollout_adv" else "fastdistill")
    for by_lag in report["summary"].values():
        assert list(by_lag) == ["0", "2"]
        for row in by_lag.values():
            assert set(row) == set(KEYS)
            assert all(_finite(row[k]["mean"]) and row[k]["mean"] > 0 and _finite(row[k]["std"]) for k in KEYS)
    assert len(report["runs"]) == len(ESTIMATORS) * 2  # one seed in quick mode
    assert all(set(KEYS) <= set(r) and all(_finite(r[k]) for k in KEYS) for r in report["runs"])
    gradients = report["gradients"]
    assert list(gradients["by_lag"]) == ["0", "2"]
    assert all(_finite(v) and v > 0 for v in gradients["reference_norm"].values())
    for rows in gradients["by_lag"].values():
        assert list(rows) == ESTIMATORS
        for row in rows.values():
            assert all(_finite(row[k]) and row[k] >= 0 for k in ("bias", "variance", "bias_noise"))
    assert list(gradients["stabilizer_fraction"]) == ["0", "2"]
    for fractions in gradients["stabilizer_fraction"].values():
        assert set(fractions) == {"ppo_clip", "m2po"} and all(0 <= v <= 1 for v in fractions.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    teacher = report["teacher"]
    assert 0 < teacher["top_k_mass"] < 1 and teacher["entropy"] > 0


def test_bench_estimators_refuses_a_gradient_lag_beyond_the_warm_steps(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--grad-lags", "4", "--grad-warm-steps", "2", "--json",
           str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--grad-warm-steps" in proc.stderr
    assert not (tmp_path / "x.json").exists()
