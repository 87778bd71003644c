"""The freshness weight of stale samples (``freshness_weight: true``, docs/train.md "Staleness").

A sample's rollout drift is the mean, over its sampled tokens, of |log π_θ(y_t) − log μ(y_t)|: the current student's
log-probability of each token against the behaviour log-probability the student server recorded when it sampled it
(nats per token; 0 when the weights have not moved). The sample's freshness weight is ``exp(−drift / scale)`` in
(0, 1], with the default ``scale = 1`` the geometric mean over its tokens of min(ρ_t, 1/ρ_t), ρ_t = π_θ(y_t)/μ(y_t).
It is a constant (no gradient) on every token of the sample.
"""

from __future__ import annotations

import math

import torch

__all__ = ["freshness_weights"]


def freshness_weights(current_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, token_sample: torch.Tensor,
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position freshness weights and per-sample drifts.

    ``current_logprobs`` (log π_θ(y_t)), ``behaviour_logprobs`` (log μ(y_t)) and ``token_sample`` (the sample of each
    position, any ids) are ``(N,)``. A position where either log-prob is not finite is left out of its sample's mean;
    a sample with none left has drift 0. Returns ``(weights (N,), drift (N,))``: each position's sample's weight
    ``exp(−drift / scale)`` and drift, float32 (float64 for float64 inputs), detached. ValueError for a ``scale``
    that is not a finite number > 0 or shapes that disagree."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if not (current_logprobs.shape == behaviour_logprobs.shape == token_sample.shape) or current_logprobs.dim() != 1:
        raise ValueError(f"current_logprobs {tuple(current_logprobs.shape)}, behaviour_logprobs "
                         f"{tuple(behaviour_logprobs.shape)} and token_sample {tuple(token_sample.shape)} must be one "
                         "(N,) shape")
    dtype = torch.float64 if torch.float64 in (current_logprobs.dtype, behaviour_logprobs.dtype) else torch.float32
    current, behaviour = current_logprobs.detach().to(dtype), behaviour_logprobs.detach().to(dtype)
    if current.numel() == 0:
        return current.new_zeros(0), current.new_zeros(0)
    _, sample = torch.unique(token_sample, return_inverse=True)
    finite = torch.isfinite(current) & torch.isfinite(behaviour)
    gap = torch.where(finite, (current - behaviour).abs(), torch.zeros_like(current))
    count = int(sample.max()) + 1
    sums = gap.new_zeros(count).index_add_(0, sample, gap)
    counts = gap.new_zeros(count).index_add_(0, sample, finite.to(dtype))
    drift = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return torch.exp(-drift / scale)[sample], drift[sample]
