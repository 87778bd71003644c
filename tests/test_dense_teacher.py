"""dense_teacher_jsd_loss: the memory-bounded torch path against the float64 dense reference and plain formulas."""

from __future__ import annotations

import itertools
import math
import weakref

import pytest
import torch
from loss_cases import assert_elementwise, half_gradient_bounds, rel_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastdistill import DenseJSDOutput, SparseJSDOutput, dense_teacher_jsd_loss
from fastdistill.loss.chunked import default_chunk_rows

EPS32 = torch.finfo(torch.float32).eps
FIELDS = ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "teacher_dropped_mass_sum", "per_teacher")


def make_inputs(seed=0, N=24, Ds=16, Dt=12, V=96, Vt=96, spread=1.5, dtype=torch.float64):
    """Random student and teacher heads (float64 leaves; biases included), a mask, token weights, 3 teachers."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = dict(
        hs=r(N, Ds), ws=r(V, Ds) * (spread / Ds**0.5), bs=0.1 * r(V),
        ht=r(N, Dt), wt=r(Vt, Dt) * (spread / Dt**0.5), bt=0.1 * r(Vt),
        mask=torch.rand(N, generator=g) > 0.25,
        token_weights=2 * torch.rand(N, generator=g, dtype=torch.float64),
        teacher_index=torch.randint(3, (N,), generator=g),
    )
    x["mask"][0] = False  # at least one masked row
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in x.items()}


def run(x, dtype, backend, grads=True, **kw):
    """The loss on ``x`` cast to ``dtype``, and the gradients of ``loss`` w.r.t. the student's (hs, ws, bs)."""
    hs, ws, bs = (x[k].detach().to(dtype).requires_grad_(grads) for k in ("hs", "ws", "bs"))
    kw.setdefault("mask", x["mask"])
    kw.setdefault("token_weights", x["token_weights"].to(dtype))
    kw.setdefault("teacher_index", x["teacher_index"])
    kw.setdefault("num_teachers", 3)
    out = dense_teacher_jsd_loss(hs, ws, x["ht"].to(dtype), x["wt"].to(dtype), student_bias=bs,
                                 teacher_bias=x["bt"].to(dtype), backend=backend, **kw)
    return out, (torch.autograd.grad(out.loss, (hs, ws, bs)) if grads else None)


def logit_error_scale(x, student_scale=1.0, teacher_scale=1.0, temperature=1.0) -> float:
    """max |z| + max |logsumexp z| over both sides' final logits (float64, no softcap: softcap only shrinks them).

    An fp32 logit carries an absolute error of a few eps32·|z| (one rounding of the GEMM's result; the D-term dot
    products of these cases add less), a log-prob s = z − lse a few eps32·(|z| + |lse|). The loss terms q·(t − s),
    p·(s − log m), the entropies and the logit gradient p − q (and its β > 0 forms) are each a probability times
    these log-probs, so their relative errors are a few eps32 times this scale, and the per-row and GEMM sums add
    relative errors of a few eps32 more. Measured: about 1–2 eps32 times it."""
    zs = (x["hs"] @ x["ws"].t() + x["bs"]) * (student_scale / temperature)
    zt = (x["ht"] @ x["wt"].t() + x["bt"]) * (teacher_scale / temperature)
    return max(float(z.abs().max() + z.logsumexp(1).abs().max()) for z in (zs, zt))


GRID = list(itertools.product((0.0, 0.3, 1.0), (0.7, 1.5), (None, 3.0), (False, True)))


@pytest.mark.parametrize("beta,T,softcap,padded", GRID)
def test_torch_path_matches_float64_reference(beta, T, softcap, padded):
    x = make_inputs(seed=int(beta * 10) + int(T * 10), Vt=110 if padded else 96)
    kw = dict(beta=beta, temperature=T, student_softcap=softcap, teacher_softcap=None if softcap is None else 4.0,
              student_logit_scale=1.2, teacher_logit_scale=0.9, chunk_rows=7)
    ref, ref_grads = run(x, torch.float64, "reference", **kw)
    assert int(ref.num_tokens) == int(x["mask"].sum()) > 0
    assert (float(ref.teacher_dropped_mass_sum) > 0) == padded
    # fp32 tolerance: 3·eps32 × the logit error scale (see logit_error_scale), which these inputs keep ≤ 1e-5
    fp32_tol = 3 * EPS32 * logit_error_scale(x, 1.2, 0.9, T)
    assert fp32_tol <= 1e-5
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, fp32_tol)):
        out, grads = run(x, dtype, "torch", **kw)
        assert isinstance(out, DenseJSDOutput) and isinstance(out, SparseJSDOutput)
        assert int(out.num_tokens) == int(ref.num_tokens)
        for f in FIELDS:
            rel_close(getattr(out, f), getattr(ref, f), rtol, f"{dtype} {f}")
        for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
            assert g.dtype == dtype
            rel_close(g, r, rtol, f"{dtype} {name}")


@pytest.mark.parametrize("beta,softcap", [(0.0, None), (0.3, 2.0), (1.0, None), (0.7, 3.0), (1.0, 2.5)])
def test_gradcheck_float64(beta, softcap):
    x = make_inputs(seed=3, N=5, Ds=4, Dt=3, V=9, Vt=11)

    def f(hs, ws, bs):
        return dense_teacher_jsd_loss(hs, ws, x["ht"], x["wt"], student_bias=bs, teacher_bias=x["bt"], beta=beta,
                                      temperature=0.9, student_logit_scale=1.3, student_softcap=softcap,
                                      teacher_softcap=softcap, mask=x["mask"], token_weights=x["token_weights"],
                                      backend="torch", chunk_rows=2).loss

    leaves = tuple(x[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs"))
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


def test_chunk_rows_do_not_change_the_result():
    """float64: equal to 1e-12 whatever the chunking; fp32: within the rounding bound of two fp32 evaluations."""
    x = make_inputs(seed=5, N=23)
    fp32_tol = 2 * 3 * EPS32 * logit_error_scale(x)
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, fp32_tol)):
        base, base_grads = run(x, dtype, "torch", beta=0.3, chunk_rows=23)
        for rows in (1, 4, 7, None):
            out, grads = run(x, dtype, "torch", beta=0.3, chunk_rows=rows)
            for f in FIELDS:
                rel_close(getattr(out, f), getattr(base, f), rtol, f"{dtype} chunk_rows={rows} {f}")
            for name, g, r in zip(("dh", "dW", "db"), grads, base_grads, strict=True):
                rel_close(g, r, rtol, f"{dtype} chunk_rows={rows} {name}")


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_teacher_inputs_get_no_gradient(backend):
    """The teacher's hidden states, weight and bias are detached: constants even when they require grad."""
    x = make_inputs(seed=6, Vt=100)
    hs, ws, bs = (x[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs"))
    ht, wt, bt = (x[k].clone().requires_grad_(True) for k in ("ht", "wt", "bt"))
    out = dense_teacher_jsd_loss(hs, ws, ht, wt, student_bias=bs, teacher_bias=bt, beta=0.3, backend=backend)
    out.loss.backward()
    assert all(t.grad is not None for t in (hs, ws, bs))
    assert all(t.grad is None for t in (ht, wt, bt))


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_forward_and_reverse_kl_equal_torch_kl_div(beta):
    """β = 0 is KL(teacher‖student), β = 1 KL(student‖teacher), over the full vocabulary (F.kl_div as oracle)."""
    x = make_inputs(seed=7)
    out, _ = run(x, torch.float64, "torch", grads=False, beta=beta, mask=None, token_weights=None)
    s = torch.log_softmax(x["hs"] @ x["ws"].t() + x["bs"], dim=-1)
    t = torch.log_softmax(x["ht"] @ x["wt"].t() + x["bt"], dim=-1)
    inp, target = (s, t) if beta == 0.0 else (t, s)
    expected = torch.nn.functional.kl_div(inp, target, log_target=True, reduction="sum")
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.entropy_sum, -(s.exp() * s).sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(out.teacher_entropy_sum, -(t.exp() * t).sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_token_weights_scale_each_positions_loss_and_gradient(backend):
    """loss = Σ w_i·div_i over scored rows (per-row float64 reference calls); the metrics stay unweighted."""
    x = make_inputs(seed=8, N=9)
    out, (dh, dw, db) = run(x, torch.float64, backend, beta=0.3)
    hs, ws, bs = (x[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs"))
    rows = x["mask"].nonzero().squeeze(1).tolist()
    per_row = [dense_teacher_jsd_loss(hs[i : i + 1], ws, x["ht"][i : i + 1], x["wt"], student_bias=bs,
                                      teacher_bias=x["bt"], beta=0.3, backend="reference").loss for i in rows]
    expected = sum(x["token_weights"][i] * loss for i, loss in zip(rows, per_row, strict=True))
    torch.testing.assert_close(out.loss, expected, rtol=1e-10, atol=0)
    for g, e in zip((dh, dw, db), torch.autograd.grad(expected, (hs, ws, bs)), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(out.jsd_sum, sum(per_row).detach(), rtol=1e-10, atol=0)


def test_per_teacher_statistics_partition_the_totals():
    x = make_inputs(seed=9)
    out, _ = run(x, torch.float64, "torch", grads=False, beta=0.3)
    assert out.per_teacher.shape == (3, 3)
    totals = out.per_teacher.sum(dim=0)
    torch.testing.assert_close(totals, torch.stack([out.num_tokens.double(), out.jsd_sum, out.teacher_entropy_sum]))
    scored = x["teacher_index"][x["mask"]]
    assert out.per_teacher[:, 0].tolist() == [float((scored == k).sum()) for k in range(3)]
    single, _ = run(x, torch.float64, "torch", grads=False, beta=0.3, teacher_index=None, num_teachers=1)
    torch.testing.assert_close(single.per_teacher[0], totals)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_masked_rows_do_not_matter(backend):
    """Masked rows add nothing to the loss or the metrics, and their hidden states get a zero gradient."""
    x = make_inputs(seed=10)
    out, (dh, _, _) = run(x, torch.float64, backend, beta=0.3)
    y = dict(x, hs=x["hs"].clone(), ht=x["ht"].clone())
    y["hs"][~x["mask"]] = 100.0
    y["ht"][~x["mask"]] = float("nan")
    other, _ = run(y, torch.float64, backend, beta=0.3)
    assert int(out.num_tokens) == int(x["mask"].sum())
    for f in FIELDS:
        torch.testing.assert_close(getattr(other, f), getattr(out, f), rtol=1e-12, atol=0)
    assert torch.count_nonzero(dh[~x["mask"]]) == 0


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_nothing_scored_gives_zero_loss_connected_to_graph(backend):
    x = make_inputs(seed=11)
    for n, mask in ((0, None), (6, torch.zeros(6, dtype=torch.bool))):
        hs, ws, bs = (t.clone().requires_grad_(True) for t in (x["hs"][:n], x["ws"], x["bs"]))
        out = dense_teacher_jsd_loss(hs, ws, x["ht"][:n], x["wt"], student_bias=bs, mask=mask, backend=backend,
                                     teacher_index=torch.zeros(n, dtype=torch.long), num_teachers=2)
        assert float(out.loss.detach()) == 0.0 and int(out.num_tokens) == 0 and out.loss.requires_grad
        out.loss.backward()
        assert all(g is not None and torch.count_nonzero(g) == 0 for g in (hs.grad, ws.grad, bs.grad))
        assert torch.count_nonzero(out.per_teacher) == 0


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_padded_teacher_vocabulary_is_dropped_and_renormalised(beta):
    """A teacher with V_t > V_s rows scores like the same teacher cut to the student's V_s rows (its mass on the
    padding is dropped and the rest renormalised), and reports the dropped mass."""
    x = make_inputs(seed=12, V=96, Vt=128)
    x["bt"][96:] += 2.0  # real mass on the padding
    out, grads = run(x, torch.float64, "torch", beta=beta)
    cut, cut_grads = run(dict(x, wt=x["wt"][:96], bt=x["bt"][:96]), torch.float64, "torch", beta=beta)
    for f in ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "per_teacher"):
        torch.testing.assert_close(getattr(out, f), getattr(cut, f), rtol=1e-12, atol=1e-14)
    for g, c in zip(grads, cut_grads, strict=True):
        torch.testing.assert_close(g, c, rtol=1e-12, atol=1e-14)
    full = torch.softmax(x["ht"] @ x["wt"].t() + x["bt"], dim=-1)
    expected_drop = full[x["mask"], 96:].sum()
    assert float(expected_drop) > 1.0  # several rows' worth of mass
    torch.testing.assert_close(out.teacher_dropped_mass_sum, expected_drop, rtol=1e-12, atol=0)
    assert float(cut.teacher_dropped_mass_sum) == 0.0


def test_extreme_logits_stay_finite_and_accurate_in_fp32():
    """Logit gaps of hundreds of nats: most probabilities underflow in fp32, yet the log-space formulas give finite
    losses and gradients that agree with the float64 torch path (the float64 reference, in probability space, is
    no oracle at these gaps).

    The loss keeps the relative bound of :func:`logit_error_scale`. The gradients get an absolute one: with
    near-one-hot rows a tiny gradient can be all rounding, and dL/dz depends on the log-probs with a factor up to
    |s − t| + 1 ≲ 2·Z (β = 1: p·(s − t − D)), so per row Σ_v |δ dL/dz_v| ≲ a few eps32·Z². dh, dW and db
    multiply dL/dz by |W|·scale/T, Σ_i |h_i| and the row count."""
    x = make_inputs(seed=13, spread=40.0)
    Z = logit_error_scale(x)
    grad_units = (float(x["ws"].abs().max()), float(x["hs"].abs().sum(dim=0).max()), x["hs"].shape[0])
    for beta in (0.0, 0.3, 1.0):
        ref, ref_grads = run(x, torch.float64, "torch", beta=beta, mask=None, token_weights=None)
        out, grads = run(x, torch.float32, "torch", beta=beta, mask=None, token_weights=None)
        assert all(bool(torch.isfinite(t).all()) for t in (out.loss, out.entropy_sum, *grads))
        rel_close(out.loss, ref.loss, 3 * EPS32 * Z, f"beta={beta} loss")
        for name, g, r, unit in zip(("dh", "dW", "db"), grads, ref_grads, grad_units, strict=True):
            err = float((g.double() - r).abs().max())
            assert err <= 3 * EPS32 * Z**2 * unit, f"beta={beta} {name}: {err:.3e}"


def test_upstream_gradient_and_only_requested_gradients():
    x = make_inputs(seed=14)
    out, grads = run(x, torch.float64, "torch", beta=0.3)
    hs, ws = (x[k].clone().requires_grad_(True) for k in ("hs", "ws"))
    scaled = dense_teacher_jsd_loss(hs, ws, x["ht"], x["wt"], student_bias=x["bs"], teacher_bias=x["bt"], beta=0.3,
                                    mask=x["mask"], token_weights=x["token_weights"])
    (2.5 * scaled.loss).backward()
    torch.testing.assert_close(hs.grad, 2.5 * grads[0])
    torch.testing.assert_close(ws.grad, 2.5 * grads[1])
    with torch.no_grad():
        nograd = dense_teacher_jsd_loss(hs, ws, x["ht"], x["wt"], beta=0.3)
    assert not nograd.loss.requires_grad and math.isfinite(float(nograd.loss))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_fp32_and_round_each_gradient_once(dtype):
    """Element by element (not relative to the largest entry): each gradient entry is the float64 one of the same
    half-precision inputs rounded once, within the fp32 evaluation's error of that entry."""
    x = make_inputs(seed=15)
    out, grads = run(x, dtype, "torch", beta=0.3)
    assert out.loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    y = {k: v.to(dtype).double() if v.is_floating_point() else v for k, v in x.items()}  # the same inputs
    ref, ref_grads = run(y, torch.float64, "reference", beta=0.3)
    rel_close(out.loss, ref.loss, 1e-5, "half loss")
    rows = y["mask"]
    zs = y["hs"][rows] @ y["ws"].t() + y["bs"]
    zt = y["ht"][rows] @ y["wt"].t() + y["bt"]
    s, t = zs.log_softmax(-1), zt.log_softmax(-1)
    weights = y["token_weights"][rows]
    scale = weights * (1 + zs.abs().amax(1) + zt.abs().amax(1) + s.abs().amax(1) + t.abs().amax(1))
    hs = torch.zeros_like(y["hs"])
    hs[rows] = y["hs"][rows]
    full_s = torch.full((y["hs"].shape[0], s.shape[1]), -torch.inf, dtype=torch.float64)
    full_s[rows] = s
    full_t = torch.zeros_like(full_s)
    full_t[rows] = t.exp()
    full_scale = torch.zeros(y["hs"].shape[0], dtype=torch.float64)
    full_scale[rows] = scale
    bounds = half_gradient_bounds(hs, y["ws"], full_s, full_t, full_scale, 1.0, ref_grads, dtype)
    for name, g, r, bound in zip(("dh", "dW", "db"), grads, ref_grads, bounds, strict=True):
        assert_elementwise(g, r, bound, f"{dtype} {name}")


class _PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of live storages allocated by aten ops while the mode is active (deterministic: a storage's bytes
    count from the op that creates it until its last reference is gone, which CPython frees at once)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):  # fresh outputs: new allocations
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._seen and storage.nbytes():
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _peak_bytes(N: int, backend: str, V: int = 1024, Vt: int = 1100, D: int = 16) -> int:
    """Peak live bytes of one loss call plus its backward, float32, N rows."""
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(N, D, generator=g, requires_grad=True)
    ws = torch.randn(V, D, generator=g, requires_grad=True)
    ht, wt = torch.randn(N, D, generator=g), torch.randn(Vt, D, generator=g)
    with _PeakLiveBytes() as probe:
        out = dense_teacher_jsd_loss(hs, ws, ht, wt, beta=0.3, backend=backend)
        torch.autograd.grad(out.loss, (hs, ws))
    return probe.peak


def test_torch_path_peak_memory_is_flat_in_n():
    """Doubling N adds only O(N·D) bytes (the dh gradient, per-row statistics) to the torch path's peak: no
    (N, V) tensor. The dense reference, for contrast, grows by at least N·V floats."""
    V, D = 1024, 16
    rows = default_chunk_rows(1100, torch.float32)  # 256
    p1, p2 = _peak_bytes(2 * rows, "torch"), _peak_bytes(4 * rows, "torch")
    n = 2 * rows  # rows added
    assert p2 - p1 <= n * (2 * D + 16) * 4, (p1, p2)  # dh (saved and returned) + a few (N,) vectors
    assert p2 < 12 * rows * 1100 * 4  # a handful of (rows, V) tiles in all
    r1, r2 = _peak_bytes(2 * rows, "reference"), _peak_bytes(4 * rows, "reference")
    assert r2 - r1 >= n * V * 4


class _LargestTensor(TorchDispatchMode):
    """The largest tensor (in elements) that any aten op returns while the mode is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel, *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
        return out


def test_torch_path_never_creates_a_rows_by_vocabulary_tensor():
    g = torch.Generator().manual_seed(0)
    N, D, V = 512, 8, 1024
    hs, ws = torch.randn(N, D, generator=g, requires_grad=True), torch.randn(V, D, generator=g, requires_grad=True)
    ht, wt = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    with _LargestTensor() as largest:
        out = dense_teacher_jsd_loss(hs, ws, ht, wt, beta=0.5, chunk_rows=64)
        torch.autograd.grad(out.loss, (hs, ws))
    assert largest.numel == 64 * V  # one (chunk_rows, V) tile; the GEMM operands are smaller


def _args(N=4, D=6, V=10):
    g = torch.Generator().manual_seed(0)
    return dict(student_hidden=torch.randn(N, D, generator=g), student_weight=torch.randn(V, D, generator=g),
                teacher_hidden=torch.randn(N, D + 1, generator=g), teacher_weight=torch.randn(V, D + 1, generator=g))


BAD = [
    (dict(student_hidden=torch.randn(4)), "student_hidden must be 2-D \\(N, D_s\\)"),
    (dict(student_hidden=torch.ones(4, 6, dtype=torch.long)), "student_hidden must be a floating-point"),
    (dict(student_hidden=[[1.0]]), "student_hidden must be a torch.Tensor"),
    (dict(student_weight=torch.randn(10, 5)), "student_weight must be 2-D \\(V, D\\) with D = 6"),
    (dict(student_weight=torch.ones(10, 6, dtype=torch.int32)), "student_weight must be a floating-point"),
    (dict(student_weight=torch.randn(0, 6), teacher_weight=torch.randn(0, 7)), "at least one vocabulary row"),
    (dict(teacher_hidden=torch.randn(3, 7)), "teacher_hidden must be 2-D \\(N, D_t\\) with N = 4"),
    (dict(teacher_hidden=torch.ones(4, 7, dtype=torch.long)), "teacher_hidden must be a floating-point"),
    (dict(teacher_weight=torch.randn(10, 6)), "teacher_weight must be 2-D \\(V, D\\) with D = 7"),
    (dict(teacher_weight=torch.randn(9, 7)), "teacher_weight has 9 vocabulary rows, fewer than the student's 10"),
    (dict(teacher_weight=None), "teacher_weight must be a torch.Tensor"),
    (dict(student_bias=torch.randn(9)), "student_bias must have shape \\(10,\\)"),
    (dict(student_bias=torch.ones(10, dtype=torch.long)), "student_bias must be a floating-point"),
    (dict(teacher_bias=torch.randn(11)), "teacher_bias must have shape \\(10,\\)"),
    (dict(teacher_bias=torch.zeros(10, device="meta")), "teacher_bias is on meta but student_hidden is on cpu"),
    (dict(teacher_hidden=torch.zeros(4, 7, device="meta")), "teacher_hidden is on meta but student_hidden is on"),
    (dict(student_weight=torch.zeros(10, 6, device="meta")), "student_weight is on meta"),
    (dict(mask=torch.ones(3, dtype=torch.bool)), "mask must have shape \\(4,\\)"),
    (dict(mask=torch.ones(4)), "mask must be a bool tensor"),
    (dict(mask=[True] * 4), "mask must be a torch.Tensor"),
    (dict(beta=1.5), "beta must be a number in \\[0, 1\\]"),
    (dict(beta=-0.1), "beta must be a number in \\[0, 1\\]"),
    (dict(temperature=0.0), "temperature must be a finite number > 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number > 0"),
    (dict(student_logit_scale=0.0), "student_logit_scale must be a finite number > 0"),
    (dict(teacher_logit_scale=float("inf")), "teacher_logit_scale must be a finite number > 0"),
    (dict(student_softcap=0.0), "student_softcap must be None or a finite number > 0"),
    (dict(teacher_softcap=-1.0), "teacher_softcap must be None or a finite number > 0"),
    (dict(backend="fused"),
     "backend must be one of \\('auto', 'torch', 'reference', 'triton', 'triton-chunked'\\), got 'fused'"),
    (dict(chunk_rows=0), "chunk_rows must be None or an int >= 1"),
    (dict(chunk_rows=2.0), "chunk_rows must be None or an int >= 1"),
    (dict(num_teachers=0), "num_teachers must be an int >= 1"),
    (dict(teacher_index=torch.zeros(3, dtype=torch.long)), "teacher_index must have shape \\(4,\\)"),
    (dict(teacher_index=torch.zeros(4)), "teacher_index must be an integer tensor"),
    (dict(teacher_index=torch.tensor([0, 1, 2, 0]), num_teachers=2),
     "teacher_index values must lie in \\[0, num_teachers\\) = \\[0, 2\\)"),
    (dict(token_weights=torch.ones(3)), "token_weights must have shape \\(4,\\)"),
    (dict(token_weights=torch.tensor([1.0, -1.0, 1.0, 1.0])), "token_weights must be finite and >= 0"),
    (dict(token_weights=torch.ones(4, requires_grad=True)), "token_weights must not require grad"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_input_raises_value_error_naming_the_argument(overrides, message):
    args = _args()
    args.update(overrides)
    positional = [args.pop(k) for k in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")]
    with pytest.raises(ValueError, match=message):
        dense_teacher_jsd_loss(*positional, **args)


@pytest.mark.parametrize("beta,padded", [(0.0, False), (0.3, True), (1.0, True), (0.7, False)])
def test_student_top_k_torch_path_matches_float64_reference(beta, padded):
    x = make_inputs(seed=16 + int(beta * 10), Vt=110 if padded else 96)
    kw = dict(beta=beta, temperature=0.8, student_softcap=3.0, student_logit_scale=1.2, chunk_rows=5, student_top_k=6)
    ref, ref_grads = run(x, torch.float64, "reference", **kw)
    assert (float(ref.teacher_dropped_mass_sum) > 0) == padded
    fp32_tol = 3 * EPS32 * logit_error_scale(x, 1.2, 1.0, 0.8)
    assert fp32_tol <= 1e-5
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, fp32_tol)):
        out, grads = run(x, dtype, "torch", **kw)
        for f in FIELDS:
            rel_close(getattr(out, f), getattr(ref, f), rtol, f"{dtype} {f}")
        for name, g, r in zip(("dh", "dW", "db"), grads, ref_grads, strict=True):
            rel_close(g, r, rtol, f"{dtype} {name}")


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_student_top_k_over_the_whole_vocabulary_is_the_full_divergence(beta):
    """k = V_s: the candidates cover the vocabulary, no tail bucket is left, and the objective is the full one."""
    x = make_inputs(seed=17, V=40, Vt=44)
    full, full_grads = run(x, torch.float64, "torch", beta=beta)
    top, top_grads = run(x, torch.float64, "torch", beta=beta, student_top_k=40)
    for f in ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "teacher_dropped_mass_sum", "per_teacher"):
        torch.testing.assert_close(getattr(top, f), getattr(full, f), rtol=1e-10, atol=1e-13)
    for g, r in zip(top_grads, full_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)


def test_student_top_k_scores_the_students_favoured_tokens():
    """The support is the student's own top-k: a token the student favours and the teacher does not is scored
    (its teacher log-prob is the teacher's, however low), unlike a teacher top-K candidate set."""
    x = make_inputs(seed=18, N=6, V=50, Vt=50)
    out, _ = run(x, torch.float64, "torch", grads=False, beta=1.0, mask=None, token_weights=None, student_top_k=1)
    s = torch.log_softmax(x["hs"] @ x["ws"].t() + x["bs"], dim=-1)
    t = torch.log_softmax(x["ht"] @ x["wt"].t() + x["bt"], dim=-1)
    top = s.argmax(dim=1, keepdim=True)
    ps, pt = s.gather(1, top).exp(), t.gather(1, top).exp()  # the student's top token on each side, then the tail
    p, q = torch.cat([ps, 1 - ps], 1), torch.cat([pt, 1 - pt], 1)
    torch.testing.assert_close(out.loss, (p * (p.log() - q.log())).sum(), rtol=1e-10, atol=0)


def test_gradcheck_student_top_k_float64():
    x = make_inputs(seed=19, N=5, Ds=4, Dt=3, V=9, Vt=11)

    def f(hs, ws, bs):
        return dense_teacher_jsd_loss(hs, ws, x["ht"], x["wt"], student_bias=bs, teacher_bias=x["bt"], beta=0.4,
                                      student_softcap=2.0, mask=x["mask"], student_top_k=3, chunk_rows=2).loss

    leaves = tuple(x[k].clone().requires_grad_(True) for k in ("hs", "ws", "bs"))
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("k", [0, 11, 2.0, True])
def test_student_top_k_must_be_an_int_in_range(k):
    args = _args()
    positional = [args.pop(n) for n in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")]
    with pytest.raises(ValueError, match="student_top_k must be None or an int in \\[1, V_s\\] = \\[1, 10\\]"):
        dense_teacher_jsd_loss(*positional, student_top_k=k)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_student_top_k_is_a_lower_bound_of_the_full_divergence(beta):
    """The generalized JSD is an f-divergence, so merging tokens into one tail bucket can only lower it (data
    processing): top-k ≤ full at every position (checked on the sums here), growing with k (nested supports)."""
    x = make_inputs(seed=20, V=60, Vt=60)
    full, _ = run(x, torch.float64, "reference", grads=False, beta=beta, mask=None, token_weights=None)
    previous = 0.0
    for k in (1, 5, 20, 59):
        top, _ = run(x, torch.float64, "torch", grads=False, beta=beta, mask=None, token_weights=None,
                     student_top_k=k)
        assert previous - 1e-12 <= float(top.jsd_sum) <= float(full.jsd_sum) + 1e-12
        previous = float(top.jsd_sum)
