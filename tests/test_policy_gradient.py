"""``reverse_kl_pg_loss``: its expectation is the reverse-KL gradient; importance ratio, clipping, chunking, errors."""

from __future__ import annotations

import math

import pytest
import torch

from fastdistill.loss import reverse_kl_pg_loss, sampled_token_logprobs


def grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("softcap,scale,temperature", [(None, 1.0, 1.0), (3.0, 1.5, 0.7)])
def test_expectation_over_sampled_tokens_is_the_reverse_kl_gradient(softcap, scale, temperature):
    """Σ_y π_θ(y) ∇L(y) (exact enumeration over a 7-token vocabulary, ratio 1, no clip) = ∇ KL(π_θ ‖ π_T)."""
    torch.manual_seed(0)
    V, D = 7, 5
    hidden = torch.randn(1, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(V) * 2, dim=0)
    kw = dict(logit_scale=scale, softcap=softcap, temperature=temperature)

    every = torch.arange(V)
    logp = sampled_token_logprobs(hidden.expand(V, D), weight, every, **kw)  # log π_θ(y) for every y
    probs = logp.detach().exp()
    kl = (logp.exp() * (logp - teacher)).sum()
    expected = grads(kl, (hidden, weight))

    estimate = [torch.zeros_like(hidden), torch.zeros_like(weight)]
    for y in range(V):
        out = reverse_kl_pg_loss(hidden, weight, torch.tensor([y]), teacher[y : y + 1], **kw)
        for acc, g in zip(estimate, grads(out.loss, (hidden, weight)), strict=True):
            acc += probs[y] * g
    for got, want in zip(estimate, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_importance_ratio_and_clip_scale_the_gradient():
    torch.manual_seed(1)
    N, V, D = 5, 11, 4
    hidden = torch.randn(N, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    actual = torch.randint(0, V, (N,))
    teacher = -torch.rand(N) * 3
    own = sampled_token_logprobs(hidden, weight, actual).detach()
    plain = reverse_kl_pg_loss(hidden, weight, actual, teacher)
    doubled = reverse_kl_pg_loss(hidden, weight, actual, teacher, rollout_logprobs=own - math.log(2.0))
    clipped = reverse_kl_pg_loss(hidden, weight, actual, teacher, rollout_logprobs=own - math.log(2.0),
                                 ratio_clip=1.5)
    g_plain, g_doubled, g_clipped = (grads(o.loss, (hidden,))[0] for o in (plain, doubled, clipped))
    torch.testing.assert_close(g_doubled, 2.0 * g_plain, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_clipped, 1.5 * g_plain, rtol=1e-5, atol=1e-7)
    assert float(doubled.ratio_sum) == pytest.approx(2.0 * N, rel=1e-5)
    assert float(clipped.clipped) == N and float(doubled.clipped) == 0
    # the metrics: A = log π_T − log π_θ, and the reverse-KL estimate is −Σ A
    advantage = teacher - own
    assert float(plain.advantage_sum) == pytest.approx(float(advantage.sum()), rel=1e-5)
    assert float(plain.reverse_kl_sum) == pytest.approx(float(-advantage.sum()), rel=1e-5)
    assert float(plain.advantage_sq_sum) == pytest.approx(float((advantage**2).sum()), rel=1e-5)


def test_chunked_logprobs_equal_one_tile_values_and_gradients():
    torch.manual_seed(2)
    hidden = torch.randn(10, 6, requires_grad=True)
    weight = torch.randn(30, 6, requires_grad=True)
    actual = torch.randint(0, 30, (10,))
    small = sampled_token_logprobs(hidden, weight, actual, chunk_rows=3)
    whole = torch.log_softmax(hidden @ weight.t(), dim=1).gather(1, actual[:, None]).squeeze(1)
    torch.testing.assert_close(small, whole)
    for a, b in zip(grads(small.sum(), (hidden, weight)), grads(whole.sum(), (hidden, weight)), strict=True):
        torch.testing.assert_close(a, b)


def test_no_tokens_gives_a_zero_loss_connected_to_the_graph():
    hidden = torch.randn(0, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    out = reverse_kl_pg_loss(hidden, weight, torch.zeros(0, dtype=torch.long), torch.zeros(0))
    out.loss.backward()
    assert float(out.loss) == 0.0 and weight.grad is not None and int(out.num_tokens) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"actual_ids": torch.tensor([0, 9])}, r"actual_ids must lie in \[0, V\)"),
        ({"actual_ids": torch.tensor([0])}, r"actual_ids must have shape \(2,\)"),
        ({"teacher_logprobs": torch.tensor([-1.0, -math.inf])}, "teacher_logprobs must be finite"),
        ({"rollout_logprobs": torch.zeros(3)}, r"rollout_logprobs must have shape \(2,\)"),
        ({"ratio_clip": 2.0}, "ratio_clip needs rollout_logprobs"),
        ({"hidden": torch.randn(2, 3)}, "hidden must be"),
    ],
)
def test_errors(kwargs, message):
    args = {"hidden": torch.randn(2, 4), "weight": torch.randn(9, 4), "actual_ids": torch.tensor([1, 2]),
            "teacher_logprobs": torch.tensor([-1.0, -2.0])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        reverse_kl_pg_loss(args.pop("hidden"), args.pop("weight"), args.pop("actual_ids"),
                           args.pop("teacher_logprobs"), **args)
