"""pack_row: layout, alignment against TRL's own collator + shift, packed attention on a tiny Qwen3, errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from fastdistill.data import PackedRow, pack_row
from fastdistill.rollout import RolloutSample
from fastdistill.tiny import tiny_config

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

VOCAB = 300


def make_sample(
    rng: np.random.Generator,
    prompt_length: int,
    completion_length: int,
    top_k: int = 3,
    *,
    teacher_id: str = "t0",
    prompt_id: int = 0,
    model_version: int = 0,
    completion_mask_drop: float = 0.0,
) -> RolloutSample:
    """A scored sample shaped like the worker's: top-K distinct ids by rank, the realised token in slot K when it
    is outside the top-K, a few rows shortened with -1/-inf padding; ``completion_mask_drop`` zeroes a fraction of
    the completion mask (positions forwarded but not trained, as a custom worker may produce)."""
    input_ids = rng.integers(3, VOCAB, prompt_length + completion_length).astype(np.int32)
    ids = np.full((completion_length, top_k + 1), -1, np.int32)
    lps = np.full((completion_length, top_k + 1), -np.inf, np.float32)
    for j in range(completion_length):
        valid = int(rng.integers(1, top_k + 1))
        ids[j, :valid] = rng.choice(np.arange(3, VOCAB), valid, replace=False)
        actual = input_ids[prompt_length + j]
        if actual not in ids[j, :valid]:
            ids[j, top_k] = actual
        lps[j][ids[j] >= 0] = np.sort(rng.normal(-2.0, 1.0, int((ids[j] >= 0).sum())).astype(np.float32))[::-1]
    mask = np.concatenate([np.zeros(prompt_length, np.int32), np.ones(completion_length, np.int32)])
    if completion_mask_drop:
        mask[prompt_length:] *= (rng.random(completion_length) >= completion_mask_drop).astype(np.int32)
    return RolloutSample(
        input_ids=input_ids,
        completion_mask=mask,
        teacher_topk_ids=ids,
        teacher_topk_logprobs=lps,
        rollout_logprobs=rng.normal(-1.0, 0.5, completion_length).astype(np.float32),
        model_version=model_version,
        teacher_id=teacher_id,
        prompt_id=prompt_id,
        dataset_index=prompt_id,
    )


def sample_offsets(samples) -> list[int]:
    """[0, o_1, ..., T]: where each sample starts in the packed row, from the samples' own lengths."""
    return np.cumsum([0] + [len(sample.input_ids) for sample in samples]).tolist()


def test_layout_of_a_hand_made_row():
    rng = np.random.default_rng(0)
    a = make_sample(rng, 2, 3, teacher_id="b", prompt_id=7, model_version=4)
    b = make_sample(rng, 1, 0, teacher_id="a", prompt_id=8, model_version=5)  # empty completion
    c = make_sample(rng, 3, 2, teacher_id="a", prompt_id=9, model_version=6)
    row = pack_row([a, b, c], ["a", "b"])

    assert row.input_ids.dtype == torch.int64 and row.input_ids.shape == (1, 11)
    assert row.input_ids[0].tolist() == [*a.input_ids, *b.input_ids, *c.input_ids]
    assert row.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4]
    # a's completion tokens sit at 2, 3, 4 (predicted from 1, 2, 3); c's at 6+3, 6+4 (predicted from 8, 9).
    assert row.target_positions.dtype == torch.int64 and row.target_positions.tolist() == [1, 2, 3, 8, 9]
    assert row.actual_ids.tolist() == [*a.input_ids[2:], *c.input_ids[3:]]
    assert torch.equal(
        row.candidate_ids, torch.from_numpy(np.concatenate([a.teacher_topk_ids, c.teacher_topk_ids])).long()
    )
    assert row.candidate_ids.dtype == torch.int64 and row.candidate_ids.shape == (5, 4)
    assert row.candidate_logprobs.dtype == torch.float32
    assert torch.equal(
        row.candidate_logprobs, torch.from_numpy(np.concatenate([a.teacher_topk_logprobs, c.teacher_topk_logprobs]))
    )
    assert row.rollout_logprobs.tolist() == [*a.rollout_logprobs.tolist(), *c.rollout_logprobs.tolist()]
    assert row.teacher_index.tolist() == [1, 1, 1, 0, 0]
    assert row.token_sample.tolist() == [0, 0, 0, 2, 2]
    assert row.model_versions.dtype == torch.int64 and row.model_versions.tolist() == [4, 5, 6]
    assert row.prompt_ids == [7, 8, 9]
    assert (row.num_tokens, row.num_samples, row.num_trained) == (11, 3, 5)


def test_completion_positions_with_mask_zero_are_forwarded_not_trained():
    rng = np.random.default_rng(1)
    sample = make_sample(rng, 2, 4)
    sample.completion_mask[3] = 0  # completion token 1
    row = pack_row([sample], ["t0"])
    assert row.num_tokens == 6
    assert row.target_positions.tolist() == [1, 3, 4]
    assert torch.equal(row.candidate_ids, torch.from_numpy(sample.teacher_topk_ids[[0, 2, 3]]).long())
    assert row.rollout_logprobs.tolist() == sample.rollout_logprobs[[0, 2, 3]].tolist()


def _trl_collator_view(samples_per_row, teacher_ids):
    """TRL 1.16's DataCollatorForRollout on the same samples, then compute_loss's strip-padding + next-token shift
    ("drop the first element, shift by one"): per row, the positions j where completion_mask[j+1] == 1 and the
    shifted arrays there."""
    from trl.experimental.async_distillation.async_distillation_trainer import DataCollatorForRollout

    mapping = {t: i for i, t in enumerate(teacher_ids)} if len(teacher_ids) > 1 else None
    collator = DataCollatorForRollout(pad_token_id=0, num_processes=len(samples_per_row), teacher_id_to_idx=mapping)
    examples = [
        [{**s.to_trl_layout(), "teacher_id": s.teacher_id, "prompt_id": s.prompt_id, "metrics": {}} for s in row]
        for row in samples_per_row
    ]
    batch = collator.torch_call([examples])
    views = []
    for r in range(len(samples_per_row)):
        real = batch["attention_mask"][r].bool()
        ids = batch["input_ids"][r][real]
        shifted_mask = batch["completion_mask"][r][real][1:]
        trained = shifted_mask.nonzero().squeeze(1)
        view = {
            "input_ids": ids,
            "position_ids": batch["position_ids"][r][real],
            "target_positions": trained,
            "candidate_ids": batch["teacher_topk_ids"][r][real][1:][trained],
            "candidate_logprobs": batch["teacher_topk_logprobs"][r][real][1:][trained],
            "actual_ids": ids[1:][trained],
        }
        if mapping is not None:
            view["teacher_index"] = batch["teacher_id_idx"][r][real][1:][trained]
        views.append(view)
    return views


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(
        st.lists(
            st.tuples(st.integers(1, 6), st.integers(0, 6), st.sampled_from(["x", "y", "z"])), min_size=1, max_size=4
        ),
        min_size=1,
        max_size=3,
    ),
    top_k=st.integers(1, 4),
    num_teachers=st.sampled_from([1, 3]),
    drop=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_alignment_matches_trl_collator_and_shift(rows, top_k, num_teachers, drop, seed):
    rng = np.random.default_rng(seed)
    teacher_ids = ["x", "y", "z"][:num_teachers]
    samples_per_row = [
        [
            make_sample(rng, p, n, top_k, teacher_id=t if num_teachers > 1 else "x", completion_mask_drop=drop)
            for p, n, t in row
        ]
        for row in rows
    ]
    views = _trl_collator_view(samples_per_row, teacher_ids)
    for samples, trl in zip(samples_per_row, views, strict=True):
        ours = pack_row(samples, teacher_ids)
        for key, expected in trl.items():
            got = getattr(ours, key)
            got = got[0] if key in ("input_ids", "position_ids") else got
            assert torch.equal(got, expected.to(got.dtype)), key
        # The selected arrays are exactly TRL's valid region: every target has the same teacher row as TRL.
        assert ours.num_trained == int(sum(int(s.completion_mask.sum()) for s in samples))


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_each_target_predicts_its_own_samples_completion_token(shapes, seed):
    """Structural invariants, sample by sample: target t and t+1 lie in the same sample, t+1 is its completion
    token j (position P+j), and the candidate row is that sample's row j."""
    rng = np.random.default_rng(seed)
    samples = [make_sample(rng, p, n, 2, prompt_id=i) for i, (p, n) in enumerate(shapes)]
    row = pack_row(samples, ["t0"])
    cu = sample_offsets(samples)
    for m in range(row.num_trained):
        t, s = int(row.target_positions[m]), int(row.token_sample[m])
        assert cu[s] <= t and t + 1 < cu[s + 1]
        j = int(row.position_ids[0, t + 1]) - samples[s].prompt_length
        assert j >= 0
        assert (
            int(row.input_ids[0, t + 1])
            == int(row.actual_ids[m])
            == int(samples[s].input_ids[samples[s].prompt_length + j])
        )
        assert row.candidate_ids[m].tolist() == samples[s].teacher_topk_ids[j].tolist()
    assert row.position_ids[0].tolist() == [i for p, n in shapes for i in range(p + n)]


def test_to_device_moves_every_tensor():
    rng = np.random.default_rng(2)
    row = pack_row([make_sample(rng, 2, 3), make_sample(rng, 1, 2)], ["t0"])
    moved = row.to("meta")
    assert isinstance(moved, PackedRow) and moved is not row
    for name, value in vars(moved).items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "meta", name
            assert value.dtype == getattr(row, name).dtype and value.shape == getattr(row, name).shape, name
    assert moved.prompt_ids == row.prompt_ids and row.input_ids.device.type == "cpu"


# ---------------------------------------------------------------------------------------------------------------
# Packed attention on a tiny Qwen3: no attention mask, position_ids restarting per sample.


@pytest.fixture(scope="module")
def packed_case():
    rng = np.random.default_rng(3)
    samples = [
        make_sample(rng, p, n, 2, prompt_id=i) for i, (p, n) in enumerate([(4, 6), (1, 1), (7, 3), (2, 9), (3, 0)])
    ]
    return samples, pack_row(samples, ["t0"])


def _tiny_model(attn_implementation: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(VOCAB), attn_implementation=attn_implementation).eval()
    assert model.config._attn_implementation == attn_implementation
    return model


def _alone(model, samples) -> list[torch.Tensor]:
    with torch.no_grad():
        return [
            model.model(input_ids=torch.from_numpy(s.input_ids).long()[None], use_cache=False).last_hidden_state[0]
            for s in samples
        ]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_forward_equals_each_sample_alone(packed_case, attn_implementation):
    samples, row = packed_case
    model = _tiny_model(attn_implementation)
    with torch.no_grad():
        packed = model.model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).last_hidden_state[
            0
        ]
    alone = _alone(model, samples)
    cu = sample_offsets(samples)
    for s, hidden in enumerate(alone):
        assert (packed[cu[s] : cu[s + 1]] - hidden).abs().max() <= 1e-5, s

    # And the targets: log-probs read at target_positions / actual_ids are each sample's own next-token log-probs.
    logprobs = torch.log_softmax(model.lm_head(packed[row.target_positions]), -1)
    ours = logprobs.gather(1, row.actual_ids[:, None])[:, 0]
    expected = []
    for sample, hidden in zip(samples, alone, strict=True):
        p = sample.prompt_length
        lp = torch.log_softmax(model.lm_head(hidden[p - 1 : -1]), -1)
        expected.append(lp.gather(1, torch.from_numpy(sample.input_ids[p:]).long()[:, None])[:, 0])
    assert (ours - torch.cat(expected)).abs().max() <= 1e-5


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_an_attention_mask_lets_packed_samples_attend_to_each_other(packed_case, attn_implementation):
    """Negative control: with an (all-ones) attention_mask, transformers skips its packed-sequence detection and
    every sample after the first attends to the ones before it. This is why the trainer must not pass one."""
    samples, row = packed_case
    model = _tiny_model(attn_implementation)
    with torch.no_grad():
        masked = model.model(
            input_ids=row.input_ids,
            position_ids=row.position_ids,
            attention_mask=torch.ones_like(row.input_ids),
            use_cache=False,
        ).last_hidden_state[0]
    alone = _alone(model, samples)
    cu = sample_offsets(samples)
    assert (masked[: cu[1]] - alone[0]).abs().max() <= 1e-5  # the first sample has nothing before it
    for s in range(1, len(samples)):
        assert (masked[cu[s] : cu[s + 1]] - alone[s]).abs().max() > 1e-2, s


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_empty_list_is_an_error():
    with pytest.raises(ValueError, match="at least one sample"):
        pack_row([], ["t0"])


def test_unknown_teacher_names_the_known_ids():
    sample = make_sample(np.random.default_rng(0), 2, 2, teacher_id="physics")
    with pytest.raises(ValueError, match=r"unknown teacher_id 'physics'; known teacher ids: \['math', 'code'\]"):
        pack_row([sample], ["math", "code"])


@pytest.mark.parametrize(
    ("teacher_ids", "match"),
    [([], "teacher_ids is empty"), (["a", "a"], "duplicates"), ("t0", "not the string")],
)
def test_bad_teacher_ids(teacher_ids, match):
    with pytest.raises(ValueError, match=match):
        pack_row([make_sample(np.random.default_rng(0), 2, 2)], teacher_ids)


def test_inconsistent_candidate_widths():
    rng = np.random.default_rng(0)
    with pytest.raises(
        ValueError, match=r"sample 1 \(prompt_id=5\) has 3 candidate slots per position, sample 0 has 5"
    ):
        pack_row([make_sample(rng, 2, 2, 4), make_sample(rng, 2, 2, 2, prompt_id=5)], ["t0"])


def _malformed(change):
    sample = make_sample(np.random.default_rng(0), 3, 4, prompt_id=11)
    change(sample)
    return sample


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: setattr(s, "teacher_topk_logprobs", s.teacher_topk_logprobs[:, :2]), "need equal shapes"),
        (lambda s: setattr(s, "teacher_topk_logprobs", s.teacher_topk_ids.copy()), "need equal shapes"),
        (lambda s: setattr(s, "rollout_logprobs", s.rollout_logprobs[:3]), r"expected \(4,\)"),
        (lambda s: setattr(s, "completion_mask", s.completion_mask[:-1]), "completion_mask has shape"),
        (lambda s: setattr(s, "input_ids", s.input_ids[3:]), "at least one token"),
        (lambda s: setattr(s, "input_ids", s.input_ids.astype(np.float32)), "1-D integer array"),
        (lambda s: setattr(s, "input_ids", s.input_ids.tolist()), "must be a numpy array"),
        (lambda s: setattr(s, "teacher_topk_ids", s.teacher_topk_ids[:, 0]), r"2-D \(L, K\+1\)"),
        (lambda s: setattr(s, "teacher_topk_ids", s.teacher_topk_ids[:, :0]), "no candidate slots"),
        (lambda s: s.completion_mask.__setitem__(0, 1), "0 on the 3 prompt positions"),
        (lambda s: s.completion_mask.__setitem__(5, 2), "must be 0/1"),
    ],
)
def test_malformed_sample(change, match):
    with pytest.raises(ValueError, match=rf"sample 0 \(prompt_id=11\) is malformed: .*{match}"):
        pack_row([_malformed(change)], ["t0"])


def test_not_a_rollout_sample():
    with pytest.raises(ValueError, match="expected a RolloutSample, got dict"):
        pack_row([{"input_ids": [1, 2]}], ["t0"])
