"""Per-position divergence over the support buckets (+ tail), from a few numbers per row.

Everything here is O(N·S): the vocabulary-sized work (log-sum-exps, candidate logits) is done by the caller.
The torch path and the kernels both reduce a row of logits to ``z_cand`` (the candidates' logits), ``lse``
(log-sum-exp over the whole vocabulary) and ``lse_nc`` (log-sum-exp over the non-candidate vocabulary), then
call :func:`bucket_divergence`, which is differentiable in those three.
"""

from __future__ import annotations

import math

import torch

# TRL's clamp on log Σ p before the tail log(1 − Σ p): keeps the tail finite (≥ log(1 − e^-1e-7) ≈ −16.118).
TRL_TAIL_CLAMP = -1e-7


def clamped_tail(log_probs: torch.Tensor) -> torch.Tensor:
    """Tail log-mass ``log(1 − Σ exp(log_probs))`` with TRL's clamp, ``(n, S) -> (n,)``; -inf entries are empty."""
    log_sum = torch.logsumexp(log_probs, dim=-1).clamp(max=TRL_TAIL_CLAMP)
    return torch.log(-torch.expm1(log_sum))


def bucket_divergence(
    z_cand: torch.Tensor,
    lse: torch.Tensor,
    lse_nc: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    valid: torch.Tensor,
    covers_vocab: torch.Tensor,
    *,
    beta: float,
    add_tail_bucket: bool,
    tail_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized JSD per row over the valid candidate slots plus the tail bucket.

    Args:
        z_cand: ``(n, S)`` student logits of the candidates (after scale, softcap and temperature).
        lse, lse_nc: ``(n,)`` log-sum-exp of the student logits over all / non-candidate columns.
        teacher_logprobs: ``(n, S)`` teacher log-probs (nats), finite where ``valid``.
        valid: ``(n, S)`` bool, canonical slots (distinct ids); every row has at least one.
        covers_vocab: ``(n,)`` bool, rows whose candidates are the whole vocabulary: with the exact tail
            there is no leftover token, so such rows carry no tail bucket on either side.
        beta, add_tail_bucket, tail_mode: see :func:`fastdistill.sparse_jsd_loss`.

    Returns:
        ``(divergence, teacher_entropy)``, each ``(n,)``; the first is differentiable in z_cand, lse, lse_nc.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=z_cand.dtype, device=z_cand.device)
    s = torch.where(valid, z_cand - lse.unsqueeze(-1), neg_inf)
    t = torch.where(valid, teacher_logprobs.to(z_cand.dtype), neg_inf)
    if add_tail_bucket:
        t_tail = clamped_tail(t)
        if tail_mode == "exact":
            s_tail = lse_nc - lse
            tail_valid = ~covers_vocab
        else:  # "trl": TRL's subtraction with clamp, on the student side too
            s_tail = clamped_tail(s)
            tail_valid = torch.ones_like(covers_vocab)
        s = torch.cat([s, s_tail.unsqueeze(-1)], dim=-1)
        t = torch.cat([t, t_tail.unsqueeze(-1)], dim=-1)
        valid = torch.cat([valid, tail_valid.unsqueeze(-1)], dim=-1)
    else:  # renormalise both sides over the support
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)

    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s = torch.where(valid, s, zero)  # safe values: masked slots contribute exactly 0 (and no NaN gradients)
    t = torch.where(valid, t, zero)
    p = torch.where(valid, s.exp(), zero)
    q = torch.where(valid, t.exp(), zero)
    if beta == 0.0:
        terms = q * (t - s)
    elif beta == 1.0:
        terms = p * (s - t)
    else:
        log_m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        terms = beta * q * (t - log_m) + (1.0 - beta) * p * (s - log_m)
    terms = torch.where(valid, terms, zero)
    teacher_entropy = -(q * t).sum(dim=-1)
    return terms.sum(dim=-1), teacher_entropy.detach()
