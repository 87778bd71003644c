"""Training from an offline teacher cache (``teacher_cache``): no server, every cached row trained once per epoch
(across a resume too), and the settings that need servers refused."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdistill.cache import TeacherCache, score_dataset
from fastdistill.errors import ConfigError
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.trainer import AsyncDistillationTrainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_teacher_cache import FAST_RETRY, StubTeacher, conversations  # noqa: E402

NUM_ROWS = 12


@pytest.fixture(scope="module")
def cache_and_student(tmp_path_factory):
    """(cache folder of NUM_ROWS rows scored by a stub teacher, student folder with the same tokenizer)."""
    tokenizer = build_tokenizer()
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    cache = tmp_path_factory.mktemp("cache")
    with StubTeacher(tokenizer) as stub:
        score_dataset(conversations(NUM_ROWS), stub.url, cache, top_k=4, tokenizer=str(tokenizer_dir),
                      rows_per_shard=5, retry=FAST_RETRY)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=5), tokenizer,
                                  tmp_path_factory.mktemp("student"))
    return cache, student


def cache_config(cache: Path, student: Path, output: Path, **overrides) -> AsyncDistillationConfig:
    values = dict(model_name_or_path=str(student), output_dir=str(output), teacher_cache=str(cache),
                  per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-3, token_budget=0,
                  gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", export_final_model=False,
                  vllm_server_base_url="http://127.0.0.1:9", teacher_server_urls={"default": "http://127.0.0.1:10"})
    values.update(overrides)
    return AsyncDistillationConfig(**values)


def trained_ids(output: Path) -> list[int]:
    lines = (output / "trained_prompts.jsonl").read_text().splitlines()
    return [p for line in lines if line.strip() for p in json.loads(line)["prompt_ids"]]


def test_a_cache_trains_every_row_once_per_epoch_without_servers(cache_and_student, tmp_path):
    cache, student = cache_and_student
    config = cache_config(cache, student, tmp_path / "run", export_final_model=True)
    trainer = AsyncDistillationTrainer(config)
    before = {k: v.clone() for k, v in trainer.hf_model.state_dict().items()}
    summary = trainer.train()  # the server URLs lead nowhere: nothing asks them
    assert summary["steps"] == 2 * NUM_ROWS // 4 and summary["model_version"] == 0
    assert sorted(trained_ids(tmp_path / "run")) == list(range(2 * NUM_ROWS))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["loss"] > 0 for r in records)
    after = trainer.hf_model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # each epoch visits every cached row once: prompt p trains row row_of_prompt(p)
    from fastdistill.rollout import row_of_prompt

    rows = [row_of_prompt(p, NUM_ROWS, config.seed) for p in range(2 * NUM_ROWS)]
    assert sorted(rows[:NUM_ROWS]) == list(range(NUM_ROWS)) == sorted(rows[NUM_ROWS:])
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_the_trained_loss_is_the_loss_of_the_cached_rows(cache_and_student, tmp_path):
    """One step on the cache equals one step on the same rows given as samples (the online path's loss)."""
    cache, student = cache_and_student
    config = cache_config(cache, student, tmp_path / "cached", max_steps=1, shuffle=False)
    cached = AsyncDistillationTrainer(config).train()
    rows = TeacherCache(cache)
    import dataclasses

    samples = [dataclasses.replace(rows[i], prompt_id=i) for i in range(4)]
    direct_config = cache_config(cache, student, tmp_path / "direct", max_steps=1, shuffle=False)
    direct_config.teacher_cache = None
    direct = AsyncDistillationTrainer(direct_config, samples=samples).train()
    loss = [json.loads(line)["loss"] for line in (tmp_path / "cached" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line)["loss"] for line in (tmp_path / "direct" / "metrics.jsonl").read_text().splitlines()]
    assert loss == expected and cached["steps"] == direct["steps"] == 1


def test_a_resumed_cache_run_trains_every_prompt_exactly_once(cache_and_student, tmp_path):
    cache, student = cache_and_student
    output = tmp_path / "run"
    first = cache_config(cache, student, output, max_steps=2, save_strategy="steps", save_steps=2)
    AsyncDistillationTrainer(first).train()
    assert sorted(trained_ids(output)) != list(range(2 * NUM_ROWS))  # stopped part way
    resumed = cache_config(cache, student, output, save_strategy="steps", save_steps=2,
                           resume_from_checkpoint="latest")
    summary = AsyncDistillationTrainer(resumed).train()
    assert summary["steps"] == 2 * NUM_ROWS // 4
    assert sorted(trained_ids(output)) == list(range(2 * NUM_ROWS))


def test_a_cache_scored_with_another_tokenizer_is_refused(cache_and_student, tmp_path):
    cache, _ = cache_and_student
    other = build_tokenizer(["a completely different corpus", "with other words entirely"])
    student = save_pretrained_dir(build_model(tiny_config(len(other) + 8), seed=1), other, tmp_path / "other")
    with pytest.raises(ConfigError, match="was scored with another tokenizer"):
        AsyncDistillationTrainer(cache_config(cache, student, tmp_path / "run"))


def test_a_missing_or_corrupted_cache_is_a_config_error(cache_and_student, tmp_path):
    cache, student = cache_and_student
    with pytest.raises(ConfigError, match="teacher_cache: "):
        AsyncDistillationTrainer(cache_config(tmp_path / "nowhere", student, tmp_path / "run"))
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(cache, broken)
    shard = sorted(broken.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="teacher_cache: shard .* is corrupted: its sha256"):
        AsyncDistillationTrainer(cache_config(broken, student, tmp_path / "run"))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train_dataset": "rows.jsonl"}, "train_dataset must be None with teacher_cache"),
    ({"eval_dataset": "held.jsonl"}, "eval_dataset must be None with teacher_cache"),
    ({"loss_type": "reverse_kl_pg"}, "loss_type must be 'jsd' with teacher_cache"),
    ({"stale_policy": "importance"}, "stale_policy must be 'drop' with teacher_cache"),
    ({"verify_weight_sync": True}, "verify_weight_sync must be False with teacher_cache"),
    ({"teacher_cache": ""}, "teacher_cache must be None or a cache folder path"),
])
def test_settings_that_need_servers_are_refused(overrides, message):
    values = {"model_name_or_path": "m", "teacher_cache": "cache", **overrides}
    with pytest.raises(ConfigError, match=message):
        AsyncDistillationConfig(**values)


def test_a_cache_serves_one_teacher(cache_and_student, tmp_path):
    cache, student = cache_and_student
    config = cache_config(cache, student, tmp_path / "run",
                          teacher_server_urls={"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"})
    with pytest.raises(ConfigError, match="teacher_cache holds one teacher's scores"):
        AsyncDistillationTrainer(config)


@pytest.mark.vllm
def test_score_mix_and_train_from_the_cache_with_real_servers(tmp_path, tiny_servers):
    """The offline workflow end to end against real vLLM (the session's tiny pair): the teacher scores the training
    and held-out rows once; a run whose on-policy share anneals from lmbda=0.25 to lmbda_final=0.75 generates that
    share of each step's prompts on-policy (student server, weight sync; its cold sync puts this student's weights
    on the server) and takes the rest from the cache, every prompt once; then a run from the cache alone, given no
    server, lowers the held-out divergence (scored by the same teacher)."""
    from fractions import Fraction

    from transformers import AutoModelForCausalLM

    from fastdistill.train.evaluate import divergence_per_token

    tokenizer = build_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=11), tokenizer,
                                      tmp_path / "student")
    rows = conversations(40)
    student, teacher = tiny_servers.student, tiny_servers.teacher
    train = score_dataset(rows[:32], teacher.url, tmp_path / "cache", top_k=8, rows_per_shard=16, concurrency=4)
    held = score_dataset(rows[32:], teacher.url, tmp_path / "held", top_k=8, concurrency=4)
    assert train.manifest_written and held.manifest_written
    mixed = cache_config(tmp_path / "cache", student_dir, tmp_path / "mixed", lmbda=0.25, lmbda_final=0.75,
                         num_train_epochs=1,
                         per_device_train_batch_size=8, max_completion_length=8, teacher_top_k=8,
                         vllm_server_base_url=student.url, teacher_server_urls={"default": teacher.url},
                         verify_weight_sync=True, heartbeat_stale_after_s=60.0)
    summary = AsyncDistillationTrainer(mixed).train()
    assert summary["steps"] == 32 // 8 and summary["model_version"] == 1 + 32 // 8  # cold sync + one per step
    assert sorted(trained_ids(tmp_path / "mixed")) == list(range(32))
    records = [json.loads(line) for line in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    # the share of prompt j is 1/4 + (3/4 - 1/4)·j/32; the first n prompts hold floor(Σ_{j<n} share) on-policy ones
    on_policy = [math.floor(sum(Fraction(1, 4) + Fraction(j, 64) for j in range(n))) for n in (0, 8, 16, 24, 32)]
    assert [r["sample/on_policy_frac"] for r in records] == [(b - a) / 8 for a, b in itertools.pairwise(on_policy)]
    assert on_policy == [0, 2, 5, 10, 15]
    assert all(r["sync/served_logprob_gap"] <= 1e-4 for r in records)

    held_out = list(TeacherCache(tmp_path / "held"))  # no server from here on
    before = divergence_per_token(AutoModelForCausalLM.from_pretrained(student_dir).eval(), held_out, ["default"])
    config = cache_config(tmp_path / "cache", student_dir, tmp_path / "run", num_train_epochs=4, learning_rate=3e-3,
                          per_device_train_batch_size=8, export_final_model=True)
    summary = AsyncDistillationTrainer(config).train()
    assert summary["steps"] == 4 * 32 // 8
    after = divergence_per_token(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval(), held_out,
                                 ["default"])
    assert after < 0.9 * before, (before, after)


def test_on_policy_ids_hold_their_share_of_every_stretch():
    from fastdistill.rollout import is_on_policy

    for fraction in (0.0, 0.25, 1 / 3, 0.5, 0.7, 1.0):
        picks = [is_on_policy(p, fraction) for p in range(300)]
        for n in range(301):
            assert sum(picks[:n]) == math.floor(n * fraction)  # the increments telescope
        for start in range(0, 290):
            window = sum(picks[start:start + 8])
            assert abs(window - 8 * fraction) < 1 + 1e-9


def test_a_mixed_source_interleaves_its_share_and_takes_every_prompt_once(cache_and_student):
    """MixedSource with a stand-in for the worker (the on-policy ids as samples): every step's 4 samples hold 2
    on-policy ones, and the two sources together give every prompt id once."""
    import dataclasses

    from fastdistill.rollout import OnPolicyShare, is_on_policy
    from fastdistill.train.collector import SourceExhausted
    from fastdistill.train.source import CacheSource, ListSource, MixedSource

    cache = TeacherCache(cache_and_student[0])
    total = 2 * NUM_ROWS
    online_ids = [p for p in range(total) if is_on_policy(p, 0.5)]
    online = ListSource([dataclasses.replace(cache[0], prompt_id=p, model_version=0) for p in online_ids])
    cached = CacheSource(cache, seed=0, shuffle=True, start_index=0, end_index=total, skip_prompt_ids=frozenset(),
                         teacher_id="default", on_policy=OnPolicyShare(0.5))
    mixed = MixedSource(online, cached, OnPolicyShare(0.5))
    taken = []
    while True:
        try:
            taken.append(mixed.next(model_version=0))
        except SourceExhausted:
            break
    assert sorted(s.prompt_id for s in taken) == list(range(total))
    for step in range(0, total, 4):
        assert sum(s.model_version == 0 for s in taken[step:step + 4]) == 2
    assert mixed.metrics["sample/on_policy_frac"].count((1.0, 1.0)) == len(online_ids)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"teacher_cache": None, "lmbda": 0.5}, "lmbda must be 0.0 without teacher_cache"),
    ({"lmbda": 1.5}, r"lmbda must be in \[0.0, 1.0\]"),
    ({"lmbda": 0.5, "async_mode": False}, "async_mode must be True with teacher_cache and lmbda > 0"),
])
def test_lmbda_settings_are_checked(overrides, message):
    values = {"model_name_or_path": "m", "teacher_cache": "cache", **overrides}
    with pytest.raises(ConfigError, match=message):
        AsyncDistillationConfig(**values)


def test_a_mixed_run_may_evaluate_and_verify():
    config = AsyncDistillationConfig(model_name_or_path="m", teacher_cache="cache", lmbda=0.25,
                                     eval_dataset="held.jsonl", verify_weight_sync=True)
    assert config.lmbda == 0.25


def test_a_mixed_run_builds_its_prompts_from_the_cache_and_drops_only_the_prompts_it_generates(cache_and_student,
                                                                                              tmp_path):
    """``lmbda=0.5`` with ``skip_long_prompts``: the prompt table holds each cached row's prompt (read from the
    shards' token arrays, not by assembling every sample), and a row too long for the student server is dropped only
    where the run would generate it; where the cache serves it, it is trained from the cache."""
    from fastdistill.cache import TeacherCache
    from fastdistill.rollout import OnPolicyShare, ServedModel, row_of_prompt

    cache, student = cache_and_student
    opened = TeacherCache(cache)
    trainer = AsyncDistillationTrainer(cache_config(cache, student, tmp_path / "mixed", lmbda=0.5,
                                                    skip_long_prompts=True, max_completion_length=4))
    assert len(trainer.rows) == len(opened)
    for index in range(len(opened)):
        sample = opened[index]
        assert trainer.rows[index]["prompt_ids"] == sample.input_ids[: sample.prompt_length].tolist()
    lengths = trainer.rows.lengths
    limit = int(np.median(lengths)) + 4  # the longer half of the prompts + 4 completion tokens does not fit
    long_rows = {int(row) for row in np.flatnonzero(lengths + 4 > limit)}
    assert 0 < len(long_rows) < len(lengths)
    served = {"student": ServedModel("s", limit), "default": ServedModel("t", 10_000)}
    assert trainer._skip_long_prompts(served) == long_rows
    share = OnPolicyShare(0.5)
    dropped = [json.loads(line) for line in (tmp_path / "mixed" / "dropped_prompts.jsonl").read_text().splitlines()]
    expected = [p for p in range(trainer.total_prompts) if row_of_prompt(p, len(opened), 42) in long_rows
                and share.selects(p)]
    assert sorted(d["prompt_id"] for d in dropped) == expected and expected
