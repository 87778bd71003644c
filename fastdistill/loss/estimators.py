"""Student-side reverse-KL estimators over S "query" ids per position: :func:`query_reverse_kl_loss`.

Per position (student hidden state h, current student π_θ, rollout/behaviour policy μ, teacher π_T) the rollout
gives S query ids a_1..a_S with log μ(a_n) and log π_T(a_n). Two estimators of the reverse KL KL(π_θ‖π_T):

``estimator="multi_sample"`` (``loss_type="reverse_kl_mc"``): a_n ~ μ iid (a_1 the realised token), and

    w_n = π_θ(a_n) / μ(a_n)                   (π_θ at the sampling temperature, as :func:`importance_ratios`)
    A_n = log π_T(a_n) − sg[log π_θ(a_n)]     (learner-time advantage, the CURRENT student)
    L   = −(1/S) Σ_n sg[w_n] · A_n · log π_θ(a_n)

E_{a~μ}[w ∇(−A log π_θ)] = Σ_a π_θ(a)(log π_θ(a) − log π_T(a)) ∇log π_θ(a) = ∇KL(π_θ‖π_T) at the state, for the
current π_θ whatever μ is (μ > 0 where π_θ > 0); the S draws are iid, so the gradient's variance is 1/S of one
draw's. Without the ratio (``importance_ratio=False``) the expectation is Σ_a μ(a)(…)∇log π_θ(a): biased when
μ ≠ π_θ. The ratio may be truncated (``ratio_clip``) or replaced by a stabilizer (``stabilizer``:
:func:`~fastdistill.loss.policy_gradient.stabilized_ratios`: PPO-clip, decoupled PPO, M2PO); those trade the
unbiasedness for bounded weights.

``estimator="student_topk"`` (``loss_type="reverse_kl_student_topk"``): the a_n are the rollout student's top-S ids
(distinct; taken from μ, not π_θ, so possibly stale), and the loss is the reverse KL between the two distributions
coarsened to the S support ids plus one tail bucket, computed exactly:

    KL_S = Σ_{i∈S} π_θ(i)(log π_θ(i) − log π_T(i)) + P_tail (log P_tail − log Q_tail)

with P_tail = 1 − Σ_S π_θ (an exact log-sum-exp over the non-support logits) and Q_tail = 1 − Σ_S π_T (the
teacher's clamped tail, as the JSD loss takes it). By the data-processing inequality 0 ≤ KL_S ≤ KL, with equality
when the support is the whole vocabulary. Its gradient with respect to a logit z_v is p_v(ℓ_v − KL_S) with
ℓ_v = log(p_v/q_v) on the support and ℓ_v = log(P_tail/Q_tail) (the tail's average log-ratio) off it, where the
dense gradient has p_v(log(p_v/q_v) − KL): the bias is zero when the support covers the vocabulary, or when
log(p_v/q_v) is the same at every tail id, and otherwise nonzero (tests/test_estimators.py measures it). The tail
term, rather than the truncated sum alone (AsyncOPD's ``reverse_kl_rollout_student_topk``: not a divergence, it can
be negative) or a renormalisation over the support (which gives the tail logits no gradient at all), keeps the
student's tail mass pulled toward the teacher's. No ratio: the sum is exact at the visited state, whichever policy
chose S.

Both need on the wire, per completion position: S query ids, log μ at them (the student server's processed
log-probs) and log π_T at them (``RolloutSample.query_*``). The full-vocabulary log-sum-exp is taken in bounded row
chunks under activation checkpointing (:func:`~fastdistill.loss.policy_gradient.sampled_token_logprobs`), so no
(N, V) tensor is alive.

Signature note: beyond the shared contract's arguments, :func:`query_reverse_kl_loss` takes ``importance_ratio``
(default True), ``ratio_clip`` (default None), ``proximal_logprobs`` (default None: the current weights) and
``sampling_top_k`` (default None: the stabilizers judge the policy's move by π_θ/μ itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from fastdistill_kernels.buckets import clamped_tail

from fastdistill.logit_head import LogitHead, head_logits

from .policy_gradient import (
    CHUNK_ROWS,
    PG_STABILIZERS,
    check_sampling_top_k,
    check_stabilizer,
    checkpointed_row_chunks,
    sampled_token_logprobs,
    sampler_log_ratio,
    sampling_log_ratio,
    stabilized_ratios,
)

ESTIMATORS = ("multi_sample", "student_topk")


@dataclass
class EstimatorOutput:
    """Result of :func:`query_reverse_kl_loss`; every field but ``loss`` is detached.

    Attributes:
        loss: 0-dim, differentiable: Σ over positions of the per-position surrogate (times ``token_weights``).
            Divide by the window's token count.
        reverse_kl_sum: 0-dim, Σ over positions of the reverse-KL estimate ``reverse_kl``.
        advantage_sum, advantage_sq_sum: 0-dim, Σ and Σ² of A = log π_T(a) − log π_θ(a) over the N·S entries.
        ratio_sum, ratio_max: 0-dim, Σ and max of π_θ/μ over the entries (multi_sample; zeros for student_topk).
        clipped, masked: 0-dim, entries whose gradient a clip removed or truncated, and entries M2PO masked.
        support_mass_sum: 0-dim, Σ over positions of π_θ's mass on the support (student_topk; 0 otherwise).
        num_tokens: 0-dim int64, N positions; num_queries: 0-dim int64, N·S entries.
        reverse_kl: ``(N,)`` per position: (1/S) Σ_n w_n (log π_θ − log π_T)(a_n) (multi_sample; w = 1 without
            the ratio), or KL_S (student_topk).
    """

    loss: torch.Tensor
    reverse_kl_sum: torch.Tensor
    advantage_sum: torch.Tensor
    advantage_sq_sum: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_max: torch.Tensor
    clipped: torch.Tensor
    masked: torch.Tensor
    support_mass_sum: torch.Tensor
    num_tokens: torch.Tensor
    num_queries: torch.Tensor
    reverse_kl: torch.Tensor


def _support_logprobs(hidden, weight, bias, ids, logit_scale, softcap, temperature):
    """(c, S) log π_θ at ``ids`` and (c,) log P_tail (a log-sum-exp over the non-support logits)."""
    logits = head_logits(hidden, weight, bias, LogitHead(float(logit_scale), softcap), temperature=temperature)
    lse = torch.logsumexp(logits, dim=1, keepdim=True)
    tail = torch.logsumexp(logits.scatter(1, ids, float("-inf")), dim=1) - lse.squeeze(1)
    return logits.gather(1, ids) - lse, tail


def support_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *,
                     bias: torch.Tensor | None = None, logit_scale: float = 1.0, softcap: float | None = None,
                     temperature: float = 1.0, chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log π_θ(ids) (N, S), log P_tail (N,))`` for distinct ``ids`` (N, S) with S < V: the student's log-probs on
    the support and its log-mass off it, differentiable, one ``(chunk_rows, V)`` logits tile (and its masked copy)
    alive per checkpointed chunk."""
    parts = checkpointed_row_chunks(_support_logprobs, hidden, weight, bias, ids, logit_scale, softcap, temperature,
                                    chunk_rows=chunk_rows)
    if not parts:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        return hidden.new_zeros(tuple(ids.shape), dtype=dtype), hidden.new_zeros(0, dtype=dtype)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _validate(hidden, weight, query_ids, behaviour_logprobs, teacher_logprobs, token_weights, proximal_logprobs, *,
              estimator, temperature, sampling_temperature, stabilizer, clip_eps, m2po_budget, importance_ratio,
              ratio_clip, sampling_top_k):
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, D) and weight (V, D) with the same D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    n, vocab = hidden.shape[0], weight.shape[0]
    if query_ids.dim() != 2 or query_ids.shape[0] != n or query_ids.shape[1] < 1:
        raise ValueError(f"query_ids must be (N, S) with N = {n} and S >= 1, got {tuple(query_ids.shape)}")
    if query_ids.dtype.is_floating_point or query_ids.dtype == torch.bool:
        raise ValueError(f"query_ids must be an integer tensor, got {query_ids.dtype}")
    shape = tuple(query_ids.shape)
    for name, x, want in (("behaviour_logprobs", behaviour_logprobs, shape), ("teacher_logprobs", teacher_logprobs,
                          shape), ("proximal_logprobs", proximal_logprobs, shape), ("token_weights", token_weights,
                                                                                    (n,))):
        if x is not None and tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if n and (int(query_ids.min()) < 0 or int(query_ids.max()) >= vocab):
        raise ValueError(f"query_ids must lie in [0, V) = [0, {vocab})")
    if n and not bool(torch.isfinite(teacher_logprobs).all()):
        raise ValueError("teacher_logprobs must be finite (the teacher's log-prob of every query id)")
    for name, value in (("temperature", temperature), ("sampling_temperature", sampling_temperature)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    check_stabilizer(stabilizer, clip_eps, m2po_budget)
    check_sampling_top_k(sampling_top_k)
    if ratio_clip is not None and not (isinstance(ratio_clip, (int, float)) and math.isfinite(ratio_clip)
                                       and ratio_clip > 0):
        raise ValueError(f"ratio_clip must be None or a finite number > 0, got {ratio_clip!r}")
    if estimator == "student_topk":
        if stabilizer != "none" or ratio_clip is not None or proximal_logprobs is not None:
            raise ValueError("estimator='student_topk' is an exact sum over its support, no importance ratio: "
                             "stabilizer must be 'none', ratio_clip and proximal_logprobs None")
        if query_ids.shape[1] > vocab:
            raise ValueError(f"estimator='student_topk' needs distinct ids: S = {query_ids.shape[1]} > V = {vocab}")
        if n and query_ids.shape[1] > 1:
            ordered = torch.sort(query_ids, dim=1).values
            if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                raise ValueError("estimator='student_topk' needs distinct query_ids in every row (a top-S support)")
        return
    if n and importance_ratio and not bool(torch.isfinite(behaviour_logprobs).all()):
        raise ValueError("behaviour_logprobs must be finite (log μ of ids drawn from μ)")
    if not importance_ratio and (stabilizer != "none" or ratio_clip is not None):
        raise ValueError(f"importance_ratio=False leaves no ratio to stabilize or clip (stabilizer={stabilizer!r}, "
                         f"ratio_clip={ratio_clip!r})")
    if stabilizer != "none" and ratio_clip is not None:
        raise ValueError(f"ratio_clip is the plain estimator's truncation; stabilizer={stabilizer!r} clips itself")
    if proximal_logprobs is not None and stabilizer != "decoupled_ppo":
        raise ValueError(f"proximal_logprobs are decoupled PPO's; stabilizer={stabilizer!r}")


def query_reverse_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    query_ids: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    estimator: str = "multi_sample",
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    sampling_temperature: float | None = None,
    stabilizer: str = "none",
    clip_eps: float = 0.2,
    m2po_budget: float = 0.01,
    token_weights: torch.Tensor | None = None,
    importance_ratio: bool = True,
    ratio_clip: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    sampling_top_k: int | None = None,
) -> EstimatorOutput:
    """Reverse-KL estimator over S query ids per position, summed over the N positions (module docstring).

    Args:
        hidden: ``(N, D)`` student hidden states; weight ``(V, D)``; bias ``(V,)`` or None; ``logit_scale`` and
            ``softcap`` as :func:`fastdistill.logit_head.head_logits` applies them.
        query_ids: ``(N, S)`` integer ids in [0, V): draws from μ (multi_sample, duplicates allowed) or the rollout
            student's distinct top-S (student_topk).
        behaviour_logprobs: ``(N, S)`` log μ at the ids (nats); read by multi_sample's ratio only.
        teacher_logprobs: ``(N, S)`` log π_T at the ids (nats), finite.
        estimator: ``"multi_sample"`` or ``"student_topk"``.
        temperature: divides the student logits of the advantage and the loss (the teacher's, 1 for served ones).
        sampling_temperature: the temperature μ sampled at (None: ``temperature``); the ratio's π_θ is taken there.
        stabilizer, clip_eps, m2po_budget: one of ``PG_STABILIZERS`` for multi_sample
            (:func:`~fastdistill.loss.policy_gradient.stabilized_ratios`; M2PO's second moment is over this
            call's N·S entries).
        token_weights: ``(N,)`` extra constant per-position weights, or None.
        importance_ratio: multi_sample weights by π_θ/μ (False: w = 1, biased when μ ≠ π_θ).
        ratio_clip: upper truncation of the plain ratio (None: unclipped).
        proximal_logprobs: ``(N, S)`` log π_prox at the ids, sampling temperature, for ``"decoupled_ppo"`` (None:
            the current weights are the proximal policy, r' = 1).
        sampling_top_k: the rollout's top-k (None: none): ``"ppo_clip"`` and ``"m2po"`` then judge the policy's move
            by the current weights' truncated sampling distribution over μ
            (:func:`~fastdistill.loss.policy_gradient.sampler_log_ratio`; a fresh sample's is 1), the weight staying
            π_θ/μ.

    Raises ValueError for mismatched shapes, ids outside [0, V) (or repeated ones for student_topk), non-finite
    teacher (or, with the ratio, behaviour) log-probs, bad temperatures and option combinations that do not apply.
    """
    _validate(hidden, weight, query_ids, behaviour_logprobs, teacher_logprobs, token_weights, proximal_logprobs,
              estimator=estimator, temperature=temperature, sampling_temperature=sampling_temperature,
              stabilizer=stabilizer, clip_eps=clip_eps, m2po_budget=m2po_budget, importance_ratio=importance_ratio,
              ratio_clip=ratio_clip, sampling_top_k=sampling_top_k)
    n, draws = query_ids.shape
    ids = query_ids.long()
    head = dict(bias=bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    device = hidden.device
    zero = torch.zeros((), device=device)
    if estimator == "student_topk":
        return _student_topk(hidden, weight, ids, teacher_logprobs, token_weights, head)
    logprob = sampled_token_logprobs(hidden, weight, ids, **head)  # (N, S)
    with torch.no_grad():
        advantage = teacher_logprobs.to(logprob.dtype) - logprob
        ratio, clipped, masked = torch.ones_like(advantage), zero, zero
        weights = ratio
        if importance_ratio:
            log_ratio = sampling_log_ratio(hidden, weight, ids, behaviour_logprobs, logprob,
                                           sampling_temperature=sampling_temperature, **head)
            proximal = None if proximal_logprobs is None else (proximal_logprobs.to(log_ratio.dtype)
                                                                 - behaviour_logprobs.to(log_ratio.dtype))
            lag = None if stabilizer in ("none", "decoupled_ppo") else sampler_log_ratio(
                hidden, weight, ids, behaviour_logprobs, bias=bias, logit_scale=logit_scale, softcap=softcap,
                sampling_temperature=sampling_temperature or temperature, sampling_top_k=sampling_top_k)
            stabilized = stabilized_ratios(log_ratio, advantage, stabilizer=stabilizer, clip_eps=clip_eps,
                                           m2po_budget=m2po_budget, proximal_log_ratio=proximal,
                                           ratio_clip=ratio_clip, lag_log_ratio=lag)
            ratio = torch.exp(log_ratio)
            weights = stabilized.weight
            clipped, masked = stabilized.clipped.sum().float(), stabilized.masked.sum().float()
        coefficient = weights * advantage / draws
        estimate = (ratio * -advantage).mean(dim=1)
        if token_weights is not None:
            coefficient = coefficient * token_weights.to(coefficient.dtype)[:, None]
    loss = -(coefficient * logprob).sum()
    if n == 0:  # keep the graph connected so that backward (and FSDP's gradient sync) still runs
        loss = loss + 0.0 * (hidden.sum() + weight.sum())
    return EstimatorOutput(
        loss=loss, reverse_kl_sum=estimate.sum(), advantage_sum=advantage.sum(),
        advantage_sq_sum=(advantage**2).sum(), ratio_sum=ratio.sum() if importance_ratio else zero,
        ratio_max=ratio.max() if importance_ratio and ratio.numel() else zero, clipped=clipped, masked=masked,
        support_mass_sum=zero, num_tokens=torch.tensor(n, dtype=torch.int64, device=device),
        num_queries=torch.tensor(n * draws, dtype=torch.int64, device=device), reverse_kl=estimate)


def _student_topk(hidden, weight, ids, teacher_logprobs, token_weights, head) -> EstimatorOutput:
    """The exact reverse KL over the support plus a tail bucket (module docstring)."""
    n, size = ids.shape
    device = hidden.device
    zero = torch.zeros((), device=device)
    covers = size == weight.shape[0]  # distinct ids: every row covers the vocabulary, or none does
    if covers:
        logprob = sampled_token_logprobs(hidden, weight, ids, **head)
    else:
        logprob, log_tail = support_logprobs(hidden, weight, ids, **head)
    teacher = teacher_logprobs.to(logprob.dtype)
    kl = (logprob.exp() * (logprob - teacher)).sum(dim=1)
    if not covers:
        kl = kl + log_tail.exp() * (log_tail - clamped_tail(teacher))
    per_position = kl if token_weights is None else kl * token_weights.to(kl.dtype)
    loss = per_position.sum()
    if n == 0:
        loss = loss + 0.0 * (hidden.sum() + weight.sum())
    with torch.no_grad():
        advantage = teacher - logprob
        return EstimatorOutput(
            loss=loss, reverse_kl_sum=kl.detach().sum(), advantage_sum=advantage.sum(),
            advantage_sq_sum=(advantage**2).sum(), ratio_sum=zero, ratio_max=zero, clipped=zero, masked=zero,
            support_mass_sum=logprob.exp().sum(), num_tokens=torch.tensor(n, dtype=torch.int64, device=device),
            num_queries=torch.tensor(n * size, dtype=torch.int64, device=device), reverse_kl=kl.detach())


__all__ = ["ESTIMATORS", "EstimatorOutput", "PG_STABILIZERS", "query_reverse_kl_loss", "support_logprobs"]
