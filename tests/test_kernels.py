"""The Triton kernels (fastdistill_kernels): under Triton's CPU interpreter without a GPU, compiled on a GPU.

Without CUDA (or with ``TRITON_INTERPRET=1``) the kernels run in the interpreter on CPU tensors, against the float64
dense reference. Shapes are tiny and tiles are 32×64×32 (the interpreter's default tiles) so that N, V and D are
never multiples of a tile and several tiles, vocabulary splits and workspace chunks are exercised.

With CUDA (and no ``TRITON_INTERPRET=1``) the interpreter tests are skipped and the ``cuda_compiled`` tests run the
compiled kernels on the GPU: loss, entropies, dh, dW and db against the torch path, every backward mode and dtype.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported: kernels run on the CPU
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")
import triton.language as tl  # noqa: E402
from fastdistill_kernels import TileConfig, backward, config, fused_sparse_jsd, ops  # noqa: E402
from loss_cases import make_case, rel_close  # noqa: E402

import fastdistill.loss.api as api  # noqa: E402
from fastdistill import sparse_jsd_loss  # noqa: E402
from fastdistill.loss.support import canonical_mask  # noqa: E402

cuda_compiled = pytest.mark.skipif(not CUDA or INTERPRETER, reason="the compiled kernels need a CUDA GPU "
                                   "(and TRITON_INTERPRET unset)")

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels" / "fastdistill_kernels"
FIELDS = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum")
FP32_RTOL = 1e-5
# bf16 gradients: dL/dx is rounded to bf16 for the GEMMs (as on tensor cores), then the result is rounded. Where
# the candidate and non-candidate contributions cancel (small dh, e.g. beta=1) that reaches ~8e-3 of max |dh|.
BF16_GRAD_RTOL = 1e-2


def _case(seed, **kw):
    """N=40 (not a multiple of the 32-row tile), V=300 (not a multiple of the 64-column tile), D=48."""
    return make_case(seed=seed, N=40, D=48, V=300, K=8, **kw)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


def _scored_inputs(case, beta, dtype):
    """Leaves in ``dtype`` and the canonical slots of the rows with teacher signal (the kernel op's contract)."""
    ids, lps, mask = case.narrowed(beta)
    valid = canonical_mask(ids, lps, mask)
    keep = valid.any(dim=1)
    h, w, b = case.leaves(dtype)
    h = h[keep].detach().requires_grad_(True)
    return h, w, b, ids[keep], lps[keep], valid[keep]


def _reference_rows(h, w, b, ids, lps, valid, **kw):
    """Per-row float64 reference losses, differentiable: one dense reference call per row."""
    h, w, b = (x.detach().double().requires_grad_(True) for x in (h, w, b))
    rows = [sparse_jsd_loss(h[n:n + 1], w, ids[n:n + 1], lps[n:n + 1], valid[n:n + 1], bias=b, backend="reference",
                            **kw).loss for n in range(h.shape[0])]
    return torch.stack(rows), (h, w, b)


API_GRID = [
    # beta, add_tail_bucket, tail_mode, softcap, temperature, dtype
    (0.0, True, "exact", None, 1.0, torch.float32),
    (0.0, True, "trl", 4.0, 0.7, torch.float32),
    (0.0, False, "exact", None, 1.3, torch.float32),
    (0.3, True, "exact", 4.0, 1.3, torch.float32),
    (0.3, True, "trl", None, 0.7, torch.float32),
    (0.3, False, "exact", 4.0, 1.0, torch.float32),
    (1.0, True, "exact", None, 0.7, torch.float32),
    (1.0, True, "trl", 4.0, 1.3, torch.float32),
    (0.0, True, "exact", 4.0, 0.7, torch.bfloat16),
    (0.3, True, "trl", None, 1.0, torch.bfloat16),
    (1.0, True, "exact", 4.0, 1.3, torch.bfloat16),
]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("beta,tail,mode,softcap,T,dtype", API_GRID)
def test_triton_backend_matches_float64_reference(beta, tail, mode, softcap, T, dtype):
    """Through sparse_jsd_loss: padded, duplicated and masked slots, rows without signal, bias, two teachers."""
    case = _case(seed=int(beta * 10) + int(T * 7), empty_rows=3)
    ids, lps, mask = case.narrowed(beta)
    kw = dict(beta=beta, temperature=T, softcap=softcap, add_tail_bucket=tail, tail_mode=mode, logit_scale=1.5,
              teacher_index=case.teacher_index, num_teachers=2)
    h, w, b = case.leaves(dtype)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, backend="triton", **kw)
    grads = _grads(out.loss, (h, w, b))
    hr, wr, br = (x.detach().double().requires_grad_(True) for x in (h, w, b))  # the rounded inputs, in float64
    ref = sparse_jsd_loss(hr, wr, ids, lps, mask, bias=br, backend="reference", **kw)
    ref_grads = _grads(ref.loss, (hr, wr, br))

    assert int(out.num_tokens) == int(ref.num_tokens) < case.hidden.shape[0]
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), FP32_RTOL, f)
    rel_close(out.per_teacher, ref.per_teacher, FP32_RTOL, "per_teacher")
    grad_rtol = FP32_RTOL if dtype == torch.float32 else BF16_GRAD_RTOL
    for name, g, r, x in zip(("dh", "dW", "db"), grads, ref_grads, (h, w, b), strict=True):
        assert g.dtype == x.dtype
        rel_close(g, r, grad_rtol, name)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("backward_mode", ["deterministic", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_modes_with_per_row_upstream_gradients(backward_mode, dtype):
    """The op's per-row divergences, weighted per row (negative, zero and large weights included)."""
    case = _case(seed=21)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.0, dtype)
    kw = dict(logit_scale=1.2, softcap=5.0, temperature=0.8, beta=0.0)
    weights = torch.linspace(-1.0, 3.0, h.shape[0])
    weights[3] = 0.0
    config = TileConfig(block_rows=32, block_vocab=64, block_d=32, vocab_splits=3, workspace_bytes=8192)
    out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode=backward_mode, config=config, **kw)
    grads = _grads((out.divergence * weights).sum(), (h, w, b))
    ref_rows, ref_leaves = _reference_rows(h, w, b, ids, lps, valid, **kw)
    ref_grads = _grads((ref_rows * weights.double()).sum(), ref_leaves)

    rel_close(out.divergence, ref_rows, FP32_RTOL, "per-row divergence")
    grad_rtol = FP32_RTOL if dtype == torch.float32 else BF16_GRAD_RTOL
    for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
        rel_close(g, r, grad_rtol, name)


@pytest.mark.interpreter
def test_forward_in_row_block_slabs_matches_one_launch(monkeypatch):
    """Row blocks sit on grid axis 1 (at most 65,535 on CUDA): more are launched in slabs from first_row_block.
    Slabs of one row block give exactly the single launch's results."""
    from fastdistill_kernels import forward
    case = _case(seed=21)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.0, torch.float32)
    config = TileConfig(block_rows=32, block_vocab=64, block_d=32, vocab_splits=3, workspace_bytes=8192)
    one = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, config=config)
    launches = []
    kernel = forward._forward_kernel
    monkeypatch.setattr(forward, "MAX_GRID_Y", 1)
    monkeypatch.setattr(forward, "_forward_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        launches.append(grid), kernel[grid])[1]})())
    slabs = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, config=config)
    assert len(launches) == -(-h.shape[0] // 32) > 1 and all(g[1] == 1 for g in launches)
    for a, c in zip(one, slabs, strict=True):
        assert torch.equal(a, c)


def _concentrated_case(N=40, D=48, V=512, K=8, seed=5):
    """Candidates drawn from the first 64 ids only, and a bias that puts almost all of the student's mass there:
    every other vocabulary tile holds only tiny gradients."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).requires_grad_(True)
    w = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_(True)
    b = torch.where(torch.arange(V) < 64, 12.0, 0.0).requires_grad_(True)
    ids = torch.stack([torch.randperm(64, generator=g)[:K] for _ in range(N)])
    lps = torch.log_softmax(torch.randn(N, K + 1, generator=g), dim=-1)[:, :K]  # last = the teacher's tail
    return h, w, b, ids, lps, torch.ones(N, K, dtype=torch.bool)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("backward_mode", ["deterministic", "fused"])
def test_gradient_filter_error_stays_within_its_bound(backward_mode):
    """Each skipped entry has |dL/dx| < eps·|g_row|, so |Δdh[n, d]| ≤ eps·|g_n|·Σ_v |W[v, d]|,
    |ΔdW[v, d]| ≤ eps·Σ_n |g_n|·|h[n, d]| and |Δdb[v]| ≤ eps·Σ_n |g_n|."""
    h, w, b, ids, lps, valid = _concentrated_case()
    weights = torch.linspace(0.5, 2.0, h.shape[0])
    eps = 1e-3

    def run(filter_eps):
        out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode=backward_mode, filter_eps=filter_eps)
        return _grads((out.divergence * weights).sum(), (h, w, b))

    (dh_f, dw_f, db_f), (dh, dw, db) = run(eps), run(None)
    ref_rows, ref_leaves = _reference_rows(h, w, b, ids, lps, valid)
    ref_grads = _grads((ref_rows * weights.double()).sum(), ref_leaves)
    for name, g, r in zip(("dh", "dW", "db"), (dh, dw, db), ref_grads, strict=True):
        rel_close(g, r, FP32_RTOL, f"exact {name}")
    assert not torch.equal(dw_f, dw), "the filter skipped nothing: the case does not exercise it"
    slack = 1e-6  # fp32 summation-order noise
    assert ((dh_f - dh).abs() <= eps * weights.abs()[:, None] * w.detach().abs().sum(dim=0) + slack).all()
    assert ((dw_f - dw).abs() <= eps * (weights.abs()[:, None] * h.detach().abs()).sum(dim=0) + slack).all()
    assert ((db_f - db).abs() <= eps * weights.abs().sum() + slack).all()


@pytest.mark.interpreter
def test_rows_whose_candidates_cover_the_vocabulary():
    """No non-candidate column: the exact tail bucket is absent (tail log-sum-exp over an empty set)."""
    g = torch.Generator().manual_seed(3)
    N, D, V = 6, 40, 64
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5
    teacher = torch.log_softmax(torch.randn(N, V, generator=g), dim=-1)
    ids = torch.arange(V).repeat(N, 1)
    mask = torch.ones(N, V, dtype=torch.bool)
    mask[3:, 5:] = False  # rows 3..5 keep five candidates and a real tail
    for beta in (0.0, 1.0):
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = sparse_jsd_loss(hk, wk, ids, teacher, mask, beta=beta, backend="triton")
        hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
        ref = sparse_jsd_loss(hr, wr, ids, teacher, mask, beta=beta, backend="reference")
        rel_close(out.loss, ref.loss, FP32_RTOL, "loss")
        for name, a, r in zip(("dh", "dW"), _grads(out.loss, (hk, wk)), _grads(ref.loss, (hr, wr)), strict=True):
            rel_close(a, r, FP32_RTOL, name)


@pytest.mark.interpreter
def test_scalar_upstream_gradient_and_only_requested_gradients():
    case = _case(seed=8)
    ids, lps, mask = case.narrowed(0.3)
    h, w, _ = case.leaves()
    w.requires_grad_(False)
    out = sparse_jsd_loss(h, w, ids, lps, mask, beta=0.3, backend="triton")
    (2.5 * out.loss).backward()
    assert w.grad is None
    h1 = case.leaves()[0]
    sparse_jsd_loss(h1, w, ids, lps, mask, beta=0.3, backend="triton").loss.backward()
    torch.testing.assert_close(h.grad, 2.5 * h1.grad)


@pytest.mark.interpreter
def test_token_weights_match_the_torch_path():
    case = _case(seed=9)
    ids, lps, mask = case.narrowed(0.0)
    h, w, _ = case.leaves()
    h2, w2, _ = case.leaves()
    weights = torch.rand(h.shape[0], generator=torch.Generator().manual_seed(0)) * 2
    out = sparse_jsd_loss(h, w, ids, lps, mask, token_weights=weights, backend="triton")
    ref = sparse_jsd_loss(h2, w2, ids, lps, mask, token_weights=weights, backend="torch")
    rel_close(out.loss, ref.loss, FP32_RTOL, "loss")
    for name, a, r in zip(("dh", "dW"), _grads(out.loss, (h, w)), _grads(ref.loss, (h2, w2)), strict=True):
        rel_close(a, r, FP32_RTOL, name)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "triton-chunked"])
def test_no_scored_rows_gives_zero_loss_connected_to_graph(backend):
    case = _case(seed=1)
    for n in (0, 4):  # no rows at all; rows without any usable slot
        h, w, b = case.leaves()
        h = h[:n].detach().requires_grad_(True)
        ids = torch.full((n, 3), -1)
        lps = torch.full((n, 3), -torch.inf)
        out = sparse_jsd_loss(h, w, ids, lps, ids >= 0, bias=b, backend=backend)
        assert float(out.loss.detach()) == 0.0 and int(out.num_tokens) == 0 and out.loss.requires_grad
        out.loss.backward()
        for g in (h.grad, w.grad, b.grad):
            assert g is not None and torch.count_nonzero(g) == 0


def test_auto_backend_keeps_cpu_tensors_on_the_torch_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("auto must not pick the Triton kernels for CPU tensors")

    monkeypatch.setattr(api, "_triton_sparse_jsd", refuse)
    case = _case(seed=2)
    h, w, b = case.leaves()
    assert torch.isfinite(sparse_jsd_loss(h, w, *case.narrowed(0.0), bias=b).loss)


@pytest.mark.interpreter
def test_triton_backend_errors_are_clear(monkeypatch):
    case = _case(seed=2)
    args = (*case.leaves()[:2], *case.narrowed(0.0))
    with pytest.raises(ValueError, match="takes float32, bfloat16 or float16 hidden"):
        sparse_jsd_loss(args[0].double(), *args[1:], backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="use CUDA tensors, or set TRITON_INTERPRET=1"):
        sparse_jsd_loss(*args, backend="triton")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'fastdistill\[gpu\]'"):
        sparse_jsd_loss(*args, backend="triton")


@pytest.mark.interpreter
def test_op_rejects_bad_settings():
    case = _case(seed=2)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.0, torch.float32)
    with pytest.raises(ValueError, match="backward_mode must be one of"):
        fused_sparse_jsd(h, w, ids, lps, valid, backward_mode="atomic")
    with pytest.raises(ValueError, match="filter_eps must be None or a finite number > 0"):
        fused_sparse_jsd(h, w, ids, lps, valid, filter_eps=0.0)


@pytest.mark.interpreter
def test_loads_through_the_hugging_face_kernels_library():
    kernels = pytest.importorskip("kernels", reason="the Hugging Face `kernels` package is not installed")
    module = kernels.get_local_kernel(KERNELS_DIR)
    assert module.__name__ != "fastdistill_kernels"  # a second, independent copy of the package
    case = _case(seed=4)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.0, torch.float32)
    loaded = module.fused_sparse_jsd(h, w, ids, lps, valid, bias=b).divergence
    direct = fused_sparse_jsd(h, w, ids, lps, valid, bias=b).divergence
    torch.testing.assert_close(loaded, direct, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ dW without addmm
@pytest.mark.interpreter
def test_dw_fallback_without_mixed_precision_addmm_matches_float64(monkeypatch):
    """Torch releases without ``addmm(..., out_dtype=float32)`` take fp32 GEMMs of upcast column blocks: same
    result as one float64 product of the half-precision operands, to fp32 rounding, whatever the block size."""
    g = torch.Generator().manual_seed(0)
    dx = torch.randn(40, 300, generator=g).bfloat16()
    h = torch.randn(40, 48, generator=g).bfloat16()
    expected = 0.5 + dx.double().t() @ h.double()
    for block in (40 * 7, 40 * 300, 1):  # uneven blocks, one block, one column per block
        dw = torch.full((300, 48), 0.5)
        backward.accumulate_dw_upcast(dw, dx, h, block_elems=block)
        rel_close(dw, expected, 1e-6, f"dW, blocks of {block} elements")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deterministic_backward_forced_onto_the_fallback(monkeypatch, dtype):
    """The whole op with the mixed-precision GEMM reported missing and tiny upcast blocks (several per vocabulary
    chunk, for dh += dx @ W[chunk] and dW[chunk] = dxᵀ @ h alike)."""
    calls, blocks = [], []
    upcast = backward.addmm_upcast
    monkeypatch.setattr(backward, "mixed_addmm_supported", lambda device, dtype: calls.append(dtype) or False)
    monkeypatch.setattr(backward, "UPCAST_BLOCK_ELEMS", 64 * 20)
    monkeypatch.setattr(backward, "addmm_upcast", lambda *a: blocks.append((a[1].shape, a[-1])) or upcast(*a))
    case = _case(seed=21)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.0, dtype)
    out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode="deterministic")
    grads = _grads(out.divergence.sum(), (h, w, b))
    ref_rows, ref_leaves = _reference_rows(h, w, b, ids, lps, valid)
    for name, got, ref in zip(("dh", "dW", "db"), grads, _grads(ref_rows.sum(), ref_leaves), strict=True):
        rel_close(got, ref, BF16_GRAD_RTOL, name)
    assert calls and set(calls) == {dtype}, "the deterministic backward did not ask about the mixed-precision GEMM"
    assert {e for _, e in blocks} == {64 * 20}
    # two GEMMs per chunk (dh and dW), several chunks and row blocks, most operands larger than one block
    assert len(blocks) >= 4 and sum(shape.numel() > 64 * 20 for shape, _ in blocks) >= 4, blocks


@pytest.mark.interpreter
def test_deterministic_backward_is_bitwise_reproducible(dtype=torch.bfloat16):
    """Same inputs, same bits: vocabulary chunks (here one tile each) of fixed shape and summation order."""
    case = _case(seed=4)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.3, dtype)
    config = TileConfig(block_rows=32, block_vocab=64, block_d=32, vocab_splits=2,
                        workspace_bytes=h.shape[0] * 64 * h.element_size() * 2 - 1)
    assert backward.vocab_chunk_tiles(config, h.shape[0], 5, h.element_size()) == 1

    def run():
        out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, beta=0.3, softcap=4.0, config=config)
        return (out.divergence, *_grads(out.divergence.sum(), (h, w, b)))

    first, second = run(), run()
    for name, a, c in zip(("divergence", "dh", "dW", "db"), first, second, strict=True):
        assert torch.equal(a, c), name


def test_vocabulary_chunks_stay_within_the_workspace_bound():
    """Chunk width: as many tiles as the (N, chunk) workspace fits in workspace_bytes, at least one, at most V."""
    cfg = TileConfig(block_vocab=128, workspace_bytes=2**28)
    n, tiles = 16384, 1188  # Qwen-like: N = 16384 rows, V = 152064
    chunk = backward.vocab_chunk_tiles(cfg, n, tiles, 2)
    assert chunk == 64 and n * chunk * 128 * 2 <= cfg.workspace_bytes < n * (chunk + 1) * 128 * 2
    assert backward.vocab_chunk_tiles(cfg, 10**7, tiles, 2) == 1  # a tile wider than the budget: still one
    assert backward.vocab_chunk_tiles(cfg, 8, tiles, 4) == tiles  # everything fits: one chunk


@pytest.mark.interpreter
def test_candidates_crowded_into_tiles_and_split_edges(backward_mode="fused"):
    """Several candidates of one row in the same vocabulary tile (several trips of the per-row cursor), ids on
    tile and split boundaries (0, 63, 64, 127, 128, V − 1), slots in no particular order, invalid slots between
    valid ones, and a valid slot whose id lies outside the vocabulary (treated as invalid) — against float64.
    Both backward modes place candidates with the same kernel code; the fused one is run."""
    g = torch.Generator().manual_seed(9)
    n, d, v, k = 33, 40, 300, 9
    h = torch.randn(n, d, generator=g).requires_grad_(True)
    w = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_(True)
    b = (0.1 * torch.randn(v, generator=g)).requires_grad_(True)
    edges = torch.tensor([0, 63, 64, 127, 128, 191, 192, v - 1])
    ids = torch.stack([torch.cat([edges[torch.randperm(8, generator=g)[:4]], torch.randperm(v, generator=g)[:k - 4]])
                       for _ in range(n)])
    ids[:5, :6] = torch.tensor([10, 12, 11, 50, 30, 20])  # six candidates in the first tile
    ids = torch.stack([row[torch.randperm(k, generator=g)] for row in ids])
    valid = canonical_mask(ids, torch.zeros(n, k), torch.rand(n, k, generator=g) > 0.15)
    valid[:, 0] = True
    valid = canonical_mask(ids, torch.zeros(n, k), valid)
    lps = torch.log_softmax(torch.randn(n, k + 1, generator=g), dim=-1)[:, :k]
    weights = torch.linspace(0.5, 1.5, n)
    out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode=backward_mode)
    grads = _grads((out.divergence * weights).sum(), (h, w, b))
    ref_rows, ref_leaves = _reference_rows(h, w, b, ids, lps, valid)
    rel_close(out.divergence, ref_rows, FP32_RTOL, "per-row divergence")
    for name, g_, r in zip(("dh", "dW", "db"), grads, _grads((ref_rows * weights.double()).sum(), ref_leaves),
                           strict=True):
        rel_close(g_, r, FP32_RTOL, name)

    # An id outside [0, V) in a valid slot is never matched: the same as that slot being invalid.
    ids_oov, valid_oov = ids.clone(), valid.clone()
    spare = (~valid).nonzero()[0]
    ids_oov[spare[0], spare[1]], valid_oov[spare[0], spare[1]] = v + 5, True
    out_oov = fused_sparse_jsd(h, w, ids_oov, lps, valid_oov, bias=b, backward_mode=backward_mode)
    torch.testing.assert_close(out_oov.entropy, out.entropy, rtol=0, atol=0)


def test_mixed_addmm_detection(monkeypatch):
    """Detected once per device by trying it: absent on CPU, absent where torch lacks the overload (simulated),
    present on CUDA with torch >= 2.8."""
    detect = backward.mixed_addmm_supported.__wrapped__  # uncached
    assert detect(torch.device("cpu"), torch.bfloat16) is False
    assert detect(torch.device("cpu"), torch.float16) is False
    real = torch.addmm

    def old_addmm(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise TypeError("addmm() received an invalid combination of arguments - got (..., out_dtype=...)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", old_addmm)
    assert detect(torch.device("cpu"), torch.bfloat16) is False
    if CUDA:
        assert detect(torch.device("cuda"), torch.bfloat16) is False
        monkeypatch.setattr(torch, "addmm", real)
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        for dtype in (torch.bfloat16, torch.float16):
            assert detect(torch.device("cuda"), dtype) is (version >= (2, 8)), dtype


# ------------------------------------------------------------------------------------------------ device guard
@pytest.mark.interpreter
def test_every_launch_runs_under_the_tensors_device_guard(monkeypatch):
    """Triton launches on the current CUDA device: forward and backward launches run inside
    ``torch.cuda.device(hidden.device)``. Pretend the tensors are CUDA ones and record the guard."""
    entered, depth = [], [0]

    class Recorder:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            depth[0] += 1

        def __exit__(self, *exc):
            depth[0] -= 1

    def inside_guard(fn):
        def wrapped(hidden, *args, **kwargs):
            assert depth[0] == 1 and entered[-1] == hidden.device, "kernel launched outside the device guard"
            return fn(hidden, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(config, "is_cuda_device", lambda device: True)
    monkeypatch.setattr(torch.cuda, "device", Recorder)
    monkeypatch.setattr(ops, "forward_stats", inside_guard(ops.forward_stats))
    monkeypatch.setattr(ops, "backward_grads", inside_guard(ops.backward_grads))
    case = _case(seed=5)
    h, w, b, ids, lps, valid = _scored_inputs(case, 0.0, torch.float32)
    out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b)
    out.divergence.sum().backward()
    assert entered == [h.device, h.device] and depth[0] == 0


@triton.jit
def _loop_bounds_probe(OUT, D, steps, BLOCK: tl.constexpr):
    """Sums what two Python ``range`` loops over integer kernel arguments visit, as the kernels' loops do."""
    acc = tl.zeros((BLOCK,), tl.int32)
    for d0 in range(0, D, BLOCK):
        acc += d0
    for _ in range(steps):
        acc += 1
    tl.store(OUT + tl.arange(0, BLOCK), acc)


@pytest.mark.interpreter
def test_python_ranges_over_kernel_arguments_run_in_the_interpreter():
    """Triton 3.6's interpreter converted a scalar argument with ``int()`` of a one-element array, which numpy 2.4
    and later refuse; ``fastdistill_kernels.compat`` patches that (only where it is broken), so the loops over D,
    V and the binary search's step count run on every supported release."""
    from fastdistill_kernels import compat

    out = torch.zeros(4, dtype=torch.int32)
    _loop_bounds_probe[(1,)](out, 10, 3, BLOCK=4)
    assert out.tolist() == [sum(range(0, 10, 4)) + 3] * 4
    from triton.runtime import interpreter

    assert not compat._interpreter_index_broken(interpreter, tl)  # patched, or never broken
    assert compat.patch_interpreter_scalar_index() == bool(getattr(interpreter, "_fastdistill_index_patched", False))


def test_device_guard_is_a_no_op_off_cuda(monkeypatch):
    def refuse(device):
        raise AssertionError("torch.cuda.device must not be entered for CPU tensors")

    monkeypatch.setattr(torch.cuda, "device", refuse)
    with config.device_guard(torch.device("cpu")):
        pass


@cuda_compiled
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_a_second_gpu_while_the_first_is_current():
    case = _case(seed=6)
    results = []
    for device in ("cuda:0", "cuda:1"):
        torch.cuda.set_device(0)
        h, w, b, ids, lps, valid = (x.to(device) for x in _scored_inputs(case, 0.0, torch.float32))
        h, w, b = (x.detach().requires_grad_(True) for x in (h, w, b))
        out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b)
        results.append([out.divergence.cpu(), *(g.cpu() for g in _grads(out.divergence.sum(), (h, w, b)))])
    for a, r in zip(*results, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ compiled on a GPU
GPU_VARIANTS = [
    # beta, add_tail_bucket, tail_mode, softcap, temperature, bias
    (0.0, True, "exact", None, 1.0, True),
    (0.3, True, "trl", 4.0, 0.7, False),
    (1.0, True, "exact", 4.0, 1.3, True),
    (0.3, False, "exact", None, 1.0, True),
]
GPU_LOSS_RTOL = 5e-5  # two fp32 evaluations (kernels, torch path), each within 1e-5 of float64 in the CPU tests
GPU_GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: BF16_GRAD_RTOL, torch.float16: BF16_GRAD_RTOL}


def _gpu_case(seed, dtype, beta, bias, N=333, D=192, V=5003, K=8):
    """CUDA leaves in ``dtype`` and the canonical slots of the scored rows; N, D, V are no tile multiples."""
    case = make_case(seed=seed, N=N, D=D, V=V, K=K, empty_rows=0)
    h, w, b, ids, lps, valid = _scored_inputs(case, beta, dtype)
    leaves = [x.detach().cuda().requires_grad_(True) for x in (h, w, b)]
    return (*leaves[:2], leaves[2] if bias else None, ids.cuda(), lps.cuda(), valid.cuda())


@cuda_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backward_mode", ["deterministic", "fused"])
@pytest.mark.parametrize("beta,tail,mode,softcap,T,bias", GPU_VARIANTS)
def test_compiled_kernels_match_the_torch_path(dtype, backward_mode, beta, tail, mode, softcap, T, bias):
    """Loss, entropies, dh, dW and db of the compiled kernels against the torch path on the same CUDA inputs, with
    per-row upstream gradients (negative and zero included)."""
    h, w, b, ids, lps, valid = _gpu_case(seed=int(10 * beta) + 3, dtype=dtype, beta=beta, bias=bias)
    kw = dict(beta=beta, temperature=T, softcap=softcap, add_tail_bucket=tail, tail_mode=mode, logit_scale=1.5)
    weights = torch.linspace(-1.0, 3.0, h.shape[0], device="cuda")
    weights[3] = 0.0
    out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode=backward_mode, **kw)
    leaves = [x for x in (h, w, b) if x is not None]
    grads = torch.autograd.grad((out.divergence * weights).sum(), leaves)
    refs = [x.detach().clone().requires_grad_(True) for x in leaves]
    rb = refs[2] if b is not None else None
    ref = sparse_jsd_loss(refs[0], refs[1], ids, lps, valid, bias=rb, backend="torch", **kw)
    rel_close(out.divergence.sum(), ref.jsd_sum, GPU_LOSS_RTOL, "loss")
    rel_close(out.entropy.sum(), ref.entropy_sum, GPU_LOSS_RTOL, "entropy")
    rel_close(out.teacher_entropy.sum(), ref.teacher_entropy_sum, GPU_LOSS_RTOL, "teacher entropy")
    positive = weights.clamp_min(0)  # the torch path takes non-negative token weights: split the upstream gradient
    ref_pos = sparse_jsd_loss(refs[0], refs[1], ids, lps, valid, bias=rb, backend="torch", token_weights=positive,
                              **kw).loss
    ref_neg = sparse_jsd_loss(refs[0], refs[1], ids, lps, valid, bias=rb, backend="torch",
                              token_weights=positive - weights, **kw).loss
    ref_grads = torch.autograd.grad(ref_pos - ref_neg, refs)
    for name, g, r, x in zip(("dh", "dW", "db"), grads, ref_grads, leaves, strict=False):
        assert g.dtype == x.dtype
        rel_close(g, r, GPU_GRAD_RTOL[dtype], name)


@cuda_compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_deterministic_backward_forced_onto_the_dw_fallback(monkeypatch, dtype):
    """Torch releases without the mixed-precision addmm: the upcast-block fallback gives the same dW as the
    addmm path (both sum exact half-precision products in fp32) and the same dh and db."""
    h, w, b, ids, lps, valid = _gpu_case(seed=11, dtype=dtype, beta=0.0, bias=True)

    def grads():
        out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode="deterministic")
        return _grads(out.divergence.sum(), (h, w, b))

    native = grads()
    monkeypatch.setattr(backward, "mixed_addmm_supported", lambda device, dtype: False)
    monkeypatch.setattr(backward, "UPCAST_BLOCK_ELEMS", 1024 * 700)  # several blocks per workspace chunk
    one_ulp = 2 * torch.finfo(dtype).eps  # fp32 sums in another order, then rounded to the dtype
    for name, got, ref in zip(("dh", "dW", "db"), grads(), native, strict=True):
        rel_close(got, ref, one_ulp, name)


@cuda_compiled
@pytest.mark.parametrize("backward_mode", ["deterministic", "fused"])
def test_compiled_gradient_filter_error_stays_within_its_bound(backward_mode):
    """The interpreter test's bound, on the compiled kernels (fp32)."""
    h, w, b, ids, lps, valid = (x.cuda() for x in _concentrated_case())
    h, w, b = (x.detach().requires_grad_(True) for x in (h, w, b))
    weights = torch.linspace(0.5, 2.0, h.shape[0], device="cuda")
    eps = 1e-3

    def run(filter_eps):
        out = fused_sparse_jsd(h, w, ids, lps, valid, bias=b, backward_mode=backward_mode, filter_eps=filter_eps)
        return _grads((out.divergence * weights).sum(), (h, w, b))

    (dh_f, dw_f, db_f), (dh, dw, db) = run(eps), run(None)
    slack = 1e-5
    assert ((dh_f - dh).abs() <= eps * weights.abs()[:, None] * w.detach().abs().sum(dim=0) + slack).all()
    assert ((dw_f - dw).abs() <= eps * (weights.abs()[:, None] * h.detach().abs()).sum(dim=0) + slack).all()
    assert ((db_f - db).abs() <= eps * weights.abs().sum() + slack).all()


@cuda_compiled
@pytest.mark.parametrize("beta,tail,mode,softcap,T,dtype", API_GRID + [(0.3, True, "exact", 4.0, 0.7, torch.float16)])
def test_compiled_triton_backend_matches_float64_reference(beta, tail, mode, softcap, T, dtype):
    """The interpreter's API grid on the GPU: padded, duplicated and masked slots, empty rows, bias, two teachers."""
    case = _case(seed=int(beta * 10) + int(T * 7), empty_rows=3)
    ids, lps, mask = (x.cuda() for x in case.narrowed(beta))
    kw = dict(beta=beta, temperature=T, softcap=softcap, add_tail_bucket=tail, tail_mode=mode, logit_scale=1.5,
              teacher_index=case.teacher_index.cuda(), num_teachers=2)
    h, w, b = (x.detach().cuda().requires_grad_(True) for x in case.leaves(dtype))
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, backend="triton", **kw)
    grads = _grads(out.loss, (h, w, b))
    hr, wr, br = (x.detach().double().requires_grad_(True) for x in (h, w, b))
    ref = sparse_jsd_loss(hr, wr, ids, lps, mask, bias=br, backend="reference", **kw)
    for f in FIELDS:
        rel_close(getattr(out, f), getattr(ref, f), GPU_LOSS_RTOL, f)
    for name, g, r in zip(("dh", "dW", "db"), grads, _grads(ref.loss, (hr, wr, br)), strict=True):
        rel_close(g, r, GPU_GRAD_RTOL[dtype], name)


@cuda_compiled
@pytest.mark.parametrize("backward_mode", ["deterministic", "fused"])
def test_compiled_kernels_at_a_qwen_vocabulary(backward_mode):
    """bf16 at Qwen2.5's vocabulary (V = 151936, many vocabulary splits and workspace columns) and D = 896."""
    h, w, b, ids, lps, valid = _gpu_case(seed=7, dtype=torch.bfloat16, beta=0.0, bias=False, N=512, D=896,
                                         V=151936, K=8)
    out = fused_sparse_jsd(h, w, ids, lps, valid, backward_mode=backward_mode)
    grads = _grads(out.divergence.sum(), (h, w))
    hr, wr = (x.detach().clone().requires_grad_(True) for x in (h, w))
    ref = sparse_jsd_loss(hr, wr, ids, lps, valid, backend="torch")
    rel_close(out.divergence.sum(), ref.loss, GPU_LOSS_RTOL, "loss")
    for name, g, r in zip(("dh", "dW"), grads, _grads(ref.loss, (hr, wr)), strict=True):
        rel_close(g, r, BF16_GRAD_RTOL, name)
