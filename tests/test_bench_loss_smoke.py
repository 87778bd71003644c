"""Smoke test of benchmarks/bench_loss.py: the quick sweep runs, measures every implementation, and the losses agree.

Timings are never asserted (the machine may be busy); only that every measurement exists and is finite.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_loss.py"


def test_bench_loss_quick(tmp_path):
    out = tmp_path / "bench.json"
    # tail_mode="trl" makes ours compute the same clamped student tail as dense and TRL, so the losses match.
    # One quick config (N=64) keeps this fast: each worker is a fresh interpreter, and importing trl takes seconds.
    cmd = [sys.executable, str(SCRIPT), "--quick", "--N", "64", "--impls", "dense", "trl", "ours", "--repeats", "1",
           "--tail-mode", "trl", "--device", "cpu", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert result["machine"]["torch"]
    assert [(r["N"], r["D"], r["V"], r["K"]) for r in result["rows"]] == [(64, 32, 512, 8)]
    for row in result["rows"]:
        impls = row["impls"]
        assert set(impls) == {"dense", "trl", "ours"}
        for name, m in impls.items():
            assert m["status"] == "ok", (name, m)
            assert len(m["times_s"]) == 1
            assert math.isfinite(m["median_s"]) and m["median_s"] > 0
            assert math.isfinite(m["peak_mb"]) and math.isfinite(m["extra_over_grads_mb"])
            assert math.isfinite(m["loss"]) and m["loss"] > 0
        dense_loss = impls["dense"]["loss"]
        for name in ("trl", "ours"):
            assert math.isclose(impls[name]["loss"], dense_loss, rel_tol=1e-4), (name, impls[name]["loss"], dense_loss)
        assert row["summary"]["loss_rel_diff_ours_trl"] < 1e-4
