"""Batchers and micro-batch metrics: properties, parity with TRL 1.16's planners and collator metrics, errors."""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdistill.data import FixedCountBatcher, TokenBudgetBatcher, balance_by_squared_length, microbatch_metrics
from fastdistill.rollout import RolloutSample

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def sample(length: int, prompt_length: int = 1, arrival: int = 0, metrics: dict | None = None) -> RolloutSample:
    """A sample of ``length`` tokens (``prompt_length`` of them prompt); ``prompt_id`` records the arrival order."""
    completion = length - prompt_length
    return RolloutSample(
        input_ids=np.arange(length, dtype=np.int32),
        completion_mask=np.r_[np.zeros(prompt_length, np.int32), np.ones(completion, np.int32)],
        teacher_topk_ids=np.full((completion, 2), -1, np.int32),
        teacher_topk_logprobs=np.full((completion, 2), -np.inf, np.float32),
        rollout_logprobs=np.zeros(completion, np.float32),
        model_version=0,
        teacher_id="t0",
        prompt_id=arrival,
        dataset_index=arrival,
        metrics=metrics or {},
    )


def _len(s: RolloutSample) -> int:
    return len(s.input_ids)


def _trl():
    from trl.experimental.async_distillation import async_distillation_trainer

    return async_distillation_trainer


def _as_trl_examples(samples):
    """Dicts TRL's planners accept; each carries the sample object so the plans can be compared by identity."""
    return [{"input_ids": s.input_ids, "sample": s} for s in samples]


def _unwrap(trl_microbatch):
    return [[example["sample"] for example in row] for row in trl_microbatch]


# ---------------------------------------------------------------------------------------------------------------
# balance_by_squared_length


def test_balance_hand_made():
    samples = [sample(n, arrival=i) for i, n in enumerate([3, 5, 4, 4, 1])]
    rows = balance_by_squared_length(samples, 2)
    # 5 -> row 0 (25); 4 (arrival 2) -> row 1 (16); 4 (arrival 3) -> row 1 (32); 3 -> row 0 (34); 1 -> row 1.
    assert [[s.prompt_id for s in row] for row in rows] == [[1, 0], [2, 3, 4]]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), max_size=24), num_rows=st.integers(1, 5))
def test_balance_is_the_greedy_squared_length_rule(lengths, num_rows):
    samples = [sample(n, arrival=i) for i, n in enumerate(lengths)]
    rows = balance_by_squared_length(samples, num_rows)
    assert len(rows) == num_rows
    assert sorted(s.prompt_id for row in rows for s in row) == list(range(len(samples)))
    if len(samples) >= num_rows:
        assert all(rows)
    # Replay: visiting longest first (stable), each sample went to the then least-loaded row (lowest index on ties).
    placed = {id(s): r for r, row in enumerate(rows) for s in row}
    loads = [0] * num_rows
    for s in sorted(samples, key=_len, reverse=True):
        assert placed[id(s)] == loads.index(min(loads))
        loads[placed[id(s)]] += _len(s) ** 2
    # Same plan as TRL's own implementation.
    assert _unwrap(_trl()._balance_by_squared_length(_as_trl_examples(samples), num_rows)) == rows


# ---------------------------------------------------------------------------------------------------------------
# TokenBudgetBatcher


def _run(batcher, samples):
    emitted = []
    for s in samples:
        microbatch = batcher.add(s)
        if microbatch is not None:
            emitted.append((s, microbatch))
    return emitted


def test_token_budget_hand_made():
    batcher = TokenBudgetBatcher(token_budget=10, num_rows=2)
    samples = [sample(n, arrival=i) for i, n in enumerate([6, 6, 11, 3, 4, 5])]
    emitted = _run(batcher, samples)
    # 6 -> r0; 6 fits only r1; 11 is dropped; 3 fits both, equal loads (36, 36) -> r0; 4 fits only r1 (6 + 4 = 10);
    # 5 fits neither (9 + 5, 10 + 5) -> the micro-batch is emitted and 5 opens row 0 of the next one.
    assert [[[s.prompt_id for s in row] for row in mb] for _, mb in emitted] == [[[0, 3], [1, 4]]]
    assert emitted[0][0].prompt_id == 5
    assert [s.prompt_id for s in batcher.pending] == [5]
    assert batcher.dropped_oversize_total == 1


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), max_size=40),
    token_budget=st.integers(1, 40),
    num_rows=st.integers(1, 4),
)
def test_token_budget_properties_and_trl_parity(lengths, token_budget, num_rows):
    samples = [sample(n, arrival=i) for i, n in enumerate(lengths)]
    batcher = TokenBudgetBatcher(token_budget, num_rows)
    emitted = _run(batcher, samples)
    accepted = [s for s in samples if _len(s) <= token_budget]
    assert batcher.dropped_oversize_total == len(samples) - len(accepted)

    seen = []
    for closing, microbatch in emitted:
        assert len(microbatch) == num_rows and all(microbatch)
        for row in microbatch:
            assert sum(_len(s) for s in row) <= token_budget
            assert [s.prompt_id for s in row] == sorted(s.prompt_id for s in row)  # arrival order within a row
            # The closing sample fitted no row of the micro-batch it closed.
            assert sum(_len(s) for s in row) + _len(closing) > token_budget
        ids = sorted(s.prompt_id for row in microbatch for s in row)
        assert all(i < closing.prompt_id for i in ids)
        seen.extend(ids)
    # Every accepted sample is emitted exactly once, micro-batches in arrival order, the rest is still pending.
    pending = sorted(s.prompt_id for s in batcher.pending)
    assert seen + pending == [s.prompt_id for s in accepted]

    # TRL's drop path logs through accelerate (needs an initialised state), so it gets the accepted samples only.
    trl_batcher = _trl().TokenBudgetBatcher(_as_trl_examples(accepted), num_rows, token_budget, defaultdict(list))
    assert [_unwrap(mb) for mb in trl_batcher] == [mb for _, mb in emitted]


def test_oversize_drop_warns(caplog):
    batcher = TokenBudgetBatcher(token_budget=4, num_rows=1)
    with caplog.at_level(logging.WARNING, logger="fastdistill.data.batching"):
        assert batcher.add(sample(5, arrival=9)) is None
    assert batcher.dropped_oversize_total == 1 and batcher.pending == []
    assert "5 tokens that exceeds token_budget=4 (prompt_id=9)" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# FixedCountBatcher


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), max_size=40),
    samples_per_row=st.integers(1, 4),
    num_rows=st.integers(1, 3),
)
def test_fixed_count_properties_and_trl_parity(lengths, samples_per_row, num_rows):
    samples = [sample(n, arrival=i) for i, n in enumerate(lengths)]
    batcher = FixedCountBatcher(samples_per_row, num_rows)
    emitted = _run(batcher, samples)
    size = samples_per_row * num_rows
    assert len(emitted) == len(samples) // size
    for k, (closing, microbatch) in enumerate(emitted):
        assert closing.prompt_id == (k + 1) * size - 1
        assert sorted(s.prompt_id for row in microbatch for s in row) == list(range(k * size, (k + 1) * size))
        assert microbatch == balance_by_squared_length(samples[k * size : (k + 1) * size], num_rows)
        assert len(microbatch) == num_rows and all(microbatch)
    assert [s.prompt_id for s in batcher.pending] == list(range(len(emitted) * size, len(samples)))

    trl_batcher = _trl().FixedCountBatcher(_as_trl_examples(samples), num_rows, size)
    assert [_unwrap(mb) for mb in trl_batcher] == [mb for _, mb in emitted]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TokenBudgetBatcher(0, 2), "token_budget must be a positive int, got 0"),
        (lambda: TokenBudgetBatcher(128, 0), "num_rows must be a positive int, got 0"),
        (lambda: TokenBudgetBatcher(12.5, 1), "token_budget must be a positive int, got 12.5"),
        (lambda: FixedCountBatcher(0, 1), "samples_per_row must be a positive int, got 0"),
        (lambda: FixedCountBatcher(2, True), "num_rows must be a positive int, got True"),
        (lambda: balance_by_squared_length([], 0), "num_rows must be a positive int, got 0"),
    ],
)
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------------------------------------------------
# microbatch_metrics


def test_metrics_exact_values():
    # Row 0: lengths 4 (prompt 3) and 2 (prompt 1); row 1: length 6 (prompt 2).
    microbatch = [
        [sample(4, 3, metrics={"reward": 1.0}), sample(2, 1, metrics={"reward": math.nan})],
        [sample(6, 2, metrics={"reward": 3.0, "other": 2.0})],
    ]
    got = microbatch_metrics(microbatch, token_budget=8)
    assert got == {
        "sample/forwarded_tokens_mean": 4.0,  # (4 + 2 + 6) / 3
        "sample/forwarded_tokens_max": 6.0,
        "sample/trained_tokens_mean": 2.0,  # (1 + 1 + 4) / 3
        "batch/masked_token_frac": 0.5,  # (12 - 6) / 12
        "batch/samples_per_row": 1.5,
        "batch/row_tokens_mean": 6.0,
        "batch/row_tokens_max": 6.0,
        "batch/row_imbalance": 36 / 28,  # Σ L² = 20 and 36; mean 28
        "batch/row_fill_frac": 0.75,  # 12 / (8 * 2)
        "reward": 2.0,  # NaN-aware mean over the samples that carry it
        "other": 2.0,
    }
    assert "batch/row_fill_frac" not in microbatch_metrics(microbatch, token_budget=None)
    assert "batch/row_fill_frac" not in microbatch_metrics(microbatch, token_budget=0)
    assert math.isnan(microbatch_metrics([[sample(3, metrics={"x": math.nan})]], None)["x"])


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=4), min_size=1, max_size=3
    ),
    token_budget=st.sampled_from([0, 64]),
)
def test_metrics_match_trl_collator(rows, token_budget):
    """Same numbers as TRL 1.16's DataCollatorForRollout logs (rates reduced to one ratio; no pad_frac)."""
    microbatch = [[sample(p + n, p, metrics={"m": float(p)}) for p, n in row] for row in rows]
    sink = defaultdict(list)
    collator = _trl().DataCollatorForRollout(
        pad_token_id=0, num_processes=len(rows), metrics=sink, token_budget=token_budget
    )
    examples = [
        [{**s.to_trl_layout(), "teacher_id": "t0", "prompt_id": 0, "metrics": s.metrics} for s in row]
        for row in microbatch
    ]
    collator.torch_call([examples])
    expected = {}
    for key, (value,) in sink.items():
        if key == "batch/pad_frac":
            continue
        expected[key] = value[0] / value[1] if isinstance(value, tuple) else value
    got = microbatch_metrics(microbatch, token_budget)
    assert got.keys() == expected.keys()
    for key in got:
        assert got[key] == pytest.approx(expected[key], rel=1e-12), key


@pytest.mark.parametrize("microbatch", [[], [[sample(3)], []]])
def test_metrics_reject_empty_rows(microbatch):
    with pytest.raises(ValueError, match="non-empty list of non-empty rows"):
        microbatch_metrics(microbatch, None)
