"""The on-policy share of a run that mixes in a teacher cache (``lmbda``, annealed to ``lmbda_final``): which prompt
ids are generated on-policy, checked against exact rational sums, and how the trainer and MixedSource use it."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from fastdistill.errors import ConfigError
from fastdistill.rollout import OnPolicyShare, RolloutConfig, RolloutSample, is_on_policy
from fastdistill.train.collector import SourceExhausted
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.source import ListSource, MixedSource


def exact_sums(n_max: int, start: Fraction, final: Fraction, horizon: int) -> list[Fraction]:
    """[Σ_{j<n} share(j) for n = 0 … n_max] in exact rationals, the shares added one by one."""
    sums = [Fraction(0)]
    for j in range(n_max):
        sums.append(sums[-1] + start + (final - start) * Fraction(min(j, horizon), horizon))
    return sums


@pytest.mark.parametrize("fraction", ["0", "1/4", "1/3", "1/2", "7/10", "1"])
def test_a_fixed_share_selects_floor_n_times_the_share(fraction):
    share = OnPolicyShare(float(Fraction(fraction)))
    for n in range(0, 400):
        assert share.count(n) == math.floor(n * Fraction(fraction)) or n * Fraction(fraction) % 1 == 0
        assert sum(share.selects(p) for p in range(n)) == share.count(n)
    assert [is_on_policy(p, float(Fraction(fraction))) for p in range(50)] == [share.selects(p) for p in range(50)]


@pytest.mark.parametrize(("start", "final", "horizon"), [("1/4", "3/4", 32), ("0", "1", 1000), ("9/10", "1/10", 333),
                                                          ("1/2", "1/2", 10), ("0", "1/3", 7)])
def test_an_annealed_share_matches_the_exact_sum_and_spreads_evenly(start, final, horizon):
    """Annealed from ``start`` to ``final`` over ``horizon`` prompts, then held: the number of on-policy ids among
    every prefix is the exact floor of the summed shares (fp64 is far from a rounding boundary on these), every
    stretch of consecutive ids holds its exact share within one, and the share after the horizon is ``final``."""
    s, f = Fraction(start), Fraction(final)
    share = OnPolicyShare(float(s), float(f), horizon)
    n_max = horizon + 200
    picks = [share.selects(p) for p in range(n_max)]
    prefix = [0]
    for pick in picks:
        prefix.append(prefix[-1] + pick)
    exact = exact_sums(n_max, s, f, horizon)
    mismatches = [n for n in range(n_max + 1) if prefix[n] != math.floor(exact[n])]
    # the fp64 sum can land a hair below an integer the exact sum reaches: allowed only there, and off by one
    assert all(exact[n].denominator == 1 and prefix[n] == exact[n] - 1 for n in mismatches), mismatches
    for a in range(0, n_max - 16, 5):
        expected = exact[a + 16] - exact[a]
        assert abs(sum(picks[a:a + 16]) - expected) < 1 + 1e-9
    tail = picks[horizon:]
    assert abs(sum(tail) - f * len(tail)) <= 1


def test_share_settings_are_checked():
    with pytest.raises(ValueError, match=r"on-policy share start must be in \[0, 1\], got 1.5"):
        OnPolicyShare(1.5)
    with pytest.raises(ValueError, match=r"on-policy share final must be in \[0, 1\], got -0.1"):
        OnPolicyShare(0.5, -0.1, 10)
    with pytest.raises(ValueError, match="an annealed on-policy share needs a horizon of >= 1 prompts, got None"):
        OnPolicyShare(0.5, 1.0)
    with pytest.raises(ValueError, match="on_policy must be None or an OnPolicyShare, got 0.5"):
        RolloutConfig(student_url="http://127.0.0.1:9", teacher_urls={"default": "http://127.0.0.1:10"}, on_policy=0.5)


def sample(prompt_id: int, model_version: int) -> RolloutSample:
    return RolloutSample(input_ids=np.array([1, 2, 3], np.int32), completion_mask=np.array([0, 1, 1], np.int32),
                         teacher_topk_ids=np.zeros((2, 1), np.int32),
                         teacher_topk_logprobs=np.zeros((2, 1), np.float32),
                         rollout_logprobs=np.zeros(2, np.float32), model_version=model_version, teacher_id="default",
                         prompt_id=prompt_id, dataset_index=prompt_id)


@pytest.mark.parametrize("first_prompt", [0, 13])
def test_a_mixed_source_follows_an_annealed_share(first_prompt):
    """Online samples (model_version 0, the ids the share selects) and cached ones (version -1, the others),
    interleaved: after n samples from the resume point, the online ones number the share's count over those
    prompt ids, so the per-step share rises from lmbda to lmbda_final; every prompt is taken once."""
    share = OnPolicyShare(0.1, 0.9, 64)
    ids = range(first_prompt, 64)
    online = ListSource([sample(p, 0) for p in ids if share.selects(p)])
    cached = ListSource([sample(p, -1) for p in ids if not share.selects(p)])
    mixed = MixedSource(online, cached, share, first_prompt=first_prompt)
    taken = []
    while True:
        try:
            taken.append(mixed.next(model_version=0))
        except SourceExhausted:
            break
    assert sorted(s.prompt_id for s in taken) == list(ids)
    for n in range(len(taken) + 1):
        assert sum(s.model_version == 0 for s in taken[:n]) == share.count(first_prompt + n) - share.count(first_prompt)
    steps = [sum(s.model_version == 0 for s in taken[a:a + 8]) for a in range(0, len(taken) - 7, 8)]
    assert steps[0] < steps[-1]


def base_config(**overrides) -> AsyncDistillationConfig:
    values = dict(model_name_or_path="m", teacher_cache="cache", lmbda=0.25, async_mode=True)
    values.update(overrides)
    return AsyncDistillationConfig(**values)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"teacher_cache": None, "lmbda": 0.0, "lmbda_final": 0.5},
     "lmbda_final must be None without teacher_cache"),
    ({"lmbda_final": 1.5}, r"lmbda_final must be in \[0.0, 1.0\]"),
    ({"lmbda": 0.0, "lmbda_final": 0.5, "async_mode": False},
     "async_mode must be True with teacher_cache and lmbda > 0 or lmbda_final > 0"),
])
def test_lmbda_final_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        base_config(**overrides)


def test_a_share_that_starts_at_zero_still_mixes():
    assert base_config(lmbda=0.0, lmbda_final=0.5).mixes_on_policy
    assert not base_config(lmbda=0.0, lmbda_final=0.0, verify_weight_sync=False).mixes_on_policy
    assert not base_config(lmbda=0.0, verify_weight_sync=False).mixes_on_policy


@pytest.mark.parametrize(("overrides", "total_prompts", "expected"), [
    ({}, 40, OnPolicyShare(0.25)),
    ({"lmbda_final": 0.75}, 40, OnPolicyShare(0.25, 0.75, 40)),  # max_steps=-1: every prompt of every epoch
    ({"lmbda_final": 0.75, "max_steps": 5, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
     None, OnPolicyShare(0.25, 0.75, 5 * 4 * 2 * 3)),  # max_steps × batch × GA × world (3 ranks)
])
def test_the_trainer_anneals_over_the_runs_prompts(overrides, total_prompts, expected):
    from fastdistill.train.trainer import AsyncDistillationTrainer

    trainer = SimpleNamespace(config=base_config(**overrides), total_prompts=total_prompts,
                              dist=SimpleNamespace(world_size=3))
    assert AsyncDistillationTrainer._on_policy_share(trainer) == expected


def test_the_share_is_a_plain_value():
    assert dataclasses.replace(OnPolicyShare(0.5), final=0.5, horizon=3) == OnPolicyShare(0.5, 0.5, 3)
