"""The fused-loss kernels compiled for real NVIDIA targets (sm_80, sm_90) on a CPU machine, as a GPU would launch them.

``benchmarks/compile_report.py --set test`` records every kernel launch the dispatcher makes for each variant (dtype,
bias + softcap, backward mode, filter) at a Qwen-like shape through the real ``fused_sparse_jsd`` on meta tensors,
specialises it as ``JITFunction.run`` would and compiles it with Triton's bundled ptxas. It runs in a subprocess:
the test session runs Triton in its interpreter (conftest.py), which replaces ``@triton.jit`` kernels. Nothing is
cached between runs. Known defects of the current kernels are strict xfails carrying the measured numbers: fixing
one turns its xfail into a failure, and the mark goes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile  # every test but one reads a ptxas compile report (minutes)

triton = pytest.importorskip("triton", reason="compiling the kernels needs the triton package")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_report.py"
_spec = importlib.util.spec_from_file_location("compile_report", SCRIPT)
cr = importlib.util.module_from_spec(_spec)
sys.modules["compile_report"] = cr  # dataclasses look their module up
_spec.loader.exec_module(cr)

SHAPE = "qwen"
VARIANTS = cr.variant_set("test")
TARGETS = cr.selected_targets()  # all, or $FASTDISTILL_COMPILE_TARGETS (the triton-3.6 lane: the lent H200's sm90)
ROLES = {  # kernel role -> (JIT function, the backward mode of the call whose launch is checked)
    "forward": ("_forward_kernel", "deterministic"),
    "backward-deterministic": ("_backward_kernel", "deterministic"),
    "backward-fused": ("_backward_kernel", "fused"),
}
# Shared memory per block (dynamic + static) above the target's opt-in limit: the launch raises OutOfResources.
# None since fp32 got its own tiles (config.FP32_TILES, 128×64×32): with the half-precision tiles the fp32 fused
# backward needed 212,992 B (ieee) / 262,144–295,936 B (tf32) on sm_80 / sm_90, over 166,912 / 232,448 B.
SMEM_OVERFLOW: dict[tuple[str, str], str] = {}
# The Triton release compiling here (the subprocess runs the same interpreter and path): register allocation, and so
# the spills below, differ between releases. A release not measured is held to the pinned one's numbers.
TRITON = ".".join(triton.__version__.split(".")[:2])
PINNED_TRITON = "3.9"
# ptxas spill stores (bytes per thread) in the plain half-precision variants at N=16384, D=3584, V=152064, S=65
# (tiles 128×128×64, 3 stages), per Triton release (3.9.0 with its ptxas 12.9, 3.6.0 with its ptxas 12.8). Under
# 3.9 the forward on sm_80 stopped spilling (112 / 84 B before) when its per-candidate loop became one candidate per
# row per trip.
SPILLS_BY_TRITON = {
    "3.9": {
        ("forward", "sm90"): "forward: 255 registers, 8 B spill stores / 4 B loads on sm_90 (1 CTA/SM)",
        ("backward-fused", "sm80"): "fused backward: 255 registers, 84 B spill stores / 84 B loads on sm_80",
    },
    "3.6": {
        ("forward", "sm80"): "forward: 255 registers, 32 B spill stores / 32 B loads on sm_80 (triton 3.6.0)",
    },
}
SPILLS = SPILLS_BY_TRITON.get(TRITON, SPILLS_BY_TRITON[PINNED_TRITON])
# The same for the fused dense-teacher kernels: (dtype, target, kernel label) -> measured spill.
DENSE_FUSED_SPILLS_BY_TRITON = {
    "3.9": {},
    "3.6": {("bf16", "sm90", "backward-fused/jsd"): "255 registers, 8 B spill stores / 8 B loads (triton 3.6.0)"},
}
DENSE_FUSED_SPILLS = DENSE_FUSED_SPILLS_BY_TRITON.get(TRITON, DENSE_FUSED_SPILLS_BY_TRITON[PINNED_TRITON])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The compile report of the test variants at the Qwen-like shape, both targets (one subprocess, ~2-3 min)."""
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    cmd = [sys.executable, str(SCRIPT), "--set", "test", "--shapes", SHAPE, "--first-chunk-only", "--quiet",
           "--json", str(out), "--targets", *TARGETS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if proc.returncode == 2:  # the script's exit code for an unusable toolchain (no NVIDIA backend, no ptxas)
        pytest.skip(proc.stderr.strip()[-500:])
    assert proc.returncode in (0, 1) and out.exists(), proc.stderr[-4000:]  # 1: some variant failed or overflows
    return json.loads(out.read_text())


def _units(report: dict, variant: str, target: str, kernel: str | None = None) -> list[dict]:
    """The compiled kernels one dispatcher call launches (optionally only ``kernel``'s)."""
    calls = [c for c in report["calls"] if (c["variant"], c["shape"], c["target"]) == (variant, SHAPE, target)]
    assert len(calls) == 1, (variant, target)
    by_id = {u["id"]: u for u in report["units"]}
    units = [by_id[i] for i in calls[0]["units"]]
    return [u for u in units if kernel is None or u["kernel"] == kernel]


def _main_units(report: dict, dtype: str, role: str, target: str) -> list[dict]:
    """The compiled kernels of ``role`` in the plain ``dtype`` variant."""
    kernel, mode = ROLES[role]
    units = _units(report, cr.Variant(dtype, mode=mode).name, target, kernel)
    assert units, (dtype, role, target)
    return units


def _cases(names, marks: dict) -> list:
    """pytest params over ``names`` (tuples), with a strict xfail where ``marks`` names a measured defect."""
    return [pytest.param(*n, marks=pytest.mark.xfail(strict=True, reason=marks[n]) if n in marks else (),
                         id="-".join(n)) for n in names]


@pytest.mark.parametrize("variant,target", [pytest.param(v.name, t, id=f"{v.name}-{t}") for v in VARIANTS
                                            for t in TARGETS])
def test_every_variant_compiles(report, variant, target):
    units = _units(report, variant, target)
    assert {u["kernel"] for u in units} == {"_forward_kernel", "_backward_kernel"}
    for u in units:
        assert "error" not in u["metrics"], (u["id"], u["metrics"].get("error"))
        assert u["metrics"]["registers"] > 0 and u["metrics"]["sass"]["instructions"] > 0, u["id"]


@pytest.mark.parametrize("variant,target", _cases([(v.name, t) for v in VARIANTS for t in TARGETS], SMEM_OVERFLOW))
def test_shared_memory_fits_the_target(report, variant, target):
    limit = report["targets"][target]["smem_per_block"]
    for u in _units(report, variant, target):
        m = u["metrics"]
        assert m["shared_bytes"] + m["static_shared_bytes"] <= limit, (u["id"], m["shared_bytes"], limit)


HALF_CASES = [(dt, role, t) for dt in ("bf16", "fp16") for role in ROLES for t in TARGETS]


# fp32 runs its dots as tf32x3 (three tf32 tensor-core products), so it uses tensor cores too.
TC_CASES = HALF_CASES + [("fp32", role, t) for role in ROLES for t in TARGETS]


@pytest.mark.parametrize("dtype,role,target", [pytest.param(*c, id="-".join(c)) for c in TC_CASES])
def test_main_variants_use_tensor_cores(report, dtype, role, target):
    for u in _main_units(report, dtype, role, target):
        ptx, sass = u["metrics"]["ptx"], u["metrics"]["sass"]
        if target == "sm90":  # warpgroup MMA, not the sm_80 fallback
            assert ptx["wgmma"] > 0 and sass["opcodes"].get("HGMMA.64", 0) > 0, (u["id"], ptx, sass["opcodes"])
            assert sass["wgmma"] == sum(n for op, n in sass["opcodes"].items() if op.startswith("HGMMA")) > 0
        else:
            assert ptx["mma"] > 0 and sass["tensor_core"] > 0, (u["id"], ptx, sass["opcodes"])


SPILL_MARKS = {(dt, role, t): why for (role, t), why in SPILLS.items() for dt in ("bf16", "fp16")}


@pytest.mark.parametrize("dtype,role,target", _cases(HALF_CASES, SPILL_MARKS))
def test_half_precision_does_not_spill(report, dtype, role, target):
    for u in _main_units(report, dtype, role, target):
        m = u["metrics"]
        assert (m["spill_store_bytes"], m["sass"]["spill_store"]) == (0, 0), (
            u["id"], m["registers"], m["spill_store_bytes"], m["spill_load_bytes"])


def test_sass_groups_count_wgmma_and_tma_by_opcode():
    """``wgmma`` counts HGMMA (sm_90's warpgroup MMA, also a tensor-core instruction), ``tma`` the TMA copies, by
    their base opcode whatever the modifiers and predicates; ordinary loads count in neither."""
    listing = "\n".join([
        "        /*0070*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;",
        "        /*0080*/              @P0   UTMALDG.2D [UR8], [UR10] ;",
        "        /*0090*/                   UTMASTG.2D [UR6], [UR12] ;",
        "        /*00a0*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*00b0*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;",
    ])
    got = cr.sass_stats(listing)
    assert (got["instructions"], got["wgmma"], got["tma"], got["tensor_core"]) == (5, 1, 2, 2)


def test_results_section_is_replaced_in_place(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# Results\n\nbefore\n\n{cr.SECTION_START}\nold\n{cr.SECTION_END}\n\nafter\n")
    cr.update_results(path, f"{cr.SECTION_START}\nnew\n{cr.SECTION_END}")
    assert path.read_text() == f"# Results\n\nbefore\n\n{cr.SECTION_START}\nnew\n{cr.SECTION_END}\n\nafter\n"
    fresh = tmp_path / "empty.md"
    cr.update_results(fresh, f"{cr.SECTION_START}\nx\n{cr.SECTION_END}")
    assert fresh.read_text().strip().endswith(cr.SECTION_END)


# --------------------------------------------------------------------------- dense teacher, chunked logits

DENSE_SCRIPT = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compile_report", {str(SCRIPT)!r})
cr = importlib.util.module_from_spec(spec)
sys.modules["compile_report"] = cr
spec.loader.exec_module(cr)
problem = cr.toolchain_problem()
if problem:
    print(problem, file=sys.stderr)
    sys.exit(2)
json.dump(cr.dense_report(("bf16",), cr.selected_targets()), open(sys.argv[1], "w"))
"""


def run_report_script(script: str, out: Path, timeout: int) -> list[dict]:
    """Run a report ``script`` (writes JSON to its first argument) in a subprocess without the interpreter; skip
    where the toolchain is unusable (exit 2)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=timeout,
                          env=env)
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip()[-500:])
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def dense_report(tmp_path_factory) -> list[dict]:
    """The dense-teacher chunked kernels (statistics pass, gradient pass per β mode) compiled in bf16 at the
    Qwen-like shape for both targets (one subprocess, ~10 s)."""
    return run_report_script(DENSE_SCRIPT, tmp_path_factory.mktemp("compile-dense") / "dense.json", 600)


@pytest.mark.parametrize("target", TARGETS)
def test_dense_chunk_kernels_compile_fit_and_do_not_spill(dense_report, target):
    entries = [e for e in dense_report if e["target"] == target]
    assert sorted(e["mode"] for e in entries) == sorted(["stats", *cr.DENSE_MODES])
    for e in entries:
        m = e["metrics"]
        assert "error" not in m, (e["kernel"], e["mode"], m.get("error"))
        assert m["registers"] > 0, e
        assert m["shared_bytes"] + m["static_shared_bytes"] <= e["smem_per_block"], (e["kernel"], e["mode"], m)
        assert (m["spill_store_bytes"], m["spill_load_bytes"], m["sass"]["spill_store"]) == (0, 0, 0), (
            e["kernel"], e["mode"], m["registers"], m["spill_store_bytes"], m["spill_load_bytes"])


# --------------------------------------------------------------------------- dense teacher, fused heads

DENSE_FUSED_SCRIPT = DENSE_SCRIPT.replace("cr.dense_report(", "cr.dense_fused_report(").replace(
    '("bf16",)', '("bf16", "fp32")')


@pytest.fixture(scope="module")
def dense_fused_report(tmp_path_factory) -> list[dict]:
    """The fused dense-teacher kernels (forward, mixed-β pass, backward per β mode and backward mode) compiled in
    bf16 and fp32 at the Qwen-like shape for both targets with their default tiles (one subprocess, ~30 s)."""
    return run_report_script(DENSE_FUSED_SCRIPT, tmp_path_factory.mktemp("compile-dense-fused") / "dense.json", 900)


DENSE_FUSED_LABELS = ["forward", "mixed", *(f"backward-{m}/{b}" for m in cr.MODES for b in cr.DENSE_MODES)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dense_fused_kernels_compile_fit_and_use_tensor_cores(dense_fused_report, dtype, target):
    entries = [e for e in dense_fused_report if e["target"] == target and e["dtype"] == dtype]
    assert sorted(e["mode"] for e in entries) == sorted(DENSE_FUSED_LABELS)
    for e in entries:
        m = e["metrics"]
        assert "error" not in m, (e["kernel"], e["mode"], m.get("error"))
        assert m["shared_bytes"] + m["static_shared_bytes"] <= e["smem_per_block"], (e["mode"], m["shared_bytes"])
        assert m["sass"]["tensor_core"] > 0, (e["mode"], m["sass"])
        fused = e["mode"].startswith("backward-fused")
        assert (m["sass"]["atomic"] > 0) == fused, (e["mode"], m["sass"]["atomic"])


@pytest.mark.parametrize("dtype,target,label", _cases([(dt, t, label) for dt in ("bf16", "fp32") for t in TARGETS
                                                       for label in DENSE_FUSED_LABELS], DENSE_FUSED_SPILLS))
def test_dense_fused_kernels_do_not_spill(dense_fused_report, dtype, target, label):
    (e,) = [e for e in dense_fused_report if (e["dtype"], e["target"], e["mode"]) == (dtype, target, label)]
    m = e["metrics"]
    assert (m["spill_store_bytes"], m["spill_load_bytes"], m["sass"]["spill_store"]) == (0, 0, 0), (
        e["mode"], m["registers"], m["spill_store_bytes"], m["spill_load_bytes"])


# A compile parent that blocks in its pool until killed: the workers report their pids, then wait forever (the work
# itself is replaced; the pool and its workers are the real ones).
POOL_PARENT = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
cr = importlib.util.module_from_spec(spec)
sys.modules["compile_report"] = cr
spec.loader.exec_module(cr)

def compile_forever(launch, target):
    open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()
    signal.pause()

cr.compile_launch = compile_forever
cr.compile_launches([(None, None)] * 2)
"""


def test_compile_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILL of the process running ``compile_launches`` takes its forked pool workers with it (they would wait on
    the job queue for ever): the parent's process group is empty afterwards."""
    import signal

    from fastdistill.supervise import group_is_empty
    from fastdistill_testing.cluster import wait_for

    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "FASTDISTILL_COMPILE_JOBS": "2"}
    parent = subprocess.Popen([sys.executable, "-c", POOL_PARENT, str(SCRIPT), str(pids)], env=env,
                              start_new_session=True)
    try:
        wait_for(lambda: len(list(pids.iterdir())) == 2, timeout_s=120, what="two compile workers started")
        workers = [int(path.name) for path in pids.iterdir()]
        assert all(os.getpgid(pid) == parent.pid for pid in workers)
        parent.kill()
        parent.wait()
        wait_for(lambda: group_is_empty(parent.pid), timeout_s=60, what="the compile workers ended with their parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
