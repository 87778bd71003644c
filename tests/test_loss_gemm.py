"""The torch path's GPU design on the CPU (fastdistill.loss.gemm): bf16 GEMM operands with fp32 results, and the
fp32 ``dL/dz`` tile as two bf16 terms (hi + lo) in the gradient GEMMs. CPU torch has no fp32-output bf16 GEMM, so
:func:`gemm_into` takes its upcast path here, with the same numerics (bf16 products are exact in fp32); the split
path is forced on CPU tensors by patching :func:`fastdistill.loss.chunked.split_operands`."""

from __future__ import annotations

import pytest
import torch
from loss_cases import assert_elementwise, make_case, rel_close, row_log_scale

import fastdistill.loss.api as api
import fastdistill.loss.chunked as chunked
from fastdistill import sparse_jsd_loss
from fastdistill.loss import gemm
from fastdistill.loss.chunked import LossConfig
from fastdistill.loss.support import canonical_mask

EPS32 = torch.finfo(torch.float32).eps
SPLIT_REL = 2.0**-16  # |z − (hi + lo)| ≤ 2⁻⁸·|z − hi| ≤ 2⁻¹⁶·|z| (bf16 rounds to 8 significant bits)


def test_gemm_into_matches_an_fp32_gemm_of_the_upcast_operands(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 19, generator=g).bfloat16(), torch.randn(19, 23, generator=g).bfloat16()
    assert not gemm.mixed_mm_supported(torch.device("cpu"), torch.bfloat16)
    exact = a.float() @ b.float()
    monkeypatch.setattr(gemm, "UPCAST_BLOCK_ELEMS", 19 * 5)  # row blocks of 5: 8 blocks, the last one short
    out = torch.full((37, 23), float("nan"))
    gemm.gemm_into(out, a, b)
    tol = dict(rtol=0, atol=19 * 4 * EPS32 * float((a.float().abs() @ b.float().abs()).max()))  # fp32 sums, any order
    torch.testing.assert_close(out, exact, **tol)
    gemm.gemm_into(out, a, b, accumulate=True)
    torch.testing.assert_close(out, 2 * exact, **tol)
    c = torch.randn(37, 19, generator=g)
    gemm.gemm_into(out, c, b.float())
    torch.testing.assert_close(out, c @ b.float(), **tol)


def test_split_tile_keeps_sixteen_bits():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(8, 300, generator=g) * torch.logspace(-30, 3, 300)  # magnitudes bf16's exponent range covers
    hi, lo = torch.empty_like(z, dtype=torch.bfloat16), torch.empty_like(z, dtype=torch.bfloat16)
    original = z.clone()
    gemm.split_tile(z, hi, lo)
    err = (hi.double() + lo.double() - original.double()).abs()
    assert bool((err <= SPLIT_REL * original.double().abs()).all())
    assert float((hi.double() - original.double()).abs().max() / original.abs().max()) > 1e-4  # hi alone is not


def test_only_bf16_cuda_inputs_with_fp32_output_gemms_are_split(monkeypatch):
    h, w = torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(5, 3, dtype=torch.bfloat16)
    assert not gemm.split_operands(h, w)  # CPU
    monkeypatch.setattr(gemm, "mixed_mm_supported", lambda device, dtype: True)
    cuda = type("T", (), {"dtype": torch.bfloat16, "device": torch.device("cuda")})()
    assert gemm.split_operands(cuda, cuda)
    half = type("T", (), {"dtype": torch.float16, "device": torch.device("cuda")})()
    assert not gemm.split_operands(half, half)  # fp16's range cannot hold the small terms: upcast instead


def test_gpu_chunks_are_large_and_bounded():
    assert chunked.default_chunk_rows(152064, torch.float32, on_gpu=True) == 2**30 // (152064 * 4)  # 1765 rows
    assert chunked.default_chunk_rows(32000, torch.float32, on_gpu=True) == chunked.GPU_MAX_CHUNK_ROWS
    assert chunked.default_chunk_rows(152064, torch.float32) == 55  # the CPU's 32 MiB tile
    assert chunked.scratch_rows(152064, torch.float32, on_gpu=True) == 2**27 // (152064 * 4)
    assert chunked.scratch_rows(152064, torch.float32, on_gpu=False) == chunked.BLOCK_ROWS


def _split_bounds(case, h, w, b, ids, lps, mask, ref_grads, chain, extra_rel, rounded=True):
    """Element-wise bounds of the gradients: rounded once to bf16 (2⁻⁸·|exact|, when ``rounded``) plus the fp32
    evaluation's error and ``extra_rel`` relative error on every dL/dz entry, carried through |W|, |h| and the row
    sum. Every dL/dz_v is at most (p_v + q_v)·L_n·chain (L_n: 1 + the row's largest |logit|, |log-prob|)."""
    logp, q, scale = row_log_scale(h, w, b, ids, lps, mask, chain)
    unit = (16 * EPS32 + 2 * extra_rel) * chain * scale[:, None] * (logp.exp() + q)
    ha, wa = h.detach().double().abs(), w.detach().double().abs()
    u = 2.0**-8 if rounded else 0.0
    return [u * r.abs() + e for r, e in zip(ref_grads, (unit @ wa, unit.t() @ ha, unit.sum(0)), strict=True)]


CASES = [(0.0, None, 1.0), (0.5, 4.0, 1.5), (1.0, None, 0.8)]


def _without_lo(z, hi, lo):
    """:func:`gemm.split_tile` with ``lo`` dropped: one bf16 rounding of dL/dz, what a plain bf16 GEMM takes."""
    gemm.split_tile(z, hi, lo)
    lo.zero_()


def _reference(beta, softcap, scale):
    case = make_case(seed=10)
    ids, lps, mask = case.narrowed(beta)
    h, w, b = case.leaves(torch.bfloat16)
    kw = dict(beta=beta, softcap=softcap, logit_scale=scale)
    hr, wr, br = (x.detach().double().requires_grad_(True) for x in (h, w, b))
    ref = sparse_jsd_loss(hr, wr, ids, lps, mask, bias=br, **kw, backend="reference")
    return case, (h, w, b, ids, lps, mask), kw, ref, torch.autograd.grad(ref.loss, (hr, wr, br))


def _force_split(monkeypatch):
    monkeypatch.setattr(chunked, "split_operands", lambda hidden, weight: hidden.dtype == torch.bfloat16)
    monkeypatch.setattr(chunked, "default_chunk_rows", lambda *a, **k: 7)  # several chunks


@pytest.mark.parametrize("beta,softcap,scale", CASES)
def test_split_path_rounds_each_bf16_gradient_once(monkeypatch, beta, softcap, scale):
    """bf16 inputs through the split path (forced on CPU), via the public API: the loss within fp32 accuracy of
    float64, every gradient entry the float64 one rounded once to bf16 within the bound for 2⁻¹⁶-accurate dL/dz."""
    case, (h, w, b, ids, lps, mask), kw, ref, ref_grads = _reference(beta, softcap, scale)
    _force_split(monkeypatch)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, **kw, backend="torch")
    grads = torch.autograd.grad(out.loss, (h, w, b))
    rel_close(out.loss, ref.loss, 1e-5, "loss")
    bounds = _split_bounds(case, h, w, b, ids, lps, mask, ref_grads, scale, SPLIT_REL)
    for name, g, r, bound in zip(("dh", "dW", "db"), grads, ref_grads, bounds, strict=True):
        assert g.dtype == torch.bfloat16
        assert_elementwise(g, r, bound, name)


@pytest.mark.parametrize("beta,softcap,scale", CASES)
def test_split_gemms_keep_the_fp32_gradients_at_sixteen_bits(monkeypatch, beta, softcap, scale):
    """The gradients before their rounding to bf16 (fp32, from :func:`sparse_jsd_rows`): within the fp32 error plus
    2⁻¹⁶ of |dL/dz| of float64; with ``lo`` dropped (one bf16 rounding of dL/dz, what a plain bf16 GEMM does) dh
    and dW are off by ten times as much or more."""
    case, (h, w, b, ids, lps, mask), kw, ref, ref_grads = _reference(beta, softcap, scale)
    _force_split(monkeypatch)
    hs, ids_s, lps_s, valid, _, _ = api._scored_rows(h, ids, lps, mask, None)
    keep = canonical_mask(ids, lps, mask).any(dim=1)
    cfg = LossConfig(logit_scale=scale, softcap=softcap, beta=beta, temperature=1.0, add_tail_bucket=True,
                     tail_mode="exact")
    bounds = _split_bounds(case, h, w, b, ids, lps, mask, ref_grads, scale, SPLIT_REL, rounded=False)
    refs = (ref_grads[0][keep], ref_grads[1], ref_grads[2])
    bounds[0] = bounds[0][keep]

    def worst_excess():
        with torch.no_grad():
            got = chunked.sparse_jsd_rows(hs, w, b, ids_s, lps_s, valid, cfg, need_dh=True, need_dw=True,
                                          need_db=True)[3:]
        for name, g, r, bound in zip(("dh", "dW", "db"), got, refs, bounds, strict=True):
            assert g.dtype == torch.float32
            assert_elementwise(g, r, bound, name)
        return max(float(((g.double() - r).abs() / bound).max()) for g, r, bound in zip(got[:2], refs[:2],
                                                                                         bounds[:2], strict=True))

    split = worst_excess()

    monkeypatch.setattr(chunked, "split_tile", _without_lo)
    try:
        rounded = worst_excess()
    except AssertionError:
        return  # beyond the bound
    assert rounded >= 10 * split, (rounded, split)  # within the (envelope) bound, but an order of magnitude worse


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_dense_teacher_split_path_matches_its_fp32_path(monkeypatch, beta):
    """The dense-teacher torch path on bf16 inputs, split (forced on CPU) against the same rows with the operands
    upcast to fp32 (the CPU's path, itself checked against float64 in test_dense_teacher.py): the statistics agree to
    fp32 rounding (the logits are the same exact products), the gradients within 4·2⁻¹⁶ of the largest entry (the
    split dL/dz); ``hi`` alone is more than ten times further off."""
    from test_dense_teacher import make_inputs

    import fastdistill.loss.dense as dense

    x = make_inputs(seed=5, N=40, V=96, Vt=110)
    args = [x[k].bfloat16() for k in ("hs", "ws", "bs", "ht", "wt", "bt")]

    def rows(split: bool):
        monkeypatch.setattr(dense, "split_operands", lambda h, w: split and h.dtype == torch.bfloat16)
        with torch.no_grad():
            return dense.dense_rows(*args, dense.Head(1.2, 3.0, 0.7), dense.Head(0.9, 4.0, 0.7), beta, need_dh=True,
                                    need_dw=True, need_db=True, chunk_rows=7, row_weights=x["token_weights"])

    upcast, split = rows(False), rows(True)
    for name, a, r in zip(("div", "ent", "tent", "dropped"), split[:4], upcast[:4], strict=True):
        rel_close(a, r, 4 * EPS32, name)
    for name, a, r in zip(("dh", "dW", "db"), split[4:], upcast[4:], strict=True):
        assert a.dtype == torch.float32
        rel_close(a, r, 4 * SPLIT_REL, name)
    monkeypatch.setattr(dense, "split_tile", _without_lo)
    for name, a, r in zip(("dh", "dW"), rows(True)[4:6], upcast[4:6], strict=True):
        with pytest.raises(AssertionError, match="max error"):
            rel_close(a, r, 40 * SPLIT_REL, f"{name} from hi alone")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output bf16 GEMMs are CUDA's")
@pytest.mark.parametrize("beta,softcap,scale", CASES)
def test_on_cuda_bf16_inputs_take_the_split_gemms_at_fp32_accuracy(beta, softcap, scale):
    """On a GPU, unforced: torch has the fp32-output GEMM, the torch path splits, and every bf16 gradient entry is
    the float64 one rounded once within the bound of the CPU test above."""
    assert gemm.mixed_mm_supported(torch.device("cuda"), torch.bfloat16)
    case, (h, w, b, ids, lps, mask), kw, ref, ref_grads = _reference(beta, softcap, scale)
    leaves = [x.detach().cuda().requires_grad_(True) for x in (h, w, b)]
    assert gemm.split_operands(leaves[0], leaves[1])
    out = sparse_jsd_loss(*leaves[:2], ids.cuda(), lps.cuda(), mask.cuda(), bias=leaves[2], **kw, backend="torch")
    grads = torch.autograd.grad(out.loss, leaves)
    rel_close(out.loss.cpu(), ref.loss, 1e-5, "loss")
    bounds = _split_bounds(case, h, w, b, ids, lps, mask, ref_grads, scale, SPLIT_REL)
    for name, g, r, bound in zip(("dh", "dW", "db"), grads, ref_grads, bounds, strict=True):
        assert g.dtype == torch.bfloat16
        assert_elementwise(g.cpu(), r, bound, name)
