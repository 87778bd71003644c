"""``query_reverse_kl_loss`` and the policy-gradient stabilizers against exact enumeration (float64, tiny vocabulary).

The oracles are written out here: log π_θ from a float64 log-softmax of the logits, the reverse KL and its gradient
from autograd on that dense formula, the coarsened (support + tail) KL from its definition, PPO / decoupled PPO /
M2PO from their objectives (autograd through a differentiable ratio) and an iterative M2PO mask. Logit-space
gradients use an identity lm_head (D = V, weight = I), so that the hidden state is the logit vector.
"""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch

from fastdistill.loss import query_reverse_kl_loss, reverse_kl_pg_loss, sampled_token_logprobs, stabilized_ratios
from fastdistill.loss.policy_gradient import m2po_mask

EPS32 = torch.finfo(torch.float32).eps
V = 6


def dist(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * scale, dim=0)


def setting():
    """Student logits z, behaviour μ ≠ π_θ and teacher π_T (log-probs, (V,))."""
    z = torch.randn(V, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.2
    return z, dist(2, 0.8), dist(3, 1.5)


def dense_kl_gradient(z: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(π_θ‖π_T), ∇_z KL) from autograd on the dense formula."""
    z = z.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(z, dim=0)
    kl = (logp.exp() * (logp - teacher)).sum()
    (grad,) = torch.autograd.grad(kl, z)
    return kl.detach(), grad


def per_tuple_gradients(z, behaviour, teacher, draws: int, **kw):
    """All V^S tuples of S draws: (their probability Π μ (T,), the estimator's gradient w.r.t. z per tuple (T, V)),
    from one call with one row per tuple (identity head: row t's hidden state is z)."""
    tuples = torch.tensor(list(itertools.product(range(V), repeat=draws)), dtype=torch.long)
    rows = tuples.shape[0]
    hidden = z.detach().expand(rows, V).clone().requires_grad_(True)
    out = query_reverse_kl_loss(hidden, torch.eye(V, dtype=torch.float64), tuples, behaviour[tuples],
                                teacher[tuples], **kw)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    return behaviour[tuples].sum(dim=1).exp(), grad, out


@pytest.mark.parametrize("draws", [1, 2, 4])
def test_multi_sample_expectation_is_the_dense_reverse_kl_gradient_and_its_variance_is_one_over_s(draws):
    """Exact over every S-tuple drawn from μ ≠ π_θ (the realised token a_1 too): E[∇L] = ∇KL(π_θ‖π_T) of the
    current student, and Var_S = Var_1 / S per logit (iid draws)."""
    z, behaviour, teacher = setting()
    assert (torch.log_softmax(z, 0) - behaviour).abs().max() > 0.3  # μ is far from π_θ
    _, want = dense_kl_gradient(z, teacher)
    prob, grad, _ = per_tuple_gradients(z, behaviour, teacher, draws)
    torch.testing.assert_close(prob.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    mean = (prob[:, None] * grad).sum(0)
    torch.testing.assert_close(mean, want, rtol=1e-10, atol=1e-12)
    variance = (prob[:, None] * (grad - mean) ** 2).sum(0)
    prob1, grad1, _ = per_tuple_gradients(z, behaviour, teacher, 1)
    variance1 = (prob1[:, None] * (grad1 - (prob1[:, None] * grad1).sum(0)) ** 2).sum(0)
    assert variance1.min() > 1e-4  # a real variance, not zero
    torch.testing.assert_close(variance, variance1 / draws, rtol=1e-9, atol=1e-14)


def test_multi_sample_expectation_in_parameter_space_with_scale_softcap_and_temperature():
    """The same identity for ∇ over (hidden, weight) of a D < V head with logit_scale, softcap and temperature, S = 2:
    Σ over the 36 ordered pairs of Π μ · ∇L = ∇KL, the KL of the tempered, softcapped student."""
    torch.manual_seed(0)
    D = 3
    hidden = torch.randn(1, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    _, behaviour, teacher = setting()
    kw = dict(logit_scale=1.5, softcap=2.0, temperature=0.7)
    raw = (hidden @ weight.t() * 1.5)[0]
    logp = torch.log_softmax(2.0 * torch.tanh(raw / 2.0) / 0.7, dim=0)
    want = torch.autograd.grad((logp.exp() * (logp - teacher)).sum(), (hidden, weight))
    got = [torch.zeros_like(hidden), torch.zeros_like(weight)]
    for pair in itertools.product(range(V), repeat=2):
        ids = torch.tensor([pair])
        out = query_reverse_kl_loss(hidden, weight, ids, behaviour[ids], teacher[ids], **kw)
        for acc, g in zip(got, torch.autograd.grad(out.loss, (hidden, weight)), strict=True):
            acc += behaviour[ids].sum().exp() * g
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_without_the_ratio_the_estimator_is_biased_off_policy_and_exact_on_policy():
    """importance_ratio=False: E_μ[∇L] = Σ_a μ(a)(log π_θ − log π_T)(a)∇log π_θ(a), which differs from ∇KL when
    μ ≠ π_θ (the gap is measured) and equals it when μ = π_θ."""
    z, behaviour, teacher = setting()
    _, want = dense_kl_gradient(z, teacher)
    prob, grad, _ = per_tuple_gradients(z, behaviour, teacher, 2, importance_ratio=False)
    mean = (prob[:, None] * grad).sum(0)
    logp = torch.log_softmax(z, 0)
    # Σ_a μ(a)(log π_θ(a) − log π_T(a)) ∇_z log π_θ(a), ∇_z log π_θ(a) = e_a − π_θ
    jac = torch.eye(V, dtype=torch.float64) - logp.exp()[None, :]
    formula = (behaviour.exp() * (logp - teacher))[:, None].mul(jac).sum(0)
    torch.testing.assert_close(mean, formula, rtol=1e-10, atol=1e-12)
    bias = (mean - want).norm() / want.norm()
    assert bias > 0.1, float(bias)
    prob, grad, _ = per_tuple_gradients(z, logp, teacher, 2, importance_ratio=False)
    torch.testing.assert_close((prob[:, None] * grad).sum(0), want, rtol=1e-10, atol=1e-12)


def test_the_reverse_kl_estimate_is_unbiased_and_reverse_kl_pg_is_the_one_draw_case():
    """E_μ[reverse_kl] = KL(π_θ‖π_T) with the ratio; with S = 1 and a_1 the sampled token, the loss and gradient
    are reverse_kl_pg_loss's with its importance ratio."""
    z, behaviour, teacher = setting()
    kl, _ = dense_kl_gradient(z, teacher)
    prob, _, out = per_tuple_gradients(z, behaviour, teacher, 2)
    torch.testing.assert_close((prob * out.reverse_kl).sum(), kl, rtol=1e-10, atol=1e-12)
    hidden = z.expand(V, V).clone().requires_grad_(True)
    ids = torch.arange(V)
    a = query_reverse_kl_loss(hidden, torch.eye(V, dtype=torch.float64), ids[:, None], behaviour[:, None],
                              teacher[:, None])
    (ga,) = torch.autograd.grad(a.loss, hidden)
    b = reverse_kl_pg_loss(hidden, torch.eye(V, dtype=torch.float64), ids, teacher, rollout_logprobs=behaviour)
    (gb,) = torch.autograd.grad(b.loss, hidden)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.ratio_sum, b.ratio_sum, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------- student top-k


def coarsened_kl(z: torch.Tensor, teacher: torch.Tensor, support: list[int]) -> torch.Tensor:
    """KL between the student and teacher coarsened to ``support`` plus one tail bucket, from the definition."""
    logp = torch.log_softmax(z, 0)
    tail = [v for v in range(V) if v not in support]
    p = torch.cat([logp[support].exp(), logp[tail].exp().sum()[None]]) if tail else logp[support].exp()
    q = torch.cat([teacher[support].exp(), teacher[tail].exp().sum()[None]]) if tail else teacher[support].exp()
    return (p * (p.log() - q.log())).sum()


def topk_gradient(z, behaviour, teacher, size):
    """The estimator on the rollout student's (μ's) top-``size`` ids: (support, value, ∇_z)."""
    support = torch.topk(behaviour, size).indices
    hidden = z.detach()[None].clone().requires_grad_(True)
    out = query_reverse_kl_loss(hidden, torch.eye(V, dtype=torch.float64), support[None], behaviour[support][None],
                                teacher[support][None], estimator="student_topk")
    (grad,) = torch.autograd.grad(out.loss, hidden)
    return support.tolist(), out, grad[0]


def test_student_topk_covering_the_vocabulary_is_the_exact_reverse_kl():
    z, behaviour, teacher = setting()
    kl, want = dense_kl_gradient(z, teacher)
    _, out, grad = topk_gradient(z, behaviour, teacher, V)
    torch.testing.assert_close(out.reverse_kl_sum, kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(out.support_mass_sum, torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_student_topk_bias_is_what_the_tail_bucket_formula_says(size):
    """S < V, support = μ's top-S (not π_θ's: stale): the value is the coarsened KL (≤ the full KL), its gradient is
    p_v(ℓ_v − KL_S) with ℓ_v the bucket's log-ratio (the tail's own off the support), and the bias against the dense
    gradient p_v(log(p_v/q_v) − KL) is that difference: measured, over 5 % of the gradient's norm with two or more
    tail ids, zero with one (S = V − 1)."""
    z, behaviour, teacher = setting()
    kl, dense = dense_kl_gradient(z, teacher)
    support, out, grad = topk_gradient(z, behaviour, teacher, size)
    assert support != torch.topk(z, size).indices.tolist() or size == 1  # the stale support is not π_θ's top-S
    value = coarsened_kl(z, teacher, support)
    torch.testing.assert_close(out.reverse_kl_sum, value, rtol=1e-12, atol=1e-14)
    assert 0 < float(value) <= float(kl)
    logp = torch.log_softmax(z, 0)
    p = logp.exp()
    tail = torch.ones(V, dtype=torch.bool)
    tail[support] = False
    log_tail_ratio = torch.log(p[tail].sum()) - torch.log(teacher[tail].exp().sum())
    ratio = torch.where(tail, log_tail_ratio, logp - teacher)
    formula = p * (ratio - value)
    torch.testing.assert_close(grad, formula, rtol=1e-10, atol=1e-13)
    bias = grad - dense
    torch.testing.assert_close(bias, p * (ratio - (logp - teacher)) - p * (value - kl), rtol=1e-10, atol=1e-13)
    relative = float(bias.norm() / dense.norm())
    if int(tail.sum()) >= 2:  # the tail's log-ratios differ: biased
        assert relative > 0.05, relative
    else:  # one tail id: its log-ratio is the tail's, KL_S = KL, no bias
        assert relative < 1e-12, relative
        torch.testing.assert_close(value, kl, rtol=1e-12, atol=1e-14)


def test_student_topk_is_unbiased_when_the_tail_log_ratio_is_constant():
    """A teacher whose tail is proportional to the student's (log(p_v/q_v) the same at every tail id): KL_S = KL and
    the gradient is the dense one although the support is three of six ids."""
    z, behaviour, _ = setting()
    logp = torch.log_softmax(z, 0)
    support = torch.topk(behaviour, 3).indices
    tail = torch.ones(V, dtype=torch.bool)
    tail[support] = False
    q = torch.empty(V, dtype=torch.float64)
    q[support] = torch.tensor([0.3, 0.25, 0.2], dtype=torch.float64)
    q[tail] = 0.25 * logp.exp()[tail] / logp.exp()[tail].sum()
    teacher = q.log()
    kl, dense = dense_kl_gradient(z, teacher)
    _, out, grad = topk_gradient(z, behaviour, teacher, 3)
    torch.testing.assert_close(out.reverse_kl_sum, kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, dense, rtol=1e-10, atol=1e-13)


# ------------------------------------------------------------------------------------------------- stabilizers


def stabilizer_case(spread: float, seed: int = 5, rows: int = 8, draws: int = 3):
    """Rows of student logits, draws and behaviour log-probs whose log-ratios spread by about ``spread``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, V, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(z, 1)
    ids = torch.randint(0, V, (rows, draws), generator=g)
    behaviour = logp.gather(1, ids) + spread * torch.randn(rows, draws, generator=g, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5, 1).gather(1, ids)
    return z, ids, behaviour, teacher


def loss_gradient(z, ids, behaviour, teacher, **kw):
    hidden = z.clone().requires_grad_(True)
    out = query_reverse_kl_loss(hidden, torch.eye(V, dtype=torch.float64), ids, behaviour, teacher, **kw)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    return out, grad


def objective_gradient(z, ids, behaviour, teacher, objective):
    """∇_z of −(1/S)·Σ objective(r, A, logp) with r = π_θ/μ differentiable and A detached (the oracle)."""
    hidden = z.clone().requires_grad_(True)
    logp = torch.log_softmax(hidden, 1).gather(1, ids)
    advantage = (teacher - logp).detach()
    value = -objective(torch.exp(logp - behaviour), advantage, logp).sum() / ids.shape[1]
    (grad,) = torch.autograd.grad(value, hidden)
    return grad


def ppo(r, a, eps):
    return torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)


@pytest.mark.parametrize("stabilizer", ["ppo_clip", "decoupled_ppo", "m2po"])
def test_stabilizers_reduce_to_the_plain_estimator_inside_their_range(stabilizer):
    z, ids, behaviour, teacher = stabilizer_case(0.05)
    plain, want = loss_gradient(z, ids, behaviour, teacher)
    log_ratio = torch.log_softmax(z, 1).gather(1, ids) - behaviour
    assert log_ratio.abs().max() < math.log(1.2) and (log_ratio**2).mean() < 0.01
    kw = {"proximal_logprobs": behaviour + 0.5 * log_ratio} if stabilizer == "decoupled_ppo" else {}
    out, grad = loss_gradient(z, ids, behaviour, teacher, stabilizer=stabilizer, **kw)
    torch.testing.assert_close(grad, want, rtol=1e-13, atol=1e-15)
    assert float(out.clipped) == 0 and float(out.masked) == 0


def test_ppo_clip_is_ppos_objective_gradient_and_clips_the_expected_entries():
    z, ids, behaviour, teacher = stabilizer_case(0.6)
    out, grad = loss_gradient(z, ids, behaviour, teacher, stabilizer="ppo_clip", clip_eps=0.2)
    torch.testing.assert_close(grad, objective_gradient(z, ids, behaviour, teacher, lambda r, a, _: ppo(r, a, 0.2)),
                               rtol=1e-12, atol=1e-14)
    r = torch.exp(torch.log_softmax(z, 1).gather(1, ids) - behaviour)
    a = teacher - torch.log_softmax(z, 1).gather(1, ids)
    expected = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))
    assert 0 < int(expected.sum()) < expected.numel()
    assert int(out.clipped) == int(expected.sum())
    weights = stabilized_ratios((r.log()), a, stabilizer="ppo_clip", clip_eps=0.2)
    assert torch.equal(weights.clipped, expected)


def test_decoupled_ppo_is_its_objective_gradient_with_the_proximal_policy():
    """(π_prox/μ)·min(r'A, clip(r')A), r' = π_θ/π_prox: the proximal policy between μ and π_θ clips the entries
    where π_θ moved more than ε from π_prox, not from μ."""
    z, ids, behaviour, teacher = stabilizer_case(0.6)
    logp = torch.log_softmax(z, 1).gather(1, ids)
    proximal = logp + 0.3 * torch.randn(ids.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out, grad = loss_gradient(z, ids, behaviour, teacher, stabilizer="decoupled_ppo", proximal_logprobs=proximal)

    def objective(r, a, lp):
        prox_ratio = torch.exp(proximal - behaviour)
        return prox_ratio * ppo(torch.exp(lp - proximal), a, 0.2)

    torch.testing.assert_close(grad, objective_gradient(z, ids, behaviour, teacher, objective), rtol=1e-12,
                               atol=1e-14)
    r2 = torch.exp(logp - proximal)
    a = teacher - logp
    expected = ((a > 0) & (r2 > 1.2)) | ((a < 0) & (r2 < 0.8))
    assert 0 < int(expected.sum()) and int(out.clipped) == int(expected.sum())
    # without proximal log-probs the current weights are the proximal policy: nothing clipped, the plain gradient
    none, plain = loss_gradient(z, ids, behaviour, teacher, stabilizer="decoupled_ppo")
    torch.testing.assert_close(plain, loss_gradient(z, ids, behaviour, teacher)[1], rtol=1e-13, atol=1e-15)
    assert int(none.clipped) == 0


def iterative_m2po(log_ratio: torch.Tensor, budget: float) -> torch.Tensor:
    """Mask the largest (log r)² one at a time until the kept entries' mean is ≤ budget."""
    second = (log_ratio**2).flatten().tolist()
    masked = [False] * len(second)
    while True:
        kept = [s for s, m in zip(second, masked, strict=True) if not m]
        if not kept or sum(kept) / len(kept) <= budget:
            return torch.tensor(masked).view(log_ratio.shape)
        largest = max((s, i) for i, s in enumerate(second) if not masked[i])[1]
        masked[largest] = True


@pytest.mark.parametrize("budget", [0.005, 0.02, 0.05])
def test_m2po_masks_the_largest_second_moments_until_the_budget(budget):
    z, ids, behaviour, teacher = stabilizer_case(0.3)
    log_ratio = torch.log_softmax(z, 1).gather(1, ids) - behaviour
    expected = iterative_m2po(log_ratio, budget)
    assert 0 < int(expected.sum()) < expected.numel()
    assert torch.equal(m2po_mask(log_ratio, budget), expected)
    out, grad = loss_gradient(z, ids, behaviour, teacher, stabilizer="m2po", m2po_budget=budget)
    assert int(out.masked) == int(expected.sum())
    keep = (~expected).double()
    torch.testing.assert_close(grad, objective_gradient(z, ids, behaviour, teacher, lambda r, a, _: keep * r * a),
                               rtol=1e-12, atol=1e-14)
    assert float((log_ratio[~expected] ** 2).mean()) <= budget


def test_reverse_kl_pg_takes_the_stabilizers_as_the_one_draw_estimator():
    z, ids, behaviour, teacher = stabilizer_case(0.6, draws=1)
    for stabilizer in ("ppo_clip", "decoupled_ppo", "m2po"):
        a, ga = loss_gradient(z, ids, behaviour, teacher, stabilizer=stabilizer)
        hidden = z.clone().requires_grad_(True)
        b = reverse_kl_pg_loss(hidden, torch.eye(V, dtype=torch.float64), ids[:, 0], teacher[:, 0],
                               rollout_logprobs=behaviour[:, 0], stabilizer=stabilizer)
        (gb,) = torch.autograd.grad(b.loss, hidden)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
        assert float(a.clipped) == float(b.clipped) and float(a.masked) == float(b.masked)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        reverse_kl_pg_loss(z, torch.eye(V, dtype=torch.float64), ids[:, 0], teacher[:, 0], stabilizer="ppo_clip")
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        reverse_kl_pg_loss(z, torch.eye(V, dtype=torch.float64), ids[:, 0], teacher[:, 0], stabilizer="m2po",
                           rollout_logprobs=behaviour[:, 0], ratio_clip=2.0)


# ------------------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("estimator", ["multi_sample", "student_topk"])
def test_float32_agrees_with_float64_within_the_rounding_bound(estimator):
    """300 positions (two row chunks), D = 8: float32 against float64, per position and summed, within bounds built
    from the arithmetic (ε = float32's epsilon). A logit is a D-term dot product (error ≤ D·ε·Σ_d|h_d w_d|) and a
    log-prob subtracts a V-term log-sum-exp (≤ (V + 2)·ε·(1 + max|z|) more), twice for safety: e per log-prob. Each
    entry's term is a product of such log-probs, the ratio exp(log π_θ − log μ) and the teacher's log-prob, so its
    error is bounded by first-order propagation (every factor at its own magnitude, doubled); the sum over positions
    adds ⌈log2 N⌉·ε·Σ|terms| (pairwise summation)."""
    g = torch.Generator().manual_seed(11)
    n, d, draws = 300, 8, 3
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64) * 0.5
    if estimator == "student_topk":
        ids = torch.argsort(torch.rand(n, V, generator=g), dim=1)[:, :draws]
    else:
        ids = torch.randint(0, V, (n, draws), generator=g)
    logits = hidden @ weight.t()
    logp64 = torch.log_softmax(logits, 1)
    behaviour = (logp64.gather(1, ids) + 0.2 * torch.randn(n, draws, generator=g, dtype=torch.float64))
    teacher_full = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64), 1)
    teacher = teacher_full.gather(1, ids)
    e = 2 * (d * EPS32 * (hidden.abs() @ weight.abs().t()).amax(1) + (V + 2) * EPS32 * (1 + logits.abs().amax(1)))
    lp32 = sampled_token_logprobs(hidden.float(), weight.float(), ids)
    assert lp32.dtype == torch.float32
    lp = logp64.gather(1, ids)
    assert bool(((lp32.double() - lp).abs() <= e[:, None]).all())
    kw = dict(estimator=estimator)
    out64 = query_reverse_kl_loss(hidden, weight, ids, behaviour, teacher, **kw)
    out32 = query_reverse_kl_loss(hidden.float(), weight.float(), ids, behaviour.float(), teacher.float(), **kw)
    gap = lp - teacher
    ee = e[:, None]
    if estimator == "multi_sample":  # mean_n w_n·(lp − T)_n, w = exp(lp − b)
        w = torch.exp(lp - behaviour)
        rel_w = ee + EPS32 * (behaviour.abs() + 2)
        per_entry = w * (ee + EPS32 * gap.abs()) + w * gap.abs() * rel_w
        per_position = 2 * per_entry.mean(1)
    else:  # Σ_S p·(lp − T) + P_tail·(log P_tail − log Q_tail)
        p = lp.exp()
        q_tail = 1 - teacher.exp().sum(1)
        p_tail = 1 - p.sum(1)
        tail_gap = (p_tail.log() - q_tail.log()).abs()
        per_position = 2 * ((p * (ee + (ee + EPS32) * gap.abs())).sum(1)
                            + p_tail * (ee.squeeze(1) * (1 + tail_gap) / p_tail.clamp(min=1e-3)
                                        + draws * EPS32 / q_tail))
    assert bool(((out32.reverse_kl.double() - out64.reverse_kl).abs() <= per_position).all())
    total = per_position.sum() + math.ceil(math.log2(n * draws)) * EPS32 * out64.reverse_kl.abs().sum() * 2
    assert abs(float(out32.reverse_kl_sum) - float(out64.reverse_kl_sum)) <= float(total)
    assert float(per_position.max() / out64.reverse_kl.abs().max()) < 1e-3  # a bound tight enough to mean something


@pytest.mark.parametrize("estimator", ["multi_sample", "student_topk"])
def test_no_n_by_v_tensor_is_kept_for_backward(estimator):
    """1024 positions, V = 64: every tensor autograd saves for backward is smaller than one (256, V) chunk tile
    (checkpointing keeps only each chunk's inputs), let alone (N, V); the gradient is the unchunked one's."""
    from fastdistill.loss.policy_gradient import CHUNK_ROWS

    g = torch.Generator().manual_seed(3)
    n, vocab, d, draws = 1024, 64, 8, 4
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, requires_grad=True)
    ids = torch.argsort(torch.rand(n, vocab, generator=g), 1)[:, :draws]
    lps = torch.full((n, draws), -3.0)
    largest = []

    def pack(t):
        largest.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = query_reverse_kl_loss(hidden, weight, ids, lps, lps, estimator=estimator)
    assert max(largest) < CHUNK_ROWS * vocab < n * vocab, max(largest)
    grads = torch.autograd.grad(out.loss, (hidden, weight))
    logits = hidden @ weight.t()
    logp = torch.log_softmax(logits, 1)
    lp = logp.gather(1, ids)
    if estimator == "multi_sample":
        advantage = (lps - lp).detach()
        dense = -(torch.exp(lp - lps).detach() * advantage * lp).sum() / draws
    else:
        tail = torch.logsumexp(logits.scatter(1, ids, -math.inf), 1) - torch.logsumexp(logits, 1)
        dense = (lp.exp() * (lp - lps)).sum() + (tail.exp() * (tail - torch.log1p(-lps.exp().sum(1)))).sum()
    for got, want in zip(grads, torch.autograd.grad(dense, (hidden, weight)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_positions_still_connects_the_graph():
    weight = torch.randn(V, 3, requires_grad=True)
    hidden = torch.zeros(0, 3, requires_grad=True)
    empty = torch.zeros(0, 2)
    for estimator in ("multi_sample", "student_topk"):
        out = query_reverse_kl_loss(hidden, weight, empty.long(), empty, empty, estimator=estimator)
        out.loss.backward()
        assert float(out.loss.detach()) == 0 and int(out.num_tokens) == 0 and weight.grad is not None


# ------------------------------------------------------------------------------------------------- errors


def bad_calls():
    h, w = torch.randn(2, 3), torch.randn(V, 3)
    ids = torch.tensor([[0, 1], [2, 3]])
    lp = torch.full((2, 2), -1.0)
    base = dict(hidden=h, weight=w, query_ids=ids, behaviour_logprobs=lp, teacher_logprobs=lp)

    def case(match, **changes):
        return pytest.param({**base, **changes}, match, id=match[:40])

    return [
        case("estimator must be one of", estimator="dense"),
        case("hidden must be", hidden=torch.randn(2, 4)),
        case("query_ids must be", query_ids=ids[:1]),
        case("query_ids must be an integer", query_ids=ids.float()),
        case("behaviour_logprobs must have shape", behaviour_logprobs=lp[:, :1]),
        case("teacher_logprobs must have shape", teacher_logprobs=lp[:1]),
        case("token_weights must have shape", token_weights=torch.ones(3)),
        case("proximal_logprobs must have shape", proximal_logprobs=lp[:, :1], stabilizer="decoupled_ppo"),
        case(r"query_ids must lie in \[0, V\)", query_ids=ids + V - 1),
        case(r"query_ids must lie in \[0, V\)", query_ids=ids - 1),
        case("teacher_logprobs must be finite", teacher_logprobs=torch.tensor([[-1.0, float("nan")], [-1, -1]])),
        case("behaviour_logprobs must be finite", behaviour_logprobs=torch.tensor([[-1.0, -math.inf], [-1, -1]])),
        case("temperature must be", temperature=0.0),
        case("sampling_temperature must be", sampling_temperature=math.inf),
        case("stabilizer must be one of", stabilizer="grpo"),
        case("clip_eps must be", stabilizer="ppo_clip", clip_eps=1.0),
        case("m2po_budget must be", stabilizer="m2po", m2po_budget=0.0),
        case("ratio_clip must be", ratio_clip=-1.0),
        case("stabilizer must be 'none'", estimator="student_topk", stabilizer="m2po"),
        case("distinct query_ids", estimator="student_topk", query_ids=torch.tensor([[0, 0], [1, 2]])),
        case(r"S = 7 > V = 6", estimator="student_topk", query_ids=torch.zeros(2, 7, dtype=torch.long),
             behaviour_logprobs=torch.zeros(2, 7), teacher_logprobs=torch.zeros(2, 7)),
        case("importance_ratio=False leaves no ratio", importance_ratio=False, stabilizer="ppo_clip"),
        case("clips itself", stabilizer="ppo_clip", ratio_clip=2.0),
        case("proximal_logprobs are decoupled PPO's", proximal_logprobs=lp),
        case("sampling_top_k must be None or an int", sampling_top_k=2.5),
    ]


@pytest.mark.parametrize("kwargs,match", bad_calls())
def test_bad_inputs_are_value_errors_naming_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        query_reverse_kl_loss(**kwargs)


# ------------------------------------------------------------------------------------------------ the trainer


def test_config_maps_the_loss_types_to_student_queries_and_refuses_what_cannot_work():
    from fastdistill.errors import ConfigError
    from fastdistill.train.config import AsyncDistillationConfig

    base = dict(model_name_or_path="m", weight_sync_backend="none")
    mc = AsyncDistillationConfig(**base, loss_type="reverse_kl_mc", num_student_queries=4, top_k=8)
    topk = AsyncDistillationConfig(**base, loss_type="reverse_kl_student_topk", num_student_queries=3)
    assert (mc.student_queries, topk.student_queries) == ("samples", "topk")
    assert AsyncDistillationConfig(**base).student_queries == "none"
    for stabilizer in ("ppo_clip", "decoupled_ppo", "m2po"):
        AsyncDistillationConfig(**base, loss_type="reverse_kl_mc", num_student_queries=2, top_k=8,
                                pg_stabilizer=stabilizer)
        AsyncDistillationConfig(**base, loss_type="reverse_kl_pg", pg_importance_ratio=True, pg_stabilizer=stabilizer)
    refused = [
        (dict(loss_type="reverse_kl_mc"), "num_student_queries must be an int >= 1 with loss_type='reverse_kl_mc'"),
        (dict(loss_type="reverse_kl_student_topk", num_student_queries=0), "num_student_queries must be an int >= 1"),
        (dict(num_student_queries=2), "num_student_queries must be 0 with loss_type='jsd'"),
        (dict(loss_type="reverse_kl_mc", num_student_queries=2),
         "top_k must be a top-k with loss_type='reverse_kl_mc'"),
        (dict(pg_stabilizer="ppo_clip"), "pg_stabilizer must be 'none' with loss_type='jsd'"),
        (dict(loss_type="reverse_kl_student_topk", num_student_queries=2, pg_stabilizer="m2po"),
         "pg_stabilizer must be 'none' with loss_type='reverse_kl_student_topk'"),
        (dict(loss_type="reverse_kl_pg", pg_stabilizer="ppo_clip"), "pg_importance_ratio=False"),
        (dict(loss_type="reverse_kl_pg", pg_importance_ratio=True, pg_ratio_clip=2.0, pg_stabilizer="ppo_clip"),
         "pg_ratio_clip must be None with pg_stabilizer='ppo_clip'"),
        (dict(loss_type="reverse_kl_student_topk", num_student_queries=2, pg_ratio_clip=2.0),
         "pg_ratio_clip must be None, or a number > 0"),
        (dict(pg_stabilizer="trust_region"), "pg_stabilizer must be one of"),
        (dict(pg_clip_eps=1.5), "pg_clip_eps must be in (0, 1)"),
        (dict(m2po_budget=0.0), "m2po_budget must be a finite number > 0"),
        (dict(loss_type="reverse_kl_mc", num_student_queries=2, top_k=8, teacher_cache="cache"),
         "loss_type must be 'jsd' with teacher_cache"),
        (dict(loss_type="reverse_kl_student_topk", num_student_queries=2, teacher_cache="cache"),
         "loss_type must be 'jsd' with teacher_cache"),
    ]
    for overrides, message in refused:
        with pytest.raises(ConfigError) as error:
            AsyncDistillationConfig(**{**base, **overrides})
        assert message in str(error.value), (overrides, str(error.value))
    AsyncDistillationConfig(**base, loss_type="reverse_kl_mc", num_student_queries=2, top_k=8, pg_ratio_clip=2.0)
    # a hidden-state teacher is supported: the trainer computes log π_T at the query ids from the teacher's head
    AsyncDistillationConfig(**base, loss_type="reverse_kl_student_topk", num_student_queries=2,
                            teacher_server_urls={"d": "http://127.0.0.1:10"}, teacher_signal="hidden")


def test_the_rollout_config_asks_for_the_loss_types_queries():
    from fastdistill.train.checkpoint import RolloutState
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.pipeline import rollout_config

    for loss, extra, kind in (("reverse_kl_mc", dict(top_k=8), "samples"), ("reverse_kl_student_topk", {}, "topk")):
        cfg = AsyncDistillationConfig(model_name_or_path="m", weight_sync_backend="none", loss_type=loss,
                                      num_student_queries=3, **extra)
        rollouts = rollout_config(cfg, world_size=1, rollout_state=RolloutState(), total_prompts=4,
                                  skip_rows=frozenset(), on_policy=None, eos_ids=(2,), adapter_sync=False)
        assert (rollouts.student_queries, rollouts.num_student_queries) == (kind, 3)


QUERIES = 3


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(tokenizer, student folder, top-K teacher model, hidden teacher folder and model) of the tiny family."""
    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    student = build_model(tiny_config(vocab, pad_token_id=0, eos_token_id=2), seed=7)
    student_dir = save_pretrained_dir(student, tokenizer, tmp_path_factory.mktemp("student"))
    teacher = build_model(tiny_config(vocab, pad_token_id=0, eos_token_id=2), seed=103).float().eval()
    teacher_dir = save_pretrained_dir(teacher, tokenizer, tmp_path_factory.mktemp("teacher"))
    return tokenizer, student_dir, teacher, teacher_dir


def completion_logprobs(model, sample) -> torch.Tensor:
    """(L, V) float64 log-probs of ``model`` at the positions predicting each completion token."""
    with torch.no_grad():
        logits = model(torch.tensor(sample.input_ids[None].astype("int64")), use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), -1)[sample.prompt_length - 1 : -1]


def with_queries(samples, student, teacher, kind: str):
    """The samples with student queries: μ is the student's distribution sharpened (so π_θ ≠ μ), draws from it with
    the realised token first ("samples") or its top-S ("topk"), and the teacher's log-probs at them."""
    import dataclasses

    import numpy as np

    rng = torch.Generator().manual_seed(4)
    out = []
    for sample in samples:
        mu = torch.log_softmax(completion_logprobs(student, sample) * 1.5, -1)
        if kind == "samples":
            ids = torch.multinomial(mu.exp(), QUERIES, replacement=True, generator=rng)
            ids[:, 0] = torch.from_numpy(sample.completion_ids.astype("int64"))
        else:
            ids = torch.topk(mu, QUERIES, dim=-1).indices
        teacher_lp = completion_logprobs(teacher, sample).gather(1, ids)
        out.append(dataclasses.replace(sample, query_ids=ids.numpy().astype(np.int32),
                                       query_behaviour_logprobs=mu.gather(1, ids).numpy().astype(np.float32),
                                       query_teacher_logprobs=teacher_lp.numpy().astype(np.float32)))
    return out


def oracle_estimate(student, sample, kind: str) -> torch.Tensor:
    """(L,) per position from the Hugging Face student's float64 log-probs: (1/S) Σ_n w_n (log π_θ − log π_T)(a_n)
    with w = π_θ/μ, or the support-plus-tail KL."""
    logp = completion_logprobs(student, sample)
    ids = torch.from_numpy(sample.query_ids.astype("int64"))
    lp, mu = logp.gather(1, ids), torch.from_numpy(sample.query_behaviour_logprobs).double()
    teacher = torch.from_numpy(sample.query_teacher_logprobs).double()
    if kind == "samples":
        return (torch.exp(lp - mu) * (lp - teacher)).mean(1)
    p_tail, q_tail = 1 - lp.exp().sum(1), 1 - teacher.exp().sum(1)
    return (lp.exp() * (lp - teacher)).sum(1) + p_tail * (p_tail.log() - q_tail.log())


@pytest.mark.parametrize("loss_type,kind", [("reverse_kl_mc", "samples"), ("reverse_kl_student_topk", "topk")])
def test_a_training_step_logs_the_estimate_of_the_current_student(loss_type, kind, tiny_models, tmp_path):
    """One trainer step on samples with queries: the logged reverse_kl is the mean over positions of the estimate
    computed here from the Hugging Face student (before the step), with the pg metrics; the weights move."""
    from trainer_cases import offline_config
    from transformers import AutoModelForCausalLM

    from fastdistill.train.trainer import AsyncDistillationTrainer
    from fastdistill_testing.synthetic import synthetic_samples

    tokenizer, student_dir, teacher, _ = tiny_models
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    samples = with_queries(synthetic_samples(teacher, len(tokenizer), 4, seed=5), student, teacher, kind)
    cfg = offline_config(student_dir, tmp_path, teacher_server_urls={"default": "http://127.0.0.1:9"},
                         loss_type=loss_type, num_student_queries=QUERIES, max_steps=1, top_k=8,
                         per_device_train_batch_size=4, export_final_model=True)
    AsyncDistillationTrainer(cfg, samples=samples).train()
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    want = torch.cat([oracle_estimate(student, s, kind) for s in samples]).mean()
    assert logged["reverse_kl"] == pytest.approx(float(want), rel=1e-4)
    assert "pg/advantage_std" in logged
    assert ("pg/ratio_mean" in logged) == (kind == "samples")
    assert ("pg/support_mass_mean" in logged) == (kind == "topk")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not torch.equal(trained.lm_head.weight, student.lm_head.weight)


@pytest.mark.parametrize("loss_type,kind", [("reverse_kl_pg", None), ("reverse_kl_mc", "samples"),
                                            ("reverse_kl_student_topk", "topk")])
def test_a_hidden_state_teacher_gets_its_query_logprobs_from_its_head(loss_type, kind, tiny_models):
    """A hidden-state teacher sends no log-probs: the model computes log π_T at the query ids (the sampled token
    for reverse_kl_pg) from the teacher's head on its hidden states; the loss equals the one on the same samples
    with the teacher's log-probs on the wire (to float32 rounding of the two routes)."""
    import dataclasses

    import numpy as np
    from transformers import AutoModelForCausalLM

    from fastdistill.data.packing import pack_row
    from fastdistill.loss import narrow_support
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.model import DistillationModel
    from fastdistill.train.step import TrainStep
    from fastdistill.train.teacher_head import load_teacher_head
    from fastdistill_testing.synthetic import synthetic_samples

    tokenizer, student_dir, teacher, teacher_dir = tiny_models
    student = AutoModelForCausalLM.from_pretrained(student_dir).float()
    samples = synthetic_samples(teacher, len(tokenizer), 3, seed=6)
    if kind is not None:
        samples = with_queries(samples, student.eval(), teacher, kind)
    hidden_samples = []
    for s in samples:
        with torch.no_grad():
            states = teacher.model(torch.tensor(s.input_ids[None].astype("int64"))).last_hidden_state[0]
        rows = states[s.prompt_length - 1 : -1].float().numpy()
        width = (len(s.completion_ids), 0)
        hidden_samples.append(dataclasses.replace(
            s, teacher_hidden=rows, teacher_topk_ids=np.zeros(width, np.int32),
            teacher_topk_logprobs=np.zeros(width, np.float32), query_teacher_logprobs=None))
    extra = dict(num_student_queries=QUERIES, top_k=8) if kind else {}
    outputs = []
    for batch, signal in ((samples, "topk"), (hidden_samples, "hidden")):
        cfg = AsyncDistillationConfig(model_name_or_path=str(student_dir), weight_sync_backend="none",
                                      teacher_server_urls={"default": "http://127.0.0.1:9"}, teacher_signal=signal,
                                      loss_type=loss_type, **extra)
        model = DistillationModel(student, cfg)
        model.teacher_heads = {0: load_teacher_head(teacher_dir)} if signal == "hidden" else {}
        row = pack_row(batch, ["default"], vocab_size=len(tokenizer))
        support = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)
        out, _ = model(row, *support)
        outputs.append(out)
        # the step's token count (the loss's normaliser) counts the positions the model scored
        assert TrainStep._scored_count(SimpleNamespace(config=cfg), row, support) == int(out.num_tokens)
    topk_out, hidden_out = outputs
    # the synthetic top-K rows carry the realised token (top-K, or added): every position is scored either way
    assert int(hidden_out.num_tokens) == int(topk_out.num_tokens) == row.num_trained
    assert float(hidden_out.jsd_sum) == pytest.approx(float(topk_out.jsd_sum), rel=1e-5, abs=1e-5)
    assert float(hidden_out.jsd_sum) != 0.0
    grads = torch.autograd.grad(hidden_out.loss, student.lm_head.weight)
    assert bool(torch.isfinite(grads[0]).all()) and grads[0].abs().sum() > 0


def test_a_row_without_queries_is_refused_by_a_query_loss_type(tiny_models):
    from transformers import AutoModelForCausalLM

    from fastdistill.data.packing import pack_row
    from fastdistill.loss import narrow_support
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.model import DistillationModel
    from fastdistill_testing.synthetic import synthetic_samples

    tokenizer, student_dir, teacher, _ = tiny_models
    cfg = AsyncDistillationConfig(model_name_or_path=str(student_dir), weight_sync_backend="none",
                                  loss_type="reverse_kl_student_topk", num_student_queries=2)
    model = DistillationModel(AutoModelForCausalLM.from_pretrained(student_dir), cfg)
    row = pack_row(synthetic_samples(teacher, len(tokenizer), 2, seed=8), ["default"], vocab_size=len(tokenizer))
    support = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)
    with pytest.raises(ValueError, match="reads student queries, and this row's samples carry none"):
        model(row, *support)


# ------------------------------------------------------------------------------------------------ top-k sampling


def truncated(logp: torch.Tensor, k: int) -> torch.Tensor:
    """log of ``logp``'s top-k renormalised, −inf elsewhere (rows), from its definition."""
    top = torch.topk(logp, k, dim=-1)
    out = torch.full_like(logp, -math.inf)
    return out.scatter(-1, top.indices, top.values - torch.logsumexp(top.values, -1, keepdim=True))


def test_under_top_k_sampling_a_fresh_ratio_is_the_top_k_mass_and_the_stabilizers_read_the_lag_instead():
    """μ = the current student's top-3 of 6, renormalised (a fresh rollout under top-k): r = π_θ/μ is the top-3 mass Z
    on every draw, so M2PO masks every entry and PPO-clip clips the negative-advantage ones; with
    ``sampling_top_k=3`` they judge the move by μ_θ/μ = 1 and reduce to the plain estimator."""
    from fastdistill.loss.policy_gradient import sampler_log_ratio

    z, ids, _, teacher = stabilizer_case(0.0, draws=3)
    logp = torch.log_softmax(z, 1)
    mu = truncated(logp, 3)
    ids = torch.topk(logp, 3, dim=1).indices  # draws inside μ's support
    behaviour = mu.gather(1, ids)
    mass = torch.topk(logp, 3, dim=1).values.exp().sum(1)
    lag = sampler_log_ratio(z, torch.eye(V, dtype=torch.float64), ids, behaviour, bias=None, logit_scale=1.0,
                            softcap=None, sampling_temperature=1.0, sampling_top_k=3)
    torch.testing.assert_close(lag, torch.zeros_like(lag), rtol=0, atol=1e-14)
    assert sampler_log_ratio(z, torch.eye(V, dtype=torch.float64), ids, behaviour, bias=None, logit_scale=1.0,
                             softcap=None, sampling_temperature=1.0, sampling_top_k=V) is None
    plain, want = loss_gradient(z, ids, behaviour, teacher)
    torch.testing.assert_close(torch.exp(torch.log_softmax(z, 1).gather(1, ids) - behaviour),
                               mass[:, None].expand_as(ids), rtol=1e-12, atol=0)
    blind, _ = loss_gradient(z, ids, behaviour, teacher, stabilizer="m2po")
    assert int(blind.masked) == ids.numel()
    for stabilizer in ("m2po", "ppo_clip"):
        out, grad = loss_gradient(z, ids, behaviour, teacher, stabilizer=stabilizer, sampling_top_k=3)
        assert int(out.masked) == int(out.clipped) == 0
        torch.testing.assert_close(grad, want, rtol=1e-13, atol=1e-15)


def test_the_sampler_lag_ratio_is_the_truncated_distributions_ratio_and_ppo_clips_on_it():
    """A stale rollout (μ = the top-3 of perturbed logits): sampler_log_ratio = log μ_θ − log μ with μ_θ the current
    top-3 renormalised (−inf outside it), and PPO-clip clips exactly where that ratio leaves [0.8, 1.2] against the
    advantage's sign, weighting the rest by π_θ/μ."""
    from fastdistill.loss.policy_gradient import sampler_log_ratio

    z, _, _, _ = stabilizer_case(0.0, draws=3)
    g = torch.Generator().manual_seed(21)
    old = z + 0.4 * torch.randn(z.shape, generator=g, dtype=torch.float64)
    mu = truncated(torch.log_softmax(old, 1), 3)
    ids = torch.topk(old, 3, dim=1).indices
    behaviour = mu.gather(1, ids)
    teacher = torch.log_softmax(torch.randn(z.shape, generator=g, dtype=torch.float64), 1).gather(1, ids)
    current = truncated(torch.log_softmax(z, 1), 3).gather(1, ids)
    lag = sampler_log_ratio(z, torch.eye(V, dtype=torch.float64), ids, behaviour, bias=None, logit_scale=1.0,
                            softcap=None, sampling_temperature=1.0, sampling_top_k=3)
    torch.testing.assert_close(lag, current - behaviour, rtol=1e-12, atol=1e-14)
    assert bool(torch.isinf(lag).any())  # some stale draws left the current top-3
    out, grad = loss_gradient(z, ids, behaviour, teacher, stabilizer="ppo_clip", sampling_top_k=3)
    logp = torch.log_softmax(z, 1).gather(1, ids)
    r_lag, a = lag.exp(), teacher - logp
    expected = ((a > 0) & (r_lag > 1.2)) | ((a < 0) & (r_lag < 0.8))
    assert 0 < int(expected.sum()) < expected.numel() and int(out.clipped) == int(expected.sum())
    keep = (~expected).double()
    torch.testing.assert_close(grad, objective_gradient(z, ids, behaviour, teacher, lambda r, adv, _: keep * r * adv),
                               rtol=1e-12, atol=1e-14)
