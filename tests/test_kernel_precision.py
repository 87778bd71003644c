"""bf16 gradients of every Triton design against float64, within the precision policy's bound (docs/loss.md,
"Precision policy"; the bound's arithmetic is tests/precision_policy.py), element-wise.

Every design computes the raw logits and the per-row statistics in fp32, rounds ``dL/dx`` once to bf16 for the
gradient GEMMs, sums inside each GEMM in fp32, and rounds dh once and dW once per rounding of its running sum (the
chunked designs once per row chunk unless ``fp32_accumulator``, the deterministic backward once per row block, the
fp32-atomic backward once). The bound is derived from those roundings, not tuned: it fails for dL/dx computed from
bf16-rounded logits (below), the error the chunked designs made before their logits became fp32. The torch path's
own check is tests/test_loss_gemm.py (the same bound, no triton needed).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from fastdistill_kernels import dense_chunk, dense_fused, logits_chunk, ops  # noqa: E402
from precision_policy import (  # noqa: E402
    CHUNK,
    DESIGNS,
    D,
    N,
    V,
    dense_reference,
    dx_unit,
    eps_logits,
    gradients,
    inputs,
    measure,
    policy_bounds,
    rel_l2,
    sparse_reference,
    worst_ratio,
)

TRITON_DESIGNS = [d for d in DESIGNS if d.triton]


@pytest.mark.interpreter
@pytest.mark.parametrize("design", TRITON_DESIGNS, ids=[d.name for d in TRITON_DESIGNS])
def test_each_design_within_the_policy_bound(design):
    """dh and dW of each Triton design in bf16, every element within the policy's bound for the design's roundings."""
    r = measure(design, seed=0)
    assert r["worst_dh"] <= 1.0, r
    assert r["worst_dw"] <= 1.0, r


@pytest.mark.interpreter
def test_the_deterministic_backward_rounds_dw_once_per_row_block():
    """The interpreter's tiles split these N rows into row blocks (so the bound above counts more than one rounding
    of dW for the deterministic designs): the case the policy allows and the bound covers is exercised."""
    design = next(d for d in DESIGNS if d.name == "triton deterministic")
    assert len(design.dw_breaks(N)) >= 2


@pytest.mark.interpreter
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_dense_chunked_mixed_and_reverse_within_the_policy_bound(beta):
    h, w, ht, wt, *_ = x = inputs(seed=1)
    ref = dense_reference(h, w, ht, wt, beta)
    b_dh, b_dw = policy_bounds(ref, h, w, eps_logits((h, w), (ht, wt)), u_dx=dx_unit(),
                               dw_breaks=list(range(CHUNK, N, CHUNK)) + [N])

    class Beta:
        name = f"dense chunked β={beta}"

        @staticmethod
        def loss(h_, w_, _x):
            return dense_chunk.chunked_dense_teacher_jsd(h_, w_, ht, wt, beta=beta, chunk_rows=CHUNK).loss

    dh, dw = gradients(Beta, x)
    assert worst_ratio(dh, ref.dh, b_dh) <= 1.0
    assert worst_ratio(dw, ref.dw, b_dw) <= 1.0


@pytest.mark.interpreter
def test_bounds_are_tight_enough_to_catch_bf16_logits():
    """The same bound fails for dL/dx computed from bf16-rounded logits (the previous chunked design), so it can
    fail."""
    h, w, ht, wt, *_ = inputs(seed=1)
    ref = dense_reference(h, w, ht, wt, 0.0)
    _, b_dw = policy_bounds(ref, h, w, eps_logits((h, w), (ht, wt)), u_dx=dx_unit(),
                            dw_breaks=list(range(CHUNK, N, CHUNK)) + [N])
    xs = (h.double() @ w.double().t()).bfloat16().double()
    xt = (ht.double() @ wt.double().t()).bfloat16().double()
    g_bf16 = (torch.softmax(xs, -1) - torch.softmax(xt, -1)).bfloat16().double()  # rounded as the kernel stores
    dw_bf16 = g_bf16.t() @ h.double()
    assert worst_ratio(dw_bf16, ref.dw, b_dw) > 1.0


@pytest.mark.interpreter
def test_chunked_error_within_twice_the_fused_kernels():
    """The chunked designs' relative L2 gradient error against float64 is at most 2× the fused kernels' (same
    inputs; before fp32 logits it was 6–8× on the dense loss on an H200)."""
    x = inputs(seed=2)
    h, w, ht, wt, ids, lps, valid = x
    s_ref, d_ref = sparse_reference(h, w, ids, lps), dense_reference(h, w, ht, wt, 0.0)

    def named(name, fn):
        return type("Design", (), {"name": name, "loss": staticmethod(fn)})

    pairs = {
        "sparse": (named("chunked", lambda h_, w_, _x: logits_chunk.chunked_logits_sparse_jsd(
                       h_, w_, ids, lps, valid, chunk_rows=CHUNK).loss),
                   named("fused", lambda h_, w_, _x: ops.fused_sparse_jsd(h_, w_, ids, lps, valid).divergence.sum()),
                   s_ref),
        "dense": (named("chunked", lambda h_, w_, _x: dense_chunk.chunked_dense_teacher_jsd(
                      h_, w_, ht, wt, chunk_rows=CHUNK).loss),
                  named("fused", lambda h_, w_, _x: dense_fused.fused_dense_teacher_jsd(
                      h_, w_, ht, wt).divergence.sum()), d_ref),
    }
    for name, (chunked, fused, ref) in pairs.items():
        c_dh, c_dw = gradients(chunked, x)
        f_dh, f_dw = gradients(fused, x)
        assert rel_l2(c_dh, ref.dh) <= 2 * rel_l2(f_dh, ref.dh), name
        assert rel_l2(c_dw, ref.dw) <= 2 * rel_l2(f_dw, ref.dw), name


def test_raw_logits_are_fp32_products_of_the_half_precision_operands(monkeypatch):
    """Without a mixed-precision GEMM (the CPU; torch < 2.8) the logits come from fp32 GEMMs of upcast weight blocks:
    the float64 products rounded to fp32 within D·2⁻²⁴ of Σ|h||w| (fp32 sums), whatever the block size."""
    from fastdistill_kernels import backward

    assert backward.mixed_mm_supported.__wrapped__(torch.device("cpu"), torch.bfloat16) is False  # uncached
    h, w, *_ = inputs(seed=3)
    exact = h.double() @ w.double().t()
    scale = h.double().abs() @ w.double().abs().t()
    for block in (256, 64 * 7, 2**24):
        monkeypatch.setattr(backward, "UPCAST_BLOCK_ELEMS", block)
        out = torch.full((N, V), float("nan"))
        logits_chunk._raw_logits(h, w, out)
        assert ((out.double() - exact).abs() <= D * 2.0**-24 * scale).all(), block


@pytest.mark.parametrize("start", [True, False, (False, False)])
def test_half_precision_output_gemms_combine_split_k_partials_in_fp32(monkeypatch, start):
    """A half-precision-output cuBLAS GEMM of the kernels' host code (dh and dW of the chunked designs, dW of the
    deterministic backward) runs with torch's reduced-precision split-K reductions off, and the flags (their split-K
    setting included) come back as they were, after an error too. A meta tensor takes the non-CPU branch."""
    from fastdistill_kernels import backward

    flags = torch.backends.cuda.matmul

    def state():
        return [(getattr(flags, n), getattr(flags, n + "_split_k", None)) for n in backward.REDUCTION_FLAGS]

    seen = []

    def record(name, real):
        def call(*args, **kw):
            seen.append((name, *(getattr(flags, n) for n in backward.REDUCTION_FLAGS)))
            return real(*args, **kw)
        return call

    monkeypatch.setattr(torch, "mm", record("mm", torch.mm))
    monkeypatch.setattr(torch.Tensor, "addmm_", record("addmm_", torch.Tensor.addmm_))
    a, b = (torch.empty(*shape, device="meta", dtype=torch.bfloat16) for shape in ((5, 7), (7, 3)))
    out = torch.empty(5, 3, device="meta", dtype=torch.bfloat16)
    original = state()
    try:
        flags.allow_bf16_reduced_precision_reduction = start
        before = state()
        backward.gemm_into(out, a, b, accumulate=False)
        backward.gemm_into(out, a, b, accumulate=True)
        assert [name for name, *_ in seen if name == "addmm_"] == ["addmm_"] and seen[0][0] == "mm"
        assert all(tuple(flags_seen) == (False, False) for _, *flags_seen in seen)  # (meta's addmm_ calls mm too)
        assert state() == before
        with pytest.raises(RuntimeError, match="boom"), backward.fp32_split_k():
            raise RuntimeError("boom")
        assert state() == before
    finally:
        for name, value in zip(backward.REDUCTION_FLAGS, original, strict=True):
            setattr(flags, name, value)
