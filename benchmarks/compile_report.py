"""What the fused-loss Triton kernels compile to on NVIDIA GPUs, measured on any machine (no GPU needed).

Every kernel variant the dispatcher (``fastdistill_kernels.fused_sparse_jsd``) can launch is recorded by running
the real entry point, forward and backward, on ``meta`` tensors with the two ``@triton.jit`` kernels swapped for
recorders. Each recorded launch is specialised exactly as ``JITFunction.run`` would on a GPU (Triton's launch
binder ``create_function_from_signature`` + ``JITFunction._pack_args``: pointer dtypes, 16-divisible integers,
constexprs, launch options), then compiled with ``triton.compiler.compile(ASTSource(...), target=GPUTarget(...))``
for sm_80 (A100) and sm_90 (H100/H200). Read out of each compiled kernel: shared memory (``metadata.shared`` plus
the cubin's static shared memory), registers and spills (ptxas's ``-v`` log of that very compile), and from the
SASS (``nvdisasm``, with source lines) tensor-core, spill, atomic and fence instructions.

Needs triton's NVIDIA backend with its bundled ``ptxas`` / ``nvdisasm`` / ``cuobjdump``; must run without
``TRITON_INTERPRET=1`` (the interpreter replaces ``@triton.jit`` functions). Nothing is cached between runs.

    python benchmarks/compile_report.py                                   # every variant, Qwen-like + small shape
    python benchmarks/compile_report.py --set test --shapes qwen          # what tests/test_kernel_compile.py compiles
    python benchmarks/compile_report.py --json out.json --results benchmarks/RESULTS.md
    python benchmarks/compile_report.py --chunked --targets sm90      # the chunked designs' row kernels
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION_START = "<!-- compile-report:start -->"
SECTION_END = "<!-- compile-report:end -->"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp32-tf32": torch.float32}
MODES = ("deterministic", "fused")
FILTER_EPS = 2.0**-12
RESERVED_SMEM_PER_BLOCK = 1024  # the driver reserves 1 KiB of shared memory per block on sm_80 and later
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256


@dataclass(frozen=True)
class Target:
    """An NVIDIA compile target and the per-device numbers the launch and the occupancy depend on.

    ``smem_per_block`` is CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (CUDA's compute-capability table:
    163 KiB on 8.0, 227 KiB on 9.0; torch's inductor keys A100/H100 on the same 166912 / 232448), the ceiling of
    ``dynamic + static`` shared memory per block. ``sm_count`` feeds ``config.vocab_splits`` as
    ``multi_processor_count`` would (A100 108, H100 SXM / H200 132).
    """

    name: str
    arch: int
    sm_count: int
    smem_per_block: int
    smem_per_sm: int
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32


TARGETS = {
    "sm80": Target("sm80", 80, sm_count=108, smem_per_block=166912, smem_per_sm=167936),
    "sm90": Target("sm90", 90, sm_count=132, smem_per_block=232448, smem_per_sm=233472),
}
TARGETS_ENV = "FASTDISTILL_COMPILE_TARGETS"


def selected_targets() -> tuple[str, ...]:
    """The targets the compile tests check: ``$FASTDISTILL_COMPILE_TARGETS`` (comma-separated names of
    :data:`TARGETS`), default all. ValueError naming an unknown one."""
    names = tuple(n.strip() for n in os.environ.get(TARGETS_ENV, "").split(",") if n.strip()) or tuple(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"${TARGETS_ENV} names unknown targets {unknown}; known: {list(TARGETS)}")
    return names


@dataclass(frozen=True)
class Shape:
    """Problem size: N rows of hidden states (D wide), a V-word vocabulary, S candidate slots per row."""

    name: str
    n: int
    d: int
    v: int
    s: int


SHAPES = {
    "qwen": Shape("qwen", n=16384, d=3584, v=152064, s=65),  # Qwen2.5-7B lm_head, K = 64 (+ the realised token)
    "small": Shape("small", n=1000, d=200, v=5000, s=9),  # no size divisible by 16: the other specialisation
}


@dataclass(frozen=True)
class Variant:
    """One dispatcher call: input dtype (``fp32-tf32`` = fp32 under ``torch.set_float32_matmul_precision("high")``),
    bias, softcap, backward mode, gradient filter, and whether the lm_head weight is trained (False: frozen, as
    with LoRA, so the backward skips dW)."""

    dtype: str
    bias: bool = False
    softcap: bool = False
    mode: str = "deterministic"
    filter: bool = False
    train_weight: bool = True

    @property
    def name(self) -> str:
        """Short label, e.g. ``bf16+bias+softcap/fused+filter``."""
        feats = "".join(f"+{f}" for f, on in (("bias", self.bias), ("softcap", self.softcap)) if on)
        tail = ("+filter" if self.filter else "") + ("" if self.train_weight else "+frozenW")
        return f"{self.dtype}{feats}/{self.mode}{tail}"

    @property
    def main(self) -> bool:
        """The plain variant of its dtype and mode (no bias, softcap or filter; weight trained)."""
        return not (self.bias or self.softcap or self.filter) and self.train_weight


def variant_set(name: str) -> list[Variant]:
    """``all``: every dtype × bias × softcap × mode × filter, plus the frozen-weight bf16 calls. ``test``: what CI
    compiles — every dtype/mode/filter plain, and bias+softcap with bf16 (each axis value on every kernel)."""
    if name == "all":
        out = [Variant(dt, b, c, m, f) for dt in DTYPES for b in (False, True) for c in (False, True)
               for m in MODES for f in (False, True)]
        return out + [Variant("bf16", mode=m, filter=f, train_weight=False) for m in MODES for f in (False, True)]
    if name == "test":
        out = [Variant(dt, mode=m) for dt in ("bf16", "fp16", "fp32") for m in MODES]
        out += [Variant("bf16", mode=m, filter=True) for m in MODES]
        out += [Variant("bf16", bias=True, softcap=True, mode=m) for m in MODES]
        return out + [Variant("fp32-tf32", mode="fused")]
    raise ValueError(f"unknown variant set {name!r}")


# ----------------------------------------------------------------------------------------------------- toolchain


def toolchain_problem() -> str | None:
    """Why this machine cannot AOT-compile for NVIDIA targets, or None when it can."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 replaces @triton.jit kernels with the interpreter; run without it"
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except Exception as exc:  # noqa: BLE001 - any import failure means no compiler
        return f"triton is not importable: {exc!r}"
    if "nvidia" not in backends:
        return "triton has no NVIDIA backend"
    for tool in ("ptxas", "ptxas_blackwell", "nvdisasm", "cuobjdump"):
        problem = _tool_problem(tool)
        if problem:
            return problem
    return None


def _tool_problem(name: str) -> str | None:
    from triton import knobs

    try:
        tool = getattr(knobs.nvidia, name)
        subprocess.run([tool.path, "--version"], check=True, capture_output=True, timeout=60)
    except Exception as exc:  # noqa: BLE001 - missing binary, wrong platform, ...
        return f"triton's bundled {name} is unusable here: {exc!r}"
    return None


def tool_versions() -> dict[str, str]:
    """Versions of triton, torch and the bundled NVIDIA tools (last line of ``--version``)."""
    import triton
    from triton import knobs

    out = {"triton": triton.__version__, "torch": torch.__version__}
    for name in ("ptxas", "ptxas_blackwell", "nvdisasm"):
        text = subprocess.run([getattr(knobs.nvidia, name).path, "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release ([\d.]+), V([\d.]+)", text)
        out[name] = release.group(2) if release else text.strip().splitlines()[-1]
    return out


# ------------------------------------------------------------------------------------------------ launch capture


@dataclass
class Launch:
    """One kernel launch as ``JITFunction.run`` would specialise it on the target.

    Attributes:
        kernel: the JIT function's name. fn: the JITFunction. grid: launch grid.
        key: Triton's own kernel-cache key (specialisation + options): equal keys share one compiled kernel.
        signature, constexprs, attrs, options: the ``ASTSource`` arguments and compile options.
    """

    kernel: str
    fn: Any
    grid: tuple
    key: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict


class _LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records a :class:`Launch`."""

    def __init__(self, fn, backend, sink: list[Launch]):
        self.fn, self.backend, self.sink = fn, backend, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(bind_launch(self.fn, self.backend, tuple(grid), args, kwargs))

        return launch


# Compilation knobs ``JITFunction.run`` passes to the binder as launch options, each where this triton has it
# (``fpsan_homomorphic_casts`` came after 3.6): a knob the release lacks is no option of its kernels either.
RUN_COMPILATION_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")


def run_options(fn, kwargs: dict) -> dict:
    """``kwargs`` plus the options ``JITFunction.run`` adds before binding, as the installed triton adds them."""
    from triton import knobs

    out = dict(kwargs)
    out["debug"] = out.get("debug", fn.debug) or knobs.runtime.debug
    for name in RUN_COMPILATION_KNOBS:
        if hasattr(knobs.compilation, name):
            out[name] = getattr(knobs.compilation, name)
    return out


def bind_launch(fn, backend, grid: tuple, args: tuple, kwargs: dict) -> Launch:
    """Specialise ``fn[grid](*args, **kwargs)`` for ``backend``'s target as ``JITFunction.run`` does (triton 3.6
    to 3.9)."""
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    kwargs = run_options(fn, kwargs)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return Launch(kernel=fn.__name__, fn=fn, grid=grid, key=key, signature=signature, constexprs=constexprs,
                  attrs=attrs, options=dict(options.__dict__))


def record_launches(variant: Variant, shape: Shape, target: Target) -> list[Launch]:
    """Run ``fused_sparse_jsd`` forward and backward for ``variant`` at ``shape`` on meta tensors as on a CUDA device
    of ``target`` (its default tiles and vocabulary splits), and return the kernel launches it makes."""
    import fastdistill_kernels.backward as bwd
    import fastdistill_kernels.config as cfg
    import fastdistill_kernels.forward as fwd
    import fastdistill_kernels.ops as ops
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    launches: list[Launch] = []
    cuda = torch.device("cuda")
    props = SimpleNamespace(multi_processor_count=target.sm_count)
    precision = "high" if variant.dtype == "fp32-tf32" else "highest"
    old_precision = torch.get_float32_matmul_precision()
    patches = (
        mock.patch.object(fwd, "_forward_kernel", _LaunchRecorder(fwd._forward_kernel, backend, launches)),
        mock.patch.object(bwd, "_backward_kernel", _LaunchRecorder(bwd._backward_kernel, backend, launches)),
        mock.patch.object(ops, "default_config", lambda device, *a: cfg.default_config(cuda, *a)),
        mock.patch.object(fwd, "vocab_splits", lambda c, rb, vt, device: cfg.vocab_splits(c, rb, vt, cuda)),
        mock.patch("torch.cuda.get_device_properties", lambda device=None: props),
    )
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        torch.set_float32_matmul_precision(precision)
        try:
            _run_meta_call(ops.fused_sparse_jsd, variant, shape)
        finally:
            torch.set_float32_matmul_precision(old_precision)
    return launches


def _run_meta_call(fused_sparse_jsd, variant: Variant, shape: Shape) -> None:
    """One forward + backward through the dispatcher on meta tensors (the kernels are recorders by now)."""
    dtype, meta = DTYPES[variant.dtype], torch.device("meta")
    hidden = torch.empty(shape.n, shape.d, dtype=dtype, device=meta, requires_grad=True)
    weight = torch.empty(shape.v, shape.d, dtype=dtype, device=meta, requires_grad=variant.train_weight)
    bias = torch.empty(shape.v, dtype=dtype, device=meta, requires_grad=True) if variant.bias else None
    ids = torch.empty(shape.n, shape.s, dtype=torch.long, device=meta)
    lps = torch.empty(shape.n, shape.s, dtype=torch.float32, device=meta)
    valid = torch.empty(shape.n, shape.s, dtype=torch.bool, device=meta)
    out = fused_sparse_jsd(hidden, weight, ids, lps, valid, bias=bias, softcap=30.0 if variant.softcap else None,
                           beta=0.5, backward_mode=variant.mode, filter_eps=FILTER_EPS if variant.filter else None)
    out.divergence.sum().backward()


DENSE_SHAPE = Shape("qwen-dense", n=16384, d=3584, v=152064, s=0)  # student V_s; the teacher's V_t adds DENSE_PAD
DENSE_PAD = 64  # a padded teacher vocabulary (V_t = V_s + 64) also compiles the dropped-mass loop
DENSE_MODES = {"fwd-kl": 0.0, "jsd": 0.5, "rev-kl": 1.0}


def record_dense_launches(dtype: str, target: Target, shape: Shape = DENSE_SHAPE) -> list[Launch]:
    """The launches one row chunk of ``chunked_dense_teacher_jsd`` makes with ``dtype`` operands (the statistics
    pass, then the gradient pass per β mode), as ``dense_chunked_rows`` makes them: fp32 raw-logits buffers, dL/dx in
    the operand dtype over the student's (``gradient_view``); bias and softcap on both sides, padded teacher
    vocabulary, gradient and token weights on; on meta tensors as on a CUDA device."""
    import fastdistill_kernels.dense_chunk as dc
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    launches: list[Launch] = []
    dt, meta = DTYPES[dtype], torch.device("meta")
    v, vt = shape.v, shape.v + DENSE_PAD
    c = dc.dense_chunk_rows_for(shape.n, v, vt)
    xs = torch.empty(c, v, dtype=dc.BUFFER_DTYPE, device=meta)
    xt = torch.empty(c, vt, dtype=dc.BUFFER_DTYPE, device=meta)
    bs, bt = torch.empty(v, dtype=dt, device=meta), torch.empty(vt, dtype=dt, device=meta)
    rows = torch.empty(c, dtype=torch.float32, device=meta)
    heads = dc.DenseHeads(1.0, 30.0, 1.0, 30.0, 1.0)
    patches = (
        mock.patch.object(dc, "_dense_stats_kernel", _LaunchRecorder(dc._dense_stats_kernel, backend, launches)),
        mock.patch.object(dc, "_dense_grad_out_kernel", _LaunchRecorder(dc._dense_grad_out_kernel, backend,
                                                                        launches)),
    )
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        dc.launch_dense_stats(xs, xt, bs, bt, heads)
        for beta in DENSE_MODES.values():
            dc.launch_dense_grad_out(xs, xt, dc.gradient_view(xs, dt), bs, bt, rows, rows, rows, heads, beta)
    return launches


def record_chunk_launches(dtype: str, target: Target, shape: Shape = SHAPES["qwen"]) -> list[tuple[str, Launch]]:
    """The launches one row chunk of ``chunked_logits_sparse_jsd`` makes with ``dtype`` operands, as
    ``chunked_logits_rows`` makes them: ``_chunk_stats_kernel`` over the fp32 raw-logits buffer of the default chunk
    (``chunk_rows_for``), then ``_chunk_grad_out_kernel`` writing dL/dx in the operand dtype over it
    (``gradient_view``); ``(features, launch)`` for "plain" and "bias+softcap", on meta tensors as on a CUDA device."""
    import fastdistill_kernels.logits_chunk as lc
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    dt, meta = DTYPES[dtype], torch.device("meta")
    c, v, s = lc.chunk_rows_for(shape.n, shape.v), shape.v, shape.s

    def f32(*size):
        return torch.empty(*size, dtype=torch.float32, device=meta)

    out = []
    for features in ("plain", "bias+softcap"):
        launches: list[Launch] = []
        bias = torch.empty(v, dtype=dt, device=meta) if features != "plain" else None
        ids = torch.empty(c, s, dtype=torch.int32, device=meta)
        kw = dict(logit_scale=1.0, softcap=None if features == "plain" else 30.0, temperature=1.0)
        x = torch.empty(c, v, dtype=lc.BUFFER_DTYPE, device=meta)
        with mock.patch.object(lc, "_chunk_stats_kernel", _LaunchRecorder(lc._chunk_stats_kernel, backend, launches)), \
                mock.patch.object(lc, "_chunk_grad_out_kernel",
                                  _LaunchRecorder(lc._chunk_grad_out_kernel, backend, launches)):
            lc.launch_chunk_stats(x, bias, ids, **kw)
            lc.launch_chunk_grad_out(x, lc.gradient_view(x, dt), bias, ids, f32(c, s), f32(c), f32(c), f32(c, s), **kw)
        out += [(features, launch) for launch in launches]
    return out


def record_scale_launch(dtype: str, target: Target, shape: Shape = SHAPES["qwen"]) -> Launch:
    """The launch with which both chunked designs' backward scales a gradient they computed in the forward by the
    upstream gradient, on the device (``logits_chunk.scale_in_place``): here dW, (V, D) in ``dtype``, on meta
    tensors as on a CUDA device."""
    import fastdistill_kernels.logits_chunk as lc
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    meta, launches = torch.device("meta"), []
    with mock.patch.object(lc, "_scale_in_place", _LaunchRecorder(lc._scale_in_place, backend, launches)):
        lc.scale_in_place(torch.empty(shape.v, shape.d, dtype=DTYPES[dtype], device=meta),
                          torch.empty((), dtype=torch.float32, device=meta))
    (launch,) = launches
    return launch


def record_dense_fused_launches(dtype: str, target: Target, shape: Shape = DENSE_SHAPE) -> list[tuple[str, Launch]]:
    """The launches of ``fused_dense_teacher_jsd`` forward + backward (bias and softcap on both sides, padded
    teacher vocabulary, student hidden and weight trained) for each β mode and backward mode, on meta tensors as on
    a CUDA device of ``target`` (its default tiles and vocabulary splits); one ``(label, launch)`` per distinct
    compiled kernel (the forward is the same for every β)."""
    import fastdistill_kernels.config as cfg
    import fastdistill_kernels.dense_fused as df
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    dt, meta, cuda = DTYPES[dtype], torch.device("meta"), torch.device("cuda")
    v, vt = shape.v, shape.v + DENSE_PAD
    props = SimpleNamespace(multi_processor_count=target.sm_count)
    capability = (target.arch // 10, target.arch % 10)
    out: dict[str, tuple[str, Launch]] = {}
    for mode_name, beta in DENSE_MODES.items():
        for bwd in MODES:
            launches: list[Launch] = []
            patches = [mock.patch.object(df, name, _LaunchRecorder(getattr(df, name), backend, launches))
                       for name in ("_dense_forward_kernel", "_dense_mixed_kernel", "_dense_backward_kernel")]
            patches += [
                mock.patch.object(df, "dense_default_config", lambda device, *a: cfg.dense_default_config(cuda, *a)),
                mock.patch("torch.cuda.get_device_capability", lambda device=None: capability),
                mock.patch.object(df, "vocab_splits", lambda c, rb, t, device: cfg.vocab_splits(c, rb, t, cuda)),
                mock.patch("torch.cuda.get_device_properties", lambda device=None: props),
            ]
            with contextlib.ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                hs = torch.empty(shape.n, shape.d, dtype=dt, device=meta, requires_grad=True)
                ws = torch.empty(v, shape.d, dtype=dt, device=meta, requires_grad=True)
                bs = torch.empty(v, dtype=dt, device=meta, requires_grad=True)
                ht = torch.empty(shape.n, shape.d, dtype=dt, device=meta)
                wt, bt = torch.empty(vt, shape.d, dtype=dt, device=meta), torch.empty(vt, dtype=dt, device=meta)
                heads = df.DenseHeads(1.0, 30.0, 1.0, 30.0, 1.0)
                res = df.fused_dense_teacher_jsd(hs, ws, ht, wt, student_bias=bs, teacher_bias=bt, heads=heads,
                                                 beta=beta, backward_mode=bwd)
                res.divergence.sum().backward()
            for launch in launches:
                label = {"_dense_forward_kernel": "forward", "_dense_mixed_kernel": "mixed"}.get(
                    launch.kernel, f"backward-{bwd}/{mode_name}")
                out.setdefault(launch.key + launch.kernel, (label, launch))
    return list(out.values())


def dense_report(dtypes: tuple[str, ...] = ("bf16",), targets: tuple[str, ...] = tuple(TARGETS)) -> list[dict]:
    """Compile the dense-teacher chunked kernels (:func:`record_dense_launches`) for ``targets``: one entry per
    launch with ``dtype``, ``target``, ``kernel``, ``mode`` (β mode of the gradient kernel; "stats" for the first
    kernel), ``smem_per_block`` (the target's limit) and ``metrics`` (:func:`compile_launch`)."""
    sys.path.insert(0, str(ROOT / "kernels"))
    out, jobs = [], []
    for dtype in dtypes:
        for t in targets:
            target = TARGETS[t]
            launches = record_dense_launches(dtype, target)
            modes = ["stats", *DENSE_MODES]
            for launch, mode in zip(launches, modes, strict=True):
                out.append(dict(dtype=dtype, target=t, kernel=launch.kernel, mode=mode,
                                smem_per_block=target.smem_per_block))
                jobs.append((launch, target))
    for entry, metrics in zip(out, compile_launches(jobs), strict=True):
        entry["metrics"] = metrics
    return out


def chunked_report(dtypes: tuple[str, ...] = ("bf16",), targets: tuple[str, ...] = tuple(TARGETS)) -> list[dict]:
    """Compile both chunked designs' row kernels as their entry points launch them (fp32 logits, dL/dx in the
    operand dtype over them): :func:`record_chunk_launches` (design "sparse", mode "plain" / "bias+softcap") and
    :func:`record_dense_launches` (design "dense", mode "stats" or the β mode). One entry per launch, keys as
    :func:`dense_report` plus ``design``."""
    sys.path.insert(0, str(ROOT / "kernels"))
    out, jobs = [], []
    for dtype in dtypes:
        for t in targets:
            target = TARGETS[t]
            labelled = [("sparse", mode, launch) for mode, launch in record_chunk_launches(dtype, target)]
            labelled += [("dense", mode, launch) for mode, launch in
                         zip(["stats", *DENSE_MODES], record_dense_launches(dtype, target), strict=True)]
            labelled.append(("both", "upstream scale (dW)", record_scale_launch(dtype, target)))
            for design, mode, launch in labelled:
                out.append(dict(design=design, dtype=dtype, target=t, kernel=launch.kernel, mode=mode,
                                grid=list(launch.grid), smem_per_block=target.smem_per_block))
                jobs.append((launch, target))
    for entry, metrics in zip(out, compile_launches(jobs), strict=True):
        entry["metrics"] = metrics
    return out


def chunked_markdown(entries: list[dict]) -> str:
    """Markdown table of :func:`chunked_report`: registers, spills, shared memory, wgmma and TMA instructions."""
    lines = ["| design | kernel | mode | target | regs | spill st/ld B | smem (dyn + static) B | wgmma (HGMMA) | "
             "TMA | SASS |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        m = e["metrics"]
        if "error" in m:
            lines.append(f"| {e['design']} | `{e['kernel']}` | {e['mode']} | {e['target']} | **failed** |||||")
            continue
        sass = m["sass"]
        lines.append(f"| {e['design']} | `{e['kernel']}` | {e['mode']} | {e['target']} | {m['registers']} | "
                     f"{m['spill_store_bytes']}/{m['spill_load_bytes']} | {m['shared_bytes']} + "
                     f"{m['static_shared_bytes']} | {sass.get('wgmma', 0)} | "
                     f"{sass.get('tma', 0)} | {sass['instructions']} |")
    return "\n".join(lines)


def dense_fused_report(dtypes: tuple[str, ...] = ("bf16",), targets: tuple[str, ...] = tuple(TARGETS)) -> list[dict]:
    """Compile the fused dense-teacher kernels (:func:`record_dense_fused_launches`) for ``targets``: one entry per
    distinct kernel with ``dtype``, ``target``, ``kernel``, ``mode`` ("forward", "mixed" or
    "backward-<backward mode>/<β mode>"), ``smem_per_block`` and ``metrics`` (:func:`compile_launch`)."""
    sys.path.insert(0, str(ROOT / "kernels"))
    out, jobs = [], []
    for dtype in dtypes:
        for t in targets:
            target = TARGETS[t]
            for label, launch in record_dense_fused_launches(dtype, target):
                out.append(dict(dtype=dtype, target=t, kernel=launch.kernel, mode=label,
                                smem_per_block=target.smem_per_block))
                jobs.append((launch, target))
    for entry, metrics in zip(out, compile_launches(jobs), strict=True):
        entry["metrics"] = metrics
    return out


# ------------------------------------------------------------------------------------------------------ compile


def compile_launch(launch: Launch, target: Target) -> dict:
    """Compile ``launch`` for ``target`` (no cache) and return its metrics; ``{"error": ...}`` if it fails."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        for knob in (knobs.cache, knobs.compilation, knobs.nvidia):
            stack.enter_context(knob.scope())
        cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastdistill-aot-"))
        knobs.cache.dir = cache_dir
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v of this very compile, printed to stdout
        stack.enter_context(contextlib.redirect_stdout(log))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", UserWarning)  # TRITON_DEFAULT_FP_FUSION notice: same default as a launch
        try:
            kernel = compile(src, target=GPUTarget("cuda", target.arch, 32), options=launch.options)
        except Exception as exc:  # noqa: BLE001 - reported per variant, the caller decides
            return {"error": f"{type(exc).__name__}: {exc}"[:4000], "compile_s": time.perf_counter() - start}
        metrics = {"compile_s": round(time.perf_counter() - start, 2)}
        metrics.update(ptxas_stats(log.getvalue()))
        metrics.update(cubin_stats(kernel.asm["cubin"], cache_dir))
    metrics["shared_bytes"] = kernel.metadata.shared
    metrics["num_warps"] = kernel.metadata.num_warps
    metrics["num_stages"] = launch.options["num_stages"]
    metrics["ptx"] = ptx_stats(kernel.asm["ptx"])
    metrics["occupancy"] = occupancy(metrics, target)
    return metrics


_PENDING: list[tuple[Launch, Target]] = []  # what the forked compile workers read (Launch objects do not pickle)


def _compile_pending(index: int) -> dict:
    return compile_launch(*_PENDING[index])


def compile_jobs() -> int:
    """How many kernels compile at once: ``$FASTDISTILL_COMPILE_JOBS``, else one per CPU core."""
    value = os.environ.get("FASTDISTILL_COMPILE_JOBS", "")
    return max(1, int(value)) if value.strip() else max(1, os.cpu_count() or 1)


def compile_launches(jobs: list[tuple[Launch, Target]], on_done=None) -> list[dict]:
    """:func:`compile_launch` of every ``(launch, target)``, :func:`compile_jobs` at a time in forked worker
    processes (each compile is independent: one MLIR pipeline and one ptxas run, both single-threaded). Returns the
    metrics in the order of ``jobs``; ``on_done(index, metrics)`` is called as each finishes. The workers are
    killed when the calling thread ends, however it ends: a forked worker of a killed parent would otherwise wait
    forever on a job queue whose write end it holds itself."""
    import multiprocessing
    import signal
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from fastdistill.supervise import death_signal_setter

    results: list[dict] = [{}] * len(jobs)
    workers = min(compile_jobs(), len(jobs))
    if workers <= 1:
        for index, job in enumerate(jobs):
            results[index] = compile_launch(*job)
            if on_done:
                on_done(index, results[index])
        return results
    _PENDING[:] = jobs
    try:
        # Forked from this thread when the pool starts (all at once under fork), so the death signal follows it.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=death_signal_setter(signal.SIGKILL)) as pool:
            futures = {pool.submit(_compile_pending, index): index for index in range(len(jobs))}
            for future in as_completed(futures):
                index = futures[future]
                results[index] = future.result()
                if on_done:
                    on_done(index, results[index])
    finally:
        _PENDING.clear()
    return results


def ptxas_stats(log: str) -> dict:
    """Registers, stack frame and spill bytes from a ``ptxas -v`` log (zeros when ptxas prints no spill line)."""

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    stack = grab(r"(\d+) bytes stack frame")
    return {"registers": grab(r"Used (\d+) registers"), "stack_frame_bytes": stack,
            "spill_store_bytes": grab(r"(\d+) bytes spill stores"),
            "spill_load_bytes": grab(r"(\d+) bytes spill loads"),
            "n_spills": stack // 4}  # what CompiledKernel.n_spills reports on a GPU: local bytes per thread / 4


def cubin_stats(cubin: bytes, workdir: str) -> dict:
    """Static shared memory (``cuobjdump -res-usage``) and SASS instruction counts (``nvdisasm``, with lines)."""
    from triton import knobs

    path = Path(workdir) / "kernel.cubin"
    path.write_bytes(cubin)
    res = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", str(path)], check=True, capture_output=True,
                         text=True).stdout
    static = re.search(r"SHARED:(\d+)", res)
    sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-g", str(path)], check=True, capture_output=True,
                          text=True).stdout
    return {"static_shared_bytes": int(static.group(1)) if static else 0, "sass": sass_stats(sass)}


SASS_GROUPS = {
    "tensor_core": ("HGMMA", "HMMA"),  # wgmma (sm_90) / mma.sync (sm_80 and sm_90)
    "spill_store": ("STL",),
    "spill_load": ("LDL",),
    "atomic": ("RED", "REDG", "ATOM", "ATOMG"),
    "membar": ("MEMBAR",),  # memory barriers: .GPU / .SYS ones order against every outstanding access
    "fence": ("FENCE",),  # proxy fences (FENCE.VIEW.ASYNC: wgmma / TMA operands)
    "cache_control": ("CCTL", "ERRBAR"),  # L1 invalidation, error barrier (acquire / release sequences)
    "async_copy": ("LDGSTS", "UTMALDG", "LDGDEPBAR"),
    "barrier": ("BAR",),
    "wgmma": ("HGMMA",),  # sm_90's warpgroup MMA (also in tensor_core)
    "tma": ("UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP"),  # tensor-memory-accelerator copies (sm_90)
}
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_SASS_SOURCE = re.compile(r'"([^"]+)", line (\d+)')


def _project_line(chain: list[tuple[str, str]]) -> str:
    """``file:line`` of the innermost frame of an inlining chain (innermost first) outside Triton's own library
    (``nvdisasm -g`` gives one frame: the innermost line, e.g. ``standard.py`` for ``tl.sum``'s reduction)."""
    for path, line in chain:
        if "/triton/" not in path.replace("\\", "/"):
            return f"{Path(path).name}:{line}"
    return f"{Path(chain[0][0]).name}:{chain[0][1]}" if chain else "?"


def sass_stats(sass: str) -> dict:
    """Instruction counts of ``nvdisasm -c -g`` output: total, per group (:data:`SASS_GROUPS`), the full opcodes
    (with memory-order/scope modifiers) of atomics and fences, and per source line for the groups."""
    total, groups, variants = 0, Counter(), Counter()
    by_line: dict[str, Counter] = {g: Counter() for g in SASS_GROUPS}
    lines_total: Counter = Counter()
    where = "?"
    for line in sass.splitlines():
        if line.lstrip().startswith("//## File"):
            where = _project_line(_SASS_SOURCE.findall(line))
            continue
        m = _SASS_LINE.match(line)
        if not m:
            continue
        opcode = m.group(1)
        base = opcode.split(".")[0]
        total += 1
        lines_total[where] += 1
        for group, bases in SASS_GROUPS.items():
            if base in bases:
                groups[group] += 1
                by_line[group][where] += 1
                if group in ("atomic", "membar", "fence", "cache_control", "tensor_core"):
                    variants[opcode] += 1
    return {"instructions": total, **{g: groups[g] for g in SASS_GROUPS}, "opcodes": dict(variants),
            "by_line": {g: dict(c.most_common()) for g, c in by_line.items() if c},
            "instructions_by_line": dict(lines_total.most_common())}


_PTX_OPS = {
    "wgmma": re.compile(r"^\s*wgmma\.mma_async\S*"),
    "mma": re.compile(r"^\s*mma\.sync\S*"),
    "atomic": re.compile(r"^\s*(?:@%p\d+\s+)?((?:atom|red)\.\S+)"),
    "fence": re.compile(r"^\s*(?:@%p\d+\s+)?((?:fence|membar)\.\S+)"),
}
_PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
_PTX_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")


def ptx_stats(ptx: str) -> dict:
    """Counts of tensor-core, atomic and fence instructions in the PTX, their full opcodes (memory order and scope
    included), and the source line of each (the ``.loc`` before it: exact, unlike SASS line tables)."""
    files = {m.group(1): Path(m.group(2)).name for m in map(_PTX_FILE.match, ptx.splitlines()) if m}
    counts, opcodes = Counter(), {"atomic": Counter(), "fence": Counter()}
    by_line: dict[str, Counter] = {name: Counter() for name in _PTX_OPS}
    where = "?"
    for line in ptx.splitlines():
        if m := _PTX_LOC.match(line):
            where = f"{files.get(m.group(1), m.group(1))}:{m.group(2)}"
            continue
        for name, pattern in _PTX_OPS.items():
            if m := pattern.match(line):
                counts[name] += 1
                by_line[name][where] += 1
                if name in opcodes:
                    opcodes[name][m.group(1)] += 1
    out: dict[str, Any] = {name: counts[name] for name in _PTX_OPS}
    out.update({f"{name}_opcodes": dict(c) for name, c in opcodes.items() if c})
    out["by_line"] = {name: dict(c.most_common()) for name, c in by_line.items() if c}
    return out


def occupancy(metrics: dict, target: Target) -> dict:
    """Resident blocks per SM allowed by registers, shared memory and threads (CUDA's occupancy rules)."""
    warps = metrics["num_warps"]
    regs_per_warp = -(-metrics["registers"] * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (REGS_PER_SM // max(regs_per_warp, 1)) // warps
    smem = metrics["shared_bytes"] + metrics["static_shared_bytes"] + RESERVED_SMEM_PER_BLOCK
    by_smem = target.smem_per_sm // smem
    by_threads = min(target.max_threads_per_sm // (warps * 32), target.max_blocks_per_sm)
    return {"blocks_per_sm": min(by_regs, by_smem, by_threads), "by_registers": by_regs, "by_shared": by_smem,
            "by_threads": by_threads}


# ------------------------------------------------------------------------------------------------------- report


@dataclass
class Unit:
    """One distinct compiled kernel (Triton cache key) on one target and shape, and the variants that launch it."""

    id: str
    kernel: str
    target: str
    shape: str
    label: str
    launches: int
    grid: list
    specialisation: dict
    variants: list[str] = field(default_factory=list)
    main: bool = False
    metrics: dict = field(default_factory=dict)


def _spec_summary(launch: Launch) -> dict:
    """JSON-able signature: each argument's type and divisibility, plus the constexprs and launch options."""
    names = list(launch.signature)
    args = {}
    for i, name in enumerate(names):
        if launch.signature[name] == "constexpr":
            args[name] = repr(launch.constexprs.get((i,)))
        else:
            div = any(a[0] == "tt.divisibility" for a in launch.attrs.get((i,), []))
            args[name] = launch.signature[name] + (" %16" if div else "")
    opts = {k: launch.options[k] for k in ("num_warps", "num_stages", "enable_fp_fusion", "arch")}
    return {"args": args, "options": opts}


def _unit_label(kernel: str, variant: Variant, spec_note: str) -> str:
    """``fwd bf16+bias`` / ``bwd-fused bf16+filter`` style row label for a compiled kernel."""
    feats = "".join(f"+{f}" for f, on in (("bias", variant.bias), ("softcap", variant.softcap)) if on)
    if kernel == "_forward_kernel":
        label = f"fwd {variant.dtype}{feats}"
    else:
        tail = ("+filter" if variant.filter else "") + ("" if variant.train_weight else " (no dW)")
        label = f"bwd-{'det' if variant.mode == 'deterministic' else 'fused'} {variant.dtype}{feats}{tail}"
    return f"{label} [{spec_note}]" if spec_note else label


def _spec_notes(launches: list[Launch]) -> dict[str, str]:
    """For launches of one kernel by one call that specialise differently (row chunks), name what differs."""
    keys = list(dict.fromkeys(x.key for x in launches))
    if len(keys) < 2:
        return {keys[0]: ""} if keys else {}
    first = {x.key: x for x in reversed(launches)}
    names = list(launches[0].signature)
    differ = [i for i in range(len(names)) if len({str(first[k].attrs.get((i,))) for k in keys}) > 1]
    notes = {}
    for k in keys:
        parts = [f"{names[i]}{' %16' if first[k].attrs.get((i,)) else ' not %16'}" for i in differ]
        n = sum(x.key == k for x in launches)
        notes[k] = ", ".join(parts) + f"; {n} of {len(launches)} launches"
    return notes


def collect_units(variants: list[Variant], shapes: list[Shape], targets: list[Target],
                  first_chunk_only: bool = False) -> tuple[list[Unit], dict[str, Launch], list[dict]]:
    """Record every variant's launches per shape and target; group them into distinct compiled kernels.
    ``first_chunk_only`` keeps, per call and kernel, only the first launch's specialisation (the deterministic
    backward's later row chunks could specialise ``first_row_block`` differently before it was marked
    ``do_not_specialize``; they compile to the same code).

    Returns ``(units, launch_of, calls)``: a sample launch per unit id, and per (variant, shape, target) call the
    unit ids it launches."""
    units: dict[tuple, Unit] = {}
    launch_of: dict[str, Launch] = {}
    calls = []
    for shape in shapes:
        for target in targets:
            for variant in variants:
                launches = record_launches(variant, shape, target)
                ids = []
                for kernel in dict.fromkeys(x.kernel for x in launches):
                    mine = [x for x in launches if x.kernel == kernel]
                    if first_chunk_only:
                        mine = [x for x in mine if x.key == mine[0].key]
                    for key, note in _spec_notes(mine).items():
                        ukey = (kernel, key, target.name, shape.name)
                        if ukey not in units:
                            sample = next(x for x in mine if x.key == key)
                            uid = f"{target.name}/{shape.name}/{_unit_label(kernel, variant, note)}"
                            units[ukey] = Unit(id=uid, kernel=kernel, target=target.name, shape=shape.name,
                                               label=_unit_label(kernel, variant, note),
                                               launches=sum(x.key == key for x in mine), grid=list(sample.grid),
                                               specialisation=_spec_summary(sample))
                            launch_of[uid] = sample
                        units[ukey].variants.append(variant.name)
                        units[ukey].main |= variant.main
                        ids.append(units[ukey].id)
                calls.append({"variant": variant.name, "main": variant.main, "dtype": variant.dtype,
                              "mode": variant.mode, "shape": shape.name, "target": target.name, "units": ids})
    return list(units.values()), launch_of, calls


def build_report(variants: list[Variant], shapes: list[Shape], targets: list[Target], *,
                 first_chunk_only: bool = False, progress=None) -> dict:
    """Record, compile and measure every distinct kernel (see :func:`collect_units`); the JSON-able report."""
    units, launch_of, calls = collect_units(variants, shapes, targets, first_chunk_only)
    done = 0

    def compiled(index: int, metrics: dict) -> None:
        nonlocal done
        units[index].metrics, done = metrics, done + 1
        if progress:
            progress(done, len(units), units[index])

    compile_launches([(launch_of[unit.id], TARGETS[unit.target]) for unit in units], on_done=compiled)
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": tool_versions(),
        "targets": {t.name: asdict(t) for t in targets},
        "shapes": {s.name: asdict(s) for s in shapes},
        "units": [asdict(u) for u in units],
        "calls": calls,
    }


def problems(report: dict) -> list[str]:
    """Every unit that failed to compile or exceeds its target's shared memory (empty when all is well)."""
    out = []
    for u in report["units"]:
        m, limit = u["metrics"], report["targets"][u["target"]]["smem_per_block"]
        if "error" in m:
            out.append(f"{u['id']}: {m['error']}")
        elif m["shared_bytes"] + m["static_shared_bytes"] > limit:
            out.append(f"{u['id']}: shared {m['shared_bytes']} + {m['static_shared_bytes']} B > {limit} B")
    return out


def problem_summary(report: dict) -> list[str]:
    """:func:`problems`, grouped: one line per target, kernel + dtype and outcome, with the variants and shapes."""
    groups: dict[tuple, list[dict]] = {}
    for u in report["units"]:
        m, limit = u["metrics"], report["targets"][u["target"]]["smem_per_block"]
        base = re.split(r"[+ ]", u["label"].split(" ", 1)[1])[0]
        kernel = u["label"].split(" ", 1)[0]
        if "error" in m:
            groups.setdefault((u["target"], kernel, base, "compile error"), []).append(u)
        elif (total := m["shared_bytes"] + m["static_shared_bytes"]) > limit:
            groups.setdefault((u["target"], kernel, base, f"{total} B shared > {limit} B"), []).append(u)
    out = []
    for (target, kernel, base, outcome), units in groups.items():
        shapes = ", ".join(dict.fromkeys(u["shape"] for u in units))
        labels = sorted({u["label"] for u in units})
        out.append(f"{target} {kernel} {base}: {outcome} — {len(labels)} variant(s) ({', '.join(labels)}); "
                   f"shapes {shapes}")
    return out


TABLE_COLUMNS = ("smem B", "regs", "spill st/ld B", "TC", "atomics / MEMBAR", "SASS", "CTA/SM")


def _cells(m: dict | None) -> tuple[str, ...]:
    """The :data:`TABLE_COLUMNS` cells of one compiled kernel's metrics."""
    if m is None:
        return ("–",) * len(TABLE_COLUMNS)
    if "error" in m:
        return ("**failed**",) + ("–",) * (len(TABLE_COLUMNS) - 1)
    s = m["sass"]
    return (str(m["shared_bytes"] + m["static_shared_bytes"]), str(m["registers"]),
            f"{m['spill_store_bytes']}/{m['spill_load_bytes']}", str(s["tensor_core"]),
            f"{s['atomic']} / {s['membar']}", str(s["instructions"]), str(m["occupancy"]["blocks_per_sm"]))


def table_rows(report: dict, shape: str, main_only: bool = False) -> list[tuple[str, dict[str, tuple]]]:
    """``(label, {target: cells})`` per kernel variant of ``shape``. Specialisations of one variant (row chunks of
    the deterministic backward) whose cells agree on every target share one row, marked ``×k``."""
    groups: dict[str, dict[str, dict[str, tuple]]] = {}
    for u in report["units"]:
        if u["shape"] == shape and (u["main"] or not main_only):
            base, _, note = u["label"].partition(" [")
            groups.setdefault(base, {}).setdefault(note, {})[u["target"]] = _cells(u["metrics"])
    rows = []
    for base, by_note in groups.items():
        if len(by_note) > 1 and all(len({str(c.get(t)) for c in by_note.values()}) == 1 for t in report["targets"]):
            rows.append((f"{base} (×{len(by_note)} specialisations)", next(iter(by_note.values()))))
        else:
            rows += [(f"{base} [{note}" if note else base, cells) for note, cells in by_note.items()]
    return rows


def markdown_table(report: dict, shape: str, main_only: bool = False) -> str:
    """Markdown table of one shape's kernel variants, the targets side by side."""
    targets = list(report["targets"])
    head = "| variant | " + " | ".join(f"{t} {c}" for t in targets for c in TABLE_COLUMNS) + " |"
    lines = [head, "|---" + "|---:" * (len(TABLE_COLUMNS) * len(targets)) + "|"]
    for label, cells in table_rows(report, shape, main_only):
        row = [c for t in targets for c in cells.get(t, _cells(None))]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_section(report: dict, command: str) -> str:
    """The RESULTS.md section (between the marker comments): command, versions, a table of the plain variants
    per shape and the full table of every variant in a collapsed block."""
    v = report["versions"]
    parts = [
        SECTION_START,
        f"## Kernels compiled for sm_80 / sm_90 — `benchmarks/compile_report.py` ({report['date'].split()[0]})",
        "",
        f"Run {report['date']} on a CPU-only machine ({report['wall_s']:.0f} s). Command: `{command}`. "
        f"triton {v['triton']} (ptxas {v['ptxas']} for sm_80, {v['ptxas_blackwell']} for sm_90; nvdisasm "
        f"{v['nvdisasm']}), torch {v['torch']}.",
        "",
        ("Every variant `fused_sparse_jsd` can launch" if report.get("set", "all") == "all" else
         "The variants `tests/test_kernel_compile.py` compiles (`--set test`, a subset of what "
         "`fused_sparse_jsd` can launch)") + ", recorded through the real dispatcher on meta tensors and "
        "specialised as `JITFunction.run` would on the GPU (pointer dtypes, 16-divisible ints, constexprs; default "
        "GPU tiles 128×128×64 for half precision, 128×64×32 for fp32, 8 warps, 3 stages; vocabulary splits for "
        "108 / 132 SMs), compiled with "
        "`triton.compiler.compile` for `GPUTarget(\"cuda\", 80|90, 32)`. One row per compiled kernel. smem = "
        "dynamic + static shared bytes per block (limits: sm80 166912, sm90 232448); regs and spill bytes from "
        "ptxas `-v`; TC = tensor-core SASS instructions (HGMMA = wgmma on sm90, HMMA = mma.sync on sm80); "
        "atomics / MEMBAR = RED/ATOM and MEMBAR SASS instructions; SASS = static instruction count; CTA/SM = "
        "resident blocks per SM allowed by registers, shared memory and threads. Variant names: dtype "
        "(`fp32-tf32` = fp32 under `torch.set_float32_matmul_precision(\"high\")`), `+bias`, `+softcap`, "
        "`+filter` (filter_eps), `(no dW)` (frozen lm_head). Per-line attributions: `--json PATH`.",
    ]
    for shape in report["shapes"].values():
        title = f"{shape['name']}: N={shape['n']}, D={shape['d']}, V={shape['v']}, S={shape['s']}"
        parts += ["", f"### {title} — plain variants", "", markdown_table(report, shape["name"], main_only=True),
                  "", f"<details><summary>{title} — every variant</summary>", "",
                  markdown_table(report, shape["name"]), "", "</details>"]
    bad = problem_summary(report)
    if bad:
        parts += ["", "Do not compile or do not fit (the launch raises `OutOfResources`):", ""]
        parts += [f"- {line}" for line in bad]
    parts.append(SECTION_END)
    return "\n".join(parts)


def update_results(path: Path, section: str) -> None:
    """Replace the text between the compile-report markers in ``path`` (append the section if they are absent)."""
    text = path.read_text() if path.exists() else ""
    if SECTION_START in text and SECTION_END in text:
        head, rest = text.split(SECTION_START, 1)
        tail = rest.split(SECTION_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def print_table(report: dict) -> None:
    """Plain-text table to stdout: one line per compiled kernel and target."""
    fmt = "{:<58} {:>5} {:>7} {:>5} {:>11} {:>5} {:>6} {:>6} {:>6} {:>6}"
    print(fmt.format("variant", "tgt", "smem B", "regs", "spill st/ld", "TC", "atom", "membar", "SASS", "CTA/SM"))
    for u in report["units"]:
        m = u["metrics"]
        name = f"{u['shape']}: {u['label']}"
        if "error" in m:
            print(f"{name:<58} {u['target']:>5} FAILED {m['error'][:200]}")
            continue
        s = m["sass"]
        print(fmt.format(name[:58], u["target"], m["shared_bytes"] + m["static_shared_bytes"], m["registers"],
                         f"{m['spill_store_bytes']}/{m['spill_load_bytes']}", s["tensor_core"], s["atomic"],
                         s["membar"], s["instructions"], m["occupancy"]["blocks_per_sm"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=("all", "test"), default="all", help="which variants (default: all)")
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    p.add_argument("--targets", nargs="+", choices=tuple(TARGETS), default=list(TARGETS))
    p.add_argument("--json", type=Path, help="write the full report (per-line SASS attributions included) here")
    p.add_argument("--results", type=Path, help="replace the compile-report section of this markdown file")
    p.add_argument("--first-chunk-only", action="store_true",
                   help="one specialisation per call and kernel (skip the later row chunks' twins)")
    p.add_argument("--from-json", type=Path, help="render a report written by --json instead of compiling")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--chunked", action="store_true",
                   help="instead: the chunked designs' row kernels (sparse and dense teacher) as their entry points "
                        "launch them, a markdown table (--targets, --json)")
    return p.parse_args(argv)


def _compile_report(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """Compile the selected variants (progress on stderr unless ``--quiet``) and stamp the command and wall time."""
    sys.path.insert(0, str(ROOT / "kernels"))  # fastdistill_kernels without installing the project
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # launches get the same default

    def progress(i: int, n: int, unit: Unit) -> None:
        if not args.quiet:
            err = unit.metrics.get("error")
            print(f"[{i}/{n}] {unit.id}: {'FAILED' if err else 'ok'} ({unit.metrics['compile_s']:.1f} s)",
                  file=sys.stderr, flush=True)

    start = time.perf_counter()
    report = build_report(variant_set(args.set), [SHAPES[s] for s in args.shapes],
                          [TARGETS[t] for t in args.targets], first_chunk_only=args.first_chunk_only,
                          progress=progress)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["set"] = args.set
    report["command"] = "python benchmarks/compile_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return report


def chunked_main(args: argparse.Namespace) -> int:
    """``--chunked``: compile :func:`chunked_report` in bf16 for ``--targets``, print its table; exit 2 if the
    toolchain is unusable, 1 if a kernel fails to compile, spills or exceeds the shared memory per block."""
    problem = toolchain_problem()
    if problem:
        print(f"cannot compile for NVIDIA targets here: {problem}", file=sys.stderr)
        return 2
    entries = chunked_report(("bf16",), tuple(args.targets))
    print(chunked_markdown(entries))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(entries, indent=1))
    bad = [e for e in entries if "error" in e["metrics"] or e["metrics"]["spill_store_bytes"]
           or e["metrics"]["shared_bytes"] + e["metrics"]["static_shared_bytes"] > e["smem_per_block"]]
    for e in bad:
        print(f"PROBLEM {e['design']} {e['kernel']} {e['mode']} {e['target']}", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: compile, print, write JSON / markdown; exit 2 if the toolchain is unusable, 1 on failures."""
    args = parse_args(argv)
    if args.chunked:
        return chunked_main(args)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        problem = toolchain_problem()
        if problem:
            print(f"cannot compile for NVIDIA targets here: {problem}", file=sys.stderr)
            return 2
        report = _compile_report(args, argv)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.results:
        update_results(args.results, markdown_section(report, report["command"].strip()))
    bad = problems(report)
    for line in bad:
        print(f"PROBLEM {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
