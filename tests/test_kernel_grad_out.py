"""The fp32-logits gradient kernels of the chunked paths: ``_chunk_grad_out_kernel`` (sparse) and
``_dense_grad_out_kernel`` (dense teacher) write ``dL/dx`` in the GEMM dtype over the fp32 raw logits they read.

In the interpreter: every gradient element (and the dense kernel's divergence) lies within fp32 evaluation error plus
one rounding to the GEMM dtype of a float64 reference (the formula for the sparse kernel's given coefficients,
autograd of the divergence for the dense one), whether written over the logits (the first half of each fp32 row, as
the chunked paths launch them; fp32: in place) or into a separate buffer, the two bit for bit equal. Compiled for the
GPU targets as the chunked paths launch them: ``tests/test_kernels_chunked.py`` (sparse) and
``tests/test_kernel_compile.py`` (dense, ``compile_report.dense_report``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from fastdistill_kernels import dense_chunk, logits_chunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
C, V, S = 6, 200, 5  # V spans four 64-column interpreter blocks, the last one partial


U32 = 2.0**-24  # unit roundoff of fp32
ARITH_ROUNDINGS = 16  # fp32 roundings on the way to one element: bias, scale, sigmoid, the row's max and sums
STORE_REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11, torch.float32: 0.0}  # bf16: the interpreter truncates
STORE_ABS = {torch.bfloat16: 0.0, torch.float16: 2.0**-25, torch.float32: 0.0}  # fp16's subnormal spacing / 2


def _final64(x, bias, scale, softcap, temperature):
    """float64 ``softcap(scale·(x + b)) / T`` (softcap None = off)."""
    y = (x.double() + bias.double()) * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    return y / temperature


def _assert_within(got, ref, arith, dtype):
    """``|got − ref| ≤ arith + STORE_REL·(|ref| + arith) + STORE_ABS``: fp32 evaluation error ``arith``, then one
    rounding (bf16: truncation in the interpreter, nearest on a GPU; both within 2⁻⁷ relative) to ``dtype``."""
    err = (got.double() - ref).abs()
    bound = arith + STORE_REL[dtype] * (ref.abs() + arith) + STORE_ABS[dtype]
    assert torch.isfinite(got).all()
    worst = (err - bound).max()
    assert worst <= 0, f"max excess {worst.item():.3g}, max err {err.max().item():.3g}, max |ref| {ref.abs().max():.3g}"


def _sparse_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = 4.0 * torch.randn(C, V, generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:S] for _ in range(C)]).to(torch.int32)
    ids[1, 3:] = -1  # invalid slots
    bias = 0.1 * torch.randn(V, generator=g)
    coef = torch.randn(C, generator=g)
    cand_grad = torch.randn(C, S, generator=g)
    return x, ids, bias, coef, cand_grad


def _sparse_reference(x, ids, bias, coef, cand_grad, *, logit_scale, softcap, temperature):
    """float64 ``dL/dx`` of the raw logits ``x`` (before the stats pass): ``exp(z − m_nc)·coef`` at
    non-candidates (``m_nc`` their max), ``cand_grad`` at the valid candidates, times ``logit_scale / T`` and the
    softcap derivative ``1 − (z·T/c)²``; and the largest ``|z|`` (the scale of fp32's absolute errors)."""
    z = _final64(x, bias, logit_scale, softcap, temperature)
    valid = ids >= 0
    rows = torch.arange(C).unsqueeze(1).expand_as(ids)[valid]
    cand = torch.zeros(C, V, dtype=torch.bool)
    cand[rows, ids[valid].long()] = True
    m_nc = z.masked_fill(cand, float("-inf")).amax(dim=1, keepdim=True)
    dz = torch.exp(z - m_nc) * coef.double().unsqueeze(1)
    dz[cand] = 0.0
    dz[rows, ids[valid].long()] = cand_grad.double()[valid]
    if softcap is not None:
        dz = dz * (1.0 - (z * temperature / softcap) ** 2)
    return dz * (logit_scale / temperature), z.abs().max().item()


@pytest.mark.interpreter
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunk_grad_out_matches_a_float64_reference(dtype, softcap):
    """Every element within fp32 evaluation error plus one rounding to ``dtype`` of the float64 gradient, whether
    written over the logits (the first half of each fp32 row, as the chunked path launches it; fp32: in place) or
    into a separate buffer, and the two bit for bit equal."""
    x, ids, bias, coef, cand_grad = _sparse_inputs(seed=1)
    kw = dict(logit_scale=1.3, softcap=softcap, temperature=0.8)
    ref, z_max = _sparse_reference(x, ids, bias, coef, cand_grad, **kw)
    stats = logits_chunk.launch_chunk_stats(x, bias, ids, **kw)  # writes the −inf sentinels into x
    args = (ids, stats.z_cand, stats.m_nc, coef, cand_grad)
    separate = torch.full((C, V), float("nan"), dtype=dtype)
    logits_chunk.launch_chunk_grad_out(x.clone(), separate, bias, *args, **kw)
    aliased = x.clone()
    dx = logits_chunk.gradient_view(aliased, dtype)
    assert dx.shape == (C, V) and dx.untyped_storage().data_ptr() == aliased.untyped_storage().data_ptr()
    logits_chunk.launch_chunk_grad_out(aliased, dx, bias, *args, **kw)
    # every factor is a product of fp32 roundings of values whose absolute error is ≤ k·u·|z|max: relative error
    _assert_within(dx, ref, ARITH_ROUNDINGS * U32 * z_max * ref.abs(), dtype)
    assert torch.equal(separate, dx)


def _dense_reference(xs, xt, bs, bt, rw, heads, beta):
    """float64 per-row divergence ``(C,)`` and ``dL/dx_s`` of ``Σ w·D`` (autograd), with the bound of fp32's
    evaluation error per element: ``k·u·Z·(p + q)·(1 + |s| + |t| + |D|)·w·scale / T`` (``Z`` the largest |z| or
    log-sum-exp: each log-prob's absolute error is ≤ k·u·Z, and the gradient's terms are p, q times log-probs)."""
    xs64 = xs.double().requires_grad_()
    zs = _final64(xs64, bs, heads.student_scale, heads.student_softcap, heads.temperature)
    zt = _final64(xt, bt, heads.teacher_scale, heads.teacher_softcap, heads.temperature)[:, : xs.shape[1]]
    s, t = torch.log_softmax(zs, dim=1), torch.log_softmax(zt, dim=1)  # the teacher over the student's vocabulary
    p, q = s.exp(), t.exp()
    if beta == 0.0:
        div = (q * (t - s)).sum(dim=1)
    elif beta == 1.0:
        div = (p * (s - t)).sum(dim=1)
    else:
        log_m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        div = beta * (q * (t - log_m)).sum(dim=1) + (1.0 - beta) * (p * (s - log_m)).sum(dim=1)
    (dx,) = torch.autograd.grad((rw.double() * div).sum(), xs64)
    z_max = max(zs.abs().max().item(), zt.abs().max().item(), torch.logsumexp(zs, 1).abs().max().item(),
                torch.logsumexp(zt, 1).abs().max().item())
    with torch.no_grad():
        mag = (p + q) * (1.0 + s.abs() + t.abs() + div.abs().unsqueeze(1))
        chain = rw.double().unsqueeze(1) * heads.student_scale / heads.temperature
        arith = ARITH_ROUNDINGS * U32 * z_max * mag * chain
        div_arith = ARITH_ROUNDINGS * U32 * z_max * mag.sum(dim=1)
    return div.detach(), dx, arith, div_arith


@pytest.mark.interpreter
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_grad_out_matches_a_float64_reference(dtype, beta):
    """The divergence and every gradient element within fp32 evaluation error (plus one rounding to ``dtype``) of
    float64 autograd, over the logits as the chunked path launches it or into a separate buffer, bit for bit the
    same; without a gradient buffer, the same divergence."""
    g = torch.Generator().manual_seed(2)
    xs, xt = 4.0 * torch.randn(C, V, generator=g), 4.0 * torch.randn(C, V + 30, generator=g)
    bs, bt = 0.1 * torch.randn(V, generator=g), 0.1 * torch.randn(V + 30, generator=g)
    rw = torch.rand(C, generator=g)
    heads = dense_chunk.DenseHeads(1.2, 20.0, 0.9, None, 0.7)
    div_ref, dx_ref, arith, div_arith = _dense_reference(xs, xt, bs, bt, rw, heads, beta)
    st = dense_chunk.launch_dense_stats(xs, xt, bs, bt, heads)
    aliased = xs.clone()
    dx = dense_chunk.gradient_view(aliased, dtype)
    div = dense_chunk.launch_dense_grad_out(aliased, xt, dx, bs, bt, st.lse_s, st.lse_t, rw, heads, beta)
    assert ((div.double() - div_ref).abs() <= div_arith).all(), (div, div_ref)
    _assert_within(dx, dx_ref, arith, dtype)
    separate = torch.full((C, V), float("nan"), dtype=dtype)
    div_sep = dense_chunk.launch_dense_grad_out(xs.clone(), xt, separate, bs, bt, st.lse_s, st.lse_t, rw, heads,
                                                beta)
    assert torch.equal(separate, dx) and torch.equal(div_sep, div)
    div_only = dense_chunk.launch_dense_grad_out(xs.clone(), xt, None, bs, bt, st.lse_s, st.lse_t, rw, heads, beta)
    assert torch.equal(div_only, div)
