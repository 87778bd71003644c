"""The predicted cost split of one training step on an H200, per phase, at the benchmark's shapes and workload:
FLOPs / the matmul rate + bytes / the bandwidth, with the rates of ``roofline.H200_RECORDED`` (bf16 ``torch.mm``
measured on an H200; the copy bandwidth and the float32 rate from the datasheet) and the loss from ``roofline.py``,
the one home of the loss designs' costs. A prediction for the first GPU run of ``bench_train_step.py``, printed raw
and calibrated: the loss by its design's H200 factor (``roofline.calibration_factor``), the other phases by the
three bare GEMMs' factor (the only H200 factor of plain cuBLAS work; their memory-bound parts have none).

The loss, three ways, all with bf16 operands: the check's trainer is one rank FSDP2-sharded with bf16 mixed
precision, so the loss gets bf16 hidden states and a bf16 lm_head (an unsharded process under autocast casts them to
bf16 itself: ``train.model.loss_operands``): the fused kernels (``triton``, ``roofline.no_logits``, 8·N·D·V), the
chunked design (``triton-chunked``, ``roofline.chunked``, 6·N·D·V) and the torch path (``roofline.torch_path``).
Which one ``auto`` runs depends on what is validated where it runs (docs/loss.md).
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
LOSS_FUSED = "loss: triton (fused)"
LOSS_CHUNKED = "loss: triton-chunked"
LOSS_TORCH = "loss: torch"
LOSS_IMPLS = {LOSS_FUSED: "ours-det", LOSS_CHUNKED: "ours-chunked", LOSS_TORCH: "torch"}  # roofline designs
CALIBRATION_HEADS = {"qwen2.5-0.5b": "Qwen2.5-0.5B"}  # a shape whose lm_head the H200 measured (else the 7B head's)


def loss_costs(n: int, d: int, vocab: int) -> dict[str, roofline.Cost]:
    """The loss's three predicted costs at ``n`` trained positions (``roofline`` designs, K = :data:`TOP_K`, bf16)."""
    shape = roofline.Shape(N=n, D=d, V=vocab, K=TOP_K)
    return {name: roofline.impl_cost(impl, shape) for name, impl in LOSS_IMPLS.items()}


def phase_factor(shape: str, phase: str) -> float:
    """The H200 factor calibrating ``phase`` of ``shape``: a loss row's design factor at its head, else (and for
    the CE floor's loss: three GEMMs) the bare GEMMs'."""
    head = CALIBRATION_HEADS.get(shape)
    return roofline.calibration_factor(LOSS_IMPLS.get(phase, "gemms"), head)


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
    for name, p in out.items():
        p["ms_calibrated"] = p["ms"] * phase_factor(shape, name)
    return out


DESIGN_ROWS = {"triton": LOSS_FUSED, "triton-chunked": LOSS_CHUNKED, "torch": LOSS_TORCH}


def ce_loss_ms(shape: str, trained: float, calibrated: bool = False) -> float:
    """The cross-entropy floor's loss at ``trained`` positions: its three GEMMs plus its logits' traffic (ms; raw,
    or calibrated by the bare GEMMs' H200 factor)."""
    logits = trained * SHAPES[shape]["vocab_size"]
    ms = 1e3 * (6 * logits * SHAPES[shape]["hidden_size"] / RATES.matmul_flops
                + CE_LOGIT_BYTES * logits / RATES.copy_bytes)
    return ms * (phase_factor(shape, "gemms") if calibrated else 1.0)


def predicted_step_ms(shape: str, design: str, forwarded: float, trained: float, pairs: float,
                      calibrated: bool = False) -> float:
    """The predicted milliseconds of one step of ``shape`` that forwards ``forwarded`` tokens, trains ``trained``
    positions over ``pairs`` causal pairs, its loss run by ``design`` ("triton", "triton-chunked", "torch", or "ce":
    the cross-entropy floor), raw or ``calibrated``: the numbers printed beside a measured step."""
    key = "ms_calibrated" if calibrated else "ms"
    phases = predict(shape, {"forwarded": forwarded, "trained": trained, "pairs": pairs})
    common = sum(p[key] for name, p in phases.items() if not name.startswith("loss"))
    return common + (ce_loss_ms(shape, trained, calibrated) if design == "ce" else phases[DESIGN_ROWS[design]][key])


def prediction_table() -> str:
    """The markdown table of :func:`predict` at both shapes, every time raw and calibrated."""
    row = typical_row()
    lines = [f"Typical packed row: {row['forwarded']:.0f} forwarded tokens, {row['trained']:.0f} trained positions, "
             f"{row['pairs'] / 1e6:.2f} M causal pairs. Calibrated: the loss × its design's H200 factor, the rest × "
             "the bare GEMMs' (roofline.calibration_factor).", "",
             "| shape | phase | TFLOP | GB moved | predicted ms: raw / calibrated |", "|---|---|---:|---:|---:|"]
    for shape in TOP_K_SHAPES:
        phases = predict(shape, row)
        for name, p in phases.items():
            lines.append(f"| {shape} | {name} | {p['tflop']:.2f} | {p['gb']:.1f} | {p['ms']:.1f} / "
                         f"{p['ms_calibrated']:.1f} |")
        totals = {}
        for key, calibrated in (("ms", False), ("ms_calibrated", True)):
            common = sum(p[key] for name, p in phases.items() if not name.startswith("loss"))
            totals[key] = (common, ce_loss_ms(shape, row["trained"], calibrated))
        ce = totals["ms"][1], totals["ms_calibrated"][1]
        lines.append(f"| {shape} | CE floor's loss (3 GEMMs + logits traffic) | | | {ce[0]:.1f} / {ce[1]:.1f} |")
        for loss in (LOSS_FUSED, LOSS_CHUNKED, LOSS_TORCH):
            cells = []
            for key in ("ms", "ms_calibrated"):
                common, ce_ms = totals[key]
                step = common + phases[loss][key]
                cells.append(f"{step:.0f} (loss {100 * phases[loss][key] / step:.0f} %, ≈ "
                             f"{step / (common + ce_ms):.2f}× a CE step)")
            lines.append(f"| {shape} | step with {loss} | | | {cells[0]} / {cells[1]} |")
    return "\n".join(lines)
