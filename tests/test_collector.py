"""The window collector alone (no model, no server): what is trained, what is dropped, and when the run ends."""

from __future__ import annotations

import numpy as np
import pytest

from fastdistill.data.batching import FixedCountBatcher, TokenBudgetBatcher
from fastdistill.rollout import RolloutSample
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.train.checkpoint import RolloutState
from fastdistill.train.collector import SourceExhausted, WindowCollector


def sample(prompt_id: int, length: int = 6, prompt_length: int = 2) -> RolloutSample:
    completion = length - prompt_length
    return RolloutSample(
        input_ids=np.arange(length, dtype=np.int32),
        completion_mask=np.concatenate([np.zeros(prompt_length, np.int32), np.ones(completion, np.int32)]),
        teacher_topk_ids=np.zeros((completion, 2), np.int32),
        teacher_topk_logprobs=np.zeros((completion, 2), np.float32),
        rollout_logprobs=np.zeros(completion, np.float32),
        model_version=0, teacher_id="a", prompt_id=prompt_id, dataset_index=prompt_id % 1000,
    )


def dropped(prompt_id: int) -> DroppedPrompt:
    return DroppedPrompt(prompt_id=prompt_id, dataset_index=prompt_id, reason="rejected", message="HTTP 400: no",
                         server="teacher a")


class Stream:
    """A source over a list; raises SourceExhausted at its end when ``finite``, else fails the test (a collector
    that keeps asking after the run's last prompt would hang on a real worker)."""

    def __init__(self, items, finite: bool = False):
        self.items = list(items)
        self.finite = finite
        self.taken = 0

    def next(self, model_version: int):
        if self.taken == len(self.items):
            if self.finite:
                raise SourceExhausted
            raise AssertionError("the collector asked for a sample after the run's last prompt")
        self.taken += 1
        return self.items[self.taken - 1]


def collector(total, world_size=1, batch=2, ga=1, budget=None, state=None) -> WindowCollector:
    def make():
        return TokenBudgetBatcher(budget, world_size) if budget else FixedCountBatcher(batch, world_size)

    return WindowCollector(total_prompts=total, world_size=world_size, microbatches_per_step=ga, make_batcher=make,
                           state=state or RolloutState(), token_budget=budget)


def run(c: WindowCollector, source) -> list:
    """Collect every window, marking its prompts trained as the trainer does after the step."""
    windows = []
    while (window := c.collect(source, 0)) is not None:
        windows.append(window)
        for prompt_id in window.prompt_ids:
            c.state.add(prompt_id)
        assert len(windows) < 100
    return windows


def test_a_dropped_prompt_counts_as_done_and_the_run_ends():
    c = collector(total=5, batch=2)
    source = Stream([sample(0), dropped(1), sample(2), sample(3), sample(4)])
    windows = run(c, source)
    assert [w.prompt_ids for w in windows] == [[0, 2], [3, 4]]
    assert windows[-1].last and not windows[0].last
    assert source.taken == 5
    drops = c.take_drops()
    assert [(d.prompt_id, d.reason, d.message) for d in drops] == [(1, "rejected", "HTTP 400: no")]
    assert c.take_drops() == []  # taken once
    assert c.state.prompt_index == 5


def test_the_last_prompt_dropped_ends_the_run_without_waiting_for_another_sample():
    c = collector(total=3, batch=2)
    windows = run(c, Stream([sample(0), sample(1), dropped(2)]))
    assert [w.prompt_ids for w in windows] == [[0, 1]]
    assert c.state.is_trained(2)


def test_a_notice_for_a_prompt_already_done_or_waiting_is_ignored():
    c = collector(total=4, batch=2)
    windows = run(c, Stream([sample(0), dropped(0), sample(1), sample(2), dropped(2), sample(3)]))
    assert [w.prompt_ids for w in windows] == [[0, 1], [2, 3]]
    assert c.take_drops() == []


def test_oversize_samples_are_dropped_listed_and_the_run_ends():
    c = collector(total=4, budget=10)
    windows = run(c, Stream([sample(0, 6), sample(1, 11), sample(2, 5), sample(3, 4)]))
    assert sorted(p for w in windows for p in w.prompt_ids) == [0, 2, 3]
    (drop,) = c.take_drops()
    assert (drop.prompt_id, drop.reason) == (1, "oversize")
    assert drop.message == "prompt + completion = 11 tokens, more than token_budget=10"
    counters = c.take_counters()
    assert counters.dropped == {"oversize": 1}


@pytest.mark.parametrize("num_prompts", [25, 1, 3])
def test_a_remainder_below_the_world_size_gets_ghost_rows(num_prompts):
    world_size, batch = 2, 2
    c = collector(total=num_prompts, world_size=world_size, batch=batch)
    windows = run(c, Stream([sample(i, 4 + i % 5) for i in range(num_prompts)]))
    trained = sorted(p for w in windows for p in w.prompt_ids)
    assert trained == list(range(num_prompts))
    for window in windows[:-1]:
        assert all(sum(len(row) for row in mb) == world_size * batch and all(mb) for mb in window.microbatches)
    final = windows[-1].microbatches[-1]
    assert windows[-1].last and len(final) == world_size
    left = num_prompts % (world_size * batch) or world_size * batch
    assert sum(len(row) for row in final) == left
    assert sum(1 for row in final if not row) == max(0, world_size - left)  # empty rows come last
    assert [bool(row) for row in final] == sorted((bool(row) for row in final), reverse=True)


def test_samples_out_of_the_run_or_already_trained_or_pending_are_discarded():
    state = RolloutState()
    state.add(1)  # trained before a resume
    c = collector(total=4, batch=3, state=state)
    windows = run(c, Stream([sample(0), sample(1), sample(0), sample(7), sample(2), sample(3)]))
    assert [w.prompt_ids for w in windows] == [[0, 2, 3]]
    assert c.take_counters().discarded_total == 3


def test_resume_with_holes_trains_each_remaining_prompt_once():
    state = RolloutState()
    for prompt_id in (0, 1, 3, 6):
        state.add(prompt_id)
    c = collector(total=8, batch=2, ga=2, state=state)
    windows = run(c, Stream([sample(i) for i in (2, 4, 5, 7)]))
    assert [w.prompt_ids for w in windows] == [[2, 4, 5, 7]]
    assert windows[0].last and len(windows[0].microbatches) == 2


def test_an_exhausted_source_flushes_what_is_pending():
    c = collector(total=None, batch=4)
    windows = run(c, Stream([sample(i) for i in range(6)], finite=True))
    assert [w.prompt_ids for w in windows] == [[0, 1, 2, 3], [4, 5]]
    assert c.collect(Stream([], finite=True), 0) is None


def test_an_unbounded_run_never_calls_a_window_last():
    c = collector(total=None, batch=2)
    window = c.collect(Stream([sample(0), sample(1)]), 0)
    assert window.prompt_ids == [0, 1] and not window.last
    assert c.remaining() == float("inf")


def test_a_full_window_that_takes_the_last_prompts_is_last():
    c = collector(total=4, batch=2, ga=2)
    window = c.collect(Stream([sample(i) for i in range(4)]), 0)
    assert window.last and window.num_samples == 4


def test_total_prompts_must_not_be_negative():
    with pytest.raises(ValueError, match="total_prompts must be None or >= 0, got -1"):
        collector(total=-1)
