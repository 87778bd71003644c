"""Rollout worker against stub vLLM servers (aiohttp, in a thread of the test process) and its pure helpers."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import queue
import signal
import threading
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fastdistill.rollout.child import RolloutLoop  # noqa: E402
from fastdistill.rollout.config import RolloutConfig  # noqa: E402
from fastdistill.rollout.dropped import DroppedPrompt  # noqa: E402
from fastdistill.rollout.http import RetryPolicy  # noqa: E402
from fastdistill.rollout.order import epoch_order, prompt_cursor, row_of_prompt  # noqa: E402
from fastdistill.rollout.sequence import is_clipped  # noqa: E402
from fastdistill.rollout.worker import RolloutWorker  # noqa: E402
from fastdistill.serve import free_port  # noqa: E402

FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=30.0)
TOP_K = 2
# For a loaded machine: a deadline only keeps a broken test from hanging (the assertions are on events, never on
# how fast they came), and where staleness is not what a test checks the heartbeat limit only reports a child
# that stopped running.
DEADLINE_S = 120.0
HEALTHY_S = 60.0


class StubServer:
    """An aiohttp app on 127.0.0.1:<free port>, served from a background thread; ``completion(body)`` answers
    ``POST /v1/completions`` with (status, JSON body)."""

    def __init__(self, name: str, completion):
        self.name = name
        self.completion = completion
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.requests = 0  # POST /v1/completions received
        self.model_queries = 0  # GET /v1/models received

    async def models(self, request: web.Request) -> web.Response:
        self.model_queries += 1
        return web.json_response({"data": [{"id": self.name, "max_model_len": 512}]})

    async def completions(self, request: web.Request) -> web.Response:
        self.requests += 1
        status, body = await self.completion(await request.json())
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type="application/json")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)  # do not wait for slow handlers
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> StubServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(DEADLINE_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(DEADLINE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class PoolingStub(StubServer):
    """``POST /pooling``: float32 rows [token, position, 0.5] for every input position."""

    async def pooling(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["task"] == "token_embed" and body["embed_dtype"] == "float32"
        tokens = body["input"]
        rows = np.array([[t, i, 0.5] for i, t in enumerate(tokens)], dtype="<f4")
        return web.json_response({"data": [{"data": base64.b64encode(rows.tobytes()).decode()}]})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/pooling", self.pooling)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


def student_completion(prompt: list[int]) -> list[int]:
    """The stub student's deterministic completion of ``prompt``: 3 tokens derived from its first token."""
    return [prompt[0] + 100, prompt[0] + 101, 2]


def student_stub(fail_500=(), fail_400=(), delay_s: float = 0.0):
    """Student /v1/completions: HTTP 500 (forever) or 400 for prompts whose first token is listed, else 200."""

    async def complete(body):
        await asyncio.sleep(delay_s)
        first = body["prompt"][0]
        if first in fail_500:
            return 500, {"error": {"message": "engine crashed"}}
        if first in fail_400:
            return 400, {"error": {"message": "context too long"}}
        tokens = student_completion(body["prompt"])
        return 200, {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": [-0.5] * len(tokens)}}]}

    return complete


def teacher_stub(tag: int):
    """Teacher prompt_logprobs: at every position, candidate ``tag`` at rank 1 and the realised token at rank 50."""

    async def score(body):
        sequence = body["prompt"]
        assert body["prompt_logprobs"] == TOP_K and body["max_tokens"] == 1
        entries = [None] + [
            {str(tag): {"logprob": -0.25, "rank": 1}, str(token): {"logprob": -4.0, "rank": 50}}
            for token in sequence[1:]
        ]
        return 200, {"choices": [{"prompt_logprobs": entries}]}

    return score


def dataset(num_rows: int, teacher_ids=("math", "code")) -> list[dict]:
    return [
        {"prompt_ids": [10 + i, 5, 6], "teacher_id": teacher_ids[i % len(teacher_ids)], "prompt": f"row {i}"}
        for i in range(num_rows)
    ]


def config(student: StubServer, teachers: dict[str, StubServer], **overrides) -> RolloutConfig:
    settings = dict(teacher_top_k=TOP_K, max_tokens=8, max_inflight_tasks=4, retry=FAST_RETRY, seed=7)
    settings.update(overrides)
    return RolloutConfig(student.url, {name: server.url for name, server in teachers.items()}, **settings)


def collect_first_epoch(worker: RolloutWorker, expected: int, timeout_s: float = DEADLINE_S) -> dict[int, object]:
    """Samples with prompt_id < ``expected`` (the first epoch), keyed by prompt_id."""
    found = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < expected:
        worker.check_health(stale_after_s=HEALTHY_S)
        assert time.monotonic() < deadline, f"only {sorted(found)} arrived"
        try:
            sample = worker.samples.get(timeout=0.5)
        except queue.Empty:
            continue
        if sample.prompt_id < expected:
            found[sample.prompt_id] = sample
    return found


def drain_metrics(worker: RolloutWorker, until=bool, timeout_s: float = DEADLINE_S) -> list[dict]:
    """The metric payloads queued now, and more until ``until(payloads)`` holds (by default: there is one). The
    child pushes a rollout's metrics just after its sample, so they can trail the samples already taken."""
    metrics: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            metrics.append(worker.metrics_queue.get(timeout=0.1))
            continue
        except queue.Empty:
            if until(metrics):
                return metrics
        assert time.monotonic() < deadline, f"timed out waiting for metrics; got {metrics}"
        worker.check_health(stale_after_s=HEALTHY_S)


@pytest.fixture
def servers():
    with (
        StubServer("student", student_stub(fail_500={12}, fail_400={14})) as student,
        StubServer("math-teacher", teacher_stub(tag=1000)) as math,
        StubServer("code-teacher", teacher_stub(tag=2000)) as code,
    ):
        yield student, {"math": math, "code": code}


# ------------------------------------------------------------------------------------------------ pure helpers


def test_epoch_order_is_a_seeded_permutation_per_epoch():
    first = epoch_order(50, seed=3, epoch=0)
    assert sorted(first.tolist()) == list(range(50))
    assert np.array_equal(first, epoch_order(50, seed=3, epoch=0))
    assert not np.array_equal(first, epoch_order(50, seed=3, epoch=1))
    assert not np.array_equal(first, epoch_order(50, seed=4, epoch=0))
    assert np.array_equal(epoch_order(5, seed=3, epoch=0, shuffle=False), np.arange(5))


def test_cursor_resumes_where_it_left_off_across_epochs():
    full = list(itertools.islice(prompt_cursor(7, seed=1), 30))
    assert [prompt_id for prompt_id, _ in full] == list(range(30))
    for epoch in range(4):
        assert sorted(row for _, row in full[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert list(itertools.islice(prompt_cursor(7, seed=1, start_index=11), 19)) == full[11:30]


def test_row_of_prompt_inverts_the_cursor():
    for shuffle in (True, False):
        for prompt_id, row in itertools.islice(prompt_cursor(7, seed=5, shuffle=shuffle), 30):
            assert row_of_prompt(prompt_id, 7, seed=5, shuffle=shuffle) == row


def test_config_accepts_one_url_or_replicas_and_rejects_bad_settings():
    config = RolloutConfig("http://s/", {"math": "http://a/", "code": ["http://b", "http://c/"]}, skip_prompt_ids={3})
    assert config.student_replicas() == ("http://s",) and config.teacher_replicas("math") == ("http://a",)
    assert config.teacher_replicas("code") == ("http://b", "http://c") and config.skip_prompt_ids == frozenset({3})
    cases = [
        (dict(teacher_urls={}), "teacher_urls is empty"),
        (dict(teacher_urls={"math": []}), "teacher 'math': the list of replica URLs is empty"),
        (dict(teacher_urls={"math": ["http://a", "http://a"]}), "teacher 'math': a replica URL is listed twice"),
        (dict(student_url=["http://s", ""]), "student_url: every replica URL must be a non-empty string"),
        (dict(max_rollout_attempts=0), "max_rollout_attempts must be >= 1, got 0"),
        (dict(teacher_top_k=0), "teacher_top_k must be >= 1, got 0"),
        (dict(start_index=-1), "start_index must be >= 0"),
        (dict(server_down_deadline_s=0.0), "server_down_deadline_s must be > 0"),
        (dict(replica_cooldown_s=-1.0), "replica_cooldown_s >= 0"),
        (dict(skip_prompt_ids=frozenset({2, -4})), r"skip_prompt_ids must be prompt ids >= 0, got \['-4'\]"),
        (dict(max_inflight_tasks=4, initial_inflight_tasks=5), r"initial_inflight_tasks must be None or in \[1, "),
        (dict(initial_inflight_tasks=0), "initial_inflight_tasks must be None or in"),
        (dict(max_lookahead=0), "max_lookahead must be None or an int >= 1, got 0"),
        (dict(max_lookahead=2.5), "max_lookahead must be None or an int >= 1, got 2.5"),
    ]
    for overrides, message in cases:
        settings = dict(student_url="http://s", teacher_urls={"math": "http://a"}) | overrides
        with pytest.raises(ValueError, match=message):
            RolloutConfig(**settings)


def test_slow_start_grows_the_in_flight_cap_by_one_per_finished_rollout():
    rows = [{"prompt_ids": [1], "teacher_id": "t", "prompt": None}]
    loop = RolloutLoop(RolloutConfig("http://s", {"t": "http://t"}, max_inflight_tasks=10, initial_inflight_tasks=3),
                        rows, None)
    assert loop.inflight_cap() == 3
    loop.finished = 4
    assert loop.inflight_cap() == 7
    loop.finished = 50
    assert loop.inflight_cap() == 10
    plain = RolloutLoop(RolloutConfig("http://s", {"t": "http://t"}, max_inflight_tasks=10), rows, None)
    assert plain.inflight_cap() == 10


class _CountedQueue:
    def __init__(self, size: int, countable: bool = True):
        self.size, self.countable = size, countable

    def qsize(self) -> int:
        if not self.countable:
            raise NotImplementedError
        return self.size


def test_lookahead_counts_queued_samples_against_the_in_flight_cap():
    rows = [{"prompt_ids": [1], "teacher_id": "t", "prompt": None}]
    channels = type("Channels", (), {"samples": _CountedQueue(0)})()
    loop = RolloutLoop(RolloutConfig("http://s", {"t": "http://t"}, max_inflight_tasks=16, max_lookahead=12),
                        rows, channels)
    assert loop.inflight_cap() == 12  # an empty queue: the whole lookahead may be in flight
    channels.samples.size = 5
    assert loop.inflight_cap() == 7
    channels.samples.size = 12
    assert loop.inflight_cap() == 0  # the trainer has a full lookahead waiting: dispatch nothing
    channels.samples = _CountedQueue(12, countable=False)  # macOS: the queue cannot be counted, so it is not
    assert loop.inflight_cap() == 12


def test_clipped_means_no_eos_at_the_end_or_the_length_limit_without_eos_ids():
    eos = frozenset({2, 0})
    assert not is_clipped(np.array([5, 2]), eos, 32) and not is_clipped(np.array([0]), eos, 32)
    assert is_clipped(np.array([5, 6]), eos, 32)
    assert is_clipped(np.array([5, 6, 7]), frozenset(), 3) and not is_clipped(np.array([5, 2]), frozenset(), 3)


def test_redo_rejects_negative_prompt_ids():
    worker = RolloutWorker(RolloutConfig("http://s", {"t": "http://t"}), dataset(2))
    with pytest.raises(ValueError, match=r"redo: prompt ids must be >= 0, got \[3, -1\]"):
        worker.redo([3, -1])


def test_unknown_or_missing_teacher_id_is_rejected_up_front():
    two = RolloutConfig("http://s", {"math": "http://a", "code": "http://b"})
    rows = dataset(3)
    rows[2]["teacher_id"] = "bio"
    with pytest.raises(ValueError, match=r"row 2 has teacher_id='bio'.*\['code', 'math'\]"):
        RolloutWorker(two, rows)
    del rows[2]["teacher_id"]
    with pytest.raises(ValueError, match=r"teacher_id=None.*\['code', 'math'\]"):
        RolloutWorker(two, rows)
    one = RolloutConfig("http://s", {"math": "http://a"})
    RolloutWorker(one, rows)  # a single teacher takes every row, whatever its teacher_id


# ------------------------------------------------------------------------------------------------ worker process


def test_samples_are_scored_by_their_teacher_once_per_epoch(servers):
    student, teachers = servers
    rows = [row for row in dataset(10) if row["prompt_ids"][0] not in (12, 14)]
    worker = RolloutWorker(config(student, teachers), rows, queue_maxsize=8)
    worker.model_version = 3
    worker.start()
    try:
        found = collect_first_epoch(worker, len(rows))
        metrics = drain_metrics(worker, until=lambda ms: any("teacher_score_s/math" in m for m in ms))
    finally:
        worker.stop()
    order = epoch_order(len(rows), seed=7, epoch=0)
    assert [found[i].dataset_index for i in range(len(rows))] == order.tolist()
    for sample in found.values():
        row = rows[sample.dataset_index]
        prompt, completion = row["prompt_ids"], student_completion(row["prompt_ids"])
        assert sample.teacher_id == row["teacher_id"] and sample.model_version == 3 and sample.prompt == row["prompt"]
        assert sample.input_ids.dtype == np.int32 and sample.input_ids.tolist() == prompt + completion
        assert sample.completion_mask.tolist() == [0] * len(prompt) + [1] * len(completion)
        assert sample.rollout_logprobs.dtype == np.float32 and sample.rollout_logprobs.tolist() == [-0.5] * 3
        tag = 1000 if row["teacher_id"] == "math" else 2000
        assert sample.teacher_topk_ids.shape == (3, TOP_K + 1) and sample.teacher_topk_ids.dtype == np.int32
        assert sample.teacher_topk_ids.tolist() == [[tag, token, -1] for token in completion]
        assert sample.teacher_topk_logprobs[:, :2].tolist() == [[-0.25, -4.0]] * 3
        assert np.isneginf(sample.teacher_topk_logprobs[:, 2]).all() and sample.enqueued_at is not None
        trl = sample.to_trl_layout()
        assert trl["teacher_topk_ids"].shape == (6, TOP_K + 1) and (trl["teacher_topk_ids"][:3] == -1).all()
        assert np.array_equal(trl["teacher_topk_ids"][3:], sample.teacher_topk_ids)
    assert any("teacher_score_s/math" in m and m["rollout/duration_s"] >= m["rollout/score_s"] for m in metrics)


def test_a_prompt_table_stays_compact_and_its_dataset_prompts_reach_the_samples(servers, tmp_path, monkeypatch):
    """A PromptTable from a datasets.Dataset (prompts read lazily from its Arrow column) goes to the child as is:
    the samples carry the rows' ids, teachers and prompts."""
    datasets = pytest.importorskip("datasets")
    from fastdistill.data import PromptTable
    from fastdistill.data.sources import tokenize_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    student, teachers = servers
    rows = [{"prompt_ids": [10 + i, 5, 6], "teacher_id": ("math", "code")[i % 2],
             "prompt": [{"role": "user", "content": f"row {i}"}]} for i in (0, 1, 3, 5)]
    table = tokenize_dataset(datasets.Dataset.from_list(rows), None)
    worker = RolloutWorker(config(student, teachers), table, queue_maxsize=8)
    assert isinstance(worker._rows, PromptTable) and worker._rows.token_ids is table.token_ids
    worker.start()
    try:
        found = collect_first_epoch(worker, len(rows))
    finally:
        worker.stop()
    for sample in found.values():
        row = rows[sample.dataset_index]
        assert sample.prompt == row["prompt"] and sample.teacher_id == row["teacher_id"]
        assert sample.input_ids.tolist() == row["prompt_ids"] + student_completion(row["prompt_ids"])


def total(metrics: list[dict], key: str) -> float:
    """Sum of a counter over metric payloads (each holds the count since the previous one)."""
    return sum(m.get(key, 0.0) for m in metrics)


def test_failed_rollouts_are_counted_and_the_rest_arrive(servers):
    student, teachers = servers
    rows = dataset(8, teacher_ids=("anything",))  # first tokens 10..17; 12 answers 500, 14 answers 400
    settings = dict(shuffle=False, max_rollout_attempts=2)
    worker = RolloutWorker(config(student, {"math": teachers["math"]}, **settings), rows, queue_maxsize=64)
    worker.start()
    try:
        good, dropped = {}, {}
        while len(good) + len(dropped) < 8:  # the first epoch, prompts 0..7, each delivered or given up on; the
            (sample,) = next_samples(worker, 1)  # second epoch's may overtake prompt 2's retries
            if sample.prompt_id < 8:
                (dropped if isinstance(sample, DroppedPrompt) else good)[sample.prompt_id] = sample
        # the failures of prompts 2 and 4 land (counters ride on the next delivered rollout's payload)
        metrics = drain_metrics(worker, until=lambda ms: total(ms, "rollout/dropped_total") >= 2)
    finally:
        worker.stop()
    assert sorted(good) == [0, 1, 3, 5, 6, 7]
    assert all(sample.teacher_id == "math" for sample in good.values())
    # the two given up on arrive as notices naming the prompt, the reason and the server's message
    assert dropped[2].reason == "unavailable" and dropped[2].server == "student" and dropped[2].prompt_id == 2
    assert "engine crashed" in dropped[2].message and "2 attempts" in dropped[2].message
    assert dropped[4].reason == "rejected" and dropped[4].server == "student"
    assert dropped[4].message == "context too long"
    # Prompt 2 (500, transient): 2 attempts of 2 requests each, so 2 retries, then dropped. Prompt 4 (400): one
    # request, no retry, dropped at once. Counted once per failed attempt.
    first_epoch = [m for m in metrics if "rollout/failed_total" in m]
    assert total(first_epoch, "rollout/failed_total") >= 3
    assert total(first_epoch, "rollout/redispatched_total") >= 1
    assert total(first_epoch, "rollout/dropped_total") >= 2
    assert total(first_epoch, "rollout/vllm_retry_total") >= 2


def test_lookahead_bounds_in_flight_plus_queued_rollouts():
    with StubServer("student", student_stub()) as student, StubServer("teacher", teacher_stub(tag=1000)) as teacher:
        _check_lookahead(student, teacher)


def _check_lookahead(student: StubServer, teacher: StubServer) -> None:
    rows = dataset(40, teacher_ids=("anything",))
    worker = RolloutWorker(config(student, {"math": teacher}, max_inflight_tasks=16, max_lookahead=5), rows,
                           queue_maxsize=3)

    def requests_settle_at(expected: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while student.requests < expected:
            assert time.monotonic() < deadline, f"{student.requests} generations, expected {expected}"
            worker.check_health(stale_after_s=HEALTHY_S)
            time.sleep(0.05)
        # and no more follow: a window to watch for extra requests (not a wait for anything; on a slow machine it
        # can only miss an over-dispatch, never fail a correct worker)
        time.sleep(0.5)
        assert student.requests == expected

    worker.start()
    try:
        requests_settle_at(5)  # nothing consumed: the whole lookahead is generated, no more
        for _ in range(2):
            worker.samples.get(timeout=DEADLINE_S)
        requests_settle_at(7)  # each sample the trainer takes frees one rollout
    finally:
        worker.stop()


def limits_recorder(requested: list[int]):
    """A stub student that also records each request's ``max_tokens``."""
    answer = student_stub()

    async def complete(body):
        requested.append(body["max_tokens"])
        return await answer(body)

    return complete


def test_the_horizon_follows_the_trainers_steps_not_its_weight_syncs():
    """A linear horizon from 2 to 10 tokens over 4 steps. The worker (lookahead 2) dispatches its first two rollouts
    at step 0; the trainer then reports 4 steps trained, with no weight sync, and every later rollout asks for the
    full 10 tokens. A synchronous source reads the steps from the trainer's policy steps, wave by wave."""
    from fastdistill.rollout.horizon import HorizonSchedule
    from fastdistill.train.source import SynchronousSource
    from fastdistill.train.staleness import PolicySteps

    horizon = HorizonSchedule(start_tokens=2, full_tokens=10, growth_steps=4)
    requested: list[int] = []
    with StubServer("student", limits_recorder(requested)) as student, \
            StubServer("teacher", teacher_stub(tag=1000)) as teacher:
        rows = dataset(8, teacher_ids=("math",))
        settings = dict(max_tokens=10, horizon=horizon, max_inflight_tasks=4, max_lookahead=2, shuffle=False)
        worker = RolloutWorker(config(student, {"math": teacher}, **settings), rows, queue_maxsize=2)
        worker.start()
        try:
            deadline = time.monotonic() + DEADLINE_S
            while len(requested) < 2:
                assert time.monotonic() < deadline, requested
                worker.check_health(stale_after_s=HEALTHY_S)
                time.sleep(0.05)
            worker.trained_steps = 4  # the model version stays 0: nothing was synced
            collect_first_epoch(worker, 8)
        finally:
            worker.stop()
        assert requested[:2] == [2, 2] and len(requested) >= 8 and set(requested[2:]) == {10}, requested

        requested.clear()
        policy = PolicySteps(1)
        source = SynchronousSource(rows, config(student, {"math": teacher}, **settings), wave_size=4, policy=policy)
        for step in (0, 1):
            policy.step = step
            for _ in range(4):
                source.next(model_version=0)
        source.close()
    assert requested == [2] * 4 + [4] * 4  # ⌊2 + 8·1/4⌋ at step 1


def test_synchronous_source_serves_waves_of_current_samples_over_kept_connections():
    from fastdistill.train.source import SynchronousSource

    with StubServer("student", student_stub()) as student, StubServer("teacher", teacher_stub(tag=1000)) as teacher:
        rows = dataset(6, teacher_ids=("math",))
        source = SynchronousSource(rows, config(student, {"math": teacher}, shuffle=False), wave_size=3)
        first = [source.next(model_version=4) for _ in range(3)]
        assert (student.requests, teacher.requests) == (3, 3)  # one wave, generated and scored at once
        second = [source.next(model_version=5) for _ in range(3)]
        source.close()
        source.close()  # idempotent
    assert [s.prompt_id for s in first + second] == list(range(6))
    assert [s.model_version for s in first + second] == [4, 4, 4, 5, 5, 5]  # stamped with the trainer's version
    assert first[0].input_ids.tolist() == [10, 5, 6, *student_completion([10])]
    assert student.model_queries == 1  # the clients (and their connections) live for the whole run


def test_backpressure_keeps_the_heartbeat_fresh(servers):
    """One rollout at a time, a queue of one and nobody consuming: the second rollout waits on the full queue, and
    the child keeps beating while it waits; the wait is reported as rollout/backpressure_s."""
    student, teachers = servers
    rows = [row for row in dataset(6) if row["prompt_ids"][0] not in (12, 14)]  # 4 rows the stub student answers
    worker = RolloutWorker(config(student, teachers, max_inflight_tasks=1), rows, queue_maxsize=1)
    worker.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (worker.samples.full() and sum(t.requests for t in teachers.values()) >= 2):
            assert time.monotonic() < deadline, "the second rollout was never scored"
            worker.check_health(stale_after_s=HEALTHY_S)
            time.sleep(0.05)
        scored_at = time.time()
        # a beat stamped 3 s after the second rollout was scored, with the queue still full: the child, running (that
        # rollout done in milliseconds), waits on the queue and beats meanwhile
        while worker._channels.heartbeat.value < scored_at + 3.0:
            assert time.monotonic() < deadline, "no beat while the queue was full"
            worker.check_health(stale_after_s=HEALTHY_S)
            time.sleep(0.05)
        assert worker.samples.full() and student.requests == 2  # nothing consumed, nothing more dispatched
        worker.samples.get(timeout=DEADLINE_S)
        worker.samples.get(timeout=DEADLINE_S)
        metrics = drain_metrics(worker, until=lambda ms: sum("rollout/backpressure_s" in m for m in ms) >= 2)
    finally:
        worker.stop()
    assert max(m["rollout/backpressure_s"] for m in metrics if "rollout/backpressure_s" in m) > 1.0


def test_stop_does_not_wait_for_requests_in_flight(servers):
    """stop() with generations in flight that would take 10 minutes: the child cancels them and exits cleanly (exit
    code 0) within stop's grace period; waiting for them would have run into it and ended in terminate/kill."""
    _, teachers = servers
    with StubServer("slow-student", student_stub(delay_s=600.0)) as slow:
        worker = RolloutWorker(config(slow, teachers), dataset(4))
        worker.start()
        deadline = time.monotonic() + DEADLINE_S
        while slow.requests == 0:  # a generation is in flight
            assert time.monotonic() < deadline, "no generation request arrived"
            worker.check_health(stale_after_s=HEALTHY_S)
            time.sleep(0.05)
        worker.stop(timeout_s=DEADLINE_S)
    assert not worker.is_alive() and worker._process.exitcode == 0


def test_dead_child_is_detected(servers):
    student, teachers = servers
    worker = RolloutWorker(config(student, teachers), dataset(4))
    worker.start()
    try:
        os.kill(worker.pid, signal.SIGKILL)
        worker._process.join(DEADLINE_S)
        with pytest.raises(RuntimeError, match="died"):
            worker.check_health(stale_after_s=60.0)
    finally:
        worker.stop()


def poll_health(worker: RolloutWorker, timeout_s: float = DEADLINE_S) -> None:
    """Call ``check_health`` every 50 ms for up to ``timeout_s`` (it raises once the child has failed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker.check_health(stale_after_s=HEALTHY_S)
        time.sleep(0.05)


def test_child_failure_reports_its_traceback(servers):
    _, teachers = servers
    worker = RolloutWorker(RolloutConfig("not-a-url", {"math": teachers["math"].url}), dataset(2))
    worker.start()
    try:
        with pytest.raises(RuntimeError, match=r"(?s)child failed.*Traceback.*not-a-url"):
            poll_health(worker)
        with pytest.raises(RuntimeError, match="not-a-url"):  # the report survives being read once
            worker.check_health(stale_after_s=60.0)
    finally:
        worker.stop()


def test_a_server_failing_every_rollout_stops_the_child(servers):
    _, teachers = servers
    with StubServer("broken-student", student_stub(fail_400=set(range(10, 14)))) as broken:
        worker = RolloutWorker(config(broken, teachers, max_consecutive_failures=3), dataset(4))
        worker.start()
        try:
            with pytest.raises(RuntimeError, match=r"(?s)3 rollouts in a row were rejected.*context too long"):
                poll_health(worker)
        finally:
            worker.stop()


def test_child_sees_no_gpu_and_no_distributed_env(servers, monkeypatch):
    student, teachers = servers
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    worker = RolloutWorker(config(student, teachers), dataset(2))
    worker.start()
    try:
        with open(f"/proc/{worker.pid}/environ", "rb") as environ:
            child_env = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
    finally:
        worker.stop()
    assert child_env[b"CUDA_VISIBLE_DEVICES"] == b"" and b"RANK" not in child_env and b"MASTER_PORT" not in child_env
    assert os.environ["RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def next_samples(worker: RolloutWorker, count: int, timeout_s: float = DEADLINE_S) -> list:
    samples = []
    deadline = time.monotonic() + timeout_s
    while len(samples) < count:
        assert time.monotonic() < deadline, f"only {len(samples)} of {count} samples arrived"
        worker.check_health(stale_after_s=HEALTHY_S)
        try:
            samples.append(worker.samples.get(timeout=0.5))
        except queue.Empty:
            pass
    return samples


def test_skip_prompt_ids_are_never_dispatched_and_redo_dispatches_again(servers):
    student, teachers = servers
    rows = [row for row in dataset(8) if row["prompt_ids"][0] not in (12, 14)]  # 6 good rows
    settings = dict(start_index=2, skip_prompt_ids=frozenset({3, 7}), max_inflight_tasks=2)
    worker = RolloutWorker(config(student, teachers, **settings), rows, queue_maxsize=2)
    worker.start()
    try:
        first: list[int] = []  # until 2..9 without 3 and 7 have arrived (a later prompt may overtake one in flight)
        while not {2, 4, 5, 6, 8, 9} <= set(first):
            first += [sample.prompt_id for sample in next_samples(worker, 1)]
            assert len(first) <= 12, f"prompts 2..9 never all arrived: {first}"
        assert min(first) == 2 and not {3, 7} & set(first)  # from the cursor on, 3 and 7 skipped
        worker.redo([4, 6, 40])  # 4 and 6 again; 40 is ahead of the cursor: now, and not again later
        later = next_samples(worker, 40)
    finally:
        worker.stop()
    ids = [sample.prompt_id for sample in later]
    assert ids.count(4) == 1 and ids.count(6) == 1 and ids.count(40) == 1
    assert ids.index(40) < 10 and ids.index(4) < 10  # ahead of the cursor (give or take the in-flight ones)
    redone = next(sample for sample in later if sample.prompt_id == 40)
    assert redone.dataset_index == row_of_prompt(40, len(rows), seed=7)
    assert max(ids) > 40 and set(range(10, 45)) - {40} <= set(ids) | set(first)


def test_completion_metrics_and_generated_token_rate(servers):
    student, teachers = servers
    rows = [row for row in dataset(8) if row["prompt_ids"][0] not in (12, 14)]
    worker = RolloutWorker(config(student, teachers, eos_token_ids=(2,)), rows, queue_maxsize=64)
    worker.start()
    try:
        next_samples(worker, 8)
        metrics = [m for m in drain_metrics(worker) if "completions/mean_length" in m]
    finally:
        worker.stop()
    assert metrics
    for m in metrics:  # the stub completes every prompt with 3 tokens ending in eos id 2
        assert m["completions/max_length"] == m["completions/min_length"] == 3.0
        assert m["completions/clipped_ratio"] == 0.0
        tokens, seconds = m["rollout/generated_tok_s"]
        assert tokens == 3.0 and seconds > 0
        assert m["rollout/vllm_retry_total"] == 0.0 and m["rollout/failed_total"] == 0.0


def test_replicas_share_the_load_and_a_dead_replica_fails_over(servers):
    _, teachers = servers
    dead = f"http://127.0.0.1:{free_port()}"
    rows = [row for row in dataset(8) if row["prompt_ids"][0] not in (12, 14)]
    with StubServer("student", student_stub()) as one, StubServer("student", student_stub()) as two:
        settings = dict(teacher_urls={"math": [dead, teachers["math"].url]}, replica_cooldown_s=0.2)
        cfg = RolloutConfig([one.url, two.url], **settings, teacher_top_k=TOP_K, retry=FAST_RETRY)
        worker = RolloutWorker(cfg, rows, queue_maxsize=64)
        worker.start()
        try:
            samples = next_samples(worker, 30)
            metrics = drain_metrics(worker, until=lambda ms: total(ms, "rollout/failover_total") >= 1
                                    and total(ms, "rollout/replica_errors/math@0_total") >= 1)
        finally:
            worker.stop()
    assert all(sample.teacher_topk_ids[0, 0] == 1000 for sample in samples)  # scored by the live teacher
    assert one.requests >= 10 and two.requests >= 10
    assert total(metrics, "rollout/failed_total") == 0
    assert total(metrics, "rollout/failover_total") >= 1 and total(metrics, "rollout/vllm_retry_total") >= 1
    assert total(metrics, "rollout/replica_errors/math@0_total") >= 1
    assert total(metrics, "rollout/replica_errors/math@1_total") == 0
