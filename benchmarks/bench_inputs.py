"""Inputs of the kernel benchmark (``bench_kernels.py``): two distributions of the student's logits, and what each
looks like (mean entropy, tokens per row at p ≥ 2⁻¹², mean p_max).

- ``random``: hidden ~ N(0, 1), W ~ N(0, 1/D): low-magnitude logits (std ≈ 1), a nearly flat distribution, no
  token at p ≥ 2⁻¹², teacher log-probs of random logits over K + 1 spread-out candidate ids.
- ``peaked``: shaped like a trained model's: W ~ N(0, 0.02²), and each row's hidden state is the least-norm
  solution putting its target and four other ids (its first five candidates) at logits 14, 11, 10, 9, 8; every
  other logit is a near-zero background (std ≈ 0.4 at D = 3584). The teacher agrees on those five (log-probs of the
  same logits over its whole vocabulary, the rest of its mass in the tail). Its dense teacher (Liger, ours-dense) is
  the same hidden states sharpened by 1.1.
"""

from __future__ import annotations

import math

import torch

DISTRIBUTIONS = ("random", "peaked")
PEAK_LOGITS = (14.0, 11.0, 10.0, 9.0, 8.0)  # the target first
PEAKED_W_STD = 0.02
PEAKED_TEACHER_SHARPEN = 1.1
TEACHER_SEED = 1  # the random distribution's dense teacher hidden states
SOLVE_ROWS = 4096  # rows per batched least-norm solve (bounds its (rows, 5, D) fp32 temporary)
P_COUNT = 2.0**-12  # Cut Cross-Entropy's gradient filter threshold


def candidate_ids(N: int, S: int, V: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """``(N, S)`` ids, distinct within a row (S evenly spaced ids from a random start)."""
    if S > V:
        raise ValueError(f"K + 1 = {S} candidates do not fit a vocabulary of {V}")
    start = torch.randint(0, V, (N, 1), generator=g, device=device)
    return (start + torch.arange(S, device=device) * (V // S)) % V


def make_inputs(N: int, D: int, V: int, K: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                dist: str = "random"):
    """``(hidden (N, D), weight (V, D), ids (N, K+1), teacher log-probs (N, K+1), mask (N, K+1))``: hidden and
    weight are leaves in ``dtype`` that require grad; the teacher's probabilities sum to < 1 (the rest is its
    tail); the mask is all true."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    S = K + 1
    mask = torch.ones(N, S, dtype=torch.bool, device=device)
    if dist == "random":
        hidden = torch.randn(N, D, generator=g, device=device)
        weight = torch.randn(V, D, generator=g, device=device) / math.sqrt(D)
        ids = candidate_ids(N, S, V, g, device)
        lps = torch.log_softmax(2.0 * torch.randn(N, S + 1, generator=g, device=device), dim=1)[:, :S].contiguous()
    else:
        weight = (PEAKED_W_STD * torch.randn(V, D, generator=g, device=device)).to(dtype)
        ids = candidate_ids(N, S, V, g, device)
        peaks = torch.tensor(PEAK_LOGITS, device=device)[: min(S, len(PEAK_LOGITS))]
        hidden = least_norm_hidden(weight.float(), ids[:, : len(peaks)], peaks)
        target = torch.zeros(N, S, device=device)
        target[:, : len(peaks)] = peaks
        lse = torch.logsumexp(torch.cat([target, torch.full((N, 1), math.log(V - S), device=device)], 1), dim=1)
        lps = (target - lse[:, None]).contiguous()
    return (hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True), ids, lps, mask)


def least_norm_hidden(weight: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``(N, D)`` fp32 hidden states ``h`` of least norm with ``weight[ids[n]] @ h[n] = logits`` for every row."""
    out = torch.empty(ids.shape[0], weight.shape[1], device=weight.device)
    for r0 in range(0, ids.shape[0], SOLVE_ROWS):
        a = weight[ids[r0:r0 + SOLVE_ROWS]]  # (rows, P, D)
        gram = a @ a.transpose(1, 2)
        coef = torch.linalg.solve(gram, logits.expand(a.shape[0], -1).unsqueeze(2))
        out[r0:r0 + SOLVE_ROWS] = (a.transpose(1, 2) @ coef).squeeze(2)
    return out


def teacher_hidden(hidden: torch.Tensor, dtype: torch.dtype | None = None, dist: str = "random") -> torch.Tensor:
    """The dense teacher's hidden states (no gradient), rounded to ``dtype`` (default: hidden's), the same for every
    call: seeded normal ones (random), or ``hidden`` sharpened by 1.1 (peaked)."""
    dtype = dtype or hidden.dtype
    if dist == "peaked":
        return (hidden.detach().to(dtype).float() * PEAKED_TEACHER_SHARPEN).to(dtype)
    g = torch.Generator(device=hidden.device).manual_seed(TEACHER_SEED)
    return torch.randn(hidden.shape, generator=g, device=hidden.device).to(dtype)


@torch.no_grad()
def distribution_stats(hidden: torch.Tensor, weight: torch.Tensor, rows: int | None = None,
                       chunk_rows: int = 1024) -> dict:
    """The student's next-token distribution on the first ``rows`` rows (default all), from fp32 logits of the
    rounded inputs: mean entropy (nats), mean count of tokens with p ≥ 2⁻¹² per row, mean p_max."""
    n = hidden.shape[0] if rows is None else min(rows, hidden.shape[0])
    w = weight.detach().float()
    ent = count = pmax = 0.0
    for r0 in range(0, n, chunk_rows):
        logp = torch.log_softmax(hidden[r0:min(n, r0 + chunk_rows)].detach().float() @ w.t(), dim=1)
        p = logp.exp()
        ent += float(-(p * logp).sum())
        count += float((p >= P_COUNT).sum())
        pmax += float(p.max(dim=1).values.sum())
    n = max(1, n)
    return {"rows": n, "mean_entropy_nats": ent / n, "tokens_per_row_p_ge_2^-12": count / n, "mean_p_max": pmax / n}
