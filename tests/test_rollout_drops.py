"""Prompts the rollout gives up on reach the trainer as notices, and the rollout stops at the run's last prompt
(stub vLLM servers, no model)."""

from __future__ import annotations

import queue
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_rollout_worker import StubServer, config, dataset, student_stub, teacher_stub  # noqa: E402

from fastdistill.rollout import RolloutWorker, WorkerExhausted  # noqa: E402
from fastdistill.rollout.dropped import DroppedPrompt  # noqa: E402
from fastdistill.train.source import SourceExhausted, SynchronousSource  # noqa: E402

DEADLINE_S = 120.0  # generous: only reached when something is broken


def rejecting_teacher(rejected_first_tokens):
    score = teacher_stub(tag=1000)

    async def answer(body):
        if body["prompt"][0] in rejected_first_tokens:
            return 400, {"error": {"message": "teacher refuses this one"}}
        return await score(body)

    return answer


def test_worker_stops_at_end_index_and_names_the_teacher_that_refused():
    """end_index=7 over 5 rows: prompt ids 0..6 are dispatched (the cursor crosses into the second epoch) and no
    more, except row 3 (skip_rows); the teacher's 400 arrives as a notice naming that teacher and its message; the
    last item is the worker's "nothing left" notice."""
    with (StubServer("student", student_stub()) as student,
          StubServer("teacher", rejecting_teacher({11})) as teacher):
        rows = dataset(5, teacher_ids=("math",))  # first tokens 10..14; row 1 is refused by the teacher
        worker = RolloutWorker(config(student, {"math": teacher}, shuffle=False, end_index=7,
                                        skip_rows=frozenset({3})), rows,
                               queue_maxsize=16)
        worker.start()
        items = {}
        deadline = time.monotonic() + DEADLINE_S
        try:
            while len(items) < 6:
                assert time.monotonic() < deadline, f"only {sorted(items)} arrived"
                worker.check_health(stale_after_s=DEADLINE_S)
                try:
                    item = worker.samples.get(timeout=0.5)
                except queue.Empty:
                    continue
                items[item.prompt_id] = item
            # then the worker says it has nothing left, and nothing comes after that notice
            assert worker.samples.get(timeout=DEADLINE_S) == WorkerExhausted(redo_seen=0)
            assert worker.samples.empty()
        finally:
            worker.stop()
    assert sorted(items) == [0, 1, 2, 4, 5, 6]
    notices = {p: i for p, i in items.items() if isinstance(i, DroppedPrompt)}
    assert sorted(notices) == [1, 6]  # row 1 in both epochs
    assert {(n.reason, n.server, n.message, n.dataset_index) for n in notices.values()} == {
        ("rejected", "teacher math", "teacher refuses this one", 1)}
    assert student.requests == 6  # nothing dispatched past end_index, nor row 3


def test_synchronous_source_turns_failures_into_notices_and_ends():
    with (StubServer("student", student_stub(fail_400={12})) as student,
          StubServer("teacher", rejecting_teacher({13})) as teacher):
        rows = dataset(5, teacher_ids=("math",))
        source = SynchronousSource(rows, config(student, {"math": teacher}, shuffle=False, end_index=5), wave_size=2)
        items = [source.next(model_version=0) for _ in range(5)]
        with pytest.raises(SourceExhausted):
            source.next(model_version=0)
        source.close()
    notices = [i for i in items if isinstance(i, DroppedPrompt)]
    assert [(n.prompt_id, n.reason, n.server, n.message) for n in notices] == [
        (2, "rejected", "student", "context too long"), (3, "rejected", "teacher math", "teacher refuses this one")]
    assert [i.prompt_id for i in items if not isinstance(i, DroppedPrompt)] == [0, 1, 4]


def test_skip_rows_are_never_dispatched():
    with StubServer("student", student_stub()) as student, StubServer("teacher", teacher_stub(tag=1000)) as teacher:
        rows = dataset(4, teacher_ids=("math",))
        source = SynchronousSource(rows, config(student, {"math": teacher}, shuffle=False, end_index=8,
                                                skip_rows=frozenset({2})), wave_size=3)
        ids = []
        with pytest.raises(SourceExhausted):
            while True:
                ids.append(source.next(model_version=0).prompt_id)
        source.close()
    assert ids == [0, 1, 3, 4, 5, 7]


def test_end_index_before_start_index_is_refused():
    with pytest.raises(ValueError, match="end_index must be None or >= start_index=4, got 3"):
        config(StubServer("s", None), {"t": StubServer("t", None)}, start_index=4, end_index=3)
