"""``reverse_kl_pg``: the AsyncOPD reverse-KL policy-gradient estimator with a learner-time advantage.

For a sampled token y at a state with student hidden state h:

    A = log π_T(y) − sg[log π_θ(y)]                  (recomputed with the CURRENT student, at learner time)
    L = − sg[w] · A · log π_θ(y),    w = min(π_θ(y) / μ(y), clip) or 1

E_{y ~ π_θ}[∇L] (w = 1) = Σ_y π_θ(y)(log π_θ(y) − log π_T(y)) ∇log π_θ(y) = ∇ KL(π_θ ‖ π_T): the gradient of the
reverse KL at the visited state, using only the teacher's log-prob of the sampled token. Recomputing the advantage
with the learner's weights (instead of the stale rollout's) is what makes it robust to asynchrony (the AsyncOPD
paper's estimator). ``w`` optionally corrects for the rollout policy μ ≠ π_θ.

The full-vocabulary log-sum-exp is taken in bounded row chunks under activation checkpointing, so at most one
``(chunk, V)`` logits tile is alive, in forward and in backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_ROWS = 256


@dataclass
class PolicyGradientOutput:
    """Result of :func:`reverse_kl_pg_loss`.

    Attributes:
        loss: 0-dim, differentiable: Σ over positions of −w·A·log π_θ(y). Divide by the window's token count.
        reverse_kl_sum: 0-dim, Σ (log π_θ(y) − log π_T(y)), a per-sample estimate of KL(π_θ‖π_T), detached.
        advantage_sum, advantage_sq_sum: 0-dim, Σ A and Σ A² (for mean and std), detached.
        ratio_sum, ratio_max, clipped: 0-dim, Σ π_θ/μ, its max and the number of clipped ratios (zeros
            without rollout log-probs).
        num_tokens: 0-dim int64, number of positions.
        reverse_kl: ``(N,)`` per-position log π_θ(y) − log π_T(y), detached.
    """

    loss: torch.Tensor
    reverse_kl_sum: torch.Tensor
    advantage_sum: torch.Tensor
    advantage_sq_sum: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_max: torch.Tensor
    clipped: torch.Tensor
    num_tokens: torch.Tensor
    reverse_kl: torch.Tensor


def _token_logprobs(hidden, weight, bias, actual_ids, logit_scale, softcap, temperature):
    logits = torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    return logits.gather(1, actual_ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)


def sampled_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, actual_ids: torch.Tensor, *,
                           bias: torch.Tensor | None = None, logit_scale: float = 1.0, softcap: float | None = None,
                           temperature: float = 1.0, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """log π_θ(y) of ``actual_ids`` (N,) over the full vocabulary, float32 (N,), differentiable, with at most one
    ``(chunk_rows, V)`` logits tile alive (checkpointed per chunk)."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (hidden[rows], weight, bias, actual_ids[rows], logit_scale, softcap, temperature)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_token_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_token_logprobs(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def reverse_kl_pg_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    actual_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    rollout_logprobs: torch.Tensor | None = None,
    ratio_clip: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyGradientOutput:
    """Reverse-KL policy-gradient surrogate summed over ``N`` sampled tokens.

    Args:
        hidden: ``(N, D)`` student hidden states of the positions; weight ``(V, D)``; bias ``(V,)`` or None.
        actual_ids: ``(N,)`` the sampled tokens y.
        teacher_logprobs: ``(N,)`` log π_T(y) (nats), finite.
        rollout_logprobs: ``(N,)`` log μ(y) of the rollout policy, or None (no importance ratio).
        ratio_clip: upper clip of the importance ratio (None: unclipped); needs ``rollout_logprobs``.
        token_weights: ``(N,)`` extra constant weights, or None.
    """
    n = hidden.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, D) and weight (V, D) with the same D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    for name, x in (("actual_ids", actual_ids), ("teacher_logprobs", teacher_logprobs),
                    ("rollout_logprobs", rollout_logprobs), ("token_weights", token_weights)):
        if x is not None and x.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(x.shape)}")
    if n and (int(actual_ids.min()) < 0 or int(actual_ids.max()) >= weight.shape[0]):
        raise ValueError(f"actual_ids must lie in [0, V) = [0, {weight.shape[0]})")
    if n and not bool(torch.isfinite(teacher_logprobs).all()):
        raise ValueError("teacher_logprobs must be finite (the teacher's log-prob of every sampled token)")
    if ratio_clip is not None and (rollout_logprobs is None or not math.isfinite(ratio_clip) or ratio_clip <= 0):
        raise ValueError("ratio_clip needs rollout_logprobs and must be a finite number > 0")
    logprob = sampled_token_logprobs(hidden, weight, actual_ids.long(), bias=bias, logit_scale=logit_scale,
                                     softcap=softcap, temperature=temperature)
    with torch.no_grad():
        advantage = teacher_logprobs.float() - logprob
        coefficient = advantage.clone()
        ratio = torch.zeros(0, device=hidden.device)
        clipped = torch.zeros((), device=hidden.device)
        if rollout_logprobs is not None:
            ratio = torch.exp(logprob - rollout_logprobs.float())
            capped = ratio if ratio_clip is None else ratio.clamp(max=ratio_clip)
            clipped = (capped < ratio).sum()
            coefficient = coefficient * capped
        if token_weights is not None:
            coefficient = coefficient * token_weights.float()
    loss = -(coefficient * logprob).sum()
    if n == 0:  # keep the graph connected so that backward (and FSDP's gradient sync) still runs
        loss = loss + 0.0 * (hidden.sum() + weight.sum())
    return PolicyGradientOutput(
        loss=loss,
        reverse_kl_sum=(-advantage).sum(),
        advantage_sum=advantage.sum(),
        advantage_sq_sum=(advantage**2).sum(),
        ratio_sum=ratio.sum(),
        ratio_max=ratio.max() if ratio.numel() else torch.zeros((), device=hidden.device),
        clipped=clipped.float(),
        num_tokens=torch.tensor(n, dtype=torch.int64, device=hidden.device),
        reverse_kl=-advantage,
    )
