"""Smoke test of benchmarks/bench_loss.py: the quick sweep runs, measures every implementation, and the losses agree.

Timings are never asserted (the machine may be busy); only that every measurement exists and is finite.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_loss.py"


@pytest.mark.slow
def test_bench_loss_quick(tmp_path):
    out = tmp_path / "bench.json"
    # tail_mode="trl" makes ours compute the same clamped student tail as dense and TRL, so the losses match.
    # One quick config (N=64) keeps this fast: each worker is a fresh interpreter (3 implementations × 2 allocator
    # settings), and importing trl takes seconds.
    cmd = [sys.executable, str(SCRIPT), "--quick", "--N", "64", "--impls", "dense", "trl", "ours", "--repeats", "1",
           "--tail-mode", "trl", "--device", "cpu", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert result["machine"]["torch"]
    assert [(r["N"], r["D"], r["V"], r["K"]) for r in result["rows"]] == [(64, 32, 512, 8)]
    # both allocator settings, each measured in its own fresh worker process
    assert result["worker_env"] == {"glibc-default": {}, "mmap-threshold-1MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}
    for row in result["rows"]:
        assert set(row["allocators"]) == {"glibc-default", "mmap-threshold-1MiB"}
        for allocator, measured in row["allocators"].items():
            impls = measured["impls"]
            assert set(impls) == {"dense", "trl", "ours"}
            for name, m in impls.items():
                assert m["status"] == "ok", (allocator, name, m)
                assert m["allocator"] == allocator
                assert len(m["times_s"]) == 1
                assert math.isfinite(m["median_s"]) and m["median_s"] > 0
                assert math.isfinite(m["peak_mb"]) and math.isfinite(m["extra_over_grads_mb"])
                assert math.isfinite(m["loss"]) and m["loss"] > 0
            dense_loss = impls["dense"]["loss"]
            for name in ("trl", "ours"):
                assert math.isclose(impls[name]["loss"], dense_loss, rel_tol=1e-4), (name, impls[name]["loss"])
            assert measured["summary"]["loss_rel_diff_ours_trl"] < 1e-4
    assert "allocator: glibc-default" in proc.stdout and "allocator: mmap-threshold-1MiB" in proc.stdout


def test_workers_get_exactly_the_allocator_setting(monkeypatch):
    """The glibc-default workers run without any malloc tuning inherited from the parent's environment."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_loss
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")
    default = bench_loss.worker_env("glibc-default")
    assert not any(k.startswith("MALLOC_") for k in default) and "GLIBC_TUNABLES" not in default
    assert bench_loss.worker_env("mmap-threshold-1MiB")["MALLOC_MMAP_THRESHOLD_"] == "1048576"


@pytest.mark.slow
def test_bench_loss_dense_teacher_quick(tmp_path):
    """--dense: TRL GKD, TRL Distillation, Liger and ours on one tiny config; every measurement exists and the four
    mean divergences agree (fp32 evaluations of the same generalized JSD, β = 0.5)."""
    import os

    out = tmp_path / "bench_dense.json"
    cmd = [sys.executable, str(SCRIPT), "--dense", "--quick", "--N", "64", "--repeats", "1", "--device", "cpu",
           "--allocator", "glibc-default", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}  # the workers import this checkout's fastdistill
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["settings"]["dense"] and result["settings"]["beta"] == 0.5
    (row,) = result["rows"]
    assert (row["N"], row["D"], row["V"]) == (64, 32, 512)
    measured = row["allocators"]["glibc-default"]
    impls = measured["impls"]
    assert set(impls) == {"gkd", "distill", "liger", "ours-topk", "ours"}
    for name, m in impls.items():
        assert m["status"] == "ok", (name, m)
        assert math.isfinite(m["median_s"]) and m["median_s"] > 0 and math.isfinite(m["peak_mb"])
        assert math.isfinite(m["loss"]) and m["loss"] > 0
    summary = measured["summary"]
    assert summary["loss_ref"] == "gkd"
    for name in ("distill", "liger", "ours"):
        assert summary[f"loss_rel_diff_{name}"] < 1e-4, name
    assert "loss_rel_diff_ours-topk" not in summary  # another loss (the teacher's top-K), timed for scale only
    for name in ("gkd", "distill", "liger", "ours-topk"):
        assert summary[f"ours_over_{name}_time"] > 0 and f"ours_over_{name}_mem" in summary, name
    assert "dense teacher, allocator: glibc-default" in proc.stdout


def test_bench_loss_rejects_impls_of_the_other_mode():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dense", "--impls", "trl"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "not an implementation of this mode" in proc.stderr
