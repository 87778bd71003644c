"""``fastdistill demo --quick`` end to end: real vLLM servers, rollout worker, trainer, weight sync, report, plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastdistill_testing.vllm_server import require_vllm


@pytest.mark.vllm
def test_quick_demo_writes_its_report_and_plot(tmp_path):
    require_vllm()
    script = Path(sys.executable).parent / "fastdistill"
    result = subprocess.run([str(script), "demo", "--quick", "--output-dir", str(tmp_path)], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for key in ("jsd_before", "jsd_after", "accuracy_before", "accuracy_after", "trained_tokens_per_s", "steps"):
        assert key in report
    assert report["steps"] >= 10 and report["trained_tokens_per_s"] > 0
    assert report["served_logprob_gap"] <= 1e-4  # the served weights are the trainer's at the end
    assert report["jsd_after"] < report["jsd_before"]
    # the held-out curve: step 0, every eval_steps (half the run in --quick) and the end
    assert [p["step"] for p in report["held_out_curve"]][0] == 0 and len(report["held_out_curve"]) >= 3
    assert report["held_out_curve"][-1]["step"] == report["steps"]
    # every second is attributed: the demo's parts add up to its total, the trainer's phases to the distillation
    times, phases = report["time_s"], report["distillation_time_s"]
    assert sum(v for k, v in times.items() if k != "total") == pytest.approx(times["total"], rel=1e-9)
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"], rel=1e-9)
    assert phases["total"] == times["distillation"] and phases["other"] < phases["total"]
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "held-out jsd" in result.stdout
