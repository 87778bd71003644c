"""The run's ledgers alone: appends, read-back, the cut back to a checkpoint's step (torn last line, atomic rewrite)
and the data identity a checkpoint records."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from fastdistill.data import PromptTable
from fastdistill.errors import ConfigError
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.train import ledger as ledger_module
from fastdistill.train.ledger import (
    DataIdentity,
    RunLedger,
    cache_fingerprint,
    data_identity,
    read_step_records,
    resume_problem,
    samples_fingerprint,
    truncate_step_log,
)


def drop(prompt_id: int) -> DroppedPrompt:
    return DroppedPrompt(prompt_id=prompt_id, dataset_index=prompt_id + 100, reason="rejected", message="HTTP 400",
                         server="teacher a")


def write_steps(path, steps, tail: str = "") -> None:
    path.write_text("".join(json.dumps({"step": s, "value": s * 10}) + "\n" for s in steps) + tail)


# ------------------------------------------------------------------------------------------------ append, read


def test_appends_read_back_in_order(tmp_path):
    ledger = RunLedger(tmp_path / "out")
    ledger.append_trained(1, [3, 0, 2])
    ledger.append_drops(1, [drop(5), drop(7)])
    ledger.append_trained(2, np.array([1, 4], np.int64))
    ledger.append_metrics({"step": 2, "loss": 0.5})
    assert ledger.trained() == [{"step": 1, "prompt_ids": [3, 0, 2]}, {"step": 2, "prompt_ids": [1, 4]}]
    assert ledger.trained_prompt_ids() == [3, 0, 2, 1, 4]
    assert ledger.dropped() == [{"step": 1, "prompt_id": p, "dataset_index": p + 100, "reason": "rejected",
                                 "message": "HTTP 400", "server": "teacher a"} for p in (5, 7)]
    assert ledger.metrics() == [{"step": 2, "loss": 0.5}]
    assert ledger.earlier_run_files() == ["trained_prompts.jsonl", "dropped_prompts.jsonl", "metrics.jsonl"]


def test_an_append_is_one_write_call(tmp_path, monkeypatch):
    """One write(2) per append: a killed process leaves every line it wrote whole (the kernel finishes a write)."""
    calls = []
    real_write = os.write

    def recording_write(descriptor, data):
        calls.append(len(data))
        return real_write(descriptor, data)

    monkeypatch.setattr(ledger_module.os, "write", recording_write)
    RunLedger(tmp_path).append_drops(3, [drop(p) for p in range(50)])
    assert len(calls) == 1 and calls[0] == (tmp_path / "dropped_prompts.jsonl").stat().st_size


def test_a_short_write_is_continued(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(ledger_module.os, "write", lambda descriptor, data: real_write(descriptor, data[:7]))
    RunLedger(tmp_path).append_trained(1, list(range(30)))
    assert RunLedger(tmp_path).trained() == [{"step": 1, "prompt_ids": list(range(30))}]


def test_empty_ledgers_are_not_an_earlier_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert RunLedger(tmp_path).earlier_run_files() == []
    assert RunLedger(tmp_path / "missing").trained() == []


# ------------------------------------------------------------------------------------------------ torn lines


def test_a_torn_last_line_is_dropped(tmp_path, caplog):
    path = tmp_path / "trained_prompts.jsonl"
    write_steps(path, [1, 2, 3], tail='{"step": 4, "val')
    assert [record["step"] for _, record in read_step_records(path)] == [1, 2, 3]
    assert "ends in a torn line (line 4" in caplog.text


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2], tail='{"step": 3, "value": 30}')
    assert [record["step"] for _, record in read_step_records(path)] == [1, 2, 3]
    truncate_step_log(path, 5)  # the rewrite ends it with its newline
    assert path.read_text().endswith('{"step": 3, "value": 30}\n')


@pytest.mark.parametrize(("line", "reason"), [('{"step": 2, "val\n', "Unterminated string"),
                                              ('{"value": 3}\n', "it has no int 'step'"),
                                              ('[2, 3]\n', "it has no int 'step'"),
                                              ('{"step": "2"}\n', "it has no int 'step'")])
def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, line, reason):
    path = tmp_path / "dropped_prompts.jsonl"
    write_steps(path, [1])
    with open(path, "a") as handle:
        handle.write(line)
    write_steps(tmp_path / "rest", [3])
    with open(path, "a") as handle:
        handle.write((tmp_path / "rest").read_text())
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=rf"dropped_prompts\.jsonl line 2 is not a JSON record of a step "
                                          rf"\({reason}.*damaged otherwise"):
        truncate_step_log(path, 1)
    assert path.read_bytes() == before
    with pytest.raises(ConfigError, match="line 2"):
        RunLedger(tmp_path).check_readable()


def test_a_terminated_bad_last_line_is_an_error(tmp_path):
    """A kill cannot leave a broken line followed by its newline: that is damage, not a torn write."""
    path = tmp_path / "trained_prompts.jsonl"
    write_steps(path, [1], tail='{"step": 2, "prompt\n')
    with pytest.raises(ConfigError, match=r"line 2 is not a JSON record"):
        read_step_records(path)


# ------------------------------------------------------------------------------------------------ truncation


def test_truncation_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    ledger = RunLedger(tmp_path)
    for step in (1, 2, 3, 4):
        ledger.append_trained(step, [step])
        ledger.append_metrics({"step": step, "loss": 1.0 / step})
    ledger.append_drops(0, [drop(9)])  # listed before the first step (prompts too long for the servers)
    ledger.append_drops(3, [drop(8)])
    with open(ledger.trained_path, "a") as handle:
        handle.write('{"step": 5, "prompt_')
    ledger.truncate(2)
    assert ledger.trained() == [{"step": 1, "prompt_ids": [1]}, {"step": 2, "prompt_ids": [2]}]
    assert [r["prompt_id"] for r in ledger.dropped()] == [9]
    assert [r["step"] for r in ledger.metrics()] == [1, 2]
    assert ledger.metrics()[1]["loss"] == 0.5
    ledger.append_trained(3, [3])  # the resumed run appends after a clean end
    assert [r["step"] for r in ledger.trained()] == [1, 2, 3]


def test_truncation_replaces_the_file_rather_than_rewriting_it(tmp_path):
    """The cut writes a new file and renames it over the ledger: a hard link to the old file still holds every
    old line (an in-place rewrite would change it too), and no temporary file is left."""
    path = tmp_path / "trained_prompts.jsonl"
    write_steps(path, [1, 2, 3])
    old = path.read_text()
    os.link(path, tmp_path / "old-link")
    truncate_step_log(path, 2)
    assert (tmp_path / "old-link").read_text() == old
    assert [r["step"] for _, r in read_step_records(path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old-link", "trained_prompts.jsonl"]


def test_a_crash_during_the_cut_leaves_the_old_ledger(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3])
    old = path.read_bytes()

    def crash(*args):
        raise OSError("killed")

    monkeypatch.setattr(ledger_module.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        truncate_step_log(path, 1)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_the_new_file_is_on_disk_before_it_replaces_the_ledger(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(ledger_module.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(ledger_module.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2])
    truncate_step_log(path, 1)
    assert events[:2] == ["fsync", "replace"]


def test_nothing_to_cut_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2])
    inode = path.stat().st_ino
    truncate_step_log(path, 2)
    truncate_step_log(tmp_path / "missing.jsonl", 2)
    assert path.stat().st_ino == inode and not (tmp_path / "missing.jsonl").exists()


# ------------------------------------------------------------------------------------------------ data identity


def table(rows, teachers=None) -> PromptTable:
    return PromptTable.from_rows([{"prompt_ids": ids} for ids in rows], teachers)


def test_the_prompt_table_fingerprint_sees_every_change():
    base = table([[1, 2, 3], [4, 5]], ["a", "b"])
    assert base.fingerprint() == table([[1, 2, 3], [4, 5]], ["a", "b"]).fingerprint()
    assert len(base.fingerprint()) == 64
    others = [table([[1, 2, 3], [4, 6]], ["a", "b"]),  # an edited token
              table([[1, 2], [3, 4, 5]], ["a", "b"]),  # the same tokens, another row boundary
              table([[4, 5], [1, 2, 3]], ["b", "a"]),  # reordered
              table([[1, 2, 3], [4, 5]], ["a", "a"]),  # another teacher for a row
              table([[1, 2, 3], [4, 5], [6]], ["a", "b", "a"]),  # a row added
              table([[1, 2, 3], [4, 5]])]  # no teacher ids
    prints = {other.fingerprint() for other in others}
    assert len(prints) == len(others) and base.fingerprint() not in prints


def test_samples_and_cache_fingerprints():
    from fastdistill.rollout import RolloutSample

    def sample(prompt_id, ids):
        length = 2
        return RolloutSample(input_ids=np.array(ids, np.int32),
                             completion_mask=np.array([0] * (len(ids) - length) + [1] * length, np.int32),
                             teacher_topk_ids=np.zeros((length, 3), np.int32),
                             teacher_topk_logprobs=np.zeros((length, 3), np.float32),
                             rollout_logprobs=np.zeros(length, np.float32), model_version=0, teacher_id="a",
                             prompt_id=prompt_id, dataset_index=prompt_id)

    stream = [sample(0, [1, 2, 3, 4]), drop(1), sample(2, [5, 6, 7])]
    assert samples_fingerprint(stream) == samples_fingerprint(list(stream))
    assert samples_fingerprint(stream) != samples_fingerprint([stream[0], drop(1), sample(2, [5, 6, 8])])
    assert samples_fingerprint(stream) != samples_fingerprint([stream[0], sample(2, [5, 6, 7])])
    manifest = {"settings": {"top_k": 4}, "shards": [{"index": 0, "sha256": "ab"}], "format_version": 1}
    cache = SimpleNamespace(manifest=manifest)
    assert cache_fingerprint(cache) == cache_fingerprint(SimpleNamespace(manifest=json.loads(json.dumps(manifest))))
    changed = {**manifest, "shards": [{"index": 0, "sha256": "ac"}]}
    assert cache_fingerprint(cache) != cache_fingerprint(SimpleNamespace(manifest=changed))


def test_data_identity_prefers_samples_then_the_cache_then_the_table():
    config = SimpleNamespace(seed=3, shuffle=False, num_train_epochs=2.5)
    rows = table([[1, 2], [3]])
    cache = type("Cache", (), {"manifest": {"settings": {}, "shards": []}, "__len__": lambda self: 7})()
    assert data_identity(config, rows=rows) == DataIdentity("dataset", 2, 3, False, 2.5, rows.fingerprint())
    assert data_identity(config, cache=cache, rows=rows).source == "teacher_cache"
    assert data_identity(config, cache=cache, rows=rows).num_prompts == 7
    assert data_identity(config, samples=[drop(0)], cache=cache).source == "samples"
    with pytest.raises(ValueError, match="needs samples, a teacher cache or the prompt table"):
        data_identity(config)


def test_differences_name_old_and_new():
    identity = DataIdentity("dataset", 10, 1, True, 1, "f" * 64)
    recorded = {**identity.to_json(), "num_prompts": 12, "data_fingerprint": "0" * 64}
    assert identity.differences(identity.to_json()) == []
    assert identity.differences(recorded) == ["num_prompts: 12 in the checkpoint, 10 now",
                                              f"data_fingerprint: {'0' * 16}… in the checkpoint, {'f' * 16}… now"]


def test_resume_problem_from_scratch(tmp_path):
    identity = DataIdentity("dataset", 10, 1, True, 1, "f" * 64)
    ledger = RunLedger(tmp_path)
    assert resume_problem(ledger, None, identity, None) is None
    ledger.append_metrics({"step": 0, "eval/jsd": 1.0})
    assert "holds the ledgers of an earlier run (metrics.jsonl)" in resume_problem(ledger, None, identity, "latest")
    (tmp_path / "checkpoint-4").mkdir()
    assert "holds checkpoint-4 of an earlier run" in resume_problem(ledger, None, identity, None)


def test_resume_problem_when_resuming(tmp_path):
    identity = DataIdentity("dataset", 10, 1, True, 1, "f" * 64)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    ledger = RunLedger(tmp_path)
    assert resume_problem(ledger, checkpoint, identity, "latest") is None  # no rollout state: loading it raises
    (checkpoint / "rollout_state.json").write_text("{")
    assert "rollout_state.json cannot be read" in resume_problem(ledger, checkpoint, identity, "latest")
    state = {"prompt_index": 4, "model_version": 0, "trained_prompt_ids_after": [], "data": identity.to_json()}
    (checkpoint / "rollout_state.json").write_text(json.dumps(state))
    assert resume_problem(ledger, checkpoint, identity, "latest") is None
    other = DataIdentity("dataset", 10, 2, True, 1, "f" * 64)
    assert "seed: 1 in the checkpoint, 2 now" in resume_problem(ledger, checkpoint, other, "latest")
    ledger.append_trained(1, [0])
    with open(ledger.trained_path, "a") as handle:
        handle.write("garbage\n{\"step\": 2, \"prompt_ids\": [1]}\n")
    assert "trained_prompts.jsonl line 2 is not a JSON record" in resume_problem(ledger, checkpoint, identity, None)
