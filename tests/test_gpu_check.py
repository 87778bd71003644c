"""benchmarks/gpu_check.py (and its .sh wrapper) in dry-run mode on the CPU, so the one-call GPU check cannot rot:
argument parsing, every step's plumbing, bench_kernels' interpreter smoke config, the JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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

    assert set(result["source"]) >= {"commit", "clean", "dirty"}  # a dry run runs on any tree, and records it
    kernel_tests = steps["kernel-tests"]
    assert kernel_tests["status"] == "ok" and kernel_tests["counts"]["passed"] >= 4, kernel_tests
    launches = kernel_tests["launch_record"]  # the interpreter's launches, with the keys of the tree that ran
    assert launches["run_keys"]["designs"]["sparse"]["triton"]["modules"]["ops"]
    assert "passed" in launches["patterns"]["sparse"]["triton"].values()
    assert kernel_tests["counts"]["failures"] == kernel_tests["counts"]["errors"] == 0

    bench = steps["bench-4096"]
    assert bench["status"] == "ok", bench["output_tail"]
    assert [r["dist"] for r in bench["rows"]] == ["random", "peaked"]  # the new benchmark, both distributions
    for row in bench["rows"]:
        for impl in ("ours-det", "ours-chunked", "torch"):
            m = row["impls"][impl]
            assert m["status"] == "ok" and m["gate"]["ok"] and m["predicted_s"] > 0, m
        assert row["floor"]["three_s"] > 0 and row["distribution"]["mean_p_max"] > 0
    assert bench["predicted"]["rows"] and bench["machine"]["copy_gbytes_per_s"] > 0
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


def test_steps_run_by_value_within_eight_minutes():
    gpu_check = _gpu_check()
    assert gpu_check.STEPS[:4] == ("environment", "install", "kernel-tests", "bench-4096")
    budget = gpu_check.parse_args([]).budget_s
    assert budget <= 8 * 60 and all(limit <= budget for limit in gpu_check.STEP_LIMITS.values())
    assert gpu_check.step_timeout("install", 1000.0, dry_run=False, kit=True) == gpu_check.KIT_INSTALL_LIMIT_S
    assert gpu_check.KIT_INSTALL_LIMIT_S < gpu_check.STEP_LIMITS["install"]


def test_the_json_is_rewritten_after_every_step(tmp_path, monkeypatch):
    gpu_check = _gpu_check()
    out = tmp_path / "out.json"
    seen = []

    def fake_step(ctx, name):
        seen.append(list(json.loads(out.read_text())["steps"]) if out.exists() else [])
        return {"status": "ok"}

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    assert gpu_check.main(["--dry-run", "--json", str(out)]) == 0
    assert seen == [list(gpu_check.STEPS[:k]) for k in range(len(gpu_check.STEPS))]
    assert list(json.loads(out.read_text())["steps"]) == list(gpu_check.STEPS)


def test_kit_mode_needs_a_kit_folder(tmp_path):
    with pytest.raises(SystemExit):
        _gpu_check().parse_args(["--kit", str(tmp_path / "no-such-kit")])


def test_kit_mode_environment_puts_kit_and_source_first_and_stays_offline(tmp_path):
    gpu_check = _gpu_check()
    args = gpu_check.parse_args(["--kit", str(tmp_path), "--site", str(tmp_path / "site")])
    assert args.python == sys.executable  # the image's python3 as it is: no venv
    ctx = gpu_check.Context(args=args, python=args.python, deadline=time.monotonic() + 60, workdir=tmp_path)
    env = ctx.env()
    assert env["PYTHONPATH"].split(os.pathsep)[:3] == [str(tmp_path / "site"), str(ROOT), str(ROOT / "kernels")]
    assert all(env[k] == v for k, v in gpu_check.OFFLINE_ENV.items()) and "TRITON_INTERPRET" not in env
    cmd = gpu_check.device_kit.install_command(ctx.python, args.kit, ctx.site())
    assert cmd[:3] == [sys.executable, "-m", "pip"]
    assert {"--isolated", "--no-index", "--no-deps"} <= set(cmd) and cmd[cmd.index("--target") + 1] == str(
        tmp_path / "site")
    res = gpu_check.step_install(ctx, 30)  # an empty kit folder
    assert res["status"] == "failed" and "no wheels" in res["detail"]


def test_a_kit_wheel_that_does_not_import_fails_the_install_step(tmp_path, monkeypatch):
    """A wheel that installs but whose module is not importable (here a kit that lacks trl's dependencies entirely:
    an empty wheel named like one) is a failed install step, naming the package."""
    import zipfile

    gpu_check = _gpu_check()
    kit = tmp_path / "kit"
    kit.mkdir()
    with zipfile.ZipFile(kit / "placeholder-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("placeholder-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: placeholder\nVersion: 1.0\n")
        zf.writestr("placeholder-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("placeholder-1.0.dist-info/RECORD", "")
    args = gpu_check.parse_args(["--dry-run", "--kit", str(kit), "--site", str(tmp_path / "site")])
    ctx = gpu_check.Context(args=args, python=args.python, deadline=time.monotonic() + 120, workdir=tmp_path)
    monkeypatch.setattr(gpu_check.device_kit, "PROBE_MODULES",
                        {"placeholder": "placeholder", "no-such-package": "no_such_module_xyz"})
    res = gpu_check.step_install(ctx, 90)
    assert res["status"] == "failed" and "no-such-package" in res["detail"], res
    assert (tmp_path / "site" / "placeholder-1.0.dist-info").is_dir()  # the wheel itself went in


def test_compiled_counts_treat_a_skip_as_no_pass(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite tests="4">'
                      '<testcase classname="t" name="test_compiled_a[bf16]"/>'
                      '<testcase classname="t" name="test_compiled_b[fp32]"><skipped message="no GPU"/></testcase>'
                      '<testcase classname="t" name="test_compiled_c"><failure message="x"/></testcase>'
                      '<testcase classname="t" name="test_interpreter_only"><failure message="y"/></testcase>'
                      "</testsuite></testsuites>")
    counts = _gpu_check().compiled_counts(report)
    assert counts["tests"] == 3 and counts["passed"] == 1
    assert counts["failed"] == ["test_compiled_b[fp32]: skipped", "test_compiled_c: failure"]


def test_gpu_bench_steps_time_ten_repeats_after_five_warmups(tmp_path):
    """On the GPU each benchmark step times >= 10 fwd+bwd windows after >= 5 warm-ups, on both distributions."""
    gpu_check = _gpu_check()
    args = gpu_check.parse_args(["--python", sys.executable, "--json", str(tmp_path / "o.json")])
    ctx = gpu_check.Context(args=args, python=sys.executable, deadline=time.monotonic() + 60, workdir=tmp_path)
    for name, spec in gpu_check.BENCH_STEPS.items():
        cmd = gpu_check.bench_command(ctx, name, tmp_path / "b.json")
        assert int(cmd[cmd.index("--repeats") + 1]) >= 10 and int(cmd[cmd.index("--warmup") + 1]) >= 5, cmd
        assert "--quick" not in cmd and "--dists" not in cmd  # the default: both distributions
        assert [int(n) for n in cmd[cmd.index("--N") + 1:cmd.index("--D")]] == spec["N"]
        assert "cce" in cmd and "ours-chunked" in cmd
    assert set(gpu_check.BENCH_STEPS) <= set(gpu_check.STEPS)


def test_the_read_off_renders_every_step_and_the_bench_rows(tmp_path):
    """gpu_results: a step it does not know (a later train-step) still gets its numbers; a bench row gets its floor,
    spread, ratio and prediction."""
    gpu_check = _gpu_check()
    gr = gpu_check.gpu_results
    floor = {"total": {"min": 0.07, "median": 0.076, "max": 0.08, "n": 10}, "three_s": 0.076, "dense_s": 0.1,
             "logits_s": 0.024, "dh_s": 0.026, "dW_s": 0.026}
    m = {"status": "ok", "fwd_s": 0.07, "bwd_s": 0.03, "total_s": 0.1, "peak_mb": 2100.0, "predicted_peak_mb": 2112.0,
         "spread_s": {"min": 0.099, "median": 0.1, "max": 0.11, "n": 10}, "x_floor": 0.1 / 0.076,
         "predicted_s": 0.08, "measured_over_predicted": 1.25, "gate": {"ok": True, "rel_diff": {"dh": 1e-3}}}
    row = {"dist": "peaked", "N": 16384, "D": 3584, "V": 152064, "K": 8, "floor": floor, "floor_predicted_s": 0.071,
           "impls": {"ours-chunked": m}, "distribution": {"mean_entropy_nats": 2.03, "mean_p_max": 0.82,
                                                          "tokens_per_row_p_ge_2^-12": 5.0}}
    results = {"steps": {"bench-16384": {"status": "ok", "rows": [row], "machine": {"bf16_matmul_peak_tflops": 700.0}},
                         "train-step": {"status": "ok", "seconds": 12.0, "tokens_per_s": 1234.5}}}
    table = gr.bench_table(results)
    assert "| bench-16384 | peaked | 16384 | 3584 | 152064 | 8 | ours-chunked | 99.0 / **100.0** / 110.0 |" in table
    assert "| 1.32 | 80.0 (1.25) |" in table and "2,100 (2,112)" in table
    useful = 6 * 16384 * 3584 * 152064 / 0.1
    assert f"| {useful / 1e12:.0f} | {100 * useful / 700e12:.0f}% / {100 * useful / 989e12:.0f}% |" in table
    assert "three bare GEMMs | 70.0 / **76.0** / 80.0 | 24.0 + 26.0 + 26.0 | 1.00 | 71.0 (1.07) |" in table
    assert "- train-step: **ok** (12 s); tokens_per_s 1.23e+03" in gr.step_lines(results)
    assert any("peaked inputs (N=16384): mean entropy 2.03 nats, 5.0 tokens" in x for x in gr.inputs_lines(results))


# ------------------------------------------------------------------------------------------------ the tree that ran
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git checkout shaped like this one (a kernel package, a test, a benchmark), as gpu_check's ROOT."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no user git config
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    repo = tmp_path / "repo"
    for rel, text in {"kernels/fastdistill_kernels/ops.py": "NUM_WARPS = 8\n", "tests/test_x.py": "x = 1\n",
                      "benchmarks/b.py": "b = 1\n", "README.md": "r\n"}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "c")
    gpu_check = _gpu_check()
    monkeypatch.setattr(gpu_check, "ROOT", repo)
    monkeypatch.setattr(gpu_check, "STAMP", repo / "build" / "gpu-check-source.json")
    return repo


def test_the_source_state_is_the_commit_and_whether_the_tree_is_it(checkout):
    gpu_check = _gpu_check()
    head = _git(checkout, "rev-parse", "--short=7", "HEAD").strip()
    assert gpu_check.source_state() == {"commit": head, "clean": True, "dirty": [], "how": "git"}
    (checkout / "benchmarks" / "someone_elses.py").write_text("")  # untracked outside the package: not what runs
    (checkout / "README.md").write_text("edited\n")  # outside the source paths
    assert gpu_check.source_state()["clean"]
    (checkout / "kernels" / "fastdistill_kernels" / "new_module.py").write_text("")
    state = gpu_check.source_state()
    assert not state["clean"] and state["dirty"] == ["?? kernels/fastdistill_kernels/new_module.py"]
    (checkout / "kernels" / "fastdistill_kernels" / "new_module.py").unlink()
    (checkout / "tests" / "test_x.py").write_text("x = 2\n")
    assert gpu_check.source_state()["dirty"] == ["M tests/test_x.py"]


def test_gpu_check_refuses_a_dirty_tree_before_running_anything(checkout, tmp_path, monkeypatch, capsys):
    gpu_check = _gpu_check()
    (checkout / "kernels" / "fastdistill_kernels" / "ops.py").write_text("NUM_WARPS = 4\n")
    ran = []
    monkeypatch.setattr(gpu_check, "run_step", lambda ctx, name: ran.append(name) or {"status": "ok"})
    out = tmp_path / "out.json"
    assert gpu_check.main(["--python", sys.executable, "--json", str(out)]) == 2
    assert ran == [] and not out.exists()
    assert "refused" in capsys.readouterr().out
    assert gpu_check.main(["--python", sys.executable, "--json", str(out), "--allow-dirty"]) == 0
    written = json.loads(out.read_text())
    assert written["source"]["clean"] is False and ran == list(gpu_check.STEPS)
    assert any("not a committed one" in p for p in gpu_check.gpu_results.validation_problems(written))


def test_a_copy_without_git_proves_its_commit_with_the_stamp(checkout, tmp_path, monkeypatch):
    gpu_check = _gpu_check()
    (checkout / "tests" / "test_x.py").write_text("x = 2\n")
    with pytest.raises(SystemExit, match="uncommitted changes"):
        gpu_check.write_stamp(gpu_check.STAMP)
    _git(checkout, "commit", "-q", "-am", "d")
    stamp = gpu_check.write_stamp(gpu_check.STAMP)
    assert set(stamp["files"]) == {"kernels/fastdistill_kernels/ops.py", "tests/test_x.py", "benchmarks/b.py"}
    copy = tmp_path / "copy"  # what the device machine gets: the files, build/ carried, no .git
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(gpu_check, "ROOT", copy)
    monkeypatch.setattr(gpu_check, "STAMP", copy / "build" / "gpu-check-source.json")
    assert gpu_check.source_state() == {"commit": stamp["commit"], "clean": True, "dirty": [], "how": "stamp"}
    (copy / "kernels" / "fastdistill_kernels" / "extra.py").write_text("")
    assert gpu_check.source_state()["dirty"] == ["?? kernels/fastdistill_kernels/extra.py"]
    (copy / "kernels" / "fastdistill_kernels" / "extra.py").unlink()
    (copy / "kernels" / "fastdistill_kernels" / "ops.py").write_text("NUM_WARPS = 4\n")
    assert gpu_check.source_state()["dirty"] == ["M kernels/fastdistill_kernels/ops.py"]
    gpu_check.STAMP.unlink()
    state = gpu_check.source_state()
    assert not state["clean"] and "no source stamp" in state["dirty"][0]


LAUNCHING_TESTS = '''
import torch
from fastdistill_kernels import fused_sparse_jsd


def _case():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 16, generator=g).requires_grad_(True)
    w = torch.randn(70, 16, generator=g).requires_grad_(True)
    ids = torch.randint(0, 70, (5, 3), generator=g)
    lps = torch.log_softmax(torch.randn(5, 3, generator=g), -1)
    return h, w, ids, lps, torch.ones(5, 3, dtype=torch.bool)


def test_launches_and_passes():
    h, w, ids, lps, valid = _case()
    fused_sparse_jsd(h, w, ids, lps, valid).divergence.sum().backward()


def test_launches_a_frozen_head_and_fails():
    h, w, ids, lps, valid = _case()
    fused_sparse_jsd(h, w.detach(), ids, lps, valid)
    assert False
'''


@pytest.mark.slow
def test_the_record_is_written_from_the_tree_that_ran(tmp_path):
    """The kernel tests run on a copy of the package whose launch setting differs from this tree's: the launch
    record carries the copy's module hashes (computed where it ran), the patterns its tests launched with their
    verdicts, and gpu_results writes the validation record from that alone."""
    pytest.importorskip("triton")
    from fastdistill_kernels import validation

    ran = tmp_path / "ran" / "fastdistill_kernels"
    shutil.copytree(ROOT / "kernels" / "fastdistill_kernels", ran, ignore=shutil.ignore_patterns("__pycache__"))
    config = ran / "config.py"
    config.write_text(config.read_text().replace("num_warps: int = 8", "num_warps: int = 4"))
    (tmp_path / "test_launches.py").write_text(LAUNCHING_TESTS)
    out = tmp_path / "launch-record.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ran.parent), str(ROOT / "benchmarks")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "launch_record",
                           f"--launch-record={out}", "test_launches.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    launches = json.loads(out.read_text())
    import triton

    ran_keys = validation.run_keys(validation.folder_reader(ran), triton.__version__)
    assert launches["run_keys"] == ran_keys
    assert launches["run_keys"] != validation.run_keys(triton_version=triton.__version__)  # not this tree's
    assert launches["patterns"] == {"sparse": {"triton": {
        "hidden=fp32:grad weight=fp32:grad bias=None": "passed", "hidden=fp32:grad weight=fp32 bias=None": "failed"}}}
    assert launches["tests_that_launched"] == {"passed": 1, "failed": 1}

    gr = _gpu_check().gpu_results
    results = {"date": "2027-01-01T00:00:00", "source": {"commit": "abc1234", "clean": True},
               "steps": {"kernel-tests": {"launch_record": launches}}}
    record = gr.validation_record(results)
    entry = record["designs"]["sparse"]["triton"]
    assert entry["modules"] == ran_keys["designs"]["sparse"]["triton"]["modules"]
    assert entry["validated_on"]["commit"] == "abc1234" and set(record["designs"]) == {"sparse"}
    state = validation.design_state("sparse", "triton", "hidden=fp32:grad weight=fp32:grad bias=None", record=record,
                                    triton_version=triton.__version__, read=validation.folder_reader(ran))
    assert state.validated
    assert validation.design_state("sparse", "triton", record=record, triton_version=triton.__version__).\
        changed_modules == ("config",)  # this tree (8 warps) is not what ran


@pytest.mark.slow
def test_the_launch_record_merges_the_xdist_workers(tmp_path):
    """On the GPU the kernel tests run under pytest-xdist: each worker writes its part, the controller merges them
    (a pattern failed on any worker failed) and leaves one file."""
    pytest.importorskip("xdist")
    pytest.importorskip("triton")
    (tmp_path / "test_launches.py").write_text(LAUNCHING_TESTS)
    out = tmp_path / "launch-record.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "kernels"), str(ROOT / "benchmarks")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "-p",
                           "launch_record", f"--launch-record={out}", "test_launches.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    launches = json.loads(out.read_text())
    assert launches["patterns"] == {"sparse": {"triton": {
        "hidden=fp32:grad weight=fp32:grad bias=None": "passed", "hidden=fp32:grad weight=fp32 bias=None": "failed"}}}
    assert launches["tests_that_launched"] == {"passed": 1, "failed": 1}
    assert [p.name for p in tmp_path.glob("launch-record.json*")] == ["launch-record.json"]
