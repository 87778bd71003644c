"""One rollout sequence for the worker, the synchronous source and evaluation, and the sources that say "no more".

Against stub servers (deterministic student, top-K and hidden-state teachers): the three callers produce the same
samples for the same prompts; the synchronous source scores a hidden-state teacher by its signal; a source whose
every rollout fails stops with the servers' error; the worker source ends when the worker has nothing left; cursors
with an annealed share end instead of searching forever; the worker's child ends when its parent is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_rollout_worker import (
    DEADLINE_S,
    FAST_RETRY,
    HEALTHY_S,
    TOP_K,
    PoolingStub,
    StubServer,
    dataset,
    student_completion,
    student_stub,
    teacher_stub,
)

from fastdistill.errors import RolloutsFailingError, SourceExhausted
from fastdistill.rollout import OnPolicyShare, RolloutConfig, RolloutSample, RolloutWorker
from fastdistill.rollout.dispatch import PromptDispatcher
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.train.evaluate import collect_scored_samples
from fastdistill.train.source import CacheSource, SynchronousSource, WorkerSource


def rollout_config(student, teachers, **overrides) -> RolloutConfig:
    settings = dict(teacher_top_k=TOP_K, max_tokens=8, max_inflight_tasks=4, retry=FAST_RETRY, seed=7)
    settings.update(overrides)
    return RolloutConfig(student.url, {name: server.url for name, server in teachers.items()}, **settings)


def drain(source, model_version: int = 0, limit: int = 1000) -> list:
    """Everything ``source`` gives until it is exhausted (at most ``limit`` items: a source that never ends fails)."""
    items = []
    for _ in range(limit):
        try:
            items.append(source.next(model_version))
        except SourceExhausted:
            return items
    raise AssertionError(f"the source gave {limit} items without saying it is exhausted")


def in_thread(function, timeout_s: float = DEADLINE_S):
    """``function()``'s result, or a failed test when it has not returned after ``timeout_s`` (a hang)."""
    result: dict = {}

    def run():
        try:
            result["value"] = function()
        except BaseException as error:  # re-raised in the test's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"no result after {timeout_s:g} s: the call hangs"
    if "error" in result:
        raise result["error"]
    return result["value"]


def arrays(sample):
    hidden = None if sample.teacher_hidden is None else sample.teacher_hidden.tolist()
    return (sample.input_ids.tolist(), sample.teacher_topk_ids.tolist(), sample.teacher_topk_logprobs.tolist(), hidden)


def test_the_worker_the_synchronous_source_and_evaluation_make_the_same_samples():
    """The same rows through the three callers of the one rollout sequence, top-K and hidden-state teachers mixed."""
    rows = dataset(6)
    with (StubServer("student", student_stub()) as student, StubServer("math", teacher_stub(tag=1000)) as math,
          PoolingStub("code", None) as code):
        teachers = {"math": math, "code": code}
        settings = dict(teacher_signals={"code": "hidden"}, teacher_hidden_dtype="float32", shuffle=False,
                        end_index=len(rows))
        worker = RolloutWorker(rollout_config(student, teachers, **settings), rows, queue_maxsize=16)
        worker.start()
        try:
            source = WorkerSource(worker, max_staleness=4, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S)
            from_worker = in_thread(lambda: drain(source))
        finally:
            worker.stop()
        synchronous = SynchronousSource(rows, rollout_config(student, teachers, **settings), wave_size=4)
        try:
            from_sync = drain(synchronous)
        finally:
            synchronous.close()
        from_eval = collect_scored_samples(student.url, {name: s.url for name, s in teachers.items()}, rows,
                                           top_k=TOP_K, max_tokens=8, teacher_signals={"code": "hidden"},
                                           hidden_dtype="float32", retry=FAST_RETRY)
    by_prompt = {sample.prompt_id: sample for sample in from_worker}
    assert sorted(by_prompt) == list(range(len(rows))) == [s.prompt_id for s in from_sync]
    assert [s.dataset_index for s in from_eval] == list(range(len(rows)))
    for index, row in enumerate(rows):
        expected = arrays(by_prompt[index])
        assert arrays(from_sync[index]) == expected == arrays(from_eval[index])
        assert expected[0] == row["prompt_ids"] + student_completion(row["prompt_ids"])
        assert (expected[3] is not None) == (row["teacher_id"] == "code")


def test_the_synchronous_source_scores_a_hidden_state_teacher_with_its_hidden_states():
    """``async_mode=False`` with ``teacher_signal: hidden``: the samples carry the pooling server's hidden rows (the
    synchronous source once asked a hidden-state server for ``prompt_logprobs`` and got HTTP 404 for every prompt)."""
    rows = dataset(4, teacher_ids=("dense",))
    with StubServer("student", student_stub()) as student, PoolingStub("dense", None) as dense:
        config = rollout_config(student, {"dense": dense}, teacher_signals={"dense": "hidden"},
                                teacher_hidden_dtype="float32", end_index=len(rows))
        source = SynchronousSource(rows, config, wave_size=2)
        try:
            samples = drain(source)
        finally:
            source.close()
    assert len(samples) == len(rows) and not any(isinstance(s, DroppedPrompt) for s in samples)
    for sample in samples:
        prompt = rows[sample.dataset_index]["prompt_ids"]
        sequence = prompt + student_completion(prompt)
        P = len(prompt)
        assert sample.teacher_hidden.tolist() == [[sequence[P - 1 + j], P - 1 + j, 0.5] for j in range(3)]


def test_a_synchronous_source_whose_every_rollout_fails_stops_with_the_servers_error():
    """Every teacher request is refused: the source stops after ``max_consecutive_failures`` drops with the server's
    own message, instead of walking through the whole dataset (or, with ``max_steps``, forever)."""

    async def refuse(body):
        return 404, {"error": {"message": "The model `teacher` does not exist."}}

    rows = dataset(200, teacher_ids=("math",))
    with StubServer("student", student_stub()) as student, StubServer("math", refuse) as math:
        config = rollout_config(student, {"math": math}, max_consecutive_failures=5)  # endless: no end_index
        source = SynchronousSource(rows, config, wave_size=4)
        try:
            with pytest.raises(RolloutsFailingError, match=r"5 rollouts in a row .*teacher math.*does not exist"):
                drain(source)
        finally:
            source.close()
        assert math.requests <= 8  # two waves of four at most, not the dataset


def test_the_worker_source_says_no_more_when_the_worker_has_nothing_left():
    """A mixed run's on-policy share after a resume: prompts 0..11 with 3 and 7 already trained, every other id
    on-policy. The worker dispatches the rest and then says it is exhausted; the source ends (it once waited
    forever for a sample the worker would never produce)."""
    rows = dataset(6, teacher_ids=("math",))
    share = OnPolicyShare(0.5)
    expected = [p for p in range(2, 12) if share.selects(p) and p not in (3, 7)]
    with StubServer("student", student_stub()) as student, StubServer("math", teacher_stub(tag=9)) as math:
        config = rollout_config(student, {"math": math}, start_index=2, end_index=12, skip_prompt_ids={3, 7},
                                on_policy=share)
        worker = RolloutWorker(config, rows, queue_maxsize=4)
        worker.start()
        try:
            source = WorkerSource(worker, max_staleness=0, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S,
                                  poll_s=0.2)
            got = [s.prompt_id for s in in_thread(lambda: drain(source))]
            assert source.exhausted
        finally:
            worker.stop()
    assert sorted(got) == expected


def test_a_redo_after_the_end_is_served_before_the_source_ends():
    rows = dataset(3, teacher_ids=("math",))
    with StubServer("student", student_stub()) as student, StubServer("math", teacher_stub(tag=9)) as math:
        worker = RolloutWorker(rollout_config(student, {"math": math}, end_index=3, shuffle=False), rows,
                               queue_maxsize=8)
        worker.start()
        try:
            source = WorkerSource(worker, max_staleness=0, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S,
                                  poll_s=0.2)
            # every sample was generated at version 0; at version 1 each is stale, dropped and redone
            fresh = in_thread(lambda: [source.next(0) for _ in range(3)])
            worker.model_version = 1
            worker.redo([fresh[0].prompt_id])  # as the stale-drop does
            again = in_thread(lambda: drain(source, model_version=1))
        finally:
            worker.stop()
    assert sorted(s.prompt_id for s in fresh) == [0, 1, 2]
    assert [s.prompt_id for s in again] == [fresh[0].prompt_id] and again[0].model_version == 1


def bare_config(**overrides) -> RolloutConfig:
    return RolloutConfig("http://127.0.0.1:9", {"t": "http://127.0.0.1:9"}, **overrides)


def test_a_cursor_whose_annealed_share_settles_at_zero_ends_at_its_horizon():
    """``lmbda`` annealed to ``lmbda_final=0`` with ``max_steps`` (no end index): past the horizon no prompt is
    on-policy, so the worker's cursor ends there (it once searched forever, blocking the worker's event loop)."""
    share = OnPolicyShare(0.5, 0.0, horizon=40)
    dispatcher = PromptDispatcher(bare_config(on_policy=share, shuffle=False), num_rows=7)
    dispatched = [dispatcher.next() for _ in range(41)]
    assert dispatched[-1] is None and dispatcher.exhausted
    ids = [d[0] for d in dispatched if d is not None]
    assert ids == [p for p in range(40) if share.selects(p)] and len(ids) == share.count(40)


def test_a_cache_cursor_whose_annealed_share_settles_at_one_ends_at_its_horizon():
    share = OnPolicyShare(0.25, 1.0, horizon=30)

    class Cache:
        def __len__(self):
            return 5

        def __getitem__(self, row):
            return RolloutSample(input_ids=np.array([1, 2], np.int32), completion_mask=np.array([0, 1], np.int32),
                                 teacher_topk_ids=np.zeros((1, 1), np.int32),
                                 teacher_topk_logprobs=np.zeros((1, 1), np.float32),
                                 rollout_logprobs=np.zeros(1, np.float32), model_version=-1, teacher_id="t",
                                 prompt_id=0, dataset_index=row)

    source = CacheSource(Cache(), seed=0, shuffle=True, start_index=0, end_index=None, skip_prompt_ids=frozenset(),
                         teacher_id="t", on_policy=share)
    ids = [s.prompt_id for s in in_thread(lambda: drain(source))]
    assert ids == [p for p in range(30) if not share.selects(p)]


def test_the_settled_point_of_a_share():
    assert OnPolicyShare(0.0).settled_from(on_policy=True) == 0
    assert OnPolicyShare(0.3).settled_from(on_policy=True) is None
    assert OnPolicyShare(0.3, 0.0, horizon=9).settled_from(on_policy=True) == 9
    assert OnPolicyShare(0.3, 0.0, horizon=9).settled_from(on_policy=False) is None
    assert OnPolicyShare(1.0).settled_from(on_policy=False) == 0
    assert OnPolicyShare(0.2, 1.0, horizon=5).settled_from(on_policy=False) == 5
    for share in (OnPolicyShare(0.3, 0.0, horizon=9), OnPolicyShare(0.2, 1.0, horizon=5)):
        for on_policy in (True, False):
            start = share.settled_from(on_policy)
            if start is not None:
                assert not any(share.selects(p) == on_policy for p in range(start, start + 200))


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its new parent to reap it counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_the_worker_child_ends_when_its_parent_is_killed(tmp_path):
    """A trainer SIGKILLed mid-run cannot stop its rollout worker: the child notices it was re-parented and exits."""
    with StubServer("student", student_stub(delay_s=0.05)) as student, \
            StubServer("math", teacher_stub(tag=9)) as math:
        script = tmp_path / "parent.py"
        script.write_text(textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from fastdistill.rollout import RolloutConfig, RolloutWorker
            from test_rollout_worker import FAST_RETRY, dataset
            if __name__ == "__main__":
                config = RolloutConfig({student.url!r}, {{"math": {math.url!r}}}, teacher_top_k=2, max_tokens=8,
                                       retry=FAST_RETRY)
                worker = RolloutWorker(config, dataset(4, teacher_ids=("math",)), queue_maxsize=2)
                worker.start()
                print(worker.pid, flush=True)
                time.sleep(600)
        """))
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            child = int(parent.stdout.readline())
            assert not process_gone(child)
            parent.send_signal(signal.SIGKILL)
            parent.wait(DEADLINE_S)
            deadline = time.monotonic() + DEADLINE_S
            while not process_gone(child) and time.monotonic() < deadline:
                time.sleep(0.1)  # polling a process state, not synchronising with it
            assert process_gone(child), f"the rollout child {child} outlived its killed parent"
        finally:
            parent.kill()
            parent.wait()


def test_the_rollout_child_imports_no_torch():
    """The worker's child (spawned fresh) runs a top-K rollout without importing torch: what it imports for that is
    what ``fastdistill.rollout.child`` imports."""
    code = "import sys, fastdistill.rollout.child, fastdistill.rollout.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False"


def test_a_short_run_whose_every_rollout_fails_ends_with_the_servers_error_not_as_trained():
    """Fewer prompts than ``max_consecutive_failures``, every teacher request refused: at the end of the prompts the
    synchronous source and the worker both stop with the server's message (the run once ended "successfully" after
    0 steps, every prompt dropped)."""

    async def refuse(body):
        return 404, {"error": {"message": "The model `teacher` does not exist."}}

    rows = dataset(4, teacher_ids=("math",))
    with StubServer("student", student_stub()) as student, StubServer("math", refuse) as math:
        config = rollout_config(student, {"math": math}, end_index=len(rows))
        source = SynchronousSource(rows, config, wave_size=2)
        try:
            with pytest.raises(RolloutsFailingError, match=r"every rollout of this run failed \(4 prompts dropped, "
                               r"none scored\); last \(teacher math\).*does not exist"):
                drain(source)
        finally:
            source.close()
        worker = RolloutWorker(config, rows, queue_maxsize=8)
        worker.start()
        try:
            source = WorkerSource(worker, max_staleness=0, stale_policy="drop", heartbeat_stale_after_s=HEALTHY_S,
                                  poll_s=0.2)
            with pytest.raises(RuntimeError, match=r"RolloutsFailingError: every rollout of this run failed"):
                in_thread(lambda: drain(source))
        finally:
            worker.stop()
