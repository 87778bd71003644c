"""Model FLOPs utilisation: FLOPs per trained token and the accelerator's dense peak, where it is known.

``flops_per_token`` follows TRL 1.16's convention: forward + backward =
3 × forward, with ``L · (attention + MLP) + 2 · V · h`` forward FLOPs per token (attention scores counted for a
sequence of ``seq_len``). ``peak_flops`` returns None on CPU and on unknown accelerators, so MFU is simply not
logged there instead of being made up.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# Dense peak FLOP/s per device for (bf16, fp16); matched on the CUDA device name, first match wins.
_PEAKS: list[tuple[str, float | None, float | None]] = [
    (r"GB300|GB200", 2.5e15, None),
    (r"B300|B200", 2.25e15, None),
    (r"H100 NVL", 835e12, 835e12),
    (r"H100 PCIe", 756e12, 756e12),
    (r"H100", 989e12, 989e12),
    (r"H200 NVL", 835e12, 835e12),
    (r"H200", 989e12, 989e12),
    (r"H20", 148e12, 148e12),
    (r"A100", 312e12, 312e12),
    (r"A6000", 154.85e12, 154.85e12),
    (r"A10G|A10", 125e12, 125e12),
    (r"L40S", 362e12, 362e12),
    (r"L4", 121e12, 121e12),
]


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device`` for ``dtype`` (bf16 or fp16), or None (CPU, fp32, unknown device)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, bf16, fp16 in _PEAKS:
        if re.search(rf"\b(?:{pattern})\b", name, flags=re.IGNORECASE):
            return bf16 if dtype == torch.bfloat16 else fp16
    return None


def flops_per_token(config: Any, seq_len: float) -> float:
    """Training FLOPs per forwarded token of a dense decoder (forward + backward), TRL's formula."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    attention = 2 * h * (heads * head_dim + 2 * kv_heads * head_dim) + 2 * heads * head_dim * h
    attention += 4 * heads * head_dim * seq_len
    mlp = 6 * h * text.intermediate_size
    return 3.0 * (text.num_hidden_layers * (attention + mlp) + 2 * text.vocab_size * h)


def mfu_record(record: dict[str, float], model_config: Any, peak: float | None, world_size: int) -> dict[str, float]:
    """``perf/mfu_fwd_bwd`` and ``perf/mfu_wall_clock`` of a step's ``record`` in % of the devices' dense ``peak``
    (FLOP/s per device; None: unknown, no metrics), from its forwarded tokens and samples and its seconds."""
    tokens, samples = record.get("batch/forwarded_tokens_per_step", 0.0), record.get("batch/samples_per_step", 0.0)
    if peak is None or not tokens or not samples:
        return {}
    flops = flops_per_token(model_config, tokens / samples) * tokens
    total_peak = peak * world_size
    return {"perf/mfu_fwd_bwd": 100.0 * flops / max(record["perf/fwd_bwd_s"], 1e-9) / total_peak,
            "perf/mfu_wall_clock": 100.0 * flops / max(record["perf/step_s"], 1e-9) / total_peak}
