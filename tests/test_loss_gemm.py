"""The torch path's GPU design on the CPU (fastdistill.loss.gemm): bf16 GEMM operands with fp32 results, ``dL/dz``
rounded once to bf16 for the gradient GEMMs, dh and dW summed in fp32 (the precision policy of docs/loss.md). CPU
torch has no fp32-output bf16 GEMM, so :func:`gemm_into` takes its upcast path here, with the same numerics (bf16
products are exact in fp32); the half-precision path is forced on CPU tensors by patching
:func:`fastdistill.loss.chunked.half_operands`."""

from __future__ import annotations

import pytest
import torch
from loss_cases import assert_elementwise, make_case, rel_close, row_log_scale
from precision_policy import DESIGNS, measure

import fastdistill.loss.chunked as chunked
import fastdistill.loss.dense as dense
from fastdistill import sparse_jsd_loss
from fastdistill.loss import gemm

EPS32 = torch.finfo(torch.float32).eps
U = 2.0**-8  # dL/dz rounded once to bf16, round to nearest


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


def test_round_gradient_tile_rounds_each_entry_once():
    """The scaled tile rounded once to bf16 (round to nearest of the fp32 product), and the candidates' entries
    placed at their ids; a slot that repeats an id (an invalid slot, carrying 0) leaves the entry as it is."""
    g = torch.Generator().manual_seed(1)
    z = torch.rand(2, 50, generator=g) * torch.logspace(-30, 0, 50)
    ids = torch.tensor([[3, 7, 3], [0, 49, 0]])
    cand = torch.tensor([[0.3, -1.7, 0.0], [2.2, 1e-3, 0.0]])
    z.scatter_(1, ids, 0.0)  # the tile holds 0 at the candidates
    scale = torch.tensor([1.5, -2.0])
    out = torch.full((2, 50), float("nan"), dtype=torch.bfloat16)
    gemm.round_gradient_tile(z, scale, ids, cand, out)
    expected = (z * scale[:, None]).bfloat16()
    for (r, c), value in {(0, 3): 0.3, (0, 7): -1.7, (1, 0): 2.2, (1, 49): 1e-3}.items():
        expected[r, c] = torch.tensor(value).bfloat16()
    assert torch.equal(out, expected)


def test_only_bf16_cuda_inputs_with_fp32_output_gemms_stay_half(monkeypatch):
    h, w = torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(5, 3, dtype=torch.bfloat16)
    assert not gemm.half_operands(h, w)  # CPU
    monkeypatch.setattr(gemm, "mixed_mm_supported", lambda device, dtype: True)
    cuda = type("T", (), {"dtype": torch.bfloat16, "device": torch.device("cuda")})()
    assert gemm.half_operands(cuda, cuda)
    half = type("T", (), {"dtype": torch.float16, "device": torch.device("cuda")})()
    assert not gemm.half_operands(half, half)  # fp16 is upcast: fp32 GEMMs, more accurate than the policy asks


def test_gpu_chunks_are_large_and_bounded():
    assert chunked.default_chunk_rows(152064, torch.float32, on_gpu=True) == 2**30 // (152064 * 4)  # 1765 rows
    assert chunked.default_chunk_rows(32000, torch.float32, on_gpu=True) == chunked.GPU_MAX_CHUNK_ROWS
    assert chunked.default_chunk_rows(152064, torch.float32) == 55  # the CPU's 32 MiB tile
    assert chunked.scratch_rows(152064, torch.float32, on_gpu=True) == 2**27 // (152064 * 4)
    assert chunked.scratch_rows(152064, torch.float32, on_gpu=False) == chunked.BLOCK_ROWS


def _half_bounds(case, h, w, b, ids, lps, mask, ref_grads, chain):
    """Element-wise bounds of the bf16 gradients: rounded once to bf16 (2⁻⁸·|exact|) plus the fp32 evaluation's error
    and the 2⁻⁸ rounding of every dL/dz entry, carried through |W|, |h| and the row sum. Every dL/dz_v is at most
    (p_v + q_v)·L_n·chain (L_n: 1 + the row's largest |logit|, |log-prob|)."""
    logp, q, scale = row_log_scale(h, w, b, ids, lps, mask, chain)
    unit = (16 * EPS32 + 2 * U) * chain * scale[:, None] * (logp.exp() + q)
    ha, wa = h.detach().double().abs(), w.detach().double().abs()
    return [U * r.abs() + e for r, e in zip(ref_grads, (unit @ wa, unit.t() @ ha, unit.sum(0)), strict=True)]


CASES = [(0.0, None, 1.0), (0.5, 4.0, 1.5), (1.0, None, 0.8)]


def _reference(beta, softcap, scale):
    case = make_case(seed=10)
    ids, lps, mask = case.narrowed(beta)
    h, w, b = case.leaves(torch.bfloat16)
    kw = dict(beta=beta, softcap=softcap, logit_scale=scale)
    hr, wr, br = (x.detach().double().requires_grad_(True) for x in (h, w, b))
    ref = sparse_jsd_loss(hr, wr, ids, lps, mask, bias=br, **kw, backend="reference")
    return case, (h, w, b, ids, lps, mask), kw, ref, torch.autograd.grad(ref.loss, (hr, wr, br))


def _force_half(monkeypatch):
    monkeypatch.setattr(chunked, "half_operands", lambda hidden, weight: hidden.dtype == torch.bfloat16)
    monkeypatch.setattr(chunked, "default_chunk_rows", lambda *a, **k: 7)  # several chunks


@pytest.mark.parametrize("beta,softcap,scale", CASES)
def test_half_path_gradients_within_the_policy_bound(monkeypatch, beta, softcap, scale):
    """bf16 inputs through the half-precision path (forced on CPU), via the public API, bias, softcap and logit scale
    included: the loss within fp32 accuracy of float64, every gradient entry within the policy's bound (dL/dz rounded
    once, fp32 sums, each gradient rounded once)."""
    case, (h, w, b, ids, lps, mask), kw, ref, ref_grads = _reference(beta, softcap, scale)
    _force_half(monkeypatch)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, **kw, backend="torch")
    grads = torch.autograd.grad(out.loss, (h, w, b))
    rel_close(out.loss, ref.loss, 1e-5, "loss")
    bounds = _half_bounds(case, h, w, b, ids, lps, mask, ref_grads, scale)
    for name, g, r, bound in zip(("dh", "dW", "db"), grads, ref_grads, bounds, strict=True):
        assert g.dtype == torch.bfloat16
        assert_elementwise(g, r, bound, name)


TORCH_DESIGNS = [d for d in DESIGNS if not d.triton]


@pytest.mark.parametrize("design", TORCH_DESIGNS, ids=[d.name for d in TORCH_DESIGNS])
def test_torch_path_within_the_policy_bound(design):
    """The torch paths (sparse and dense teacher) against the policy's bound of tests/precision_policy.py, the one
    every Triton design is held to (tests/test_kernel_precision.py): fp32 dW, so one rounding of it."""
    r = measure(design, seed=0)
    assert r["dw_roundings"] == 1
    assert r["worst_dh"] <= 1.0, r
    assert r["worst_dw"] <= 1.0, r


def _count_gemm_flops(monkeypatch, module):
    flops = []
    real = module.gemm_into

    def counted(out, a, b, **kw):
        flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        real(out, a, b, **kw)

    monkeypatch.setattr(module, "gemm_into", counted)
    return flops


def test_half_path_does_six_ndv_gemm_flops(monkeypatch):
    """Logits, dh and dW: three GEMMs per chunk, 6·N·D·V in all (the split dL/dz took 10)."""
    case, (h, w, b, ids, lps, mask), kw, *_ = _reference(0.0, None, 1.0)
    _force_half(monkeypatch)
    flops = _count_gemm_flops(monkeypatch, chunked)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, **kw, backend="torch")
    n = int(mask.any(dim=1).sum())  # scored rows
    assert sum(flops) == 6 * n * h.shape[1] * w.shape[0]
    torch.autograd.grad(out.loss, (h, w, b))


def test_dense_half_path_does_six_ndv_student_gemm_flops(monkeypatch):
    """The dense-teacher torch path: the student's 6·N·D·V and the teacher's logits (2·N·D_t·V), nothing more."""
    from test_dense_teacher import make_inputs

    x = make_inputs(seed=5, N=40, V=96, Vt=96)
    args = [x[k].bfloat16() for k in ("hs", "ws", "bs", "ht", "wt", "bt")]
    monkeypatch.setattr(dense, "half_operands", lambda hidden, weight: hidden.dtype == torch.bfloat16)
    flops = _count_gemm_flops(monkeypatch, dense)
    with torch.no_grad():
        dense.dense_rows(*args, dense.Head(1.2, 3.0, 0.7), dense.Head(0.9, 4.0, 0.7), 0.5, need_dh=True,
                         need_dw=True, need_db=True, chunk_rows=7)
    n, d_s, v = args[0].shape[0], args[0].shape[1], args[1].shape[0]
    assert sum(flops) == 6 * n * d_s * v + 2 * n * args[3].shape[1] * v


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output bf16 GEMMs are CUDA's")
@pytest.mark.parametrize("beta,softcap,scale", CASES)
def test_on_cuda_bf16_inputs_take_the_half_gemms_within_the_policy_bound(beta, softcap, scale):
    """On a GPU, unforced: torch has the fp32-output GEMM, the torch path keeps bf16 operands, and every bf16
    gradient entry is within the bound of the CPU test above."""
    assert gemm.mixed_mm_supported(torch.device("cuda"), torch.bfloat16)
    case, (h, w, b, ids, lps, mask), kw, ref, ref_grads = _reference(beta, softcap, scale)
    leaves = [x.detach().cuda().requires_grad_(True) for x in (h, w, b)]
    assert gemm.half_operands(leaves[0], leaves[1])
    out = sparse_jsd_loss(*leaves[:2], ids.cuda(), lps.cuda(), mask.cuda(), bias=leaves[2], **kw, backend="torch")
    grads = torch.autograd.grad(out.loss, leaves)
    rel_close(out.loss.cpu(), ref.loss, 1e-5, "loss")
    bounds = _half_bounds(case, h, w, b, ids, lps, mask, ref_grads, scale)
    for name, g, r, bound in zip(("dh", "dW", "db"), grads, ref_grads, bounds, strict=True):
        assert g.dtype == torch.bfloat16
        assert_elementwise(g.cpu(), r, bound, name)
