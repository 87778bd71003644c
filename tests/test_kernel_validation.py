"""The record of which kernel designs have run on a real GPU (fastdistill_kernels.validation): each design keyed by
the whole source of the modules its code lives in, the triton version and the launch pattern, against
kernels/fastdistill_kernels/validated.json (the H200 run of commit 17cb676, re-keyed)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import fastdistill_kernels
import pytest
import torch
from fastdistill_kernels import validation
from loss_cases import make_case

import fastdistill.loss.api as api
import fastdistill.loss.routing as routing
from fastdistill import sparse_jsd_loss

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kernels" / "fastdistill_kernels"
RAN_COMMIT = "17cb676"  # the tree the H200 ran (the record's validated_on.commit)
RAN_TRITON = "3.6.0"

# A package of three modules: host code that launches one kernel through a class, a jit helper imported from another
# module, a tl.constexpr constant, a jit function nothing launches, and a module nothing reaches.
TOY = {
    "entry": (
        "from .helpers import helper, LIMIT\n"
        "from . import helpers\n"
        "import triton\n\n"
        "def entry(x):\n    return _Op.apply(x)\n\n"
        "class _Op:\n    @staticmethod\n    def forward(x):\n        launch(x)\n\n"
        "def launch(x):\n    _kernel[(1,)](x, num_warps=8)\n    helpers.host_only()\n\n"
        "@triton.jit(do_not_specialize=['n'])\ndef _kernel(X, n):\n    helper(X, LIMIT)\n\n"
        "@triton.jit\ndef _unused(X):\n    pass\n"
    ),
    "helpers": (
        "import triton\nimport triton.language as tl\nfrom .setup import patch\n\n"
        "BASE = 7\nLIMIT = tl.constexpr(BASE * 2)\npatch()\n\n"
        "@triton.jit\ndef helper(X, m):\n    pass\n\n"
        "def host_only():\n    return BASE\n"
    ),
    "setup": "from fastdistill_kernels.deep import DEPTH\n\ndef patch():\n    return DEPTH\n",
    "deep": "DEPTH = 3\n",
    "unrelated": "def nothing():\n    pass\n",
}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(validation, "DESIGNS", {("toy", "triton"): ("entry", "entry")})
    return TOY


def _record(sources: dict, triton: str, patterns: dict) -> dict:
    keys = validation.run_keys(sources.__getitem__, triton)
    return validation.new_record({"commit": "test"}, keys, patterns)


def _commit_reader(commit: str):
    """The kernel package's sources at ``commit`` (git show), or a skip outside a git checkout."""
    try:
        subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], check=True,
                       capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"needs the git history ({commit})")

    def read(module: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:kernels/fastdistill_kernels/{module}.py"],
                              check=True, capture_output=True, text=True, timeout=60).stdout
    return read


def test_source_hash_is_sha256_of_the_text_with_unix_line_endings():
    assert validation.source_hash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert validation.source_hash("a\r\nb\n") == hashlib.sha256(b"a\nb\n").hexdigest()


def test_a_design_is_every_module_its_code_reaches(toy):
    """The entry module, the helper's module (through a name and through ``helpers.attr``), the module an
    import-time call of it reaches and what that imports by the package's absolute name; not a module nothing
    refers to."""
    assert validation.design_modules("toy", "triton", toy.__getitem__) == ["deep", "entry", "helpers", "setup"]


def test_the_real_designs_reach_their_own_modules():
    mods = {d: set(validation.design_modules(*d)) for d in validation.DESIGNS}
    assert {"ops", "forward", "backward", "tiles", "config"} <= mods[("sparse", "triton")]
    assert "logits_chunk" not in mods[("sparse", "triton")] and "dense_fused" not in mods[("sparse", "triton")]
    assert {"logits_chunk", "config"} <= mods[("sparse", "triton-chunked")]
    assert "forward" not in mods[("sparse", "triton-chunked")]
    assert {"dense_fused", "tiles"} <= mods[("dense", "triton")]
    assert {"dense_chunk", "logits_chunk"} <= mods[("dense", "triton-chunked")]
    assert all("validation" not in m for m in mods.values())


@pytest.mark.parametrize("module,old,new", [
    ("entry", "num_warps=8", "num_warps=4"),  # a launch setting in host code
    ("helpers", "return BASE", "return BASE + 1"),  # host code of a helper module
    ("setup", "return DEPTH", "return DEPTH + 1"),  # what an import-time call runs
    ("deep", "DEPTH = 3", "DEPTH = 4"),  # a value imported by the package's absolute name
])
def test_any_edit_to_a_reached_module_changes_the_key(toy, module, old, new):
    key = validation.design_code_key("toy", "triton", "3.6.0", toy.__getitem__)
    edited = {**toy, module: toy[module].replace(old, new)}
    assert edited[module] != toy[module]
    assert validation.design_code_key("toy", "triton", "3.6.0", edited.__getitem__) != key
    unreached = {**toy, "unrelated": "def nothing():\n    return 2\n"}
    assert validation.design_code_key("toy", "triton", "3.6.0", unreached.__getitem__) == key


def test_the_key_is_the_triton_minor_version(toy):
    key = validation.design_code_key("toy", "triton", "3.6.0", toy.__getitem__)
    assert validation.design_code_key("toy", "triton", "3.6.1", toy.__getitem__) == key
    assert validation.design_code_key("toy", "triton", "3.6", toy.__getitem__) == key
    assert validation.design_code_key("toy", "triton", "3.7.0", toy.__getitem__) != key
    assert validation.triton_minor("3.6.0+git1234") == "3.6" and validation.triton_minor(None) == "none"


def _copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "fastdistill_kernels"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _all_passed(loss, backend, pattern):
    return {loss: {backend: {pattern: validation.PASSED}}}


SPARSE_BF16 = "hidden=bf16:grad weight=bf16:grad bias=None"


def test_halving_the_warps_in_a_copy_of_the_package_unvalidates_the_design(tmp_path):
    """A record of the package as it is validates the fused design; the same package with every ``num_warps``
    halved and one more stage in its tile config does not, and the state names the changed modules."""
    copy = _copy_package(tmp_path)
    read = validation.folder_reader(copy)
    record = _record({m: read(m) for m in PACKAGE_MODULES()}, "3.6.0", _all_passed("sparse", "triton", SPARSE_BF16))
    kw = dict(record=record, triton_version="3.6.0", read=read)
    assert validation.design_state("sparse", "triton", SPARSE_BF16, **kw).validated
    config = copy / "config.py"
    text = config.read_text()
    assert "num_warps: int = 8" in text and "num_stages: int = 3" in text
    config.write_text(text.replace("num_warps: int = 8", "num_warps: int = 4").replace("num_stages: int = 3",
                                                                                      "num_stages: int = 4"))
    state = validation.design_state("sparse", "triton", SPARSE_BF16, **kw)
    assert not state.validated and state.changed_modules == ("config",)
    assert "changed since the GPU run: config" in state.reason()


def test_a_launch_setting_in_host_code_unvalidates_only_the_designs_that_reach_it(tmp_path):
    copy = _copy_package(tmp_path)
    read = validation.folder_reader(copy)
    patterns = {"sparse": {"triton": {SPARSE_BF16: "passed"}, "triton-chunked": {SPARSE_BF16: "passed"}}}
    record = _record({m: read(m) for m in PACKAGE_MODULES()}, "3.6.0", patterns)
    path = copy / "logits_chunk.py"
    text = path.read_text()
    assert "GPU_NUM_WARPS = 2048, 8" in text
    path.write_text(text.replace("GPU_NUM_WARPS = 2048, 8", "GPU_NUM_WARPS = 2048, 4"))
    kw = dict(record=record, triton_version="3.6.0", read=read)
    assert validation.design_state("sparse", "triton", **kw).validated
    assert validation.design_state("sparse", "triton-chunked", **kw).changed_modules == ("logits_chunk",)


def PACKAGE_MODULES() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def test_a_different_triton_minor_version_unvalidates():
    read = validation.read_package_module
    record = _record({m: read(m) for m in PACKAGE_MODULES()}, "3.6.0", _all_passed("sparse", "triton", SPARSE_BF16))
    assert validation.design_state("sparse", "triton", record=record, triton_version="3.6.2").validated
    state = validation.design_state("sparse", "triton", record=record, triton_version="3.7.0")
    assert not state.validated and state.changed_modules == ()
    assert "triton 3.7 here, 3.6 on the GPU run" in state.reason()


def test_a_launch_pattern_validates_only_when_it_passed_on_the_gpu():
    read = validation.read_package_module
    fp32 = "hidden=fp32:grad weight=fp32:grad bias=None"
    patterns = {"sparse": {"triton": {SPARSE_BF16: "passed", fp32: "failed"}}}
    record = _record({m: read(m) for m in PACKAGE_MODULES()}, "3.6.0", patterns)
    kw = dict(record=record, triton_version="3.6.0")
    assert validation.design_state("sparse", "triton", SPARSE_BF16, **kw).validated
    assert validation.design_state("sparse", "triton", **kw).validated  # some pattern passed
    failed = validation.design_state("sparse", "triton", fp32, **kw)
    assert not failed.validated and "failed on the GPU run" in failed.reason()
    frozen = "hidden=bf16:grad weight=bf16 bias=None"  # a frozen lm_head: dW launched as None
    never = validation.design_state("sparse", "triton", frozen, **kw)
    assert not never.validated and "never ran on a GPU" in never.reason()
    only_failed = _record({m: read(m) for m in PACKAGE_MODULES()}, "3.6.0", {"sparse": {"triton": {fp32: "failed"}}})
    assert only_failed["designs"] == {}  # a design with no passing pattern is not recorded


def test_launch_pattern_reads_dtypes_nones_and_gradients():
    h = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(4, 3, dtype=torch.bfloat16)
    assert validation.launch_pattern("sparse", (h, w, None)) == "hidden=bf16:grad weight=bf16 bias=None"
    assert validation.launch_pattern("sparse", (h, w, None), grad_enabled=False) == "hidden=bf16 weight=bf16 bias=None"
    assert validation.launch_pattern("sparse", (h, w, None), needs_grad=(True, True, False, False)) == SPARSE_BF16
    t = torch.zeros(2, 3, dtype=torch.float16)
    dense = validation.launch_pattern("dense", (h, w, None, t, t, None))
    assert dense == ("student_hidden=bf16:grad student_weight=bf16 student_bias=None teacher_hidden=fp16 "
                     "teacher_weight=fp16 teacher_bias=None")
    with pytest.raises(ValueError, match="takes 3 operands"):
        validation.launch_pattern("sparse", (h, w))


def test_the_committed_record_is_the_h200_run_of_17cb676_rekeyed():
    """Its module hashes are those of 17cb676's sources with triton 3.6: every design validates against them, at
    the patterns 17cb676's compiled tests ran (bf16 without bias included), and not at a frozen lm_head."""
    record = validation.load_record()
    assert record["schema"] == validation.RECORD_SCHEMA == 2
    read = _commit_reader(RAN_COMMIT)
    for loss, backend in validation.DESIGNS:
        entry = record["designs"][loss][backend]
        run = entry["validated_on"]
        assert run["commit"] == RAN_COMMIT and "H200" in run["machine"] and "triton 3.6.0" in run["software"]
        assert run["compute_capability"] == "9.0"
        assert run["compiled_tests"]["passed"] == run["compiled_tests"]["total"] > 0
        assert entry["triton"] == "3.6"
        assert entry["code_key"] == validation.design_code_key(loss, backend, RAN_TRITON, read)
        state = validation.design_state(loss, backend, record=record, triton_version=RAN_TRITON, read=read)
        assert state.validated, (loss, backend, state.reason())
        assert set(entry["launch_patterns"].values()) == {"passed"}
    assert len(record["designs"]["sparse"]["triton"]["launch_patterns"]) == 6  # 3 dtypes × bias or None
    assert len(record["designs"]["dense"]["triton-chunked"]["launch_patterns"]) == 4
    kw = dict(record=record, triton_version=RAN_TRITON, read=read)
    assert validation.design_state("sparse", "triton", SPARSE_BF16, **kw).validated
    assert not validation.design_state("sparse", "triton", "hidden=bf16:grad weight=bf16 bias=None", **kw).validated


def test_todays_changed_designs_are_not_validated_by_the_rekeyed_record():
    """The fused sparse design among them: its host code changed after the H200 run (backward.py's row blocks and
    None launches, config.py's workspace). A design counts as validated today only where none of its modules
    changed since 17cb676."""
    record = validation.load_record()
    read = _commit_reader(RAN_COMMIT)
    for design in validation.DESIGNS:
        modules = validation.design_modules(*design)
        changed = sorted(m for m in modules if read(m) != validation.read_package_module(m))
        state = validation.design_state(*design, record=record, triton_version=RAN_TRITON)
        assert state.validated is (not changed), (design, changed)
        assert list(state.changed_modules) == changed
    assert not validation.design_state("sparse", "triton", record=record, triton_version=RAN_TRITON).validated


def test_the_cli_prints_each_designs_state():
    proc = subprocess.run([sys.executable, "-m", "fastdistill_kernels.validation", "--triton", RAN_TRITON],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(validation.DESIGNS)
    for (loss, backend), line in zip(validation.DESIGNS, lines, strict=True):
        assert re.match(rf"{loss}\s+{backend}\s+(validated \(triton 3\.6|NOT validated: )", line), line
    assert "RuntimeWarning" not in proc.stderr


def test_an_unreadable_or_foreign_record_validates_nothing(tmp_path, monkeypatch):
    bad = tmp_path / "validated.json"
    bad.write_text(json.dumps({"schema": 1, "designs": {}}))
    with pytest.raises(ValueError, match="schema 1, expected 2"):
        validation.load_record(bad)
    assert validation.load_record(tmp_path / "absent.json")["designs"] == {}
    validation.validated_designs.cache_clear()
    monkeypatch.setattr(validation, "RECORD_FILE", bad)
    try:
        assert validation.validated_designs() == frozenset()
        assert not validation.is_validated("sparse", "triton")
    finally:
        validation.validated_designs.cache_clear()


def test_is_validated_needs_the_code_key_and_the_pattern(monkeypatch):
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset({("sparse", "triton")}))
    monkeypatch.setattr(validation, "_record_patterns", lambda: {("sparse", "triton"): frozenset({SPARSE_BF16})})
    assert validation.is_validated("sparse", "triton") and validation.is_validated("sparse", "triton", SPARSE_BF16)
    assert not validation.is_validated("sparse", "triton", "hidden=fp32:grad weight=fp32:grad bias=None")
    assert not validation.is_validated("sparse", "triton-chunked", SPARSE_BF16)
    with pytest.raises(ValueError, match="unknown kernel design"):
        validation.is_validated("sparse", "cuda")


def test_the_public_flag_says_whether_every_design_is_validated(monkeypatch):
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset(validation.DESIGNS))
    assert fastdistill_kernels.KERNELS_VALIDATED_ON_GPU is True
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset(list(validation.DESIGNS)[1:]))
    assert fastdistill_kernels.KERNELS_VALIDATED_ON_GPU is False


def test_auto_without_the_self_check_runs_the_torch_path_on_todays_tree(monkeypatch, tmp_path):
    """The committed record, read for real on the triton that ran (3.6): no design of today's tree is validated, so
    ``backend="auto"`` on a CUDA device with the self-check off takes the torch path, with a warning naming each
    design's reason; a record of today's own sources (a stand-in for the next GPU run) gives it the chunked design
    back."""
    monkeypatch.setattr(routing, "_is_cuda", lambda x: True)
    monkeypatch.setattr(routing, "free_device_bytes", lambda device: 40 * 2**30)
    monkeypatch.setattr(routing, "total_device_bytes", lambda device: 80 * 2**30)
    for name in (routing.TRITON_ENV, routing.BUDGET_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FASTDISTILL_SELFCHECK", "0")
    monkeypatch.setattr(validation, "installed_triton_version", lambda: RAN_TRITON)
    taken = []
    monkeypatch.setattr(api, "_triton_sparse_jsd", lambda *a, **k: taken.append("triton"))
    monkeypatch.setattr(api, "_triton_chunked_sparse_jsd", lambda *a, **k: taken.append("triton-chunked"))
    monkeypatch.setattr(api, "torch_sparse_jsd", lambda *a, **k: taken.append("torch"))
    case = make_case(seed=2, N=40, D=16, V=300, K=4)
    h, w, _ = case.leaves(torch.bfloat16)

    def auto(record_file):
        monkeypatch.setattr(validation, "RECORD_FILE", record_file)
        validation.validated_designs.cache_clear()
        validation._record_patterns.cache_clear()
        try:
            sparse_jsd_loss(h, w, *case.narrowed(0.0), backend="auto")
        finally:
            validation.validated_designs.cache_clear()
            validation._record_patterns.cache_clear()
        return taken.pop()

    routing._WARNED.clear()
    with pytest.warns(UserWarning, match=r"runs the torch path for the sparse loss on CUDA.*triton-chunked: "
                      r"changed since the GPU run: backward.*triton: changed since the GPU run: backward"):
        assert auto(validation.RECORD_FILE) == "torch"
    routing._WARNED.clear()
    today = validation.new_record({"commit": "next"}, validation.run_keys(triton_version=RAN_TRITON),
                                  {"sparse": {"triton-chunked": {SPARSE_BF16: "passed"}}})
    path = tmp_path / "validated.json"
    path.write_text(json.dumps(today))
    assert auto(path) == "triton-chunked"
