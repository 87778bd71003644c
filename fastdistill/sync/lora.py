"""What a weight sync sends of a LoRA student: the merged weights, streamed one tensor at a time, or the adapter alone.

``lora_sync="merged"`` (default): the server keeps serving a plain model; every sync sends ``W + scaling · B A`` for
each adapted layer under the base model's Hugging Face names, so no LoRA support is needed in vLLM and nothing
changes in the weight-transfer path. The merge is computed on the fly, one tensor at a time as the sync streams it
(:func:`merged_weights`), without modifying the trained weights.

``lora_sync="adapter"``: only the adapter travels (:func:`adapter_weights`, then :func:`save_adapter` writes a PEFT
folder that vLLM loads with ``/v1/load_lora_adapter``; see :mod:`fastdistill.sync.adapter`).

With FSDP2 every tensor is gathered with ``full_tensor()`` (collective: every rank iterates in lockstep).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from fastdistill.sync.naming import NamedTensors
from fastdistill.sync.transport import TensorSpec

PEFT_PREFIX = "base_model.model."


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else tensor).detach()


def _base_name(name: str) -> str:
    """A peft parameter name as the base model's Hugging Face name."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def _base_parameters(peft_model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, param) for name, param in peft_model.named_parameters() if ".lora_" not in name]


def merged_weight_manifest(peft_model: nn.Module) -> list[TensorSpec]:
    """Names, dtypes and full shapes of what :func:`merged_named_weights` yields, in order, without merging."""
    return [TensorSpec(_base_name(name), p.dtype, tuple(p.shape)) for name, p in _base_parameters(peft_model)]


@torch.no_grad()
def merged_named_weights(peft_model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of the base model with every active adapter merged in: ``W + scaling · B @ A``.

    A generator: each merged tensor is computed when the consumer asks for it, so no more than one exists at a time
    unless the consumer keeps them. Names are the base model's (``model.layers.0.self_attn.q_proj.weight``); adapter
    parameters are not yielded. Unmerged tensors are detached views of the parameters, not copies."""
    from peft.tuners.lora import LoraLayer  # peft is optional (`fastdistill[lora]`): only LoRA runs need it

    layers = {name: module for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}
    for name, param in _base_parameters(peft_model):
        tensor = _full(param)
        if name.endswith(".base_layer.weight"):
            layer = layers[name.removesuffix(".base_layer.weight")]
            for adapter in layer.active_adapters:
                if adapter not in layer.lora_A:
                    continue
                delta = _full(layer.lora_B[adapter].weight) @ _full(layer.lora_A[adapter].weight)
                tensor = tensor + layer.scaling[adapter] * delta.to(tensor.dtype)
                del delta
        yield _base_name(name), tensor
        del tensor


def merged_weights(peft_model: nn.Module) -> NamedTensors:
    """The merged weights as a stream for :meth:`VLLMWeightSync.push`: each push merges one tensor at a time."""
    return NamedTensors.stream(lambda: merged_named_weights(peft_model), merged_weight_manifest(peft_model))


@dataclass(frozen=True)
class AdapterWeights:
    """The trained adapter at one moment: ``tensors`` named as PEFT saves them
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, full shapes, cloned) and the adapter's
    ``config`` (a peft ``LoraConfig``)."""

    tensors: dict[str, torch.Tensor]
    config: Any

    @property
    def num_bytes(self) -> int:
        """Bytes of the tensors (what the safetensors file holds, less its small header)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())


@torch.no_grad()
def adapter_weights(peft_model: nn.Module, adapter: str = "default") -> AdapterWeights:
    """A copy of ``peft_model``'s ``adapter`` (the LoRA A and B matrices only), gathered to full tensors.

    Collective under FSDP2: every rank must call it (each gathers every tensor, like the merged path does); the
    copy is independent of later training steps."""
    from peft.utils import get_peft_model_state_dict  # optional, as above

    gathered = {name: _full(param).clone() for name, param in peft_model.named_parameters()
                if ".lora_" in name and f".{adapter}." in name}
    tensors = get_peft_model_state_dict(peft_model, state_dict=gathered, adapter_name=adapter)
    return AdapterWeights({name: tensor.contiguous() for name, tensor in tensors.items()},
                          peft_model.peft_config[adapter])


def save_adapter(weights: AdapterWeights, path: str | Path) -> Path:
    """Write ``weights`` as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) at
    ``path``, atomically: into a temporary folder next to it, then renamed, so a reader sees all of it or nothing.
    An existing folder at ``path`` is replaced. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        weights.config.save_pretrained(str(temporary))
        save_file(weights.tensors, str(temporary / "adapter_model.safetensors"), metadata={"format": "pt"})
        if path.exists():
            shutil.rmtree(path)
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return path
