"""Random but realistic inputs for the loss tests: a dense teacher's top-K plus the realised token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdistill import narrow_support
from fastdistill.loss.support import canonical_mask


@dataclass
class Case:
    hidden: torch.Tensor  # (N, D)
    weight: torch.Tensor  # (V, D)
    bias: torch.Tensor  # (V,)
    wide_ids: torch.Tensor  # (N, K+1), TRL wire format: top-K by rank, then the realised token if outside
    wide_lps: torch.Tensor  # (N, K+1)
    actual: torch.Tensor  # (N,)
    teacher_index: torch.Tensor  # (N,)

    def narrowed(self, beta: float):
        return narrow_support(self.wide_ids, self.wide_lps, self.actual, beta)

    def leaves(self, dtype=torch.float32, bias=True):
        """Fresh leaf copies (requires_grad) of hidden, weight and bias in ``dtype``."""
        h = self.hidden.to(dtype).detach().requires_grad_(True)
        w = self.weight.to(dtype).detach().requires_grad_(True)
        b = self.bias.to(dtype).detach().requires_grad_(True) if bias else None
        return h, w, b


def make_case(
    seed: int = 0,
    N: int = 24,
    D: int = 32,
    V: int = 160,
    K: int = 8,
    *,
    num_teachers: int = 2,
    pad_frac: float = 0.15,
    dup_frac: float = 0.1,
    empty_rows: int = 2,
    student_scale: float = 1.0,
) -> Case:
    """Float64 case with -1 padding, duplicated ids (same log-prob) and a few rows without teacher signal."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * (student_scale / D**0.5)
    bias = 0.1 * torch.randn(V, generator=g, dtype=torch.float64)
    teacher = torch.log_softmax(2.0 * torch.randn(N, V, generator=g, dtype=torch.float64), dim=-1)
    top_lps, top_ids = teacher.topk(K, dim=-1)
    actual = torch.multinomial(teacher.exp(), 1, generator=g).squeeze(1)
    outside = ~(top_ids == actual[:, None]).any(dim=1)
    extra_ids = torch.where(outside, actual, torch.full_like(actual, -1))
    extra_lps = torch.where(outside, teacher.gather(1, actual[:, None]).squeeze(1), torch.full_like(actual, -torch.inf,
                                                                                                    dtype=torch.float64))
    ids = torch.cat([top_ids, extra_ids[:, None]], dim=1)
    lps = torch.cat([top_lps, extra_lps[:, None]], dim=1)
    # random -1 padding (never slot 0, so most rows keep signal) and duplicates of an earlier slot
    pad = torch.rand(N, K + 1, generator=g) < pad_frac
    pad[:, 0] = False
    ids = torch.where(pad, torch.full_like(ids, -1), ids)
    lps = torch.where(pad, torch.full_like(lps, -torch.inf), lps)
    if K >= 2:
        dup = torch.rand(N, generator=g) < dup_frac
        ids[dup, K - 1] = ids[dup, 0]
        lps[dup, K - 1] = lps[dup, 0]
    for r in range(min(empty_rows, N)):
        ids[r * 5 % N] = -1
        lps[r * 5 % N] = -torch.inf
    teacher_index = torch.randint(num_teachers, (N,), generator=g)
    return Case(hidden, weight, bias, ids, lps, actual, teacher_index)


def rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Assert ``actual`` ≈ ``expected`` with an error relative to the largest entry of ``expected``."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: max error {float(err):.3e} relative to max |expected| {float(scale):.3e} > {rtol}"


def divergence_term_scale(hidden, weight, bias, logit_scale, softcap, ids, teacher_lps, mask, beta, temperature,
                          add_tail_bucket, *_) -> torch.Tensor:
    """(N,) float64: per row, Σ over the buckets of w·a·(1 + |log a| + |log b|) for each weighted KL(a‖b) that the
    β-divergence of TRL's ``_chunked_jsd_loss`` (same positional arguments) is made of — β=0: KL(p‖q), β=1: KL(q‖p),
    else β·KL(p‖m) + (1−β)·KL(q‖m) with m = βp + (1−β)q.

    These terms are far larger than the divergence itself when the student is close to the teacher, so an fp32
    evaluation of the divergence is only good to a few eps32 times this (see :func:`fp32_divergence_slack`)."""
    logits = hidden.detach().double() @ weight.detach().double().t()
    if bias is not None:
        logits = logits + bias.detach().double()
    logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    student = (logits / temperature).log_softmax(-1).gather(1, ids.long().clamp_min(0)).masked_fill(~mask, -torch.inf)
    teacher = teacher_lps.double().masked_fill(~mask, -torch.inf)
    if add_tail_bucket:
        def with_tail(lps):
            return torch.cat([lps, torch.log(-torch.expm1(lps.logsumexp(-1, keepdim=True).clamp(max=-1e-7)))], -1)

        student, teacher = with_tail(student), with_tail(teacher)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
    else:
        student, teacher = student.log_softmax(-1), teacher.log_softmax(-1)
    p, q = teacher.exp().where(mask, 0.0), student.exp().where(mask, 0.0)
    log_m = (beta * p + (1 - beta) * q).clamp_min(1e-300).log()
    kls = {0.0: [(1.0, p, teacher, student)], 1.0: [(1.0, q, student, teacher)]}.get(
        beta, [(beta, p, teacher, log_m), (1 - beta, q, student, log_m)])
    return sum((w * a * (1 + la.abs() + lb.abs())).where(mask, 0.0).sum(-1) for w, a, la, lb in kls)


def fp32_divergence_slack(term_scale: torch.Tensor) -> float:
    """Absolute slack between two fp32 evaluations of a mean divergence over rows with these term scales
    (:func:`divergence_term_scale`): 8·eps32 per unit, a handful of roundings per term (exp, mixture, log,
    difference, product, weighted sum) on each side."""
    return 8 * torch.finfo(torch.float32).eps * float(term_scale.mean()) if term_scale.numel() else 0.0


def row_log_scale(h, w, b, ids, lps, mask, chain: float = 1.0):
    """float64 ``(logp, q, scale)`` of the scored rows: the student's log-probs ``(N, V)`` at logits
    ``(h·Wᵀ + b)·chain``, the teacher's probabilities ``q`` ``(N, V)`` on its valid candidates, and each row's
    ``scale`` = 1 + its largest |logit|, |log-prob| (capped at 1e3), |log tail| and |teacher log-prob|: every
    dL/dz_v is at most (p_v + q_v)·scale·chain."""
    logits = (h.detach().double() @ w.detach().double().t() + b.detach().double()) * chain
    logp = logits.log_softmax(-1)
    valid = canonical_mask(ids, lps, mask)
    q = torch.zeros_like(logp).scatter_add_(1, ids.clamp_min(0), torch.where(valid, lps.double().exp(), 0.0))
    tail = (1 - q.sum(1)).clamp_min(1e-300)
    scale = 1 + logits.abs().amax(1) + logp.abs().amax(1).clamp_max(1e3) + tail.log().abs()
    return logp, q, scale + torch.where(valid, lps.double().abs(), 0.0).amax(1)


def half_gradient_bounds(hidden, weight, student_logprobs, teacher_probs, row_log_scale, chain, grads, dtype):
    """Element-wise bounds on |half-precision gradient − float64 reference| for (dh, dW, db), derived from the dtype.

    The kernels compute in fp32 from the half inputs (exact in fp32) and round each gradient once to ``dtype``: an
    entry is off by at most u·|exact| (u = 2^-8 for bfloat16, 2^-11 for float16) plus its fp32 error. Every entry of
    the logit gradient dL/dz_v is a probability (student p_v or teacher q_v) times log-probs of the row, so its fp32
    error is a few eps32 · (p_v + q_v) · L_n (L_n = ``row_log_scale``: 1 + the row's largest |log-prob| or |logit|)
    times ``chain`` (scale / temperature); dh = (dL/dz) W, dW = (dL/dz)ᵀ h and db = Σ_n dL/dz carry those errors
    through |W|, |h| and a sum. ``student_logprobs`` / ``teacher_probs`` are float64 (N, V) of the scored rows
    (teacher mass on the candidates' ids; a tail bucket's is spread like the student's), ``grads`` the float64
    reference gradients. Returns the three bound tensors, entry by entry."""
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    eps32 = torch.finfo(torch.float32).eps
    mass = student_logprobs.exp() + teacher_probs
    unit = 16 * eps32 * chain * row_log_scale[:, None] * mass
    h, w = hidden.detach().double().abs(), weight.detach().double().abs()
    ref_dh, ref_dw, ref_db = (g.detach().double().abs() for g in grads)
    return u * ref_dh + unit @ w, u * ref_dw + unit.t() @ h, u * ref_db + unit.sum(0)


def assert_elementwise(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """Assert |actual − expected| ≤ bound entry by entry (no normalisation by the largest entry)."""
    err = (actual.detach().double() - expected.detach().double()).abs()
    excess = err / bound.clamp_min(1e-300)
    worst = int(excess.argmax())
    assert bool((err <= bound).all()), (f"{what}: entry {worst} off by {float(err.flatten()[worst]):.3e} > bound "
                                        f"{float(bound.flatten()[worst]):.3e} (|expected| "
                                        f"{float(expected.flatten()[worst].abs()):.3e})")
