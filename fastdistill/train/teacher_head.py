"""The teacher's output head, loaded on its own from the teacher's checkpoint, for served hidden states.

A hidden-state teacher server (``fastdistill serve-teacher --signal hidden``) returns final hidden states; the
trainer turns them into the teacher's logits with the head loaded here: ``softcap(logit_scale * (hidden @
weight.T + bias))``, the scalars read from its config.json by the reader the student's head uses
(:func:`fastdistill.logit_head.logit_head_from_config`: each family's own rule, a ConfigError for a family whose
head it cannot reproduce). Only the head's tensors are read from the safetensors files, not the rest of the model.

:func:`teacher_head_folder` and :func:`load_hidden_teacher_head` are the rules the trainer and ``fastdistill eval``
share for a ``teacher_signal: hidden`` teacher: where its head comes from, that it covers the student's vocabulary,
and that its width is the width the server sends.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fastdistill.errors import ConfigError, TeacherHeadError
from fastdistill.logit_head import LogitHead, head_logits, logit_head_from_config

# Where checkpoints keep the output projection, and the input embedding a tied head reuses (first match wins).
HEAD_WEIGHT_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "embed_out.weight", "output.weight")
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                   "language_model.model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight",
                   "tok_embeddings.weight", "transformer.word_embeddings.weight")


@dataclass(frozen=True)
class TeacherHead:
    """The teacher's lm_head: ``weight`` (V, D), ``bias`` (V,) or None, and its :class:`LogitHead` scalars.

    ``tied`` says whether ``weight`` is the input embedding (``tie_word_embeddings``). V is the checkpoint's row
    count, which may exceed the tokenizer's vocabulary (padded embeddings).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    head: LogitHead
    tied: bool

    @property
    def logit_scale(self) -> float:
        """The scale of :attr:`head`."""
        return self.head.scale

    @property
    def softcap(self) -> float | None:
        """The softcap of :attr:`head` (None: none)."""
        return self.head.softcap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher logits (..., V) for final hidden states (..., D), computed in the head's dtype."""
        return head_logits(hidden, self.weight, self.bias, self.head, dtype=self.weight.dtype)

    def to(self, dtype: torch.dtype) -> TeacherHead:
        """The same head with its tensors in ``dtype``."""
        return dataclasses.replace(self, weight=self.weight.to(dtype),
                                   bias=None if self.bias is None else self.bias.to(dtype))


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _setting(config: dict[str, Any], key: str) -> Any:
    """``key`` from the text config when it has it, else from the top level (multimodal configs nest them)."""
    text = _text_config(config)
    return text[key] if key in text else config.get(key)


def head_settings(config: dict[str, Any]) -> tuple[LogitHead, bool | None]:
    """``(logit head, tie_word_embeddings)`` from a parsed config.json (the last None when absent); ConfigError
    from :func:`~fastdistill.logit_head.logit_head_from_config` for a head it cannot reproduce."""
    tied = _setting(config, "tie_word_embeddings")
    return logit_head_from_config(config), (None if tied is None else bool(tied))


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (a sharded checkpoint's index, or the one file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as reader:
            return {name: single for name in reader.keys()}
    found = sorted(p.name for p in folder.iterdir())
    raise TeacherHeadError(f"{folder} has no model.safetensors nor model.safetensors.index.json (it holds "
                           f"{found[:12]}); the teacher head is read from safetensors only")


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    path = files[name]
    if not path.is_file():
        raise TeacherHeadError(f"{path} (listed for {name}) does not exist")
    with safe_open(path, framework="pt") as reader:
        return reader.get_tensor(name)


def load_teacher_head(model_dir: str | Path, dtype: torch.dtype | None = torch.float32,
                      device: str | torch.device = "cpu") -> TeacherHead:
    """The output head of the Hugging Face checkpoint in ``model_dir``, reading only its tensors.

    The weight is the input embedding for a tied model (``tie_word_embeddings: true``), ``lm_head.weight`` (or
    another known head name) for an untied one, and without that setting the head when the checkpoint holds one,
    else the embedding; the bias is ``lm_head.bias`` when present. ``dtype`` casts the tensors (None keeps the
    checkpoint's); load it in the student's compute dtype (bfloat16 for a bf16 run), the dtype the dense loss uses
    on both sides. Raises :class:`TeacherHeadError` when the folder, its config.json, its safetensors or the head's
    tensors are missing, the shapes disagree, or the config's logit head cannot be reproduced.
    """
    folder = Path(model_dir)
    if not folder.is_dir():
        raise TeacherHeadError(f"teacher model folder {str(folder)!r} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise TeacherHeadError(f"{folder} has no config.json")
    config = json.loads(config_path.read_text())
    try:
        head, tied = head_settings(config)
    except ConfigError as error:
        raise TeacherHeadError(f"{folder}: {error}") from error
    files = _tensor_files(folder)
    # A tied model computes with its embedding (whatever else the checkpoint holds), an untied one with its head;
    # without the setting (each model class has its own default), the head when the checkpoint has one.
    if tied is True:
        candidates = EMBEDDING_NAMES + HEAD_WEIGHT_NAMES
    elif tied is False:
        candidates = HEAD_WEIGHT_NAMES
    else:
        candidates = HEAD_WEIGHT_NAMES + EMBEDDING_NAMES
    head_name = next((name for name in candidates if name in files), None)
    if head_name is None:
        raise TeacherHeadError(f"{folder}: no output head among the checkpoint's tensors (looked for "
                               f"{list(candidates)}; tie_word_embeddings={tied})")
    weight = _read(files, head_name)
    bias_name = next((name.removesuffix(".weight") + ".bias" for name in HEAD_WEIGHT_NAMES
                      if name.removesuffix(".weight") + ".bias" in files), None)
    bias = _read(files, bias_name) if bias_name is not None else None
    if weight.ndim != 2 or (bias is not None and bias.shape != weight.shape[:1]):
        raise TeacherHeadError(f"{folder}: head weight {tuple(weight.shape)} and bias "
                               f"{None if bias is None else tuple(bias.shape)} do not make a (V, D) head")
    hidden_size = _setting(config, "hidden_size")
    if hidden_size is not None and weight.shape[1] != int(hidden_size):
        raise TeacherHeadError(f"{folder}: head weight {tuple(weight.shape)} does not match hidden_size {hidden_size}")
    cast = {"dtype": dtype} if dtype is not None else {}
    return TeacherHead(
        weight=weight.to(device=device, **cast),
        bias=None if bias is None else bias.to(device=device, **cast),
        head=head,
        tied=head_name in EMBEDDING_NAMES,
    )


def cached_hub_snapshot(name: str) -> str | None:
    """The local folder of Hugging Face Hub model ``name`` (``org/model``) in the Hub cache (``HF_HUB_CACHE``; where
    a vLLM server on this machine stored it), or None when it is not a repo id or not cached. Nothing is
    downloaded."""
    if Path(name).is_absolute() or name.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # transformers brings huggingface_hub; without it there is no cache to look in
        return None
    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def teacher_head_folder(teacher_id: str, model_paths: Mapping[str, str] | None, served_name: str | None) -> str:
    """The local checkpoint folder of hidden-state teacher ``teacher_id``'s head: its ``teacher_model_paths`` entry,
    else ``served_name`` (the id its server reports at ``/v1/models``; None when no server is contacted) when that is
    a local folder; either may also be a Hub model id already in the local Hugging Face cache
    (:func:`cached_hub_snapshot`). Raises ConfigError saying what to set otherwise."""
    paths = model_paths or {}
    if teacher_id in paths:
        entry = paths[teacher_id]
        return entry if Path(entry).exists() else cached_hub_snapshot(entry) or entry  # a missing folder: named later
    if served_name is not None and Path(served_name).is_dir():
        return served_name
    cached = None if served_name is None else cached_hub_snapshot(served_name)
    if cached is not None:
        return cached
    where = (f"its server serves {served_name!r}, which is neither a local folder nor a model in this machine's "
             "Hugging Face cache" if served_name is not None else "no teacher server is contacted in this run")
    raise ConfigError(f"teacher {teacher_id!r} has teacher_signal 'hidden' but no teacher_model_paths entry, and "
                      f"{where}: set teacher_model_paths: {{{teacher_id!r}: <local checkpoint folder>}} (the "
                      "teacher's lm_head is read from it)")


def load_hidden_teacher_head(teacher_id: str, folder: str | Path, *, vocab_size: int, dtype: torch.dtype | None,
                             device: str | torch.device = "cpu", served_width: int | None = None) -> TeacherHead:
    """:func:`load_teacher_head` for hidden-state teacher ``teacher_id``, checked against what it must serve.

    ``vocab_size`` is the student's lm_head row count: a head with fewer rows cannot give the teacher's probability
    of every student token. ``served_width`` (when known) is the width D of the hidden states the teacher's server
    sends, which must equal the head's. Every failure is a ConfigError naming the teacher."""
    what = f"teacher {teacher_id!r} (teacher_signal 'hidden')"
    try:
        head = load_teacher_head(folder, dtype=dtype, device=device)
    except TeacherHeadError as error:
        raise ConfigError(f"{what}: {error}") from error
    rows, width = (int(n) for n in head.weight.shape)
    if rows < vocab_size:
        raise ConfigError(f"{what}: its lm_head in {folder} has {rows} vocabulary rows, fewer than the student's "
                          f"{vocab_size}; the dense loss needs the teacher's distribution over every student token")
    if served_width is not None and served_width != width:
        raise ConfigError(f"{what}: its server sends hidden states of width {served_width}, but its lm_head in "
                          f"{folder} takes width {width}: the server does not serve the checkpoint the head was read "
                          "from (check teacher_model_paths, or the model the teacher server was started with)")
    return head
