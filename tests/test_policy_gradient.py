"""``reverse_kl_pg_loss``: its expectation is the reverse-KL gradient; importance ratio, clipping, chunking, errors."""

from __future__ import annotations

import math

import pytest
import torch

from fastdistill.loss import importance_ratios, reverse_kl_pg_loss, sampled_token_logprobs

EPS64 = torch.finfo(torch.float64).eps


def grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


EPS32 = torch.finfo(torch.float32).eps


def oracle_logprobs(hidden, weight, scale, softcap, temperature):
    """(N, V) float64 log π_θ, written out independently of the code under test."""
    z = hidden.double() @ weight.double().t() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.log_softmax(z / temperature, dim=1)


@pytest.mark.parametrize("softcap,scale,temperature", [(None, 1.0, 1.0), (3.0, 1.5, 0.7), (0.8, 0.25, 1.3)])
def test_expectation_over_sampled_tokens_is_the_reverse_kl_gradient(softcap, scale, temperature):
    """Σ_y π_θ(y) ∇L(y) (exact enumeration over a 7-token vocabulary, ratio 1, no clip) = ∇ KL(π_θ ‖ π_T), the
    KL's gradient from an independent float64 formula of the logits (scale, softcap, temperature)."""
    torch.manual_seed(0)
    V, D = 7, 5
    hidden = torch.randn(1, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(V, dtype=torch.float64) * 2, dim=0)
    kw = dict(logit_scale=scale, softcap=softcap, temperature=temperature)

    logp = oracle_logprobs(hidden, weight, scale, softcap, temperature)[0]
    probs = logp.detach().exp()
    kl = (logp.exp() * (logp - teacher)).sum()
    expected = grads(kl, (hidden, weight))
    # the helper's log-probs are the oracle's
    every = torch.arange(V)
    torch.testing.assert_close(sampled_token_logprobs(hidden.expand(V, D), weight, every, **kw).detach(),
                               logp.detach(), rtol=0, atol=16 * EPS64)

    estimate = [torch.zeros_like(hidden), torch.zeros_like(weight)]
    for y in range(V):
        out = reverse_kl_pg_loss(hidden, weight, torch.tensor([y]), teacher[y : y + 1], **kw)
        for acc, g in zip(estimate, grads(out.loss, (hidden, weight)), strict=True):
            acc += probs[y] * g
    for got, want in zip(estimate, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_fresh_sample_ratio_is_one_at_the_sampling_temperature():
    """The one convention: π_θ at the sampling temperature τ over μ, so that a sample scored by the weights that
    generated it (μ = π_θ at τ, what a processed_logprobs server reports) has ratio 1 — even when the loss is at
    another temperature."""
    torch.manual_seed(4)
    N, V, D, tau = 6, 13, 5, 0.6
    hidden, weight = torch.randn(N, D), torch.randn(V, D)
    actual = torch.randint(0, V, (N,))
    served = oracle_logprobs(hidden, weight, 1.3, 2.0, tau).gather(1, actual[:, None]).squeeze(1).float()
    bound = 4 * EPS32 * max(1.0, float(served.abs().max()))  # μ rounded to float32, π_θ computed in float32
    ratio = importance_ratios(hidden, weight, actual, served, logit_scale=1.3, softcap=2.0, sampling_temperature=tau)
    assert float((ratio - 1).abs().max()) <= bound
    out = reverse_kl_pg_loss(hidden, weight, actual, -torch.rand(N), logit_scale=1.3, softcap=2.0, temperature=1.0,
                             sampling_temperature=tau, rollout_logprobs=served)
    assert abs(float(out.ratio_sum) - N) <= N * bound and float(out.ratio_max) <= 1 + bound
    # at T = 1 the same sample would look off-policy by whole factors
    at_one = importance_ratios(hidden, weight, actual, served, logit_scale=1.3, softcap=2.0)
    assert float((at_one - 1).abs().max()) > 0.1


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
        ({"sampling_temperature": 0.0}, "sampling_temperature must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature must be a finite number > 0"),
    ],
)
def test_errors(kwargs, message):
    args = {"hidden": torch.randn(2, 4), "weight": torch.randn(9, 4), "actual_ids": torch.tensor([1, 2]),
            "teacher_logprobs": torch.tensor([-1.0, -2.0])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        reverse_kl_pg_loss(args.pop("hidden"), args.pop("weight"), args.pop("actual_ids"),
                           args.pop("teacher_logprobs"), **args)


def _granite_student():
    """A tiny float64 Granite causal LM (logits divided by logits_scaling = 8) with a head of a few nats."""
    from transformers import AutoModelForCausalLM
    from transformers.models.granite import GraniteConfig

    config = GraniteConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, logits_scaling=8.0, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 2.0)
    return model


def _fresh_samples(model, tau: float, count: int = 3):
    """Samples whose rollout log-probs are what a server running ``model`` at temperature ``tau`` reports
    (processed log-probs: ``log_softmax(model(...).logits / tau)``), with random top-K teacher candidates."""
    import numpy as np

    from fastdistill.rollout import RolloutSample

    rng = np.random.default_rng(6)
    samples = []
    for index in range(count):
        prompt, completion = rng.integers(3, 64, 4), rng.integers(3, 64, 5)
        ids = np.concatenate([prompt, completion])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids[None])).logits[0, len(prompt) - 1 : -1]
        served = torch.log_softmax(logits / tau, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        top = np.stack([rng.permutation(np.arange(3, 64))[:3] for _ in completion])
        candidates = np.concatenate([top, completion[:, None]], axis=1).astype(np.int32)
        samples.append(RolloutSample(
            input_ids=ids.astype(np.int32), completion_mask=np.r_[np.zeros(4), np.ones(5)].astype(np.int32),
            teacher_topk_ids=candidates, teacher_topk_logprobs=np.full(candidates.shape, -3.0, dtype=np.float32),
            rollout_logprobs=served.numpy().astype(np.float32), model_version=0, teacher_id="default",
            prompt_id=index, dataset_index=index))
    return samples


@pytest.mark.parametrize("loss_type", ["jsd", "reverse_kl_pg"])
def test_distillation_model_gives_a_fresh_sample_ratio_one(loss_type):
    """Both importance-ratio paths of the trainer's model (stale-sample weights, ``pg_importance_ratio``) use the
    one convention and the student's real logit head: a fresh sample at sampling temperature 0.6 has ratio 1."""
    from fastdistill.data.packing import pack_row
    from fastdistill.loss import narrow_support
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.model import DistillationModel

    tau = 0.6
    model = _granite_student()
    config = AsyncDistillationConfig(model_name_or_path="student", temperature=tau, loss_type=loss_type,
                                     pg_importance_ratio=loss_type == "reverse_kl_pg",
                                     stale_policy="importance", importance_ratio_clip=10.0)
    wrapped = DistillationModel(model, config)
    row = pack_row(_fresh_samples(model, tau), ["default"], vocab_size=64)
    ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, config.beta)
    stale = torch.ones(row.num_trained, dtype=torch.bool) if loss_type == "jsd" else None
    _, metrics = wrapped(row, ids, lps, mask, stale=stale)
    key = "sample/importance_ratio" if loss_type == "jsd" else "pg/ratio"
    bound = 4 * EPS32 * max(1.0, float(row.rollout_logprobs.abs().max()))
    assert abs(metrics[f"{key}_mean"] - 1.0) <= bound and metrics[f"{key}_max"] <= 1.0 + bound, metrics
