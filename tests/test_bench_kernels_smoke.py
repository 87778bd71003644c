"""Smoke test of benchmarks/bench_kernels.py: the quick config runs the kernels (Triton's CPU interpreter here) and
they agree with the torch path; the contenders are called the way their installed versions require, every timed
row passed the correctness gate, a wrong result is not timed, and missing kernels fail loudly. Timings are never
asserted."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from fastdistill import sparse_jsd_loss

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"


def _bench():
    """benchmarks/bench_kernels.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(bench, N=12, D=16, V=96, K=4, dtype=torch.float32):
    return bench.make_inputs(N, D, V, K, dtype, torch.device("cpu"))


@pytest.mark.slow
def test_bench_kernels_quick(tmp_path):
    pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
    out = tmp_path / "bench_kernels.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert result["machine"]["versions"]["torch"]
    assert len(result["rows"]) == 1
    row = result["rows"][0]
    for name, m in row["impls"].items():
        # ours and the torch path are always there; the other packages may be absent (reported, not fatal)
        assert m["status"] == "ok" or (m["status"] == "missing" and not name.startswith(("ours", "torch"))), (name, m)
        if m["status"] == "ok":
            assert m["fwd_s"] > 0 and m["bwd_s"] > 0 and math.isfinite(m["loss"]) and m["loss"] > 0
            assert m["gate"]["ok"] and m["gate"]["rows"] == 32, (name, m["gate"])  # timed only after the gate
    same_loss = [m["loss"] for name, m in row["impls"].items() if name.startswith(("ours", "torch", "trl"))
                 and not name.startswith("ours-dense") and m["status"] == "ok"]
    # liger and ours-dense* (dense teacher) and cce (cross-entropy) compute other losses; the dense-teacher ones agree
    dense = [m["loss"] for name, m in row["impls"].items() if name in ("liger", "ours-dense") and m["status"] == "ok"]
    assert "ours-dense" in row["impls"] and max(dense) - min(dense) <= 1e-5 * max(dense), dense
    assert len(same_loss) >= 2 and max(same_loss) - min(same_loss) <= 1e-5 * max(same_loss)
    if "rel_diff_vs_torch_path" in row:  # CPU run: the kernels against the torch path, loss and gradients
        for mode, diffs in row["rel_diff_vs_torch_path"].items():
            assert all(d < 1e-5 for d in diffs.values()), (mode, diffs)


class _Liger085JSD(torch.nn.Module):
    """Stand-in with liger-kernel 0.8.5's ``LigerFusedLinearJSD`` interface: ``shift_labels`` is a required
    positional argument; β = 0 is the forward KL(teacher‖student) averaged over rows."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None):
        super().__init__()
        self.jsd_beta, self.temperature = jsd_beta, temperature

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
        assert shift_labels is None or shift_labels.shape == (teacher_input.shape[0],)
        s = torch.log_softmax(student_input.float() @ student_weight.float().t() / self.temperature, dim=-1)
        t = torch.log_softmax(teacher_input.float() @ teacher_weight.float().t() / self.temperature, dim=-1)
        return (t.exp() * (t - s)).sum() / student_input.shape[0]


def test_liger_is_called_with_the_signature_of_0_8_5(monkeypatch):
    """liger-kernel 0.8.5 requires shift_labels: the row used to read "failed" (TypeError) on every GPU."""
    bench = _bench()
    module = types.ModuleType("liger_kernel.transformers")
    module.LigerFusedLinearJSD = _Liger085JSD
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    inputs = _inputs(bench)
    loss = bench.loss_fn("liger", *inputs)()
    loss.backward()
    assert torch.isfinite(loss) and inputs[0].grad is not None
    gate = bench.correctness_gate("liger", inputs, rows=8)
    assert gate["ok"], gate


def test_installed_liger_runs_and_passes_the_gate():
    """The real package, when installed (its Triton kernels run in the interpreter on CPU)."""
    pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed (pip install '.[bench]')")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("liger's Triton kernels need CUDA or TRITON_INTERPRET=1")
    bench = _bench()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = bench.make_inputs(16, 32, 128, 4, torch.float32, device)
    gate = bench.correctness_gate("liger", inputs, rows=16)
    assert gate["ok"], gate


@pytest.mark.parametrize("impl,tail_mode", [("torch", "exact"), ("ours-det", "exact"), ("ours-chunked", "exact"),
                                            ("trl", "trl")])
def test_float64_gate_reference_is_the_reference_backend(impl, tail_mode):
    """The gate's vectorised float64 oracle equals fastdistill's dense reference (independent code)."""
    bench = _bench()
    hidden, weight, ids, lps, mask = _inputs(bench, dtype=torch.float64)
    got = bench.reference_loss(impl, hidden, weight, ids, lps, torch.float64)
    ref = sparse_jsd_loss(hidden, weight, ids, lps, mask, tail_mode=tail_mode, backend="reference").loss
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)


def test_gate_tolerances_follow_the_dtype():
    bench = _bench()
    bf16, fp16, fp32 = (bench.gate_tolerances(d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert bf16["grad"] == 4 * 2.0**-7 and fp16["grad"] == 4 * 2.0**-10 and fp32 == {"loss": 1e-5, "grad": 1e-4}
    assert bf16["loss"] > fp16["loss"] > fp32["loss"]


def test_an_implementation_that_disagrees_is_not_timed(monkeypatch):
    bench = _bench()
    real = bench.loss_fn

    def off_by_one_percent(impl, *inputs):
        fn = real(impl, *inputs)
        return lambda: 1.01 * fn()

    monkeypatch.setattr(bench, "loss_fn", off_by_one_percent)
    timed = []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: timed.append(1) or 0.0)
    m = bench.measure("torch", _inputs(bench), repeats=1, warmup=0, device=torch.device("cpu"), gate_rows=8)
    assert m["status"] == "incorrect" and not m["gate"]["ok"] and "fwd_s" not in m
    assert m["gate"]["rel_diff"]["loss"] == pytest.approx(0.01, rel=1e-3)
    assert not timed


def test_ours_rows_fail_loudly_without_the_kernels(monkeypatch, capsys, tmp_path):
    bench = _bench()
    monkeypatch.setitem(sys.modules, "fastdistill_kernels", None)  # `import fastdistill_kernels` raises ImportError
    with pytest.raises(bench.KernelsUnavailable, match="pip install"):
        bench.measure("ours-det", _inputs(bench), repeats=1, warmup=0, device=torch.device("cpu"))
    rc = bench.cli(["--quick", "--impls", "torch", "ours-fused", "--json", str(tmp_path / "out.json")])
    assert rc == 2 and "ours-* rows need the fastdistill kernels" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()  # refused before measuring anything


def test_an_incorrect_ours_row_makes_the_exit_status_1(capsys):
    bench = _bench()
    rows = [{"N": 1, "D": 2, "V": 3, "K": 4, "impls": {"trl": {"status": "missing"},
                                                       "ours-det": {"status": "incorrect", "error": "dh 0.5 > 0.03"}}}]
    assert bench.report_ours_failures(rows) == 1
    assert "ours-det at N=1 D=2 V=3 K=4: incorrect" in capsys.readouterr().err
    rows[0]["impls"]["ours-det"] = {"status": "ok"}
    assert bench.report_ours_failures(rows) == 0


def test_roofline_counts_follow_the_designs():
    """8·N·D·V matmul FLOPs without logits, 6·N·D·V with chunked logits; the no-logits design's extra memory does
    not grow with N·V, the chunked one's holds a chunk of logits."""
    sys.path.insert(0, str(SCRIPT.parent))
    from roofline import chunked_logits_cost, no_logits_cost, roofline_rows

    N, D, V, S = 16384, 3584, 152064, 9
    kernels, chunked = no_logits_cost(N, D, V, S), chunked_logits_cost(N, D, V, S, chunk_rows=4096)
    assert kernels.flops == 8 * N * D * V and chunked.flops == 6 * N * D * V
    # the fp32 dW read-modify-writes, once per 128-row block: 128 · V · D · 8 bytes
    assert kernels.bytes > 128 * V * D * 8
    assert chunked.extra_memory - kernels.extra_memory == 4096 * V * 2  # one chunk of bf16 logits; both hold dW, dh
    assert no_logits_cost(2 * N, D, V, S).extra_memory - kernels.extra_memory == N * D * 4  # dh only
    rows = roofline_rows([(N, D, V, S)])
    assert [r["design"] for r in rows] == ["no-logits", "chunked-logits"]
    assert all(r["ms_H200"] > 0 for r in rows)
