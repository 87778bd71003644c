"""The tiny in-code tokenizer and models, their save/reload round trip, and the packed-row attention trap."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastdistill.tiny import (
    EOS_TOKEN,
    IM_START,
    PAD_TOKEN,
    build_model,
    build_tokenizer,
    save_pretrained_dir,
    tiny_config,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return build_model(config, seed=0).eval()


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == [PAD_TOKEN, IM_START, EOS_TOKEN]
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 2
    assert 259 < len(tokenizer) <= 512  # 256 bytes + 3 specials, plus merges learnt from the corpus


def test_tokenizer_is_deterministic(tokenizer):
    again = build_tokenizer()
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_tokenizer_vocab_size_and_corpus_are_honoured():
    small = build_tokenizer(["aaaa bbbb aaaa bbbb"], vocab_size=262)
    assert len(small) == 262
    assert small("aaaa")["input_ids"] != build_tokenizer()("aaaa")["input_ids"]


@pytest.mark.parametrize("text", ["unseen-wörds ✓", "ZZZ 12345 !?", "  leading and trailing  ", "日本語 🙂\n\ttab"])
def test_tokenizer_round_trips_unseen_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40))
def test_tokenizer_round_trips_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert tokenizer.decode(ids) == prompt


def test_model_shape(tokenizer, model):
    config = model.config
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (32, 4, 2)
    assert config.vocab_size == len(tokenizer) and config.use_cache is False
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
    assert model.config._attn_implementation == "sdpa"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_build_model_is_seeded(tokenizer):
    config = tiny_config(len(tokenizer))
    first, same, other = build_model(config, seed=3), build_model(config, seed=3), build_model(config, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), same.parameters(), strict=True))
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_save_and_reload(tmp_path, tokenizer, model):
    path = save_pretrained_dir(model, tokenizer, tmp_path / "tiny")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    reloaded_model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    text = "Count to 5: 1 2 3 4 5, then unseen-wörds ✓"
    assert reloaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (reloaded_tokenizer.eos_token, reloaded_tokenizer.pad_token) == (EOS_TOKEN, PAD_TOKEN)
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(reloaded_model(ids).logits, model(ids).logits)


# Packed rows: samples concatenated with position_ids restarting at 0, no attention_mask, no cache.


def _samples(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=generator) for n in (7, 13, 5, 20)]


def _separate_hidden(model, samples) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.model(s[None], use_cache=False).last_hidden_state[0] for s in samples])


def _packed_hidden(model, samples, **kwargs) -> torch.Tensor:
    input_ids = torch.cat(samples)[None]
    with torch.no_grad():
        return model.model(input_ids, **kwargs).last_hidden_state[0]


def _restarting_positions(samples) -> torch.Tensor:
    return torch.cat([torch.arange(len(s)) for s in samples])[None]


def test_packed_row_equals_separate_runs(model):
    samples = _samples(model.config.vocab_size)
    packed = _packed_hidden(model, samples, position_ids=_restarting_positions(samples), use_cache=False)
    assert (packed - _separate_hidden(model, samples)).abs().max() < 1e-5


def test_packed_row_gradients_equal_separate_runs(model):
    samples = _samples(model.config.vocab_size)
    weight = model.lm_head.weight

    def grad_of(hidden):
        (grad,) = torch.autograd.grad(torch.log_softmax(hidden @ weight.T, dim=-1).max(dim=-1).values.sum(), weight)
        return grad

    packed = model.model(torch.cat(samples)[None], position_ids=_restarting_positions(samples), use_cache=False)
    separate = torch.cat([model.model(s[None], use_cache=False).last_hidden_state[0] for s in samples])
    assert (grad_of(packed.last_hidden_state[0]) - grad_of(separate)).abs().max() < 1e-5


def test_packing_trap_without_position_ids(model):
    """Control: without restarting position_ids the samples see each other, so the states differ."""
    samples = _samples(model.config.vocab_size)
    packed = _packed_hidden(model, samples, use_cache=False)
    assert (packed - _separate_hidden(model, samples)).abs().max() > 1e-2


def test_packing_trap_with_cache(model):
    """Control: with a KV cache transformers skips its packed-sequence detection, so the states differ."""
    samples = _samples(model.config.vocab_size)
    packed = _packed_hidden(model, samples, position_ids=_restarting_positions(samples), use_cache=True)
    assert (packed - _separate_hidden(model, samples)).abs().max() > 1e-2
