"""Tiny models and a tokenizer built entirely in code, for tests, local servers and the demo.

Nothing here touches a model hub: the tokenizer is a byte-level BPE trained on a few sentences, the models are
randomly initialised Qwen3 configurations small enough to train on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, EOS_TOKEN]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? The answer is 5.",
    "Count to 5: 1 2 3 4 5.",
    "Spell 'cat' backwards: tac.",
    "A student learns from a teacher, one token at a time.",
    "Hello! How can I help you today?",
    "Distillation matches the student's distribution to the teacher's.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18.",
]


def build_tokenizer(corpus: list[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` (a small built-in one by default) with a ChatML template.

    Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1), ``<|im_end|>`` (eos, id 2). Being
    byte-level, it encodes any text. ``vocab_size`` is an upper bound: a small corpus yields fewer merges.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus if corpus is not None else DEFAULT_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Qwen3Config:
    """A small Qwen3 configuration (untied lm_head, no KV cache by default, head_dim 32 as vLLM-CPU requires).

    ``use_cache=False`` matters for packed rows: with a cache, transformers skips its packed-sequence detection
    and lets samples attend to each other. Pass the tokenizer's pad/eos ids so generation stops at eos.
    """
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )


def build_model(config: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised :class:`Qwen3ForCausalLM` (SDPA attention); the same seed gives the same weights."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def save_pretrained_dir(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | Path
) -> Path:
    """Write a Hugging Face folder (config, safetensors weights, tokenizer, chat template) and return its path.

    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` reload it offline, and vLLM
    can serve it.
    """
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
