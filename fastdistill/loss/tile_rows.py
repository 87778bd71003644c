"""Per-row reductions over ``(c, V)`` tiles of the dense-teacher torch path, in row blocks so that their temporaries
stay a block, not a tile: 16 rows on the CPU, 128 MiB worth on a GPU (few, large blocks: each costs launches)."""

from __future__ import annotations

import math

import torch

from .chunked import scratch_rows


def block_rows(x: torch.Tensor) -> int:
    """Rows per block of the per-row reductions over a ``(c, V)`` tile: 16 on the CPU, 128 MiB worth on a GPU
    (:func:`fastdistill.loss.chunked.scratch_rows`)."""
    return scratch_rows(x.shape[1] or 1, x.dtype, x.device.type == "cuda")


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row dot product of two ``(c, V)`` tiles, in row blocks (:func:`block_rows`; a block-sized temporary).
    Products summed by ``torch.sum``, whose cascade summation keeps the fp32 error near eps whatever V; a batched
    matmul's running sum drifts with V (~1e-5 relative at V = 32768)."""
    out = torch.empty(a.shape[0], dtype=a.dtype, device=a.device)
    step = block_rows(a)
    for i in range(0, a.shape[0], step):
        out[i : i + step] = (a[i : i + step] * b[i : i + step]).sum(dim=1)
    return out


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Per-row log-sum-exp of a ``(c, V)`` tile in row blocks (``torch.logsumexp`` would allocate ``(c, V)``
    temporaries inside its kernel)."""
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    step = block_rows(x)
    for i in range(0, x.shape[0], step):
        xb = x[i : i + step]
        m = xb.amax(dim=1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        out[i : i + step] = m + torch.log(torch.exp(xb - m.unsqueeze(1)).sum(dim=1))
    return out


def rowdot_exp_diff(log_a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row Σ exp(log_a)·(log_a − b), in row blocks so the temporaries stay small."""
    out = torch.empty(log_a.shape[0], dtype=log_a.dtype, device=log_a.device)
    step = block_rows(log_a)
    for i in range(0, log_a.shape[0], step):
        block = log_a[i : i + step]
        out[i : i + step] = (torch.exp(block) * (block - b[i : i + step])).sum(dim=1)
    return out


def log_mixture(s: torch.Tensor, t: torch.Tensor, beta: float, *, out: torch.Tensor) -> torch.Tensor:
    """``log((1−β)·e^s + β·e^t)`` into ``out`` by log-sum-exp mixing, finite for finite s and t (no log of an
    underflowed mixture): with a = s + log(1−β), b = t + log β, ``log m = b + relu(a − b) + log1p(exp(−|a − b|))``.
    The log1p term goes through a row-block scratch, so no second ``(c, V)`` tile is needed."""
    a_off, b_off = math.log1p(-beta), math.log(beta)
    torch.sub(s, t, out=out).add_(a_off - b_off)
    step = block_rows(out)
    for i in range(0, out.shape[0], step):
        d = out[i : i + step]
        soft = d.abs().neg_().exp_().log1p_()
        d.clamp_(min=0.0).add_(soft)
    return out.add_(t).add_(b_off)
