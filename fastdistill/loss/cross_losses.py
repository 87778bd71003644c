"""Losses against a teacher with another tokenizer, over aligned groups (see :mod:`fastdistill.cross_tokenizer`).

Inputs are per student position, as :func:`fastdistill.cross_tokenizer.build_targets` ships them
(group ids made unique across a batch by :func:`~fastdistill.cross_tokenizer.concatenate_targets`).
For an aligned group g let s_g / t_g be its first student / teacher token, p = the student's next-token distribution
at s_g (full vocabulary, the loss temperature), q = the teacher's at t_g (its top-K + realised token, the rest
unknown), and the "observed" merge scales (GOLD's default strategy) c_s = Π p(y) over the student's realised tokens
of g after the first, c_t the same for the teacher.

**Hybrid loss** (:func:`hybrid_loss`), summed over groups: ``w_shared · JSD_g + w_unshared · ULD_g``.

- ``JSD_g``: the generalized JSD of :func:`fastdistill.sparse_jsd_loss` (same β convention: 0 = KL(teacher‖student),
  1 = KL(student‖teacher), m = (1−β)·p + β·q) at row s_g, over the teacher's candidates whose bytes the student's
  vocabulary shares (mapped to student ids), plus one exact tail bucket per side: the student's is the full-vocabulary
  mass off those ids, the teacher's 1 − Σ q over them (so its unshared and unreported mass). Unscaled: p and q are
  next-token distributions from the same text prefix.
- ``ULD_g``: the L1 distance of the sorted probabilities of the **unshared** tokens, scaled by c_s / c_t:
  Σ_{r<n} |c_s·p_(r) − c_t·q_(r)| + |c_s·P_rest − c_t·Q_rest|, where q_(r) are the teacher's n unshared candidates
  among its ranked top-K (sorted: exactly its n most probable unshared tokens), p_(r) the student's n most probable
  unshared tokens, P_rest the student's unshared mass beyond them and Q_rest = 1 − Σ shared candidates − Σ q_(r):
  the teacher's mass it did not report, all counted as unshared (exact when the candidates cover the vocabulary).
- Weights: GOLD's adaptive ``(n_shared / V_t, 1 − n_shared / V_t)`` from
  :meth:`~fastdistill.cross_tokenizer.VocabularyMap.gold_weights`, or fixed ones.

**ULD loss** (:func:`uld_loss`): ULD_g over every token (no vocabulary map: the student's whole vocabulary, all the
teacher's ranked candidates, Q_rest = 1 − Σ ranked).

**Group reverse-KL policy gradient** (:func:`group_reverse_kl_pg_loss`): the estimator of
:mod:`fastdistill.loss.policy_gradient` with the aligned group as the action:
A_g = log π_T(text of g) − sg[log π_θ(text of g)] (sums of the realised tokens' log-probs on each side) and
L = −Σ_g sg[w_g·A_g] · Σ_{s∈g} log π_θ(y_s), w_g the group's importance ratio Π π_θ/μ (optionally clipped).

**Against TRL 1.16's GOLD** (``ULDLoss``, ``use_extended_uld=True``, ``uld_token_merge_strategy="observed"``):

- Same: the grouping (GOLD's ``_align_by_byte_offsets`` on the same spans), the observed merge (first position's
  distribution × the later realised tokens' probabilities), sorting, zero-padding of the shorter side, the L1 and
  the adaptive weights. With a teacher whose candidates cover its vocabulary, ``uld_loss / G`` equals GOLD's
  distillation loss and the hybrid's ULD part / G GOLD's ``last_unmatched_loss`` (the tests check both).
- Different: (1) GOLD scores a dense local teacher; here the teacher is sparse, hence the rest buckets P_rest /
  Q_rest (GOLD's sorted L1 over every rank is their K = V limit). (2) GOLD's shared-token JSD takes the merged,
  unnormalised probabilities restricted to the shared ids, clamped at 1e-8, with no tail and reduced by "batchmean";
  here it is the existing sparse generalized JSD with exact tails on the unscaled next-token distributions, so it is
  a divergence between two proper distributions and runs on the same paths (torch, Triton) as the same-tokenizer
  loss. (3) GOLD pairs tokens by their vocabulary strings, special tokens included; here by bytes, special tokens
  excluded (they have no bytes), so a byte-level and a SentencePiece tokenizer still share "the" and " the".
  (4) Reduction: GOLD averages over groups per sample and then over samples; these return sums over groups (divide
  by the window's token or group count as the trainer does for the other losses). (5) GOLD's "observed" mode reads
  the logits at the answer positions themselves (``probs[k]`` is what a causal LM uses for token k+1, paired with
  token k); here row j predicts token j. (6) GOLD's optional student cross-entropy term
  (``uld_crossentropy_weight``) and its "bayesian" merge are not part of these.

No ``(N, V)`` tensor: the full-vocabulary reductions (log-sum-exp, top-n, the realised tokens' log-probs) run in row
chunks under activation checkpointing, one ``(chunk, V)`` logits tile (two with an unshared mask) alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from fastdistill.logit_head import LogitHead, head_logits

from .api import sparse_jsd_loss
from .policy_gradient import PolicyGradientOutput, importance_ratios, sampled_token_logprobs

CHUNK_ROWS = 128


@dataclass
class HybridOutput:
    """Result of :func:`hybrid_loss` / :func:`uld_loss`.

    Attributes:
        loss: 0-dim, differentiable: Σ_g (w_shared·JSD_g + w_unshared·ULD_g) (ULD only: Σ_g ULD_g).
        jsd_sum: 0-dim, Σ_g JSD_g (unweighted, detached; 0 for :func:`uld_loss`).
        uld_sum: 0-dim, Σ_g ULD_g (unweighted, detached).
        num_groups: 0-dim int64, G, the groups scored.
        uld: ``(G,)`` ULD_g per group in group-start order, detached.
    """

    loss: torch.Tensor
    jsd_sum: torch.Tensor
    uld_sum: torch.Tensor
    num_groups: torch.Tensor
    uld: torch.Tensor


def _check_groups(group_index: torch.Tensor, group_start: torch.Tensor, n: int) -> None:
    if group_index.shape != (n,) or group_start.shape != (n,):
        raise ValueError(f"group_index and group_start must have shape ({n},), got {tuple(group_index.shape)} and "
                         f"{tuple(group_start.shape)}")
    if group_start.dtype != torch.bool or group_index.is_floating_point():
        raise ValueError("group_start must be bool and group_index an integer tensor")
    if not n:
        return
    if bool((group_start & (group_index < 0)).any()):
        raise ValueError("a group start has group_index -1 (excluded)")
    kept = group_index[group_index >= 0].long()
    if kept.numel():
        starts = torch.bincount(group_index[group_start].long(), minlength=int(kept.max()) + 1)
        present = torch.bincount(kept, minlength=starts.numel()) > 0
        if bool((starts[present] != 1).any()):
            raise ValueError("every group must have exactly one start row (group_start) among its positions")


def _sorted_logprobs(hidden, weight, bias, logit_scale, softcap, temperature, excluded, m):
    """A chunk's ``m`` largest student log-probs over the non-excluded ids ``(c, m)``, and those ids' log-mass
    ``(c,)``."""
    z = head_logits(hidden, weight, bias, LogitHead(float(logit_scale), softcap), temperature=temperature)
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    if excluded is not None:
        z = z.masked_fill(excluded, float("-inf"))
    top = z.topk(m, dim=1).values - lse if m else z[:, :0]
    return top, (torch.logsumexp(z, dim=1, keepdim=True) - lse).squeeze(1)


def sorted_student_logprobs(hidden: torch.Tensor, weight: torch.Tensor, m: int, *,
                            excluded: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                            logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0,
                            chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``hidden`` (n, D): the ``m`` largest student log-probs (full-vocabulary softmax) among the ids not
    in ``excluded`` (V,) bool, descending ``(n, m)``, and the log of those ids' total probability ``(n,)``;
    differentiable, float32 (float64 for float64 inputs), one checkpointed ``(chunk_rows, V)`` tile at a time."""
    tops, masses = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        args = (hidden[start:start + chunk_rows], weight, bias, logit_scale, softcap, temperature, excluded, m)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            top, mass = checkpoint(_sorted_logprobs, *args, use_reentrant=False)
        else:
            top, mass = _sorted_logprobs(*args)
        tops.append(top)
        masses.append(mass)
    if not tops:
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        return hidden.new_zeros(0, m, dtype=dtype), hidden.new_zeros(0, dtype=dtype)
    return torch.cat(tops), torch.cat(masses)


def _continuation_logprob(hidden, weight, actual_ids, group_index, group_start, head_kwargs, chunk_rows):
    """Σ over each group's realised student tokens after its first of log π_θ(y) ``(G_max,)``, differentiable."""
    later = (group_index >= 0) & ~group_start
    num = int(group_index.max()) + 1 if group_index.numel() else 0
    lp = sampled_token_logprobs(hidden[later], weight, actual_ids[later].long(), chunk_rows=chunk_rows, **head_kwargs)
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    return torch.zeros(num, dtype=dtype, device=hidden.device).index_add(0, group_index[later].long(), lp.to(dtype))


def _uld_terms(hidden, weight, actual_ids, group_index, group_start, unshared_logprobs, continuation_logprob,
               shared_logprobs, student_shared, head_kwargs, chunk_rows):
    """ULD_g per group start ``(G,)``, differentiable (see the module docstring)."""
    rows = group_start.nonzero().squeeze(1)
    k = unshared_logprobs.shape[1]
    vocab = weight.shape[0]
    subset = vocab - (int(student_shared.sum()) if student_shared is not None else 0)
    m = min(k, subset)
    top, mass = sorted_student_logprobs(hidden[rows], weight, m, excluded=student_shared, chunk_rows=chunk_rows,
                                        **head_kwargs)
    dtype = top.dtype
    s_scale = _continuation_logprob(hidden, weight, actual_ids, group_index, group_start, head_kwargs,
                                    chunk_rows)[group_index[rows].long()] if rows.numel() else top.new_zeros(0)
    t_scale = continuation_logprob[rows].to(dtype)
    t_rank = unshared_logprobs[rows].to(dtype)
    if m < k:
        top = torch.cat([top, top.new_full((top.shape[0], k - m), float("-inf"))], dim=1)
    ranked = torch.arange(k, device=top.device) < torch.isfinite(t_rank).sum(dim=1, keepdim=True)
    zero = top.new_zeros(())
    s = torch.where(ranked, torch.exp(top + s_scale[:, None]), zero)
    t = torch.where(ranked, torch.exp(t_rank + t_scale[:, None]), zero)
    s_rest = (torch.exp(s_scale) * (torch.exp(mass) - torch.where(ranked, top.exp(), zero).sum(dim=1))).clamp_min(0)
    t_reported = torch.exp(t_rank).sum(dim=1)
    if shared_logprobs is not None:
        t_reported = t_reported + torch.exp(shared_logprobs[rows].to(dtype)).sum(dim=1)
    t_rest = (torch.exp(t_scale) * (1.0 - t_reported)).clamp_min(0)
    return (s - t).abs().sum(dim=1) + (s_rest - t_rest).abs()


def _check_common(hidden, weight, actual_ids, group_index, group_start, per_row: dict) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, D) and weight (V, D) with the same D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    n = hidden.shape[0]
    if actual_ids.shape != (n,):
        raise ValueError(f"actual_ids must have shape ({n},), got {tuple(actual_ids.shape)}")
    if n and (int(actual_ids.min()) < 0 or int(actual_ids.max()) >= weight.shape[0]):
        raise ValueError(f"actual_ids must lie in [0, V) = [0, {weight.shape[0]})")
    _check_groups(group_index, group_start, n)
    for name, x in per_row.items():
        if x is not None and (x.dim() < 1 or x.shape[0] != n):
            raise ValueError(f"{name} must have {n} rows, got shape {tuple(x.shape)}")


def uld_loss(hidden: torch.Tensor, weight: torch.Tensor, actual_ids: torch.Tensor, group_index: torch.Tensor,
             group_start: torch.Tensor, ranked_logprobs: torch.Tensor, continuation_logprob: torch.Tensor, *,
             bias: torch.Tensor | None = None, logit_scale: float = 1.0, softcap: float | None = None,
             temperature: float = 1.0, chunk_rows: int = CHUNK_ROWS) -> HybridOutput:
    """The sorted-probability ULD loss over every token, summed over aligned groups.

    Args:
        hidden: ``(N, D)`` student hidden states (row j predicts ``actual_ids[j]``); weight ``(V, D)``; bias ``(V,)``.
        actual_ids: ``(N,)`` the student's realised tokens.
        group_index, group_start: ``(N,)`` int / bool, the aligned groups (-1 excluded) and their first rows.
        ranked_logprobs: ``(N, K)`` at group starts the teacher's ranked top-K log-probs sorted descending, -inf
            padded (``unshared_logprobs`` of targets built with ``VocabularyMap.empty``).
        continuation_logprob: ``(N,)`` at group starts log c_t, the teacher's merge scale.
        logit_scale, softcap, temperature: the student head and the loss temperature.
    """
    _check_common(hidden, weight, actual_ids, group_index, group_start,
                  {"ranked_logprobs": ranked_logprobs, "continuation_logprob": continuation_logprob})
    head = dict(bias=bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    uld = _uld_terms(hidden, weight, actual_ids, group_index, group_start, ranked_logprobs, continuation_logprob,
                     None, None, head, chunk_rows)
    loss = uld.sum() if uld.numel() else 0.0 * (hidden.sum() + weight.sum())
    return HybridOutput(loss=loss, jsd_sum=torch.zeros((), device=hidden.device), uld_sum=uld.detach().sum(),
                        num_groups=torch.tensor(uld.numel(), device=hidden.device), uld=uld.detach())


def hybrid_loss(hidden: torch.Tensor, weight: torch.Tensor, actual_ids: torch.Tensor, group_index: torch.Tensor,
                group_start: torch.Tensor, shared_ids: torch.Tensor, shared_logprobs: torch.Tensor,
                unshared_logprobs: torch.Tensor, continuation_logprob: torch.Tensor, student_shared: torch.Tensor, *,
                shared_weight: float, unshared_weight: float, beta: float = 0.0, bias: torch.Tensor | None = None,
                logit_scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0,
                backend: str = "auto", chunk_rows: int = CHUNK_ROWS) -> HybridOutput:
    """GOLD's hybrid loss against a sparse teacher with another tokenizer: generalized JSD on shared tokens, sorted
    ULD on the rest, summed over aligned groups (definitions in the module docstring).

    Args:
        hidden, weight, actual_ids, group_index, group_start, continuation_logprob: as :func:`uld_loss`.
        shared_ids / shared_logprobs: ``(N, W)`` at group starts the student ids of the teacher's shared candidates
            and their teacher log-probs (-1 / -inf empty).
        unshared_logprobs: ``(N, K)`` at group starts the teacher's ranked unshared log-probs, sorted, -inf padded.
        student_shared: ``(V,)`` bool, the student ids the teacher's vocabulary shares.
        shared_weight, unshared_weight: the weights of the two terms (GOLD's adaptive ones:
            ``VocabularyMap.gold_weights()``), finite and ≥ 0.
        beta: the generalized JSD's β. backend: :func:`fastdistill.sparse_jsd_loss`'s backend for the JSD term.
    """
    _check_common(hidden, weight, actual_ids, group_index, group_start,
                  {"shared_ids": shared_ids, "shared_logprobs": shared_logprobs,
                   "unshared_logprobs": unshared_logprobs, "continuation_logprob": continuation_logprob})
    if student_shared.shape != (weight.shape[0],) or student_shared.dtype != torch.bool:
        raise ValueError(f"student_shared must be a bool tensor of shape ({weight.shape[0]},), got "
                         f"{student_shared.dtype} {tuple(student_shared.shape)}")
    for name, value in (("shared_weight", shared_weight), ("unshared_weight", unshared_weight)):
        if not isinstance(value, (int, float)) or not (0.0 <= float(value) < float("inf")):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    head = dict(bias=bias, logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    uld = _uld_terms(hidden, weight, actual_ids, group_index, group_start, unshared_logprobs, continuation_logprob,
                     shared_logprobs, student_shared, head, chunk_rows)
    rows = group_start.nonzero().squeeze(1)
    loss = unshared_weight * uld.sum() + 0.0 * (hidden.sum() + weight.sum())  # connected even with no group
    jsd_sum = torch.zeros((), device=hidden.device)
    if rows.numel():
        ids = shared_ids[rows]
        jsd = sparse_jsd_loss(hidden[rows], weight, ids, shared_logprobs[rows], ids >= 0, beta=beta,
                              add_tail_bucket=True, tail_mode="exact", backend=backend, **head)
        loss = loss + shared_weight * jsd.loss
        jsd_sum = jsd.jsd_sum
    return HybridOutput(loss=loss, jsd_sum=jsd_sum, uld_sum=uld.detach().sum(),
                        num_groups=torch.tensor(rows.numel(), device=hidden.device), uld=uld.detach())


def group_reverse_kl_pg_loss(hidden: torch.Tensor, weight: torch.Tensor, actual_ids: torch.Tensor,
                             group_index: torch.Tensor, group_start: torch.Tensor, group_logprob: torch.Tensor, *,
                             bias: torch.Tensor | None = None, logit_scale: float = 1.0,
                             softcap: float | None = None, temperature: float = 1.0,
                             sampling_temperature: float | None = None, rollout_logprobs: torch.Tensor | None = None,
                             ratio_clip: float | None = None, chunk_rows: int = 256) -> PolicyGradientOutput:
    """The reverse-KL policy gradient with aligned groups as actions (module docstring), summed over groups.

    Args:
        hidden, weight, actual_ids, group_index, group_start: as :func:`uld_loss`.
        group_logprob: ``(N,)`` at group starts the teacher's log-prob of the group's text (nats), finite.
        sampling_temperature, rollout_logprobs ``(N,)``, ratio_clip: the importance ratio as
            :func:`fastdistill.reverse_kl_pg_loss` takes it, here multiplied over the group's tokens.

    Returns:
        :class:`~fastdistill.loss.policy_gradient.PolicyGradientOutput` whose per-position fields are per group
        (``num_tokens`` = G, ``reverse_kl`` ``(G,)`` in group-id order of the groups present).
    """
    _check_common(hidden, weight, actual_ids, group_index, group_start,
                  {"group_logprob": group_logprob, "rollout_logprobs": rollout_logprobs})
    if ratio_clip is not None and (rollout_logprobs is None or not ratio_clip > 0):
        raise ValueError("ratio_clip needs rollout_logprobs and must be a number > 0")
    starts = group_start.nonzero().squeeze(1)
    if starts.numel() and not bool(torch.isfinite(group_logprob[starts]).all()):
        raise ValueError("group_logprob must be finite at group starts (the teacher's log-prob of each group)")
    kept = (group_index >= 0).nonzero().squeeze(1)
    groups = group_index[kept].long()
    lp = sampled_token_logprobs(hidden[kept], weight, actual_ids[kept].long(), bias=bias, logit_scale=logit_scale,
                                softcap=softcap, temperature=temperature, chunk_rows=chunk_rows)
    num = int(groups.max()) + 1 if groups.numel() else 0
    student = torch.zeros(num, dtype=lp.dtype, device=lp.device).index_add(0, groups, lp)
    present = group_index[starts].long()
    with torch.no_grad():
        teacher = torch.zeros(num, dtype=lp.dtype, device=lp.device)
        teacher[present] = group_logprob[starts].to(lp.dtype)
        advantage = teacher - student
        coefficient = advantage.clone()
        ratio = torch.zeros(0, device=hidden.device)
        clipped = torch.zeros((), device=hidden.device)
        if rollout_logprobs is not None:
            if sampling_temperature is None or sampling_temperature == temperature:
                log_ratio = lp - rollout_logprobs[kept].to(lp.dtype)
            else:
                log_ratio = importance_ratios(hidden[kept], weight, actual_ids[kept], rollout_logprobs[kept],
                                              bias=bias, logit_scale=logit_scale, softcap=softcap,
                                              sampling_temperature=sampling_temperature).log().to(lp.dtype)
            ratio = torch.zeros_like(student).index_add(0, groups, log_ratio).exp()
            capped = ratio if ratio_clip is None else ratio.clamp(max=ratio_clip)
            clipped = (capped[present] < ratio[present]).sum()
            coefficient = coefficient * capped
            ratio = ratio[present]
    loss = -(coefficient[groups] * lp).sum() + 0.0 * (hidden.sum() + weight.sum())
    advantage = advantage[present]
    return PolicyGradientOutput(
        loss=loss, reverse_kl_sum=(-advantage).sum(), advantage_sum=advantage.sum(),
        advantage_sq_sum=(advantage**2).sum(), ratio_sum=ratio.sum(),
        ratio_max=ratio.max() if ratio.numel() else torch.zeros((), device=hidden.device),
        clipped=clipped.float(), num_tokens=torch.tensor(present.numel(), dtype=torch.int64, device=hidden.device),
        reverse_kl=-advantage,
    )
