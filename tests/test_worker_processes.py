"""Several rollout worker processes sharing one prompt stream (``rollout_processes``), against instant stub servers
(no vLLM): the partition of the prompt ids, exactly-once across a resume, drops, re-dispatch, the end of the stream,
the global lookahead, health checks and shutdown."""

from __future__ import annotations

import collections
import copy
import itertools
import json
import math
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_one_rollout import drain, in_thread, process_gone  # noqa: E402
from test_rollout_worker import (  # noqa: E402
    FAST_RETRY,
    HEALTHY_S,
    StubServer,
    dataset,
    student_completion,
    teacher_stub,
)

from fastdistill.data.batching import FixedCountBatcher  # noqa: E402
from fastdistill.errors import ConfigError, SourceExhausted  # noqa: E402
from fastdistill.rollout import OnPolicyShare, RolloutConfig, RolloutWorker, WorkerExhausted  # noqa: E402
from fastdistill.rollout.dispatch import PromptDispatcher, owner_of  # noqa: E402
from fastdistill.rollout.dropped import DroppedPrompt  # noqa: E402
from fastdistill.rollout.processes import SharedCounts  # noqa: E402
from fastdistill.train.checkpoint import RolloutState  # noqa: E402
from fastdistill.train.collector import WindowCollector  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402
from fastdistill.train.source import WorkerSource  # noqa: E402

DEADLINE_S = 120.0  # only reached when something is broken
REJECTED = 13  # the stub student answers 400 to prompts whose first token is this (row 3)
FLAKY = 15  # ... and 500 to the first two requests of this one (row 5): one attempt fails, the next succeeds


def flaky_student(rejected=(REJECTED,), flaky=(FLAKY,), failures_each: int = 2):
    """Student /v1/completions: 400 for the ``rejected`` first tokens, 500 for the first ``failures_each``
    requests of each ``flaky`` one, else the deterministic completion."""
    failed = collections.Counter()

    async def complete(body):
        first = body["prompt"][0]
        if first in rejected:
            return 400, {"error": {"message": "context too long"}}
        if first in flaky and failed[first] < failures_each:
            failed[first] += 1
            return 500, {"error": {"message": "engine restarting"}}
        tokens = student_completion(body["prompt"])
        return 200, {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": [-0.5] * len(tokens)}}]}

    return complete


def config(student: StubServer, teacher: StubServer, **overrides) -> RolloutConfig:
    settings = dict(teacher_top_k=2, max_tokens=8, max_inflight_tasks=4, retry=FAST_RETRY, seed=7,
                    rollout_processes=2, max_rollout_attempts=3)
    settings.update(overrides)
    return RolloutConfig(student.url, {"math": teacher.url}, **settings)


class NoticeLog:
    """Wraps a worker's :meth:`~RolloutWorker.ended_by` to record the notices the source passed it."""

    def __init__(self, worker: RolloutWorker):
        self.notices: list[WorkerExhausted] = []
        ended_by = worker.ended_by

        def recording(notice: WorkerExhausted) -> bool:
            self.notices.append(notice)
            return ended_by(notice)

        worker.ended_by = recording  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------------ the partition


def test_every_prompt_id_has_one_owner_and_regular_patterns_spread_evenly():
    """owner_of is a function of the id into [0, P); the ids of a range, and the every-other ids an on-policy share
    of 0.5 selects, each split evenly (within 5 standard deviations of a fair split: a bound from the binomial
    arithmetic, not a tuning); one process owns everything."""
    ids = range(20_000)
    assert {owner_of(i, 1) for i in ids} == {0}
    share = OnPolicyShare(0.5)
    for processes in (2, 3, 8):
        owners = [owner_of(i, processes) for i in ids]
        assert owners == [owner_of(i, processes) for i in ids] and set(owners) == set(range(processes))
        for selected in (list(ids), [i for i in ids if share.selects(i)]):
            counts = collections.Counter(owners[i] for i in selected)
            expected = len(selected) / processes
            bound = 5 * math.sqrt(len(selected) * (1 / processes) * (1 - 1 / processes))
            assert all(abs(counts[p] - expected) < bound for p in range(processes)), (processes, counts)


def dispatched(dispatcher: PromptDispatcher) -> list[int]:
    return [item[0] for item in iter(dispatcher.next, None)]


def test_the_processes_dispatchers_split_the_one_cursor_with_its_skips():
    """With P dispatchers over one config (shuffled epochs, resume cursor, skipped ids and rows, an on-policy share,
    an end): each yields exactly the single dispatcher's sequence filtered to the ids it owns, in the same order and
    with the same rows, so together they dispatch every prompt once."""
    settings = dict(start_index=5, end_index=95, skip_prompt_ids=frozenset({6, 9, 40, 41}), skip_rows=frozenset({2}),
                    on_policy=OnPolicyShare(0.7))
    cfg = RolloutConfig("http://s", {"t": "http://t"}, **settings)
    one = PromptDispatcher(cfg, 30)
    alone = [item for item in iter(one.next, None)]
    assert alone and {p for p, _, _ in alone}.isdisjoint(settings["skip_prompt_ids"])
    for processes in (2, 3):
        parts = [[item for item in iter(PromptDispatcher(cfg, 30, p, processes).next, None)]
                 for p in range(processes)]
        for process, part in enumerate(parts):
            assert part == [item for item in alone if owner_of(item[0], processes) == process]
        assert sorted(itertools.chain(*parts)) == sorted(alone)
    # a redo of an id its owner's cursor has not reached runs now and not again; one behind it runs again
    first = PromptDispatcher(cfg, 30, 0, 2)
    ahead = next(p for p, _, _ in alone if owner_of(p, 2) == 0 and p > 50)
    first.redo([ahead])
    assert dispatched(first).count(ahead) == 1
    with pytest.raises(ValueError, match=r"process must be in \[0, processes=2\), got 2"):
        PromptDispatcher(cfg, 30, 2, 2)


def test_bad_process_counts_are_refused():
    base = dict(student_url="http://s", teacher_urls={"t": "http://t"})
    for value in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=f"rollout_processes must be an int >= 1, got {value!r}"):
            RolloutConfig(**base, rollout_processes=value)
    with pytest.raises(ValueError, match="rollout_processes=5 is more than max_inflight_tasks=4: every process needs"):
        RolloutConfig(**base, rollout_processes=5, max_inflight_tasks=4)
    train = dict(model_name_or_path="student", output_dir="out")
    with pytest.raises(ConfigError, match="rollout_processes must be an int >= 1, got 0"):
        AsyncDistillationConfig(**train, rollout_processes=0)
    with pytest.raises(ConfigError, match="rollout_processes must be 1 with async_mode=False .*got 2"):
        AsyncDistillationConfig(**train, rollout_processes=2, async_mode=False)
    with pytest.raises(ConfigError, match=r"rollout_processes must be .* at most max_inflight_tasks .*got 3"):
        AsyncDistillationConfig(**train, rollout_processes=3, max_inflight_tasks=2)
    assert AsyncDistillationConfig(**train, rollout_processes=2).rollout_processes == 2


def test_the_trainer_passes_its_process_count_to_the_rollout_settings():
    from fastdistill.train.pipeline import rollout_config

    train = AsyncDistillationConfig(model_name_or_path="student", output_dir="out", rollout_processes=3)
    settings = rollout_config(train, world_size=1, rollout_state=RolloutState(), total_prompts=12,
                              skip_rows=frozenset(), on_policy=None, eos_ids=(2,), adapter_sync=False)
    assert settings.rollout_processes == 3


# ------------------------------------------------------------------------------------------------ worker processes


def test_two_processes_deliver_every_prompt_once_and_the_stream_ends_when_both_have():
    """Two epochs of 10 rows through two processes: every prompt id arrives once, as a sample or (row 3, rejected)
    a drop notice; row 5's first attempt fails (the server restarting) and is re-dispatched. The source ends only
    after both processes said "nothing left". A redo after the end goes to each id's owner, is served once, and ends
    the stream again."""
    rows = dataset(10, teacher_ids=("math",))
    with StubServer("student", flaky_student()) as student, StubServer("teacher", teacher_stub(tag=1)) as teacher:
        worker = RolloutWorker(config(student, teacher, end_index=20), rows, queue_maxsize=4)
        log = NoticeLog(worker)
        worker.start()
        try:
            assert len(set(worker.pids)) == 2 and os.getpid() not in worker.pids
            source = WorkerSource(worker, max_staleness=4, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S,
                                  poll_s=0.2)
            items = in_thread(lambda: drain(source))
            assert sorted(notice.process for notice in log.notices) == [0, 1]  # one each, then the end
            with pytest.raises(SourceExhausted):
                source.next(0)
            source.drain_worker_metrics()
            redone = [4, 17]  # after the end: each back from its owner, once
            worker.redo(redone)
            again: list = []
            notices: list[WorkerExhausted] = []
            deadline = time.monotonic() + DEADLINE_S
            ended = False
            while not ended:
                assert time.monotonic() < deadline, f"redo not served: {again} {notices}"
                worker.check_health(stale_after_s=HEALTHY_S)
                try:
                    item = worker.samples.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(item, WorkerExhausted):
                    notices.append(item)
                    ended = worker.ended_by(item)
                else:
                    again.append(item.prompt_id)
        finally:
            worker.stop()
    ids = collections.Counter(item.prompt_id for item in items)
    assert ids == dict.fromkeys(range(20), 1)
    drops = sorted((item.prompt_id, item.dataset_index) for item in items if isinstance(item, DroppedPrompt))
    order = [row for _, row, _ in iter(PromptDispatcher(config(student, teacher, end_index=20), 10).next, None)]
    assert drops == [(p, 3) for p in range(20) if order[p] == 3]  # row 3 in each epoch, nothing else
    # row 5's failed attempt was re-dispatched: its prompts are among the ids delivered exactly once above (the
    # child's metrics travel on their own queue, so their arrival is not ordered with the samples': not asserted)
    assert sorted(again) == redone
    assert {notice.process for notice in notices} == {owner_of(p, 2) for p in redone}
    assert not worker.is_alive()


def test_a_resume_after_a_crash_trains_every_prompt_exactly_once():
    """The trainer's accounting (WindowCollector and RolloutState) over two processes: a run checkpoints after
    step 2, trains step 3, and its children are SIGKILLed mid-run; the resume starts from the checkpoint's state
    (the cursor and the ids trained beyond it) with two new processes. Samples older than max_staleness are redone
    by their owners. Every prompt of the run's two epochs is trained or dropped exactly once in the ledger (steps
    up to the checkpoint, then the resumed run's), the rejected row's prompts dropped."""
    rows = dataset(12, teacher_ids=("math",))
    total = 24

    def make_collector(state: RolloutState) -> WindowCollector:
        return WindowCollector(total_prompts=total, world_size=1, microbatches_per_step=1,
                               make_batcher=lambda: FixedCountBatcher(3, 1), state=state)

    def open_worker(state: RolloutState) -> tuple[RolloutWorker, WorkerSource]:
        cfg = config(student, teacher, end_index=total, start_index=state.prompt_index,
                     skip_prompt_ids=frozenset(state.trained_after), max_inflight_tasks=6, max_lookahead=6)
        worker = RolloutWorker(cfg, rows, queue_maxsize=3)
        worker.start()
        return worker, WorkerSource(worker, max_staleness=1, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S,
                                    poll_s=0.2)

    def version_of(step: int) -> int:  # two versions a step: what a step leaves in the lookahead is stale next step
        return 2 * (step - 1)

    ledger: list[tuple[int, list[int]]] = []  # (step, prompt ids) as trained_prompts.jsonl holds them
    drops: list[tuple[int, int]] = []  # (step, prompt id) as dropped_prompts.jsonl holds them
    with StubServer("student", flaky_student(flaky=())) as student, \
            StubServer("teacher", teacher_stub(tag=1)) as teacher:
        state = RolloutState()
        collector = make_collector(state)
        worker, source = open_worker(state)
        try:
            for step in (1, 2, 3):
                worker.model_version = version_of(step)
                window = in_thread(lambda step=step: collector.collect(source, model_version=version_of(step)))
                collector.mark_trained(window)
                ledger.append((step, window.prompt_ids))
                drops += [(step, notice.prompt_id) for notice in collector.take_drops()]
                if step == 2:
                    checkpoint = copy.deepcopy(state)
            for pid in worker.pids:  # the crash: children killed with rollouts in flight and samples queued
                os.kill(pid, signal.SIGKILL)
        finally:
            worker.stop()
        stale_before = source.dropped_stale_total
        # the resume: ledger lines after the checkpoint's step are dropped, the state is the checkpoint's
        ledger = [line for line in ledger if line[0] <= 2]
        drops = [line for line in drops if line[0] <= 2]
        state = copy.deepcopy(checkpoint)
        collector = make_collector(state)
        worker, source = open_worker(state)
        try:
            step = 3
            worker.model_version = version_of(step)
            while (window := in_thread(lambda step=step: collector.collect(source, version_of(step)))) is not None:
                step += 1
                worker.model_version = version_of(step)
                collector.mark_trained(window)
                ledger.append((step, window.prompt_ids))
                drops += [(step, notice.prompt_id) for notice in collector.take_drops()]
        finally:
            worker.stop()
    counts = collections.Counter([p for _, ids in ledger for p in ids] + [p for _, p in drops])
    assert counts == dict.fromkeys(range(total), 1), counts
    order = [row for _, row, _ in iter(PromptDispatcher(config(student, teacher, end_index=total), 12).next, None)]
    assert sorted(p for _, p in drops) == [p for p in range(total) if order[p] == REJECTED - 10]
    # the redo path ran: step 1 took 3 of the 6 rollouts dispatched at version 0, step 2 (version 2) found the others
    assert stale_before >= 1 and stale_before + source.dropped_stale_total >= 1


def test_the_lookahead_bounds_every_process_together():
    """max_lookahead=5 over two processes, nobody consuming: 5 generations in all (3 queued, 2 waiting on the full
    queue), no more; each sample taken frees one rollout, whichever process takes it."""
    rows = dataset(40, teacher_ids=("math",))
    with StubServer("student", flaky_student(rejected=(), flaky=())) as student, \
            StubServer("teacher", teacher_stub(tag=1)) as teacher:
        worker = RolloutWorker(config(student, teacher, max_inflight_tasks=16, max_lookahead=5), rows,
                               queue_maxsize=3)

        def requests_settle_at(expected: int) -> None:
            deadline = time.monotonic() + DEADLINE_S
            while student.requests < expected:
                assert time.monotonic() < deadline, f"{student.requests} generations, expected {expected}"
                worker.check_health(stale_after_s=HEALTHY_S)
                time.sleep(0.05)
            # a window to watch for extra requests: on a slow machine it can only miss an over-dispatch
            time.sleep(0.5)
            assert student.requests == expected

        worker.start()
        try:
            requests_settle_at(5)
            for _ in range(2):
                worker.samples.get(timeout=DEADLINE_S)
            requests_settle_at(7)
        finally:
            worker.stop()


def test_the_run_is_idle_only_once_every_child_recorded_its_totals():
    """A child that ran out of prompts with none in flight (``reserve(has_work=False)``) but has not yet recorded its
    scored and dropped totals (``settle``) does not make the run idle: the other child's settle must not see a run
    with only its own drops. Once both settled, the totals are both children's; a child handed prompts back
    (``has_work``) is unsettled again."""
    import multiprocessing

    counts = SharedCounts(multiprocessing.get_context("spawn"), 2)
    assert counts.reserve(0, 0, False, lambda finished: 8) == 0  # child 0: nothing left, nothing in flight
    assert counts.settle(1, 0, 3) == (False, 0, 3)  # child 1 settles first: child 0's drops are not counted yet
    assert counts.settle(0, 0, 3) == (True, 0, 6)
    assert counts.reserve(1, 0, True, lambda finished: 8) > 0  # child 1 got prompts back (a redo)
    assert counts.settle(0, 0, 3) == (False, 0, 6)
    assert counts.settle(1, 2, 3) == (True, 2, 6)


def test_a_run_whose_every_rollout_fails_ends_with_the_error_once_both_processes_are_idle():
    async def refuse(body):
        return 404, {"error": {"message": "The model `teacher` does not exist."}}

    rows = dataset(6, teacher_ids=("math",))
    with StubServer("student", flaky_student(rejected=(), flaky=())) as student, StubServer("math", refuse) as math:
        worker = RolloutWorker(config(student, math, end_index=6), rows, queue_maxsize=8)
        worker.start()
        try:
            source = WorkerSource(worker, max_staleness=0, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S,
                                  poll_s=0.2)
            with pytest.raises(RuntimeError, match=r"child [01] of 2 failed: RolloutsFailingError: every rollout of "
                               r"this run failed \(6 "
                               r"prompts dropped, none scored\); last \(teacher math\).*does not exist"):
                in_thread(lambda: drain(source))
        finally:
            worker.stop()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_dead_or_stopped_process_is_named_and_stop_ends_the_others():
    rows = dataset(8, teacher_ids=("math",))
    with StubServer("student", flaky_student(rejected=(), flaky=())) as student, \
            StubServer("teacher", teacher_stub(tag=1)) as teacher:
        worker = RolloutWorker(config(student, teacher), rows, queue_maxsize=2)
        worker.start()
        first, second = worker.pids
        try:
            os.kill(second, signal.SIGSTOP)  # stopped, it cannot beat
            wait_for(lambda: time.time() - worker._children[1].heartbeat.value > 1.5, "a beat 1.5 s old")
            with pytest.raises(RuntimeError, match=rf"heartbeat stale: .* the child 1 of 2 \(pid {second}\) is alive"):
                worker.check_health(stale_after_s=1.0)
            os.kill(second, signal.SIGKILL)
            wait_for(lambda: not worker._processes[1].is_alive(), "the killed child")
            with pytest.raises(RuntimeError, match=rf"worker child 1 of 2 \(pid {second}\) died \(exit code -9"):
                worker.check_health(stale_after_s=HEALTHY_S)
        finally:
            worker.stop(timeout_s=DEADLINE_S)
    assert not worker.is_alive() and worker._processes[0].exitcode == 0 and process_gone(first)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_every_child_ends_when_the_parent_is_killed(tmp_path):
    """A trainer SIGKILLed mid-run cannot stop its rollout processes: each notices it was re-parented and exits."""
    with StubServer("student", flaky_student(rejected=(), flaky=())) as student, \
            StubServer("math", teacher_stub(tag=9)) as math:
        script = tmp_path / "parent.py"
        script.write_text(textwrap.dedent(f"""
            import time
            from fastdistill.rollout import RetryPolicy, RolloutConfig, RolloutWorker
            if __name__ == "__main__":
                config = RolloutConfig({student.url!r}, {{"math": {math.url!r}}}, teacher_top_k=2, max_tokens=8,
                                       retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02),
                                       rollout_processes=2, max_inflight_tasks=4)
                rows = [{{"prompt_ids": [10 + i, 5, 6]}} for i in range(4)]
                worker = RolloutWorker(config, rows, queue_maxsize=2)
                worker.start()
                print(*worker.pids, flush=True)
                time.sleep(600)
        """))
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            children = [int(pid) for pid in parent.stdout.readline().split()]
            assert len(children) == 2 and not any(process_gone(child) for child in children)
            parent.send_signal(signal.SIGKILL)
            parent.wait(DEADLINE_S)
            deadline = time.monotonic() + DEADLINE_S
            while not all(process_gone(child) for child in children) and time.monotonic() < deadline:
                time.sleep(0.1)  # polling process states, not synchronising with them
            left = [child for child in children if not process_gone(child)]
            assert not left, f"rollout children {left} outlived their killed parent"
        finally:
            parent.kill()
            parent.wait()


def test_the_ceiling_benchmark_runs_one_and_two_processes_side_by_side(tmp_path):
    """bench_worker_ceiling.py's workers part at tiny sizes: a row per process count with finite costs and its
    projection (timings are never asserted: the machine may be busy)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_worker_ceiling.py"
    out = tmp_path / "ceiling.json"
    command = [sys.executable, str(script), "--parts", "workers", "--processes", "1", "2", "--workers-top-k", "4",
               "--workers-length", "16", "--workers-prompt-length", "8", "--workers-samples", "6",
               "--workers-warmup", "3", "--samples-per-step", "3", "--workers-repeats", "1", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| | P = 1 | P = 2 |" in proc.stdout and "processes for 200k tok/s" in proc.stdout
    rows = json.loads(out.read_text())["workers"]
    assert [row["processes"] for row in rows] == [1, 2]
    for row in rows:
        assert row["samples"] == 6 and len(row["child_busy"]) == row["processes"]
        assert math.isfinite(row["tok_s"]) and row["tok_s"] > 0 and row["child_us_per_token"] >= 0
        assert math.isfinite(row["trainer_side_us_per_token"]) and row["processes_for_target"] >= 0
