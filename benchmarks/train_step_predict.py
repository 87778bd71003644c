"""The predicted cost split of one training step on an H200, per phase, at the benchmark's shapes and workload:
FLOPs / the matmul rate + bytes / the bandwidth, with the rates of ``roofline.H200_RECORDED`` (bf16 ``torch.mm``
measured on an H200; the copy bandwidth and the float32 rate from the datasheet) and the loss from ``roofline.py``,
the one home of the loss designs' costs. A prediction for the first GPU run of ``bench_train_step.py``.

The loss, three ways, all with bf16 operands: the check's trainer is one rank FSDP2-sharded with bf16 mixed
precision, so the loss gets bf16 hidden states and a bf16 lm_head (an unsharded process under autocast casts them to
bf16 itself: ``train.model.loss_operands``). ``auto`` picks the fastest design whose kernels a GPU check has
validated as they are today: the fused kernels (``triton``, ``roofline.no_logits``, 8·N·D·V) until the next GPU check
records the current chunked kernels; then ``triton-chunked`` (``roofline.chunked``, 6·N·D·V); ``torch``:
``roofline.torch_path``.
Bytes per phase (≈, bf16 activations, float32 master weights, FSDP2 on one rank: its all-gather and reduce-scatter
are copies): forward casts each float32 weight to its bf16 copy and reads it (8 B/param) plus ≈ (16·D + 6·I)·2 B of
activations per token and layer; backward gathers the bf16 copy again (8 B/param), twice the activations, and the
weight gradient (bf16 written, cast to the float32 reduce dtype and copied by the reduce-scatter: 2 + 6 + 8 B/param);
AdamW (float32, foreach) reads weight, gradient and both moments and writes three (28 B/param); gradient clipping
reads and scales the gradients (12 B/param, in "the rest"). The cross-entropy floor's loss (bf16 logits): the three
GEMMs plus its (N, V) logits' traffic (16 B per logit).
"""

from __future__ import annotations

import numpy as np
import roofline
from train_step_parts import SHAPES, WORKLOADS

RATES = roofline.H200_RECORDED
CE_LOGIT_BYTES = 16  # the floor's logits: bf16 written, float32 copy written and read by softmax, its gradient
TOP_K_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
TOP_K = 8
LOSS_AUTO = "loss: auto → triton (fused, validated)"
LOSS_CHUNKED = "loss: triton-chunked (auto's once validated)"
LOSS_TORCH = "loss: torch"


def loss_costs(n: int, d: int, vocab: int) -> dict[str, roofline.Cost]:
    """The loss's three predicted costs at ``n`` trained positions (``roofline`` designs, K = :data:`TOP_K`, bf16)."""
    shape = roofline.Shape(N=n, D=d, V=vocab, K=TOP_K)
    return {LOSS_AUTO: roofline.no_logits(shape), LOSS_CHUNKED: roofline.chunked(shape),
            LOSS_TORCH: roofline.torch_path(shape)}


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
    phases = {
        "backbone_fwd": (2 * linear_params * t + attention, 8 * params + activations),
        "backbone_bwd": (4 * linear_params * t + 2 * attention, 24 * params + 2 * activations),
        "optimizer": (0.0, 28 * params),
        "rest (grad clip)": (0.0, 12 * params),
    }
    out = {name: {"tflop": flops / 1e12, "gb": nbytes / 1e9,
                  "ms": 1e3 * (flops / RATES.matmul_flops + nbytes / RATES.copy_bytes)}
           for name, (flops, nbytes) in phases.items()}
    for name, cost in loss_costs(int(n), d, vocab).items():
        out[name] = {"tflop": cost.gemm_flops / 1e12, "gb": cost.bytes / 1e9, "ms": 1e3 * cost.predicted_s(RATES)}
    return out


DESIGN_ROWS = {"triton": LOSS_AUTO, "triton-chunked": LOSS_CHUNKED, "torch": LOSS_TORCH}


def ce_loss_ms(shape: str, trained: float) -> float:
    """The cross-entropy floor's loss at ``trained`` positions: its three GEMMs plus its logits' traffic (ms)."""
    logits = trained * SHAPES[shape]["vocab_size"]
    return 1e3 * (6 * logits * SHAPES[shape]["hidden_size"] / RATES.matmul_flops
                  + CE_LOGIT_BYTES * logits / RATES.copy_bytes)


def predicted_step_ms(shape: str, design: str, forwarded: float, trained: float, pairs: float) -> float:
    """The predicted milliseconds of one step of ``shape`` that forwards ``forwarded`` tokens, trains ``trained``
    positions over ``pairs`` causal pairs, its loss run by ``design`` ("triton", "triton-chunked", "torch", or "ce":
    the cross-entropy floor): the number printed beside a measured step."""
    phases = predict(shape, {"forwarded": forwarded, "trained": trained, "pairs": pairs})
    common = sum(p["ms"] for name, p in phases.items() if not name.startswith("loss"))
    return common + (ce_loss_ms(shape, trained) if design == "ce" else phases[DESIGN_ROWS[design]]["ms"])


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
        ce_ms = ce_loss_ms(shape, row["trained"])
        lines.append(f"| {shape} | CE floor's loss (3 GEMMs + logits traffic) | | | {ce_ms:.1f} |")
        for loss in (LOSS_AUTO, LOSS_CHUNKED, LOSS_TORCH):
            step = common + phases[loss]["ms"]
            floor = common + ce_ms
            share = 100 * phases[loss]["ms"] / step
            lines.append(f"| {shape} | step with {loss} | | | {step:.0f} (loss {share:.0f} %, ≈ {step / floor:.2f}× a "
                         "CE step) |")
    return "\n".join(lines)
