"""bf16 gradients of the chunked paths against float64: within bounds derived from bf16 arithmetic, element-wise.

The chunked paths compute the raw logits in fp32 (never rounded to bf16 before exp), write dL/dx in bf16 for the
gradient GEMMs and accumulate dW in bf16 with fp32 sums inside each chunk's GEMM. Each step's error is bounded
element-wise from the float64 reference of the same (bf16-rounded) inputs, whose gradient dL/dx is ``G`` ``(N, V)``:

- dL/dx rounded to bf16: ``|δG| ≤ u_dx·|G|``, ``u_dx`` = 2⁻⁸ (round to nearest), 2⁻⁷ in Triton's interpreter, which
  converts fp32 to bf16 by truncation; through the GEMMs: ``u_dx·|G|ᵀ|h|`` on dW, ``u_dx·|G||W|`` on dh;
- each GEMM output rounded to bf16 (``u`` = 2⁻⁸): dh once, dW once per chunk at its running sum ``T_i``:
  ``u·Σ_i |T_i|`` (``u·|dW|`` with ``fp32_accumulator=True``);
- fp32 logits: ``|δz| ≤ ε_z = γ_D·max Σ_d |h||w|`` (``γ_D = D·2⁻²⁴ / (1 − D·2⁻²⁴)``, any summation order), which
  moves each probability by at most ``2ε_z·p`` and every fp32 gradient term with it: ``8·ε_z·(|G| + p + q)`` on
  dL/dx, generous (p, q: student, teacher probabilities);

summed, times 1.01 for second-order terms. Bf16 logits would add ``|z|·2⁻⁹`` to ``δz`` (≈ 2·10⁻² at |z| = 10, five
times ``u_dx``), the error the issue measured. The issue's own criterion is checked too: the chunked path's relative
L2 error within 2× the fused kernel's (which recomputes fp32 logit tiles and writes dW once per row block).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from fastdistill_kernels import dense_chunk, dense_fused, logits_chunk, ops  # noqa: E402

N, D, V, K = 48, 64, 384, 8
CHUNK = 6  # 8 chunks: 8 roundings of dW's running sum (the 7B head's default has 10)
SCALE = 4.0  # logit standard deviation: |z| up to ≈ 15, where bf16 logits lose 3·10⁻² of each probability
U = 2.0**-8


def dx_unit() -> float:
    """Relative error of dL/dx stored to bf16 by a kernel: truncation in the interpreter, rounding on a GPU."""
    from fastdistill_kernels.config import interpreting

    return 2.0**-7 if interpreting() else U


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * SCALE / D**0.5).bfloat16()
    ht = torch.randn(N, D, generator=g).bfloat16()
    wt = (torch.randn(V, D, generator=g) * SCALE / D**0.5).bfloat16()
    lps, ids = torch.log_softmax(ht.double() @ wt.double().t(), dim=-1).topk(K, dim=-1)
    return h, w, ht, wt, ids, lps.float(), torch.ones(N, K, dtype=torch.bool)


def _sparse_reference(h, w, ids, lps):
    """KL(teacher ‖ student) over K candidates + the exact tail bucket, float64: loss, G, p, q, dh, dW."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    x = h64 @ w64.t()
    x.retain_grad()
    ls = torch.log_softmax(x, dim=-1)
    s = ls.gather(1, ids)
    s_tail = torch.log1p(-s.exp().sum(1))
    t = lps.double()
    t_tail = torch.log1p(-t.exp().sum(1))
    loss = ((t.exp() * (t - s)).sum(1) + t_tail.exp() * (t_tail - s_tail)).sum()
    loss.backward()
    return x.grad, ls.exp().detach(), torch.zeros_like(x.grad), h64.grad, w64.grad


def _dense_reference(h, w, ht, wt, beta):
    """Generalized JSD (β = 0: KL(teacher ‖ student)) over the vocabulary, float64: G, p, q, dh, dW."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    x = h64 @ w64.t()
    x.retain_grad()
    s = torch.log_softmax(x, dim=-1)
    t = torch.log_softmax(ht.double() @ wt.double().t(), dim=-1)
    if beta == 0.0:
        loss = (t.exp() * (t - s)).sum()
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        loss = (beta * t.exp() * (t - m) + (1 - beta) * s.exp() * (s - m)).sum()
    loss.backward()
    return x.grad, s.exp().detach(), t.exp(), h64.grad, w64.grad


def _eps_logits(*pairs) -> float:
    """ε_z: the fp32 logits' error bound over the (hidden, weight) pairs."""
    gamma = D * 2.0**-24 / (1 - D * 2.0**-24)
    return gamma * max(float((h.double().abs() @ w.double().abs().t()).max()) for h, w in pairs)


def bounds(G, p, q, h, w, eps_z, chunk_rows: int | None):
    """Element-wise error bounds ``(B_dh, B_dW)`` (see the module docstring); ``chunk_rows`` None: dW rounded once."""
    h64, w64 = h.double(), w.double()
    absG, slack = G.abs(), G.abs() + p + q
    b_dh = dx_unit() * absG @ w64.abs() + U * (G @ w64).abs() + 8 * eps_z * slack @ w64.abs()
    if chunk_rows is None:
        rounding = (G.t() @ h64).abs()
    else:
        partials = [G[r:r + chunk_rows].t() @ h64[r:r + chunk_rows] for r in range(0, G.shape[0], chunk_rows)]
        rounding = sum(torch.stack(partials).cumsum(0).abs())
    b_dw = dx_unit() * absG.t() @ h64.abs() + U * rounding + 8 * eps_z * slack.t() @ h64.abs()
    return 1.01 * b_dh, 1.01 * b_dw


def _run(fn, h, w):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    fn(h, w).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    return h.grad, w.grad


def rel_l2(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def _check(name, got, ref, bound):
    err = (got.double() - ref).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{name}: an element's error is {worst:.2f}× its bound"
    assert rel_l2(got, ref) <= float(bound.norm() / ref.norm()), name


@pytest.mark.interpreter
@pytest.mark.parametrize("fp32_accumulator", [False, True])
def test_sparse_chunked_bf16_gradients_within_the_bf16_bounds(fp32_accumulator):
    h, w, _, _, ids, lps, valid = _inputs(seed=0)
    G, p, q, ref_dh, ref_dw = _sparse_reference(h, w, ids, lps)
    b_dh, b_dw = bounds(G, p, q, h, w, _eps_logits((h, w)), None if fp32_accumulator else CHUNK)
    dh, dw = _run(lambda h_, w_: logits_chunk.chunked_logits_sparse_jsd(
        h_, w_, ids, lps, valid, chunk_rows=CHUNK, fp32_accumulator=fp32_accumulator).loss, h, w)
    _check("dh", dh, ref_dh, b_dh)
    _check("dW", dw, ref_dw, b_dw)


@pytest.mark.interpreter
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_dense_chunked_bf16_gradients_within_the_bf16_bounds(beta):
    h, w, ht, wt, *_ = _inputs(seed=1)
    G, p, q, ref_dh, ref_dw = _dense_reference(h, w, ht, wt, beta)
    b_dh, b_dw = bounds(G, p, q, h, w, _eps_logits((h, w), (ht, wt)), CHUNK)
    dh, dw = _run(lambda h_, w_: dense_chunk.chunked_dense_teacher_jsd(h_, w_, ht, wt, beta=beta,
                                                                       chunk_rows=CHUNK).loss, h, w)
    _check("dh", dh, ref_dh, b_dh)
    _check("dW", dw, ref_dw, b_dw)


@pytest.mark.interpreter
def test_bounds_are_tight_enough_to_catch_bf16_logits():
    """The same bound fails for dL/dx computed from bf16-rounded logits (the previous design), so it can fail."""
    h, w, ht, wt, *_ = _inputs(seed=1)
    G, p, q, _, ref_dw = _dense_reference(h, w, ht, wt, 0.0)
    _, b_dw = bounds(G, p, q, h, w, _eps_logits((h, w), (ht, wt)), CHUNK)
    xs = (h.double() @ w.double().t()).bfloat16().double()
    xt = (ht.double() @ wt.double().t()).bfloat16().double()
    g_bf16 = (torch.softmax(xs, -1) - torch.softmax(xt, -1)).bfloat16().double()  # rounded as the kernel stores
    dw_bf16 = g_bf16.t() @ h.double()
    assert float(((dw_bf16 - ref_dw).abs() / b_dw).max()) > 1.0


@pytest.mark.interpreter
def test_chunked_error_within_twice_the_fused_kernels():
    """The issue's criterion: in bf16 the chunked paths' relative L2 gradient error against float64 is at most 2×
    the fused kernels' (same inputs; before fp32 logits it was 6–8× on the dense loss on an H200)."""
    h, w, ht, wt, ids, lps, valid = _inputs(seed=2)
    *_, s_dh, s_dw = _sparse_reference(h, w, ids, lps)
    *_, d_dh, d_dw = _dense_reference(h, w, ht, wt, 0.0)
    pairs = {
        "sparse": ((lambda h_, w_: logits_chunk.chunked_logits_sparse_jsd(h_, w_, ids, lps, valid,
                                                                          chunk_rows=CHUNK).loss),
                   (lambda h_, w_: ops.fused_sparse_jsd(h_, w_, ids, lps, valid).divergence.sum()), s_dh, s_dw),
        "dense": ((lambda h_, w_: dense_chunk.chunked_dense_teacher_jsd(h_, w_, ht, wt, chunk_rows=CHUNK).loss),
                  (lambda h_, w_: dense_fused.fused_dense_teacher_jsd(h_, w_, ht, wt).divergence.sum()), d_dh, d_dw),
    }
    for name, (chunked, fused, ref_dh, ref_dw) in pairs.items():
        c_dh, c_dw = _run(chunked, h, w)
        f_dh, f_dw = _run(fused, h, w)
        assert rel_l2(c_dh, ref_dh) <= 2 * rel_l2(f_dh, ref_dh), name
        assert rel_l2(c_dw, ref_dw) <= 2 * rel_l2(f_dw, ref_dw), name


def test_raw_logits_are_fp32_products_of_the_half_precision_operands(monkeypatch):
    """Without a mixed-precision GEMM (the CPU; torch < 2.8) the logits come from fp32 GEMMs of upcast weight blocks:
    the float64 products rounded to fp32 within D·2⁻²⁴ of Σ|h||w| (fp32 sums), whatever the block size."""
    from fastdistill_kernels import backward

    assert backward.mixed_mm_supported.__wrapped__(torch.device("cpu"), torch.bfloat16) is False  # uncached
    h, w, *_ = _inputs(seed=3)
    exact = h.double() @ w.double().t()
    scale = h.double().abs() @ w.double().abs().t()
    for block in (256, 64 * 7, 2**24):
        monkeypatch.setattr(backward, "UPCAST_BLOCK_ELEMS", block)
        out = torch.full((N, V), float("nan"))
        logits_chunk._raw_logits(h, w, out)
        assert ((out.double() - exact).abs() <= D * 2.0**-24 * scale).all(), block
