"""benchmarks/device_kit.py (the wheels one GPU-check call carries) and benchmarks/gpu_results.py (the check's
read-off: the verdict, the validation record of a passing run and the RESULTS.md section), on synthetic inputs."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


kit = _load("device_kit")
gr = _load("gpu_results")


def _wheel(folder: Path, name: str, version: str, requires: list[str], size: int = 0) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n{meta}")
        zf.writestr(f"{name}/pad.bin", b"\0" * size)
    return path


def test_download_command_asks_for_wheels_for_the_image_only():
    cmd = kit.download_command(Path("/k"), "3.12", {"trl": "1.16.0", "liger-kernel": "0.8.5"})
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert "manylinux_2_28_x86_64" in platforms and "manylinux2014_x86_64" in platforms and "any" in platforms
    assert cmd[-2:] == ["trl==1.16.0", "liger-kernel==0.8.5"]


def test_manifest_and_problems(tmp_path):
    _wheel(tmp_path, "trl", "1.16.0", ["datasets>=4.7.0", "rich; extra == 'cli'"])
    _wheel(tmp_path, "liger_kernel", "0.8.5", ["torch>=2.1.2"])
    info = kit.manifest(tmp_path, "3.12")
    assert [w["file"] for w in info["wheels"]] == ["liger_kernel-0.8.5-py3-none-any.whl", "trl-1.16.0-py3-none-any.whl"]
    assert info["wheels"][1]["requires"] == ["datasets>=4.7.0"]  # extras left out
    assert info["total_bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*.whl"))
    wanted = {"trl": "1.16.0", "liger-kernel": "0.8.5"}
    assert kit.kit_problems(info, wanted) == []
    assert kit.kit_problems(info, {**wanted, "cut-cross-entropy": "25.1.1"}) == ["cut-cross-entropy==25.1.1 is missing"]
    _wheel(tmp_path, "trl", "1.15.0", [])
    assert "trl is there in two versions" in kit.kit_problems(kit.manifest(tmp_path, "3.12"), wanted)
    big = {**info, "total_bytes": kit.KIT_LIMIT_BYTES + 1, "total_mib": 16.01}
    assert any("over the kit's" in p for p in kit.kit_problems(big, wanted))


def test_build_reports_what_pip_said(tmp_path, monkeypatch):
    fake = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found for trl")
    monkeypatch.setattr(kit.subprocess, "run", lambda *a, **k: fake)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        kit.build(tmp_path / "kit")
    assert kit.main(["--out", str(tmp_path / "kit")]) == 1


def test_the_kit_holds_the_contenders_and_says_what_it_leaves_out():
    assert {"trl", "liger-kernel", "cut-cross-entropy", "datasets"} <= set(kit.KIT_PACKAGES)
    assert kit.KIT_PACKAGES["trl"] == "1.16.0"
    assert {"vllm", "flash-attn"} <= set(kit.NOT_CARRIED)
    assert kit.KIT_LIMIT_BYTES < kit.CALL_LIMIT_BYTES


# ------------------------------------------------------------------------------------------------ the read-off


def _ok_row(impl_names, N=4096, K=8):
    impls = {i: {"status": "ok", "fwd_s": 0.010, "bwd_s": 0.020, "peak_mb": 512.0, "tflops": 150.0, "mfu": 0.19,
                 "gate": {"ok": True, "rel_diff": {"loss": 1e-6, "dh": 3e-3, "dW": 2e-3}}} for i in impl_names}
    return {"N": N, "D": 3584, "V": 152064, "K": K, "impls": impls}


# What benchmarks/launch_record.py writes on the GPU machine: the keys of the tree that ran (not this tree's: a
# module hash no checkout has) and the launch patterns' verdicts.
LAUNCH_RECORD = {
    "triton_version": "3.6.0",
    "run_keys": {"triton": "3.6", "designs": {
        "sparse": {"triton": {"modules": {"ops": "1" * 64}, "code_key": "2" * 64},
                   "triton-chunked": {"modules": {"logits_chunk": "3" * 64}, "code_key": "4" * 64}},
        "dense": {"triton": {"modules": {"dense_fused": "5" * 64}, "code_key": "6" * 64}}}},
    "patterns": {"sparse": {"triton": {"hidden=bf16:grad weight=bf16:grad bias=None": "passed",
                                       "hidden=fp16:grad weight=fp16:grad bias=None": "failed"},
                            "triton-chunked": {"hidden=bf16:grad weight=bf16:grad bias=None": "passed"}},
                 "dense": {"triton": {"student_hidden=fp16:grad": "failed"}}},
    "tests_that_launched": {"passed": 60, "failed": 0},
}
PASSING = {
    "date": "2027-01-01T00:00:00+00:00", "dry_run": False, "budget_s": 480.0, "elapsed_s": 400.0,
    "source": {"commit": "abc1234", "clean": True, "dirty": [], "how": "stamp"},
    "steps": {
        "environment": {"status": "ok", "gpus": ["NVIDIA H200, 580.159.03, 143771 MiB, 9.0"]},
        "install": {"status": "ok", "seconds": 8.0,
                    "versions": {"python": "3.12.3", "torch": "2.11.0+cu130", "triton": "3.6.0"}},
        "kernel-tests": {"status": "ok", "seconds": 150.0, "compiled": {"tests": 70, "passed": 70, "failed": []},
                         "launch_record": LAUNCH_RECORD},
        "bench-4096": {"status": "ok", "seconds": 90.0, "rows": [_ok_row(["ours-det", "ours-fused", "liger", "cce"])],
                       "machine": {"bf16_matmul_peak_tflops": 780.0, "versions": {"triton": "3.6.0"}}},
        "packed-attention": {"status": "skipped", "detail": "flash-attn is not importable"},
        "bench-16384": {"status": "skipped", "detail": "out of budget (10 s left)"},
        "vllm-sync": {"status": "skipped", "detail": "vllm is not importable"},
    },
}


def _printed_record(text: str) -> dict:
    return json.loads(text[text.index("{"):])


def test_a_passing_gpu_run_prints_its_validation_record():
    """Commit (the check's source state), date, machine, software and compiled-test count of the run, and the keys
    and launch-pattern verdicts the GPU machine recorded, nothing of this tree; a design none of whose patterns
    passed is left out."""
    assert gr.validation_problems(PASSING) == []
    text = gr.verdict(PASSING)
    assert "kernels/fastdistill_kernels/validated.json" in text and "NVIDIA H200" in text
    record = _printed_record(text)
    run = record["designs"]["sparse"]["triton-chunked"]["validated_on"]
    assert run == {"commit": "abc1234", "date": "2027-01-01", "machine": "NVIDIA H200, 580.159.03, 143771 MiB, 9.0",
                   "compute_capability": "9.0", "software": "python 3.12.3, torch 2.11.0+cu130, triton 3.6.0",
                   "check": "benchmarks/gpu_check.py",
                   "compiled_tests": {"passed": 70, "total": 70}}
    fused = record["designs"]["sparse"]["triton"]
    assert fused["modules"] == {"ops": "1" * 64} and fused["code_key"] == "2" * 64 and fused["triton"] == "3.6"
    assert fused["launch_patterns"] == LAUNCH_RECORD["patterns"]["sparse"]["triton"]
    assert set(record["designs"]) == {"sparse"}  # dense: its only pattern failed


def test_the_record_is_written_only_when_every_compiled_gate_passed(tmp_path, monkeypatch):
    package = tmp_path / "fastdistill_kernels"
    shutil.copytree(ROOT / "kernels" / "fastdistill_kernels", package,
                    ignore=shutil.ignore_patterns("__pycache__", "validated.json"))
    monkeypatch.setattr(gr, "VALIDATION_MODULE", package / "validation.py")
    results = tmp_path / "check.json"
    results.write_text(json.dumps(_mutated(["steps", "kernel-tests", "status"], "failed")))
    assert gr.main([str(results), "--record"]) == 1
    assert not (package / "validated.json").exists()
    results.write_text(json.dumps(PASSING))
    assert gr.main([str(results), "--record"]) == 0
    written = json.loads((package / "validated.json").read_text())
    assert written == gr.validation_record(PASSING)
    assert written["designs"]["sparse"]["triton-chunked"]["modules"] == {"logits_chunk": "3" * 64}
    with pytest.raises(SystemExit):  # the commit is the check's, not an argument
        gr.main([str(results), "--record", "--commit", "def5678"])


def _mutated(path: list, value):
    results = copy.deepcopy(PASSING)
    node = results
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return results


@pytest.mark.parametrize("path,value,expect", [
    (["dry_run"], True, "a dry run"),
    (["steps", "environment", "gpus"], [], "no GPU"),
    (["steps", "kernel-tests", "compiled"], {"tests": 70, "passed": 69, "failed": ["test_compiled_x: skipped"]},
     "69 of 70"),
    (["steps", "kernel-tests", "compiled"], {"tests": 0, "passed": 0, "failed": []}, "no compiled-kernel test ran"),
    (["steps", "kernel-tests", "status"], "timeout", "kernel-tests: timeout"),
    (["steps", "bench-4096", "status"], "skipped", "bench-4096: not run"),
    (["source"], {"commit": "abc1234", "clean": False, "dirty": ["M kernels/fastdistill_kernels/ops.py"]},
     "not a committed one: M kernels/fastdistill_kernels/ops.py"),
    (["source"], None, "the check recorded no source state"),
    (["steps", "kernel-tests", "launch_record"], None, "no launch record"),
    (["steps", "kernel-tests", "launch_record", "patterns"], {"sparse": {"triton": {"x": "failed"}}},
     "no kernel design launched on the GPU in a passing test"),
    (["steps", "bench-4096", "rows", 0, "impls", "ours-fused", "status"], "incorrect", "ours-fused at N=4096"),
    (["steps", "bench-16384"], {"status": "ok", "rows": [_ok_row(["ours-det"], N=16384)
                                                          | {"impls": {"ours-det": {"status": "failed"}}}]},
     "bench-16384: ours-det"),
])
def test_the_flag_stays_unless_every_compiled_gate_passed_on_a_gpu(path, value, expect):
    results = _mutated(path, value)
    problems = gr.validation_problems(results)
    assert any(expect in p for p in problems), problems
    text = gr.verdict(results)
    assert "stays as it is" in text and "is not rewritten" in text and "{" not in text


def test_a_contender_failing_its_gate_does_not_block_the_flag():
    """Only fastdistill's kernels are gated: Liger disagreeing is recorded in the table, not a reason to wait."""
    results = _mutated(["steps", "bench-4096", "rows", 0, "impls", "liger", "status"], "incorrect")
    assert gr.validation_problems(results) == []


def test_the_results_section_has_the_table_and_replaces_itself(tmp_path):
    section = gr.markdown_section(PASSING)
    assert section.startswith(gr.SECTION_START) and section.endswith(gr.SECTION_END)
    assert "780 TFLOP/s" in section and "| bench-4096 | random | 4096 | 3584 | 152064 | 8 | ours-det | 30.00 | " \
        "10.0 / 20.0 | – | – | 446 | 57% / 45% | 512 (–) | pass (3.0e-03) |" in section
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# R\n\n{gr.SECTION_START}\nplaceholder\n{gr.SECTION_END}\n\ntail\n")
    gr.update_results(path, section)
    text = path.read_text()
    assert "placeholder" not in text and text.startswith("# R\n\n") and text.endswith("\n\ntail\n")
    assert text.count(gr.SECTION_START) == 1


def test_results_md_has_the_prepared_section():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert text.count(gr.SECTION_START) == 1 and text.count(gr.SECTION_END) == 1
    assert re.search(r"gpu_check\.sh --kit", text)
