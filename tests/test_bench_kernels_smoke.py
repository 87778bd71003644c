"""Smoke test of benchmarks/bench_kernels.py: the quick config runs the kernels (Triton's CPU interpreter here) and
they agree with the torch path. Timings are never asserted."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"


def test_bench_kernels_quick(tmp_path):
    pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
    out = tmp_path / "bench_kernels.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert result["machine"]["versions"]["torch"]
    assert len(result["rows"]) == 1
    row = result["rows"][0]
    for name, m in row["impls"].items():
        # ours and the torch path are always there; the other packages may be absent (reported, not fatal)
        assert m["status"] == "ok" or (m["status"] == "missing" and not name.startswith(("ours", "torch"))), (name, m)
        if m["status"] == "ok":
            assert m["fwd_s"] > 0 and m["bwd_s"] > 0 and math.isfinite(m["loss"]) and m["loss"] > 0
    same_loss = [m["loss"] for name, m in row["impls"].items() if name.startswith(("ours", "torch", "trl"))
                 and m["status"] == "ok"]  # liger (dense teacher) and cce (cross-entropy) compute other losses
    assert len(same_loss) >= 2 and max(same_loss) - min(same_loss) <= 1e-5 * max(same_loss)
    if "rel_diff_vs_torch_path" in row:  # CPU run: the kernels against the torch path, loss and gradients
        for mode, diffs in row["rel_diff_vs_torch_path"].items():
            assert all(d < 1e-5 for d in diffs.values()), (mode, diffs)
