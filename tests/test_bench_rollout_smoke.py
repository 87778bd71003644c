"""Smoke test of benchmarks/bench_rollout.py, stub part only (no vLLM): it runs, measures every quantity, writes JSON.

Timings are never asserted (the machine may be busy); only that every measurement exists and is finite.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rollout.py"


@pytest.mark.slow
def test_bench_rollout_stub_part(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--stub-only", "--stub-samples", "30", "--max-tokens", "8", "--top-k", "4",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Worker overhead per sample" in proc.stdout
    result = json.loads(out.read_text())
    assert "vllm" not in result and result["machine"]["cpus"] >= 1
    stub = result["stub"]
    assert (stub["max_tokens"], stub["top_k"], stub["samples"]) == (8, 4, 30)
    for key in ("parse_us", "pickle_us", "seconds", "samples_per_s", "child_cpu_ms_per_sample"):
        assert math.isfinite(stub[key]) and stub[key] > 0, (key, stub[key])
    assert stub["pickled_bytes"] > 8 * 5 * 8  # at least the (L, K+1) int32 ids and float32 log-probs
    assert math.isfinite(stub["parent_cpu_us_per_sample"]) and stub["parent_cpu_us_per_sample"] >= 0
