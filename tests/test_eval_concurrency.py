"""Held-out evaluation keeps a bounded number of rows in flight, and a socket this machine cannot open is not held
against a healthy replica (stub vLLM servers, no model)."""

from __future__ import annotations

import asyncio
import errno
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

sys.path.insert(0, str(Path(__file__).parent))
from test_rollout_worker import FAST_RETRY, TOP_K, StubServer, dataset, student_stub, teacher_stub  # noqa: E402

import fastdistill.rollout.http as rollout_http  # noqa: E402
from fastdistill.errors import VLLMUnavailableError  # noqa: E402
from fastdistill.http_client import new_session  # noqa: E402
from fastdistill.rollout import RolloutConfig  # noqa: E402
from fastdistill.rollout.http import RetryPolicy, request_json_pooled  # noqa: E402
from fastdistill.rollout.replicas import ReplicaPool  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402
from fastdistill.train.evaluate import EVAL_MAX_INFLIGHT, collect_held_out, collect_scored_samples  # noqa: E402

RELEASE_AFTER_S = 1.0  # only what a group of requests at the cap waits for a request beyond it that never comes


class PeakCounter:
    """A student stub that counts the generation requests it holds at once. Each waits until one more than ``cap``
    are held (which only happens when the client exceeds its cap: then every held request is released and the peak
    shows it) or ``RELEASE_AFTER_S`` has passed, so that a client over its cap is caught however fast it sends."""

    def __init__(self, cap: int):
        self.cap, self.active, self.peak = cap, 0, 0
        self.over = asyncio.Event()
        self.answer = student_stub()

    async def __call__(self, body):
        self.active += 1
        self.peak = max(self.peak, self.active)
        if self.active > self.cap:
            self.over.set()
        try:
            await asyncio.wait_for(self.over.wait(), RELEASE_AFTER_S)
        except TimeoutError:
            pass
        finally:
            self.active -= 1
        return await self.answer(body)


def test_evaluation_holds_at_most_its_cap_of_rows_in_flight():
    """12 rows, a cap of 4: every row is scored, and the student never holds more than 4 generations at once (before
    the cap, every row was in flight at once: 1,000 eval rows opened 1,000+ sockets)."""
    rows = dataset(12, teacher_ids=("math",))
    counter = PeakCounter(cap=4)
    with StubServer("student", counter) as student, StubServer("math", teacher_stub(tag=1000)) as teacher:
        samples = collect_scored_samples(student.url, {"math": teacher.url}, rows, top_k=TOP_K, max_tokens=8,
                                         retry=FAST_RETRY, max_inflight_tasks=4)
    assert [s.dataset_index for s in samples] == list(range(12))
    assert counter.peak <= 4


def test_the_trainers_evaluation_takes_its_cap_from_the_run():
    """collect_held_out: the run's max_inflight_tasks; automatic (-1): the rollout worker's default cap."""
    assert EVAL_MAX_INFLIGHT == RolloutConfig("http://s:1", {"t": "http://t:1"}).max_inflight_tasks
    rows = dataset(9, teacher_ids=("math",))
    counter = PeakCounter(cap=3)
    with StubServer("student", counter) as student, StubServer("math", teacher_stub(tag=1000)) as teacher:
        config = AsyncDistillationConfig(model_name_or_path="m", vllm_server_base_url=student.url,
                                         teacher_server_urls={"math": teacher.url}, teacher_top_k=TOP_K,
                                         max_completion_length=8, max_inflight_tasks=3)
        samples = collect_held_out(config, rows)
    assert len(samples) == 9 and counter.peak <= 3


def emfile() -> aiohttp.ClientConnectorError:
    """What aiohttp raises when this process has no file descriptor left for a new socket."""
    key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None, None)
    return aiohttp.ClientConnectorError(key, OSError(errno.EMFILE, "Too many open files"))


def test_a_socket_this_machine_cannot_open_does_not_bench_the_replica(monkeypatch):
    """Two EMFILE failures, then the request goes through: the replica has no error, no cooldown and the pool is not
    down (an EMFILE used to count as the server's "no answer" and bench a healthy replica). When every attempt fails
    that way, the error says the cause is on this machine."""
    real_send = rollout_http.send
    failures = {"left": 2}

    async def send(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise emfile()
        return await real_send(*args, **kwargs)

    monkeypatch.setattr(rollout_http, "send", send)
    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=30.0)
    with StubServer("student", student_stub()) as student:
        pool = ReplicaPool(student.url)

        async def ask():
            async with new_session() as session:
                return await request_json_pooled(session, "GET", pool, "/v1/models", retry=retry)

        body = asyncio.run(ask())
        assert body["data"][0]["id"] == "student"
        replica = pool.replicas[0]
        assert (replica.errors, replica.cooldown_s, replica.down_until, pool.down_since) == (0, 0.0, 0.0, None)

        failures["left"] = 10
        with pytest.raises(VLLMUnavailableError, match="on this machine, not the server.*ulimit -n"):
            asyncio.run(ask())
        assert replica.errors == 0 and pool.down_since is None
