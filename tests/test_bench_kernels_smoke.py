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
import time
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

    assert result["machine"]["versions"]["torch"] and result["machine"]["copy_gbytes_per_s"] > 0
    assert [r["dist"] for r in result["rows"]] == ["random", "peaked"]
    for row in result["rows"]:
        assert row["floor"]["three_s"] > 0 and row["floor"]["dense_s"] > row["floor"]["three_s"]
        for name, m in row["impls"].items():
            # ours and the torch path are always there; the other packages may be absent (reported, not fatal)
            assert m["status"] == "ok" or (m["status"] == "missing" and not name.startswith(("ours", "torch"))), m
            if m["status"] != "ok":
                continue
            assert m["gate"]["ok"] and m["gate"]["rows"] == 32, (name, m["gate"])  # timed only after the gate
            spread = m["spread_s"]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"] and math.isfinite(m["loss"])
            assert m["x_floor"] == pytest.approx(m["total_s"] / m["floor_s"])
            assert m["predicted_s"] > 0
            assert m["measured_over_predicted"] == pytest.approx(m["total_s"] / m["predicted_s"])
        same_loss = [m["loss"] for name, m in row["impls"].items() if name.startswith(("ours", "torch", "trl"))
                     and not name.startswith("ours-dense") and m["status"] == "ok"]
        assert len(same_loss) >= 2 and max(same_loss) - min(same_loss) <= 1e-5 * max(same_loss)
        for mode, diffs in row["rel_diff_vs_torch_path"].items():  # CPU run: kernels against the torch path
            assert all(d < 1e-5 for d in diffs.values()), (mode, diffs)
    # no GPU: the predicted table at the three heads, from the H200's recorded rates
    assert "H200 recorded" in result["predicted"]["rates"]
    assert {r["head"] for r in result["predicted"]["rows"]} == {"Qwen2.5-7B", "Llama-3-8B", "Qwen2.5-0.5B"}
    assert "three bare GEMMs" in proc.stdout and "mean p_max" in proc.stdout


def test_predict_only_measures_nothing_and_follows_the_formula(tmp_path, capsys, monkeypatch):
    """--predict-only: the table from the H200's recorded rates; the floor's time is 6·N·D·V / rate by hand."""
    bench = _bench()
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("--predict-only measured something"))
    out = tmp_path / "p.json"
    assert bench.main(["--predict-only", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["predicted"]["rows"]
    floor = next(r for r in rows if r["head"] == "Qwen2.5-7B" and r["impl"] == "gemms")
    assert floor["ms"] == pytest.approx(1e3 * 6 * 16384 * 3584 * 152064 / 756e12)
    assert floor["x_floor"] == 1.0 and floor["mfu_datasheet"] == pytest.approx(756 / 989)
    assert "| Llama-3-8B | ours-chunked |" in capsys.readouterr().out


def test_one_window_per_repeat_after_the_warmups():
    """fwd and bwd marks inside one window: total = fwd + bwd per repeat; warm-ups are not timed."""
    bench = _bench()
    calls = []
    x = torch.ones(3, requires_grad=True)

    def fn():
        calls.append(1)
        return (x * 2).sum()

    t = bench.time_fwd_bwd(fn, (x,), repeats=4, warmup=3, device=torch.device("cpu"))
    assert len(calls) == 7 and t["total"]["n"] == 4 and t["loss"] == 6.0 and x.grad is None
    assert t["total"]["min"] <= t["total"]["median"] <= t["total"]["max"]
    assert t["total"]["median"] >= t["fwd"]["min"] and t["total"]["max"] >= t["bwd"]["max"]


def test_bare_gemm_floor_and_ceilings_on_the_cpu():
    bench = _bench()
    cpu = torch.device("cpu")
    f = bench.time_gemms(8, 16, 32, torch.float32, cpu, repeats=2, warmup=1)
    assert f["total"]["n"] == 2 and f["dense_s"] == pytest.approx(f["three_s"] + f["logits_s"])
    assert bench.copy_bandwidth(cpu, nbytes=2**16, repeats=2) > 0
    assert bench.matmul_rate(cpu, torch.float32, n=32, repeats=2) > 0


def test_useful_flops_and_the_floor_drive_the_row_rates():
    """MFU divides the useful FLOPs (6·N·D·V; + 2·N·D·V for a dense teacher) by the measured rate and by 989."""
    bench = _bench()
    rates = bench.roofline.Rates(matmul_flops=1e12, copy_bytes=1e11, source="test")
    shape = bench.roofline.Shape(4, 8, 16, 2, 4)
    floor = {"three_s": 1e-3, "dense_s": 2e-3}
    for impl, flops, floor_s in (("ours-det", 6 * 4 * 8 * 16, 1e-3), ("ours-dense", 8 * 4 * 8 * 16, 2e-3)):
        m = {"status": "ok", "total_s": 4e-3}
        bench.add_rates(m, impl, shape, floor, rates, tokens_per_row=1.0)
        assert m["mfu"] == pytest.approx(flops / 4e-3 / 1e12) and m["x_floor"] == pytest.approx(4e-3 / floor_s)
        assert m["mfu_datasheet"] == pytest.approx(flops / 4e-3 / 989e12)
    m = {"status": "ok", "total_s": 1.0}
    bench.add_rates(m, "trl", shape, floor, rates, tokens_per_row=1.0)
    assert "predicted_s" not in m  # TRL's own code is not modelled


def test_input_distributions_look_as_stated():
    """peaked: the five chosen logits land where the construction puts them (float64 check); the statistics
    function against a hand-made distribution."""
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_inputs

    h, w, ids, lps, mask = bench_inputs.make_inputs(16, 256, 2048, 8, torch.float32, torch.device("cpu"),
                                                    dist="peaked")
    z = (h.double() @ w.double().t()).gather(1, ids[:, :5])
    torch.testing.assert_close(z, torch.tensor([bench_inputs.PEAK_LOGITS] * 16, dtype=torch.float64),
                               rtol=0, atol=1e-3)
    assert bool((lps.exp().sum(1) < 1).all()) and all(len(set(r.tolist())) == 9 for r in ids)
    # two rows: uniform over 4 tokens (entropy log 4, p_max 1/4, all 4 ≥ 2^-12), and a one-hot-ish row
    weight = torch.eye(4)
    hidden = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0]])
    s = bench_inputs.distribution_stats(hidden, weight)
    assert s["mean_entropy_nats"] == pytest.approx(math.log(4) / 2, abs=1e-6)
    assert s["tokens_per_row_p_ge_2^-12"] == 2.5 and s["mean_p_max"] == pytest.approx((0.25 + 1.0) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="dist must be one of"):
        bench_inputs.make_inputs(4, 8, 16, 2, torch.float32, torch.device("cpu"), dist="flat")


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
    monkeypatch.setattr(time, "perf_counter", lambda: timed.append(1) or 0.0)  # the CPU clock of bench_timing
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
    assert "ours-det at random N=1 D=2 V=3 K=4: incorrect" in capsys.readouterr().err
    rows[0]["impls"]["ours-det"] = {"status": "ok"}
    assert bench.report_ours_failures(rows) == 0


def test_roofline_counts_follow_the_designs():
    """FLOPs: 6·N·D·V useful for every design, 8·N·D·V done without logits; + 2·N·D_t·V_t useful for a dense teacher
    (+ 4·N·D_t·V_t done by the fused kernel). Prediction: FLOPs / rate + bytes / bandwidth. Memory of the 17cb676
    chunked design at the 7B head: two fp32 dW, a bf16 dW and two dh (it measured 5,424 MiB on the H200)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import roofline

    s = roofline.Shape(16384, 3584, 152064, 8)
    NDV = 16384 * 3584 * 152064
    assert roofline.useful_flops(s) == 6 * NDV and roofline.useful_flops(s, dense_teacher=True) == 8 * NDV
    chunked, det = roofline.impl_cost("ours-chunked", s), roofline.impl_cost("ours-det", s)
    assert chunked.gemm_flops == chunked.useful_flops == 6 * NDV
    assert det.gemm_flops == 8 * NDV and det.useful_flops == 6 * NDV
    dense = roofline.impl_cost("ours-dense", s)
    assert dense.gemm_flops == 12 * NDV and dense.useful_flops == 8 * NDV
    rates = roofline.Rates(matmul_flops=500e12, copy_bytes=2e12, source="test")
    assert det.predicted_s(rates) == pytest.approx(8 * NDV / 500e12 + det.bytes / 2e12)
    old = roofline.impl_cost("ours-chunked@17cb676", s)
    W32, W, H = 152064 * 3584 * 4, 152064 * 3584 * 2, 16384 * 3584 * 2
    assert old.peak_memory == 2 * W32 + W + 2 * H
    assert abs(old.peak_memory / 2**20 - 5424) / 5424 < 0.01
    cce = roofline.impl_cost("cce", s, tokens_per_row=5)
    kept = 1 - math.exp(-128 * 128 * 5 / 152064)
    assert cce.gemm_flops == pytest.approx(NDV * (4 + 4 * kept)) and cce.peak_memory == W + H
    torch_path = roofline.impl_cost("torch", s)
    assert torch_path.gemm_flops == 6 * NDV and torch_path.gemm_fp32_flops == 0  # dL/dz rounded once to bf16
    assert roofline.impl_cost("torch@17cb676", s).gemm_fp32_flops == 6 * NDV  # it computed in fp32
    assert roofline.impl_cost("trl", s) is None and roofline.floor_of("ours-dense") == "gemms-dense"


def test_calibration_predicts_the_17cb676_designs_at_the_records_own_rate():
    """roofline --calibrate: each measured row beside its 17cb676 design's prediction at that step's matmul rate."""
    sys.path.insert(0, str(SCRIPT.parent))
    import roofline

    m = {"status": "ok", "fwd_s": 0.09, "bwd_s": 0.004, "peak_mb": 5424.0}
    record = {"steps": {"bench-16384": {"machine": {"bf16_matmul_peak_tflops": 700.0}, "rows": [
        {"N": 16384, "D": 3584, "V": 152064, "K": 8, "impls": {"ours-chunked": m, "trl": m,
                                                               "ours-det": {"status": "incorrect"}}}]}}}
    (row,) = roofline.calibration_rows(record, copy_bytes=4e12)
    cost = roofline.chunked_17cb676(roofline.Shape(16384, 3584, 152064, 8))
    assert row["impl"] == "ours-chunked" and row["measured_ms"] == pytest.approx(94.0)
    assert row["predicted_ms"] == pytest.approx(1e3 * (6 * 16384 * 3584 * 152064 / 700e12 + cost.bytes / 4e12))
    assert "| bench-16384 | 16384 | 8 | ours-chunked | 94.0 |" in roofline.calibration_markdown([row])


def test_the_models_blocks_and_chunks_are_the_kernels():
    """The chunk rows and the deterministic backward's blocks of the model are those the kernels compute."""
    sys.path.insert(0, str(SCRIPT.parent))
    import roofline
    from fastdistill_kernels.backward import deterministic_blocks
    from fastdistill_kernels.config import TileConfig
    from fastdistill_kernels.dense_chunk import dense_chunk_rows_for
    from fastdistill_kernels.logits_chunk import chunk_rows_for

    shapes = [*roofline.HEADS.values(), roofline.Shape(300, 64, 1000), roofline.Shape(100000, 8192, 256000)]
    for s in shapes:
        assert roofline.fp32_chunk_rows(s) == chunk_rows_for(s.N, s.V, torch.float32), s
        assert roofline.fp32_chunk_rows(s, True) == dense_chunk_rows_for(s.N, s.V, s.V, torch.float32,
                                                                        torch.float32), s
        rows, tiles = deterministic_blocks(TileConfig(), s.N, s.D, math.ceil(s.V / 128), 2)
        assert roofline.deterministic_blocks(s) == (rows, tiles * 128), s
