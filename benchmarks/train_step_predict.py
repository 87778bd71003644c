"""The predicted cost split of one training step on an H200, per phase, at the benchmark's shapes and workload:
FLOPs / the bf16 matmul rate measured on an H200 + bytes / its bandwidth (datasheet), and the loss from its own
H200 measurements. A prediction for the first GPU run of ``bench_train_step.py`` to be read against.

Rates: bf16 matmul 750 TFLOP/s (``torch.mm`` measured on an H200: 737-775); float32 matmul 67 TFLOP/s (datasheet,
TF32 off as torch leaves it); HBM 4.8 TB/s (datasheet). Neither datasheet rate was measured.
The loss, three ways. ``auto`` picks ``triton-chunked`` on a validated GPU; the one-process trainer runs under bf16
autocast with float32 master weights, and the backbone's last norm returns float32, so the loss gets float32 hidden
states and a float32 lm_head: its chunked logits GEMM (``torch.mm(..., out=)``, which autocast leaves alone) and its
two backward GEMMs then run in float32 (6·N·D·V at the float32 rate), unless the hidden states and the head are cast
to bf16 first (then 1.27-1.30× three bare bf16 GEMMs, as measured on an H200). ``torch``: 2,725-2,895 ms at
N = 16,384 trained positions, V = 152,064 on an H200 (bf16 inputs), ≈ 1.1 ns per position and vocabulary entry.
Bytes per phase (≈, bf16 activations, float32 master weights under autocast): forward reads each float32 weight and
writes and reads its bf16 copy (8 B/param) plus ≈ (16·D + 6·I)·2 B of activations per token and layer; backward
twice the activations plus the weight gradient (bf16 product, float32 accumulation: 10 B/param); AdamW (float32,
foreach) reads weight, gradient and both moments and writes three (28 B/param); gradient clipping reads and scales
the gradients (12 B/param, in "the rest"). The cross-entropy floor's loss (autocast: bf16 logits): the three GEMMs
plus its (N, V) logits' traffic (16 B per logit).
"""

from __future__ import annotations

import numpy as np
from train_step_parts import SHAPES, WORKLOADS

MATMUL_RATE = 750e12
FP32_MATMUL_RATE = 67e12
BANDWIDTH = 4.8e12
TORCH_LOSS_S_PER_LOGIT = 2.81 / (16384 * 152064)
CHUNKED_OVER_GEMMS = 1.285
CE_LOGIT_BYTES = 16  # the floor's logits: bf16 written, float32 copy written and read by softmax, its gradient
TOP_K_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
LOSS_FP32 = "loss: auto → triton-chunked, float32 inputs (the one-process trainer today)"
LOSS_BF16 = "loss: triton-chunked, bf16 inputs"
LOSS_TORCH = "loss: torch"


def typical_row(seed: int = 0, rows: int = 400) -> dict[str, float]:
    """Mean forwarded tokens, trained tokens and causal pairs of a packed row of the GPU workload (samples drawn as
    the benchmark's cache draws them, packed in order up to the token budget)."""
    workload = WORKLOADS["gpu"]
    rng = np.random.default_rng(seed)
    forwarded, trained, pairs, row = [], [], [], []
    for _ in range(rows * 8):
        p = int(rng.integers(workload.prompt[0], workload.prompt[1] + 1))
        c = int(rng.integers(workload.completion[0], workload.completion[1] + 1))
        if sum(a + b for a, b in row) + p + c > workload.token_budget:
            forwarded.append(sum(a + b for a, b in row))
            trained.append(sum(b for _, b in row))
            pairs.append(sum((a + b) * (a + b + 1) / 2 for a, b in row))
            row = []
        row.append((p, c))
    return {"forwarded": float(np.mean(forwarded)), "trained": float(np.mean(trained)), "pairs": float(np.mean(pairs))}


def predict(shape: str, row: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per phase: FLOPs, bytes and predicted ms (FLOPs at the matmul rate + bytes at the bandwidth)."""
    c = SHAPES[shape]
    d, inter, layers, heads, kv = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                                   c["num_attention_heads"], c["num_key_value_heads"])
    head_dim, vocab = d // heads, c["vocab_size"]
    linear_params = layers * (2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * inter)
    params = linear_params + vocab * d  # tied embeddings: one (V, D) matrix
    t, n, pairs = row["forwarded"], row["trained"], row["pairs"]
    attention = 4 * heads * head_dim * layers * pairs
    activations = t * layers * (16 * d + 6 * inter) * 2
    gemms = 6 * n * d * vocab
    phases = {
        "backbone_fwd": (2 * linear_params * t + attention, 8 * params + activations),
        LOSS_FP32: (gemms, 0.0),
        LOSS_BF16: (gemms, 0.0),
        LOSS_TORCH: (gemms, 0.0),
        "backbone_bwd": (4 * linear_params * t + 2 * attention, 10 * params + 2 * activations),
        "optimizer": (0.0, 28 * params),
        "rest (grad clip)": (0.0, 12 * params),
    }
    out = {}
    for name, (flops, nbytes) in phases.items():
        ms = 1e3 * (flops / MATMUL_RATE + nbytes / BANDWIDTH)
        if name == LOSS_TORCH:
            ms = 1e3 * TORCH_LOSS_S_PER_LOGIT * n * vocab
        elif name == LOSS_BF16:
            ms = 1e3 * CHUNKED_OVER_GEMMS * gemms / MATMUL_RATE
        elif name == LOSS_FP32:
            ms = 1e3 * gemms / FP32_MATMUL_RATE
        out[name] = {"tflop": flops / 1e12, "gb": nbytes / 1e9, "ms": ms}
    return out


def prediction_table() -> str:
    """The markdown table of :func:`predict` at both shapes."""
    row = typical_row()
    lines = [f"Typical packed row: {row['forwarded']:.0f} forwarded tokens, {row['trained']:.0f} trained positions, "
             f"{row['pairs'] / 1e6:.2f} M causal pairs.", "",
             "| shape | phase | TFLOP | GB moved | predicted ms |", "|---|---|---:|---:|---:|"]
    for shape in TOP_K_SHAPES:
        phases = predict(shape, row)
        for name, p in phases.items():
            lines.append(f"| {shape} | {name} | {p['tflop']:.2f} | {p['gb']:.1f} | {p['ms']:.1f} |")
        common = sum(p["ms"] for name, p in phases.items() if not name.startswith("loss"))
        logits = row["trained"] * SHAPES[shape]["vocab_size"]
        ce_loss_ms = 1e3 * (6 * logits * SHAPES[shape]["hidden_size"] / MATMUL_RATE
                            + CE_LOGIT_BYTES * logits / BANDWIDTH)
        lines.append(f"| {shape} | CE floor's loss (3 GEMMs + logits traffic) | | | {ce_loss_ms:.1f} |")
        for loss in (LOSS_FP32, LOSS_BF16, LOSS_TORCH):
            step = common + phases[loss]["ms"]
            floor = common + ce_loss_ms
            share = 100 * phases[loss]["ms"] / step
            lines.append(f"| {shape} | step with {loss} | | | {step:.0f} (loss {share:.0f} %, ≈ {step / floor:.2f}× a "
                         "CE step) |")
    return "\n".join(lines)
