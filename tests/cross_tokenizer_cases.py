"""Tokenizers built in code for the cross-tokenizer tests: two byte-level BPEs with different corpora, vocabularies,
merges, special tokens and chat templates, and a lossy one (lowercasing, unknown-character fallback)."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fastdistill.tiny import build_tokenizer

TEACHER_CHAT_TEMPLATE = (
    "{{ '<bos>' }}{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TEACHER_SPECIAL = ["<pad>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
TEACHER_CORPUS = [
    "Hello there, how are you doing today? I am fine, thanks for asking.",
    "The teacher model answers questions about numbers: 12, 345, 6789.",
    "Emoji and accents: 🙂 🚀 café naïve Straße — done.",
    "def add(a, b):\n    return a + b\n",
    "Tokenizers disagree about where words split, so groups of tokens are aligned by bytes.",
]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? The answer is 5.",
    "Hello! How can I help you today?",
    "café naïve Straße 🙂🚀 — ok",
    "def add(a, b):\n    return a + b\n",
    "  leading spaces\tand tabs\n\nnew lines ",
    "中文字符 and 日本語",
]


@lru_cache(maxsize=1)
def student_tokenizer() -> PreTrainedTokenizerFast:
    """fastdistill's tiny byte-level BPE (ChatML template; specials <|endoftext|>, <|im_start|>, <|im_end|>)."""
    return build_tokenizer()


@lru_cache(maxsize=1)
def teacher_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on another corpus (other merges, 380 ids), a Gemma-style chat template and its own
    special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=TEACHER_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEACHER_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<end_of_turn>", chat_template=TEACHER_CHAT_TEMPLATE)


@lru_cache(maxsize=1)
def lossy_tokenizer() -> PreTrainedTokenizerFast:
    """A character BPE (not byte-level) that lowercases and maps unseen characters to <unk>: it cannot round-trip
    every text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"], show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>",
                                   chat_template=TEACHER_CHAT_TEMPLATE)


@lru_cache(maxsize=1)
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE as Hugging Face converts Llama 2's: ``▁`` for spaces (one put before the text),
    ``<0xNN>`` byte-fallback pieces for what its vocabulary lacks, and the matching decoder."""
    import json

    marker = "\u2581"
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=marker, prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trainer_tokenizer.train_from_iterator(TEACHER_CORPUS, trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=marker, prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(marker, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template=TEACHER_CHAT_TEMPLATE)
