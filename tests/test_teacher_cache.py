"""The offline teacher cache: ``fastdistill score`` against a stub teacher server (round trip, resume after a kill,
``--shard i/n``, rejected rows, errors) and against a real vLLM teacher (marker ``vllm``).

The stub answers ``prompt_logprobs`` with pseudo-random candidates and records every answer it sent; the tests
parse those answers with the rollout client's parser (tested against real vLLM in test_rollout_client.py) and
compare the cache with them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from fastdistill.cache import CacheError, TeacherCache, completion_row, score_dataset  # noqa: E402
from fastdistill.cache.format import from_bfloat16_bits, to_bfloat16_bits  # noqa: E402
from fastdistill.cache.score import parse_shard, shard_block  # noqa: E402
from fastdistill.cli import main as cli_main  # noqa: E402
from fastdistill.errors import ConfigError  # noqa: E402
from fastdistill.rollout.client import TeacherClient  # noqa: E402
from fastdistill.rollout.decode import parse_prompt_logprobs  # noqa: E402
from fastdistill.rollout.http import RetryPolicy  # noqa: E402
from fastdistill.serve import free_port  # noqa: E402
from fastdistill.tiny import build_tokenizer  # noqa: E402

DEADLINE_S = 120.0  # only keeps a broken test from hanging; nothing is asserted about time
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02, request_timeout_s=60.0)
REJECT_MARKER = "please refuse"  # a row whose user turn holds this is refused by the stub with HTTP 400


class StubTeacher:
    """A teacher server stand-in on 127.0.0.1, served from a thread: ``/v1/models`` (id ``model_id``), ``/tokenize``
    with ``tokenizer``, and ``/v1/completions`` answering ``prompt_logprobs`` with pseudo-random candidates drawn
    from a seed that hashes the sequence. ``sent`` maps each scored sequence (tuple) to the answer's
    ``prompt_logprobs``; ``gate`` (cleared) holds every scoring request after the first ``hold_after``.

    ``prompt_logprobs=-1`` is answered with a full distribution over ``vocab_size`` tokens (only the top
    ``full_entries`` of it when that is set, like a server that truncates); ``max_logprobs`` refuses larger requests
    with vLLM's HTTP 400 and message."""

    def __init__(self, tokenizer, model_id: str = "stub-teacher", vocab_size: int | None = None,
                 hold_after: int | None = None, max_logprobs: int | None = None, full_entries: int | None = None):
        self.max_logprobs = max_logprobs
        self.full_entries = full_entries
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.vocab_size = vocab_size or len(tokenizer)
        self.hold_after = hold_after
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.sent: dict[tuple[int, ...], list] = {}
        self.requests: list[tuple[int, ...]] = []
        self.gate = asyncio.Event()
        self.refused_text = tuple(tokenizer(REJECT_MARKER, add_special_tokens=False)["input_ids"])

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.model_id, "max_model_len": 4096}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": self.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]})

    def answer(self, sequence: list[int], top_k: int) -> list:
        seed = int.from_bytes(hashlib.sha256(json.dumps(sequence).encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        entries: list = [None]
        for token in sequence[1:]:
            ids = rng.choice(self.vocab_size, size=top_k, replace=False)
            if rng.random() < 0.5 and token not in ids:  # the realised token in the top-K at about half the positions
                ids[rng.integers(top_k)] = token
            logprobs = np.sort(-rng.exponential(3.0, size=top_k + 1).astype(np.float32))[::-1]
            entry = {str(int(t)): {"logprob": float(lp), "rank": r + 1}
                     for r, (t, lp) in enumerate(zip(ids, logprobs[:top_k], strict=True))}
            if str(token) not in entry:
                entry[str(token)] = {"logprob": float(logprobs[-1]), "rank": top_k + 7}
            entries.append(entry)
        return entries

    def full_answer(self, sequence: list[int]) -> list:
        """Every token's log-prob (float32 values of a float64 log-softmax of peaked random logits) per position."""
        seed = int.from_bytes(hashlib.sha256(json.dumps(["full", *sequence]).encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        entries: list = [None]
        for _ in sequence[1:]:
            logits = rng.standard_normal(self.vocab_size) * 3.0
            logprobs = (logits - np.logaddexp.reduce(logits)).astype(np.float32)
            order = np.argsort(-logprobs, kind="stable")
            kept = order[: self.full_entries] if self.full_entries is not None else order
            entries.append({str(int(t)): {"logprob": float(logprobs[t]), "rank": r + 1} for r, t in enumerate(kept)})
        return entries

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        sequence = [int(t) for t in body["prompt"]]
        self.requests.append(tuple(sequence))
        if self.hold_after is not None and len(self.requests) > self.hold_after:
            await self.gate.wait()
        text = tuple(sequence)
        if any(text[i : i + len(self.refused_text)] == self.refused_text for i in range(len(text))):
            return web.json_response({"error": {"message": "This model's maximum context length is exceeded"}},
                                     status=400)
        assert body["max_tokens"] == 1
        wanted = int(body["prompt_logprobs"])
        if self.max_logprobs is not None and (self.vocab_size if wanted == -1 else wanted) > self.max_logprobs:
            message = (f"Requested prompt logprobs of {self.vocab_size if wanted == -1 else wanted}, which is greater "
                       f"than max allowed: {self.max_logprobs} (parameter=prompt_logprobs, value="
                       f"{self.vocab_size if wanted == -1 else wanted})")  # vLLM 0.32's message, verbatim
            return web.json_response({"error": {"message": message}}, status=400)
        entries = self.full_answer(sequence) if wanted == -1 else self.answer(sequence, wanted)
        self.sent[text] = entries
        return web.json_response({"choices": [{"prompt_logprobs": entries}]})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def open_gate(self) -> None:
        self.loop.call_soon_threadsafe(self.gate.set)

    def __enter__(self) -> StubTeacher:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(DEADLINE_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.open_gate()
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(DEADLINE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def conversations(count: int, refuse: tuple[int, ...] = ()) -> list[dict]:
    """Rows with a ``messages`` column: a system turn on some, a user question, the assistant's answer."""
    rows = []
    for i in range(count):
        question = f"What is {i} + {i + 1}?" + (f" {REJECT_MARKER}" if i in refuse else "")
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": f"The answer is {2 * i + 1}."}]
        if i % 3 == 0:
            turns.insert(0, {"role": "system", "content": "Be brief."})
        rows.append({"messages": turns})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def expected_ids(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Prompt and completion ids the oracle way: the prompt rendered with the generation prompt, the whole
    conversation rendered, the completion = what the whole has after the prompt."""
    prompt = list(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False))
    whole = list(tokenizer.apply_chat_template(messages, return_dict=False))
    assert whole[: len(prompt)] == prompt
    return prompt, whole[len(prompt) :]


def check_rows_against_stub(cache: TeacherCache, stub: StubTeacher, tokenizer, rows: list[dict], top_k: int,
                            dtype: str, skipped: tuple[int, ...] = ()) -> None:
    expected_indices = [i for i in range(len(rows)) if i not in skipped]
    assert len(cache) == len(expected_indices)
    for position, (sample, index) in enumerate(zip(cache, expected_indices, strict=True)):
        prompt, completion = expected_ids(tokenizer, rows[index]["messages"])
        assert sample.dataset_index == index and sample.prompt_id == position
        assert sample.input_ids.dtype == np.int32 and sample.input_ids.tolist() == prompt + completion
        assert sample.prompt_length == len(prompt)
        assert sample.completion_mask.tolist() == [0] * len(prompt) + [1] * len(completion)
        assert sample.model_version == -1 and np.isnan(sample.rollout_logprobs).all()
        assert sample.rollout_logprobs.shape == (len(completion),)
        received = parse_prompt_logprobs("stub", stub.sent[tuple(prompt + completion)], len(prompt),
                                         len(completion), top_k)
        np.testing.assert_array_equal(sample.teacher_topk_ids, received.candidate_ids)
        assert sample.teacher_topk_logprobs.dtype == np.float32
        if dtype == "float16":
            rounded = received.logprobs.astype(np.float16).astype(np.float32)
            bound = 2.0**-11
        else:
            rounded = from_bfloat16_bits(to_bfloat16_bits(received.logprobs))
            bound = 2.0**-8
        np.testing.assert_array_equal(sample.teacher_topk_logprobs, rounded)  # bit-exact after the storage cast
        finite = np.isfinite(received.logprobs)
        assert (np.isfinite(sample.teacher_topk_logprobs) == finite).all()
        error = np.abs(sample.teacher_topk_logprobs[finite] - received.logprobs[finite])
        assert (error <= bound * np.abs(received.logprobs[finite])).all()  # the dtype's round-to-nearest bound


# ------------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scored_rows_read_back_exactly_as_the_teacher_sent_them(tokenizer, tokenizer_dir, tmp_path, dtype):
    rows = conversations(7)
    with StubTeacher(tokenizer) as stub:
        summary = score_dataset(rows, stub.url, tmp_path / "cache", top_k=4, tokenizer=str(tokenizer_dir),
                                rows_per_shard=3, concurrency=2, logprob_dtype=dtype, retry=FAST_RETRY)
    assert (summary.shards_written, summary.rows_scored, summary.rows_rejected) == (3, 7, 0)
    assert summary.manifest_written
    cache = TeacherCache(tmp_path / "cache")
    check_rows_against_stub(cache, stub, tokenizer, rows, 4, dtype)
    manifest = cache.manifest
    assert manifest["settings"]["teacher_model"] == "stub-teacher" and manifest["settings"]["top_k"] == 4
    assert manifest["settings"]["id_dtype"] == "uint16" and manifest["settings"]["candidate_mode"] == "topk"
    assert manifest["rows"] == 7 and [s["row_start"] for s in manifest["shards"]] == [0, 3, 6]
    assert manifest["tokens"] == sum(len(s.input_ids) for s in cache)
    cache.check_tokenizer(tokenizer)  # the same tokenizer passes
    assert cache[3].input_ids.tolist() == list(cache)[3].input_ids.tolist()  # random access = iteration
    with pytest.raises(IndexError):
        cache[7]

    # the shards are standard safetensors: another reader gets the same arrays
    from safetensors.numpy import load_file

    if dtype == "float16":
        loaded = load_file(tmp_path / "cache" / "shard-00001.safetensors")
        ids = loaded["candidate_ids"]
        assert loaded["input_ids"].dtype == np.uint16 and loaded["candidate_logprobs"].dtype == np.float16
        assert ids.shape[1] == 5 and (ids == 65535).any()  # the realised token's slot is empty where it is in top-K
    else:
        from safetensors.torch import load_file as load_torch

        loaded = load_torch(tmp_path / "cache" / "shard-00001.safetensors")
        assert str(loaded["candidate_logprobs"].dtype) == "torch.bfloat16"
        sample = cache[3]
        first = loaded["candidate_logprobs"][: sample.teacher_topk_ids.shape[0]].float().numpy()
        np.testing.assert_array_equal(first, sample.teacher_topk_logprobs)


def test_a_vocabulary_beyond_uint16_stores_int32_ids(tokenizer, tokenizer_dir, tmp_path):
    folder = tmp_path / "big-vocab"
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 70000}))
    rows = conversations(3)
    with StubTeacher(tokenizer, vocab_size=70000) as stub:
        score_dataset(rows, stub.url, tmp_path / "cache", top_k=6, tokenizer=str(folder), retry=FAST_RETRY)
    cache = TeacherCache(tmp_path / "cache")
    assert cache.settings.id_dtype == "int32" and cache.settings.vocab_size == 70000
    check_rows_against_stub(cache, stub, tokenizer, rows, 6, "float16")
    assert max(int(s.teacher_topk_ids.max()) for s in cache) > 65535


# ------------------------------------------------------------------------------------------------ resume


def score_command(dataset: Path, url: str, output: Path, tokenizer_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fastdistill.cli", "score", "--dataset", str(dataset), "--teacher-url", url,
            "--output", str(output), "--top-k", "3", "--rows-per-shard", "2", "--concurrency", "2",
            "--tokenizer", str(tokenizer_dir), *extra]


@pytest.mark.slow
def test_a_killed_run_resumes_at_its_first_unfinished_shard(tokenizer, tokenizer_dir, tmp_path):
    rows = conversations(6)
    dataset = write_jsonl(tmp_path / "rows.jsonl", rows)
    output = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with StubTeacher(tokenizer, hold_after=2) as stub:  # shard 0's two rows are answered, shard 1's are held
        process = subprocess.Popen(score_command(dataset, stub.url, output, tokenizer_dir), env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + DEADLINE_S
        while not (output / "shard-00000.json").exists():
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "shard 0 was never written"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(DEADLINE_S)
        process.stderr.close()
        assert not (output / "shard-00001.safetensors").exists() and not (output / "manifest.json").exists()
        first_run = list(stub.requests)

        stub.hold_after = None
        stub.open_gate()
        rerun = subprocess.run(score_command(dataset, stub.url, output, tokenizer_dir), env=env, capture_output=True,
                               text=True, timeout=DEADLINE_S)
        assert rerun.returncode == 0, rerun.stderr
        assert "2 shards written (4 rows scored), 1 already finished" in rerun.stderr
    shard0 = {tuple(sum(expected_ids(tokenizer, rows[i]["messages"]), [])) for i in (0, 1)}
    second_run = stub.requests[len(first_run) :]
    assert shard0 <= set(first_run) and not shard0 & set(second_run)  # finished shard never scored again
    assert len(second_run) == 4
    check_rows_against_stub(TeacherCache(output), stub, tokenizer, rows, 3, "float16")


def test_a_rerun_with_other_settings_is_refused_and_a_changed_shard_is_scored_again(tokenizer, tokenizer_dir,
                                                                                     tmp_path):
    rows = conversations(4)
    with StubTeacher(tokenizer) as stub:
        score_dataset(rows, stub.url, tmp_path, top_k=3, tokenizer=str(tokenizer_dir), rows_per_shard=2,
                      retry=FAST_RETRY)
        with pytest.raises(ConfigError, match=r"other settings \(in the folder != this run: top_k: 3 != 5\)"):
            score_dataset(rows, stub.url, tmp_path, top_k=5, tokenizer=str(tokenizer_dir), rows_per_shard=2,
                          retry=FAST_RETRY)
        shard = tmp_path / "shard-00001.safetensors"
        shard.write_bytes(shard.read_bytes()[:-4])
        summary = score_dataset(rows, stub.url, tmp_path, top_k=3, tokenizer=str(tokenizer_dir), rows_per_shard=2,
                                retry=FAST_RETRY)
    assert (summary.shards_written, summary.shards_skipped) == (1, 1)
    check_rows_against_stub(TeacherCache(tmp_path), stub, tokenizer, rows, 3, "float16")


# ------------------------------------------------------------------------------------------------ --shard i/n


def test_shard_blocks_partition_the_shards_and_bad_specs_are_refused():
    for num_shards in range(0, 12):
        for parts in range(1, 6):
            blocks = [list(shard_block((i, parts), num_shards)) for i in range(parts)]
            assert sum(blocks, []) == list(range(num_shards))
    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="--shard must look like i/n"):
            parse_shard(bad)


def test_machines_scoring_disjoint_shards_build_one_cache(tokenizer, tokenizer_dir, tmp_path):
    rows = conversations(9)
    seen = []
    with StubTeacher(tokenizer) as stub:
        for part in (1, 0):  # either machine may finish last
            before = len(stub.requests)
            summary = score_dataset(rows, stub.url, tmp_path, top_k=2, tokenizer=str(tokenizer_dir),
                                    shard=(part, 2), rows_per_shard=2, retry=FAST_RETRY)
            seen.append(set(stub.requests[before:]))
            assert summary.manifest_written == (part == 0)
            assert (tmp_path / "manifest.json").exists() == (part == 0)
    everything = {tuple(sum(expected_ids(tokenizer, row["messages"]), [])) for row in rows}
    assert not seen[0] & seen[1] and seen[0] | seen[1] == everything
    assert len(seen[0]) == 5 and len(seen[1]) == 4  # 1/2: shards 2-4 (rows 4-8); 0/2: shards 0-1 (rows 0-3)
    check_rows_against_stub(TeacherCache(tmp_path), stub, tokenizer, rows, 2, "float16")


# ------------------------------------------------------------------------------------------------ rejected rows


def test_rows_the_server_rejects_are_listed_and_the_run_ends_normally(tokenizer, tokenizer_dir, tmp_path, capsys):
    rows = conversations(5, refuse=(1, 4))
    dataset = write_jsonl(tmp_path / "rows.jsonl", rows)
    with StubTeacher(tokenizer) as stub:
        code = cli_main(["score", "--dataset", str(dataset), "--teacher-url", stub.url, "--output",
                         str(tmp_path / "cache"), "--top-k", "2", "--rows-per-shard", "3", "--tokenizer",
                         str(tokenizer_dir)])
    assert code == 0
    log = capsys.readouterr().err
    assert "2 shards written (3 rows scored)" in log and "2 rows skipped because the teacher server rejected" in log
    rejected = [json.loads(line) for line in (tmp_path / "cache" / "rejected.jsonl").read_text().splitlines()]
    assert [entry["dataset_index"] for entry in rejected] == [1, 4]
    assert all(entry["status"] == 400 and "maximum context length" in entry["message"] for entry in rejected)
    cache = TeacherCache(tmp_path / "cache")
    assert cache.manifest["rejected_rows"] == 2
    check_rows_against_stub(cache, stub, tokenizer, rows, 2, "float16", skipped=(1, 4))


# ------------------------------------------------------------------------------------------------ errors


@pytest.fixture
def small_cache(tokenizer, tokenizer_dir, tmp_path):
    with StubTeacher(tokenizer) as stub:
        score_dataset(conversations(4), stub.url, tmp_path, top_k=2, tokenizer=str(tokenizer_dir), rows_per_shard=2,
                      retry=FAST_RETRY)
    return tmp_path


def test_corrupted_truncated_and_missing_shards_are_named(small_cache):
    shard = small_cache / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"shard-00001.safetensors' is corrupted: its sha256 is"):
        TeacherCache(small_cache)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(CacheError, match=r"shard-00001.safetensors' is truncated: its arrays need \d+ bytes"):
        TeacherCache(small_cache, verify_checksums=False)
    shard.write_bytes(bytes(data[:5]))
    with pytest.raises(CacheError, match="is truncated: 5 bytes, not even a safetensors header"):
        TeacherCache(small_cache, verify_checksums=False)
    shard.unlink()
    with pytest.raises(CacheError, match="shard-00001.safetensors' listed in the manifest is missing"):
        TeacherCache(small_cache)
    (small_cache / "manifest.json").unlink()
    with pytest.raises(CacheError, match="is not a finished teacher cache: it has no manifest.json"):
        TeacherCache(small_cache)


def test_a_cache_refuses_another_tokenizer(small_cache):
    other = build_tokenizer(corpus=["A different corpus makes different merges entirely."])
    with pytest.raises(ConfigError, match="was scored with another tokenizer"):
        TeacherCache(small_cache).check_tokenizer(other)


def test_a_teacher_with_another_tokenizer_or_vocabulary_is_refused(tokenizer, tokenizer_dir, tmp_path):
    other = build_tokenizer(corpus=["A different corpus makes different merges entirely."])
    with StubTeacher(other) as stub, pytest.raises(ConfigError, match="the teacher server .* tokenizes"):
        score_dataset(conversations(2), stub.url, tmp_path, top_k=2, tokenizer=str(tokenizer_dir), retry=FAST_RETRY)
    with StubTeacher(tokenizer, vocab_size=len(tokenizer) + 50) as stub, pytest.raises(
            ConfigError, match=f"outside the tokenizer's {len(tokenizer)} ids"):
        score_dataset(conversations(8), stub.url, tmp_path / "b", top_k=40, tokenizer=str(tokenizer_dir),
                      retry=FAST_RETRY)
    with StubTeacher(tokenizer, model_id="no-such-folder") as stub, pytest.raises(
            ConfigError, match="tokenizer folder 'no-such-folder' does not exist .* pass --tokenizer"):
        score_dataset(conversations(2), stub.url, tmp_path / "c", top_k=2, retry=FAST_RETRY)


def test_rows_without_a_completion_are_refused(tokenizer):
    assert completion_row({"prompt": "Hi", "completion": " there"}, 0, tokenizer).completion_ids == \
        tokenizer(" there", add_special_tokens=False)["input_ids"]
    chat = completion_row({"prompt": [{"role": "user", "content": "Hi"}],
                           "completion": [{"role": "assistant", "content": "Hello"}]}, 0, tokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert (chat.prompt_ids, chat.completion_ids) == expected_ids(tokenizer, messages)
    cases = [
        ({"prompt": "Hi"}, "has neither 'prompt' and 'completion' columns nor a 'messages' column"),
        ({"prompt": "Hi", "completion": [{"role": "assistant", "content": "x"}]}, "must both hold text or both"),
        ({"prompt": "Hi", "completion": ""}, "row 3: the completion tokenises to no tokens"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "has no assistant turn"),
    ]
    for row, message in cases:
        with pytest.raises(ConfigError, match=message):
            completion_row(row, 3, tokenizer)
    bad_settings = [dict(top_k=0), dict(rows_per_shard=0), dict(concurrency=0), dict(logprob_dtype="int8"),
                    dict(candidates="dense")]
    for settings in bad_settings:
        with pytest.raises(ConfigError, match="must be"):
            score_dataset([{"prompt": "a", "completion": "b"}], "http://127.0.0.1:9", "unused", **(
                dict(top_k=2) | settings))


# ------------------------------------------------------------------------------------------------ real vLLM


@pytest.fixture(scope="module")
def tiny_teacher(tiny_servers):
    """(folder, server): the session's tiny Qwen3 teacher folder and the real vLLM teacher-role server serving it."""
    return tiny_servers.teacher_dir, tiny_servers.teacher


@pytest.mark.vllm
def test_cached_logprobs_equal_online_teacher_scores_from_a_real_server(tiny_teacher, tmp_path):
    folder, server = tiny_teacher
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = conversations(5)
    summary = score_dataset(rows, server.url, tmp_path, top_k=8, rows_per_shard=2, concurrency=2)  # tokenizer:
    assert summary.manifest_written and summary.rows_scored == 5  # the folder the server serves
    cache = TeacherCache(tmp_path)
    cache.check_tokenizer(tokenizer)

    async def online():
        async with TeacherClient(server.url) as teacher:
            found = []
            for row in rows:
                prompt, completion = expected_ids(tokenizer, row["messages"])
                found.append(await teacher.score(prompt, completion, top_k=8))
            return found

    for sample, scores in zip(cache, asyncio.run(online()), strict=True):
        np.testing.assert_array_equal(sample.teacher_topk_ids, scores.candidate_ids)
        finite = np.isfinite(scores.logprobs)
        assert (np.isfinite(sample.teacher_topk_logprobs) == finite).all()
        # fp16 rounding (2**-11 relative) plus the server's own run-to-run float32 noise
        tolerance = 2.0**-11 * np.abs(scores.logprobs[finite]) + 1e-5
        assert (np.abs(sample.teacher_topk_logprobs[finite] - scores.logprobs[finite]) <= tolerance).all()


# ------------------------------------------------------------------------------------------------ benchmark


def test_bench_cache_bytes_per_token_match_the_layout(tmp_path):
    """The benchmark's figure against the layout's arithmetic: every array's bytes plus at most 1 KiB of
    safetensors header per shard."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_cache
    finally:
        sys.path.pop(0)
    report = bench_cache.main(["--rows", "12", "--rows-per-shard", "5", "--prompt-lengths", "3", "9",
                               "--completion-lengths", "4", "20", "--json", str(tmp_path / "bench.json")])
    assert json.loads((tmp_path / "bench.json").read_text())["results"] == report["results"]
    assert [(r["vocab_size"], r["top_k"]) for r in report["results"]] == [(v, k) for v in (32000, 151936)
                                                                           for k in (8, 32, 128)]
    for result in report["results"]:
        id_bytes = 2 if result["vocab_size"] <= 65535 else 4
        arrays = ((result["top_k"] + 1) * (id_bytes + 2) * result["completion_tokens"] + id_bytes * result["tokens"]
                  + 8 * (12 + 3) + 4 * 12 + 8 * 12)  # candidates, ids, token offsets (3 shards), lengths, indices
        assert arrays < result["bytes"] <= arrays + 3 * 1024
        assert result["bytes_per_completion_token"] == result["bytes"] / result["completion_tokens"]
    assert [(r["vocab_size"], r["num_samples"]) for r in report["sampled_results"]] == [
        (v, n) for v in (32000, 151936) for n in (4, 12, 32)]
    for result in report["sampled_results"]:  # S slots of id, uint8 count and float16 log-prob
        id_bytes = 2 if result["vocab_size"] <= 65535 else 4
        arrays = (result["num_samples"] * (id_bytes + 3) * result["completion_tokens"] + id_bytes * result["tokens"]
                  + 8 * (12 + 3) + 4 * 12 + 8 * 12)
        assert arrays < result["bytes"] <= arrays + 3 * 1024


def test_a_manifest_that_does_not_describe_its_shards_is_refused(small_cache):
    from fastdistill.cache.format import map_safetensors, sha256_of_file, write_safetensors

    manifest_path = small_cache / "manifest.json"
    original = manifest_path.read_text()
    manifest = json.loads(original)
    manifest["shards"][0]["rows"] = 3
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="shard-00000.safetensors' does not hold the 3 rows .*array sizes disagree"):
        TeacherCache(small_cache)
    manifest_path.write_text(json.dumps(json.loads(original) | {"format_version": 99}))
    with pytest.raises(CacheError, match=r"has format version 99; this fastdistill reads versions \[1, 2\]"):
        TeacherCache(small_cache)
    manifest_path.write_text(original[:-20])
    with pytest.raises(CacheError, match="manifest.json' is not valid JSON"):
        TeacherCache(small_cache)

    shard = small_cache / "shard-00000.safetensors"
    arrays, _ = map_safetensors(shard)
    kept = {name: ("int64" if array.dtype == np.int64 else "int32" if array.dtype == np.int32 else
                   "uint16" if array.dtype == np.uint16 else "float16", np.array(array))
            for name, array in arrays.items() if name != "dataset_index"}
    write_safetensors(shard, kept, {})
    manifest = json.loads(original)
    manifest["shards"][0]["sha256"] = sha256_of_file(shard)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match=r"shard-00000.safetensors' lacks the arrays \['dataset_index'\]"):
        TeacherCache(small_cache)
    shard.write_bytes((40).to_bytes(8, "little") + b"{not json" + b" " * 40)
    with pytest.raises(CacheError, match="is not a safetensors file"):
        TeacherCache(small_cache, verify_checksums=False)


def test_a_chat_template_that_does_not_render_prompt_then_answer_is_refused(tokenizer):
    from transformers import PreTrainedTokenizerFast

    odd = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                                  chat_template=("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
                                                 "{% endfor %}{% if add_generation_prompt %}{{ 'reply:' }}{% endif %}"))
    rows = conversations(1)[0]
    with pytest.raises(ConfigError, match="row 5: the chat template does not render the conversation as its prompt"):
        completion_row(rows, 5, odd)
