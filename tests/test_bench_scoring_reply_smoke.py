"""Smoke test of benchmarks/bench_scoring_reply.py at tiny sizes: it runs, the compact answers decode to the stock
answer's scores, the table and the JSON have their shape. Timings are never asserted (the machine may be busy)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scoring_reply.py"


@pytest.mark.slow
def test_bench_scoring_reply_tiny(tmp_path):
    out = tmp_path / "reply.json"
    cmd = [sys.executable, str(SCRIPT), "--top-k", "4", "8", "--lengths", "12", "--prompt-lengths", "5",
           "--num-queries", "3", "--min-round-s", "0.002", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "body bytes and client decode CPU µs" in proc.stdout
    assert "| NO |" not in proc.stdout and proc.stdout.count("| yes |") == 2
    rows = json.loads(out.read_text())["rows"]
    assert [(row["top_k"], row["completion_length"], row["prompt_length"]) for row in rows] == [(4, 12, 5), (8, 12, 5)]
    for row in rows:
        names = {"stock", "compact", "compact+3"}
        assert set(row["us_per_position"]) == set(row["bytes_per_position"]) == set(row["agrees"]) == names
        assert all(row["agrees"].values()), row["agrees"]
        assert all(math.isfinite(v) and v > 0 for v in row["us_per_position"].values())
        size = row["bytes_per_position"]
        assert size["compact"] < size["compact+3"] and size["compact"] < size["stock"]
