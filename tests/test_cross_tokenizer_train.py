"""The trainer on cross-tokenizer samples (a teacher with another tokenizer), no server: the packed row's cross
targets against the samples', the trainer's loss against the cross-tokenizer losses called per sample on the same
hidden states (and a row that mixes in a same-tokenizer teacher), a few optimizer steps, held-out evaluation and
every configuration refusal."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastdistill.cross_tokenizer import TokenizerBytes, TokenizerPair, check_teacher_tokenizers
from fastdistill.data.packing import pack_row
from fastdistill.errors import ConfigError
from fastdistill.loss import narrow_support, sparse_jsd_loss
from fastdistill.loss.cross_losses import group_reverse_kl_pg_loss, hybrid_loss, uld_loss
from fastdistill.rollout import RolloutConfig
from fastdistill.tiny import build_model, save_pretrained_dir, tiny_config
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.cross_teachers import load_cross_teachers
from fastdistill.train.model import DistillationModel
from fastdistill.train.trainer import AsyncDistillationTrainer
from fastdistill_testing.cross_tokenizer_samples import (
    TEXTS,
    cross_tokenizer_samples,
    save_teacher_folder,
    student_tokenizer,
    teacher_tokenizer,
    tiny_teacher_model,
)
from fastdistill_testing.synthetic import synthetic_samples

URLS = {"same": "http://127.0.0.1:9", "cross": "http://127.0.0.1:10"}
TARGET_FIELDS = ("group_index", "group_start", "shared_ids", "shared_logprobs", "unshared_logprobs",
                 "continuation_logprob", "group_logprob")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny student (the student tokenizer, 409 ids), a teacher folder (the teacher tokenizer, a float64 tiny
    model), the trainer's vocabulary map, cross-tokenizer samples of every text and same-tokenizer samples."""
    tokenizer = student_tokenizer()
    student = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7)
    student_dir = save_pretrained_dir(student, tokenizer, tmp_path_factory.mktemp("student"))
    teacher_model = tiny_teacher_model()
    teacher_dir = save_teacher_folder(tmp_path_factory.mktemp("teacher"), teacher_model)
    pair = TokenizerPair.load(tokenizer, teacher_dir, student_vocab_size=len(tokenizer))
    student_bytes, teacher_bytes = TokenizerBytes.of(tokenizer), TokenizerBytes.of(teacher_tokenizer())
    cross = cross_tokenizer_samples(TEXTS, teacher_model=teacher_model, vocab=pair.vocab, top_k=4,
                                    student=student_bytes, teacher=teacher_bytes, teacher_id="cross")
    rng = np.random.default_rng(0)
    for sample in cross:  # rollout log-probs near the untrained student's (~ -6 on 409 ids): ratios about 1
        sample.rollout_logprobs[:] = rng.uniform(-8.0, -4.0, sample.rollout_logprobs.shape).astype(np.float32)
    same = synthetic_samples(build_model(tiny_config(len(tokenizer)), seed=3), len(tokenizer), 4, top_k=4,
                             teacher_ids=["same"], seed=1)
    return SimpleNamespace(student_dir=student_dir, teacher_dir=teacher_dir, pair=pair, cross=cross, same=same,
                           vocab_size=len(tokenizer))


def make_config(case, output_dir, **overrides) -> AsyncDistillationConfig:
    values = dict(model_name_or_path=str(case.student_dir), output_dir=str(output_dir), teacher_server_urls=URLS,
                  teacher_tokenizers={"cross": str(case.teacher_dir)}, teacher_top_k=4, weight_sync_backend="none",
                  learning_rate=1e-3, num_train_epochs=1, gradient_checkpointing=False, disable_tqdm=True,
                  save_strategy="no", token_budget=0, export_final_model=False)
    values.update(overrides)
    return AsyncDistillationConfig(**values)


def distillation_model(case, tmp_path, **overrides) -> DistillationModel:
    from transformers import AutoModelForCausalLM

    config = make_config(case, tmp_path, **overrides)
    model = DistillationModel(AutoModelForCausalLM.from_pretrained(case.student_dir), config)
    model.cross_teachers = load_cross_teachers(config, student_tokenizer(), vocab_size=case.vocab_size)
    return model


# ------------------------------------------------------------------------------------------------ packing


def test_packed_row_carries_each_samples_targets_per_trained_position(case):
    """Row order, empty rows for the same-tokenizer sample, group ids offset per sample, untrained positions out,
    and a group with an untrained position left out whole."""
    masked = dataclasses.replace(case.cross[3], completion_mask=case.cross[3].completion_mask.copy())
    t3 = masked.cross_targets
    sizes = np.bincount(t3.group_index[t3.group_index >= 0])
    big = int(np.argmax(sizes > 1))  # a group of several student tokens: mask its second token
    position = int(np.flatnonzero(t3.group_index == big)[1])
    masked.completion_mask[masked.prompt_length + position] = 0
    samples = [case.cross[0], case.same[0], masked]
    row = pack_row(samples, list(URLS), vocab_size=case.vocab_size)

    expected = {name: [] for name in TARGET_FIELDS}
    offset = 0
    for sample in samples:
        keep = sample.completion_mask[sample.prompt_length:] == 1
        t = sample.cross_targets
        length = len(keep)
        if t is None:
            rows = {"group_index": np.full(length, -1), "group_start": np.zeros(length, bool),
                    "shared_ids": np.full((length, 5), -1), "shared_logprobs": np.full((length, 5), -np.inf),
                    "unshared_logprobs": np.full((length, 4), -np.inf), "continuation_logprob": np.zeros(length),
                    "group_logprob": np.zeros(length)}
        else:
            rows = {name: getattr(t, name).copy() for name in TARGET_FIELDS}
            rows["group_index"] = np.where(t.group_index >= 0, t.group_index + offset, -1)
            dropped = set(t.group_index[~keep].tolist()) - {-1}
            out = np.isin(t.group_index, list(dropped))
            rows["group_index"] = np.where(out, -1, rows["group_index"])
            rows["group_start"] = t.group_start & ~out
            offset += t.num_groups
        for name in TARGET_FIELDS:
            expected[name].append(rows[name][keep])
    for name in TARGET_FIELDS:
        got = getattr(row, f"cross_{name}").numpy()
        torch.testing.assert_close(torch.from_numpy(got.astype(np.float64)),
                                   torch.from_numpy(np.concatenate(expected[name]).astype(np.float64)))
    assert row.cross_group_index.dtype == torch.int64 and row.cross_group_start.dtype == torch.bool
    assert row.num_cross_groups == case.cross[0].cross_targets.num_groups + t3.num_groups - 1
    # the cross samples' candidate rows are empty; the same-tokenizer sample's are its own
    cross_rows = row.teacher_index == 1
    assert bool((row.candidate_ids[cross_rows] == -1).all())
    assert bool((row.candidate_ids[~cross_rows] >= 0).any())
    assert pack_row(case.same[:2], list(URLS)).cross_group_index is None


def test_packing_refuses_mismatched_cross_targets(case):
    short = dataclasses.replace(case.cross[1], cross_targets=dataclasses.replace(
        case.cross[1].cross_targets, shared_ids=case.cross[1].cross_targets.shared_ids[:-1]))
    with pytest.raises(ValueError, match="cross_targets must have"):
        pack_row([short], list(URLS))
    top3 = cross_tokenizer_samples(TEXTS[:1], teacher_model=tiny_teacher_model(), vocab=case.pair.vocab, top_k=3,
                                   teacher_id="cross")
    with pytest.raises(ValueError, match="different \\(W, K\\) widths"):
        pack_row([case.cross[0], top3[0]], list(URLS))
    with pytest.raises(ValueError, match="outside the student's vocabulary"):
        pack_row([case.cross[0]], list(URLS), vocab_size=int(case.cross[0].cross_targets.shared_ids.max()))
    kinds = dataclasses.replace(case.same[0], teacher_id="cross")
    with pytest.raises(ValueError, match="cross-tokenizer targets, an earlier sample of that teacher has top-K"):
        pack_row([kinds, case.cross[0]], list(URLS))
    both = dataclasses.replace(case.cross[0], teacher_hidden=np.zeros((len(case.cross[0].rollout_logprobs), 4),
                                                                       np.float32))
    with pytest.raises(ValueError, match="not both"):
        pack_row([both], list(URLS))
    with_candidates = dataclasses.replace(case.same[0], cross_targets=case.cross[0].cross_targets)
    with pytest.raises(ValueError, match="no candidates"):
        pack_row([with_candidates], list(URLS))


# ---------------------------------------------------------------------------------------------- the loss


def per_sample_parts(model, samples):
    """Each sample's hidden states at its completion targets (one forward of that sample alone), its targets and
    realised tokens as tensors."""
    from fastdistill.logit_head import causal_lm_parts

    backbone, head = causal_lm_parts(model.model)
    parts = []
    for sample in samples:
        ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None]
        positions = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            hidden = backbone(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]
        p = sample.prompt_length
        rows = torch.arange(p - 1, ids.shape[1] - 1)
        t = {name: torch.from_numpy(np.asarray(getattr(sample.cross_targets, name))) for name in TARGET_FIELDS}
        parts.append(SimpleNamespace(hidden=hidden[rows], actual=ids[0, p:], targets=t,
                                     rollout=torch.from_numpy(sample.rollout_logprobs)))
    return head, parts


def row_loss(model, samples):
    row = pack_row(samples, list(URLS), vocab_size=model.model.config.vocab_size)
    ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)
    with torch.no_grad():
        return model(row, ids, lps, mask)


@pytest.mark.parametrize("loss", ["hybrid", "uld", "reverse_kl_pg"])
def test_trainer_loss_equals_the_cross_losses_on_the_same_hidden_states(case, tmp_path, loss):
    """A packed row of cross samples: the model's loss, groups and sums equal the loss functions called sample by
    sample (each forwarded alone) with the teacher's map and GOLD's weights; the group policy gradient with the
    clipped importance ratio. Tolerance: float32 forwards of a packed row against separate ones."""
    overrides = ({"loss_type": "reverse_kl_pg", "pg_importance_ratio": True, "pg_ratio_clip": 2.0}
                 if loss == "reverse_kl_pg" else {"cross_tokenizer_loss": loss, "beta": 0.5})
    model = distillation_model(case, tmp_path, **overrides)
    samples = case.cross[:4]
    out, metrics = row_loss(model, samples)
    head, parts = per_sample_parts(model, samples)
    shared = torch.from_numpy(case.pair.vocab.student_shared)
    w_shared, w_unshared = case.pair.vocab.gold_weights()
    loss_sum, groups, jsd, uld = 0.0, 0, 0.0, 0.0
    for p in parts:
        t = p.targets
        with torch.no_grad():
            if loss == "hybrid":
                ref = hybrid_loss(p.hidden, head.weight, p.actual, t["group_index"], t["group_start"],
                                  t["shared_ids"], t["shared_logprobs"], t["unshared_logprobs"],
                                  t["continuation_logprob"], shared, shared_weight=w_shared,
                                  unshared_weight=w_unshared, beta=0.5)
            elif loss == "uld":
                ref = uld_loss(p.hidden, head.weight, p.actual, t["group_index"], t["group_start"],
                               t["unshared_logprobs"], t["continuation_logprob"])
            else:
                ref = group_reverse_kl_pg_loss(p.hidden, head.weight, p.actual, t["group_index"], t["group_start"],
                                               t["group_logprob"], rollout_logprobs=p.rollout, ratio_clip=2.0,
                                               sampling_temperature=1.0)
        if loss == "reverse_kl_pg":
            loss_sum += float(ref.reverse_kl_sum)
            groups += int(ref.num_tokens)
        else:
            loss_sum += float(ref.loss)
            groups += int(ref.num_groups)
            jsd += float(ref.jsd_sum)
            uld += float(ref.uld_sum)
        if loss == "reverse_kl_pg":
            p.pg = ref
    assert groups == sum(s.cross_targets.num_groups for s in samples) == int(out.num_tokens)
    assert float(out.cross_groups) == groups
    if loss == "reverse_kl_pg":
        assert float(out.loss) == pytest.approx(sum(float(p.pg.loss) for p in parts), rel=1e-4, abs=1e-4)
        advantage = sum(float(p.pg.advantage_sum) for p in parts) / groups
        assert metrics["pg/advantage_mean"] == pytest.approx(advantage, rel=1e-4, abs=1e-5)
        assert metrics["pg/ratio_max"] == pytest.approx(max(float(p.pg.ratio_max) for p in parts), rel=1e-4)
        clipped = sum(float(p.pg.clipped) for p in parts)
        assert metrics["pg/clip_frac"] == pytest.approx(clipped / groups) and 0 < clipped < groups
    else:
        assert float(out.loss) == pytest.approx(loss_sum, rel=1e-4, abs=1e-5)
        assert float(out.cross_jsd_sum) == pytest.approx(jsd, rel=1e-4, abs=1e-5)
        assert float(out.cross_uld_sum) == pytest.approx(uld, rel=1e-4, abs=1e-5)
        assert (jsd > 0) == (loss == "hybrid") and uld > 0
    assert float(out.jsd_sum) == pytest.approx(loss_sum, rel=1e-4, abs=1e-4)
    # per teacher: the cross teacher (index 1) has the groups and the loss sum
    assert float(out.per_teacher[1, 0]) == groups and float(out.per_teacher[0, 0]) == 0
    assert float(out.per_teacher[1, 1]) == pytest.approx(loss_sum, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("loss_type", ["jsd", "reverse_kl_pg"])
def test_mixed_row_adds_the_same_tokenizer_loss(case, tmp_path, loss_type):
    """Same-tokenizer and cross-tokenizer samples in one row: the result is the same-tokenizer targets' own loss
    (sparse JSD, or the sampled-token policy gradient) plus the cross ones' (hybrid, or the group policy gradient);
    each teacher's share is its own, and the policy gradient's metrics count both parts' entries."""
    model = distillation_model(case, tmp_path, loss_type=loss_type)
    out, metrics = row_loss(model, [case.same[0], case.cross[0], case.same[1], case.cross[1]])
    same_only, same_metrics = row_loss(model, [case.same[0], case.same[1]])
    cross_only, cross_metrics = row_loss(model, [case.cross[0], case.cross[1]])
    tol = dict(rel=1e-4, abs=1e-5)
    if loss_type == "reverse_kl_pg":
        counts = int(same_only.num_tokens), int(cross_only.num_tokens)
        mean = (same_metrics["pg/advantage_mean"] * counts[0] + cross_metrics["pg/advantage_mean"] * counts[1])
        assert metrics["pg/advantage_mean"] == pytest.approx(mean / sum(counts), **tol)
    assert float(out.loss) == pytest.approx(float(same_only.loss) + float(cross_only.loss), **tol)
    assert int(out.num_tokens) == int(same_only.num_tokens) + int(cross_only.num_tokens)
    assert float(out.per_teacher[0, 1]) == pytest.approx(float(same_only.jsd_sum), **tol)
    assert float(out.per_teacher[1, 1]) == pytest.approx(float(cross_only.jsd_sum), **tol)
    if loss_type == "reverse_kl_pg":
        return
    # the same-tokenizer part is the sparse JSD of those targets alone
    row = pack_row([case.same[0], case.same[1]], list(URLS))
    from fastdistill.logit_head import causal_lm_parts

    backbone, head = causal_lm_parts(model.model)
    with torch.no_grad():
        hidden = backbone(input_ids=row.input_ids, position_ids=row.position_ids,
                          use_cache=False).last_hidden_state[0][row.target_positions]
        ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)
        ref = sparse_jsd_loss(hidden, head.weight, ids, lps, mask)
    assert float(same_only.jsd_sum) == pytest.approx(float(ref.jsd_sum), **tol)


def test_cross_targets_without_a_loaded_map_are_refused(case, tmp_path):
    model = distillation_model(case, tmp_path)
    model.cross_teachers = {}
    with pytest.raises(ValueError, match="no vocabulary map"):
        row_loss(model, case.cross[:1])


# --------------------------------------------------------------------------------------------- training


def test_a_few_steps_lower_the_hybrid_loss_and_log_the_cross_metrics(case, tmp_path):
    """The same 3 cross samples (with 1 same-tokenizer one) trained for 5 steps through the trainer (``samples=``,
    no server): the hybrid loss per group goes down; the first step's logged values equal the model's on the
    untrained student; groups per step are the samples' groups."""
    batch = [case.cross[0], case.cross[3], case.cross[4], case.same[0]]
    steps = 5
    samples = [dataclasses.replace(s, prompt_id=step * len(batch) + i, dataset_index=i)
               for step in range(steps) for i, s in enumerate(batch)]
    first, _ = row_loss(distillation_model(case, tmp_path), batch)
    config = make_config(case, tmp_path / "run", per_device_train_batch_size=len(batch), max_steps=steps)
    summary = AsyncDistillationTrainer(config, samples=samples).train()
    assert summary["steps"] == steps
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    groups = sum(s.cross_targets.num_groups for s in batch[:3])
    assert [r["batch/cross_groups_per_step"] for r in records] == [groups] * steps
    assert records[0]["loss"] == pytest.approx(float(first.jsd_sum) / int(first.num_tokens), rel=1e-4)
    assert records[0]["cross/jsd"] == pytest.approx(float(first.cross_jsd_sum) / groups, rel=1e-4)
    assert records[0]["cross/uld"] == pytest.approx(float(first.cross_uld_sum) / groups, rel=1e-4)
    cross = [r["teacher_jsd/cross"] for r in records]
    assert cross[-1] < cross[0], cross


# -------------------------------------------------------------------------------------------- evaluation


def test_held_out_evaluation_reports_the_cross_loss(case, tmp_path, monkeypatch):
    """eval/teacher_jsd/cross is the hybrid loss per group of the held-out cross samples; the collection is asked
    with the teacher tokenizers (what the servers would answer is stood in for by given samples)."""
    import fastdistill.train.evaluate as evaluate

    held_out = [case.cross[5], case.cross[6], case.same[2]]
    seen = {}

    def collect(*args, **kwargs):
        seen.update(kwargs)
        return held_out

    monkeypatch.setattr(evaluate, "collect_scored_samples", collect)
    rows = [{"prompt": [{"role": "user", "content": "Say something."}], "teacher_id": s.teacher_id}
            for s in held_out]
    config = make_config(case, tmp_path / "run", per_device_train_batch_size=2, max_steps=1)
    AsyncDistillationTrainer(config, samples=case.cross[:2], eval_dataset=rows).train()
    assert seen["teacher_tokenizers"] == {"cross": str(case.teacher_dir)}
    assert seen["student_tokenizer"] == str(case.student_dir)
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    expected, _ = row_loss(distillation_model(case, tmp_path), held_out[:2])
    assert logged["eval/teacher_jsd/cross"] == pytest.approx(float(expected.jsd_sum) / int(expected.num_tokens),
                                                             rel=1e-4)
    assert "eval/teacher_jsd/same" in logged


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides,field", [
    ({"teacher_tokenizers": {"nope": "/t"}}, "teacher_tokenizers"),
    ({"teacher_tokenizers": {"cross": ""}}, "teacher_tokenizers"),
    ({"teacher_signal": {"cross": "hidden"}}, "teacher_signal"),
    ({"loss_type": "reverse_kl_mc", "num_student_queries": 2, "top_k": 8}, "loss_type"),
    ({"loss_type": "reverse_kl_student_topk", "num_student_queries": 2}, "loss_type"),
    ({"loss_type": "reverse_kl_pg", "pg_importance_ratio": True, "pg_stabilizer": "ppo_clip"}, "pg_stabilizer"),
    ({"loss_type": "reverse_kl_pg", "cross_tokenizer_loss": "uld"}, "cross_tokenizer_loss"),
    ({"loss_type": "reverse_kl_pg", "cross_tokenizer_weights": [1.0, 1.0]}, "cross_tokenizer_weights"),
    ({"stale_policy": "importance"}, "stale_policy"),
    ({"add_tail_bucket": False}, "add_tail_bucket"),
    ({"tail_mode": "trl"}, "tail_mode"),
    ({"cross_tokenizer_loss": "gold"}, "cross_tokenizer_loss"),
    ({"cross_tokenizer_weights": [1.0]}, "cross_tokenizer_weights"),
    ({"cross_tokenizer_weights": [0.0, 0.0]}, "cross_tokenizer_weights"),
    ({"cross_tokenizer_weights": [-1.0, 1.0]}, "cross_tokenizer_weights"),
    ({"cross_tokenizer_loss": "uld", "cross_tokenizer_weights": [1.0, 1.0]}, "cross_tokenizer_weights"),
    ({"teacher_tokenizers": None, "cross_tokenizer_weights": [1.0, 1.0]}, "cross_tokenizer_weights"),
    ({"teacher_tokenizers": None, "cross_tokenizer_loss": "uld"}, "cross_tokenizer_loss"),
])
def test_config_refusals_name_the_options(case, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field) as error:
        make_config(case, tmp_path, **overrides)
    if overrides.get("teacher_tokenizers", {}) is not None and field != "teacher_tokenizers":
        assert "teacher_tokenizers" in str(error.value) or "cross_tokenizer" in str(error.value)


def test_both_configs_refuse_a_hidden_cross_teacher_by_the_one_rule(case, tmp_path):
    """The rollout's and the trainer's configs check teacher_tokenizers with one function: a hidden-state teacher with
    its own tokenizer is refused with the same reason, each naming its own signal option."""
    with pytest.raises(ConfigError, match="teacher_signal must") as trainer_error:
        make_config(case, tmp_path, teacher_signal={"cross": "hidden"})
    with pytest.raises(ConfigError, match="teacher_signals must") as rollout_error:
        RolloutConfig(student_url="http://s", teacher_urls=URLS, teacher_tokenizers={"cross": "/t"},
                      student_tokenizer="/s", teacher_signals={"cross": "hidden"})
    reason = "teacher 'cross' is a hidden-state teacher and has its own tokenizer"
    trainer_why, rollout_why = (str(e.value).partition(reason)[1:] for e in (trainer_error, rollout_error))
    assert trainer_why[0] == reason and trainer_why == rollout_why


def test_the_teacher_tokenizers_rule_directly():
    """check_teacher_tokenizers: the cross teachers in configuration order; refusals name the option."""
    rule = dict(hidden_ids=[], student_queries="none", signal_option=("teacher_signal", "topk"),
                queries_option=("loss_type", "jsd"))
    assert check_teacher_tokenizers({"b": "/b", "a": "/a"}, ["a", "c", "b"], **rule) == ["a", "b"]
    assert check_teacher_tokenizers(None, ["a"], **rule) == check_teacher_tokenizers({}, ["a"], **rule) == []
    with pytest.raises(ConfigError, match="teacher_tokenizers must be None or a mapping"):
        check_teacher_tokenizers(["/a"], ["a"], **rule)
    with pytest.raises(ConfigError, match=r"teacher_tokenizers\['a'\] must be a tokenizer folder"):
        check_teacher_tokenizers({"a": 3}, ["a"], **rule)
    with pytest.raises(ConfigError, match=r"teachers \['a', 'b'\] are hidden-state teachers"):
        check_teacher_tokenizers({"a": "/a", "b": "/b"}, ["a", "b"], **{**rule, "hidden_ids": ["b", "a"]})
    assert check_teacher_tokenizers({"a": "/a"}, ["a", "b"], **{**rule, "hidden_ids": ["b"]}) == ["a"]
    with pytest.raises(ConfigError, match=r"loss_type='reverse_kl_mc' asks the teacher .* teachers \['a'\]"):
        check_teacher_tokenizers({"a": "/a"}, ["a"], **{**rule, "student_queries": "samples",
                                                        "queries_option": ("loss_type", "reverse_kl_mc")})


def test_teacher_cache_with_teacher_tokenizers_is_refused(case, tmp_path):
    with pytest.raises(ConfigError, match="teacher_cache.*teacher_tokenizers"):
        make_config(case, tmp_path, teacher_cache=str(tmp_path), teacher_server_urls={"cross": URLS["cross"]})


def test_a_teacher_tokenizer_that_does_not_load_is_a_config_error(case, tmp_path):
    config = make_config(case, tmp_path, teacher_tokenizers={"cross": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="teacher_tokenizers\\['cross'\\]"):
        load_cross_teachers(config, student_tokenizer(), vocab_size=case.vocab_size)


def test_fixed_weights_replace_golds(case, tmp_path):
    config = make_config(case, tmp_path, cross_tokenizer_weights=[0.25, 2.0])
    teachers = load_cross_teachers(config, student_tokenizer(), vocab_size=case.vocab_size)
    assert (teachers[1].shared_weight, teachers[1].unshared_weight) == (0.25, 2.0)
    gold = load_cross_teachers(make_config(case, tmp_path), student_tokenizer(), vocab_size=case.vocab_size)
    assert (gold[1].shared_weight, gold[1].unshared_weight) == case.pair.vocab.gold_weights()
    assert torch.equal(gold[1].student_shared, torch.from_numpy(case.pair.vocab.student_shared))
