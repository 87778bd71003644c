"""LoRA training (``lora_r > 0``): adapters on the student's linear layers, and the merged model's export.

What a weight sync sends of a LoRA student lives in :mod:`fastdistill.sync.lora`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from fastdistill.sync.lora import merged_named_weights


def apply_lora(model: nn.Module, *, r: int, alpha: float, dropout: float, target_modules: Any) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (peft). The output embedding (lm_head) must not be a target: the fused loss
    reads its weight directly."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("lora_r > 0 needs the peft package: pip install 'fastdistill[lora]'") from error
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                  target_modules=target_modules, task_type="CAUSAL_LM"))
    if hasattr(peft_model.get_base_model().get_output_embeddings(), "lora_A"):
        raise ValueError("lora_target_modules must not include the output embedding (lm_head)")
    return peft_model


def export_merged(peft_model: nn.Module, tokenizer: Any, path: str | Path, is_main: bool) -> Path | None:
    """A Hugging Face folder of the merged model at ``path``, written by rank 0 (collective under FSDP2: every rank
    gathers and merges each tensor in turn). Streamed: rank 0 moves each merged tensor to its CPU as it comes and the
    other ranks drop it, so no rank ever holds the whole merged model on its device. Returns ``path`` on rank 0,
    None elsewhere."""
    state = {}
    for name, tensor in merged_named_weights(peft_model):
        if is_main:
            state[name] = tensor.cpu()
        del tensor  # the device copy goes before the next one is gathered
    if not is_main:
        return None
    path = Path(path)
    peft_model.get_base_model().save_pretrained(path, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
