"""Model FLOPs utilisation of a training step: the useful matmul FLOPs it did (:class:`StepFlopsModel`, read once
from the model) in % of the accelerator's datasheet dense peak (:func:`peak_flops`; None on CPU and unknown devices:
no MFU rather than a made-up one). Useful work: linear layers 3× their forward when trained, 2× when frozen; the
lm_head on the trained positions only; mixture-of-experts experts at their top-k; attention over each packed
sample's causal pairs, within its window in a sliding-window layer; no recomputation (docs/train.md, "Where the
time goes", spells it out).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Dense peak FLOP/s per device for (bf16, fp16), from the vendors' datasheets; matched on the CUDA device name, first
# match wins.
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

MFU_FWD_BWD = "perf/mfu_fwd_bwd_datasheet"  # % of the datasheet peak over forward + backward seconds
MFU_WALL_CLOCK = "perf/mfu_wall_clock_datasheet"  # % of the datasheet peak over the step's wall-clock seconds
ATTENTION_PAIRS = "batch/attention_pairs_per_step"  # Σ L·(L+1)/2 over the step's samples (all ranks)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Datasheet dense peak FLOP/s of ``device`` for ``dtype`` (bf16 or fp16), or None (CPU, fp32, unknown)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, bf16, fp16 in _PEAKS:
        if re.search(rf"\b(?:{pattern})\b", name, flags=re.IGNORECASE):
            return bf16 if dtype == torch.bfloat16 else fp16
    return None


def causal_pairs(lengths: Iterable[int], window: int | None = None) -> int:
    """Query-key pairs of causal attention over samples of ``lengths`` tokens, each attending only to itself:
    ``Σ L·(L+1)/2``; with a sliding ``window`` each query sees at most ``window`` keys (itself included, Hugging
    Face's ``kv_idx > q_idx - sliding_window``): ``Σ_i min(i + 1, window)``."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be >= 1, got {window}")
    total = 0
    for length in lengths:
        if length < 0:
            raise ValueError(f"a sample length must be >= 0, got {length}")
        full = length if window is None else min(length, window)
        total += full * (full + 1) // 2 + (length - full) * (window or 0)
    return total


@dataclass(frozen=True)
class StepFlops:
    """A step's useful matmul FLOPs (forward + backward) by part: the blocks' linear layers, the lm_head on the
    trained positions, and attention over the causal pairs."""

    linear: float
    head: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.head + self.attention


@dataclass(frozen=True)
class StepFlopsModel:
    """Forward matmul FLOPs of one model, per unit of work: ``trainable_per_token`` / ``frozen_per_token`` (the
    blocks' linear layers whose weight trains / is frozen, per forwarded token; experts at their top-k),
    ``head_per_position`` (2·D·V, per trained position; ``head_trainable``) and ``attention_per_pair``
    (4·heads·head_dim·layers, per causal pair attended in every layer). ``layer_windows``: each layer's sliding
    window (None: full causal attention); empty for a model without one."""

    trainable_per_token: float
    frozen_per_token: float
    head_per_position: float
    head_trainable: bool
    attention_per_pair: float
    layer_windows: tuple[int | None, ...] = ()

    def attended_pairs(self, lengths: Iterable[int]) -> float:
        """The causal pairs the layers attend over samples of ``lengths``, averaged over the layers (the
        ``attention_pairs`` of :meth:`step`): :func:`causal_pairs` without a sliding window."""
        lengths = list(lengths)
        windows = self.layer_windows or (None,)
        per_window = {window: causal_pairs(lengths, window) for window in set(windows)}
        return sum(per_window[window] for window in windows) / len(windows)

    def step(self, forwarded_tokens: float, trained_tokens: float, attention_pairs: float) -> StepFlops:
        """Forward + backward FLOPs of a step that forwarded ``forwarded_tokens``, trained ``trained_tokens``
        positions and attended over ``attention_pairs`` causal pairs per layer (:meth:`attended_pairs`)."""
        if min(forwarded_tokens, trained_tokens, attention_pairs) < 0:
            raise ValueError("token and pair counts must be >= 0, got "
                             f"{forwarded_tokens}, {trained_tokens}, {attention_pairs}")
        return StepFlops(
            linear=forwarded_tokens * (3.0 * self.trainable_per_token + 2.0 * self.frozen_per_token),
            head=trained_tokens * self.head_per_position * (3.0 if self.head_trainable else 2.0),
            attention=3.0 * attention_pairs * self.attention_per_pair)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a linear weight: the global shape, also for an FSDP2-sharded DTensor."""
    out_features, in_features = weight.shape
    return int(out_features), int(in_features)


def _moe_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(block, experts)`` of every mixture-of-experts block: a module with an ``experts`` child (Hugging Face's
    name in Qwen-MoE, Mixtral, DeepSeek, OLMoE, gpt-oss)."""
    return [(module, module.experts) for module in model.modules()
            if isinstance(getattr(module, "experts", None), nn.Module)]


def _top_k(block: nn.Module, config: Any) -> int:
    for owner, name in ((config, "num_experts_per_tok"), (block, "top_k"), (getattr(block, "gate", None), "top_k")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(block).__name__} has experts but neither the config's num_experts_per_tok nor a top_k: "
                     "cannot count the experts a token is routed to")


def _expert_flops(block: nn.Module, experts: nn.Module, top_k: int) -> tuple[float, float, set[nn.Module]]:
    """Forward FLOPs per token of one MoE block's experts at ``top_k`` experts per token and its router, as
    (trainable, frozen), and the ``nn.Linear`` modules counted here. Experts as a list of modules (transformers 4)
    count each linear layer at ``top_k / E``; fused experts (transformers 5: ``(E, out, in)`` parameters) each
    3-D parameter's ``2·out·in`` ``top_k`` times; a router that is not an ``nn.Linear`` (``(E, D)`` weight) once."""
    trainable = frozen = 0.0
    counted: set[nn.Module] = set()
    if isinstance(experts, (nn.ModuleList, nn.Sequential)) and len(experts):
        share = top_k / len(experts)
        for module in experts.modules():
            if isinstance(module, nn.Linear):
                counted.add(module)
                out_features, in_features = _weight_shape(module.weight)
                flops = share * 2.0 * in_features * out_features
                trainable, frozen = (trainable + flops, frozen) if module.weight.requires_grad else (
                    trainable, frozen + flops)
    else:
        for parameter in experts.parameters():
            if parameter.dim() == 3:  # (E, out, in): one matmul per expert a token is routed to
                flops = top_k * 2.0 * parameter.shape[1] * parameter.shape[2]
                trainable, frozen = (trainable + flops, frozen) if parameter.requires_grad else (
                    trainable, frozen + flops)
    router = getattr(block, "gate", None) or getattr(block, "router", None)
    weight = getattr(router, "weight", None)
    if router is not None and not isinstance(router, nn.Linear) and isinstance(weight, torch.Tensor) and \
            weight.dim() == 2:
        flops = 2.0 * weight.shape[0] * weight.shape[1]
        trainable, frozen = (trainable + flops, frozen) if weight.requires_grad else (trainable, frozen + flops)
    return trainable, frozen, counted


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each decoder layer's sliding attention window (None: full causal attention) from a Hugging Face text config:
    its ``layer_types`` (``sliding_attention`` layers at ``sliding_window``), else ``sliding_window`` on every layer
    (Mistral), unless ``use_sliding_window`` is False (Qwen2). Empty when no layer has a window."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        windows = tuple(window if kind == "sliding_attention" and window else None for kind in types)
    elif window and getattr(config, "use_sliding_window", True):
        windows = (int(window),) * config.num_hidden_layers
    else:
        windows = ()
    return windows if any(w is not None for w in windows) else ()


def step_flops_model(model: nn.Module) -> StepFlopsModel:
    """The :class:`StepFlopsModel` of a Hugging Face causal LM (peft-wrapped or not, sharded or not): every
    ``nn.Linear`` but the output embedding counts per forwarded token (a LoRA layer's frozen base and its trainable
    adapters apart; a mixture-of-experts block's experts at the config's ``num_experts_per_tok``), the output
    embedding per trained position, attention from the config's layers, heads, head_dim and sliding windows."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head): not a causal LM")
    text = _text_config(model.config)
    trainable = frozen = 0.0
    in_experts: set[nn.Module] = set()
    for block, experts in _moe_blocks(model):
        block_trainable, block_frozen, counted = _expert_flops(block, experts, _top_k(block, text))
        trainable, frozen = trainable + block_trainable, frozen + block_frozen
        in_experts |= counted
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not head and module not in in_experts:
            out_features, in_features = _weight_shape(module.weight)
            if module.weight.requires_grad:
                trainable += 2.0 * in_features * out_features
            else:
                frozen += 2.0 * in_features * out_features
    vocab, hidden = _weight_shape(head.weight)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return StepFlopsModel(trainable_per_token=trainable, frozen_per_token=frozen,
                          head_per_position=2.0 * hidden * vocab, head_trainable=bool(head.weight.requires_grad),
                          attention_per_pair=4.0 * heads * head_dim * text.num_hidden_layers,
                          layer_windows=layer_windows(text))


def mfu_record(record: dict[str, float], flops_model: StepFlopsModel, peak: float | None,
               world_size: int, attended_pairs: float | None = None) -> dict[str, float]:
    """``perf/mfu_fwd_bwd_datasheet`` and ``perf/mfu_wall_clock_datasheet`` of a step's ``record``: its useful FLOPs
    (from its forwarded and trained tokens and its causal pairs, summed over ranks; ``attended_pairs`` per layer
    when a sliding window makes them fewer, see :meth:`StepFlopsModel.attended_pairs`) in % of ``world_size``
    devices' datasheet ``peak`` (FLOP/s per device) over its forward + backward and its wall-clock seconds, and
    ``perf/step_tflop``. Empty when the peak is unknown or the record lacks the counts (ranks other than 0)."""
    tokens = record.get("batch/forwarded_tokens_per_step", 0.0)
    pairs = record.get(ATTENTION_PAIRS) if attended_pairs is None else attended_pairs
    if peak is None or not tokens or pairs is None:
        return {}
    flops = flops_model.step(tokens, record.get("batch/trained_tokens_per_step", 0.0), pairs).total
    total_peak = peak * world_size
    return {"perf/step_tflop": flops / 1e12,
            MFU_FWD_BWD: 100.0 * flops / max(record["perf/fwd_bwd_s"], 1e-9) / total_peak,
            MFU_WALL_CLOCK: 100.0 * flops / max(record["perf/step_s"], 1e-9) / total_peak}


class StepMfu:
    """A run's MFU bookkeeping: ``model``'s :class:`StepFlopsModel` (read once, after LoRA is applied), the datasheet
    ``peak`` of each of the ``world_size`` devices (None: no MFU metrics)."""

    def __init__(self, model: nn.Module, peak: float | None, world_size: int):
        self.flops_model = step_flops_model(model)
        self.peak, self.world_size = peak, world_size

    def record(self, record: dict[str, float], window: Any = None) -> dict[str, float]:
        """``batch/attention_pairs_per_step`` of rank 0's step ``window`` (its ``microbatches[m][rank]`` sample lists:
        every rank's samples; None on the other ranks) and the :func:`mfu_record` metrics of the step's ``record``."""
        out: dict[str, float] = {}
        attended = None
        if window is not None:
            lengths = [len(sample.input_ids) for microbatch in window.microbatches for row in microbatch
                       for sample in row]
            out[ATTENTION_PAIRS] = float(causal_pairs(lengths))
            if self.flops_model.layer_windows:
                attended = self.flops_model.attended_pairs(lengths)
        out.update(mfu_record({**record, **out}, self.flops_model, self.peak, self.world_size, attended))
        return out
