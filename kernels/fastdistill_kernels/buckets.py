"""Per-row bucket math in torch, O(N·S): the divergence from (z_cand, lse, lse_nc) and the logit gradients.

Shared by the kernels and fastdistill's torch path (this module needs only torch). The student's
buckets are the candidates' log-probs ``z_cand − lse`` plus, with a tail bucket, the leftover mass (exact:
``lse_nc − lse``; "trl": TRL's clamped subtraction); the teacher's tail is always the clamped subtraction.
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


def bucket_divergence(z_cand, lse, lse_nc, teacher_logprobs, valid, covers_vocab, *, beta: float,
                      add_tail_bucket: bool, tail_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized JSD per row over the valid candidate slots plus the tail bucket.

    Args:
        z_cand: ``(n, S)`` student logits of the candidates (after scale, softcap and temperature).
        lse, lse_nc: ``(n,)`` log-sum-exp of the student logits over all / non-candidate columns.
        teacher_logprobs: ``(n, S)`` teacher log-probs (nats), finite where ``valid``.
        valid: ``(n, S)`` bool, canonical slots (distinct ids); every row has at least one.
        covers_vocab: ``(n,)`` bool, rows whose candidates are the whole vocabulary (no tail bucket with "exact").
        beta: 0 = KL(teacher‖student), 1 = KL(student‖teacher), else β·KL(q‖m) + (1−β)·KL(p‖m), m = (1−β)p + βq.
        add_tail_bucket, tail_mode: the leftover-mass bucket ("exact" or "trl"), or renormalise over the support.

    Returns:
        ``(divergence, teacher_entropy)``, each ``(n,)`` nats; the first is differentiable in z_cand, lse, lse_nc.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=z_cand.dtype, device=z_cand.device)
    s = torch.where(valid, z_cand - lse.unsqueeze(-1), neg_inf)
    t = torch.where(valid, teacher_logprobs.to(z_cand.dtype), neg_inf)
    if add_tail_bucket:
        t_tail = clamped_tail(t)
        if tail_mode == "exact":
            s_tail = lse_nc - lse
            tail_valid = ~covers_vocab
        else:
            s_tail = clamped_tail(s)
            tail_valid = torch.ones_like(covers_vocab)
        s = torch.cat([s, s_tail.unsqueeze(-1)], dim=-1)
        t = torch.cat([t, t_tail.unsqueeze(-1)], dim=-1)
        valid = torch.cat([valid, tail_valid.unsqueeze(-1)], dim=-1)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)

    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s = torch.where(valid, s, zero)  # masked slots contribute exactly 0, with no NaN gradients
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
    return terms.sum(dim=-1), -(q * t).sum(dim=-1).detach()


def logit_gradients(z_cand, lse, m_nc, s_nc, teacher_logprobs, valid, covers_vocab, grad_rows, *, beta: float,
                    add_tail_bucket: bool, tail_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of ``Σ_n grad_rows[n] · divergence[n]`` w.r.t. the final logits z, in the form the backward
    kernel consumes (all ``(n,)`` / ``(n, S)`` fp32):

        non-candidate v:  dL/dz_v = exp(z_v − m_nc) · coef_nc
        candidate C[k]:   dL/dz_c = cand_grad[k]

    The loss sees z only through z_cand − lse and lse_nc − lse, so g_lse = −(Σ g_cand + g_nc); substituting it
    with P_C = Σ candidate probs avoids the cancellation of g_nc/p_tail against g_lse when the tail holds almost
    all the mass. Returns ``(coef_nc, cand_grad)``; cand_grad is 0 on invalid slots.
    """
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in (z_cand, m_nc + torch.log(s_nc))]
        div, _ = bucket_divergence(leaves[0], lse, leaves[1], teacher_logprobs, valid, covers_vocab, beta=beta,
                                   add_tail_bucket=add_tail_bucket, tail_mode=tail_mode)
        # a scalar root, not grad_outputs=grad_rows: the latter makes torch import its symbolic-shape machinery
        # (sympy, about 35 MB of peak memory on a first call); the gradient is the same
        g_cand, g_nc = torch.autograd.grad((div * grad_rows.detach()).sum(), leaves, allow_unused=True)
    g_nc = torch.zeros_like(lse) if g_nc is None else g_nc  # no exact tail bucket: lse_nc is unused
    zero = torch.zeros((), dtype=z_cand.dtype, device=z_cand.device)
    p_cand = torch.where(valid, torch.exp(z_cand - lse.unsqueeze(1)), zero)
    sum_g_cand = g_cand.sum(dim=1)
    inv_s_nc = torch.where(s_nc > 0, 1.0 / s_nc, torch.zeros_like(s_nc))  # s_nc = 0: no non-candidate column
    coef_nc = g_nc * p_cand.sum(dim=1) * inv_s_nc - sum_g_cand * torch.exp(m_nc - lse)
    cand_grad = torch.where(valid, g_cand - p_cand * (sum_g_cand + g_nc).unsqueeze(1), zero)
    return coef_nc, cand_grad
