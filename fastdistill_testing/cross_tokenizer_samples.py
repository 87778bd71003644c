"""Cross-tokenizer samples made in-process (no server), and the tokenizers the tests build them from.

Two byte-level BPEs with different corpora, vocabularies, merges, special tokens and chat templates
(:func:`student_tokenizer`: fastdistill's tiny one, ChatML; :func:`teacher_tokenizer`: 380 ids, a Gemma-style
template), a lossy one and a SentencePiece-style one. :func:`cross_tokenizer_sample` builds the
:class:`~fastdistill.rollout.RolloutSample` a cross-tokenizer teacher's rollout produces: the student's prompt (its
chat template) and completion ids, ``teacher_topk_*`` of shape (L, 0), and ``cross_targets`` from
:func:`~fastdistill.cross_tokenizer.build_targets` of a tiny Hugging Face teacher's float64 log-probs over the
teacher's own tokenization (its chat template's prompt, the completion text), in the wire layout (top-K by rank,
then the realised token when it is outside the top-K).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fastdistill.cross_tokenizer import (
    CrossTokenizerTargets,
    TokenizerBytes,
    VocabularyMap,
    build_targets,
    render_teacher_sequence,
)
from fastdistill.rollout.sample import RolloutSample
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

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


# ------------------------------------------------------------------------------------------ offline samples

MESSAGES = [{"role": "user", "content": "Say something."}]


def tiny_teacher_model(tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 1,
                       vocab_size: int | None = None) -> torch.nn.Module:
    """A randomly initialised tiny Qwen3 over ``tokenizer``'s vocabulary (default :func:`teacher_tokenizer`;
    ``vocab_size`` lm_head rows, default its length), float64, in eval mode."""
    tokenizer = tokenizer if tokenizer is not None else teacher_tokenizer()
    config = tiny_config(vocab_size or len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return build_model(config, seed=seed).double().eval()


def save_teacher_folder(path: str | Path, model: torch.nn.Module | None = None,
                        tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """A teacher folder (config with ``vocab_size``, weights, tokenizer) that
    :meth:`~fastdistill.cross_tokenizer.TokenizerPair.load` reads; returns its path."""
    tokenizer = tokenizer if tokenizer is not None else teacher_tokenizer()
    model = model if model is not None else tiny_teacher_model(tokenizer)
    return save_pretrained_dir(model, tokenizer, path)


@torch.no_grad()
def teacher_answer(model: torch.nn.Module, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                   top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's answer for its completion tokens in the wire layout: int64 ids and float64 log-probs,
    ``(Lt, K+1)`` each (top-K by rank, then the realised token when it is outside the top-K, else -1 / -inf),
    computed in float64."""
    completion = torch.as_tensor(list(completion_ids), dtype=torch.long)
    width = top_k + 1
    if completion.numel() == 0:
        return np.zeros((0, width), np.int64), np.zeros((0, width), np.float64)
    ids = torch.tensor([list(prompt_ids) + completion.tolist()])
    logits = model(ids, use_cache=False).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]  # position t predicts token t + 1
    top_logprobs, top_ids = logprobs.topk(top_k, dim=-1)
    in_top = (top_ids == completion[:, None]).any(dim=-1)
    extra_ids = torch.where(in_top, -1, completion)
    extra_lps = torch.where(in_top, float("-inf"), logprobs.gather(1, completion[:, None]).squeeze(1))
    return (torch.cat([top_ids, extra_ids[:, None]], dim=1).numpy().astype(np.int64),
            torch.cat([top_logprobs, extra_lps[:, None]], dim=1).numpy())


def cross_tokenizer_sample(text: str, *, teacher_model: torch.nn.Module, vocab: VocabularyMap, top_k: int,
                           student: TokenizerBytes | None = None, teacher: TokenizerBytes | None = None,
                           messages: Sequence[Mapping[str, Any]] = MESSAGES, teacher_id: str = "default",
                           prompt_id: int = 0, model_version: int = 0, rollout_logprobs: np.ndarray | None = None,
                           append_eos: bool = True, float64: bool = False) -> RolloutSample:
    """The sample a rollout of a cross-tokenizer teacher produces for the student completion ``text`` (as the
    student tokenizes it, plus its eos when ``append_eos``: a special token, excluded from the groups).

    ``vocab``: the pair's map (build it with the models' vocabulary sizes, as
    :meth:`~fastdistill.cross_tokenizer.TokenizerPair.load` does). ``student`` / ``teacher``: the tokenizers'
    bytes (default :func:`student_tokenizer` / :func:`teacher_tokenizer`). The targets are float32 as the wire's
    log-probs are (``float64=True`` keeps them float64, for tight oracles). ``rollout_logprobs``: (L,) float32,
    default -1.0 everywhere. Raises :class:`~fastdistill.errors.AlignmentError` for a text the two cannot align."""
    student = student if student is not None else TokenizerBytes.of(student_tokenizer())
    teacher = teacher if teacher is not None else TokenizerBytes.of(teacher_tokenizer())
    tokenizer = student.tokenizer
    completion = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if append_eos:
        completion.append(int(tokenizer.eos_token_id))
    prompt = [int(i) for i in tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                             tokenize=True, return_dict=False)]
    seq = render_teacher_sequence(student, teacher, messages, completion)
    cand, lps = teacher_answer(teacher_model, seq.prompt_ids, seq.completion_ids.tolist(), top_k)
    if not float64:
        lps = lps.astype(np.float32)
    targets = build_targets(seq.alignment, seq.completion_ids, cand, lps, vocab, top_k=top_k)
    length = len(completion)
    roll = np.full(length, -1.0, np.float32) if rollout_logprobs is None else np.asarray(rollout_logprobs,
                                                                                            np.float32)
    return RolloutSample(
        input_ids=np.asarray(prompt + completion, dtype=np.int32),
        completion_mask=np.concatenate([np.zeros(len(prompt), np.int32), np.ones(length, np.int32)]),
        teacher_topk_ids=np.zeros((length, 0), np.int32), teacher_topk_logprobs=np.zeros((length, 0), np.float32),
        rollout_logprobs=roll, model_version=model_version, teacher_id=teacher_id, prompt_id=prompt_id,
        dataset_index=prompt_id, metrics={"rollout/teacher_tokens": float(len(seq.completion_ids))},
        cross_targets=targets)


def cross_tokenizer_samples(texts: Sequence[str] = TEXTS, **kwargs: Any) -> list[RolloutSample]:
    """:func:`cross_tokenizer_sample` of every text (``prompt_id`` = its index); ``kwargs`` as there."""
    return [cross_tokenizer_sample(text, prompt_id=index, **kwargs) for index, text in enumerate(texts)]


def targets_of(samples: Sequence[RolloutSample]) -> list[CrossTokenizerTargets]:
    """The samples' ``cross_targets`` (ValueError for a sample without)."""
    missing = [s.prompt_id for s in samples if s.cross_targets is None]
    if missing:
        raise ValueError(f"samples {missing} carry no cross_targets")
    return [s.cross_targets for s in samples]
