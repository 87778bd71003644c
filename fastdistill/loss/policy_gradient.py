"""``reverse_kl_pg``: the AsyncOPD reverse-KL policy-gradient estimator with a learner-time advantage.

For a sampled token y at a state with student hidden state h:

    A = log π_T(y) − sg[log π_θ(y)]                  (recomputed with the CURRENT student, at learner time)
    L = − sg[w] · A · log π_θ(y),    w = min(π_θ(y) / μ(y), clip) or 1

E_{y ~ π_θ}[∇L] (w = 1) = Σ_y π_θ(y)(log π_θ(y) − log π_T(y)) ∇log π_θ(y) = ∇ KL(π_θ ‖ π_T): the gradient of the
reverse KL at the visited state, using only the teacher's log-prob of the sampled token. Recomputing the advantage
with the learner's weights (instead of the stale rollout's) is what makes it robust to asynchrony (the AsyncOPD
paper's estimator). ``w`` optionally corrects for the rollout policy μ ≠ π_θ.

Importance ratios (here and for stale samples, :func:`importance_ratios`) follow one convention: π_θ is evaluated
at the **sampling temperature** τ, the distribution the student server sampled y from (with ``--logprobs-mode
processed_logprobs`` its reported log-prob μ(y) is that distribution's), so the ratio corrects only for the weights
having moved since the rollout, and a fresh sample's ratio is 1. The advantage and the loss use π_θ at the loss
``temperature`` (the teacher's, 1 for served teachers); with τ ≠ 1 the estimator is the reverse-KL gradient at the
states and tokens of the tempered sampling policy, as it is without the ratio. Top-k / top-p truncation of the
sampler is not modelled.

The full-vocabulary log-sum-exp is taken in bounded row chunks under activation checkpointing, so at most one
``(chunk, V)`` logits tile is alive, in forward and in backward.

Stabilizers (:func:`stabilized_ratios`, shared with the multi-sample estimator of :mod:`.estimators`) replace the
plain ratio by PPO-clip, decoupled PPO or M2PO; under top-k sampling the clip and the mask judge the policy's move by
:func:`sampler_log_ratio` (the current weights' truncated sampling distribution over μ, 1 for a fresh sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from fastdistill.logit_head import LogitHead, head_logits

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
        masked: 0-dim, the number of tokens M2PO masked (0 otherwise).
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
    masked: torch.Tensor | None = None


def _token_logprobs(hidden, weight, bias, actual_ids, logit_scale, softcap, temperature):
    logits = head_logits(hidden, weight, bias, LogitHead(float(logit_scale), softcap), temperature=temperature)
    lse = torch.logsumexp(logits, dim=1)
    if actual_ids.dim() == 2:
        return logits.gather(1, actual_ids) - lse[:, None]
    return logits.gather(1, actual_ids[:, None]).squeeze(1) - lse


def checkpointed_row_chunks(function, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            ids: torch.Tensor, *head_args, chunk_rows: int = CHUNK_ROWS) -> list:
    """``function(hidden[rows], weight, bias, ids[rows], *head_args)`` over row chunks of ``chunk_rows``, each under
    activation checkpointing when a gradient is needed (so one chunk's ``(chunk_rows, V)`` logits are alive at a
    time, in forward and in backward); the list of the chunks' results."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (hidden[rows], weight, bias, ids[rows], *head_args)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            parts.append(checkpoint(function, *args, use_reentrant=False))
        else:
            parts.append(function(*args))
    return parts


def sampled_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, actual_ids: torch.Tensor, *,
                           bias: torch.Tensor | None = None, logit_scale: float = 1.0, softcap: float | None = None,
                           temperature: float = 1.0, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """log π_θ(y) of ``actual_ids`` (N,) over the full vocabulary, float32 (N,) (float64 for float64 inputs),
    differentiable, with at most one ``(chunk_rows, V)`` logits tile alive (checkpointed per chunk). Logits as
    :func:`fastdistill.logit_head.head_logits` computes them. ``actual_ids`` may also be ``(N, S)`` (S ids per
    position, one log-sum-exp per row): the result is then ``(N, S)``."""
    parts = checkpointed_row_chunks(_token_logprobs, hidden, weight, bias, actual_ids, logit_scale, softcap,
                                    temperature, chunk_rows=chunk_rows)
    if parts:
        return torch.cat(parts)
    return hidden.new_zeros(tuple(actual_ids.shape), dtype=torch.promote_types(hidden.dtype, torch.float32))


@torch.no_grad()
def importance_ratios(hidden: torch.Tensor, weight: torch.Tensor, actual_ids: torch.Tensor,
                      rollout_logprobs: torch.Tensor, *, bias: torch.Tensor | None = None, logit_scale: float = 1.0,
                      softcap: float | None = None, sampling_temperature: float = 1.0,
                      chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """π_θ(y) / μ(y) per sampled token, (N,) float32, no gradient: the current student's probability of
    ``actual_ids`` (N,) at the sampling temperature (``hidden`` (N, D), ``weight`` (V, D), the head's
    ``logit_scale`` / ``softcap``) over the rollout policy's, ``rollout_logprobs`` (N,) (nats, what the student server
    reported for the sample). A sample scored with the weights it was generated with has ratio 1."""
    logprob = sampled_token_logprobs(hidden, weight, actual_ids.long(), bias=bias, logit_scale=logit_scale,
                                     softcap=softcap, temperature=sampling_temperature, chunk_rows=chunk_rows)
    return torch.exp(logprob.float() - rollout_logprobs.float())


PG_STABILIZERS = ("none", "ppo_clip", "decoupled_ppo", "m2po")


@dataclass
class RatioWeights:
    """What :func:`stabilized_ratios` gives each (position, draw) entry, all detached, one shape.

    Attributes:
        weight: the constant w of the surrogate −w·A·log π_θ (float, the log-ratio's dtype).
        clipped: bool, entries whose gradient a clip removed (PPO's clipped branch) or truncated (``ratio_clip``).
        masked: bool, entries M2PO masked.
    """

    weight: torch.Tensor
    clipped: torch.Tensor
    masked: torch.Tensor


def check_stabilizer(stabilizer: str, clip_eps: float, m2po_budget: float) -> None:
    """ValueError unless ``stabilizer`` is one of :data:`PG_STABILIZERS`, ``clip_eps`` in (0, 1) and ``m2po_budget``
    a finite number > 0."""
    if stabilizer not in PG_STABILIZERS:
        raise ValueError(f"stabilizer must be one of {list(PG_STABILIZERS)}, got {stabilizer!r}")
    if not (isinstance(clip_eps, (int, float)) and 0.0 < clip_eps < 1.0):
        raise ValueError(f"clip_eps must be a number in (0, 1), got {clip_eps!r}")
    if not (isinstance(m2po_budget, (int, float)) and math.isfinite(m2po_budget) and m2po_budget > 0):
        raise ValueError(f"m2po_budget must be a finite number > 0, got {m2po_budget!r}")


def check_sampling_top_k(sampling_top_k: int | None) -> None:
    """ValueError unless ``sampling_top_k`` is None or an int (< 1: no truncation, as the rollout's top_k)."""
    if sampling_top_k is not None and (not isinstance(sampling_top_k, int) or isinstance(sampling_top_k, bool)):
        raise ValueError(f"sampling_top_k must be None or an int (the rollout's top_k), got {sampling_top_k!r}")


@torch.no_grad()
def stabilized_ratios(log_ratio: torch.Tensor, advantage: torch.Tensor, *, stabilizer: str = "none",
                      clip_eps: float = 0.2, m2po_budget: float = 0.01,
                      proximal_log_ratio: torch.Tensor | None = None,
                      ratio_clip: float | None = None, lag_log_ratio: torch.Tensor | None = None) -> RatioWeights:
    """The importance weight w of each entry of the surrogate −w·A·log π_θ, from ``log_ratio`` = log π_θ(a) −
    log μ(a) (π_θ at the sampling temperature, μ the behaviour policy; any shape) and the advantage A (same shape).
    With r = exp(log_ratio):

    - ``"none"``: w = r, or min(r, ``ratio_clip``) (truncated importance sampling).
    - ``"ppo_clip"``: PPO's objective min(r·A, clip(r, 1−ε, 1+ε)·A). Its gradient is A·∇r = r·A·∇log π_θ where the
      unclipped branch is the min and 0 where the clipped one is (A > 0 and r > 1+ε, or A < 0 and r < 1−ε): w = r
      there, 0 (``clipped``) otherwise.
    - ``"decoupled_ppo"``: behaviour μ and a proximal policy π_prox (``proximal_log_ratio`` = log π_prox −
      log μ): (π_prox/μ)·min(r'·A, clip(r', 1−ε, 1+ε)·A) with r' = π_θ/π_prox; w = (π_prox/μ)·r' = r where r' is
      unclipped, 0 (``clipped``) otherwise. None: π_prox is the current π_θ (r' = 1, nothing clipped).
    - ``"m2po"``: w = r, except that the entries with the largest second moment (log r)² get w = 0 (``masked``),
      as few as needed for the mean (log r)² of the kept entries to be ≤ ``m2po_budget``.

    The gradient forms equal the objectives' gradients when the loss's π_θ is the ratio's (loss temperature =
    sampling temperature).

    ``lag_log_ratio`` (same shape, or None: ``log_ratio``): what ``"ppo_clip"`` clips and ``"m2po"`` measures instead
    of log r, the weight staying r. :func:`sampler_log_ratio` gives it under top-k sampling, where a fresh sample's r
    is the student's top-k mass rather than 1 (docs/loss.md, "The ratio under top-k sampling")."""
    ratio = torch.exp(log_ratio)
    none = torch.zeros_like(log_ratio, dtype=torch.bool)
    if stabilizer == "none":
        if ratio_clip is None:
            return RatioWeights(ratio, none, none)
        return RatioWeights(ratio.clamp(max=ratio_clip), ratio > ratio_clip, none)
    if ratio_clip is not None:
        raise ValueError(f"ratio_clip is the plain estimator's truncation; stabilizer={stabilizer!r} clips itself")
    trust = log_ratio if lag_log_ratio is None else lag_log_ratio.to(log_ratio.dtype)
    if stabilizer in ("ppo_clip", "decoupled_ppo"):
        clip_log = trust
        if stabilizer == "decoupled_ppo":  # log π_θ/π_prox; 0 when the current weights are the proximal policy
            clip_log = torch.zeros_like(log_ratio) if proximal_log_ratio is None else (
                log_ratio - proximal_log_ratio.to(log_ratio.dtype))
        clip_ratio = torch.exp(clip_log)
        clipped = ((advantage > 0) & (clip_ratio > 1.0 + clip_eps)) | ((advantage < 0) & (clip_ratio < 1.0 - clip_eps))
        return RatioWeights(torch.where(clipped, torch.zeros_like(ratio), ratio), clipped, none)
    if stabilizer == "m2po":
        masked = m2po_mask(trust, m2po_budget)
        return RatioWeights(torch.where(masked, torch.zeros_like(ratio), ratio), none, masked)
    raise ValueError(f"stabilizer must be one of {list(PG_STABILIZERS)}, got {stabilizer!r}")


@torch.no_grad()
def m2po_mask(log_ratio: torch.Tensor, budget: float) -> torch.Tensor:
    """bool, same shape: the entries M2PO masks. Masking the largest (log r)² first, the kept entries are the k
    smallest, whose mean grows with k; k is the largest count whose mean is ≤ ``budget`` (ties at the boundary are
    broken by the sort)."""
    second = log_ratio.detach().double().flatten() ** 2  # an id outside the current top-k: inf, masked first
    ordered, order = torch.sort(second)
    means = torch.cumsum(ordered, 0) / torch.arange(1, ordered.numel() + 1, dtype=ordered.dtype,
                                                    device=ordered.device)
    keep = int((means <= budget).sum())
    masked = torch.ones_like(second, dtype=torch.bool)
    masked[order[:keep]] = False
    return masked.view(log_ratio.shape)


def sampling_log_ratio(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, behaviour_logprobs: torch.Tensor,
                       logprob: torch.Tensor, *, bias: torch.Tensor | None, logit_scale: float,
                       softcap: float | None, temperature: float, sampling_temperature: float | None) -> torch.Tensor:
    """log π_θ(a) − log μ(a), detached, π_θ at the sampling temperature (the convention of
    :func:`importance_ratios`): ``logprob`` (π_θ at the loss temperature, ids' shape) is reused when the two
    temperatures agree, else the log-probs are recomputed at ``sampling_temperature`` without a graph."""
    with torch.no_grad():
        if sampling_temperature is None or sampling_temperature == temperature:
            current = logprob.detach()
        else:
            current = sampled_token_logprobs(hidden, weight, ids, bias=bias, logit_scale=logit_scale, softcap=softcap,
                                             temperature=sampling_temperature)
        return current - behaviour_logprobs.to(current.dtype)


def _sampler_logprobs(hidden, weight, bias, ids, logit_scale, softcap, temperature, top_k):
    logits = head_logits(hidden, weight, bias, LogitHead(float(logit_scale), softcap), temperature=temperature)
    top = logits.topk(top_k, dim=1).values
    picked = logits.gather(1, ids)
    inside = picked >= top[:, -1:]
    return torch.where(inside, picked - torch.logsumexp(top, dim=1, keepdim=True), float("-inf"))


@torch.no_grad()
def sampler_log_ratio(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                      behaviour_logprobs: torch.Tensor, *, bias: torch.Tensor | None, logit_scale: float,
                      softcap: float | None, sampling_temperature: float, sampling_top_k: int | None,
                      chunk_rows: int = CHUNK_ROWS) -> torch.Tensor | None:
    """log μ_θ(a) − log μ(a) (ids' shape, (N,) or (N, S)), μ_θ the current weights' sampling distribution: π_θ at
    the sampling temperature truncated to its top ``sampling_top_k`` and renormalised, as the server samples
    (−inf at an id outside that top-k). A fresh sample's is 0 (the weights that sampled it). None when nothing is
    truncated (``sampling_top_k`` None, < 1 or ≥ V): then it equals :func:`sampling_log_ratio`."""
    vocab = weight.shape[0]
    if sampling_top_k is None or sampling_top_k < 1 or sampling_top_k >= vocab:
        return None
    two_d = ids.dim() == 2
    ids2 = ids.long() if two_d else ids.long()[:, None]
    parts = [_sampler_logprobs(hidden[start:start + chunk_rows], weight, bias, ids2[start:start + chunk_rows],
                               logit_scale, softcap, sampling_temperature, sampling_top_k)
             for start in range(0, hidden.shape[0], chunk_rows)]
    current = torch.cat(parts) if parts else behaviour_logprobs.new_zeros(tuple(ids2.shape))
    current = current if two_d else current[:, 0]
    return current - behaviour_logprobs.to(current.dtype)


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
    sampling_temperature: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    ratio_clip: float | None = None,
    token_weights: torch.Tensor | None = None,
    stabilizer: str = "none",
    clip_eps: float = 0.2,
    m2po_budget: float = 0.01,
    proximal_logprobs: torch.Tensor | None = None,
    sampling_top_k: int | None = None,
    advantages: torch.Tensor | None = None,
) -> PolicyGradientOutput:
    """Reverse-KL policy-gradient surrogate summed over ``N`` sampled tokens.

    Args:
        hidden: ``(N, D)`` student hidden states of the positions; weight ``(V, D)``; bias ``(V,)`` or None.
        actual_ids: ``(N,)`` the sampled tokens y.
        teacher_logprobs: ``(N,)`` log π_T(y) (nats), finite.
        temperature: divides the student logits of the advantage and the loss.
        sampling_temperature: the temperature y was sampled at (None: ``temperature``); the importance ratio's π_θ
            is taken there (:func:`importance_ratios`), so a fresh sample's ratio is 1.
        rollout_logprobs: ``(N,)`` log μ(y) of the rollout policy, or None (no importance ratio).
        ratio_clip: upper clip of the importance ratio (None: unclipped); needs ``rollout_logprobs``.
        token_weights: ``(N,)`` extra constant weights, or None.
        stabilizer, clip_eps, m2po_budget: ``"none"``, ``"ppo_clip"``, ``"decoupled_ppo"`` or ``"m2po"`` in place of
            the plain ratio (:func:`stabilized_ratios`); all but ``"none"`` need ``rollout_logprobs`` and exclude
            ``ratio_clip``.
        proximal_logprobs: ``(N,)`` log π_prox(y) at the sampling temperature for ``"decoupled_ppo"`` (None: the
            current weights are the proximal policy).
        sampling_top_k: the rollout's top-k (None: none): ``"ppo_clip"`` and ``"m2po"`` then judge the policy's
            move by :func:`sampler_log_ratio` (the weight stays π_θ/μ).
        advantages: ``(N,)`` finite constant advantages A in place of the learner-time log π_T(y) − log π_θ(y)
            (TOP-D's, :func:`~fastdistill.loss.opd_levers.topd_advantages`), or None; ``reverse_kl`` stays
            log π_θ(y) − log π_T(y), the advantage statistics are A's.
    """
    n = hidden.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, D) and weight (V, D) with the same D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    for name, x in (("actual_ids", actual_ids), ("teacher_logprobs", teacher_logprobs),
                    ("rollout_logprobs", rollout_logprobs), ("token_weights", token_weights),
                    ("proximal_logprobs", proximal_logprobs), ("advantages", advantages)):
        if x is not None and x.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(x.shape)}")
    if n and (int(actual_ids.min()) < 0 or int(actual_ids.max()) >= weight.shape[0]):
        raise ValueError(f"actual_ids must lie in [0, V) = [0, {weight.shape[0]})")
    if n and not bool(torch.isfinite(teacher_logprobs).all()):
        raise ValueError("teacher_logprobs must be finite (the teacher's log-prob of every sampled token)")
    for name, value in (("temperature", temperature), ("sampling_temperature", sampling_temperature)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if ratio_clip is not None and (rollout_logprobs is None or not math.isfinite(ratio_clip) or ratio_clip <= 0):
        raise ValueError("ratio_clip needs rollout_logprobs and must be a finite number > 0")
    check_stabilizer(stabilizer, clip_eps, m2po_budget)
    if stabilizer != "none" and (rollout_logprobs is None or ratio_clip is not None):
        raise ValueError(f"stabilizer={stabilizer!r} needs rollout_logprobs (its ratios) and no ratio_clip")
    check_sampling_top_k(sampling_top_k)
    if advantages is not None and n and not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages must be finite")
    logprob = sampled_token_logprobs(hidden, weight, actual_ids.long(), bias=bias, logit_scale=logit_scale,
                                     softcap=softcap, temperature=temperature)
    with torch.no_grad():
        reverse_kl = logprob - teacher_logprobs.to(logprob.dtype)  # float32, float64 for float64 inputs
        advantage = -reverse_kl if advantages is None else advantages.detach().to(logprob.dtype)
        coefficient = advantage.clone()
        ratio = torch.zeros(0, device=hidden.device)
        clipped = torch.zeros((), device=hidden.device)
        masked = torch.zeros((), device=hidden.device)
        if rollout_logprobs is not None:
            log_ratio = sampling_log_ratio(hidden, weight, actual_ids.long(), rollout_logprobs, logprob, bias=bias,
                                           logit_scale=logit_scale, softcap=softcap, temperature=temperature,
                                           sampling_temperature=sampling_temperature)
            proximal = None if proximal_logprobs is None else (proximal_logprobs.to(log_ratio.dtype)
                                                                 - rollout_logprobs.to(log_ratio.dtype))
            lag = None if stabilizer in ("none", "decoupled_ppo") else sampler_log_ratio(
                hidden, weight, actual_ids, rollout_logprobs, bias=bias, logit_scale=logit_scale, softcap=softcap,
                sampling_temperature=sampling_temperature or temperature, sampling_top_k=sampling_top_k)
            weights = stabilized_ratios(log_ratio, advantage, stabilizer=stabilizer, clip_eps=clip_eps,
                                        m2po_budget=m2po_budget, ratio_clip=ratio_clip, proximal_log_ratio=proximal,
                                        lag_log_ratio=lag)
            ratio = torch.exp(log_ratio)
            clipped, masked = weights.clipped.sum(), weights.masked.sum()
            coefficient = coefficient * weights.weight.to(coefficient.dtype)
        if token_weights is not None:
            coefficient = coefficient * token_weights.to(coefficient.dtype)
    loss = -(coefficient * logprob).sum()
    if n == 0:  # keep the graph connected so that backward (and FSDP's gradient sync) still runs
        loss = loss + 0.0 * (hidden.sum() + weight.sum())
    return PolicyGradientOutput(
        loss=loss,
        reverse_kl_sum=reverse_kl.sum(),
        advantage_sum=advantage.sum(),
        advantage_sq_sum=(advantage**2).sum(),
        ratio_sum=ratio.sum(),
        ratio_max=ratio.max() if ratio.numel() else torch.zeros((), device=hidden.device),
        clipped=clipped.float(),
        num_tokens=torch.tensor(n, dtype=torch.int64, device=hidden.device),
        reverse_kl=reverse_kl,
        masked=masked.float(),
    )
