"""The fp32-logits gradient kernels of the chunked paths: ``_chunk_grad_out_kernel`` (sparse) and
``_dense_grad_out_kernel`` (dense teacher) write ``dL/dx`` in the GEMM dtype over the fp32 raw logits they read.

In the interpreter: the gradients equal the validated in-place kernels' on the same fp32 logits, rounded once to the
GEMM dtype, bit for bit, whether written over the logits (the first half of each fp32 row, as the chunked paths
launch them), into a separate buffer, or in place in fp32. Compiled for the GPU targets (sm_80 / sm_90 on this CPU
machine, in a subprocess: this session runs Triton in its interpreter): no spills, shared memory within the limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from fastdistill_kernels import dense_chunk, logits_chunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
C, V, S = 6, 200, 5  # V spans four 64-column interpreter blocks, the last one partial


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` as a kernel's store to a ``dtype`` pointer leaves it in the interpreter: bf16 by truncation (its
    conversion drops the low 16 bits; a GPU rounds to nearest even), fp16 and fp32 as torch converts."""
    if dtype == torch.bfloat16:
        return (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: a bf16 value
    return x.to(dtype)


def _sparse_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = 4.0 * torch.randn(C, V, generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:S] for _ in range(C)]).to(torch.int32)
    ids[1, 3:] = -1  # invalid slots
    bias = 0.1 * torch.randn(V, generator=g)
    coef = torch.randn(C, generator=g)
    cand_grad = torch.randn(C, S, generator=g)
    return x, ids, bias, coef, cand_grad


@pytest.mark.interpreter
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunk_grad_out_matches_the_in_place_kernel(dtype, softcap):
    x, ids, bias, coef, cand_grad = _sparse_inputs(seed=1)
    kw = dict(logit_scale=1.3, softcap=softcap, temperature=0.8)
    stats = logits_chunk.launch_chunk_stats(x, bias, ids, **kw)  # writes the −inf sentinels into x
    args = (ids, stats.z_cand, stats.m_nc, coef, cand_grad)
    old = x.clone()
    logits_chunk.launch_chunk_grad(old, bias, *args, **kw)  # fp32 in place: the validated kernel
    expected = stored(old, dtype)
    separate = torch.full((C, V), float("nan"), dtype=dtype)
    logits_chunk.launch_chunk_grad_out(x.clone(), separate, bias, *args, **kw)
    aliased = x.clone()
    dx = logits_chunk.gradient_view(aliased, dtype)
    assert dx.shape == (C, V) and dx.untyped_storage().data_ptr() == aliased.untyped_storage().data_ptr()
    logits_chunk.launch_chunk_grad_out(aliased, dx, bias, *args, **kw)
    assert torch.equal(separate, expected)
    assert torch.equal(dx, expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_grad_out_matches_the_in_place_kernel(dtype, beta):
    g = torch.Generator().manual_seed(2)
    xs, xt = 4.0 * torch.randn(C, V, generator=g), 4.0 * torch.randn(C, V + 30, generator=g)
    bs, bt = 0.1 * torch.randn(V, generator=g), 0.1 * torch.randn(V + 30, generator=g)
    rw = torch.rand(C, generator=g)
    heads = dense_chunk.DenseHeads(1.2, 20.0, 0.9, None, 0.7)
    st = dense_chunk.launch_dense_stats(xs, xt, bs, bt, heads)
    old = xs.clone()
    div_old = dense_chunk.launch_dense_grad(old, xt, bs, bt, st.lse_s, st.lse_t, rw, heads, beta, need_grad=True)
    aliased = xs.clone()
    dx = dense_chunk.gradient_view(aliased, dtype)
    div_new = dense_chunk.launch_dense_grad_out(aliased, xt, dx, bs, bt, st.lse_s, st.lse_t, rw, heads, beta)
    assert torch.equal(div_new, div_old)
    assert torch.equal(dx, stored(old, dtype))
    div_only = dense_chunk.launch_dense_grad_out(xs.clone(), xt, None, bs, bt, st.lse_s, st.lse_t, rw, heads, beta)
    assert torch.equal(div_only, div_old)


# ------------------------------------------------------------------------------------------------ AOT compile
COMPILE_SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path
from unittest import mock

ROOT = Path(sys.argv[1])
sys.path.insert(0, str(ROOT / "kernels"))
spec = importlib.util.spec_from_file_location("compile_report", ROOT / "benchmarks" / "compile_report.py")
cr = importlib.util.module_from_spec(spec)
sys.modules["compile_report"] = cr
spec.loader.exec_module(cr)
problem = cr.toolchain_problem()
if problem:
    print(problem, file=sys.stderr)
    sys.exit(2)
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
import fastdistill_kernels.dense_chunk as dc

N, V, PAD = 16384, 152064, 64
meta = torch.device("meta")
jobs = []
for tname in cr.selected_targets():
    target = cr.TARGETS[tname]
    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    launches = []
    c = dc.dense_chunk_rows_for(N, V, V + PAD, torch.float32, torch.float32)
    xs = torch.empty(c, V, dtype=torch.float32, device=meta)
    xt = torch.empty(c, V + PAD, dtype=torch.float32, device=meta)
    bs = torch.empty(V, dtype=torch.bfloat16, device=meta)
    bt = torch.empty(V + PAD, dtype=torch.bfloat16, device=meta)
    rows = torch.empty(c, dtype=torch.float32, device=meta)
    heads = dc.DenseHeads(1.0, 30.0, 1.0, 30.0, 1.0)
    rec = cr._LaunchRecorder(dc._dense_grad_out_kernel, backend, launches)
    with mock.patch.object(dc, "_dense_grad_out_kernel", rec):
        for beta in (0.0, 0.5, 1.0):
            dc.launch_dense_grad_out(xs, xt, dc.gradient_view(xs, torch.bfloat16), bs, bt, rows, rows, rows, heads,
                                     beta)
    jobs += [(f"{tname}/beta={beta}", launch, target) for beta, launch in zip((0.0, 0.5, 1.0), launches)]
out = {}
for (key, launch, target), m in zip(jobs, cr.compile_launches([job[1:] for job in jobs]), strict=True):
    row = {k: m.get(k) for k in ("error", "registers", "spill_store_bytes", "spill_load_bytes",
                                 "shared_bytes", "static_shared_bytes", "num_warps")}
    row["sass_spill_store"] = m.get("sass", {}).get("spill_store")
    row["sass_instructions"] = m.get("sass", {}).get("instructions")
    row["smem_limit"] = target.smem_per_block
    out[key] = row
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(ROOT)], capture_output=True, text=True,
                          timeout=600, env=env)
    if proc.returncode == 2:  # an unusable toolchain (no NVIDIA backend, no ptxas)
        pytest.skip(proc.stderr.strip()[-500:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.compile
def test_dense_grad_out_kernel_compiles_without_spills(compiled):
    """Every β mode (bias and softcap on both sides, padded teacher, bf16 gradient over fp32 logits) compiles for
    each selected target with no spills and shared memory within the target's limit."""
    assert compiled
    for key, m in compiled.items():
        assert m["error"] is None, (key, m["error"])
        assert m["registers"] > 0 and m["sass_instructions"] > 0, key
        assert m["shared_bytes"] + m["static_shared_bytes"] <= m["smem_limit"], (key, m)
        assert (m["spill_store_bytes"], m["spill_load_bytes"], m["sass_spill_store"]) == (0, 0, 0), (key, m)
