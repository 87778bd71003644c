"""Benchmark of the fused Triton loss kernels against the loss implementations users have today.

On a CUDA machine (bf16, Qwen-like shapes: D ∈ {896, 1536, 3584}, V = 151936, N ∈ {4096, 16384}, K ∈ {8, 64}):
  ours-det      fastdistill_kernels.fused_sparse_jsd, deterministic backward (vocabulary chunks: workspace + GEMMs)
  ours-fused    the same with the fused backward (fp32 atomics, no workspace)
  ours-filter   fused backward with gradient filtering (filter_eps = 2^-12, CCE's bf16 default)
  ours-chunked  the 6·N·D·V variant (``chunked_logits_sparse_jsd``: cuBLAS logits per row chunk, two Triton passes)
  ours-dense    ``fused_dense_teacher_jsd``: the dense-teacher loss with both lm_heads fused into the tiles (here
                liger's setting: its teacher hidden states through the same lm_head, forward KL, row mean)
  ours-dense-chunked  ``chunked_dense_teacher_jsd``, the same loss with cuBLAS logits per row chunk
  trl           TRL's ``_chunked_jsd_loss`` (checkpointed 256-row chunks), same sparse loss
  liger         Liger's ``LigerFusedLinearJSD`` (dense teacher: a second hidden state through the same lm_head;
                it computes its gradients inside the forward, so its "fwd" holds most of the work)
  cce           Cut Cross-Entropy's ``linear_cross_entropy`` on the top-1 candidate (same matmul work, CE loss)
  torch         fastdistill's memory-bounded torch path (not in the default GPU sweep)
It prints forward / backward time, TFLOP/s counting 8·N·D·V for forward + backward, MFU against a measured bf16
``torch.mm`` peak, and the peak memory allocated beyond the inputs. K-independent implementations (liger, cce) are
measured once per (N, D).

Correctness gate: before timing an implementation on a config, its loss and gradients (dh, dW) on the first
``--gate-rows`` rows are compared with a float64 evaluation of the loss it computes, from the same (rounded) inputs;
tolerances follow the input dtype (:func:`gate_tolerances`). One that disagrees is not timed: its row reads
"incorrect", with the differences. A missing third-party package is reported, not fatal; the fastdistill kernels
not being importable is fatal (exit 2), and an ``ours-*`` row that is incorrect or fails makes the exit status 1
(after the table and the JSON are written).

Without CUDA it sets TRITON_INTERPRET=1 and runs one tiny config in Triton's CPU interpreter, gate included, and
also compares the kernels' loss and gradients with the torch path (``--quick`` keeps it to a few seconds).

    python benchmarks/bench_kernels.py                  # full GPU sweep (< 5 min on an H100-class GPU)
    python benchmarks/bench_kernels.py --quick          # tiny smoke config (CPU: interpreter)
    python benchmarks/bench_kernels.py --N 4096 --D 896 --K 8 --impls ours-det trl cce

It also prints a roofline model of the two designs (``benchmarks/roofline.py``: fastdistill's no-logits kernels at
8·N·D·V FLOPs against a chunked-logits design at 6·N·D·V), at the run's shapes on a GPU and at the GPU sweep's shapes
elsewhere, and writes it to the JSON under ``"roofline"``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

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
TEACHER_SEED = 1  # liger's dense teacher hidden states
GATE_ROWS = {"cuda": 256, "cpu": 32}


class KernelsUnavailable(RuntimeError):
    """The fastdistill kernels (the ``ours-*`` rows) cannot be imported: the benchmark cannot do its job."""


def make_inputs(N: int, D: int, V: int, K: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """hidden (N, D) and lm_head (V, D) leaves in ``dtype``, K+1 distinct candidate ids per row, teacher log-probs
    (N, K+1) whose probabilities sum to < 1 (the rest is the teacher's tail), and an all-true slot mask."""
    g = torch.Generator(device=device).manual_seed(seed)
    S = K + 1
    hidden = torch.randn(N, D, generator=g, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, D, generator=g, device=device) / math.sqrt(D)).to(dtype).requires_grad_(True)
    start = torch.randint(0, V, (N, 1), generator=g, device=device)
    ids = (start + torch.arange(S, device=device) * (V // S)) % V  # distinct within a row
    lps = torch.log_softmax(2.0 * torch.randn(N, S + 1, generator=g, device=device), dim=1)[:, :S].contiguous()
    return hidden, weight, ids, lps, torch.ones(N, S, dtype=torch.bool, device=device)


def import_kernels():
    """``fastdistill_kernels.fused_sparse_jsd``, or :class:`KernelsUnavailable` saying how to install it."""
    try:
        from fastdistill_kernels import fused_sparse_jsd
    except ImportError as e:
        raise KernelsUnavailable(f"the ours-* rows need the fastdistill kernels, which do not import ({e!r}); "
                                 "install the package with `pip install -e '.[gpu]'` (CPU: '.[test]')") from e
    return fused_sparse_jsd


def teacher_hidden(hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Liger's dense teacher input: seeded normal hidden states shaped like ``hidden``, rounded to ``dtype``
    (default: hidden's), the same for every call."""
    g = torch.Generator(device=hidden.device).manual_seed(TEACHER_SEED)
    return torch.randn(hidden.shape, generator=g, device=hidden.device).to(dtype or hidden.dtype)


def loss_fn(impl: str, hidden, weight, ids, lps, mask):
    """A closure computing the 0-dim loss of ``impl`` on these inputs (raises ImportError when a third-party
    package is not installed, :class:`KernelsUnavailable` for the ours-* rows)."""
    if impl in ("ours-dense", "ours-dense-chunked"):
        import_kernels()  # the same package: fail loudly when it is not importable
        from fastdistill_kernels import chunked_dense_teacher_jsd, fused_dense_teacher_jsd

        teacher, n = teacher_hidden(hidden), hidden.shape[0]
        if impl == "ours-dense":
            return lambda: fused_dense_teacher_jsd(hidden, weight, teacher, weight.detach()).divergence.sum() / n
        return lambda: chunked_dense_teacher_jsd(hidden, weight, teacher, weight.detach()).loss / n
    if impl == "ours-chunked":
        import_kernels()  # the same package: fail loudly when it is not importable
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
        teacher = teacher_hidden(hidden)
        # shift_labels is a required positional argument in liger-kernel 0.8.5 (None: every row counts)
        return lambda: jsd(hidden, weight, teacher, weight.detach(), None)
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda: linear_cross_entropy(hidden, weight, ids[:, 0], reduction="sum")
    raise ValueError(f"unknown implementation {impl!r}")


def reference_loss(impl: str, hidden, weight, ids, lps, input_dtype: torch.dtype) -> torch.Tensor:
    """The loss ``impl`` computes, in float64 on float64 ``hidden`` ``(n, D)`` and ``weight`` ``(V, D)`` that hold
    the benchmark's inputs (in ``input_dtype``: K+1 distinct ids per row, every slot used, β = 0). ours-* and
    torch: forward KL over the candidates + the exact tail; trl: the same with TRL's clamped student tail; liger
    and ours-dense*: the dense forward KL against :func:`teacher_hidden` (rounded to ``input_dtype`` as they get it)
    through the same lm_head, averaged over rows; cce: cross-entropy on the top-1."""
    logp = torch.log_softmax(hidden @ weight.t(), dim=1)
    if impl in DENSE_TEACHER:
        teacher = teacher_hidden(hidden, input_dtype).to(hidden.dtype)
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


def correctness_gate(impl: str, inputs, rows: int) -> dict:
    """``impl``'s loss, dh and dW on the first ``rows`` rows against :func:`reference_loss` in float64 from the same
    rounded inputs. Returns ``{"ok", "rows", "rel_diff": {loss, dh, dW}, "tol"}``."""
    hidden, weight, ids, lps, mask = inputs
    n = min(rows, hidden.shape[0])
    h = hidden[:n].detach().clone().requires_grad_(True)
    fn = loss_fn(impl, h, weight, ids[:n], lps[:n], mask[:n])
    loss = fn()
    got = (loss.detach(), *torch.autograd.grad(loss, (h, weight)))
    del loss
    h64 = h.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_loss = reference_loss(impl, h64, w64, ids[:n], lps[:n], hidden.dtype)
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(impl: str, inputs, repeats: int, warmup: int, device: torch.device, gate_rows: int = 1) -> dict:
    """The correctness gate on ``gate_rows`` rows, then (only if it passed) median forward / backward seconds, the
    loss, and the peak memory allocated beyond the inputs (CUDA). Raises :class:`KernelsUnavailable` for an ours-*
    row without the kernels."""
    hidden, weight = inputs[0], inputs[1]
    try:
        fn = loss_fn(impl, *inputs)
    except ImportError as e:  # KernelsUnavailable is not an ImportError: it propagates
        return {"status": "missing", "error": repr(e)}
    try:
        gate = correctness_gate(impl, inputs, gate_rows)
    except Exception as e:  # an OOM or a broken package must not end the sweep
        return {"status": "failed", "error": f"correctness gate: {e!r}"[:2000]}
    if not gate["ok"]:
        return {"status": "incorrect", "gate": gate,
                "error": f"disagrees with the float64 reference: {json.dumps(gate['rel_diff'])} > {gate['tol']}"}
    cuda = device.type == "cuda"
    fwd, bwd, loss = [], [], None
    try:
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(warmup + repeats):
            hidden.grad = weight.grad = None
            sync(device)
            t0 = time.perf_counter()
            out = fn()
            sync(device)
            t1 = time.perf_counter()
            out.backward()
            sync(device)
            t2 = time.perf_counter()
            loss = float(out.detach())
            del out
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / MiB if cuda else None
    except Exception as e:  # an OOM or a broken package must not end the sweep
        return {"status": "failed", "error": repr(e)[:2000]}
    finally:
        hidden.grad = weight.grad = None
    return {"status": "ok", "fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd), "loss": loss,
            "peak_mb": peak_mb, "gate": gate}


def matmul_peak_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """Measured bf16 ``torch.mm`` throughput at an (n × n) @ (n × n) product, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def compare_with_torch_path(inputs, device: torch.device) -> dict:
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


def add_rates(m: dict, N: int, D: int, V: int, peak_tflops: float | None) -> None:
    """TFLOP/s counting 8·N·D·V for forward + backward, and MFU against the measured matmul peak."""
    if m["status"] != "ok":
        return
    m["tflops"] = 8 * N * D * V / (m["fwd_s"] + m["bwd_s"]) / 1e12
    m["mfu"] = m["tflops"] / peak_tflops if peak_tflops else None


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'N':>6} {'D':>5} {'V':>6} {'K':>3}  {'impl':<12} {'fwd ms':>9} {'bwd ms':>9} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'peak MB':>9} {'loss':>12}")
    for r in rows:
        for impl, m in r["impls"].items():
            head = f"{r['N']:>6} {r['D']:>5} {r['V']:>6} {r['K']:>3}  {impl:<12}"
            if m["status"] != "ok":
                print(f"{head} {m['status']}: {m.get('error', '')[:80]}")
                continue
            print(f"{head} {1e3 * m['fwd_s']:>9.2f} {1e3 * m['bwd_s']:>9.2f} {fmt(m.get('tflops'), '.1f'):>8} "
                  f"{fmt(m.get('mfu') and 100 * m['mfu'], '.1f'):>5}% {fmt(m['peak_mb'], '.0f'):>9} "
                  f"{m['loss']:>12.6g}")


def machine_info(device: torch.device, peak_tflops: float | None) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
            "bf16_matmul_peak_tflops": peak_tflops, "python": sys.version.split()[0],
            "versions": {p: version(p) for p in ("torch", "triton", "trl", "liger-kernel", "cut-cross-entropy")},
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--N", type=int, nargs="+", help="positions (GPU: 4096 16384; CPU / quick: 64)")
    p.add_argument("--D", type=int, nargs="+", help="hidden sizes (GPU: 896 1536 3584; CPU / quick: 48)")
    p.add_argument("--V", type=int, help="vocabulary size (GPU: 151936; CPU / quick: 512)")
    p.add_argument("--K", type=int, nargs="+", help="teacher top-K, K+1 slots per row (GPU: 8 64; CPU / quick: 8)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help=f"default GPU {GPU_IMPLS}, CPU {CPU_IMPLS}")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--quick", action="store_true", help="one tiny config, one timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (Triton compiles here)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument("--gate-rows", type=int, help="rows of the correctness gate (default: GPU 256, CPU 32; >= 1)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.gate_rows = args.gate_rows or GATE_ROWS["cuda" if cuda else "cpu"]
    if args.gate_rows < 1:
        p.error("--gate-rows must be >= 1: the benchmark does not time unchecked implementations")
    small = args.quick or not cuda
    args.N = args.N or ([512] if args.quick and cuda else [64] if small else [4096, 16384])
    args.D = args.D or ([896] if args.quick and cuda else [48] if small else [896, 1536, 3584])
    args.V = args.V or (151936 if cuda else 512)
    args.K = args.K or ([8] if small else [8, 64])
    args.impls = args.impls or list(GPU_IMPLS if cuda else CPU_IMPLS)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if args.quick:
        args.repeats, args.warmup = 1, min(args.warmup, 1)
    return args


def roofline_shapes(args: argparse.Namespace, cuda: bool) -> list[tuple[int, int, int, int]]:
    """``(N, D, V, S)`` for the roofline model: the run's configs on a GPU, the GPU sweep's otherwise."""
    if cuda:
        return [(N, D, args.V, K + 1) for D in args.D for N in args.N for K in args.K]
    return [(N, 3584, 151936, K + 1) for N in (4096, 16384) for K in (8, 64)]


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print the table, write the JSON; returns the exit status (1: an ours-* row is not ok)."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before fastdistill_kernels (and its @triton.jit) loads
    if any(impl in OURS for impl in args.impls):
        import_kernels()  # fail before any measurement, not after a sweep
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    rows = []
    for D in args.D:
        for N in args.N:
            shared: dict[str, dict] = {}
            for K in args.K:
                inputs = make_inputs(N, D, args.V, K, args.dtype, device)
                by_impl = {}
                for impl in args.impls:
                    if impl in K_INDEPENDENT and impl in shared:
                        by_impl[impl] = {**shared[impl], "measured_at_K": args.K[0]}
                        continue
                    by_impl[impl] = measure(impl, inputs, args.repeats, args.warmup, device, args.gate_rows)
                    add_rates(by_impl[impl], N, D, args.V, peak)
                    if impl in K_INDEPENDENT:
                        shared[impl] = by_impl[impl]
                row = {"N": N, "D": D, "V": args.V, "K": K, "impls": by_impl}
                if device.type == "cpu":
                    row["rel_diff_vs_torch_path"] = compare_with_torch_path(inputs, device)
                rows.append(row)
                del inputs
    print(f"device: {machine_info(device, peak)['device']}; bf16 matmul peak: {fmt(peak, '.0f')} TFLOP/s; "
          f"dtype {str(args.dtype).removeprefix('torch.')}")
    print_table(rows)
    for r in rows:
        if "rel_diff_vs_torch_path" in r:
            print(f"N={r['N']} D={r['D']} K={r['K']} kernels vs torch path (max rel. diff): "
                  f"{json.dumps(r['rel_diff_vs_torch_path'])}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from roofline import print_roofline, roofline_rows

    roofline = roofline_rows(roofline_shapes(args, device.type == "cuda"), elem_bytes=args.dtype.itemsize)
    print_roofline(roofline)
    settings = {k: (str(v).removeprefix("torch.") if k == "dtype" else v) for k, v in vars(args).items() if k != "json"}
    result = {"machine": machine_info(device, peak), "settings": settings, "rows": rows, "roofline": roofline}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return report_ours_failures(rows)


def report_ours_failures(rows: list[dict]) -> int:
    """Print every ours-* measurement that is not ok to stderr; 1 if there is one, else 0."""
    bad = [(r, impl, m) for r in rows for impl, m in r["impls"].items() if impl in OURS and m["status"] != "ok"]
    for r, impl, m in bad:
        print(f"ERROR: {impl} at N={r['N']} D={r['D']} V={r['V']} K={r['K']}: {m['status']}: {m.get('error', '')}",
              file=sys.stderr)
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
