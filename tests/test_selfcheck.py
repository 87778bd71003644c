"""The first-use self-check (fastdistill_kernels.selfcheck) and how ``backend="auto"`` follows it: the interpreter
rehearsal passes against the float64 reference, a broken design is refused with a warning naming it while the check
goes on, verdicts and timings are cached per key (a new key checks again), FASTDISTILL_SELFCHECK=0 skips it, the
committed record spares the designs it covers, auto picks the fastest design that passed and fits, and rank 0's
decision holds on every rank. Every cache lives in a tmp folder (FASTDISTILL_SELFCHECK_DIR)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the self-check runs the Triton kernels")
from fastdistill_kernels import selfcheck, validation  # noqa: E402
from fastdistill_kernels import selfcheck_cases as cases  # noqa: E402

import fastdistill.loss.routing as routing  # noqa: E402

GiB = 2**30
REAL_TIME_DESIGN = selfcheck.time_design  # Spy replaces it; one test times for real
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """CPU tensors claim to be on CUDA (the kernels run in the interpreter), 40 of 80 GiB free, the record validates
    nothing, the self-check on with its cache in a tmp folder, no decision left from another test."""
    monkeypatch.setattr(routing, "_is_cuda", lambda x: True)
    monkeypatch.setattr(routing, "free_device_bytes", lambda device: 40 * GiB)
    monkeypatch.setattr(routing, "total_device_bytes", lambda device: 80 * GiB)
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset())
    for name in (routing.TRITON_ENV, routing.BUDGET_ENV, selfcheck.OFF_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(selfcheck.DIR_ENV, str(tmp_path / "selfcheck"))
    monkeypatch.setattr(selfcheck, "_FAULTS", {})
    selfcheck.forget()
    yield tmp_path / "selfcheck"
    selfcheck.forget()


def _pairs(n=40, d=16, v=300, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(n, d, generator=g).to(dtype), torch.randn(v, d, generator=g).to(dtype)),)


class Spy:
    """Stands in for the check of one design (``verdicts``: name -> passed) and the timing (``times``: backend ->
    seconds), recording the calls."""

    def __init__(self, monkeypatch, verdicts=None, times=None):
        self.checked, self.timed = [], []
        self.verdicts, self.times = verdicts or {}, times or {}

        def check(loss, backend, device, dtype=None, fault=None, on_case=None):
            name = selfcheck.design_name(loss, backend)
            self.checked.append(name)
            ok = self.verdicts.get(name, True)
            return selfcheck.Verdict(ok, "self-check", 0.5 if ok else 9.0, "" if ok else "case x: dW[0, 0] off")

        def timed(loss, backend, x):
            self.timed.append(backend)
            return self.times.get(backend, 1.0)

        monkeypatch.setattr(selfcheck, "check_design", check)
        monkeypatch.setattr(selfcheck, "time_design", timed)


def test_the_rehearsal_passes_and_a_broken_design_is_refused_while_the_run_goes_on(tmp_path):
    """The CLI as CI runs it, under the interpreter, with one design deliberately broken: that design is refused
    with the case, output and entry that failed, and the other three designs still run and pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1", selfcheck.DIR_ENV: str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "fastdistill_kernels.selfcheck", "--inject-fault",
                          "sparse/triton-chunked", "--json", str(tmp_path / "report.json")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    verdicts = {name: v["passed"] for name, v in report["designs"].items()}
    assert verdicts == {f"{d} {t}": d != "sparse/triton-chunked" for d in ("sparse/triton-chunked", "sparse/triton",
                                                                          "dense/triton-chunked", "dense/triton")
                        for t in ("bfloat16", "float32")}
    broken = report["designs"]["sparse/triton-chunked bfloat16"]
    assert broken["mismatch"].startswith("case unaligned-bf16: dW[") and broken["worst"] > 1
    assert re.search(r"^sparse/triton-chunked bfloat16 +REFUSED in", out.stdout, re.M)
    for case in cases.REHEARSAL_CASES:  # every case of the designs that passed ran and is printed
        assert f"{case.loss}/triton" in out.stdout and case.name in out.stdout
    assert not (tmp_path / "cache").exists()  # a run with a fault never writes the cache


def test_a_broken_design_is_never_auto_s_and_a_warning_names_it(monkeypatch, gpu):
    """The real check of both sparse designs in the interpreter, the chunked one broken: auto warns with its name and
    mismatch, runs the fused design, and the refusal is cached."""
    monkeypatch.setitem(selfcheck._FAULTS, "sparse/triton-chunked", cases.drop_vocabulary_tail)
    with pytest.warns(RuntimeWarning, match=r"design sparse/triton-chunked bfloat16 refused on this device.*case "
                                            r"unaligned-bf16: dW\["):
        assert routing.route("sparse", _pairs(dtype=torch.bfloat16), k=4) == routing.Route("triton")
    (file,) = gpu.glob("*.json")
    verdicts = json.loads(file.read_text())["verdicts"]
    assert set(verdicts) == {"sparse/triton-chunked bfloat16", "sparse/triton bfloat16"}  # the caller's dtype only
    assert verdicts["sparse/triton-chunked bfloat16"]["passed"] is False
    fused = verdicts["sparse/triton bfloat16"]
    assert fused["passed"] is True and fused["worst"] <= 1


def test_the_cache_is_written_and_read_per_key_and_a_new_key_checks_again(monkeypatch, gpu):
    spy = Spy(monkeypatch, times={"triton": 2.0, "triton-chunked": 1.0})
    assert routing.route("sparse", _pairs(), k=4).backend == "triton-chunked"
    assert spy.checked == ["sparse/triton-chunked", "sparse/triton"]
    assert sorted(spy.timed) == ["triton", "triton-chunked"]
    (file,) = gpu.glob("*.json")
    entry = json.loads(file.read_text())
    assert entry["key"] == selfcheck.device_key(torch.device("cpu"))
    assert set(entry["verdicts"]) == {"sparse/triton-chunked float32", "sparse/triton float32"}
    assert entry["timings"] == {"sparse|float32|N256|D16|V300|K4": {"triton": 2.0, "triton-chunked": 1.0}}

    selfcheck.forget()  # a new process: the cache answers, nothing is checked or timed again
    spy.checked.clear(), spy.timed.clear()
    assert routing.route("sparse", _pairs(), k=4).backend == "triton-chunked"
    assert spy.checked == [] and spy.timed == []

    selfcheck.forget()  # another shape class: timed, not checked
    assert routing.route("sparse", _pairs(n=300), k=4).backend == "triton-chunked"
    assert spy.checked == [] and sorted(spy.timed) == ["triton", "triton-chunked"]

    selfcheck.forget()  # the kernel code changed: a new key, checked again, in a file of its own
    spy.timed.clear()
    monkeypatch.setattr(selfcheck, "kernel_code_key", lambda: "0" * 64)
    routing.route("sparse", _pairs(), k=4)
    assert spy.checked == ["sparse/triton-chunked", "sparse/triton"] and len(spy.timed) == 2
    assert len(list(gpu.glob("*.json"))) == 2
    for part in ("device", "capability", "driver", "torch", "triton", "kernels"):  # what the key holds
        assert part in entry["key"]


def test_the_off_variable_skips_the_check_and_auto_follows_the_record(monkeypatch, gpu):
    spy = Spy(monkeypatch)
    monkeypatch.setenv(selfcheck.OFF_ENV, "0")
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("torch")  # the record validates nothing here
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset({("sparse", "triton")}))
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton")
    assert spy.checked == [] and spy.timed == [] and not gpu.exists()
    monkeypatch.setenv(selfcheck.OFF_ENV, "1")  # any other value: on
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton-chunked")
    assert len(spy.checked) == 2


def test_auto_picks_the_fastest_design_that_passed_and_fits(monkeypatch, gpu):
    spy = Spy(monkeypatch, times={"triton": 1.0, "triton-chunked": 3.0})
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton")  # measured faster here
    selfcheck.forget()
    spy.times = {"triton": 3.0, "triton-chunked": 1.0}
    monkeypatch.setenv(selfcheck.DIR_ENV, str(gpu.parent / "other"))
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton-chunked")
    monkeypatch.setattr(routing, "free_device_bytes", lambda device: 8 * GiB)  # no room for the chunk buffer
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton")
    selfcheck.forget()  # refused designs are skipped however fast
    monkeypatch.setattr(routing, "free_device_bytes", lambda device: 40 * GiB)
    monkeypatch.setenv(selfcheck.DIR_ENV, str(gpu.parent / "third"))
    spy.verdicts = {"sparse/triton-chunked": False}
    with pytest.warns(RuntimeWarning, match="sparse/triton-chunked float32 refused.*dW"):
        assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton")
    selfcheck.forget()
    monkeypatch.setenv(selfcheck.DIR_ENV, str(gpu.parent / "fourth"))
    spy.verdicts = {"sparse/triton-chunked": False, "sparse/triton": False}
    with pytest.warns(RuntimeWarning, match="refused"):
        assert routing.route("sparse", _pairs(), k=4) == routing.Route("torch")


def test_the_dense_loss_is_checked_and_ranked_on_its_own(monkeypatch, gpu):
    spy = Spy(monkeypatch, times={"triton": 1.0, "triton-chunked": 2.0})
    (h, w), = _pairs()
    ht, wt = torch.randn(40, 12), torch.randn(310, 12)
    assert routing.route("dense", ((h, w), (ht, wt))) == routing.Route("triton")
    assert spy.checked == ["dense/triton-chunked", "dense/triton"]
    (file,) = gpu.glob("*.json")
    assert list(json.loads(file.read_text())["timings"]) == ["dense|float32|N256|D16|V300|Dt12|Vt310"]


def test_the_record_spares_the_check_where_it_covers_the_code_on_this_capability(monkeypatch, gpu):
    spy = Spy(monkeypatch)
    monkeypatch.setattr(validation, "validated_designs", lambda: frozenset({("sparse", "triton")}))
    capability = validation.load_record()["designs"]["sparse"]["triton"]["validated_on"]["machine"]
    real_key = selfcheck.device_key
    for cap, checked in (("9.0", ["sparse/triton-chunked"]), ("8.0", ["sparse/triton-chunked", "sparse/triton"])):
        assert f"compute capability {'9.0'}" in capability
        selfcheck.forget()
        spy.checked.clear()
        monkeypatch.setattr(selfcheck, "device_key", lambda device, cap=cap: {**real_key(device), "capability": cap})
        routing.route("sparse", _pairs(), k=4)
        assert spy.checked == checked
    file = next(f for f in gpu.glob("*.json") if json.loads(f.read_text())["key"]["capability"] == "9.0")
    assert json.loads(file.read_text())["verdicts"]["sparse/triton float32"]["source"] == "record"


def test_rank_zero_decides_for_every_rank(monkeypatch, gpu):
    """With torch.distributed initialised, rank 0's decision is broadcast: a rank other than 0 checks nothing and
    takes rank 0's order, even where its own measurement would disagree."""
    spy = Spy(monkeypatch, times={"triton": 1.0, "triton-chunked": 3.0})
    dist = torch.distributed
    sent = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    def broadcast(box, src=0, group=None, device=None):
        sent.append(box[0])
        box[0] = selfcheck.Decision(["triton-chunked", "triton"], {})

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton-chunked")
    assert sent == [None] and spy.checked == [] and spy.timed == []
    routing.route("sparse", _pairs(n=300), k=4)  # decided once per process: no second broadcast
    assert len(sent) == 1


def test_the_cache_folder_defaults_to_the_user_cache_and_moves_with_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(selfcheck.DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert selfcheck.cache_dir() == tmp_path / "xdg" / "fastdistill" / "selfcheck"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert selfcheck.cache_dir() == tmp_path / "home" / ".cache" / "fastdistill" / "selfcheck"
    monkeypatch.setenv(selfcheck.DIR_ENV, str(tmp_path / "moved"))
    assert selfcheck.cache_dir() == tmp_path / "moved"


def test_an_unreadable_or_foreign_cache_file_is_checked_again(monkeypatch, gpu):
    spy = Spy(monkeypatch)
    key = selfcheck.device_key(torch.device("cpu"))
    path = selfcheck.cache_file(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    routing.route("sparse", _pairs(), k=4)
    assert len(spy.checked) == 2
    assert json.loads(path.read_text())["key"] == key


def test_the_tolerance_is_tight_enough_to_see_a_small_error():
    """The float64 reference rounded to the outputs' dtypes is inside the derived tolerance; a 1 % error on one
    row's divergence, or 10 % on one bf16 dW row (its tolerance: a few % of the entries, bf16 storing dL/dx and the
    result), is outside."""
    case = cases.REHEARSAL_CASES[0]
    x = cases.make_inputs(case, torch.device("cpu"))
    ref = cases.reference(x, interpreted=True)
    assert ref.db is None  # the case has no bias
    exact = cases.Outputs(ref.divergence.float(), ref.dh.to(x.hidden.dtype), ref.dw.to(x.weight.dtype), None)
    assert cases.compare(exact, ref)[0] <= 1
    row = int(ref.divergence.argmax())
    worse = cases.Outputs(exact.divergence.clone(), exact.dh, exact.dw, exact.db)
    worse.divergence[row] *= 1.01
    assert cases.compare(worse, ref)[0] > 1
    worse = cases.Outputs(exact.divergence, exact.dh, exact.dw.clone(), exact.db)
    worse.dw[5] = (ref.dw[5] * 1.10).to(worse.dw.dtype)
    ratio, detail = cases.compare(worse, ref)
    assert ratio > 1 and detail.startswith("dW[5, ")


def test_the_cli_refuses_an_unknown_design_name(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", selfcheck.DIR_ENV: str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "fastdistill_kernels.selfcheck", "--inject-fault", "sparse/nope"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "designs are" in out.stderr


def test_the_cases_cover_both_launch_patterns_and_a_frozen_head():
    """The kernels specialise on the bias and on whether dW is needed: the cases hold each, in both dtypes where it
    matters, on the GPU and in the rehearsal alike (the same names)."""
    for group in (cases.GPU_CASES, cases.REHEARSAL_CASES):
        patterns = {(c.loss, c.dtype, c.bias, c.train_weight) for c in group}
        assert ("sparse", "bfloat16", False, True) in patterns and ("sparse", "float32", True, True) in patterns
        assert ("sparse", "bfloat16", False, False) in patterns
        assert ("dense", "bfloat16", False, True) in patterns and ("dense", "float32", True, True) in patterns
        assert any(c.k == 1 for c in group) and max(c.k for c in group) >= 48
        assert {c.tail_mode for c in group if c.loss == "sparse"} == {"exact", "trl"}
        assert all(c.masked > 0 for c in group)
    assert [c.name for c in cases.GPU_CASES] == [c.name for c in cases.REHEARSAL_CASES]
    for c in cases.GPU_CASES:  # no block size divides the unaligned shapes
        if c.name.startswith(("unaligned", "dense-bf16")):
            assert all(c.v % b and c.d % 32 and c.n % 32 for b in (32, 64, 128, 2048))


def test_a_frozen_head_gets_no_weight_gradient_and_its_check_passes():
    case = next(c for c in cases.REHEARSAL_CASES if not c.train_weight)
    x = cases.make_inputs(case, torch.device("cpu"))
    ref = cases.reference(x, interpreted=True)
    out = cases.run_design(case.loss, "triton", x)
    assert out.dw is None and ref.dw is None and out.db is None
    assert cases.compare(out, ref)[0] <= 1
    with_dw = cases.Outputs(out.divergence, out.dh, torch.zeros(case.v, case.d), None)
    assert cases.compare(with_dw, ref)[1].startswith("dW: shape")


def test_auto_under_inference_mode_and_no_grad_still_checks_and_times(monkeypatch, gpu):
    """The first auto call may come from an evaluation under torch.inference_mode: the check and the timing still
    run autograd (the real timing, in the interpreter)."""
    spy = Spy(monkeypatch)
    monkeypatch.setattr(selfcheck, "time_design", REAL_TIME_DESIGN)
    with torch.inference_mode():
        pairs = _pairs(n=8, d=8, v=70)
        assert routing.route("sparse", pairs, k=2).backend in ("triton", "triton-chunked")
    assert len(spy.checked) == 2
    (file,) = gpu.glob("*.json")
    times = json.loads(file.read_text())["timings"]["sparse|float32|N256|D8|V70|K2"]
    assert set(times) == {"triton", "triton-chunked"} and all(t > 0 for t in times.values())


def test_each_dtype_is_checked_on_its_own_cases():
    """auto checks the caller's dtype only (a bf16 job compiles no fp32 variant); float16 takes the bf16 cases."""
    for on_gpu in (True, False):
        bf16 = cases.cases_for("sparse", "bfloat16", on_gpu)
        assert bf16 and {c.dtype for c in bf16} == {"bfloat16"}
        fp16 = cases.cases_for("sparse", "float16", on_gpu)
        assert [c.name for c in fp16] == [c.name for c in bf16] and {c.dtype for c in fp16} == {"float16"}
        assert {c.dtype for c in cases.cases_for("dense", None, on_gpu)} == {"bfloat16", "float32"}
    case = cases.cases_for("sparse", "float16", on_gpu=False)[0]
    x = cases.make_inputs(case, torch.device("cpu"))
    assert x.hidden.dtype == torch.float16
    assert cases.compare(cases.run_design("sparse", "triton", x), cases.reference(x, interpreted=True))[0] <= 1


def test_a_design_that_fails_at_the_caller_s_shape_is_refused_there(monkeypatch, gpu):
    spy = Spy(monkeypatch)

    def timed(loss, backend, x):
        if backend == "triton-chunked":
            raise RuntimeError("out of resources: shared memory")
        return 1.0

    monkeypatch.setattr(selfcheck, "time_design", timed)
    with pytest.warns(RuntimeWarning, match="sparse/triton-chunked float32 refused.*timing at sparse.*shared memory"):
        assert routing.route("sparse", _pairs(), k=4) == routing.Route("triton")
    assert len(spy.checked) == 2


def test_the_cli_can_fill_the_cache_ahead_of_a_job(monkeypatch, gpu):
    """``--write-cache`` stores every dtype's verdicts under the key auto computes, so the job's first call checks
    nothing (the dense rehearsal here)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", selfcheck.DIR_ENV: str(gpu)}
    out = subprocess.run([sys.executable, "-m", "fastdistill_kernels.selfcheck", "--loss", "dense", "--write-cache"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (file,) = gpu.glob("*.json")
    assert set(json.loads(file.read_text())["verdicts"]) == {
        f"dense/{b} {t}" for b in ("triton-chunked", "triton") for t in ("bfloat16", "float32")}
    spy = Spy(monkeypatch, times={"triton": 1.0, "triton-chunked": 2.0})
    (h, w), = _pairs()
    assert routing.route("dense", ((h, w), (torch.randn(40, 12), torch.randn(310, 12)))) == routing.Route("triton")
    assert spy.checked == [] and sorted(spy.timed) == ["triton", "triton-chunked"]
