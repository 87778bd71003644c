"""One-call GPU check: on a machine with one CUDA GPU and only Python, install, test, benchmark, write one JSON.

Steps, in order of value, each in its own process group with its own limit (:data:`STEP_LIMITS`), all within
``--budget-s`` (default 480 s, start-up excluded, of a 10-minute call):

  environment         nvidia-smi (GPU, driver, memory) and this Python.
  install             ``--kit DIR`` (the lent GPU machine: its image's python3 as it is, no network): the kit's
                      wheels (``benchmarks/device_kit.py``: TRL, Liger, CCE, datasets) into a ``--target`` folder
                      with ``pip install --no-index --no-deps``, fastdistill and ``kernels/`` put on PYTHONPATH
                      from this source tree (no build step), then an import probe of every contender. Without
                      ``--kit``: a venv (``--system-site-packages``: a preinstalled torch is reused) with torch
                      (``--torch-spec``, default ``torch>=2.6``: PyPI's Linux wheels are CUDA builds), triton, trl
                      1.16.0, liger-kernel, cut-cross-entropy, pytest and fastdistill itself (editable); or
                      ``--python`` for a ready interpreter.
  kernel-tests        ``pytest`` of :data:`GPU_KERNEL_TEST_FILES` (the kernel tests and the peak-memory tests) without
                      TRITON_INTERPRET: the compiled kernels on the GPU
                      against the torch path and the float64 reference, every backward mode and dtype. Its gate:
                      every ``test_compiled_*`` test ran and passed. With ``benchmarks/launch_record.py`` it records,
                      on the GPU machine, the keys of the kernel package that ran (module hashes, triton version)
                      and each design's launch patterns with their tests' verdicts: the validation record is made
                      of these alone (``gpu_results.py --record``).
  bench-4096          ``bench_kernels.py`` at N=4096, D=3584, V=152064, K=8 (the Qwen shape), random and peaked inputs,
                      against TRL, Liger and CCE (the dense-teacher rows ours-dense and ours-dense-chunked beside
                      Liger), each behind its correctness gate; the three bare GEMMs and both ceilings of the
                      prediction (matmul rate, copy bandwidth) measured in the same run; 10 repeats after 5 warm-ups.
  self-check          ``python -m fastdistill_kernels.selfcheck`` from a cold cache: each design against the float64
                      reference on the edge cases, the passing ones timed; its wall time is the first-use cost.
  bench-16384         the same at N=16384, K=8 and K=64, without TRL (1.8 s a call) and the fused-backward variants
                      (measured at 4096); Liger, CCE and the dense rows measured once per distribution. The
                      benchmark rewrites its JSON after each configuration: a step cut short keeps its rows.
  train-step          ``bench_train_step.py``: the trainer's own step (``AsyncDistillationTrainer``, one rank
                      FSDP2-sharded over NCCL, bf16 mixed precision) at the Qwen2.5-0.5B and -1.5B shapes from a
                      teacher cache written in-process, K=8 and 32, loss backends auto and torch: its phase split,
                      step time range and its prediction, MFU, peak memory and the plain cross-entropy step (sharded
                      the same way) as its floor; 20 steps must lower the loss and a packed
                      row must match its samples alone (SDPA, and flash-attn when importable); its guard compares
                      peak memory and MFU with the last recorded GPU run. Dry run: the tiny CPU rehearsal.
  packed-attention    a tiny Qwen3 in bf16 with ``flash_attention_2`` (only if flash-attn is importable): the packed
                      row (position_ids restarting per sample, no attention mask) against each sample alone.
  vllm-sync           optional, only when vllm is importable: a real GPU vLLM student server on the same GPU and a
                      weight push into it, checked through served log-probs. vLLM's ``ipc`` weight-transfer backend
                      (the only one that puts trainer and server on one device: NCCL cannot put two ranks on one
                      GPU) is NOT supported by fastdistill's sync yet (``VLLMWeightSync`` speaks ``gloo`` and ``nccl``);
                      this step therefore pushes over ``gloo`` (weights staged through CPU memory), which exercises
                      the HTTP sequence and a real GPU engine, but not the ipc path.

It runs only a committed tree, since only such a run can be recorded: a git checkout without changes to the kernel
package (untracked files included) or to the tracked files of fastdistill, tests and benchmarks; or a copy without
``.git`` (the lent GPU machine) whose files hash as the stamp written on the clean checkout (``--stamp``,
``build/gpu-check-source.json``, carried with the kit). Otherwise it refuses (exit 2); ``--allow-dirty`` runs it for
numbers only, and the dry run runs on any tree; the JSON records the state (``source``).

Steps that do not fit the remaining budget are recorded as skipped, and so are steps that need what the kit cannot
carry (flash-attn, vLLM), with the reason. The JSON (``--json``) is rewritten after every step, so a run cut short
still leaves what it measured. Exit status 0 when every step that ran passed. At the end it prints the verdict
(``benchmarks/gpu_results.py``): the validation record of this run when every compiled correctness gate passed on a
real GPU from a committed tree, else why not, and the RESULTS.md section to paste (``--results`` pastes it).

``--dry-run`` runs on a CPU what it can, so that the script cannot rot: argument parsing, the install (with
``--kit``: the real kit install and import probe; without: the plan, printed, not run), a few CPU kernel tests under
the interpreter, ``bench_kernels.py --quick`` (interpreter smoke), the packed-attention check with SDPA on the CPU,
the vllm step's import probe, and the JSON. ``tests/test_gpu_rehearsal.py`` runs it with ``--kit`` in a fresh
environment holding only torch, triton 3.6 and what the GPU image has, in a network namespace of its own.

    python3 benchmarks/device_kit.py --out build/device-kit     # here: the wheels the call carries (~3 MiB)
    python3 benchmarks/gpu_check.py --stamp                     # here, committed: the source stamp it carries
    bash benchmarks/gpu_check.sh --kit build/device-kit       # there: the image's python3, no network
    python3 benchmarks/gpu_check.py --python .venv/bin/python --json /tmp/gpu_check.json
    python3 benchmarks/gpu_check.py --dry-run         # CPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kit  # noqa: E402
import gpu_results  # noqa: E402
from device_kit import NOT_CARRIED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "gpu_check.json"
DEFAULT_VENV = ROOT / ".venv-gpu-check"
BENCH_D, BENCH_V = 3584, 152064
BENCH_IMPLS = ("ours-det", "ours-fused", "ours-filter", "ours-chunked", "ours-dense", "ours-dense-chunked", "trl",
               "liger", "cce")
BENCH_REPEATS, BENCH_WARMUP = 10, 5
# Each benchmark step: its N, its K and its implementations (both input distributions, bench_inputs.DISTRIBUTIONS).
BENCH_STEPS = {
    "bench-4096": {"N": [4096], "K": [8], "impls": BENCH_IMPLS},
    "bench-16384": {"N": [16384], "K": [8, 64],
                    "impls": tuple(i for i in BENCH_IMPLS if i not in ("trl", "ours-filter", "ours-fused"))},
}
PACKAGES = ("triton", "trl==1.16.0", "liger-kernel>=0.8.5", "cut-cross-entropy>=25.1.1", "packaging", "pytest")
# Per-step time limits (seconds), in the order the steps run (by value); the global budget cuts them further.
STEP_LIMITS = {"environment": 20, "install": 240, "kernel-tests": 180, "bench-4096": 150, "self-check": 90,
               "bench-16384": 180, "train-step": 180, "packed-attention": 45, "vllm-sync": 120}
KIT_INSTALL_LIMIT_S = 60  # unpacking ~3 MiB of wheels and an import probe, instead of building a venv
STEPS = tuple(STEP_LIMITS)
KERNEL_TEST_WORKERS = 8  # pytest-xdist processes for the compiled tests (compiles in parallel), where it is there
# Environment of every step with --kit: nothing reaches for the network (pip, the Hugging Face hub, datasets).
OFFLINE_ENV = {"PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MIN_STEP_S = 15  # a step with less time than this left is skipped
RESERVE_S = 5  # kept for writing the JSON
TERM_GRACE_S = 15  # after SIGTERM on a timeout, before SIGKILL
# the compiled-kernel tests (test_compiled_*, CUDA only); test_kernel_memory: the peak-memory bounds at the 7B head
GPU_KERNEL_TEST_FILES = ("tests/test_kernels.py", "tests/test_kernels_chunked.py", "tests/test_kernels_dense.py",
                         "tests/test_kernel_memory.py")
LAUNCH_RECORD = "launch-record.json"  # benchmarks/launch_record.py's output: keys of the ran tree, launch patterns
DRY_RUN_KERNEL_TESTS = "auto_backend_keeps or device_guard or mixed_addmm_detection or op_rejects_bad_settings"
IPC_NOTE = ("fastdistill's weight sync (VLLMWeightSync) supports the 'gloo' and 'nccl' backends, not vLLM's 'ipc' "
            "backend; NCCL cannot put two ranks on one GPU, so the same-GPU check pushes over gloo (CPU staging).")


# ------------------------------------------------------------------------------------------------ orchestration
@dataclass
class Context:
    """What every step needs: the settings, the interpreter that runs the work, the deadline, the output folder."""

    args: argparse.Namespace
    python: str
    deadline: float
    workdir: Path
    results: dict = field(default_factory=dict)

    def time_left(self) -> float:
        """Seconds until the deadline, minus the reserve for writing the JSON."""
        return self.deadline - time.monotonic() - RESERVE_S

    def site(self) -> Path:
        """The ``--target`` folder the kit is installed into."""
        return self.args.site or self.workdir / "site"

    def env(self, **extra: str) -> dict[str, str]:
        """A step's environment: :func:`clean_env`, and with ``--kit`` the kit's folder, this source tree and its
        ``kernels/`` first on PYTHONPATH and :data:`OFFLINE_ENV`."""
        if not self.args.kit:
            return clean_env(**extra)
        path = [str(self.site()), str(ROOT), str(ROOT / "kernels")]
        if os.environ.get("PYTHONPATH"):
            path.append(os.environ["PYTHONPATH"])
        return clean_env(PYTHONPATH=os.pathsep.join(path), **OFFLINE_ENV, **extra)


def step_timeout(name: str, time_left: float, dry_run: bool, kit: bool = False) -> float | None:
    """The time limit of step ``name``: its own limit cut to what is left, or None when under MIN_STEP_S remain."""
    own = KIT_INSTALL_LIMIT_S if kit and name == "install" else STEP_LIMITS[name]
    limit = min(own if not dry_run else 120, time_left)
    return None if limit < MIN_STEP_S else limit


def run_command(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
                cwd: Path = ROOT) -> dict:
    """Run ``cmd`` in its own process group; on timeout end that group (only what this step started)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as e:  # e.g. the venv's python after a failed install
        return {"cmd": shlex.join(cmd), "rc": -1, "timed_out": False, "seconds": 0.0, "output_tail": repr(e)}
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # workers stop what they started (a vLLM server) on SIGTERM
        try:
            out, _ = proc.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        timed_out = True
    return {"cmd": shlex.join(cmd), "rc": proc.returncode, "timed_out": timed_out,
            "seconds": round(time.monotonic() - t0, 2), "output_tail": (out or "")[-4000:]}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET (compiled kernels), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def write_json(ctx: Context, started: float) -> None:
    """Write the results so far (atomically: a reader never sees half a file)."""
    ctx.results["elapsed_s"] = round(time.monotonic() - started, 1)
    ran = [s for s in ctx.results["steps"].values() if s["status"] != "skipped"]
    ctx.results["ok"] = bool(ran) and all(s["status"] == "ok" for s in ran)
    path: Path = ctx.args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(ctx.results, indent=2))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ the source tree
# What the check certifies: the kernel package (untracked files count: a new module), and the code that judges it.
SOURCE_KERNELS = ("kernels",)
SOURCE_JUDGES = ("fastdistill", "tests", "benchmarks", "pyproject.toml")
STAMP = ROOT / "build" / "gpu-check-source.json"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def git_source_state() -> dict | None:
    """``{"commit", "clean", "dirty"}`` of this checkout by git (None when it is no git checkout): the changes to
    :data:`SOURCE_KERNELS` (untracked files included) and to the tracked files of :data:`SOURCE_JUDGES`."""
    try:
        head = _git("rev-parse", "--short=7", "HEAD").strip()
        dirty = (_git("status", "--porcelain", "--", *SOURCE_KERNELS).splitlines()
                 + _git("status", "--porcelain", "--untracked-files=no", "--", *SOURCE_JUDGES).splitlines())
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "clean": not dirty, "dirty": [line.strip() for line in dirty[:20]], "how": "git"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_stamp(path: Path | None = None) -> dict:
    """On a clean checkout: write the commit and the sha256 of every tracked file under the source paths to
    ``path``, for a copy of the tree without ``.git`` (the lent GPU machine) to prove it is that commit."""
    state = git_source_state()
    if state is None:
        raise SystemExit("gpu_check --stamp: not a git checkout")
    if not state["clean"]:
        raise SystemExit("gpu_check --stamp: the tree has uncommitted changes; commit them first:\n  "
                         + "\n  ".join(state["dirty"]))
    files = _git("ls-files", "--", *SOURCE_KERNELS, *SOURCE_JUDGES).splitlines()
    path = STAMP if path is None else path
    stamp = {"commit": state["commit"], "files": {f: _sha256(ROOT / f) for f in files if (ROOT / f).is_file()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=1))
    return stamp


def stamp_source_state(path: Path | None = None) -> dict:
    """The tree against a stamp (:func:`write_stamp`): clean when every stamped file hashes as stamped and the
    kernel package holds no Python file the stamp lacks."""
    path = STAMP if path is None else path
    if not path.exists():
        return {"commit": None, "clean": False, "how": "none",
                "dirty": [f"not a git checkout and no source stamp at {path} (write one on the clean checkout: "
                          "python benchmarks/gpu_check.py --stamp)"]}
    stamp = json.loads(path.read_text())
    files = stamp["files"]
    dirty = [f"M {f}" for f, h in files.items() if not (ROOT / f).is_file() or _sha256(ROOT / f) != h]
    package = ROOT / "kernels" / "fastdistill_kernels"
    dirty += [f"?? {p.relative_to(ROOT)}" for p in sorted(package.rglob("*.py"))
              if str(p.relative_to(ROOT)) not in files]
    return {"commit": stamp["commit"], "clean": not dirty, "dirty": dirty[:20], "how": "stamp"}


def source_state() -> dict:
    """The commit this tree is and whether it is exactly that commit (git, else the stamp)."""
    return git_source_state() or stamp_source_state()


# ------------------------------------------------------------------------------------------------ the steps
def step_environment(ctx: Context, timeout_s: float) -> dict:
    """nvidia-smi's view of the GPU(s), and the Python running this script."""
    info = {"status": "ok", "python": sys.version.split()[0], "platform": platform.platform()}
    if shutil.which("nvidia-smi") is None:
        info["gpus"] = []
        info["detail"] = "nvidia-smi not found" + (" (dry run)" if ctx.args.dry_run else "")
        if not ctx.args.dry_run:
            info["status"] = "failed"
        return info
    query = "--query-gpu=name,driver_version,memory.total,compute_cap"
    res = run_command(["nvidia-smi", query, "--format=csv,noheader"], timeout_s)
    info["gpus"] = [line.strip() for line in res["output_tail"].splitlines() if line.strip()]
    if res["rc"] != 0:
        info.update(status="failed", detail=res["output_tail"][-500:])
    return info


def install_commands(ctx: Context) -> list[list[str]]:
    """The commands that build the check's venv (also what a dry run prints)."""
    venv_python = str(ctx.args.venv / "bin" / "python")
    pip = [venv_python, "-m", "pip", "install", "--quiet", *shlex.split(ctx.args.pip_args)]
    torch_pip = [*pip, *(["--index-url", ctx.args.torch_index_url] if ctx.args.torch_index_url else [])]
    return [
        [sys.executable, "-m", "venv", "--system-site-packages", str(ctx.args.venv)],
        [*torch_pip, ctx.args.torch_spec],
        [*pip, *PACKAGES],
        [*pip, "-e", str(ROOT)],  # fastdistill and its dependencies (transformers, ...); torch is already satisfied
        [venv_python, "-c", "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, "
                            "torch.cuda.is_available() and torch.cuda.get_device_name())"],
    ]




def step_install_kit(ctx: Context, timeout_s: float) -> dict:
    """Install the kit into the ``--target`` folder with the image's own interpreter, then import every contender
    through the check's environment (failed: a kit wheel is missing, or one does not import)."""
    started = time.monotonic()
    deadline = started + timeout_s
    if not any(ctx.args.kit.glob("*.whl")):
        return {"status": "failed", "detail": f"no wheels in {ctx.args.kit} (build it: benchmarks/device_kit.py)"}
    install = run_command(device_kit.install_command(ctx.python, ctx.args.kit, ctx.site()), timeout_s, env=ctx.env())
    if install["rc"] != 0:
        return {"status": "timeout" if install["timed_out"] else "failed", "detail": "kit install", **install}
    probe = run_command(device_kit.probe_command(ctx.python), max(1.0, deadline - time.monotonic()), env=ctx.env())
    lines = [line for line in probe["output_tail"].splitlines() if line.startswith("{")]
    if probe["rc"] != 0 or not lines:
        return {"status": "timeout" if probe["timed_out"] else "failed", "detail": "import probe",
                "install": install, **probe}
    versions = json.loads(lines[-1])
    broken = sorted(name for name, r in versions["imports"].items() if not r["ok"])
    return {"status": "failed" if broken else "ok", "detail": f"not importable: {', '.join(broken)}" if broken else "",
            "seconds": round(time.monotonic() - started, 2), "kit": str(ctx.args.kit), "site": str(ctx.site()),
            "install": install, "versions": versions}


def step_install(ctx: Context, timeout_s: float) -> dict:
    """Create the venv and install what the check needs (or, dry run / ``--python``, only say what it would do);
    with ``--kit``, :func:`step_install_kit` (also in a dry run: it needs no network)."""
    if ctx.args.kit:
        return step_install_kit(ctx, timeout_s)
    commands = install_commands(ctx)
    if ctx.args.dry_run or ctx.args.python:
        why = "dry run" if ctx.args.dry_run else f"--python {ctx.args.python}"
        return {"status": "skipped", "detail": why, "planned": [shlex.join(c) for c in commands]}
    deadline = time.monotonic() + timeout_s
    done = []
    for cmd in commands:
        if cmd[1:3] == ["-m", "venv"] and (ctx.args.venv / "bin" / "python").exists():
            continue
        res = run_command(cmd, max(1.0, deadline - time.monotonic()))
        done.append(res)
        if res["rc"] != 0:
            hint = ("creating the venv failed: install your distribution's venv package (e.g. python3-venv) or pass "
                    "--python with an interpreter that has torch" if cmd[1:3] == ["-m", "venv"] else "")
            return {"status": "timeout" if res["timed_out"] else "failed", "detail": hint, "commands": done}
    ctx.python = commands[-1][0]
    return {"status": "ok", "commands": done, "versions": done[-1]["output_tail"].strip()}


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped / passed from a pytest JUnit XML report."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def compiled_counts(path: Path) -> dict:
    """The compiled-kernel tests (``test_compiled_*``) of a JUnit report: how many, passed, and the ids of those
    that failed, erred or were skipped (on a GPU none may be skipped: a skip is no pass)."""
    cases = [c for c in ET.parse(path).getroot().iter("testcase") if c.get("name", "").startswith("test_compiled")]
    bad = [f"{c.get('name')}: {next(iter(c)).tag}" for c in cases if len(c)]
    return {"tests": len(cases), "passed": len(cases) - len(bad), "failed": bad[:50]}


def kernel_test_command(ctx: Context, report: Path) -> list[str]:
    """pytest over the kernel tests (dry run: a few interpreter tests of one file), in parallel where pytest-xdist
    is in the check's interpreter (the compiled tests spend most of their time compiling)."""
    files = ["tests/test_kernels.py"] if ctx.args.dry_run else list(GPU_KERNEL_TEST_FILES)
    cmd = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "launch_record",
           f"--launch-record={report.with_name(LAUNCH_RECORD)}", *files, f"--junitxml={report}"]
    if ctx.args.dry_run:
        return [*cmd, "-k", DRY_RUN_KERNEL_TESTS]
    probe = run_command([ctx.python, "-c", "import xdist"], 30, env=ctx.env())
    return [*cmd, "-n", str(KERNEL_TEST_WORKERS)] if probe["rc"] == 0 else cmd


def step_kernel_tests(ctx: Context, timeout_s: float) -> dict:
    """The kernel tests: compiled on the GPU (dry run: a few interpreter tests on the CPU). On the GPU the step
    passes only when every compiled-kernel test ran and passed."""
    report = ctx.workdir / "kernel-tests.xml"
    env = ctx.env(TRITON_INTERPRET="1") if ctx.args.dry_run else ctx.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPT.parent), env.get("PYTHONPATH")) if p)  # the plugin
    res = run_command(kernel_test_command(ctx, report), timeout_s, env=env)
    launches = report.with_name(LAUNCH_RECORD)
    launch_record = json.loads(launches.read_text()) if launches.exists() else None
    if not report.exists():
        return {"status": "timeout" if res["timed_out"] else "failed", "launch_record": launch_record, **res}
    counts, compiled = junit_counts(report), compiled_counts(report)
    ok = res["rc"] == 0 and counts["passed"] > 0
    if not ctx.args.dry_run:  # the gate: compiled kernels, each test run and passed
        ok = ok and compiled["tests"] > 0 and compiled["passed"] == compiled["tests"]
    return {"status": "ok" if ok else ("timeout" if res["timed_out"] else "failed"), "counts": counts,
            "compiled": compiled, "launch_record": launch_record, **res}


def bench_command(ctx: Context, name: str, out: Path) -> list[str]:
    """bench_kernels.py for step ``name`` (dry run: the CPU interpreter smoke config, both distributions)."""
    cmd = [ctx.python, str(ROOT / "benchmarks" / "bench_kernels.py"), "--json", str(out)]
    if ctx.args.dry_run:  # the interpreter: tiny, one timed repeat
        return [*cmd, "--quick", "--impls", "ours-det", "ours-chunked", "torch", "--N", "32", "--D", "32", "--V",
                "256", "--K", "4", "--repeats", "1", "--warmup", "0", "--gate-rows", "16"]
    spec = BENCH_STEPS[name]
    return [*cmd, "--N", *map(str, spec["N"]), "--D", str(BENCH_D), "--V", str(BENCH_V), "--K", *map(str, spec["K"]),
            "--impls", *spec["impls"], "--repeats", str(BENCH_REPEATS), "--warmup", str(BENCH_WARMUP),
            "--dtype", "bfloat16"]


def step_bench(ctx: Context, name: str, timeout_s: float) -> dict:
    """One bench_kernels.py run; its rows (gate results included) go into the JSON."""
    out = ctx.workdir / f"{name}.json"
    env = ctx.env(TRITON_INTERPRET="1") if ctx.args.dry_run else ctx.env()
    res = run_command(bench_command(ctx, name, out), timeout_s, env=env)
    data = json.loads(out.read_text()) if out.exists() else {}
    rows = data.get("rows", [])
    summary = {f"{r.get('dist', 'random')} N={r['N']} K={r['K']} {impl}": m["status"]
               for r in rows for impl, m in r["impls"].items()}
    status = "ok" if res["rc"] == 0 and rows else ("timeout" if res["timed_out"] else "failed")
    return {"status": status, "summary": summary, "machine": data.get("machine"), "rows": rows,
            "predicted": data.get("predicted"), **res}


def step_worker(ctx: Context, name: str, timeout_s: float) -> dict:
    """Run one of this script's worker steps (``--run-step``) in the check's interpreter; it prints one JSON line."""
    cmd = [ctx.python, str(SCRIPT), "--run-step", name, "--timeout-s", str(int(timeout_s))]
    if ctx.args.dry_run:
        cmd.append("--dry-run")
    if ctx.args.kit:
        cmd.append("--kit-mode")
    res = run_command(cmd, timeout_s + 10, env=ctx.env())
    lines = [line for line in res["output_tail"].splitlines() if line.startswith("{")]
    if res["rc"] != 0 or not lines:
        return {"status": "timeout" if res["timed_out"] else "failed", **res}
    return {**json.loads(lines[-1]), "seconds": res["seconds"]}


TRAIN_STEP_RESERVE_S = 60  # of the step's limit: the configuration running at its budget's end, the checks, the JSON


def step_train(ctx: Context, timeout_s: float) -> dict:
    """``bench_train_step.py`` (dry run: ``--tiny`` on the CPU); its table, checks and guard go into the JSON. Passes
    when the benchmark exits 0: every correctness check passed and no guard bound was crossed."""
    out = ctx.workdir / "train-step.json"
    cmd = [ctx.python, str(ROOT / "benchmarks" / "bench_train_step.py"), "--json", str(out),
           "--budget-s", str(int(max(10.0, timeout_s - TRAIN_STEP_RESERVE_S)))]
    if ctx.args.dry_run:
        cmd.append("--tiny")
    res = run_command(cmd, timeout_s, env=ctx.env())
    data = json.loads(out.read_text()) if out.exists() else {}
    ok = res["rc"] == 0 and bool(data.get("shapes"))
    checks = {f"{s['shape']} {name}": c["status"] for s in data.get("shapes", []) for name, c in s["checks"].items()}
    return {"status": "ok" if ok else ("timeout" if res["timed_out"] else "failed"), "table": data.get("table"),
            "checks": checks, "guard": data.get("guard"), "machine": data.get("machine"),
            "shapes": data.get("shapes"), **res}


def step_selfcheck(ctx: Context, timeout_s: float) -> dict:
    """``python -m fastdistill_kernels.selfcheck``: what ``backend="auto"`` runs on a user's first call, from a cold
    cache folder of its own (dry run: the interpreter rehearsal in fp32, the quickest). Passes when every design
    passed; its verdicts, worst error / tolerance, times and wall time (the check's cost, compiles included) go into
    the JSON."""
    out = ctx.workdir / "selfcheck.json"
    cache = ctx.workdir / "selfcheck-cache"
    extra = {"FASTDISTILL_SELFCHECK_DIR": str(cache)} | ({"TRITON_INTERPRET": "1"} if ctx.args.dry_run else {})
    cmd = [ctx.python, "-m", "fastdistill_kernels.selfcheck", "--json", str(out)]
    res = run_command([*cmd, "--dtype", "float32"] if ctx.args.dry_run else cmd, timeout_s, env=ctx.env(**extra))
    data = json.loads(out.read_text()) if out.exists() else {}
    designs = data.get("designs", {})
    ok = res["rc"] == 0 and bool(designs) and all(d["passed"] for d in designs.values())
    return {"status": "ok" if ok else ("timeout" if res["timed_out"] else "failed"), "designs": designs,
            "key": data.get("key"), "wall_s": data.get("wall_s"), **res}


def run_step(ctx: Context, name: str) -> dict:
    """Dispatch step ``name`` within what is left of the budget."""
    timeout_s = step_timeout(name, ctx.time_left(), ctx.args.dry_run, kit=ctx.args.kit is not None)
    if timeout_s is None:
        return {"status": "skipped", "detail": f"out of budget ({max(0.0, ctx.time_left()):.0f} s left)"}
    if name == "environment":
        return step_environment(ctx, timeout_s)
    if name == "install":
        return step_install(ctx, timeout_s)
    if name == "kernel-tests":
        return step_kernel_tests(ctx, timeout_s)
    if name in BENCH_STEPS:
        if ctx.args.dry_run and name != "bench-4096":
            return {"status": "skipped", "detail": "dry run: one CPU smoke config only"}
        return step_bench(ctx, name, timeout_s)
    if name == "train-step":
        return step_train(ctx, timeout_s)
    if name == "self-check":
        return step_selfcheck(ctx, timeout_s)
    return step_worker(ctx, name, timeout_s)


# ------------------------------------------------------------------------------------------------ worker steps
def packed_attention_check(attn_implementation: str, device: str, dtype_name: str) -> dict:
    """A tiny Qwen3: hidden states of a packed row (position_ids restarting per sample, no attention mask)
    against each sample run alone, and against SDPA on the same packed row. Returns max abs differences."""
    import torch
    from transformers import AutoModelForCausalLM

    from fastdistill.tiny import tiny_config

    dtype = getattr(torch, dtype_name)
    lengths = [7, 1, 12, 5, 9]
    torch.manual_seed(0)
    ids = [torch.randint(3, 300, (n,), device=device) for n in lengths]
    packed_ids = torch.cat(ids)[None]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]

    def hidden(impl: str, input_ids, position_ids=None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(300), attn_implementation=impl).to(device, dtype).eval()
        with torch.no_grad():
            return model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state[0]

    packed = hidden(attn_implementation, packed_ids, positions)
    alone = torch.cat([hidden(attn_implementation, x[None]) for x in ids])
    sdpa = hidden("sdpa", packed_ids, positions)
    scale = float(alone.abs().max())
    return {"attn_implementation": attn_implementation, "device": device, "dtype": dtype_name, "lengths": lengths,
            "max_abs_diff_vs_alone": float((packed - alone).abs().max()),
            "max_abs_diff_vs_sdpa": float((packed - sdpa).abs().max()), "scale": scale}


def worker_packed_attention(args: argparse.Namespace) -> dict:
    """flash_attention_2 in bf16 on the GPU when flash-attn is importable; dry run: SDPA in fp32 on the CPU."""
    import importlib.util

    if args.dry_run:
        result = packed_attention_check("sdpa", "cpu", "float32")
        tol = 1e-5 * max(1.0, result["scale"])
    elif importlib.util.find_spec("flash_attn") is None:
        why = f"not in the kit: {NOT_CARRIED['flash-attn']}" if args.kit_mode else "pip install flash-attn"
        return {"status": "skipped", "detail": f"flash-attn is not importable ({why})"}
    else:
        result = packed_attention_check("flash_attention_2", "cuda", "bfloat16")
        tol = 2.0**-6 * max(1.0, result["scale"])  # a few bf16 roundings of the activations
    ok = max(result["max_abs_diff_vs_alone"], result["max_abs_diff_vs_sdpa"]) <= tol
    return {"status": "ok" if ok else "failed", "tolerance": tol, **result}


def worker_vllm_sync(args: argparse.Namespace) -> dict:
    """A GPU vLLM student server on this GPU, a gloo weight push, served log-probs before and after."""
    import importlib.util

    base = {"ipc_supported": False, "note": IPC_NOTE}
    if importlib.util.find_spec("vllm") is None:
        why = f"not in the kit: {NOT_CARRIED['vllm']}" if args.kit_mode else "optional step"
        return {**base, "status": "skipped", "detail": f"vllm is not importable ({why})"}
    if args.dry_run:
        return {**base, "status": "skipped", "detail": "dry run: vllm importable, no server started"}
    import torch

    from fastdistill.serve import VLLMServer
    from fastdistill.sync import VLLMWeightSync
    from fastdistill.sync.verify import served_logprob_gap
    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = build_model(config).float().eval()
    probes = [[1, 5, 9, 30, 7, 100, 3, 44, 2, 1, 60], list(range(3, 60))]
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained_dir(model, tokenizer, folder)
        server = VLLMServer(folder, role="student", python=sys.executable, cpu=False, weight_transfer_backend="gloo",
                            extra_args=["--enforce-eager", "--gpu-memory-utilization", "0.2"],
                            startup_timeout_s=max(30.0, args.timeout_s - 40))
        with server, VLLMWeightSync(server.url, backend="gloo", timeout_s=60) as sync:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            before = served_logprob_gap(server.url, model, probes)
            timings = sync.push(model, 1)
            after = served_logprob_gap(server.url, model, probes)
    ok = after <= 1e-2 < before  # fp32 server on a GPU (TF32 may be on): coarser than the CPU's ~1e-6
    return {**base, "status": "ok" if ok else "failed", "backend": "gloo", "gap_before": before, "gap_after": after,
            "timings_s": timings}


WORKERS = {"packed-attention": worker_packed_attention, "vllm-sync": worker_vllm_sync}


# ------------------------------------------------------------------------------------------------ entry points
def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line settings (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU: exercise every step's plumbing, install nothing")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole check")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="run only these steps")
    p.add_argument("--python", help="use this interpreter (torch with CUDA, triton, ...) instead of building a venv")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the venv the install step builds or reuses")
    p.add_argument("--torch-spec", default="torch>=2.6", help="pip requirement for torch (a CUDA build)")
    p.add_argument("--torch-index-url", help="pip index for torch, e.g. https://download.pytorch.org/whl/cu126")
    p.add_argument("--pip-args", default="", help="extra pip arguments, e.g. '--no-index --find-links /wheels'")
    p.add_argument("--kit", type=Path, help="a folder of wheels (benchmarks/device_kit.py): install them with this "
                   "python3 into a --target folder, no network, no venv, fastdistill from this source tree")
    p.add_argument("--site", type=Path, help="the --target folder for --kit (default: a temporary folder)")
    p.add_argument("--results", type=Path, help="paste the read-off section into this markdown file (RESULTS.md)")
    p.add_argument("--stamp", action="store_true", help=f"on a clean checkout: write {STAMP.relative_to(ROOT)} "
                   "(the commit and its files' hashes) for a copy of the tree without .git, then exit")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes: numbers only, the run "
                   "cannot be recorded as a validation")
    p.add_argument("--run-step", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--kit-mode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=120.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget_s <= RESERVE_S + MIN_STEP_S:
        p.error(f"--budget-s must exceed {RESERVE_S + MIN_STEP_S} s")
    if args.kit is not None:
        args.kit = args.kit.resolve()
        if not args.kit.is_dir():
            p.error(f"--kit {args.kit} is not a folder (build it with benchmarks/device_kit.py)")
        if args.python is None:
            args.python = sys.executable  # the image's python3 as it is
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check (or one worker step with ``--run-step``); returns the exit status."""
    args = parse_args(argv)
    if args.run_step:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwinds `with server:` blocks: no orphaned vLLM server
        print(json.dumps(WORKERS[args.run_step](args)), flush=True)
        return 0
    if args.stamp:
        stamp = write_stamp()
        print(f"[gpu_check] wrote {STAMP}: commit {stamp['commit']}, {len(stamp['files'])} files")
        return 0
    source = source_state()
    if not source["clean"] and not (args.dry_run or args.allow_dirty):
        print("[gpu_check] refused: the tree is not a committed one, so its run could not be recorded "
              "(commit, or pass --allow-dirty for numbers only):\n  " + "\n  ".join(source["dirty"]), flush=True)
        return 2
    started = time.monotonic()
    python = args.python or (sys.executable if args.dry_run else str(args.venv / "bin" / "python"))
    mode = "kit" if args.kit else ("python" if args.python else "venv")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
        ctx = Context(args=args, python=python, deadline=started + args.budget_s, workdir=Path(workdir))
        ctx.results = {"schema": 2, "date": datetime.now(UTC).isoformat(timespec="seconds"), "dry_run": args.dry_run,
                       "budget_s": args.budget_s, "step_limits": STEP_LIMITS, "mode": mode, "python": python,
                       "source": source, "notes": [IPC_NOTE], "steps": {}}
        for name in STEPS:
            if name not in args.steps:
                continue
            print(f"[gpu_check] {name} ...", flush=True)
            result = run_step(ctx, name)
            ctx.results["steps"][name] = result
            print(f"[gpu_check] {name}: {result['status']} {result.get('detail', '')}".rstrip(), flush=True)
            write_json(ctx, started)
    print(f"[gpu_check] wrote {args.json} in {ctx.results['elapsed_s']} s: {'ok' if ctx.results['ok'] else 'FAILED'}")
    section = gpu_results.markdown_section(ctx.results)
    print(section, flush=True)
    if args.results:
        gpu_results.update_results(args.results, section)
    return 0 if ctx.results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
