"""Side-by-side fwd+bwd benchmark of one sparse distillation loss (forward KL over top-K + tail bucket).

Implementations, all on the same seeded fp32 inputs:
  dense  plain autograd over materialised (N, V) logits, what a user would naively write;
  trl    TRL's own ``_chunked_jsd_loss`` (checkpointed 256-row chunks), imported from the installed package;
  ours   ``fastdistill.sparse_jsd_loss(..., backend="torch")``.

Every (implementation, config, allocator setting) measurement runs in a fresh subprocess (``--worker IMPL``), so
the peak-memory numbers of one run never leak into another. Peak memory increase = high-water mark during the
runs minus the memory in use right after the inputs were built and one tiny warm-up call (RSS on CPU,
``torch.cuda.max_memory_allocated`` on CUDA). Each measurement is taken under two allocator settings:
  glibc-default         the environment users run with (glibc's dynamic mmap/trim thresholds: freed blocks of up
                        to 32 MiB may stay on its heap, so RSS can include allocator retention);
  mmap-threshold-1MiB   ``MALLOC_MMAP_THRESHOLD_=1048576``: large blocks are mmap'd and returned on free, so RSS
                        tracks the tensors alive at the peak.

    python benchmarks/bench_loss.py                     # default sweep, D=512 K=8, V∈{8192,32768}, N∈{2048,4096,8192}
    python benchmarks/bench_loss.py --quick             # tiny shapes, a few seconds
    python benchmarks/bench_loss.py --N 4096 --V 32768 --impls trl ours --json /tmp/out.json
    python benchmarks/bench_loss.py --allocator glibc-default   # one allocator setting only
    python benchmarks/bench_loss.py --cold              # also a single call per fresh process, no warm-up at all

Dense-teacher mode (``--dense``): a generalized JSD against a local teacher's full distribution, from both models'
hidden states and lm_heads (student and teacher hidden size D, teacher logits under no_grad), mean over positions:
  gkd      TRL GKDTrainer's ``generalized_jsd_loss`` on materialised (N, V) logits of both heads;
  distill  TRL DistillationTrainer's ``_chunked_divergence_loss`` (``trl.kernels.chunked_divergence``);
  liger    Liger's ``LigerFusedLinearJSDLoss`` (weight_hard_loss=0, weight_soft_loss=1; its β is TRL's β;
           ``compiled=False``: torch.compile of its chunk step is not part of the CPU comparison);
  ours     ``fastdistill.loss.dense.dense_teacher_jsd_loss(..., backend="torch")``, divided by N;
  ours-topk  for scale, what the trainer runs for a top-K teacher instead: ``sparse_jsd_loss(..., backend="torch")``
           on the teacher's top-``--K`` log-probs (precomputed with the inputs, as a server sends them), divided by N
           (another loss: left out of the loss agreement).

    python benchmarks/bench_loss.py --dense --beta 0.5 --N 1024 2048 --V 32768 --D 512
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

IMPLS = ("dense", "trl", "ours")
DENSE_IMPLS = ("gkd", "distill", "liger", "ours-topk", "ours")
NOT_THE_DENSE_LOSS = ("ours-topk",)
LIGER_CHUNK_SIZE = 1024  # LigerFusedLinearJSDLoss's default
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_loss.json"
TRL_CHUNK_SIZE = 256  # TRL's _CHUNKED_LM_HEAD_CHUNK_SIZE
MiB = 2**20
# Environment of the workers per allocator setting (on top of the parent's, minus any glibc malloc settings).
ALLOCATORS = {
    "glibc-default": {},
    "mmap-threshold-1MiB": {"MALLOC_MMAP_THRESHOLD_": str(MiB)},  # large blocks mmap'd, returned to the OS on free
}


# ----------------------------------------------------------------------------------------------------- worker side
def make_inputs(N: int, D: int, V: int, K: int, seed: int, device):
    """Seeded inputs: hidden (N, D), lm_head (V, D), K+1 distinct candidate ids per row (a few padded with -1),
    teacher log-probs whose probabilities sum to < 1 (the rest is the teacher's tail), and the slot mask."""
    import torch

    g = torch.Generator().manual_seed(seed)
    S = K + 1
    weight = torch.randn(V, D, generator=g).div_(math.sqrt(D))  # in place: no transient second copy
    hidden = torch.randn(N, D, generator=g)
    ids = torch.randint(0, V, (N, S), generator=g)
    while True:  # redraw rows with a repeated id until every row holds S distinct ids
        srt = ids.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
        if not bool(dup.any()):
            break
        ids[dup] = torch.randint(0, V, (int(dup.sum()), S), generator=g)
    lps = torch.log_softmax(2.0 * torch.randn(N, S + 1, generator=g), dim=1)[:, :S].contiguous()  # last = tail
    pad = torch.rand(N, S, generator=g) < 0.05
    pad[:, 0] = False  # every row keeps at least one candidate
    ids[pad] = -1
    mask = ids != -1
    hidden, weight = hidden.to(device).requires_grad_(True), weight.to(device).requires_grad_(True)
    return hidden, weight, ids.to(device), lps.to(device), mask.to(device)


def dense_loss(hidden, weight, ids, lps, mask):
    """Naive autograd baseline: full log-softmax, gather the slots, TRL-style clamped tail, forward KL, sum."""
    import torch

    def with_tail(logp):
        log_sum = torch.logsumexp(logp, dim=1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([logp, torch.log(-torch.expm1(log_sum))], dim=1)

    neg_inf = float("-inf")
    logp = torch.log_softmax(hidden.float() @ weight.float().t(), dim=-1)
    s = with_tail(torch.where(mask, logp.gather(1, ids.clamp_min(0)), neg_inf))
    t = with_tail(torch.where(mask, lps, neg_inf))
    support = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    s, t = torch.where(support, s, 0.0), torch.where(support, t, 0.0)
    q = torch.where(support, t.exp(), 0.0)
    return (q * (t - s)).sum()


def loss_fn(impl: str, tail_mode: str):
    """The loss callable ``f(hidden, weight, ids, lps, mask) -> 0-dim loss`` of one implementation."""
    if impl == "dense":
        return dense_loss
    if impl == "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.async_distillation.async_distillation_trainer import _chunked_jsd_loss

        return lambda h, w, ids, lps, mask: _chunked_jsd_loss(
            h, w, None, 1.0, None, ids, lps, mask, 0.0, 1.0, True, None, 1, TRL_CHUNK_SIZE
        )[0]
    from fastdistill import sparse_jsd_loss

    return lambda h, w, ids, lps, mask: sparse_jsd_loss(
        h, w, ids, lps, mask, beta=0.0, tail_mode=tail_mode, backend="torch"
    ).loss


def make_dense_inputs(N: int, D: int, V: int, K: int, seed: int, device):
    """Seeded dense-teacher inputs: student hidden (N, D) and lm_head (V, D) (leaves), teacher hidden (N, D) and
    lm_head (V, D) (constants), the teacher's logits sharper than the student's; and, for ``ours-topk``, the
    teacher's top-K ids and log-probs (N, K) (computed here, in 256-row chunks, before any measurement)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ws = torch.randn(V, D, generator=g).div_(math.sqrt(D))
    hs = torch.randn(N, D, generator=g)
    wt = torch.randn(V, D, generator=g).mul_(2.0 / math.sqrt(D))
    ht = torch.randn(N, D, generator=g)
    k = min(K, V)
    ids, lps = torch.empty(N, k, dtype=torch.long), torch.empty(N, k)
    with torch.no_grad():
        for r in range(0, N, 256):
            top = torch.log_softmax(ht[r:r + 256] @ wt.t(), dim=1).topk(k, dim=1)
            ids[r:r + 256], lps[r:r + 256] = top.indices, top.values
    return (hs.to(device).requires_grad_(True), ws.to(device).requires_grad_(True), ht.to(device), wt.to(device),
            ids.to(device), lps.to(device))


def dense_teacher_loss_fn(impl: str, beta: float):
    """The loss callable ``f(hs, ws, ht, wt, ids, lps) -> 0-dim mean divergence over the N positions`` of one
    dense-teacher implementation (``ids``, ``lps``: the teacher's top-K, read by ``ours-topk`` only)."""
    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if impl == "gkd":
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        def gkd(hs, ws, ht, wt, *_):
            with torch.no_grad():
                teacher_logits = ht @ wt.t()
            return GKDTrainer.generalized_jsd_loss(hs @ ws.t(), teacher_logits, beta=beta)  # batchmean: / N

        return gkd
    if impl == "distill":
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        def distill(hs, ws, ht, wt, *_):
            mask = torch.ones(1, hs.shape[0], dtype=torch.long, device=hs.device)
            return _chunked_divergence_loss(hs[None], ht[None], ws, wt, mask, beta)[0]

        return distill
    if impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        module = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, compiled=False,
                                         chunk_size=LIGER_CHUNK_SIZE)
        return lambda hs, ws, ht, wt, *_: module(hs, ws, ht, wt, torch.zeros(hs.shape[0], dtype=torch.long,
                                                                            device=hs.device))
    if impl == "ours-topk":
        from fastdistill import sparse_jsd_loss

        def topk(hs, ws, ht, wt, ids, lps):
            valid = torch.ones_like(ids, dtype=torch.bool)
            return sparse_jsd_loss(hs, ws, ids, lps, valid, beta=beta, backend="torch").loss / hs.shape[0]

        return topk
    from fastdistill.loss.dense import dense_teacher_jsd_loss

    return lambda hs, ws, ht, wt, *_: dense_teacher_jsd_loss(hs, ws, ht, wt, beta=beta,
                                                             backend="torch").loss / hs.shape[0]


def rss_kib() -> int:
    """Current resident set size of this process (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0), so ``ru_maxrss`` restarts from the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_worker(args: argparse.Namespace) -> dict:
    """Measure one implementation on one config in this (fresh) process; returns the raw measurement."""
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    N, V = args.N[0], args.V[0]
    rec = {"impl": args.worker, "N": N, "D": args.D, "V": V, "K": args.K, "device": str(device), "cold": args.cold}
    try:
        fn = dense_teacher_loss_fn(args.worker, args.beta) if args.dense else loss_fn(args.worker, args.tail_mode)
    except ImportError as e:
        return {**rec, "status": "missing", "error": repr(e)}
    if device.type == "cuda":
        rec["device_name"] = torch.cuda.get_device_name(device)
    # One tiny fwd+bwd first: one-time process setup (thread pools, autograd engine, BLAS workspaces) is not
    # part of the loss's memory, so it happens before the baseline. A cold run skips it (and any warm-up): it
    # measures a single call in a fresh process, one-time setup included.
    def inputs(n, d, v):
        return make_dense_inputs(n, d, v, args.K, args.seed, device) if args.dense else make_inputs(n, d, v, args.K,
                                                                                            args.seed, device)

    if not args.cold:
        fn(*inputs(4, args.D, 4 * (args.K + 1))).backward()
    batch = inputs(N, args.D, V)
    h, w = batch[:2]

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        rec["rss_peak_reset"] = reset_rss_peak()
        base = rss_kib() * 1024  # ru_maxrss never goes down: the baseline is taken right after the inputs
    times = []
    for i in range(args.warmup + args.repeats):
        h.grad = w.grad = None  # every repeat allocates its gradients afresh
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = fn(*batch)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        rec["loss"] = loss.item()
        del loss
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_mb = (peak - base) / MiB
    grads_mb = (N * args.D + V * args.D) * 4 / MiB  # dh and dW: the only memory that must grow with N (and V)
    return {**rec, "status": "ok", "times_s": times, "median_s": statistics.median(times), "min_s": min(times),
            "baseline_mb": base / MiB, "peak_mb": peak_mb, "extra_over_grads_mb": peak_mb - grads_mb}


# ----------------------------------------------------------------------------------------------------- parent side
def worker_env(allocator: str) -> dict[str, str]:
    """The parent's environment without glibc malloc settings, plus those of ``allocator`` (see ALLOCATORS)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return {**env, **ALLOCATORS[allocator]}


def measure(impl: str, N: int, V: int, args: argparse.Namespace, allocator: str = "glibc-default",
            cold: bool = False) -> dict:
    """Run one measurement in a fresh subprocess under ``allocator`` (or skip dense when it would not fit
    ``--dense-max-gb``); ``cold``: one call, no warm-up of any kind (one-time process setup included)."""
    rec = {"impl": impl, "N": N, "D": args.D, "V": V, "K": args.K, "allocator": allocator}
    if impl in ("dense", "gkd") and 4 * N * V * 4 > args.dense_max_gb * 2**30:
        return {**rec, "status": "skipped", "error": f"~4 N×V fp32 tiles exceed --dense-max-gb {args.dense_max_gb}"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--N", str(N), "--V", str(V),
           "--D", str(args.D), "--K", str(args.K), "--threads", str(args.threads), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--seed", str(args.seed), "--device", args.device,
           "--tail-mode", args.tail_mode, "--beta", str(args.beta)] + (["--dense"] if args.dense else [])
    if cold:
        cmd[cmd.index("--repeats") + 1], cmd[cmd.index("--warmup") + 1] = "1", "0"
        cmd.append("--cold")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(allocator))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**rec, "status": "failed", "error": f"rc={proc.returncode}: {proc.stderr[-2000:]}"}
    return {**json.loads(lines[-1]), "allocator": allocator}


def measure_config(N: int, V: int, args: argparse.Namespace, allocators: list[str]) -> dict:
    """Every implementation on one config under every allocator setting (interleaved, so drift hits all alike)."""
    by_alloc: dict[str, dict] = {a: {} for a in allocators}
    cold: dict[str, dict] = {a: {} for a in allocators}
    for impl in args.impls:
        for allocator in allocators:
            for is_cold, into in ((False, by_alloc), (True, cold)) if args.cold else ((False, by_alloc),):
                m = measure(impl, N, V, args, allocator, cold=is_cold)
                if m["status"] not in ("ok", "skipped"):
                    print(f"[{impl} N={N} V={V} {allocator}{' cold' if is_cold else ''}] {m['status']}: "
                          f"{m.get('error', '')}", file=sys.stderr)
                into[allocator][impl] = m
    summary = summarize_dense if args.dense else summarize
    out = {a: {"impls": by_impl, "summary": summary(by_impl)} for a, by_impl in by_alloc.items()}
    if args.cold:
        for a, by_impl in cold.items():
            out[a]["cold"] = {"impls": by_impl, "summary": summary(by_impl)}
    return {"N": N, "D": args.D, "V": V, "K": args.K, "allocators": out}


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    ok = a and b and a.get("status") == "ok" and b.get("status") == "ok" and b[key] > 0
    return a[key] / b[key] if ok else None


def summarize(by_impl: dict[str, dict]) -> dict:
    """Ratios and loss agreement of one config from its per-implementation measurements."""
    ours, trl, dense = by_impl.get("ours"), by_impl.get("trl"), by_impl.get("dense")
    rel = None
    if ours and trl and ours.get("status") == "ok" and trl.get("status") == "ok":
        rel = abs(ours["loss"] - trl["loss"]) / max(abs(trl["loss"]), 1e-30)
    return {"ours_over_trl_time": ratio(ours, trl, "median_s"), "ours_over_trl_mem": ratio(ours, trl, "peak_mb"),
            "ours_over_dense_time": ratio(ours, dense, "median_s"),
            "ours_over_dense_mem": ratio(ours, dense, "peak_mb"), "loss_rel_diff_ours_trl": rel}


def summarize_dense(by_impl: dict[str, dict]) -> dict:
    """Dense-teacher mode: ours over each other implementation (time, peak memory) and the losses' relative
    difference from TRL GKD's (or, when it was skipped, from TRL Distillation's)."""
    ours = by_impl.get("ours")
    out = {}
    for other in [i for i in DENSE_IMPLS if i != "ours"]:
        out[f"ours_over_{other}_time"] = ratio(ours, by_impl.get(other), "median_s")
        out[f"ours_over_{other}_mem"] = ratio(ours, by_impl.get(other), "peak_mb")
    ref = next((by_impl[i] for i in ("gkd", "distill") if by_impl.get(i, {}).get("status") == "ok"), None)
    out["loss_ref"] = None if ref is None else ref["impl"]
    for impl, m in by_impl.items():
        if ref is not None and m.get("status") == "ok" and impl not in NOT_THE_DENSE_LOSS:
            out[f"loss_rel_diff_{impl}"] = abs(m["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    return out


def print_dense_tables(rows: list[dict], impls: list[str], allocator: str) -> None:
    """Dense-teacher mode: time and peak memory of each implementation, ours' ratios, loss agreement."""
    print(f"\n== dense teacher, allocator: {allocator} {ALLOCATORS[allocator] or '(glibc defaults)'}")
    rows = [{**r, **r["allocators"][allocator]} for r in rows if allocator in r["allocators"]]
    others = [i for i in impls if i != "ours"]
    print(f"{'N':>6} {'D':>5} {'V':>6} " + " ".join(f"{i + ' s':>10} {i + ' MB':>10}" for i in impls)
          + " " + " ".join(f"{'o/' + i + ' t':>10} {'o/' + i + ' mem':>11}" for i in others) + "  max relΔloss")
    for r in rows:
        s = r["summary"]
        line = f"{r['N']:>6} {r['D']:>5} {r['V']:>6} "
        ms = [r["impls"].get(i) for i in impls]
        line += " ".join(f"{cell(m, 'median_s', '.3f'):>10} {cell(m, 'peak_mb', '.1f'):>10}" for m in ms)
        line += " " + " ".join(f"{fmt(s.get(f'ours_over_{i}_time'), '.3f'):>10} "
                               f"{fmt(s.get(f'ours_over_{i}_mem'), '.3f'):>11}" for i in others)
        diffs = [v for k, v in s.items() if k.startswith("loss_rel_diff_")]
        print(line + f"  {fmt(max(diffs) if diffs else None, '.1e')}")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def cell(m: dict | None, key: str, spec: str) -> str:
    if m is None:
        return "-"
    return format(m[key], spec) if m["status"] == "ok" else m["status"][:4]


def print_tables(rows: list[dict], impls: list[str], allocator: str) -> None:
    """Timing/memory table, then the memory-flatness table (peak increase minus the dh + dW buffers), of the
    measurements under one allocator setting."""
    print(f"\n== allocator: {allocator} {ALLOCATORS[allocator] or '(glibc defaults)'}")
    rows = [{**r, **r["allocators"][allocator]} for r in rows if allocator in r["allocators"]]
    head = f"{'N':>6} {'D':>5} {'V':>6} {'K':>3} " + " ".join(f"{i + ' s':>9} {i + ' MB':>9}" for i in impls)
    print(head + f" {'o/trl t':>8} {'o/trl mem':>9} {'o/dns t':>8} {'o/dns mem':>9} {'relΔloss':>9}")
    for r in rows:
        line = f"{r['N']:>6} {r['D']:>5} {r['V']:>6} {r['K']:>3} "
        ms = [r["impls"].get(i) for i in impls]
        line += " ".join(f"{cell(m, 'median_s', '.3f'):>9} {cell(m, 'peak_mb', '.1f'):>9}" for m in ms)
        s = r["summary"]
        print(line + f" {fmt(s['ours_over_trl_time'], '.3f'):>8} {fmt(s['ours_over_trl_mem'], '.3f'):>9}"
              f" {fmt(s['ours_over_dense_time'], '.3f'):>8} {fmt(s['ours_over_dense_mem'], '.3f'):>9}"
              f" {fmt(s['loss_rel_diff_ours_trl'], '.1e'):>9}")
    cold = [r for r in rows if "cold" in r]
    if cold:
        print("Cold: a single call in a fresh process, no warm-up (one-time process setup included)")
        print(f"{'N':>6} {'V':>6} " + " ".join(f"{i + ' s':>9} {i + ' MB':>9}" for i in impls) + f" {'o/trl mem':>9}")
        for r in cold:
            ms = [r["cold"]["impls"].get(i) for i in impls]
            print(f"{r['N']:>6} {r['V']:>6} "
                  + " ".join(f"{cell(m, 'median_s', '.3f'):>9} {cell(m, 'peak_mb', '.1f'):>9}" for m in ms)
                  + f" {fmt(r['cold']['summary']['ours_over_trl_mem'], '.3f'):>9}")
    print("Memory flatness: extra_over_grads_MB = peak increase - (N·D + V·D)·4 B (dh, dW); flat in N = O(1) extra")
    print(f"{'N':>6} {'D':>5} {'V':>6} {'K':>3} " + " ".join(f"{i + ' extra MB':>15}" for i in impls))
    for r in rows:
        print(f"{r['N']:>6} {r['D']:>5} {r['V']:>6} {r['K']:>3} "
              + " ".join(f"{cell(r['impls'].get(i), 'extra_over_grads_mb', '.1f'):>15}" for i in impls))


def machine_info(args: argparse.Namespace, device: str | None) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = None
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "threads": args.threads, "device": device,
            "python": sys.version.split()[0], "torch": version("torch"), "trl": version("trl"),
            "fastdistill": version("fastdistill"), "date": datetime.now(UTC).isoformat(timespec="seconds")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--N", type=int, nargs="+", help="positions (default 2048 4096 8192; quick: 64 128)")
    p.add_argument("--V", type=int, nargs="+", help="vocabulary sizes (default 8192 32768; quick: 512)")
    p.add_argument("--D", type=int, help="hidden size (default 512; quick: 32)")
    p.add_argument("--K", type=int, default=8, help="teacher top-K; each row has K+1 candidate slots")
    p.add_argument("--impls", nargs="+", choices=sorted(set(IMPLS) | set(DENSE_IMPLS)),
                   help=f"default: {' '.join(IMPLS)}; with --dense: {' '.join(DENSE_IMPLS)}")
    p.add_argument("--dense", action="store_true", help="dense-teacher mode (see above): TRL GKD, TRL "
                   "Distillation, Liger and fastdistill's dense_teacher_jsd_loss")
    p.add_argument("--beta", type=float, default=0.5, help="dense-teacher mode: the divergence's beta")
    p.add_argument("--quick", action="store_true", help="tiny shapes that finish in seconds")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each worker")
    p.add_argument("--repeats", type=int, default=3, help="timed fwd+bwd runs (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed fwd+bwd runs first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--tail-mode", choices=("exact", "trl"), default="exact", help="fastdistill's student tail")
    p.add_argument("--dense-max-gb", type=float, default=6.0, help="skip dense when 4·N·V·4 B exceeds this")
    p.add_argument("--allocator", choices=("both", *ALLOCATORS), default="both",
                   help="glibc malloc setting(s) of the workers (default: both, each in its own fresh process)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the raw results")
    p.add_argument("--cold", action="store_true", help="also measure one call in a fresh process without any "
                   "warm-up (one-time process setup included; the parent adds these rows)")
    p.add_argument("--worker", choices=sorted(set(IMPLS) | set(DENSE_IMPLS)), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    valid = DENSE_IMPLS if args.dense else IMPLS
    args.impls = args.impls or list(valid)
    bad = [i for i in args.impls if i not in valid]
    if bad:
        p.error(f"--impls {' '.join(bad)}: not an implementation of this mode (choose from {' '.join(valid)})")
    args.N = args.N or ([64, 128] if args.quick else [2048, 4096, 8192])
    args.V = args.V or ([512] if args.quick else [8192, 32768])
    args.D = args.D or (32 if args.quick else 512)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return
    allocators = list(ALLOCATORS) if args.allocator == "both" else [args.allocator]
    rows = [measure_config(N, V, args, allocators) for V in args.V for N in args.N]
    for allocator in allocators:
        (print_dense_tables if args.dense else print_tables)(rows, args.impls, allocator)
    device = next((m["device"] for r in rows for a in r["allocators"].values() for m in a["impls"].values()
                   if "device" in m), None)
    result = {"machine": machine_info(args, device),
              "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
              "worker_env": {a: ALLOCATORS[a] for a in allocators}, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
