"""benchmarks/gpu_check.py (and its .sh wrapper) in dry-run mode on the CPU, so the one-call GPU check cannot rot:
argument parsing, every step's plumbing, bench_kernels' interpreter smoke config, the JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _gpu_check():
    """benchmarks/gpu_check.py as a module (registered: its dataclasses look their module up)."""
    if "gpu_check_under_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check_under_test"]


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    pytest.importorskip("triton", reason="the dry run's kernel steps need triton (the CPU interpreter)")
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert result["dry_run"] and result["ok"] and list(steps) == list(_gpu_check().STEPS)
    assert any("'ipc'" in note for note in result["notes"])  # says plainly that the ipc backend is not supported

    assert steps["environment"]["status"] == "ok" and steps["environment"]["python"]
    planned = " ".join(steps["install"]["planned"])
    assert steps["install"]["status"] == "skipped" and "-m venv" in planned and "torch>=2.6" in planned
    assert "liger-kernel" in planned and "cut-cross-entropy" in planned and f"-e {ROOT}" in planned

    kernel_tests = steps["kernel-tests"]
    assert kernel_tests["status"] == "ok" and kernel_tests["counts"]["passed"] >= 4, kernel_tests
    assert kernel_tests["counts"]["failures"] == kernel_tests["counts"]["errors"] == 0

    bench = steps["bench-4096"]
    assert bench["status"] == "ok", bench["output_tail"]
    (row,) = bench["rows"]
    for impl in ("ours-det", "torch"):
        assert row["impls"][impl]["status"] == "ok" and row["impls"][impl]["gate"]["ok"], row["impls"][impl]
    assert steps["bench-16384"]["status"] == "skipped"

    packed = steps["packed-attention"]
    assert packed["status"] == "ok" and packed["max_abs_diff_vs_alone"] <= packed["tolerance"], packed
    vllm = steps["vllm-sync"]
    assert vllm["status"] == "skipped" and vllm["ipc_supported"] is False


def test_steps_that_do_not_fit_the_budget_are_skipped(tmp_path):
    gpu_check = _gpu_check()
    assert gpu_check.step_timeout("install", time_left=1000.0, dry_run=False) == gpu_check.STEP_LIMITS["install"]
    assert gpu_check.step_timeout("bench-16384", time_left=40.0, dry_run=False) == 40.0
    assert gpu_check.step_timeout("bench-4096", time_left=gpu_check.MIN_STEP_S - 1, dry_run=False) is None
    out = tmp_path / "out.json"
    args = gpu_check.parse_args(["--dry-run", "--json", str(out), "--steps", "environment", "kernel-tests"])
    ctx = gpu_check.Context(args=args, python=sys.executable, deadline=time.monotonic() + 3, workdir=tmp_path)
    assert gpu_check.run_step(ctx, "kernel-tests")["status"] == "skipped"
    assert gpu_check.main(["--dry-run", "--json", str(out), "--steps", "environment"]) == 0
    assert list(json.loads(out.read_text())["steps"]) == ["environment"]


def test_a_step_past_its_time_ends_its_whole_process_group(tmp_path):
    """A timed-out step's children (e.g. a vLLM server a worker started) go too: only what the step started."""
    gpu_check = _gpu_check()
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    res = gpu_check.run_command([sys.executable, "-c", code], timeout_s=3)
    assert res["timed_out"] and res["seconds"] < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state  # a zombie has exited


def test_a_missing_interpreter_is_a_failed_step_not_a_crash(tmp_path):
    res = _gpu_check().run_command([str(tmp_path / "no-such-python"), "-V"], timeout_s=5)
    assert res["rc"] != 0 and not res["timed_out"]


def test_junit_counts(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>')
    assert _gpu_check().junit_counts(report) == {"tests": 7, "failures": 1, "errors": 0, "skipped": 2, "passed": 4}


def test_bad_budget_is_rejected():
    with pytest.raises(SystemExit):
        _gpu_check().parse_args(["--budget-s", "5"])
