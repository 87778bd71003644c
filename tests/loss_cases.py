"""Random but realistic inputs for the loss tests: a dense teacher's top-K plus the realised token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdistill import narrow_support


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
