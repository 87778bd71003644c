"""The sampled teacher cache (``fastdistill score --candidates sampled``): round trip against a stub teacher that
answers ``prompt_logprobs=-1`` with a full distribution, reproducible draws (re-sharded, resumed after a kill),
the refusals, the expectation of the cached rows' gradient against the dense forward KL, mixing with on-policy
samples, and training from a cache scored by a real vLLM teacher (marker ``vllm``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdistill.cache import CacheError, TeacherCache, score_dataset
from fastdistill.cache.format import CacheSettings, from_bfloat16_bits, id_dtype_for, to_bfloat16_bits
from fastdistill.cache.sampled import draw_candidates, parse_full_prompt_logprobs, row_seed
from fastdistill.cache.score import CompletionRow, _write_shard, write_manifest_if_complete
from fastdistill.cli import main as cli_main
from fastdistill.errors import ConfigError
from fastdistill.loss import sample_teacher_candidates, sparse_jsd_loss
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_teacher_cache import (  # noqa: E402
    DEADLINE_S,
    FAST_RETRY,
    StubTeacher,
    conversations,
    expected_ids,
    write_jsonl,
)

S = 6


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def sampled(rows, url, output, tokenizer_dir, **overrides):
    values = dict(candidates="sampled", num_samples=S, seed=11, tokenizer=str(tokenizer_dir), rows_per_shard=3,
                  concurrency=2, retry=FAST_RETRY)
    values.update(overrides)
    return score_dataset(rows, url, output, **values)


def teacher_of(stub, tokenizer, messages):
    """(prompt, completion, the teacher's dense (L, V) float32 log-probs as the stub sent them)."""
    prompt, completion = expected_ids(tokenizer, messages)
    dense = parse_full_prompt_logprobs("stub", stub.sent[tuple(prompt + completion)], len(prompt), len(completion),
                                       stub.vocab_size)
    return prompt, completion, dense


def oracle_draws(dense: np.ndarray, num_samples: int, seed: int, dataset_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct drawn ids (ascending, -1 padded) and counts (L, S), drawn by torch.multinomial from the teacher's
    renormalised probabilities with the row's generator, merged with numpy."""
    generator = torch.Generator().manual_seed(row_seed(seed, dataset_index))
    probs = torch.log_softmax(torch.from_numpy(dense), dim=-1).exp()
    draws = torch.multinomial(probs, num_samples, replacement=True, generator=generator).numpy()
    ids = np.full(draws.shape, -1, np.int64)
    counts = np.zeros(draws.shape, np.int64)
    for position, row in enumerate(draws):
        values, found = np.unique(row, return_counts=True)
        ids[position, : len(values)] = values
        counts[position, : len(values)] = found
    return ids, counts


# ------------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sampled_rows_read_back_as_drawn(tokenizer, tokenizer_dir, tmp_path, dtype):
    rows = conversations(7)
    with StubTeacher(tokenizer) as stub:
        summary = sampled(rows, stub.url, tmp_path, tokenizer_dir, logprob_dtype=dtype)
    assert (summary.shards_written, summary.rows_scored, summary.manifest_written) == (3, 7, True)
    cache = TeacherCache(tmp_path)
    assert (cache.candidate_mode, cache.candidate_width) == ("sampled", S)
    manifest = cache.manifest
    assert manifest["format_version"] == 2 and manifest["dtypes"]["candidate_counts"] == "uint8"
    settings = manifest["settings"]
    assert (settings["candidate_mode"], settings["num_samples"], settings["proposal_temperature"],
            settings["seed"], settings["top_k"]) == ("sampled", S, 1.0, 11, 0)
    realised_outside = 0
    for position, (sample, messages) in enumerate(zip(cache, (r["messages"] for r in rows), strict=True)):
        prompt, completion, dense = teacher_of(stub, tokenizer, messages)
        assert sample.input_ids.tolist() == prompt + completion and sample.dataset_index == position
        ids, counts = oracle_draws(dense, S, 11, position)
        np.testing.assert_array_equal(sample.teacher_topk_ids, ids)
        np.testing.assert_array_equal(cache.counts(position), counts)
        assert (counts.sum(axis=1) == S).all()
        # the log-weights log(c/S): bit for bit what the library's sampler gives for the same draws
        library = sample_teacher_candidates(torch.from_numpy(dense), S,
                                            generator=torch.Generator().manual_seed(row_seed(11, position)))
        np.testing.assert_array_equal(sample.teacher_topk_logprobs, library.log_weights.numpy())
        # the teacher's log-probs of the drawn tokens, as sent, after the storage cast
        sent = np.where(ids >= 0, np.take_along_axis(dense, np.maximum(ids, 0), axis=1), -np.inf).astype(np.float32)
        rounded = (sent.astype(np.float16).astype(np.float32) if dtype == "float16"
                   else from_bfloat16_bits(to_bfloat16_bits(sent)))
        np.testing.assert_array_equal(cache.teacher_logprobs(position), rounded)
        realised_outside += sum(int(token not in ids[j]) for j, token in enumerate(completion))
    assert realised_outside > 0  # the realised token has no slot of its own

    from safetensors.torch import load_file

    loaded = load_file(tmp_path / "shard-00000.safetensors")  # another reader gets the counts as uint8
    assert loaded["candidate_counts"].dtype == torch.uint8 and loaded["candidate_ids"].shape[1] == S
    assert int(loaded["candidate_counts"].sum()) == S * loaded["candidate_ids"].shape[0]


def test_draws_do_not_depend_on_sharding_and_follow_the_seed(tokenizer, tokenizer_dir, tmp_path):
    rows = conversations(9)
    with StubTeacher(tokenizer) as stub:
        sampled(rows, stub.url, tmp_path / "one", tokenizer_dir)
        for part in (1, 0):
            sampled(rows, stub.url, tmp_path / "split", tokenizer_dir, rows_per_shard=2, shard=(part, 2),
                    concurrency=3)
        sampled(rows, stub.url, tmp_path / "other-seed", tokenizer_dir, seed=12)
    one, split, other = (TeacherCache(tmp_path / name) for name in ("one", "split", "other-seed"))
    for i in range(len(rows)):
        np.testing.assert_array_equal(one[i].teacher_topk_ids, split[i].teacher_topk_ids)
        np.testing.assert_array_equal(one.counts(i), split.counts(i))
    assert any(not np.array_equal(one[i].teacher_topk_ids, other[i].teacher_topk_ids) for i in range(len(rows)))


@pytest.mark.slow
def test_a_killed_sampled_run_resumes_into_identical_shards(tokenizer, tokenizer_dir, tmp_path):
    rows = conversations(6)
    dataset = write_jsonl(tmp_path / "rows.jsonl", rows)
    output = tmp_path / "resumed"
    command = [sys.executable, "-m", "fastdistill.cli", "score", "--dataset", str(dataset), "--output", str(output),
               "--candidates", "sampled", "--num-samples", str(S), "--seed", "11", "--rows-per-shard", "2",
               "--concurrency", "2", "--tokenizer", str(tokenizer_dir), "--teacher-url"]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    with StubTeacher(tokenizer, hold_after=3) as stub:  # the probe and shard 0's two rows, then held
        process = subprocess.Popen([*command, stub.url], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + DEADLINE_S
        while not (output / "shard-00000.json").exists():
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "shard 0 was never written"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(DEADLINE_S)
        process.stderr.close()
        assert not (output / "manifest.json").exists()
        stub.hold_after = None
        stub.open_gate()
        rerun = subprocess.run([*command, stub.url], env=env, capture_output=True, text=True, timeout=DEADLINE_S)
        assert rerun.returncode == 0, rerun.stderr
        assert "2 shards written (4 rows scored), 1 already finished" in rerun.stderr
        sampled(rows, stub.url, tmp_path / "straight", tokenizer_dir, rows_per_shard=2)
    for shard in ("shard-00000", "shard-00001", "shard-00002"):
        assert (output / f"{shard}.safetensors").read_bytes() == (tmp_path / "straight" /
                                                                  f"{shard}.safetensors").read_bytes()
    resumed, straight = (json.loads((folder / "manifest.json").read_text()) for folder in (output, tmp_path /
                                                                                            "straight"))
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in straight["shards"]]


def test_a_top_k_cache_is_still_format_version_1(tokenizer, tokenizer_dir, tmp_path):
    """Top-K caches keep the version-1 manifest (no sampled-mode keys), so older readers still read them."""
    with StubTeacher(tokenizer) as stub:
        score_dataset(conversations(2), stub.url, tmp_path, top_k=2, tokenizer=str(tokenizer_dir), retry=FAST_RETRY)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and "candidate_counts" not in manifest["dtypes"]
    assert not {"num_samples", "proposal_temperature", "seed"} & set(manifest["settings"])
    cache = TeacherCache(tmp_path)
    assert (cache.candidate_mode, cache.candidate_width) == ("topk", 3)
    np.testing.assert_array_equal(cache.teacher_logprobs(1), cache[1].teacher_topk_logprobs)
    with pytest.raises(CacheError, match="holds top-K candidates: it has no draw counts"):
        cache.counts(0)


# ------------------------------------------------------------------------------------------------ refusals


def test_sampled_settings_are_checked(tokenizer, tokenizer_dir, tmp_path, capsys):
    one = [{"prompt": "a", "completion": "b"}]
    for bad in (0, 256, None, True, 2.0):
        with pytest.raises(ConfigError, match=r"--num-samples must be an int in \[1, 255\] \(counts are stored as "
                                              "uint8\\)"):
            score_dataset(one, "http://127.0.0.1:9", tmp_path, candidates="sampled", num_samples=bad)
    with pytest.raises(ConfigError, match="--top-k is for --candidates topk"):
        score_dataset(one, "http://127.0.0.1:9", tmp_path, candidates="sampled", num_samples=4, top_k=3)
    with pytest.raises(ConfigError, match="--num-samples is for --candidates sampled"):
        score_dataset(one, "http://127.0.0.1:9", tmp_path, top_k=3, num_samples=4)
    with pytest.raises(ConfigError, match="--top-k K is required with --candidates topk"):
        score_dataset(one, "http://127.0.0.1:9", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["score", "--dataset", "x.jsonl", "--teacher-url", "http://127.0.0.1:9", "--output", str(tmp_path),
                  "--candidates", "sampled"])
    assert exit_info.value.code == 2
    assert "config error: --num-samples must be an int in [1, 255]" in capsys.readouterr().err


def test_a_server_without_the_full_distribution_is_refused(tokenizer, tokenizer_dir, tmp_path):
    rows = conversations(3)
    with StubTeacher(tokenizer, max_logprobs=20) as stub, pytest.raises(
            ConfigError, match=r"refuses full-vocabulary prompt_logprobs .*HTTP 400: Requested prompt logprobs of "
                               r"\d+, which is greater than max allowed: 20 \(parameter=prompt_logprobs, value=\d+\)\. "
                               r"Start it with `--max-logprobs -1`"):
        sampled(rows, stub.url, tmp_path / "a", tokenizer_dir)
    assert not list((tmp_path / "a").glob("shard-*"))
    with StubTeacher(tokenizer, full_entries=20) as stub, pytest.raises(
            ConfigError, match=r"returned 20 log-probs holding 0\.\d+ of the probability mass .* `--max-logprobs -1`"):
        sampled(rows, stub.url, tmp_path / "b", tokenizer_dir)


def test_a_rerun_with_other_sampling_settings_is_refused(tokenizer, tokenizer_dir, tmp_path):
    rows = conversations(4)
    with StubTeacher(tokenizer) as stub:
        sampled(rows, stub.url, tmp_path, tokenizer_dir, shard=(0, 2))
        with pytest.raises(ConfigError, match=r"other settings \(in the folder != this run: num_samples: 6 != 8\)"):
            sampled(rows, stub.url, tmp_path, tokenizer_dir, num_samples=8)
        with pytest.raises(ConfigError, match=r"other settings \(in the folder != this run: seed: 11 != 3\)"):
            sampled(rows, stub.url, tmp_path, tokenizer_dir, seed=3)
        with pytest.raises(ConfigError, match="top_k: 0 != 2; candidate_mode: 'sampled' != 'topk'; num_samples: 6 "
                                              "!= None"):
            score_dataset(rows, stub.url, tmp_path, top_k=2, tokenizer=str(tokenizer_dir), rows_per_shard=3,
                          retry=FAST_RETRY)


# ------------------------------------------------------------------------------------------------ the estimate


def write_cache(folder: Path, rows: list[CompletionRow], scores: list, vocab_size: int, num_samples: int,
                seed: int) -> TeacherCache:
    """A one-shard sampled cache written by the scorer's own shard and manifest writers (no server)."""
    settings = CacheSettings(teacher_model="dense", tokenizer_fingerprint="-", vocab_size=vocab_size, top_k=0,
                             candidate_mode="sampled", id_dtype=id_dtype_for(vocab_size), logprob_dtype="float16",
                             rows_per_shard=len(rows), dataset_rows=len(rows), num_samples=num_samples,
                             proposal_temperature=1.0, seed=seed)
    _write_shard(folder, 0, list(zip(rows, scores, strict=True)), [], settings, 0, len(rows))
    assert write_manifest_if_complete(folder, settings)
    return TeacherCache(folder)


def test_cached_sampled_rows_give_the_dense_gradient_in_expectation(tmp_path):
    """Rows drawn by the scorer from one teacher distribution over 8 tokens, stored and read back, fed to
    sparse_jsd_loss (β = 0, tail bucket) as the trainer does: the mean over 2400 independent positions of the
    gradient with respect to the student's logits equals the dense forward-KL gradient π_θ − π_T (float64) within
    5 standard errors per coordinate (the sample standard deviation of the per-position gradients / sqrt(n); the
    draws are fixed by the seed). The teacher's top-4 plus tail, on the same positions, is off by far more."""
    V, num_samples, rows_count, length = 8, 4, 300, 8
    teacher = torch.log_softmax(torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5], dtype=torch.float64), 0)
    dense_row = np.tile(teacher.float().numpy(), (length, 1))
    rows = [CompletionRow(i, [1], [3] * length) for i in range(rows_count)]
    scores = [draw_candidates(dense_row, num_samples, 5, i) for i in range(rows_count)]
    cache = write_cache(tmp_path, rows, scores, V, num_samples, 5)
    ids = torch.from_numpy(np.concatenate([cache[i].teacher_topk_ids for i in range(rows_count)])).long()
    weights = torch.from_numpy(np.concatenate([cache[i].teacher_topk_logprobs for i in range(rows_count)]))
    n = ids.shape[0]
    student = torch.randn(1, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64).expand(n, V)
    dense = torch.softmax(student, dim=-1) - teacher.exp()

    def per_position_grads(ids, lps):
        hidden = student.clone().requires_grad_(True)
        out = sparse_jsd_loss(hidden, torch.eye(V, dtype=torch.float64), ids, lps.double(), ids >= 0, beta=0.0,
                              add_tail_bucket=True, backend="torch")
        (grad,) = torch.autograd.grad(out.loss, hidden)
        return grad  # row i: the gradient of position i's loss with respect to its logits

    grads = per_position_grads(ids, weights)
    error = grads.mean(dim=0) - dense[0]
    standard_error = (grads - dense).std(dim=0) / math.sqrt(n)
    theory = torch.sqrt(teacher.exp() * (1 - teacher.exp()) / num_samples / n)  # Var = π_T(1 − π_T)/S at t = 1
    torch.testing.assert_close(standard_error, theory, rtol=0.15, atol=0)  # the sample variance is the theory's
    assert (error.abs() <= 5 * standard_error + 1e-6).all(), (error, standard_error)

    top = torch.topk(teacher, 4)
    top_ids, top_lps = top.indices.expand(n, 4), top.values.expand(n, 4)
    biased = per_position_grads(top_ids, top_lps).mean(dim=0) - dense[0]
    assert (biased.abs() > 20 * standard_error).any()


# ------------------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def sampled_cache_and_student(tokenizer, tokenizer_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("sampled-cache")
    with StubTeacher(tokenizer) as stub:
        sampled(conversations(8), stub.url, cache, tokenizer_dir, rows_per_shard=4)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=5), tokenizer,
                                  tmp_path_factory.mktemp("student"))
    return cache, student


def cache_config(cache, student, output, **overrides):
    from test_cache_training import cache_config as base

    return base(cache, student, output, **overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"beta": 0.5}, r"holds sampled teacher candidates, which estimate the forward KL \(beta=0\) only; beta=0.5"),
    ({"add_tail_bucket": False}, "holds sampled teacher candidates, which need add_tail_bucket: true"),
])
def test_biased_losses_on_a_sampled_cache_are_refused(sampled_cache_and_student, tmp_path, overrides, message):
    from fastdistill.train.trainer import AsyncDistillationTrainer

    cache, student = sampled_cache_and_student
    with pytest.raises(ConfigError, match=message):
        AsyncDistillationTrainer(cache_config(cache, student, tmp_path / "run", **overrides))


def test_a_sampled_cache_trains_with_the_loss_of_its_rows(sampled_cache_and_student, tmp_path):
    """A step on the sampled cache gives the loss of the same rows handed to the trainer as samples, and the
    candidates the trainer sees are the draws with log(c/S)."""
    from fastdistill.train.trainer import AsyncDistillationTrainer

    cache, student = sampled_cache_and_student
    summary = AsyncDistillationTrainer(cache_config(cache, student, tmp_path / "cached", max_steps=1,
                                                    shuffle=False)).train()
    rows = TeacherCache(cache)
    samples = [dataclasses.replace(rows[i], prompt_id=i) for i in range(4)]
    direct_config = cache_config(cache, student, tmp_path / "direct", max_steps=1, shuffle=False)
    direct_config.teacher_cache = None
    direct = AsyncDistillationTrainer(direct_config, samples=samples).train()
    loss = [json.loads(line)["loss"] for line in (tmp_path / "cached" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line)["loss"] for line in (tmp_path / "direct" / "metrics.jsonl").read_text().splitlines()]
    assert loss == expected and summary["steps"] == direct["steps"] == 1 and math.isfinite(loss[0])


@pytest.mark.parametrize("num_samples", [3, 9])
def test_mixing_pads_on_policy_and_sampled_rows_to_one_width(tokenizer, tokenizer_dir, tmp_path, num_samples):
    """MixedSource with a stand-in for the worker (top-K samples, K + 1 = 5 slots) and a sampled cache (S slots):
    every sample comes out max(5, S) wide with empty padding, and a step's samples pack into one row."""
    from fastdistill.data.packing import pack_row
    from fastdistill.rollout import OnPolicyShare, is_on_policy
    from fastdistill.train.collector import SourceExhausted
    from fastdistill.train.source import CacheSource, ListSource, MixedSource

    with StubTeacher(tokenizer) as stub:
        sampled(conversations(6), stub.url, tmp_path / "s", tokenizer_dir, num_samples=num_samples)
        score_dataset(conversations(6), stub.url, tmp_path / "k", top_k=4, tokenizer=str(tokenizer_dir),
                      retry=FAST_RETRY)
    cache, topk = TeacherCache(tmp_path / "s"), TeacherCache(tmp_path / "k")
    total, width = 12, max(5, num_samples)
    online_ids = [p for p in range(total) if is_on_policy(p, 0.5)]
    online = ListSource([dataclasses.replace(topk[p % 6], prompt_id=p, model_version=0) for p in online_ids])
    cached = CacheSource(cache, seed=0, shuffle=True, start_index=0, end_index=total, skip_prompt_ids=frozenset(),
                         teacher_id="default", on_policy=OnPolicyShare(0.5))
    mixed = MixedSource(online, cached, OnPolicyShare(0.5), candidate_width=width)
    taken = []
    while True:
        try:
            taken.append(mixed.next(model_version=0))
        except SourceExhausted:
            break
    assert sorted(s.prompt_id for s in taken) == list(range(total))
    for sample in taken:
        assert sample.teacher_topk_ids.shape[1] == width
        original = (topk if sample.model_version == 0 else cache)[sample.dataset_index]
        have = original.teacher_topk_ids.shape[1]
        np.testing.assert_array_equal(sample.teacher_topk_ids[:, :have], original.teacher_topk_ids)
        np.testing.assert_array_equal(sample.teacher_topk_logprobs[:, :have], original.teacher_topk_logprobs)
        assert (sample.teacher_topk_ids[:, have:] == -1).all()
        assert (sample.teacher_topk_logprobs[:, have:] == -np.inf).all()
    packed = pack_row(taken[:4], ["default"])
    assert packed.candidate_ids.shape[1] == width


# ------------------------------------------------------------------------------------------------ real vLLM


@pytest.mark.vllm
def test_score_a_sampled_cache_with_a_real_teacher_then_train_from_it(tmp_path, tiny_servers):
    """Against real vLLM: the teacher server (the session's peaked tiny teacher, lm_head scaled up, so there is a
    divergence to learn) scores a sampled training cache (S = 8; the stored log-probs of the drawn tokens are the
    teacher's, checked against HF transformers); training from the sampled cache, given no server, lowers the dense
    forward KL to the teacher on held-out rows (computed with HF transformers). A server without ``--max-logprobs
    -1`` answers with vLLM's message, which the stub tests replay."""
    from transformers import AutoModelForCausalLM

    from fastdistill.train.trainer import AsyncDistillationTrainer

    tokenizer = build_tokenizer()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    teacher_dir = tiny_servers.teacher_dir
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=11), tokenizer,
                                      tmp_path / "student")
    rows = conversations(40)
    train = score_dataset(rows[:32], tiny_servers.teacher.url, tmp_path / "cache", candidates="sampled",
                          num_samples=8, rows_per_shard=16, concurrency=4)
    assert train.manifest_written
    cache = TeacherCache(tmp_path / "cache")
    assert cache.candidate_mode == "sampled" and len(cache) == 32
    hf_teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    for i in range(4):  # the stored log-probs of the drawn tokens are the teacher's (HF transformers, float32)
        sample = cache[i]
        with torch.no_grad():
            logits = hf_teacher(torch.from_numpy(sample.input_ids.astype(np.int64))[None]).logits[0].double()
        want = torch.log_softmax(logits, dim=-1)[sample.prompt_length - 1 : -1].numpy()
        ids, stored = sample.teacher_topk_ids, cache.teacher_logprobs(i)
        used = ids >= 0
        assert (cache.counts(i).sum(axis=1) == 8).all() and ((cache.counts(i) > 0) == used).all()
        expected = np.take_along_axis(want, np.maximum(ids, 0), axis=1)[used]
        # fp16 storage (2**-11 relative) plus vLLM's float32 forward against HF's
        assert (np.abs(stored[used] - expected) <= 2.0**-11 * np.abs(expected) + 1e-4).all()

    held_out = [sum(expected_ids(tokenizer, row["messages"]), []) for row in rows[32:]]
    held_prompts = [len(expected_ids(tokenizer, row["messages"])[0]) for row in rows[32:]]

    def held_out_kl(model_dir):
        """Mean dense forward KL(teacher ‖ student) per held-out completion token, float64, with HF transformers."""
        student_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        total = count = 0.0
        with torch.no_grad():
            for ids, prompt_length in zip(held_out, held_prompts, strict=True):
                x = torch.tensor([ids])
                teacher_lp = torch.log_softmax(hf_teacher(x).logits[0].double(), -1)[prompt_length - 1 : -1]
                student_lp = torch.log_softmax(student_model(x).logits[0].double(), -1)[prompt_length - 1 : -1]
                total += float((teacher_lp.exp() * (teacher_lp - student_lp)).sum())
                count += teacher_lp.shape[0]
        return total / count

    before = held_out_kl(student_dir)
    config = cache_config(tmp_path / "cache", student_dir, tmp_path / "run", num_train_epochs=4, learning_rate=3e-3,
                          per_device_train_batch_size=8, export_final_model=True)
    summary = AsyncDistillationTrainer(config).train()
    assert summary["steps"] == 4 * 32 // 8
    after = held_out_kl(tmp_path / "run" / "final")
    assert after < 0.9 * before, (before, after)
