"""Triton helper shared by the forward and backward kernels: one fp32 tile of final student logits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def logit_tile(H, W, B, rows, cols, N, V, D, logit_scale, softcap, inv_temp,
               BLOCK_ROWS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """``z[rows, cols] = softcap(logit_scale · (h·Wᵀ + b)) · inv_temp`` as a ``(BLOCK_ROWS, BLOCK_VOCAB)`` fp32 tile.

    ``rows`` / ``cols`` are int64 index vectors; entries outside ``N`` / ``V`` are finite junk the caller masks.
    softcap(x) = c·tanh(x/c) is written c·(2·sigmoid(2x/c) − 1): libdevice is unavailable in the interpreter.
    """
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_VOCAB), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        h = tl.load(H + rows[:, None] * D + d[None, :], mask=(rows[:, None] < N) & (d[None, :] < D), other=0.0)
        w = tl.load(W + cols[None, :] * D + d[:, None], mask=(cols[None, :] < V) & (d[:, None] < D), other=0.0)
        if UPCAST:  # the interpreter computes on bf16 bit patterns as integers: convert first
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
    x = acc * logit_scale
    if HAS_SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0)
    return x * inv_temp
