"""Training from an offline teacher cache (``teacher_cache``): no server, every cached row trained once per epoch
(across a resume too), and the settings that need servers refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fastdistill.cache import TeacherCache, score_dataset
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.config import AsyncDistillationConfig, ConfigError
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
def test_score_with_a_real_teacher_stop_it_and_train_from_the_cache(tmp_path):
    """The offline workflow end to end: a real vLLM teacher scores the training rows and held-out rows once, is
    stopped, and the student trains from the cache alone; its divergence on the held-out rows (scored by the same
    teacher) falls."""
    from transformers import AutoModelForCausalLM

    from fastdistill.serve import VLLMServer
    from fastdistill.testing.vllm_server import require_vllm
    from fastdistill.train.evaluate import divergence_per_token

    require_vllm()
    tokenizer = build_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    teacher_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=3).float().eval(),
                                      tokenizer, tmp_path / "teacher")
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=11), tokenizer,
                                      tmp_path / "student")
    rows = conversations(40)
    with VLLMServer(teacher_dir, role="teacher", log_path=tmp_path / "teacher.log") as server:
        train = score_dataset(rows[:32], server.url, tmp_path / "cache", top_k=8, rows_per_shard=16, concurrency=4)
        held = score_dataset(rows[32:], server.url, tmp_path / "held", top_k=8, concurrency=4)
    assert train.manifest_written and held.manifest_written and server.process is None  # the teacher is gone
    held_out = list(TeacherCache(tmp_path / "held"))
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    before = divergence_per_token(student, held_out, ["default"])
    config = cache_config(tmp_path / "cache", student_dir, tmp_path / "run", num_train_epochs=4, learning_rate=3e-3,
                          per_device_train_batch_size=8, export_final_model=True)
    summary = AsyncDistillationTrainer(config).train()
    assert summary["steps"] == 4 * 32 // 8
    after = divergence_per_token(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval(), held_out,
                                 ["default"])
    assert after < 0.9 * before, (before, after)
