"""Dense reference: materialises the (N, V) logits and writes every formula out in probability space.

It shares no code with the torch path or the kernels (own slot canonicalisation, own tail and divergence
formulas), so tests can use it as an independent oracle. Run it in float64 for a tight oracle; gradients
come from plain autograd.
"""

from __future__ import annotations

import math

import torch

from .chunked import LossConfig
from .outputs import DenseJSDOutput, summarize, summarize_dense


def reference_sparse_jsd(hidden, weight, ids, lps, mask, *, bias=None, cfg, teacher_index=None, num_teachers=1,
                         token_weights=None):
    """Same contract as :func:`fastdistill.sparse_jsd_loss` (``cfg`` is a ``LossConfig``); O(N·V) memory."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    dtype = dtype if dtype == torch.float64 else torch.float32
    x = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        x = x + bias.to(dtype)
    x = x * cfg.logit_scale
    if cfg.softcap is not None:
        x = cfg.softcap * torch.tanh(x / cfg.softcap)
    logp = torch.log_softmax(x / cfg.temperature, dim=-1)
    V = logp.shape[1]

    valid = _canonical_slots(ids, lps, mask)
    scored = [n for n in range(ids.shape[0]) if valid[n]]
    divs, ents, tents = [], [], []
    for n in scored:
        slots = valid[n]
        cand = torch.tensor([int(ids[n, k]) for k in slots], dtype=torch.long, device=logp.device)
        p = logp[n, cand].exp()
        q = lps[n, slots].to(dtype).exp()
        if cfg.add_tail_bucket:
            p, q = _with_tail(logp[n], cand, p, q, cfg.tail_mode, V)
        else:
            p, q = p / p.sum(), q / q.sum()
        divs.append(_divergence(p, q, cfg.beta))
        probs = logp[n].exp()
        ents.append(-(torch.special.xlogy(probs, probs)).sum().detach())
        tents.append(-(torch.special.xlogy(q, q)).sum().detach())

    empty = logp.new_zeros(0)
    div = torch.stack(divs) if divs else empty
    scored_idx = torch.tensor(scored, dtype=torch.long, device=logp.device)
    weighted = div if token_weights is None else div * token_weights[scored_idx].to(dtype)
    loss = weighted.sum() + 0.0 * x.sum()  # keeps the graph connected when nothing is scored
    tidx = None if teacher_index is None else teacher_index[scored_idx]
    ent = torch.stack(ents) if ents else empty
    tent = torch.stack(tents) if tents else empty
    return summarize(loss, div.detach(), ent, tent, tidx, num_teachers)


def _canonical_slots(ids, lps, mask) -> list[list[int]]:
    """Per row, the slot indices that count: mask set, id >= 0, finite teacher log-prob, first of its id."""
    out = []
    for n in range(ids.shape[0]):
        seen, keep = set(), []
        for k in range(ids.shape[1]):
            tok = int(ids[n, k])
            if bool(mask[n, k]) and tok >= 0 and math.isfinite(float(lps[n, k])) and tok not in seen:
                seen.add(tok)
                keep.append(k)
        out.append(keep)
    return out


def _with_tail(logp_row, cand, p, q, tail_mode, V):
    """Append the leftover-mass bucket to both distributions."""
    q_tail = 1.0 - min(float(q.sum()), math.exp(-1e-7))  # TRL's clamp on the teacher side
    q = torch.cat([q, q.new_tensor([q_tail])])
    if tail_mode == "exact":
        if len(cand) == V:  # no leftover token at all: no tail on either side
            return p, q[:-1]
        outside = torch.ones(V, dtype=torch.bool, device=logp_row.device)
        outside[cand] = False
        p_tail = logp_row[outside].exp().sum()
    else:
        p_tail = 1.0 - torch.clamp(p.sum(), max=math.exp(-1e-7))
    return torch.cat([p, p_tail.reshape(1)]), q


def _divergence(p, q, beta):
    """Generalized JSD in probability space (TRL/GKD convention), β = 0 / 1 are the forward / reverse KL."""
    if beta == 0.0:
        return (torch.special.xlogy(q, q) - torch.special.xlogy(q, p)).sum()
    if beta == 1.0:
        return (torch.special.xlogy(p, p) - torch.special.xlogy(p, q)).sum()
    m = (1.0 - beta) * p + beta * q
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum()
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum()
    return beta * kl_qm + (1.0 - beta) * kl_pm


def reference_dense_teacher_jsd(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, *, student, teacher, beta,
                                mask=None, token_weights=None, teacher_index=None, num_teachers=1,
                                student_top_k=None):
    """Same contract as :func:`fastdistill.dense_teacher_jsd_loss` (``student`` / ``teacher`` are its ``Head``s):
    both distributions materialised as ``(N, V)`` probabilities, the divergence in probability space; O(N·V)."""
    any64 = torch.float64 in (s_hidden.dtype, s_weight.dtype, t_hidden.dtype, t_weight.dtype)
    dtype = torch.float64 if any64 else torch.float32
    V = s_weight.shape[0]

    def probs(h, w, b, head):
        x = h.to(dtype) @ w.to(dtype).t()
        if b is not None:
            x = x + b.to(dtype)
        x = x * head.scale
        if head.softcap is not None:
            x = head.softcap * torch.tanh(x / head.softcap)
        return torch.softmax(x / head.temperature, dim=-1)

    p = probs(s_hidden, s_weight, s_bias, student)
    q_full = probs(t_hidden, t_weight, t_bias, teacher)
    q_kept = q_full[:, :V].sum(dim=1)
    q = q_full[:, :V] / q_kept.unsqueeze(1)  # the teacher's mass on ids >= V is dropped, the rest renormalised
    rows = torch.arange(p.shape[0], device=p.device) if mask is None else mask.nonzero().squeeze(1)
    if student_top_k is not None:  # the student's top-k tokens (+ tails) with the teacher's log-probs on them
        ids = p[rows].topk(student_top_k, dim=1).indices
        cfg = LossConfig(logit_scale=student.scale, softcap=student.softcap, beta=beta,
                         temperature=student.temperature, add_tail_bucket=True, tail_mode="exact")
        out = reference_sparse_jsd(s_hidden[rows], s_weight, ids, q[rows].gather(1, ids).log(), ids >= 0,
                                   bias=s_bias, cfg=cfg, num_teachers=num_teachers,
                                   teacher_index=None if teacher_index is None else teacher_index[rows],
                                   token_weights=None if token_weights is None else token_weights[rows])
        return DenseJSDOutput(**vars(out), teacher_dropped_mass_sum=q_full[rows, V:].sum())
    p, q = p[rows], q[rows]
    div = _row_divergence(p, q, beta)
    weighted = div if token_weights is None else div * token_weights[rows].to(dtype)
    loss = weighted.sum() + 0.0 * p.sum()  # keeps the graph connected when nothing is scored
    ent = -torch.special.xlogy(p, p).sum(dim=1).detach()
    tent = -torch.special.xlogy(q, q).sum(dim=1)
    tidx = None if teacher_index is None else teacher_index[rows]
    return summarize_dense(loss, div.detach(), ent, tent, q_full[rows, V:].sum(dim=1), tidx, num_teachers)


def _row_divergence(p, q, beta):
    """Per-row generalized JSD of ``(n, V)`` probability rows, same convention as :func:`_divergence`."""
    def kl(a, b):
        return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b)).sum(dim=-1)

    if beta == 0.0:
        return kl(q, p)
    if beta == 1.0:
        return kl(p, q)
    m = (1.0 - beta) * p + beta * q
    return beta * kl(q, m) + (1.0 - beta) * kl(p, m)
