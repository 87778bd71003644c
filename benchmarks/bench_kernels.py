"""Benchmark of the fused Triton loss kernels against the bare GEMMs, its own model, and the losses users have today.

Implementations (bf16 on a GPU):
  ours-det      fastdistill_kernels.fused_sparse_jsd, deterministic backward (vocabulary chunks: workspace + GEMMs)
  ours-fused    the same with the fused backward (fp32 atomics, no workspace)
  ours-filter   fused backward with gradient filtering (filter_eps = 2^-12, CCE's bf16 default)
  ours-chunked  ``chunked_logits_sparse_jsd`` (cuBLAS logits per row chunk, two Triton passes)
  ours-dense    ``fused_dense_teacher_jsd``: the dense-teacher loss with both lm_heads fused into the tiles (here
                liger's setting: its teacher hidden states through the same lm_head, forward KL, row mean)
  ours-dense-chunked  ``chunked_dense_teacher_jsd``, the same loss with cuBLAS logits per row chunk
  trl           TRL's ``_chunked_jsd_loss`` (checkpointed 256-row chunks), same sparse loss
  liger         Liger's ``LigerFusedLinearJSD`` (dense teacher: a second hidden state through the same lm_head)
  cce           Cut Cross-Entropy's ``linear_cross_entropy`` on the top-1 candidate (same matmul work, CE loss)
  torch         fastdistill's memory-bounded torch path (not in the default GPU sweep)

Per configuration (N, D, V, K) and input distribution (``bench_inputs``: random, and peaked like a trained model's;
each printed with its mean entropy, tokens per row at p ≥ 2⁻¹² and mean p_max):
- the floor: the three bare GEMMs (logits, dL/dh, dL/dW; a dense teacher adds its logits GEMM), timed in the same
  run, and every row's ratio to it;
- forward + backward in one CUDA-event window (and the split), ``--repeats`` (default 10) after ``--warmup``
  (default 5), min / median / max;
- useful TFLOP/s (``roofline.useful_flops``: 6·N·D·V, + 2·N·D_t·V_t for a dense teacher; a design's recomputation
  is not counted) and MFU against the matmul rate measured in the same call and the 989 TFLOP/s datasheet;
- the predicted time of :mod:`roofline` (GEMM FLOPs / matmul rate + bytes / copy bandwidth, both measured in the
  same call: a bf16 ``torch.mm`` and a device copy), its ratio to the measurement, and the predicted peak memory.

Correctness gate: before timing an implementation on a config, its loss and gradients (dh, dW) on the first
``--gate-rows`` rows are compared with a float64 evaluation of the loss it computes, from the same (rounded) inputs
(:func:`gate_tolerances`). One that disagrees is not timed. A missing third-party package is reported, not fatal;
the fastdistill kernels not being importable is fatal (exit 2), and an ``ours-*`` row that is incorrect or fails
makes the exit status 1 (after the table and the JSON are written).

Without CUDA it sets TRITON_INTERPRET=1, runs one tiny config in Triton's CPU interpreter (CPU ceilings, gate
included), compares the kernels with the torch path, and prints the predicted table at three lm_heads with the
H200's recorded rates (``roofline.H200_RECORDED``); ``--predict-only`` prints only that table.

    python benchmarks/bench_kernels.py                  # GPU sweep
    python benchmarks/bench_kernels.py --quick          # tiny smoke config (CPU: interpreter)
    python benchmarks/bench_kernels.py --predict-only   # the predicted table, no measurement
    python benchmarks/bench_kernels.py --N 4096 --D 896 --K 8 --impls ours-det trl cce --dists peaked
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from bench_inputs import DISTRIBUTIONS, distribution_stats, make_inputs, teacher_hidden  # noqa: E402
from bench_timing import copy_bandwidth, matmul_rate, measure_ceilings, time_fwd_bwd, time_gemms  # noqa: E402, F401

IMPLS = ("ours-det", "ours-fused", "ours-filter", "ours-chunked", "ours-dense", "ours-dense-chunked", "trl", "liger",
         "cce", "torch")
OURS = ("ours-det", "ours-fused", "ours-filter", "ours-chunked", "ours-dense", "ours-dense-chunked")
GPU_IMPLS = ("ours-det", "ours-fused", "ours-filter", "ours-chunked", "ours-dense", "ours-dense-chunked", "trl",
             "liger", "cce")
CPU_IMPLS = ("ours-det", "ours-fused", "ours-chunked", "ours-dense", "torch")
DENSE_TEACHER = ("liger", "ours-dense", "ours-dense-chunked")  # the dense forward KL against teacher_hidden
K_INDEPENDENT = ("liger", "cce", "ours-dense", "ours-dense-chunked")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_kernels.json"
TRL_CHUNK_SIZE = 256  # TRL's _CHUNKED_LM_HEAD_CHUNK_SIZE
FILTER_EPS = 2.0**-12
MiB = 2**20
GATE_ROWS = {"cuda": 256, "cpu": 32}
STATS_ROWS = {"cuda": None, "cpu": 256}  # rows of the distribution statistics (None: all)


class KernelsUnavailable(RuntimeError):
    """The fastdistill kernels (the ``ours-*`` rows) cannot be imported: the benchmark cannot do its job."""


def import_kernels():
    """``fastdistill_kernels.fused_sparse_jsd``, or :class:`KernelsUnavailable` saying how to install it."""
    try:
        from fastdistill_kernels import fused_sparse_jsd
    except ImportError as e:
        raise KernelsUnavailable(f"the ours-* rows need the fastdistill kernels, which do not import ({e!r}); "
                                 "install the package with `pip install -e '.[gpu]'` (CPU: '.[test]')") from e
    return fused_sparse_jsd


def loss_fn(impl: str, hidden, weight, ids, lps, mask, dist: str = "random"):
    """A closure computing the 0-dim loss of ``impl`` on these inputs (raises ImportError when a third-party
    package is not installed, :class:`KernelsUnavailable` for the ours-* rows)."""
    if impl in ("ours-dense", "ours-dense-chunked"):
        import_kernels()  # the same package: fail loudly when it is not importable
        from fastdistill_kernels import chunked_dense_teacher_jsd, fused_dense_teacher_jsd

        teacher, n = teacher_hidden(hidden, dist=dist), hidden.shape[0]
        if impl == "ours-dense":
            return lambda: fused_dense_teacher_jsd(hidden, weight, teacher, weight.detach()).divergence.sum() / n
        return lambda: chunked_dense_teacher_jsd(hidden, weight, teacher, weight.detach()).loss / n
    if impl == "ours-chunked":
        import_kernels()
        from fastdistill_kernels import chunked_logits_sparse_jsd

        return lambda: chunked_logits_sparse_jsd(hidden, weight, ids, lps, mask).loss
    if impl in OURS:
        fused_sparse_jsd = import_kernels()
        kw = dict(backward_mode="deterministic") if impl == "ours-det" else dict(backward_mode="fused")
        if impl == "ours-filter":
            kw["filter_eps"] = FILTER_EPS
        return lambda: fused_sparse_jsd(hidden, weight, ids, lps, mask, **kw).divergence.sum()
    if impl == "torch":
        from fastdistill import sparse_jsd_loss

        return lambda: sparse_jsd_loss(hidden, weight, ids, lps, mask, backend="torch").loss
    if impl == "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.async_distillation.async_distillation_trainer import _chunked_jsd_loss

        return lambda: _chunked_jsd_loss(hidden, weight, None, 1.0, None, ids, lps, mask, 0.0, 1.0, True, None, 1,
                                         TRL_CHUNK_SIZE)[0]
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=0.0, temperature=1.0)  # beta=0: forward KL(teacher‖student), row mean
        teacher = teacher_hidden(hidden, dist=dist)
        # shift_labels is a required positional argument in liger-kernel 0.8.5 (None: every row counts)
        return lambda: jsd(hidden, weight, teacher, weight.detach(), None)
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda: linear_cross_entropy(hidden, weight, ids[:, 0], reduction="sum")
    raise ValueError(f"unknown implementation {impl!r}")


def reference_loss(impl: str, hidden, weight, ids, lps, input_dtype: torch.dtype, dist: str = "random"
                   ) -> torch.Tensor:
    """The loss ``impl`` computes, in float64 on float64 ``hidden`` ``(n, D)`` and ``weight`` ``(V, D)`` that hold
    the benchmark's inputs (in ``input_dtype``: K+1 distinct ids per row, every slot used, β = 0). ours-* and
    torch: forward KL over the candidates + the exact tail; trl: the same with TRL's clamped student tail; liger
    and ours-dense*: the dense forward KL against :func:`teacher_hidden` (rounded to ``input_dtype`` as they get it)
    through the same lm_head, averaged over rows; cce: cross-entropy on the top-1."""
    logp = torch.log_softmax(hidden @ weight.t(), dim=1)
    if impl in DENSE_TEACHER:
        teacher = teacher_hidden(hidden, input_dtype, dist).to(hidden.dtype)
        t = torch.log_softmax(teacher @ weight.detach().t(), dim=1)  # liger's teacher weight carries no gradient
        return (t.exp() * (t - logp)).sum() / hidden.shape[0]
    if impl == "cce":
        return -logp.gather(1, ids[:, :1]).sum()
    clamp = math.exp(-1e-7)  # TRL's clamp of the supported mass (teacher side always, student side in trl mode)
    p = logp.gather(1, ids).exp()
    q = lps.to(logp.dtype).exp()
    if impl == "trl":
        p_tail = 1.0 - p.sum(dim=1).clamp(max=clamp)
    else:
        p_tail = logp.scatter(1, ids, float("-inf")).logsumexp(dim=1).exp()
    q_tail = 1.0 - q.sum(dim=1).clamp(max=clamp)
    p, q = torch.cat([p, p_tail[:, None]], dim=1), torch.cat([q, q_tail[:, None]], dim=1)
    return (torch.special.xlogy(q, q) - torch.special.xlogy(q, p)).sum()


def gate_tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Relative tolerances of the correctness gate for inputs in ``dtype`` (eps = its machine epsilon). loss:
    4·eps (at least 1e-5): a loss returned in the input dtype is itself rounded to eps/2, and chunk sums kept in it
    add a few more. grad: 4·eps (at least 1e-4) on ‖g − ref‖₂ / ‖ref‖₂: the gradients come back in the input dtype,
    and half-precision kernels round dL/dlogits to it before their GEMMs (bf16: 3.1 %, fp16: 0.39 %, fp32: 1e-4)."""
    eps = torch.finfo(dtype).eps
    return {"loss": max(4 * eps, 1e-5), "grad": max(4 * eps, 1e-4)}


def correctness_gate(impl: str, inputs, rows: int, dist: str = "random") -> dict:
    """``impl``'s loss, dh and dW on the first ``rows`` rows against :func:`reference_loss` in float64 from the same
    rounded inputs. Returns ``{"ok", "rows", "rel_diff": {loss, dh, dW}, "tol"}``."""
    hidden, weight, ids, lps, mask = inputs
    n = min(rows, hidden.shape[0])
    h = hidden[:n].detach().clone().requires_grad_(True)
    fn = loss_fn(impl, h, weight, ids[:n], lps[:n], mask[:n], dist)
    loss = fn()
    got = (loss.detach(), *torch.autograd.grad(loss, (h, weight)))
    del loss
    h64 = h.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_loss = reference_loss(impl, h64, w64, ids[:n], lps[:n], hidden.dtype, dist)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, (h64, w64)))
    del ref_loss, h64, w64
    rel = {name: rel_l2(g, r) for name, g, r in zip(("loss", "dh", "dW"), got, ref, strict=True)}
    tol = gate_tolerances(hidden.dtype)
    ok = rel["loss"] <= tol["loss"] and max(rel["dh"], rel["dW"]) <= tol["grad"]
    return {"ok": bool(ok), "rows": n, "rel_diff": rel, "tol": tol}


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖₂ / ‖ref‖₂ in float64 (NaN-safe: a non-finite ``got`` gives inf)."""
    got, ref = got.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------------------ timing
def measure(impl: str, inputs, repeats: int, warmup: int, device: torch.device, gate_rows: int = 1,
            dist: str = "random") -> dict:
    """The correctness gate on ``gate_rows`` rows, then (only if it passed) forward + backward timings
    (:func:`time_fwd_bwd`; ``fwd_s`` / ``bwd_s`` / ``total_s`` the medians), the loss, and the peak memory
    allocated beyond the inputs (CUDA). Raises :class:`KernelsUnavailable` for an ours-* row without the kernels."""
    hidden, weight = inputs[0], inputs[1]
    try:
        fn = loss_fn(impl, *inputs, dist)
    except ImportError as e:  # KernelsUnavailable is not an ImportError: it propagates
        return {"status": "missing", "error": repr(e)}
    try:
        gate = correctness_gate(impl, inputs, gate_rows, dist)
    except Exception as e:  # an OOM or a broken package must not end the sweep
        return {"status": "failed", "error": f"correctness gate: {e!r}"[:2000]}
    if not gate["ok"]:
        return {"status": "incorrect", "gate": gate,
                "error": f"disagrees with the float64 reference: {json.dumps(gate['rel_diff'])} > {gate['tol']}"}
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        t = time_fwd_bwd(fn, (hidden, weight), repeats, warmup, device)
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / MiB if cuda else None
    except Exception as e:  # an OOM or a broken package must not end the sweep
        return {"status": "failed", "error": repr(e)[:2000]}
    return {"status": "ok", "fwd_s": t["fwd"]["median"], "bwd_s": t["bwd"]["median"],
            "total_s": t["total"]["median"], "spread_s": t["total"], "fwd_spread_s": t["fwd"],
            "bwd_spread_s": t["bwd"], "loss": t["loss"], "peak_mb": peak_mb, "gate": gate}


def add_rates(m: dict, impl: str, shape: roofline.Shape, floor: dict, rates: roofline.Rates,
              tokens_per_row: float) -> None:
    """Useful TFLOP/s, MFU (against the measured matmul rate and the datasheet), the ratio to the bare-GEMM floor,
    and the model's predicted time and memory, onto a measured row ``m``."""
    if m["status"] != "ok":
        return
    dense = impl in DENSE_TEACHER
    t = m["total_s"]
    useful = roofline.useful_flops(shape, dense)
    m["useful_tflop"] = useful / 1e12
    m["tflops"] = useful / t / 1e12
    m["mfu"] = useful / t / rates.matmul_flops
    m["mfu_datasheet"] = useful / t / roofline.DATASHEET_BF16_FLOPS
    m["floor"] = "four GEMMs" if dense else "three GEMMs"
    m["floor_s"] = floor["dense_s"] if dense else floor["three_s"]
    m["x_floor"] = t / m["floor_s"]
    cost = roofline.impl_cost(impl, shape, tokens_per_row)
    if cost is not None:
        m["predicted_s"] = cost.predicted_s(rates)
        m["measured_over_predicted"] = t / m["predicted_s"]
        m["predicted_peak_mb"] = cost.peak_memory / MiB


# ------------------------------------------------------------------------------------------------------ output
def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'dist':<7}{'N':>6} {'D':>5} {'V':>6} {'K':>3}  {'impl':<19}{'fwd+bwd ms min/med/max':>24} {'fwd':>7} "
          f"{'bwd':>7} {'×floor':>6} {'pred ms':>8} {'meas/pred':>9} {'TFLOP/s':>7} {'MFU':>5} {'MFU989':>6} "
          f"{'peak MB':>8} {'pred MB':>8}")
    for r in rows:
        head = f"{r['dist']:<7}{r['N']:>6} {r['D']:>5} {r['V']:>6} {r['K']:>3}  "
        f = r["floor"]
        print(f"{head}{'three bare GEMMs':<19}{_ms3(f['total']):>24} {'':>7} {'':>7} {1.0:>6.2f} "
              f"{fmt(r.get('floor_predicted_s') and 1e3 * r['floor_predicted_s'], '.1f'):>8}")
        for impl, m in r["impls"].items():
            if m["status"] != "ok":
                print(f"{head}{impl:<19}{m['status']}: {m.get('error', '')[:80]}")
                continue
            pct = lambda x: fmt(x and 100 * x, ".0f") + "%"  # noqa: E731
            print(f"{head}{impl:<19}{_ms3(m['spread_s']):>24} {1e3 * m['fwd_s']:>7.1f} {1e3 * m['bwd_s']:>7.1f} "
                  f"{m['x_floor']:>6.2f} {fmt(m.get('predicted_s') and 1e3 * m['predicted_s'], '.1f'):>8} "
                  f"{fmt(m.get('measured_over_predicted'), '.2f'):>9} {m['tflops']:>7.1f} {pct(m['mfu']):>5} "
                  f"{pct(m['mfu_datasheet']):>6} {fmt(m['peak_mb'], '.0f'):>8} "
                  f"{fmt(m.get('predicted_peak_mb'), '.0f'):>8}")


def _ms3(s: dict) -> str:
    return f"{1e3 * s['min']:.2f}/{1e3 * s['median']:.2f}/{1e3 * s['max']:.2f}"


def machine_info(device: torch.device, rates: roofline.Rates | None) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
            "bf16_matmul_peak_tflops": rates and rates.matmul_flops / 1e12,
            "matmul_tflops": rates and rates.matmul_flops / 1e12,
            "matmul_fp32_tflops": rates and rates.matmul_fp32_flops / 1e12,
            "copy_gbytes_per_s": rates and rates.copy_bytes / 1e9, "rates_source": rates and rates.source,
            "datasheet_bf16_tflops": roofline.DATASHEET_BF16_FLOPS / 1e12, "python": sys.version.split()[0],
            "versions": {p: version(p) for p in ("torch", "triton", "trl", "liger-kernel", "cut-cross-entropy")},
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--N", type=int, nargs="+", help="positions (GPU: 4096 16384; CPU / quick: 64)")
    p.add_argument("--D", type=int, nargs="+", help="hidden sizes (GPU: 896 3584; CPU / quick: 48)")
    p.add_argument("--V", type=int, help="vocabulary size (GPU: 152064; CPU / quick: 512)")
    p.add_argument("--K", type=int, nargs="+", help="teacher top-K, K+1 slots per row (GPU: 8 64; CPU / quick: 8)")
    p.add_argument("--dists", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS),
                   help="input distributions (bench_inputs.py)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help=f"default GPU {GPU_IMPLS}, CPU {CPU_IMPLS}")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--quick", action="store_true", help="one tiny config, one timed repeat")
    p.add_argument("--repeats", type=int, default=10, help="timed forward+backward windows (min/median/max)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (Triton compiles here)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument("--gate-rows", type=int, help="rows of the correctness gate (default: GPU 256, CPU 32; >= 1)")
    p.add_argument("--predict-only", action="store_true",
                   help="print the predicted table at three lm_heads with the H200's recorded rates; measure nothing")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.gate_rows = args.gate_rows or GATE_ROWS["cuda" if cuda else "cpu"]
    if args.gate_rows < 1:
        p.error("--gate-rows must be >= 1: the benchmark does not time unchecked implementations")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    small = args.quick or not cuda
    args.N = args.N or ([512] if args.quick and cuda else [64] if small else [4096, 16384])
    args.D = args.D or ([896] if args.quick and cuda else [48] if small else [896, 3584])
    args.V = args.V or (152064 if cuda else 512)
    args.K = args.K or ([8] if small else [8, 64])
    args.impls = args.impls or list(GPU_IMPLS if cuda else CPU_IMPLS)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if args.quick:
        args.repeats, args.warmup = 1, min(args.warmup, 1)
    return args


def predicted_section(rates: roofline.Rates) -> dict:
    """The predicted table at :data:`roofline.HEADS` and the memory arithmetic, for the JSON."""
    return {"rates": rates.source, "rows": roofline.predicted_rows(roofline.HEADS, rates),
            "memory": roofline.memory_lines(roofline.HEADS)}


def print_predicted(section: dict, rates: roofline.Rates) -> None:
    print("predicted (roofline.py; not a measurement), N=16384, K=8, bf16; cce at 5 tokens per row ≥ 2^-12:")
    print(roofline.predicted_markdown(section["rows"], rates))
    print("\n".join(section["memory"]))


def run_config(args, device, rates, N: int, D: int, dist: str, stats_rows) -> list[dict]:
    """Every K of one (N, D, distribution): the floor once, the distribution's statistics, each implementation."""
    floor = time_gemms(N, D, args.V, args.dtype, device, args.repeats, args.warmup)
    shared: dict[str, dict] = {}
    rows = []
    for K in args.K:
        inputs = make_inputs(N, D, args.V, K, args.dtype, device, dist=dist)
        stats = distribution_stats(inputs[0], inputs[1], stats_rows)
        shape = roofline.Shape(N, D, args.V, K, args.dtype.itemsize)
        by_impl = {}
        for impl in args.impls:
            if impl in K_INDEPENDENT and impl in shared:
                by_impl[impl] = {**shared[impl], "measured_at_K": args.K[0]}
                continue
            by_impl[impl] = measure(impl, inputs, args.repeats, args.warmup, device, args.gate_rows, dist)
            add_rates(by_impl[impl], impl, shape, floor, rates, stats["tokens_per_row_p_ge_2^-12"])
            if impl in K_INDEPENDENT:
                shared[impl] = by_impl[impl]
        row = {"dist": dist, "N": N, "D": D, "V": args.V, "K": K, "distribution": stats, "floor": floor,
               "floor_predicted_s": roofline.bare_gemms(shape).predicted_s(rates), "impls": by_impl}
        if device.type == "cpu":
            row["rel_diff_vs_torch_path"] = compare_with_torch_path(inputs)
        rows.append(row)
        del inputs
    return rows


def compare_with_torch_path(inputs) -> dict:
    """Relative differences of the kernels (both backward modes) from the torch path: loss, dh, dW."""
    from fastdistill import sparse_jsd_loss

    fused_sparse_jsd = import_kernels()
    hidden, weight, ids, lps, mask = inputs

    def run(f):
        hidden.grad = weight.grad = None
        loss = f()
        loss.backward()
        return loss.detach().double(), hidden.grad.double(), weight.grad.double()

    ref = run(lambda: sparse_jsd_loss(hidden, weight, ids, lps, mask, backend="torch").loss)
    out = {}
    for mode in ("deterministic", "fused"):
        got = run(lambda mode=mode: fused_sparse_jsd(hidden, weight, ids, lps, mask, backward_mode=mode)
                  .divergence.sum())
        out[mode] = {name: float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
                     for name, g, r in zip(("loss", "dh", "dW"), got, ref, strict=True)}
    hidden.grad = weight.grad = None
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (or only the prediction), print the tables, write the JSON; returns the exit status (1: an
    ours-* row is not ok)."""
    args = parse_args(argv)
    settings = {k: (str(v).removeprefix("torch.") if k == "dtype" else v) for k, v in vars(args).items() if k != "json"}
    if args.predict_only:
        result = {"settings": settings, "predicted": predicted_section(roofline.H200_RECORDED)}
        print_predicted(result["predicted"], roofline.H200_RECORDED)
        return write_json(args.json, result, 0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before fastdistill_kernels (and its @triton.jit) loads
    if any(impl in OURS for impl in args.impls):
        import_kernels()  # fail before any measurement, not after a sweep
    rates = measure_ceilings(device, args.dtype)
    stats_rows = STATS_ROWS[device.type]
    # the three heads predicted: with this call's ceilings on a GPU; without one, from the H200's recorded rates
    head_rates = rates if device.type == "cuda" else roofline.H200_RECORDED
    result = {"machine": machine_info(device, rates), "settings": settings, "rows": [], "partial": True,
              "predicted": predicted_section(head_rates)}
    for dist in args.dists:
        for D in args.D:
            for N in args.N:
                result["rows"] += run_config(args, device, rates, N, D, dist, stats_rows)
                write_json(args.json, result, 0, quiet=True)  # a run cut short keeps what it measured
    rows = result.pop("rows")
    del result["partial"]
    print(f"device: {machine_info(device, rates)['device']}; ceilings {rates.source}; "
          f"dtype {str(args.dtype).removeprefix('torch.')}; {args.repeats} repeats after {args.warmup} warm-ups")
    for r in rows:
        s = r["distribution"]
        print(f"inputs {r['dist']} N={r['N']} D={r['D']} K={r['K']}: mean entropy {s['mean_entropy_nats']:.2f} nats, "
              f"{s['tokens_per_row_p_ge_2^-12']:.1f} tokens per row at p >= 2^-12, mean p_max {s['mean_p_max']:.3f}")
    print_table(rows)
    for r in rows:
        if "rel_diff_vs_torch_path" in r:
            print(f"{r['dist']} N={r['N']} D={r['D']} K={r['K']} kernels vs torch path (max rel. diff): "
                  f"{json.dumps(r['rel_diff_vs_torch_path'])}")
    result["rows"] = rows
    print_predicted(result["predicted"], head_rates)
    return write_json(args.json, result, report_ours_failures(rows))


def write_json(path: Path, result: dict, status: int, quiet: bool = False) -> int:
    """Write ``result`` (atomically: a reader never sees half a file); returns ``status``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
    if not quiet:
        print(f"wrote {path}")
    return status


def report_ours_failures(rows: list[dict]) -> int:
    """Print every ours-* measurement that is not ok to stderr; 1 if there is one, else 0."""
    bad = [(r, impl, m) for r in rows for impl, m in r["impls"].items() if impl in OURS and m["status"] != "ok"]
    for r, impl, m in bad:
        print(f"ERROR: {impl} at {r.get('dist', 'random')} N={r['N']} D={r['D']} V={r['V']} K={r['K']}: "
              f"{m['status']}: {m.get('error', '')}", file=sys.stderr)
    return 1 if bad else 0


def cli(argv: list[str] | None = None) -> int:
    """:func:`main` with :class:`KernelsUnavailable` turned into a clear message and exit status 2."""
    try:
        return main(argv)
    except KernelsUnavailable as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
