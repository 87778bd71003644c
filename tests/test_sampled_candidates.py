"""Sampled teacher candidates: the estimator's expectation by exact enumeration, the mapping onto sparse_jsd_loss,
top-K's bias, duplicate merging, a Monte Carlo check and the argument errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fastdistill.loss import candidates_from_draws, sample_teacher_candidates, sampled_kd_loss, sparse_jsd_loss

STUDENT = dict(logit_scale=1.5, softcap=3.0, temperature=0.7)


def dense_student_logprobs(hidden, weight, bias, logit_scale, softcap, temperature):
    """The student's full-vocabulary log-probs, written out independently of the code under test."""
    x = logit_scale * (hidden @ weight.t() + bias)
    return torch.log_softmax(softcap * torch.tanh(x / softcap) / temperature, dim=-1)


def problem(seed, V=5, D=3, teacher_zero=None):
    """A float64 student (one position) and a teacher distribution (``teacher_zero``: a token without mass)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True)
    logits = 2.0 * torch.randn(1, V, generator=gen, dtype=torch.float64)
    if teacher_zero is not None:
        logits[0, teacher_zero] = float("-inf")
    return hidden, weight, bias, torch.log_softmax(logits, dim=-1)


def multisets(proposal_logprobs, num_samples):
    """Every multiset of ``num_samples`` i.i.d. draws from the proposal, with its multinomial probability."""
    V = proposal_logprobs.shape[0]
    for draws in itertools.combinations_with_replacement(range(V), num_samples):
        counts = [draws.count(v) for v in range(V)]
        prob = math.factorial(num_samples)
        for v, c in enumerate(counts):
            prob *= math.exp(float(proposal_logprobs[v])) ** c / math.factorial(c)
        if prob > 0:
            yield torch.tensor([draws]), prob


def expectation(hidden, weight, bias, teacher, num_samples, proposal_temperature, loss_fn):
    """Exact E[loss] and E[∇loss] over every outcome of the draws (``loss_fn(candidates) -> 0-dim loss``)."""
    proposal = torch.log_softmax(teacher[0] / proposal_temperature, dim=-1)
    leaves = (hidden, weight, bias)
    value, grads = 0.0, [torch.zeros_like(x) for x in leaves]
    for draws, prob in multisets(proposal, num_samples):
        cand = candidates_from_draws(draws, teacher, proposal_temperature=proposal_temperature)
        loss = loss_fn(cand)
        value += prob * float(loss.detach())
        for acc, g in zip(grads, torch.autograd.grad(loss, leaves), strict=True):
            acc += prob * g
    return value, grads


def dense_forward_kl(hidden, weight, bias, teacher, **student):
    """KL(π_T ‖ π_θ) over the whole vocabulary and the cross-entropy H(π_T, π_θ), float64."""
    logp = dense_student_logprobs(hidden, weight, bias, **student)
    p_teacher = teacher.exp()
    cross_entropy = -(p_teacher * logp).sum()
    kl = (torch.special.xlogy(p_teacher, p_teacher) - p_teacher * logp).sum()
    return kl, cross_entropy


def assert_grads_close(got, want, atol):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=atol)


@pytest.mark.parametrize("proposal_temperature", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("num_samples", [1, 2, 3])
def test_expectation_by_enumeration_is_the_dense_forward_kl(num_samples, proposal_temperature):
    """E[K̂L] = KL(π_T‖π_θ), E[Ĥ] = H(π_T, π_θ) and E[∇] = ∇KL (hidden, weight, bias), exactly (float64), over
    every multiset of S draws from a 5-token vocabulary; one teacher token has no mass (never drawn)."""
    zero = 4 if num_samples == 2 else None
    hidden, weight, bias, teacher = problem(seed=num_samples, teacher_zero=zero)
    kl, cross_entropy = dense_forward_kl(hidden, weight, bias, teacher, **STUDENT)
    dense_grads = torch.autograd.grad(kl, (hidden, weight, bias))

    def kl_form(c):
        return sampled_kd_loss(hidden, weight, c.ids, c.log_weights, teacher_logprobs=c.teacher_logprobs,
                               bias=bias, **STUDENT).loss

    def cross_entropy_form(c):
        return sampled_kd_loss(hidden, weight, c.ids, c.log_weights, bias=bias, **STUDENT).loss

    for form, target in ((kl_form, kl), (cross_entropy_form, cross_entropy)):
        value, grads = expectation(hidden, weight, bias, teacher, num_samples, proposal_temperature, form)
        assert value == pytest.approx(float(target.detach()), rel=0, abs=1e-12)
        assert_grads_close(grads, dense_grads, atol=1e-12)


def test_dense_oracle_is_the_projects_forward_kl_on_the_full_vocabulary():
    """The test's dense KL equals sparse_jsd_loss's float64 reference with every token a candidate (β = 0)."""
    hidden, weight, bias, teacher = problem(seed=7)
    kl, _ = dense_forward_kl(hidden, weight, bias, teacher, **STUDENT)
    V = teacher.shape[1]
    ids = torch.arange(V)[None]
    out = sparse_jsd_loss(hidden, weight, ids, teacher, torch.ones(1, V, dtype=torch.bool), bias=bias,
                          add_tail_bucket=False, backend="reference", **STUDENT)
    assert float(out.loss.detach()) == pytest.approx(float(kl.detach()), rel=0, abs=1e-13)


@pytest.mark.parametrize("num_samples", [2, 3])
def test_sparse_jsd_loss_with_the_tail_bucket_carries_the_estimate_at_proposal_temperature_1(num_samples):
    """The mapping onto the existing loss: candidates = the distinct draws, teacher log-probs = log(c/S) (they sum
    to 1), ``add_tail_bucket=True``. Its gradient is the estimator's up to the teacher tail's clamp (1 − e^−1e−7 ≈
    1e−7 of mass), so its expectation is the dense gradient to ~1e−7. Renormalising over the draws instead
    (``add_tail_bucket=False``) is biased: the student's mass outside the draws gets no gradient."""
    hidden, weight, bias, teacher = problem(seed=10 + num_samples)
    kl, _ = dense_forward_kl(hidden, weight, bias, teacher, **STUDENT)
    dense_grads = torch.autograd.grad(kl, (hidden, weight, bias))

    def mapped(tail):
        def loss(c):
            return sparse_jsd_loss(hidden, weight, c.ids, c.log_weights, c.ids >= 0, bias=bias, beta=0.0,
                                   add_tail_bucket=tail, backend="torch", **STUDENT).loss
        return loss

    _, with_tail = expectation(hidden, weight, bias, teacher, num_samples, 1.0, mapped(True))
    assert_grads_close(with_tail, dense_grads, atol=1e-6)
    _, renormalised = expectation(hidden, weight, bias, teacher, num_samples, 1.0, mapped(False))
    gap = max(float((g - d).abs().max()) for g, d in zip(renormalised, dense_grads, strict=True))
    assert gap > 1e-2


def test_top_k_candidates_with_tail_give_a_biased_gradient():
    """The motivation: the teacher's top-2 + tail bucket (what online training and a top-K cache use) has a
    gradient that differs from the dense forward-KL gradient — the tail is one bucket, so how the student spreads
    mass inside it is never corrected — while the sampled estimator's expectation on the same example is exact."""
    hidden, weight, bias, teacher = problem(seed=3, V=6)
    kl, _ = dense_forward_kl(hidden, weight, bias, teacher, **STUDENT)
    dense_grads = torch.autograd.grad(kl, (hidden, weight, bias))
    top = torch.topk(teacher, 2, dim=1)
    out = sparse_jsd_loss(hidden, weight, top.indices, top.values, torch.ones(1, 2, dtype=torch.bool), bias=bias,
                          add_tail_bucket=True, backend="reference", **STUDENT)
    top_k_grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    relative = [float((g - d).norm() / d.norm()) for g, d in zip(top_k_grads, dense_grads, strict=True)]
    assert min(relative) > 0.05, relative

    def sampled(c):
        return sampled_kd_loss(hidden, weight, c.ids, c.log_weights, bias=bias, **STUDENT).loss

    _, expected = expectation(hidden, weight, bias, teacher, 2, 1.0, sampled)
    assert_grads_close(expected, dense_grads, atol=1e-12)


def test_duplicate_draws_merge_into_counts():
    teacher = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 1.0]], dtype=torch.float64), -1)
    draws = torch.tensor([[3, 1, 3, 3], [0, 0, 0, 0]])
    c = candidates_from_draws(draws, teacher)
    assert c.ids.tolist() == [[1, 3, -1, -1], [0, -1, -1, -1]]
    assert c.counts.tolist() == [[1, 3, 0, 0], [4, 0, 0, 0]]
    torch.testing.assert_close(c.log_weights.exp(), torch.tensor([[0.25, 0.75, 0, 0], [1.0, 0, 0, 0]],
                                                                 dtype=torch.float64), rtol=0, atol=1e-15)
    assert c.teacher_logprobs[0, :2].tolist() == teacher[0, [1, 3]].tolist()
    assert c.teacher_logprobs[1, 1:].tolist() == [float("-inf")] * 3

    # the estimate is linear in the weights: raw draws, each with weight 1/S, give the merged estimate
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    merged = sampled_kd_loss(hidden, weight, c.ids, c.log_weights, teacher_logprobs=c.teacher_logprobs)
    raw = sampled_kd_loss(hidden, weight, draws, torch.full((2, 4), -math.log(4), dtype=torch.float64),
                          teacher_logprobs=teacher.gather(1, draws))
    torch.testing.assert_close(raw.estimate, merged.estimate, rtol=1e-14, atol=1e-14)
    assert int(merged.num_tokens) == 2


def test_weights_at_a_proposal_temperature():
    """At t ≠ 1 the weight is c/S · π_T/r with r = softmax(log π_T / t); the teacher log-probs are normalised."""
    logits = torch.tensor([[2.0, 0.0, -1.0]], dtype=torch.float64)
    c = candidates_from_draws(torch.tensor([[2, 0, 2]]), logits, proposal_temperature=2.0)
    teacher = torch.log_softmax(logits, -1)[0]
    proposal = torch.log_softmax(teacher / 2.0, -1)
    want = [math.log(1 / 3) + float(teacher[0] - proposal[0]), math.log(2 / 3) + float(teacher[2] - proposal[2])]
    assert c.log_weights[0, :2].tolist() == pytest.approx(want, rel=0, abs=1e-14)
    assert c.teacher_logprobs[0, :2].tolist() == pytest.approx([float(teacher[0]), float(teacher[2])], abs=1e-14)


def test_sample_teacher_candidates_rows_are_merged_and_reproducible():
    gen = torch.Generator().manual_seed(5)
    teacher = torch.log_softmax(torch.randn(6, 20, generator=gen), -1)
    teacher[:, 7] = float("-inf")
    first = sample_teacher_candidates(teacher, 8, generator=torch.Generator().manual_seed(1))
    again = sample_teacher_candidates(teacher, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first.ids, again.ids) and torch.equal(first.counts, again.counts)
    assert first.ids.shape == (6, 8) and first.ids.dtype == torch.int64
    assert first.counts.sum(dim=1).tolist() == [8] * 6
    assert not bool((first.ids == 7).any())
    for ids, counts in zip(first.ids.tolist(), first.counts.tolist(), strict=True):
        used = [i for i, c in zip(ids, counts, strict=True) if c > 0]
        assert used == sorted(set(used)) and ids[len(used):] == [-1] * (8 - len(used))
    used = first.counts > 0
    torch.testing.assert_close(first.log_weights[used].double(), (first.counts[used] / 8).double().log())
    assert first.log_weights.dtype == torch.float32

    half = sample_teacher_candidates(teacher.bfloat16(), 12, generator=torch.Generator().manual_seed(1))
    assert half.log_weights.dtype == torch.float32  # log(c/12) is not rounded to bfloat16's 8 bits
    used = half.counts > 0
    torch.testing.assert_close(half.log_weights[used], (half.counts[used] / 12).float().log(), rtol=0, atol=1e-6)


def test_float32_estimate_matches_float64():
    """The float32 path (checkpointed chunks of 3 rows) agrees with the float64 one to float32 precision."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(1000, 16, generator=gen, dtype=torch.float64) / 4
    cand = sample_teacher_candidates(torch.randn(8, 1000, generator=gen, dtype=torch.float64) * 3, 12, generator=gen)
    results = []
    for dtype in (torch.float64, torch.float32):
        h, w = hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
        out = sampled_kd_loss(h, w, cand.ids, cand.log_weights.to(dtype), teacher_logprobs=cand.teacher_logprobs,
                              chunk_rows=3, **STUDENT)
        results.append((out.estimate, *torch.autograd.grad(out.loss, (h, w))))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_monte_carlo_at_a_50_token_vocabulary():
    """4000 independent single-position estimates (S = 4, t = 1.5): their mean gradient is within 5 standard
    errors of the dense gradient in every coordinate (a fixed generator, so the outcome is deterministic)."""
    N, V, D = 4000, 50, 4
    gen = torch.Generator().manual_seed(11)
    h = torch.randn(1, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64)
    teacher = torch.log_softmax(1.5 * torch.randn(1, V, generator=gen, dtype=torch.float64), -1)
    cand = sample_teacher_candidates(teacher.expand(N, V), 4, generator=gen, proposal_temperature=1.5)
    hidden = h.expand(N, D).clone().requires_grad_(True)
    out = sampled_kd_loss(hidden, weight, cand.ids, cand.log_weights, teacher_logprobs=cand.teacher_logprobs)
    per_row = torch.autograd.grad(out.loss, hidden)[0]
    h_leaf = h.clone().requires_grad_(True)
    logp = torch.log_softmax(h_leaf @ weight.t(), -1)
    dense = torch.autograd.grad((teacher.exp() * (teacher - logp)).sum(), h_leaf)[0][0]
    mean, se = per_row.mean(0), per_row.std(0) / math.sqrt(N)
    assert bool(((mean - dense).abs() <= 5 * se).all()), (mean, dense, se)
    kl = float((teacher.exp() * (teacher - logp)).sum().detach())
    assert float(out.estimate.mean()) == pytest.approx(kl, abs=5 * float(out.estimate.std()) / math.sqrt(N))


def test_chunks_and_empty_rows():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 3, generator=gen, requires_grad=True)
    weight = torch.randn(7, 3, generator=gen, requires_grad=True)
    cand = sample_teacher_candidates(torch.randn(5, 7, generator=gen), 3, generator=gen)
    cand.ids[2] = -1  # an unscored position
    outs = [sampled_kd_loss(hidden, weight, cand.ids, cand.log_weights, chunk_rows=rows) for rows in (2, 256)]
    grads = [torch.autograd.grad(o.loss, (hidden, weight)) for o in outs]
    torch.testing.assert_close(outs[0].loss, outs[1].loss)
    assert_grads_close(grads[0], grads[1], atol=1e-6)
    assert int(outs[0].num_tokens) == 4 and float(outs[0].estimate[2]) == 0.0
    assert float(grads[0][0][2].abs().max()) == 0.0

    bias = torch.zeros(7, requires_grad=True)
    empty = sampled_kd_loss(hidden, weight, torch.full((5, 2), -1), torch.zeros(5, 2), bias=bias)
    assert float(empty.loss.detach()) == 0.0 and int(empty.num_tokens) == 0
    assert all(float(g.abs().max()) == 0.0 for g in torch.autograd.grad(empty.loss, (hidden, weight, bias)))


def test_argument_errors():
    teacher = torch.log_softmax(torch.randn(2, 4), -1)
    with pytest.raises(ValueError, match=r"teacher_logprobs must be a 2-D \(N, V\) tensor"):
        sample_teacher_candidates(teacher[0], 2)
    with pytest.raises(ValueError, match="teacher_logprobs must be a floating-point tensor"):
        sample_teacher_candidates(torch.zeros(2, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="at least one vocabulary column"):
        sample_teacher_candidates(torch.zeros(2, 0), 2)
    with pytest.raises(ValueError, match="must not contain NaN or"):
        sample_teacher_candidates(torch.tensor([[0.0, float("nan")]]), 2)
    with pytest.raises(ValueError, match="a row is all -inf"):
        sample_teacher_candidates(torch.tensor([[0.0, 0.0], [float("-inf")] * 2]), 2)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_samples must be an int >= 1"):
            sample_teacher_candidates(teacher, bad)
    for bad in (0.0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="proposal_temperature must be a finite number > 0"):
            sample_teacher_candidates(teacher, 2, proposal_temperature=bad)
    with pytest.raises(ValueError, match="generator must be a torch.Generator or None"):
        sample_teacher_candidates(teacher, 2, generator=1)

    with pytest.raises(ValueError, match=r"draws must be 2-D \(N, S\) with N = 2 and S >= 1"):
        candidates_from_draws(torch.zeros(3, 2, dtype=torch.long), teacher)
    with pytest.raises(ValueError, match="draws must be an integer tensor"):
        candidates_from_draws(torch.zeros(2, 2), teacher)
    with pytest.raises(ValueError, match=r"draws must lie in \[0, V\) = \[0, 4\)"):
        candidates_from_draws(torch.tensor([[0, 4], [0, 0]]), teacher)
    with pytest.raises(ValueError, match="a token to which the teacher gives no mass"):
        candidates_from_draws(torch.tensor([[1], [0]]), torch.tensor([[0.0, float("-inf")], [0.0, 0.0]]))

    hidden, weight = torch.randn(2, 3), torch.randn(4, 3)
    ids, lw = torch.tensor([[0, 1], [2, -1]]), torch.log(torch.tensor([[0.5, 0.5], [1.0, 0.0]]))

    def call(**kw):
        args = dict(hidden=hidden, weight=weight, ids=ids, log_weights=lw)
        args.update(kw)
        return sampled_kd_loss(**args)

    for beta in (0.5, 1.0, 1e-9):
        with pytest.raises(ValueError, match=r"estimate only beta=0 \(forward KL\).*not linear in the teacher"):
            call(beta=beta)
    cases = [
        (dict(hidden=torch.randn(2, 2)), r"hidden must be \(N, D\) and weight \(V, D\) with the same D"),
        (dict(hidden=torch.zeros(2, 3, dtype=torch.long)), "hidden and weight must be floating-point tensors"),
        (dict(bias=torch.zeros(3)), r"bias must have shape \(4,\)"),
        (dict(ids=torch.zeros(3, 2, dtype=torch.long)), r"ids must be 2-D \(N, S\) with N = 2 and S >= 1"),
        (dict(ids=torch.zeros(2, 2)), "ids must be an integer tensor"),
        (dict(ids=torch.tensor([[0, 4], [0, 0]])), r"ids must lie in \[-1, V\) = \[-1, 4\)"),
        (dict(log_weights=torch.zeros(2, 3)), r"log_weights must have the shape of ids \(2, 2\)"),
        (dict(log_weights=torch.zeros(2, 2, dtype=torch.long)), "log_weights must be a floating-point tensor"),
        (dict(teacher_logprobs=torch.zeros(2)), r"teacher_logprobs must have the shape of ids \(2, 2\)"),
        (dict(log_weights=torch.tensor([[0.0, float("nan")], [0.0, 0.0]])), "log_weights must be finite or -inf"),
        (dict(teacher_logprobs=torch.tensor([[0.0, float("-inf")], [0.0, 0.0]])),
         "teacher_logprobs must be finite on every slot with a weight"),
        (dict(temperature=0.0), "temperature must be a finite number > 0"),
        (dict(logit_scale=float("nan")), "logit_scale must be a finite number > 0"),
        (dict(softcap=-1.0), "softcap must be None or a finite number > 0"),
        (dict(chunk_rows=0), "chunk_rows must be an int >= 1"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**kw)
