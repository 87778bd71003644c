"""The one HTTP layer (fastdistill.http_client): the error-body parser, the blocking wrapper, and that no request to a
server goes through a proxy set in the environment, for loopback and other addresses, on every path that talks to a
server (rollout clients, the weight sync's calls, the launcher's start-up wait)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fastdistill.http_client import (  # noqa: E402
    HTTPFailure,
    poll_until_healthy,
    request_json,
    request_json_blocking,
    run_blocking,
    server_message,
)
from fastdistill.rollout import RetryPolicy, StudentClient  # noqa: E402
from fastdistill.serve import free_port, wait_until_healthy  # noqa: E402
from fastdistill.sync.http import request as sync_request  # noqa: E402
from fastdistill.sync.verify import served_logprob_gap  # noqa: E402
from fastdistill_testing.stubs import interface_ipv4_addresses, serve_and_call, serving  # noqa: E402

PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
MODELS = {"data": [{"id": "student", "max_model_len": 64, "parent": None}]}
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=30.0)


async def models_and_health(request: web.Request) -> web.Response:
    if request.path == "/health":
        return web.Response(status=200)
    if request.path == "/v1/models":
        return web.json_response(MODELS)
    return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)


# ------------------------------------------------------------------------------------------------ the error parser


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}',
         "max_tokens is too large"),  # vLLM / OpenAI
        (b'{"detail": "Weight transfer not configured"}', "Weight transfer not configured"),  # FastAPI HTTPException
        (b'{"detail": [{"loc": ["body", "prompt"], "msg": "field required"}]}',
         '[{"loc": ["body", "prompt"], "msg": "field required"}]'),  # FastAPI validation error
        (b'{"message": "The model `x` does not exist."}', "The model `x` does not exist."),
        (b'{"error": "Unauthorized"}', "Unauthorized"),  # vLLM's and RequireAPIKey's 401
        (b"Internal Server Error\n", "Internal Server Error"),  # plain text
        (b'["a", "list"]', '["a", "list"]'),  # JSON that is no error object: its text
        (b"\xff\xfebad bytes", "\ufffd\ufffdbad bytes"),
        ("already text", "already text"),
    ],
)
def test_server_message_reads_every_error_body_shape(body, message):
    assert server_message(body) == message


def test_server_message_keeps_at_most_2000_characters():
    assert server_message("x" * 5000) == "x" * 2000
    assert server_message(json.dumps({"detail": "y" * 5000})) == "y" * 2000


# ------------------------------------------------------------------------------------------------ the wrapper


def test_blocking_requests_answer_decode_and_fail_with_the_server_message():
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/json":
            return web.json_response({"echo": await request.json()})
        if request.path == "/empty":
            return web.Response(status=200)
        if request.path == "/text":
            return web.Response(text="OK")
        return web.json_response({"detail": "no such route"}, status=404)

    with serving(handler) as url:
        assert request_json_blocking("POST", url + "/json", {"a": 1}, timeout_s=30) == {"echo": {"a": 1}}
        assert request_json_blocking("POST", url + "/empty", timeout_s=30) is None
        assert request_json_blocking("GET", url + "/text", timeout_s=30) == "OK"
        with pytest.raises(HTTPFailure) as failure:
            request_json_blocking("GET", url + "/missing", timeout_s=30)
        assert failure.value.status == 404 and failure.value.message == "no such route"
    with pytest.raises(HTTPFailure) as failure:
        request_json_blocking("GET", f"http://127.0.0.1:{free_port()}/x", timeout_s=30)
    assert failure.value.status is None and failure.value.message.startswith("no answer (")


def test_the_blocking_wrapper_works_inside_a_running_event_loop():
    async def inside() -> int:
        async def seven() -> int:
            await asyncio.sleep(0)
            return 7

        return run_blocking(seven)  # a blocking call from async code: runs in a helper thread's loop

    assert asyncio.run(inside()) == 7


def test_poll_until_healthy_says_exited_before_polling_and_timeout_without_time():
    with serving(models_and_health) as url:
        assert asyncio.run(poll_until_healthy(url, alive=lambda: True, timeout_s=30)) == "healthy"
        assert asyncio.run(poll_until_healthy(url, alive=lambda: False, timeout_s=30)) == "exited"
    assert asyncio.run(poll_until_healthy(url, alive=lambda: True, timeout_s=0)) == "timeout"


# ------------------------------------------------------------------------------------------------ proxies


@pytest.fixture
def dead_proxy(monkeypatch) -> str:
    """Every proxy variable points at a port nothing listens on; nothing is exempt (no_proxy unset)."""
    proxy = f"http://127.0.0.1:{free_port()}"
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    return proxy


def test_the_dead_proxy_stops_a_client_that_honours_it(dead_proxy):
    """The oracle of the tests below: a client that follows the variables (urllib) cannot reach a loopback server."""
    with serving(models_and_health) as url:
        with pytest.raises(urllib.error.URLError):  # a new opener: urlopen's reads the variables once per process
            urllib.request.build_opener().open(url + "/health", timeout=30)


def test_the_launcher_wait_reaches_a_loopback_server_despite_a_proxy(dead_proxy):
    with serving(models_and_health) as url:
        assert wait_until_healthy(url, alive=lambda: True, timeout_s=30) == "healthy"


def test_weight_sync_calls_reach_a_loopback_server_despite_a_proxy(dead_proxy):
    with serving(models_and_health) as url:
        assert sync_request("GET", url, "/v1/models", timeout_s=30) == MODELS
        assert request_json_blocking("GET", url + "/v1/models", timeout_s=30) == MODELS


def test_rollout_clients_reach_a_loopback_server_despite_a_proxy(dead_proxy):
    async def call(url: str):
        async with StudentClient(url, retry=FAST_RETRY) as client:
            await client.wait_until_healthy(timeout_s=30, poll_interval_s=0.05)
            return await client.served_model()

    served = serve_and_call(models_and_health, call)
    assert not isinstance(served, Exception), served
    assert served.name == "student" and served.max_model_len == 64


def test_requests_to_another_address_of_this_machine_skip_the_proxy_too(dead_proxy):
    others = [address for address in interface_ipv4_addresses() if not address.startswith("127.")]
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with serving(models_and_health, host=others[0]) as url:
        assert wait_until_healthy(url, alive=lambda: True, timeout_s=30) == "healthy"
        assert sync_request("GET", url, "/v1/models", timeout_s=30) == MODELS


def test_a_bearer_key_never_reaches_a_proxy(monkeypatch):
    """A live proxy that records what it is sent: the weight-sync and rollout calls carrying a key bypass it."""
    seen: list[str] = []

    async def recording_proxy(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.url} {request.headers.get('Authorization')}")
        return web.Response(status=502)

    async def keyed(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer the-key":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await models_and_health(request)

    with serving(recording_proxy) as proxy, serving(keyed) as url:
        for name in PROXY_VARIABLES:
            monkeypatch.setenv(name, proxy)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        assert sync_request("GET", url, "/v1/models", timeout_s=30, api_key="the-key") == MODELS

        async def rollout_call() -> object:
            async with StudentClient(url, retry=FAST_RETRY, api_key="the-key") as client:
                return (await client.served_model()).name

        assert asyncio.run(rollout_call()) == "student"
    assert seen == []


def test_a_verify_call_reaches_the_server_despite_a_proxy(dead_proxy):
    """served_logprob_gap's HTTP side (the model side is tested with real servers): its first request, the served
    model's name, arrives; the stub then refuses the completion and the error is the server's own message."""
    import torch

    from fastdistill.sync import WeightSyncError

    model = torch.nn.Linear(1, 1)
    with serving(models_and_health) as url:
        with pytest.raises(WeightSyncError, match="no route /v1/completions"):
            served_logprob_gap(url, model, [[1, 2]])


def test_request_json_sends_the_key_only_as_a_bearer_header():
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"authorization": request.headers.get("Authorization")})

    async def call(url: str):
        return [await request_json("GET", url + "/x", timeout_s=30, api_key=key) for key in (None, "k-1")]

    assert serve_and_call(echo, call) == [{"authorization": None}, {"authorization": "Bearer k-1"}]


def test_the_http_layer_imports_no_torch():
    """The rollout worker's child imports it: it must stay light."""
    import subprocess
    import sys

    code = "import sys, fastdistill.http_client; print('torch' in sys.modules)"
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "False"
