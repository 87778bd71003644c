"""`examples/demo.py --quick` runs end to end and distillation reduces the divergence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_quick(tmp_path):
    result = subprocess.run(
        # One thread: two OpenMP threads spin-wait badly when other jobs share the two cores.
        [sys.executable, str(DEMO), "--quick", "--threads", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["args"]["quick"] is True
    assert len(summary["history"]) == summary["args"]["steps"]
    assert summary["jsd_end"] < summary["jsd_start"]
    assert summary["after"]["held_out"]["forward_kl"] < summary["before"]["held_out"]["forward_kl"]
    assert "synchronous" in result.stdout
