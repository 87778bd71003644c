"""sparse_jsd_loss: the torch path and the dense reference against the float64 dense reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from loss_cases import assert_elementwise, half_gradient_bounds, make_case, rel_close, row_log_scale
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastdistill import narrow_support, sparse_jsd_loss
from fastdistill.loss.api import torch_sparse_jsd
from fastdistill.loss.chunked import LossConfig
from fastdistill.loss.support import canonical_mask

BETAS = (0.0, 0.3, 0.5, 1.0)
FIELDS = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum")


def _grid():
    for beta, K, T, softcap in itertools.product(BETAS, (1, 8, 64), (0.7, 1.0, 2.0), (None, 4.0)):
        for tail, mode in ((True, "exact"), (True, "trl"), (False, "exact")):
            if not tail and (beta == 1.0 or K == 1):
                continue  # one slot without a tail is rejected (identically zero loss); tested below
            yield beta, K, T, softcap, tail, mode


def _run(case, beta, dtype, backend, **kw):
    h, w, b = case.leaves(dtype)
    ids, lps, mask = case.narrowed(beta)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, beta=beta, teacher_index=case.teacher_index,
                          num_teachers=2, backend=backend, **kw)
    grads = torch.autograd.grad(out.loss, (h, w, b))
    return out, grads


@pytest.mark.parametrize("beta,K,T,softcap,tail,mode", list(_grid()))
def test_paths_match_float64_reference(beta, K, T, softcap, tail, mode):
    case = make_case(seed=K * 7 + int(T * 10), K=K, V=160 if K < 64 else 200)
    kw = dict(temperature=T, softcap=softcap, add_tail_bucket=tail, tail_mode=mode, logit_scale=1.5)
    ref, ref_grads = _run(case, beta, torch.float64, "reference", **kw)
    assert int(ref.num_tokens) > 0
    for backend, dtype in (("torch", torch.float32), ("reference", torch.float32), ("torch", torch.float64)):
        out, grads = _run(case, beta, dtype, backend, **kw)
        # fp32: the torch path is held to 1e-5; the dense fp32 reference (autograd through probabilities) is
        # itself only good to a few 1e-5 when the tail holds most of the mass.
        rtol = 1e-10 if dtype == torch.float64 else (1e-5 if backend == "torch" else 1e-4)
        assert int(out.num_tokens) == int(ref.num_tokens)
        for f in FIELDS:
            rel_close(getattr(out, f), getattr(ref, f), rtol, f"{backend}/{dtype} {f}")
        rel_close(out.per_teacher, ref.per_teacher, rtol, f"{backend}/{dtype} per_teacher")
        for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
            assert g.dtype == dtype
            rel_close(g, r, rtol, f"{backend}/{dtype} {name}")


@pytest.mark.parametrize(
    "beta,tail,mode,softcap", [(0.0, True, "exact", None), (0.5, True, "exact", 3.0), (1.0, True, "trl", None),
                               (0.3, False, "exact", 2.0), (0.0, True, "trl", 3.0)]
)
def test_gradcheck_float64(beta, tail, mode, softcap):
    case = make_case(seed=3, N=6, D=5, V=23, K=4, empty_rows=1)
    ids, lps, mask = case.narrowed(beta)
    cfg = LossConfig(logit_scale=1.2, softcap=softcap, beta=beta, temperature=0.9, add_tail_bucket=tail,
                     tail_mode=mode)

    def f(h, w, b):
        return torch_sparse_jsd(h, w, b, ids, lps, mask, cfg, chunk_rows=2).loss

    assert torch.autograd.gradcheck(f, case.leaves(torch.float64), eps=1e-6, atol=1e-7, fast_mode=True)


def test_upstream_gradient_scales_all_gradients():
    case = make_case(seed=5)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves()
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b)
    (2.5 * out.loss).backward()
    h1, w1, b1 = case.leaves()
    sparse_jsd_loss(h1, w1, ids, lps, mask, bias=b1).loss.backward()
    for a, r in ((h.grad, h1.grad), (w.grad, w1.grad), (b.grad, b1.grad)):
        torch.testing.assert_close(a, 2.5 * r)


def test_only_requested_gradients_are_computed():
    case = make_case(seed=6)
    ids, lps, mask = case.narrowed(0.0)
    h, w, _ = case.leaves()
    w.requires_grad_(False)
    sparse_jsd_loss(h, w, ids, lps, mask).loss.backward()
    assert h.grad is not None and w.grad is None
    with torch.no_grad():
        out = sparse_jsd_loss(h, w, ids, lps, mask)
    assert not out.loss.requires_grad and math.isfinite(float(out.loss))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_empty_input_gives_zero_loss_connected_to_graph(backend):
    case = make_case(seed=1)
    for n in (0, 4):  # no rows at all; rows without any usable slot
        h, w, b = case.leaves()
        h = h[:n].detach().requires_grad_(True)
        ids = torch.full((n, 3), -1)
        lps = torch.full((n, 3), -torch.inf)
        out = sparse_jsd_loss(h, w, ids, lps, ids >= 0, bias=b, backend=backend, num_teachers=2,
                              teacher_index=torch.zeros(n, dtype=torch.long))
        assert float(out.loss.detach()) == 0.0 and int(out.num_tokens) == 0
        assert out.loss.requires_grad
        out.loss.backward()
        for g in (h.grad, w.grad, b.grad):
            assert g is not None and torch.count_nonzero(g) == 0
        assert torch.count_nonzero(out.per_teacher) == 0


def test_duplicates_count_once_and_masked_slots_are_ignored():
    case = make_case(seed=8, dup_frac=0.0, pad_frac=0.0, empty_rows=0)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves(torch.float64)
    base = sparse_jsd_loss(h, w, ids, lps, mask, bias=b).loss
    # append a copy of slot 0 (same id, different log-prob) and a masked garbage slot: nothing changes
    ids2 = torch.cat([ids, ids[:, :1], torch.zeros_like(ids[:, :1])], dim=1)
    lps2 = torch.cat([lps, lps[:, :1] - 1.0, torch.full_like(lps[:, :1], float("nan"))], dim=1)
    mask2 = torch.cat([mask, mask[:, :1], torch.zeros_like(mask[:, :1])], dim=1)
    dup = sparse_jsd_loss(h, w, ids2, lps2, mask2, bias=b).loss
    torch.testing.assert_close(dup, base)


def test_minus_inf_teacher_logprob_is_an_empty_slot():
    case = make_case(seed=9, pad_frac=0.0, empty_rows=0)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves(torch.float64)
    lps_inf = lps.clone()
    lps_inf[:, 2] = -torch.inf
    mask_drop = mask.clone()
    mask_drop[:, 2] = False
    for beta in (0.0, 1.0, 0.5):
        a = sparse_jsd_loss(h, w, ids, lps_inf, mask, bias=b, beta=beta).loss
        r = sparse_jsd_loss(h, w, ids, lps, mask_drop, bias=b, beta=beta).loss
        assert math.isfinite(float(a.detach()))
        torch.testing.assert_close(a, r)


def test_full_vocabulary_support_equals_dense_forward_kl():
    g = torch.Generator().manual_seed(0)
    N, D, V = 5, 8, 12
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64), dim=-1)
    ids = torch.arange(V).repeat(N, 1)
    for backend in ("torch", "reference"):
        out = sparse_jsd_loss(h, w, ids, teacher, ids >= 0, backend=backend)
        student = torch.log_softmax(h @ w.t(), dim=-1)
        dense_kl = (teacher.exp() * (teacher - student)).sum()
        torch.testing.assert_close(out.loss, dense_kl)


def test_exact_tail_is_accurate_in_fp32_where_subtraction_is_not():
    """Candidates = the student's own top-k at a large logit scale: the tail mass is tiny."""
    g = torch.Generator().manual_seed(0)
    N, D, V, K = 32, 64, 4096, 32
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * (10.0 / D**0.5)
    ids = (h @ w.t()).topk(K, dim=-1).indices
    lps = torch.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), dim=-1) - 0.01
    mask = ids >= 0
    ref = sparse_jsd_loss(h, w, ids, lps, mask, beta=1.0, backend="reference")
    out = sparse_jsd_loss(h.float(), w.float(), ids, lps.float(), mask, beta=1.0)
    rel_close(out.loss, ref.loss, 1e-5, "exact tail, fp32")


def _sparse_half_bounds(case, h, w, b, ids, lps, mask, grads, dtype):
    """:func:`half_gradient_bounds` for the sparse loss at scale 1, T = 1 (float64 quantities of the scored rows)."""
    logp, q, scale = row_log_scale(h, w, b, ids, lps, mask)
    return half_gradient_bounds(h, w, logp, q, scale, 1.0, grads, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_fp32_and_round_each_gradient_once(dtype):
    """Element by element, not relative to the largest entry: every gradient entry is the float64 one rounded once
    to the half dtype, within the fp32 evaluation's error of that entry (the tail vocabulary's small entries too)."""
    case = make_case(seed=10)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves(dtype)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b)
    grads = torch.autograd.grad(out.loss, (h, w, b))
    assert out.loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    hr, wr, br = (x.detach().to(torch.float64).requires_grad_(True) for x in (h, w, b))
    ref = sparse_jsd_loss(hr, wr, ids, lps, mask, bias=br, backend="reference")
    ref_grads = torch.autograd.grad(ref.loss, (hr, wr, br))
    rel_close(out.loss, ref.loss, 1e-5, "half loss")
    bounds = _sparse_half_bounds(case, h, w, b, ids, lps, mask, ref_grads, dtype)
    for name, g, r, bound in zip(("dh", "dW", "db"), grads, ref_grads, bounds, strict=True):
        assert_elementwise(g, r, bound, f"{dtype} {name}")


def test_elementwise_check_sees_a_wrong_tail_gradient_that_a_max_normalised_one_misses():
    """The oracle can catch the bug: a dW whose rows of never-candidate tokens are 2 % off passes a 1e-2 check
    relative to the largest entry but fails the element-wise bound."""
    case = make_case(seed=10)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves(torch.bfloat16)
    hr, wr, br = (x.detach().to(torch.float64).requires_grad_(True) for x in (h, w, b))
    ref_grads = torch.autograd.grad(sparse_jsd_loss(hr, wr, ids, lps, mask, bias=br, backend="reference").loss,
                                    (hr, wr, br))
    never = torch.ones(w.shape[0], dtype=torch.bool)
    never[ids[canonical_mask(ids, lps, mask)]] = False
    assert int(never.sum()) > 0
    wrong = ref_grads[1].clone()
    wrong[never] *= 1.02
    rel_close(wrong, ref_grads[1], 1e-2, "max-normalised")
    bound = _sparse_half_bounds(case, h, w, b, ids, lps, mask, ref_grads, torch.bfloat16)[1]
    with pytest.raises(AssertionError, match="off by"):
        assert_elementwise(wrong, ref_grads[1], bound, "dW")


def test_per_teacher_statistics_partition_the_totals():
    case = make_case(seed=11, num_teachers=3)
    ids, lps, mask = case.narrowed(0.0)
    h, w, b = case.leaves(torch.float64)
    out = sparse_jsd_loss(h, w, ids, lps, mask, teacher_index=case.teacher_index, num_teachers=3)
    totals = out.per_teacher.sum(dim=0)
    assert out.per_teacher.shape == (3, 3)
    torch.testing.assert_close(totals, torch.stack([out.num_tokens.double(), out.jsd_sum, out.teacher_entropy_sum]))
    single = sparse_jsd_loss(h, w, ids, lps, mask)
    torch.testing.assert_close(single.per_teacher[0], totals)


def test_narrow_support_matches_the_documented_regimes():
    ids = torch.tensor([[5, 3, 9, -1], [7, 2, 4, 8], [1, 6, -1, -1], [-1, -1, -1, -1]])
    lps = torch.tensor([[-0.1, -2.0, -3.0, -torch.inf], [-0.5, -1.0, -2.0, -6.0], [-0.2, -1.5, -torch.inf, -torch.inf],
                        [-torch.inf] * 4])
    actual = torch.tensor([9, 7, 0, 3])  # row 0: inside top-K; row 1: is the top-1; row 2: not reported; row 3: empty
    i0, l0, m0 = narrow_support(ids, lps, actual, 0.0)
    assert torch.equal(i0, ids) and torch.equal(m0, ids != -1)
    i1, l1, m1 = narrow_support(ids, lps, actual, 1.0)
    assert i1.squeeze(1).tolist() == [9, 7, 0, 3]
    assert m1.squeeze(1).tolist() == [True, True, False, False]
    assert l1[0, 0] == -3.0 and l1[1, 0] == -0.5
    ih, lh, mh = narrow_support(ids, lps, actual, 0.5)
    assert ih.tolist() == [[5, 9], [7, 7], [1, 0], [-1, 3]]
    assert mh.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert lh[0].tolist() == pytest.approx([-0.1, -3.0])


class _LargestTensor(TorchDispatchMode):
    """The largest tensor (in elements) that any aten op returns while the mode is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def _largest_tensor(N: int, V: int, backend: str) -> int:
    """Largest tensor created by the loss, forward and gradients, on N rows over a vocabulary of V."""
    g = torch.Generator().manual_seed(0)
    D, K = 16, 4
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (N, K), generator=g)
    lps = torch.log_softmax(torch.randn(N, K, generator=g), -1) - 0.5
    with _LargestTensor() as largest:
        out = sparse_jsd_loss(h, w, ids, lps, ids >= 0, backend=backend)
        torch.autograd.grad(out.loss, (h, w))
    return largest.numel


def test_chunked_path_never_creates_a_rows_by_vocabulary_tensor():
    """Every tensor the torch path creates (the logits tiles included, forward and gradients) is at most one
    chunk_rows × V tile, whatever N; the dense reference, for contrast, materialises the N × V logits."""
    from fastdistill.loss.chunked import default_chunk_rows

    V = 2048
    tile = default_chunk_rows(V, torch.float32) * V  # 256 rows
    for N in (512, 1024):  # 2 and 4 tiles
        assert _largest_tensor(N, V, "torch") == tile < N * V
    assert _largest_tensor(256, V, "reference") >= 256 * V  # the probe does see an N × V tensor


def test_chunk_rows_follow_the_vocabulary():
    """Work tiles are sized by the vocabulary, not by N."""
    from fastdistill.loss.chunked import default_chunk_rows

    assert default_chunk_rows(32768, torch.float32) == default_chunk_rows(32768, torch.float32, 32 * 2**20) == 256
    assert default_chunk_rows(151936, torch.float32) * 151936 * 4 <= 32 * 2**20
    assert default_chunk_rows(10**9, torch.float32) == 1
    assert default_chunk_rows(8192, torch.float32) == 256  # row cap: small vocabularies keep a small tile


def test_gradcheck_full_jacobian_tiny():
    case = make_case(seed=4, N=3, D=3, V=7, K=2, empty_rows=0, dup_frac=0.0)
    ids, lps, mask = case.narrowed(0.0)
    cfg = LossConfig(logit_scale=1.0, softcap=2.0, beta=0.0, temperature=1.3, add_tail_bucket=True,
                     tail_mode="exact")

    def f(h, w, b):
        return torch_sparse_jsd(h, w, b, ids, lps, mask, cfg, chunk_rows=2).loss

    assert torch.autograd.gradcheck(f, case.leaves(torch.float64), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_token_weights_scale_each_positions_loss_and_gradient(backend):
    """loss = Σ w·div: equal to the float64 reference's weighted sum, gradients included; metrics unweighted."""
    torch.manual_seed(0)
    N, D, V, K = 9, 8, 40, 4
    hidden = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (N, K))
    ids[2] = -1  # a row without signal: its weight must not matter
    lps = torch.log_softmax(torch.randn(N, K, dtype=torch.float64), -1) - 0.5
    mask = ids >= 0
    w = torch.rand(N, dtype=torch.float64) * 2
    out = sparse_jsd_loss(hidden, weight, ids, lps, mask, token_weights=w, backend=backend)
    dh, dw = torch.autograd.grad(out.loss, (hidden, weight))
    plain = sparse_jsd_loss(hidden, weight, ids, lps, mask, backend="reference")
    rows = [n for n in range(N) if n != 2]
    per_row = [sparse_jsd_loss(hidden[n : n + 1], weight, ids[n : n + 1], lps[n : n + 1], mask[n : n + 1],
                               backend="reference").loss for n in rows]
    expected = sum(w[n] * loss for n, loss in zip(rows, per_row, strict=True))
    edh, edw = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(out.loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dh, edh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dw, edw, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.jsd_sum, plain.jsd_sum.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (torch.ones(3), r"token_weights must have shape \(4,\)"),
        (torch.ones(4, dtype=torch.int64), "token_weights must be a floating-point tensor"),
        (torch.tensor([1.0, -1.0, 1.0, 1.0]), "token_weights must be finite and >= 0"),
        (torch.tensor([1.0, float("nan"), 1.0, 1.0]), "token_weights must be finite and >= 0"),
        (torch.ones(4, requires_grad=True), "token_weights must not require grad"),
        ([1.0] * 4, "token_weights must be None or a torch.Tensor"),
    ],
)
def test_token_weight_errors(weights, message):
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    ids = torch.randint(0, 16, (4, 2))
    with pytest.raises(ValueError, match=message):
        sparse_jsd_loss(hidden, weight, ids, torch.full((4, 2), -1.0), ids >= 0, token_weights=weights)


class _FreshLargeTensors(TorchDispatchMode):
    """Counts the fresh tensors (outputs that alias no input: new allocations) of at least ``min_numel`` elements."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.count = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = all(r.alias_info is None for r in func._schema.returns)
        if fresh:
            self.count += sum(t.numel() >= self.min_numel for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("softcap,dtype", [(None, torch.float32), (3.0, torch.float32), (None, torch.bfloat16)])
def test_torch_path_allocates_its_buffers_once_not_per_chunk(softcap, dtype):
    """Every (rows, V), (rows, D) and (V,) buffer (logits tile, scratch, cast and scaled hidden states, bias column
    sums) is allocated once per call and reused by every chunk: 2 or 4 chunks allocate the same number of them,
    so the allocator's heap does not churn through tile-sized temporaries (glibc's default thresholds)."""
    D, V, K, rows = 64, 2048, 4, 16  # (rows, D) = 1024 and (V,) = 2048 elements; (N, K) tensors stay below 1024

    def fresh_buffers(n_chunks: int) -> int:
        g = torch.Generator().manual_seed(0)
        N = rows * n_chunks
        h = torch.randn(N, D, generator=g).to(dtype).requires_grad_(True)
        w, b = torch.randn(V, D, generator=g, requires_grad=True), torch.randn(V, generator=g, requires_grad=True)
        ids = torch.randint(0, V, (N, K), generator=g)
        lps = torch.log_softmax(torch.randn(N, K, generator=g), -1) - 0.5
        cfg = LossConfig(logit_scale=1.5, softcap=softcap, beta=0.0, temperature=0.8, add_tail_bucket=True,
                         tail_mode="exact")
        with _FreshLargeTensors(min_numel=rows * D) as probe:
            out = torch_sparse_jsd(h, w, b, ids, lps, ids >= 0, cfg, chunk_rows=rows)
            torch.autograd.grad(out.loss, (h, w, b))
        return probe.count

    assert fresh_buffers(2) == fresh_buffers(4)
