"""Smoke test of benchmarks/bench_worker_ceiling.py at tiny sizes: it runs, every decoder agrees with the reference,
the tables and the JSON have their shape. Timings are never asserted (the machine may be busy)."""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_worker_ceiling.py"


def test_bench_worker_ceiling_tiny(tmp_path):
    out = tmp_path / "ceiling.json"
    cmd = [sys.executable, str(SCRIPT), "--top-k", "4", "8", "--lengths", "12", "--prompt-lengths", "5",
           "--min-round-s", "0.002", "--trainer-steps", "2", "--samples-per-step", "3", "--json", str(out),
           "--parts", "decode", "trainer"]  # the workers part: tests/test_worker_processes.py
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CPU µs per scored token" in proc.stdout and "trainer's side of the queue" in proc.stdout
    result = json.loads(out.read_text())
    decode = result["decode"]
    assert [(row["top_k"], row["completion_length"], row["prompt_length"]) for row in decode] == [
        (4, 12, 5), (8, 12, 5)]
    for row in decode:
        names = {"json", "json+flat", "orjson", "orjson+flat", "msgspec", "msgspec+compact"}
        assert set(row["us_per_token"]) == names == set(row["agrees"])
        assert all(row["agrees"].values()), row["agrees"]
        assert all(math.isfinite(v) and v > 0 for v in row["us_per_token"].values())
    assert "| NO |" not in proc.stdout and proc.stdout.count("| yes |") == 2
    trainer = result["trainer"]
    assert [(row["top_k"], row["completion_length"]) for row in trainer] == [(4, 12), (8, 12)]
    for row in trainer:
        assert (row["steps"], row["samples_per_step"]) == (2, 3)
        assert math.isfinite(row["next_us_per_token"]) and row["next_us_per_token"] >= 0
        assert math.isfinite(row["pack_us_per_token"]) and row["pack_us_per_token"] > 0
