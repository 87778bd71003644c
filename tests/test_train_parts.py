"""The trainer's parts, each alone: the weight-sync schedule, the step's statistics, the pipeline's assembly."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fastdistill.data import PromptTable
from fastdistill.errors import ConfigError
from fastdistill.rollout import OnPolicyShare, ServedModel
from fastdistill.train.checkpoint import RolloutState
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.evaluate import fitting_eval_rows
from fastdistill.train.pipeline import (
    limits_exceeded,
    long_prompt_drops,
    open_source,
    rollout_config,
)
from fastdistill.train.source import ListSource, SynchronousSource
from fastdistill.train.step import StepResult, StepStats, step_record
from fastdistill.train.syncing import WeightSyncSchedule
from fastdistill.train.timing import PhaseClock

TEACHERS = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}


def config(**overrides) -> AsyncDistillationConfig:
    values = dict(model_name_or_path="m", teacher_server_urls=TEACHERS, vllm_server_base_url="http://127.0.0.1:8")
    values.update(overrides)
    return AsyncDistillationConfig(**values)


class RecordingSync:
    def __init__(self):
        self.calls = []

    def init(self):
        self.calls.append("init")

    def push(self, model, version):
        self.calls.append(("push", version))
        return {"perf/weight_sync_s": 0.5}

    def close(self):
        self.calls.append("close")


def schedule(sync, **overrides) -> WeightSyncSchedule:
    clock = PhaseClock()
    clock.start()
    return WeightSyncSchedule(sync, config(**overrides), torch.nn.Linear(2, 2), clock=clock)


def test_the_schedule_syncs_at_start_and_every_weight_sync_steps():
    sync = RecordingSync()
    syncs = schedule(sync, weight_sync_steps=3)
    served, trained = [], []
    syncs.on_served = served.append
    syncs.on_trained = lambda step: trained.append((step, len(served)))
    assert syncs.start() == {"perf/weight_sync_s": 0.5} and syncs.model_version == 1
    records = [syncs.after_step(step) for step in range(1, 8)]
    assert [bool(r) for r in records] == [False, False, True, False, False, True, False]
    assert sync.calls == ["init", ("push", 1), ("push", 2), ("push", 3)] and served == [1, 2, 3]
    # every step is published, before its own sync (step 3 before version 2 is served)
    assert trained == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2), (7, 3)]
    with contextlib.ExitStack() as stack:
        syncs.close(stack)
    assert sync.calls[-1] == "close"


def test_an_overlapped_sync_pushes_in_the_background_and_reports_the_wait():
    sync = RecordingSync()
    syncs = schedule(sync, weight_sync_overlap=True)
    served = []
    syncs.on_served = served.append
    syncs.start()  # the cold sync is synchronous: version 1 is served before any rollout
    assert served == [1]
    first = syncs.sync()
    assert syncs.model_version == 2 and "perf/weight_sync_s" not in first and "perf/weight_sync_wait_s" in first
    second = syncs.sync()  # waits for the first background push and reports its timings
    assert second["perf/weight_sync_s"] == 0.5 and syncs.model_version == 3
    with contextlib.ExitStack() as stack:
        syncs.close(stack)
    assert served == [1, 2, 3] and sync.calls[-1] == "close"


def test_without_a_weight_sync_nothing_is_pushed_and_the_steps_are_still_published():
    assert schedule(None).start() == {} and schedule(None).sync() == {}
    syncs, trained = schedule(None), []
    syncs.on_trained = trained.append
    assert [syncs.after_step(step) for step in (1, 2)] == [{}, {}] and trained == [1, 2]


class SummingDist:
    """Two identical ranks: a sum over ranks doubles."""

    def all_reduce_sum(self, tensor):
        return tensor * 2


def test_step_stats_sum_over_ranks_and_make_the_record():
    stats = StepStats(2, tokens=10.0, jsd=5.0, entropy=2.0, teacher_entropy=1.0, forwarded_tokens=30.0,
                      trained_tokens=12.0, samples=3.0, folded=1.0,
                      per_teacher=torch.tensor([[6.0, 3.0, 0.6], [4.0, 2.0, 0.4]], dtype=torch.float64))
    summed = stats.all_reduced(SummingDist())
    assert (summed.tokens, summed.jsd, summed.samples, summed.folded) == (20.0, 10.0, 6.0, 2.0)
    assert summed.per_teacher.tolist() == [[12.0, 6.0, 1.2], [8.0, 4.0, 0.8]]
    record = step_record(StepResult(summed, 1.5, 2.0, 0.5, 1e-3, []), ["a", "b"], "jsd", model_version=4,
                         microbatches=2)
    assert record["loss"] == record["jsd"] == 0.5 and record["entropy"] == 0.2 and record["grad_norm"] == 1.5
    assert record["batch/samples_per_step"] == 6.0 and record["model_version"] == 4.0
    assert record["teacher_token_frac/a"] == 0.6 and record["teacher_jsd/b"] == 0.5
    assert record["perf/forwarded_tok_s_fwd_bwd"] == 30.0 and record["learning_rate"] == 1e-3


def test_the_rollout_settings_follow_the_config_and_the_resume_point():
    state = RolloutState()
    for prompt_id in (0, 1, 2, 5):
        state.add(prompt_id)
    share = OnPolicyShare(0.5)
    settings = rollout_config(
        config(teacher_signal={"b": "hidden"}, max_completion_length=7, top_k=0, request_timeout=12,
               lora_r=4, lora_sync="adapter"), world_size=2, rollout_state=state, total_prompts=40,
        skip_rows=frozenset({3}), on_policy=share, eos_ids=(2,), adapter_sync=True)
    assert settings.start_index == 3 and settings.skip_prompt_ids == {5} and settings.end_index == 40
    assert settings.teacher_signal("b") == "hidden" and settings.teacher_signal("a") == "topk"
    assert settings.max_tokens == 7 and settings.top_k == -1 and settings.retry.request_timeout_s == 12
    assert settings.student_model_for_version(3) == "fastdistill-student-v3" and settings.skip_rows == {3}


def test_the_start_up_checks_ask_the_servers_with_the_runs_request_timeout(monkeypatch):
    """check_servers builds its clients from the one client factory with the run's request_timeout (they used the
    default 600 s policy, whatever the run set), and asks every server through them."""
    from aiohttp import web

    import fastdistill.rollout.http as rollout_http
    from fastdistill.train.pipeline import check_servers
    from fastdistill_testing.stubs import serving

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(text="")
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})
        return web.json_response({"tokens": [len((await request.json())["prompt"])]})  # /tokenize

    timeouts = []
    real_send = rollout_http.send

    async def recording_send(*args, timeout_s, **kwargs):
        timeouts.append(timeout_s)
        return await real_send(*args, timeout_s=timeout_s, **kwargs)

    monkeypatch.setattr(rollout_http, "send", recording_send)
    with serving(handler) as url:
        served, widths = check_servers(config(vllm_server_base_url=url, teacher_server_urls={"a": url},
                                              request_timeout=7.5, vllm_server_api_key=None, teacher_api_keys=None))
    assert served["student"].max_model_len == 64 and served["a"].name == "m" and widths == {}
    assert len(timeouts) >= 2 and set(timeouts) == {7.5}  # /v1/models and /tokenize of both servers


def test_the_source_follows_the_run():
    state = RolloutState()
    assert isinstance(open_source(config(), world_size=1, samples=[], cache=None, offline=True, rows=None,
                                  rollouts=None, rollout_state=state, total_prompts=0, on_policy=None,
                                  model_version=0)[0], ListSource)
    rows = PromptTable.from_rows([{"prompt_ids": [1, 2], "teacher_id": "a"}])
    settings = rollout_config(config(), world_size=1, rollout_state=state, total_prompts=1, skip_rows=frozenset(),
                              on_policy=None, eos_ids=(), adapter_sync=False)
    source, worker = open_source(config(async_mode=False), world_size=1, samples=None, cache=None, offline=False,
                                 rows=rows, rollouts=settings, rollout_state=state, total_prompts=1, on_policy=None,
                                 model_version=1)
    assert isinstance(source, SynchronousSource) and worker is None
    source.close()


def test_length_limits_name_the_server_and_eval_rows_are_filtered_or_refused():
    served = {"student": ServedModel("s", 20), "a": ServedModel("a", 64), "b": ServedModel("b", 15)}
    assert limits_exceeded([10, 13, 10], ["a", "a", "b"], served, 8) == {1: ("student", 21, 20),
                                                                          2: ("teacher b", 19, 15)}
    # a teacher with its own tokenizer: its token counts are known per rollout only, the student's still bound
    assert limits_exceeded([10, 13, 10], ["a", "a", "b"], served, 8, own_tokenizer={"b"}) == {1: ("student", 21, 20)}
    rows = [{"prompt_ids": [1] * n, "teacher_id": t} for n, t in [(4, "a"), (13, "a")]]
    with pytest.raises(ConfigError, match="eval_dataset: 1 of 2 rows do not fit"):
        fitting_eval_rows(rows, ["a", "b"], served, config(max_completion_length=8))
    kept, left_out = fitting_eval_rows(rows, ["a", "b"], served, config(max_completion_length=8,
                                                                        skip_long_prompts=True))
    assert kept == rows[:1] and left_out == 1


def test_long_prompts_of_a_run_are_dropped_once_each():
    table = PromptTable.from_rows([{"prompt_ids": [1] * n, "teacher_id": "a"} for n in (4, 30, 5)])
    served = {"student": ServedModel("s", 20), "a": ServedModel("a", 64), "b": ServedModel("b", 64)}
    state = RolloutState()
    skip, drops = long_prompt_drops(table, ["a", "b"], served, config(skip_long_prompts=True, shuffle=False,
                                                                      max_completion_length=8),
                                    total_prompts=6, rollout_state=state, on_policy=None)
    assert skip == {1} and [d.prompt_id for d in drops] == [1, 4] and all(state.is_trained(p) for p in (1, 4))
    with pytest.raises(ConfigError, match="1 of 3 prompts do not fit the servers"):
        long_prompt_drops(table, ["a", "b"], served, config(max_completion_length=8), total_prompts=6,
                          rollout_state=RolloutState(), on_policy=None)
