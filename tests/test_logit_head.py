"""One logit head: the loss path's logits equal ``model(...).logits`` in float64 for every family the reader claims.

Each case builds a tiny random model of the family (1–2 layers, a 96-token vocabulary) with non-trivial head
settings, so a reader that ignored or inverted a setting would be off by whole logits; the oracle is the family's
own forward. Families the reader does not know but whose config looks like it changes the logits are refused.
"""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
import torch

from fastdistill.errors import ConfigError
from fastdistill.logit_head import (
    HEAD_RULES,
    LogitHead,
    causal_lm_logits,
    head_logits,
    logit_head_from_config,
)

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class path, extra config kwargs, the LogitHead the reader must give)
FAMILIES = {
    "llama": ("llama.LlamaConfig", {}, LogitHead(1.0, None)),
    "qwen2": ("qwen2.Qwen2Config", {}, LogitHead(1.0, None)),
    "qwen3": ("qwen3.Qwen3Config", {"head_dim": 8}, LogitHead(1.0, None)),
    "mistral": ("mistral.MistralConfig", {}, LogitHead(1.0, None)),
    "gemma2": ("gemma2.Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 0.7}, LogitHead(1.0, 0.7)),
    "gemma3_text": ("gemma3.Gemma3TextConfig", {"head_dim": 8, "final_logit_softcapping": 0.9},
                    LogitHead(1.0, 0.9)),
    "vaultgemma": ("vaultgemma.VaultGemmaConfig", {"head_dim": 8, "final_logit_softcapping": 0.8},
                   LogitHead(1.0, 0.8)),
    "cohere": ("cohere.CohereConfig", {"logit_scale": 0.37}, LogitHead(0.37, None)),
    "cohere2": ("cohere2.Cohere2Config", {"logit_scale": 2.5}, LogitHead(2.5, None)),
    "granite": ("granite.GraniteConfig", {"logits_scaling": 8.0, "embedding_multiplier": 3.0,
                                          "residual_multiplier": 0.5, "attention_multiplier": 0.2},
                LogitHead(1 / 8.0, None)),
    "granitemoe": ("granitemoe.GraniteMoeConfig", {"logits_scaling": 16.0, "num_local_experts": 2,
                                                   "num_experts_per_tok": 1}, LogitHead(1 / 16.0, None)),
    "hyperclovax": ("hyperclovax.HyperCLOVAXConfig", {"logits_scaling": 0.25}, LogitHead(0.25, None)),
    "falcon_h1": ("falcon_h1.FalconH1Config", {"lm_head_multiplier": 12.0, "mamba_d_ssm": 32, "mamba_n_heads": 4,
                                               "mamba_d_head": 8, "mamba_d_state": 8, "mamba_n_groups": 1,
                                               "mamba_chunk_size": 8, "head_dim": 8},
                  LogitHead(12.0, None)),
    "minicpm3": ("minicpm3.MiniCPM3Config", {"dim_model_base": 8, "q_lora_rank": 16, "kv_lora_rank": 8,
                                             "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                                             "num_key_value_heads": 4},
                 LogitHead(8 / 32, None)),
}


def _config(family: str):
    path, extra, _ = FAMILIES[family]
    module, name = path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {path}")
    return cls(**{**SMALL, **extra})


def _model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = {"attn_implementation": "eager"}
    if hasattr(config, "num_local_experts"):
        kwargs["experts_implementation"] = "eager"  # the grouped-GEMM experts take no float64
    model = AutoModelForCausalLM.from_config(config, **kwargs).double().eval()
    with torch.no_grad():  # a random head with logits of a few nats, so scale and cap both matter
        model.get_output_embeddings().weight.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_path_logits_equal_the_family_forward_in_float64(family):
    config = _config(family)
    head = logit_head_from_config(config)
    expected_head = FAMILIES[family][2]
    assert (head.scale, head.softcap) == pytest.approx((expected_head.scale, expected_head.softcap))
    model = _model(config)
    ids = torch.randint(3, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        ours = causal_lm_logits(model, ids, dtype=torch.float64)
    assert ours.dtype == torch.float64 and ours.shape == expected.shape
    # the two differ only in the rounding of a product or quotient by the scale: a few float64 ulps of |z|
    bound = 8 * EPS64 * float(expected.abs().max())
    assert float((ours - expected).abs().max()) <= bound
    # the settings matter on these models: a plain head is whole logits away
    if (head.scale, head.softcap) != (1.0, None):
        with torch.no_grad():
            plain = head_logits(model.base_model(input_ids=ids).last_hidden_state, model.get_output_embeddings().weight,
                                dtype=torch.float64)
        assert float((plain - expected).abs().max()) > 0.05


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_json_reads_like_the_config_object(family):
    """The hidden teacher reads a parsed config.json: the same head as from the config object."""
    config = _config(family)
    parsed = json.loads(config.to_json_string())
    assert logit_head_from_config(parsed) == logit_head_from_config(config)


def test_multimodal_configs_are_read_from_their_text_config():
    nested = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "final_logit_softcapping": 30.0}}
    assert logit_head_from_config(nested) == LogitHead(1.0, 30.0, "gemma3_text")
    top_level = {"model_type": "granite", "text_config": {"hidden_size": 8}, "logits_scaling": 4.0}
    assert logit_head_from_config(top_level).scale == 0.25


def test_granite_divides_and_hyperclovax_multiplies_the_same_attribute():
    assert logit_head_from_config({"model_type": "granite", "logits_scaling": 4.0}).scale == 0.25
    assert logit_head_from_config({"model_type": "hyperclovax", "logits_scaling": 4.0}).scale == 4.0


@pytest.mark.parametrize("settings,named", [
    ({"model_type": "minicpm", "dim_model_base": 256, "hidden_size": 2304}, "dim_model_base=256"),
    ({"model_type": "xlstm", "output_logit_soft_cap": 30.0}, "output_logit_soft_cap=30.0"),
    ({"model_type": "my_remote_llm", "logit_scale": 0.5}, "logit_scale=0.5"),
    ({"model_type": "phi3small", "mup_width_multiplier": 8.0}, "mup_width_multiplier=8.0"),
    ({"model_type": "my_remote_llm", "output_multiplier": 2.0}, "output_multiplier=2.0"),
    ({"model_type": "my_remote_llm", "text_config": {"lm_head_multiplier": 3.0}}, "lm_head_multiplier=3.0"),
])
def test_unknown_family_with_a_head_looking_setting_is_refused(settings, named):
    with pytest.raises(ConfigError, match=named) as error:
        logit_head_from_config(settings)
    assert "HEAD_RULES" in str(error.value) and settings["model_type"] in str(error.value)


def test_unknown_family_without_head_settings_is_plain():
    plain = {"model_type": "my_remote_llm", "hidden_size": 8, "attn_logit_softcapping": 50.0,
             "output_router_logits": True, "num_logits_to_keep": 1, "logit_scale": 1.0,
             "final_logit_softcapping": None, "router_logit_softcapping": 4.0}
    assert logit_head_from_config(plain) == LogitHead(1.0, None, "my_remote_llm")
    assert logit_head_from_config(SimpleNamespace(model_type="my_remote_llm")) == LogitHead(1.0, None,
                                                                                          "my_remote_llm")


@pytest.mark.parametrize("settings", [
    {"model_type": "cohere", "logit_scale": "0.5"},
    {"model_type": "cohere", "logit_scale": -1.0},
    {"model_type": "granite", "logits_scaling": float("inf")},
    {"model_type": "gemma2", "final_logit_softcapping": -3.0},
])
def test_bad_values_are_refused(settings):
    with pytest.raises(ConfigError, match=settings["model_type"]):
        logit_head_from_config(settings)


def test_every_rule_is_exercised_by_a_family_case_or_a_config_case():
    """No rule is claimed without a test: each family of HEAD_RULES is built above or read from a config here."""
    read_only = {"cohere2_moe", "granite_swa", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
                 "gemma3", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "nanochat", "recurrent_gemma"}
    assert set(HEAD_RULES) <= set(FAMILIES) | read_only
    for family in read_only:
        key = {"recurrent_gemma": "logits_soft_cap"}.get(family)
        if family.startswith("granite"):
            assert logit_head_from_config({"model_type": family, "logits_scaling": 2.0}).scale == 0.5
        elif family.startswith("cohere"):
            assert logit_head_from_config({"model_type": family, "logit_scale": 2.0}).scale == 2.0
        else:
            head = logit_head_from_config({"model_type": family, key or "final_logit_softcapping": 5.0})
            assert head.softcap == 5.0


def test_head_logits_against_a_float64_formula():
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = torch.randn(5, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(9, generator=g)
    head = LogitHead(1.7, 2.5)
    got = head_logits(hidden, weight, bias, head, temperature=0.8, dtype=torch.float64)
    raw = hidden.double() @ weight.double().t() + bias.double()
    expected = 2.5 * torch.tanh(1.7 * raw / 2.5) / 0.8
    torch.testing.assert_close(got, expected, rtol=4 * EPS64, atol=4 * EPS64 * float(expected.abs().max()))
    assert head_logits(hidden, weight).dtype == torch.float32
    assert head_logits(hidden.bfloat16(), weight.bfloat16()).dtype == torch.float32


def _scored_samples(vocab_size: int, count: int = 3):
    """Random prompts and completions with random top-3 teacher candidates (plus the realised token)."""
    import numpy as np

    from fastdistill.rollout import RolloutSample

    rng = np.random.default_rng(2)
    samples = []
    for index in range(count):
        prompt, completion = rng.integers(3, vocab_size, 4), rng.integers(3, vocab_size, 5)
        top = np.stack([rng.permutation(np.arange(3, vocab_size))[:3] for _ in completion])
        ids = np.concatenate([top, completion[:, None]], axis=1).astype(np.int32)
        lps = np.log(rng.dirichlet(np.ones(5), len(completion))[:, :4]).astype(np.float32)
        samples.append(RolloutSample(
            input_ids=np.concatenate([prompt, completion]).astype(np.int32),
            completion_mask=np.r_[np.zeros(4), np.ones(5)].astype(np.int32), teacher_topk_ids=ids,
            teacher_topk_logprobs=lps, rollout_logprobs=np.full(5, -1.0, np.float32), model_version=0,
            teacher_id="default", prompt_id=index, dataset_index=index))
    return samples


@pytest.mark.parametrize("family", ["granite", "falcon_h1", "gemma2", "cohere", "hyperclovax", "qwen3"])
def test_trainer_and_eval_losses_are_the_loss_on_the_family_logits(family):
    """The trainer's model (:class:`DistillationModel`) and evaluation (``divergence_per_token``) compute the loss on
    the logits the family's forward produces: the float64 reference loss on ``model(...).logits`` themselves (fed as
    hidden states through an identity head)."""
    from fastdistill.data.packing import pack_row
    from fastdistill.loss import narrow_support, sparse_jsd_loss
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.evaluate import divergence_per_token
    from fastdistill.train.model import DistillationModel

    model = _model(_config(family))
    samples = _scored_samples(SMALL["vocab_size"])
    config = AsyncDistillationConfig(model_name_or_path="student", loss_backend="reference")
    wrapped = DistillationModel(model, config)
    scale = 1.0
    for sample in samples:  # one sample per row: the eager attention of these tiny models does not unpack rows
        row = pack_row([sample], ["default"], vocab_size=SMALL["vocab_size"])
        ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(sample.input_ids[None]).long()).logits[0, 3:-1]
            expected = sparse_jsd_loss(logits, torch.eye(SMALL["vocab_size"], dtype=torch.float64), ids, lps, mask,
                                       backend="reference")
            out, _ = wrapped(row, ids, lps, mask)
        assert int(out.num_tokens) == int(expected.num_tokens) == 5
        assert abs(float(out.jsd_sum) - float(expected.jsd_sum)) <= 1e-9 * max(1.0, float(expected.jsd_sum))
        scale = max(scale, float(logits.abs().max()))
        # evaluation runs in float32: a few eps32 of the logits' scale per term
        per_token = divergence_per_token(model, [sample], ["default"])
        assert abs(per_token - float(expected.jsd_sum) / 5) <= 64 * EPS32 * scale


def test_weight_sync_check_compares_the_server_with_the_loss_path(monkeypatch):
    """``served_logprob_gap`` measures the server against the loss path's logits: a server that serves the Granite
    model exactly (its own forward's log-probs) shows no gap, and a loss path reading the head wrong (a plain head
    on Granite, as the student's loss did) shows one of whole nats."""
    import asyncio

    from aiohttp import web

    import fastdistill.logit_head as logit_head_module
    from fastdistill.sync import served_logprob_gap
    from fastdistill_testing.stubs import serve_and_call

    model = _model(_config("granite"))
    with torch.no_grad():
        served = {}
        for ids in ([5, 9, 14, 3, 40, 41], [7, 8, 60, 61]):
            served[tuple(ids)] = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
    model = model.float()

    async def handler(request):
        if request.method == "GET":
            return web.json_response({"data": [{"id": "granite"}]})
        ids = (await request.json())["prompt"]
        logprobs = served[tuple(ids)]
        positions = [None] + [{str(token): {"logprob": float(logprobs[i - 1, token])}} for i, token in
                              enumerate(ids) if i > 0]
        return web.json_response({"choices": [{"prompt_logprobs": positions}]})

    def gap() -> float:
        result = serve_and_call(handler, lambda url: asyncio.to_thread(served_logprob_gap, url, model, list(served)))
        assert isinstance(result, float), result
        return result

    assert gap() <= 1e-5
    monkeypatch.setattr(logit_head_module, "logit_head_from_config", lambda config: LogitHead())
    assert gap() > 0.5
