"""Resume through the real trainer (in-process, no servers): a torn ledger line, data or settings that changed since
the checkpoint, and a run that would append to an earlier run's ledgers."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from trainer_cases import TEACHERS, offline_config, synthetic_run_samples, tiny_student_dir

from fastdistill.errors import ConfigError
from fastdistill.tiny import build_tokenizer
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.trainer import AsyncDistillationTrainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_cache_training import NUM_ROWS, cache_and_student, cache_config  # noqa: E402, F401 (a fixture)

LEDGERS = ("trained_prompts.jsonl", "dropped_prompts.jsonl", "metrics.jsonl")


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return tiny_student_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def samples():
    return synthetic_run_samples(24)


def config(student_dir, output_dir, **overrides) -> AsyncDistillationConfig:
    settings = dict(per_device_train_batch_size=4, save_strategy="steps", save_steps=2)
    return offline_config(student_dir, output_dir, **{**settings, **overrides})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dropped_notice(prompt_id: int):
    from fastdistill.rollout.dropped import DroppedPrompt

    return DroppedPrompt(prompt_id=prompt_id, dataset_index=prompt_id, reason="rejected",
                         message=f"HTTP 400: prompt {prompt_id} refused", server="teacher a")


class Crash(Exception):
    pass


def crash_at(step_to_crash: int):
    def on_step_end(step, record):
        if step == step_to_crash:
            raise Crash

    return on_step_end


def crashed_run(student_dir, output: Path, stream, step: int = 3, **overrides) -> None:
    """Train ``stream`` into ``output`` until the run dies after step ``step`` (checkpoint every 2 steps)."""
    trainer = AsyncDistillationTrainer(config(student_dir, output, **overrides), samples=stream,
                                       on_step_end=crash_at(step))
    with pytest.raises(Crash):
        trainer.train()


# ------------------------------------------------------------------------------------------------ torn lines


def test_a_torn_last_line_in_every_ledger_does_not_stop_the_resume(tmp_path, student_dir, samples):
    """A kill during a write leaves half a JSON line at the end of a ledger: the resume drops it (it belongs to a
    step after the checkpoint) and the run ends with every prompt trained exactly once and every step logged once."""
    stream = [dropped_notice(s.prompt_id) if s.prompt_id in (5, 14) else s for s in samples]
    output = tmp_path / "run"
    crashed_run(student_dir, output, stream)
    for name in LEDGERS:
        with open(output / name, "a") as ledger:
            ledger.write('{"step": 4, "prompt_ids": [17, 1')  # what a kill in the middle of a write leaves
    summary = AsyncDistillationTrainer(config(student_dir, output, resume_from_checkpoint="latest"),
                                       samples=stream).train()
    assert summary["steps"] == 6
    trained = [p for line in read_jsonl(output / "trained_prompts.jsonl") for p in line["prompt_ids"]]
    assert sorted(trained) == sorted(set(range(24)) - {5, 14})
    assert sorted(d["prompt_id"] for d in read_jsonl(output / "dropped_prompts.jsonl")) == [5, 14]
    assert [r["step"] for r in read_jsonl(output / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_corrupt_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, student_dir, samples):
    """Only the last line can be torn by a kill: a broken line before it is damage the run must not paper over."""
    output = tmp_path / "run"
    crashed_run(student_dir, output, samples)
    path = output / "trained_prompts.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = '{"step": 2, "prompt_ids": [4, 5\n'
    path.write_text("".join(lines))
    resumed = AsyncDistillationTrainer(config(student_dir, output, resume_from_checkpoint="latest"), samples=samples)
    with pytest.raises(ConfigError, match=r"trained_prompts\.jsonl line 2 is not a JSON record"):
        resumed.train()
    assert path.read_text() == "".join(lines)  # nothing rewritten


# ------------------------------------------------------------------------------------------------ the data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("fewer rows", r"num_prompts: 24 in the checkpoint, 20 now"),
        ("edited row", r"data_fingerprint: [0-9a-f]{16}… in the checkpoint, [0-9a-f]{16}… now"),
        ("seed", r"seed: 42 in the checkpoint, 7 now"),
        ("shuffle", r"shuffle: True in the checkpoint, False now"),
        ("fewer epochs", r"num_train_epochs: 2 in the checkpoint, 1 now \(only raising it is allowed\)"),
    ],
)
def test_a_resume_on_other_data_or_order_is_refused_by_name(tmp_path, student_dir, samples, change, message):
    """Prompt ids mean (epoch, row of the shuffled order): another dataset, seed or shuffle gives them other rows,
    so the checkpoint's list of trained ids would silently skip some prompts and repeat others; fewer epochs than
    the checkpoint was written for would leave prompts it counted on untrained."""
    output = tmp_path / "run"
    crashed_run(student_dir, output, samples, **({"num_train_epochs": 2} if change == "fewer epochs" else {}))
    before = {name: (output / name).read_text() for name in ("trained_prompts.jsonl", "metrics.jsonl")}
    stream, overrides = samples, {}
    if change == "fewer rows":
        stream = samples[:20]
    elif change == "edited row":
        edited = samples[9].input_ids.copy()
        edited[0] = edited[0] + 1
        stream = [*samples[:9], dataclasses.replace(samples[9], input_ids=edited), *samples[10:]]
    else:
        overrides = {"seed": {"seed": 7}, "shuffle": {"shuffle": False},
                     "fewer epochs": {"num_train_epochs": 1}}[change]
    resumed = AsyncDistillationTrainer(config(student_dir, output, resume_from_checkpoint="latest", **overrides),
                                       samples=stream)
    with pytest.raises(ConfigError, match=rf"checkpoint-2 was written for other data .*{message}"):
        resumed.train()
    assert {name: (output / name).read_text() for name in before} == before  # the ledgers are left alone


def test_the_checkpoint_records_the_data_it_was_written_for(tmp_path, student_dir, samples):
    output = tmp_path / "run"
    crashed_run(student_dir, output, samples)
    state = json.loads((output / "checkpoint-2" / "rollout_state.json").read_text())
    data = state["data"]
    assert (data["num_prompts"], data["seed"], data["shuffle"], data["num_train_epochs"]) == (24, 42, True, 1)
    assert data["source"] == "samples" and len(data["data_fingerprint"]) == 64


def test_a_checkpoint_without_a_data_record_still_resumes(tmp_path, student_dir, samples, caplog):
    """Checkpoints written before the data record existed resume as before, with a warning."""
    output = tmp_path / "run"
    crashed_run(student_dir, output, samples)
    path = output / "checkpoint-2" / "rollout_state.json"
    state = json.loads(path.read_text())
    del state["data"]
    path.write_text(json.dumps(state))
    summary = AsyncDistillationTrainer(config(student_dir, output, resume_from_checkpoint="latest"),
                                       samples=samples).train()
    assert summary["steps"] == 6
    assert "records no data identity" in caplog.text


def test_a_cache_run_resumed_on_another_cache_is_refused(cache_and_student, tmp_path):  # noqa: F811
    """A teacher-cache run's checkpoint names the cache by its own fingerprint (settings and shard checksums)."""
    from test_teacher_cache import FAST_RETRY, StubTeacher, conversations

    from fastdistill.cache import score_dataset

    cache, student = cache_and_student
    output = tmp_path / "run"
    AsyncDistillationTrainer(cache_config(cache, student, output, max_steps=2, save_strategy="steps",
                                          save_steps=2)).train()
    tokenizer = build_tokenizer()
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    other = tmp_path / "other-cache"
    with StubTeacher(tokenizer) as stub:  # the same number of rows, other conversations
        score_dataset(conversations(NUM_ROWS + 3)[3:], stub.url, other, top_k=4, tokenizer=str(tokenizer_dir),
                      rows_per_shard=5, retry=FAST_RETRY)
    resumed = cache_config(other, student, output, save_strategy="steps", save_steps=2,
                           resume_from_checkpoint="latest")
    with pytest.raises(ConfigError, match=r"data_fingerprint: .* in the checkpoint, .* now"):
        AsyncDistillationTrainer(resumed).train()
    # the same cache resumes
    same = cache_config(cache, student, output, save_strategy="steps", save_steps=2, resume_from_checkpoint="latest")
    assert AsyncDistillationTrainer(same).train()["steps"] == 2 * NUM_ROWS // 4


def test_a_finished_cache_run_resumed_with_more_epochs_trains_the_new_epochs_once(cache_and_student,  # noqa: F811
                                                                                  tmp_path):
    """Prompt ids do not depend on the epoch count: a run of one epoch, resumed from its last checkpoint with
    ``num_train_epochs: 2``, trains the second epoch's prompts (every cached row once more), each exactly once, and
    records the new epoch count for the next resume; lowering it again is refused."""
    from fastdistill.rollout import row_of_prompt

    cache, student = cache_and_student
    output = tmp_path / "run"
    settings = dict(save_strategy="steps", save_steps=2)
    first = AsyncDistillationTrainer(cache_config(cache, student, output, num_train_epochs=1, **settings)).train()
    assert first["steps"] == NUM_ROWS // 4
    resumed = cache_config(cache, student, output, num_train_epochs=2, resume_from_checkpoint="latest", **settings)
    summary = AsyncDistillationTrainer(resumed).train()
    assert summary["steps"] == 2 * NUM_ROWS // 4
    lines = read_jsonl(output / "trained_prompts.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 2 * NUM_ROWS // 4 + 1))
    trained = [p for line in lines for p in line["prompt_ids"]]
    assert sorted(trained) == list(range(2 * NUM_ROWS))  # every prompt of both epochs, exactly once
    assert sorted(trained[NUM_ROWS:]) == list(range(NUM_ROWS, 2 * NUM_ROWS))  # the resume trained epoch 2's ids
    assert sorted(row_of_prompt(p, NUM_ROWS, resumed.seed) for p in trained[NUM_ROWS:]) == list(range(NUM_ROWS))
    state = json.loads((output / f"checkpoint-{2 * NUM_ROWS // 4}" / "rollout_state.json").read_text())
    assert state["data"]["num_train_epochs"] == 2
    fewer = cache_config(cache, student, output, num_train_epochs=1, resume_from_checkpoint="latest", **settings)
    with pytest.raises(ConfigError, match=r"num_train_epochs: 2 in the checkpoint, 1 now"):
        AsyncDistillationTrainer(fewer).train()


# ------------------------------------------------------------------------------------------------ earlier runs


@pytest.mark.parametrize("resume", ["latest", None])
def test_a_run_without_a_checkpoint_refuses_an_earlier_runs_ledgers(tmp_path, student_dir, samples, resume):
    """A run that died before its first checkpoint left ledgers; a run that starts from scratch in the same folder
    (resume_from_checkpoint='latest' finds no checkpoint, or no resume at all) would append to them."""
    output = tmp_path / "run"
    crashed_run(student_dir, output, samples, step=1)
    assert not list(output.glob("checkpoint-*"))
    before = {name: (output / name).read_text() for name in ("trained_prompts.jsonl", "metrics.jsonl")}
    again = AsyncDistillationTrainer(config(student_dir, output, resume_from_checkpoint=resume), samples=samples)
    with pytest.raises(ConfigError, match=r"holds the ledgers of an earlier run \(trained_prompts\.jsonl, "
                                          r"metrics\.jsonl\) and no checkpoint to resume from"):
        again.train()
    assert {name: (output / name).read_text() for name in before} == before
    (output / "old").mkdir()
    for name in before:
        (output / name).rename(output / "old" / name)
    assert AsyncDistillationTrainer(config(student_dir, output, resume_from_checkpoint=resume),
                                    samples=samples).train()["steps"] == 6


def test_a_fresh_run_next_to_an_earlier_runs_checkpoint_is_refused(tmp_path, student_dir, samples):
    output = tmp_path / "run"
    crashed_run(student_dir, output, samples)
    again = AsyncDistillationTrainer(config(student_dir, output), samples=samples)
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint='latest' to continue it"):
        again.train()


def test_with_two_ranks_every_rank_stops_on_a_refused_resume(tmp_path, student_dir):
    """Rank 0 judges the resume; the other rank raises the same error instead of waiting for it in a collective."""
    import os
    import subprocess

    values = {"teacher_server_urls": TEACHERS, "weight_sync_backend": "none", "learning_rate": 1e-3,
              "num_train_epochs": 1, "gradient_checkpointing": False, "disable_tqdm": True, "token_budget": 0,
              "per_device_train_batch_size": 2, "export_final_model": False, "save_strategy": "steps",
              "save_steps": 2, "max_steps": 2}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def launch(name: str, overrides: dict) -> subprocess.CompletedProcess:
        spec = {"student_dir": str(student_dir), "output_dir": str(tmp_path / "run"), "num_samples": 24, "seed": 3,
                "config": {**values, **overrides}}
        (tmp_path / f"{name}.json").write_text(json.dumps(spec))
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(HERE / "run_trainer.py"), str(tmp_path / f"{name}.json")], capture_output=True,
                              text=True, timeout=900, env=env)  # the timeout only guards against a hang

    first = launch("first", {})
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    refused = launch("refused", {"seed": 7, "resume_from_checkpoint": "latest", "max_steps": 4})
    assert refused.returncode != 0
    output = (refused.stdout + refused.stderr).splitlines()
    for rank in (0, 1):  # torchrun prefixes each rank's lines with [rank<r>]:
        assert any(line.startswith(f"[rank{rank}]: fastdistill.errors.ConfigError: ") and
                   "seed: 42 in the checkpoint, 7 now" in line for line in output), "\n".join(output[-40:])
