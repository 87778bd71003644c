"""Teachers whose vocabulary is padded beyond the student's (same tokenizer, more embedding rows).

Candidates at or beyond the student's vocabulary are folded into the teacher's tail (``fold_out_of_vocab``,
``pack_row(vocab_size=...)``): every loss backend then equals a dense float64 oracle in which the padded teacher's
mass outside the support, its padding ids included, forms the tail. The trainer counts them in
``sample/teacher_out_of_vocab_total`` and warns once per teacher; a real vLLM teacher with a padded lm_head trains a
real student end to end.
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from fastdistill import fold_out_of_vocab, narrow_support, sparse_jsd_loss
from fastdistill.data import pack_row
from fastdistill.rollout import RolloutSample
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
from fastdistill.train.config import AsyncDistillationConfig
from fastdistill.train.trainer import AsyncDistillationTrainer
from fastdistill_testing.synthetic import synthetic_samples

STUDENT_V = 300  # the student's lm_head rows
TEACHER_V = 364  # the padded teacher's
K = 8


# ------------------------------------------------------------------------------------------------ the oracle


def padded_case(seed: int = 0, N: int = 12, D: int = 32):
    """Float64 student (N hidden states, a (STUDENT_V, D) head) and a dense padded teacher over TEACHER_V ids whose
    padding rows carry real mass; wide rows in the worker's format (top-K by rank, then the realised token when it
    is outside), the realised token drawn from the student's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(STUDENT_V, D, generator=g, dtype=torch.float64) / D**0.5
    bias = 0.1 * torch.randn(STUDENT_V, generator=g, dtype=torch.float64)
    logits = 2.0 * torch.randn(N, TEACHER_V, generator=g, dtype=torch.float64)
    logits[:, STUDENT_V:] += torch.linspace(0.0, 4.0, N, dtype=torch.float64)[:, None]  # from no padding mass to most
    teacher = torch.log_softmax(logits, dim=-1)
    top_lps, top_ids = teacher.topk(K, dim=-1)
    actual = torch.multinomial(teacher[:, :STUDENT_V].exp(), 1, generator=g).squeeze(1)
    outside = ~(top_ids == actual[:, None]).any(dim=1)
    extra_ids = torch.where(outside, actual, torch.full_like(actual, -1))
    extra_lps = torch.where(outside, teacher.gather(1, actual[:, None]).squeeze(1), -torch.inf)
    wide_ids = torch.cat([top_ids, extra_ids[:, None]], dim=1)
    wide_lps = torch.cat([top_lps, extra_lps[:, None]], dim=1)
    return hidden, weight, bias, teacher, wide_ids, wide_lps, actual


def oracle(hidden, weight, bias, teacher, wide_ids, actual, beta, add_tail_bucket, temperature):
    """Σ over scored rows of the generalized JSD (nats), number of scored rows and Σ teacher entropy, in float64
    from the dense distributions. The support is what the student can produce of what the teacher reported: the
    reported ids below STUDENT_V (β = 0), [teacher top-1 if below STUDENT_V, realised] (0 < β < 1) or [realised]
    (β = 1). With the tail, each side's tail is its dense mass outside the support: for the teacher that includes
    every padding id, reported or not. Without it, both sides are renormalised over the support."""
    student = torch.softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    q_dense = teacher.exp()
    loss, scored, teacher_entropy = 0.0, 0, 0.0
    for n in range(hidden.shape[0]):
        reported = [int(t) for t in wide_ids[n] if int(t) != -1]
        if beta == 0.0:
            support = list(dict.fromkeys(t for t in reported if t < STUDENT_V))
        elif beta == 1.0:
            support = [int(actual[n])] if int(actual[n]) in reported else []
        else:
            top1 = [reported[0]] if reported and reported[0] < STUDENT_V else []
            support = list(dict.fromkeys(top1 + ([int(actual[n])] if int(actual[n]) in reported else [])))
        if not support:
            continue
        p, q = student[n, support], q_dense[n, support]
        if add_tail_bucket:
            p = torch.cat([p, (student[n].sum() - p.sum()).reshape(1)])
            q = torch.cat([q, (q_dense[n].sum() - q.sum()).reshape(1)])
        else:
            p, q = p / p.sum(), q / q.sum()
        if beta == 0.0:
            div = (q * (q.log() - p.log())).sum()
        elif beta == 1.0:
            div = (p * (p.log() - q.log())).sum()
        else:
            m = (1 - beta) * p + beta * q
            div = beta * (q * (q.log() - m.log())).sum() + (1 - beta) * (p * (p.log() - m.log())).sum()
        loss += float(div)
        scored += 1
        teacher_entropy += float(-(q * q.log()).sum())
    return loss, scored, teacher_entropy


GRID = [  # beta, add_tail_bucket, tail_mode
    (0.0, True, "exact"),
    (0.0, True, "trl"),
    (0.5, True, "exact"),
    (1.0, True, "exact"),
    (0.0, False, "exact"),
    (0.5, False, "exact"),
]


def test_the_case_has_folded_candidates_where_they_matter():
    _, _, _, _, wide_ids, _, _ = padded_case()
    folded = wide_ids >= STUDENT_V
    assert folded.any(dim=1).sum() >= 6  # most rows
    assert (wide_ids[:, 0] >= STUDENT_V).any() and (wide_ids[:, 0] < STUDENT_V).any()  # top-1 folded on some rows


@pytest.mark.parametrize("backend", ["torch", "reference", pytest.param("triton", marks=pytest.mark.interpreter),
                                     pytest.param("triton-chunked", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("beta,tail,mode", GRID)
def test_every_backend_equals_the_dense_oracle_on_folded_rows(backend, beta, tail, mode):
    if backend.startswith("triton"):
        pytest.importorskip("triton", reason="the Triton backends need the triton package")
    hidden, weight, bias, teacher, wide_ids, wide_lps, actual = padded_case()
    T = 0.8
    dtype = torch.float32 if backend.startswith("triton") else torch.float64
    h, w, b = (x.to(dtype) for x in (hidden, weight, bias))
    ids, lps, folded = fold_out_of_vocab(wide_ids, wide_lps, STUDENT_V)
    assert int(folded.sum()) == int((wide_ids >= STUDENT_V).sum()) > 0 and int(ids.max()) < STUDENT_V
    ids, lps, mask = narrow_support(ids, lps, actual, beta)
    out = sparse_jsd_loss(h, w, ids, lps, mask, bias=b, beta=beta, temperature=T, add_tail_bucket=tail,
                          tail_mode=mode, backend=backend)
    # the oracle on the inputs the backend saw (float32-rounded for the kernels), in float64
    want, scored, want_entropy = oracle(h.double(), w.double(), b.double(), teacher, wide_ids, actual, beta, tail, T)
    assert int(out.num_tokens) == scored > 0
    # float64 paths: rounding only; float32 kernels: a few eps32 per term of a sum of ~N terms of O(1)
    rtol = 1e-10 if dtype == torch.float64 else 2e-5
    assert abs(float(out.loss) - want) <= rtol * max(1.0, abs(want)), (float(out.loss), want)
    assert abs(float(out.teacher_entropy_sum) - want_entropy) <= rtol * max(1.0, want_entropy)


def test_without_tail_bucket_the_folded_mass_is_renormalised_away():
    """add_tail_bucket=False: a folded row equals the same row whose remaining candidates' teacher log-probs were
    renormalised among themselves — the folded mass leaves no trace; with the tail it changes the loss."""
    hidden, weight, bias, _, wide_ids, wide_lps, actual = padded_case(seed=4)
    ids, lps, _ = fold_out_of_vocab(wide_ids, wide_lps, STUDENT_V)
    kept = ids != -1
    shifted = torch.where(kept, lps - 5.0, lps)  # any common shift per row is renormalised away
    for tail, equal in ((False, True), (True, False)):
        a = sparse_jsd_loss(hidden, weight, ids, lps, kept, bias=bias, add_tail_bucket=tail, backend="torch")
        b = sparse_jsd_loss(hidden, weight, ids, shifted, kept, bias=bias, add_tail_bucket=tail, backend="torch")
        assert math.isclose(float(a.loss), float(b.loss), rel_tol=1e-12) == equal


def test_a_row_with_only_folded_candidates_is_not_scored():
    ids = torch.tensor([[STUDENT_V + 3, STUDENT_V, -1], [5, STUDENT_V + 1, 7]])
    lps = torch.tensor([[-0.5, -1.5, -torch.inf], [-1.0, -2.0, -3.0]], dtype=torch.float64)
    folded_ids, folded_lps, folded = fold_out_of_vocab(ids, lps, STUDENT_V)
    assert folded.tolist() == [[True, True, False], [False, True, False]]
    assert folded_ids.tolist() == [[-1, -1, -1], [5, -1, 7]]
    assert folded_lps[0].isinf().all() and folded_lps[1].tolist()[::2] == [-1.0, -3.0]
    hidden, weight, bias, *_ = padded_case(N=2)
    out = sparse_jsd_loss(hidden, weight, folded_ids, folded_lps, folded_ids != -1, bias=bias, backend="torch")
    assert int(out.num_tokens) == 1
    untouched = fold_out_of_vocab(folded_ids, folded_lps, STUDENT_V)
    assert untouched[0] is folded_ids and not untouched[2].any()  # nothing to fold: no copy


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 0), "vocab_size must be an int >= 1, got 0"),
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), True), "vocab_size must be an int >= 1, got True"),
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2), 9), r"teacher_logprobs must have the shape of "
                                                                   r"candidate_ids \(2, 3\), got \(2, 2\)"),
    ((torch.zeros(2, 3), torch.zeros(2, 3), 9), "candidate_ids must be an integer tensor, got torch.float32"),
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 9),
     "teacher_logprobs must be a floating-point tensor, got torch.int64"),
])
def test_fold_out_of_vocab_errors(args, message):
    with pytest.raises(ValueError, match=message):
        fold_out_of_vocab(*args)


def test_the_loss_refuses_out_of_vocabulary_ids_and_points_to_the_fold():
    hidden, weight, bias, _, wide_ids, wide_lps, _ = padded_case(N=4)
    with pytest.raises(ValueError, match=r"ids must lie in \[-1, V\) = \[-1, 300\).*fastdistill.fold_out_of_vocab"):
        sparse_jsd_loss(hidden, weight, wide_ids, wide_lps, wide_ids != -1, bias=bias, backend="torch")


# ------------------------------------------------------------------------------------------------ packing


def sample_with(ids: np.ndarray, lps: np.ndarray, completion: list[int], teacher_id: str, prompt_id: int):
    prompt = [1, 4, 9]
    return RolloutSample(
        input_ids=np.array(prompt + completion, dtype=np.int32),
        completion_mask=np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int32),
        teacher_topk_ids=ids.astype(np.int32), teacher_topk_logprobs=lps.astype(np.float32),
        rollout_logprobs=np.full(len(completion), -1.0, dtype=np.float32), model_version=0, teacher_id=teacher_id,
        prompt_id=prompt_id, dataset_index=prompt_id,
    )


def test_pack_row_folds_the_candidates_beyond_the_students_vocabulary():
    a = sample_with(np.array([[310, 5, -1], [7, 8, 299]]), np.array([[-0.1, -2, -np.inf], [-1, -2, -3]]), [5, 299],
                    "x", 0)
    b = sample_with(np.array([[320, 330, 6]]), np.array([[-0.5, -1.5, -4]]), [6], "y", 1)
    row = pack_row([a, b], ["x", "y"], vocab_size=300)
    assert row.candidate_ids.tolist() == [[-1, 5, -1], [7, 8, 299], [-1, -1, 6]]
    assert row.candidate_logprobs[0, 0] == -np.inf and row.candidate_logprobs[2, :2].isinf().all()
    assert row.candidate_logprobs[1].tolist() == [-1, -2, -3] and row.actual_ids.tolist() == [5, 299, 6]
    assert row.folded_ids.tolist() == [310, 320, 330] and row.folded_teacher.tolist() == [0, 1, 1]
    moved = row.to("cpu")
    assert moved.folded_ids.tolist() == [310, 320, 330]

    unfolded = pack_row([a, b], ["x", "y"])  # no vocabulary size: candidates as reported
    assert unfolded.candidate_ids[0, 0] == 310 and unfolded.folded_ids.numel() == 0
    assert unfolded.folded_teacher.numel() == 0


def test_pack_row_vocabulary_errors():
    a = sample_with(np.array([[5, 6]]), np.array([[-0.1, -2]]), [300], "x", 4)
    with pytest.raises(ValueError, match=r"sample \(prompt_id=4\) has completion token 300, beyond the student's "
                                         r"vocabulary of 300 tokens \(lm_head rows\)"):
        pack_row([a], ["x"], vocab_size=300)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"vocab_size must be None or an int >= 1, got {bad}"):
            pack_row([a], ["x"], vocab_size=bad)


# ------------------------------------------------------------------------------------------------ the trainer


def padded_teacher(tokenizer, padding: int, seed: int):
    """A tiny teacher with ``padding`` lm_head rows beyond the tokenizer, scaled up so that they reach its top-K."""
    config = tiny_config(len(tokenizer) + padding, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = build_model(config, seed=seed)
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer):] *= 8.0
    return model


def test_trainer_counts_folded_candidates_and_warns_once_per_teacher(tmp_path, caplog):
    """Offline samples from a padded teacher 'p' and an unpadded one 'u': the run ends, the metric equals the
    candidates at or beyond the student's vocabulary on the trained positions, one warning names 'p' and the sizes."""
    tokenizer = build_tokenizer()
    V = len(tokenizer)
    student_dir = save_pretrained_dir(build_model(tiny_config(V, pad_token_id=0, eos_token_id=2), seed=7), tokenizer,
                                      tmp_path / "student")
    padded = padded_teacher(tokenizer, 64, seed=11).eval()
    plain = build_model(tiny_config(V, pad_token_id=0, eos_token_id=2), seed=12).eval()
    with torch.no_grad():
        samples = [*synthetic_samples(padded, V, 4, teacher_ids=["p"], seed=1),
                   *synthetic_samples(plain, V, 4, teacher_ids=["u"], seed=2)]
    for index, sample in enumerate(samples):
        sample.prompt_id = sample.dataset_index = index
    expected = sum(int((s.teacher_topk_ids >= V).sum()) for s in samples)
    assert expected > 0 and all(not (s.teacher_topk_ids >= V).any() for s in samples[4:])
    config = AsyncDistillationConfig(
        model_name_or_path=str(student_dir), output_dir=str(tmp_path / "run"),
        teacher_server_urls={"p": "http://127.0.0.1:9", "u": "http://127.0.0.1:10"}, weight_sync_backend="none",
        learning_rate=1e-3, num_train_epochs=1, gradient_checkpointing=False, disable_tqdm=True, save_strategy="no",
        token_budget=0, export_final_model=False, per_device_train_batch_size=2, shuffle=False,
    )
    with caplog.at_level(logging.WARNING, logger="fastdistill.train.trainer"):
        summary = AsyncDistillationTrainer(config, samples=samples).train()
    assert summary["steps"] == 4
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["sample/teacher_out_of_vocab_total"] for r in records) == expected
    assert all(math.isfinite(r["loss"]) for r in records)
    warnings = [r.getMessage() for r in caplog.records if "folded into the teacher's tail" in r.getMessage()]
    largest = max(int(s.teacher_topk_ids.max()) for s in samples[:4])
    assert warnings == [f"teacher 'p' returned candidate ids up to {largest}, but the student's vocabulary has {V} "
                        f"tokens (lm_head rows): the teacher's vocabulary is at least {largest + 1} tokens, padded "
                        "beyond the student's. Those candidates are folded into the teacher's tail bucket (the "
                        "student cannot produce them) and counted in sample/teacher_out_of_vocab_total; warned once "
                        "per teacher."]


# ------------------------------------------------------------------------------------------------ real vLLM


@pytest.fixture(scope="module")
def padded_servers(tmp_path_factory):
    """(student folder, student server with gloo weight transfer, padded teacher server): one tokenizer, a student
    with 512 vocabulary rows and a teacher with 640 whose padding lm_head rows reach its top-K."""
    from fastdistill_testing.vllm_server import require_vllm, student_and_teacher

    require_vllm()
    tokenizer = build_tokenizer()
    assert len(tokenizer) < 512
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    student_dir = save_pretrained_dir(build_model(tiny_config(512, **special), seed=1), tokenizer,
                                      tmp_path_factory.mktemp("student"))
    teacher_dir = save_pretrained_dir(padded_teacher(tokenizer, 640 - len(tokenizer), seed=2), tokenizer,
                                      tmp_path_factory.mktemp("padded-teacher"))
    with student_and_teacher(student_dir, teacher_dir, tmp_path_factory.mktemp("logs")) as (student, teacher):
        yield student_dir, student, teacher


@pytest.mark.vllm
def test_a_padded_vllm_teacher_passes_the_vocabulary_check_and_trains_a_student(tmp_path, padded_servers, caplog):
    """The startup check accepts the padded teacher (same tokenizer; a different tokenizer is refused by
    test_vocabulary_check_against_real_servers), its served top-K holds ids beyond the student's 512 rows, and a
    short run folds them, counts them, warns once and trains with a finite loss."""
    import asyncio

    from fastdistill.rollout import StudentClient, TeacherClient, check_shared_vocabulary

    student_dir, student, teacher = padded_servers

    async def check() -> None:
        async with StudentClient(student.url) as student_client, TeacherClient(teacher.url) as teacher_client:
            await check_shared_vocabulary(student_client, {"padded": teacher_client})

    asyncio.run(check())  # no VocabularyMismatchError
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i + 1}."}]} for i in range(8)]
    config = AsyncDistillationConfig(
        model_name_or_path=str(student_dir), output_dir=str(tmp_path / "run"), vllm_server_base_url=student.url,
        teacher_server_urls={"padded": teacher.url}, per_device_train_batch_size=4, num_train_epochs=1,
        learning_rate=1e-3, token_budget=0, max_completion_length=8, teacher_top_k=4, gradient_checkpointing=False,
        disable_tqdm=True, save_strategy="no", export_final_model=False, heartbeat_stale_after_s=60.0,
    )
    with caplog.at_level(logging.WARNING, logger="fastdistill.train.trainer"):
        summary = AsyncDistillationTrainer(config, train_dataset=rows).train()
    assert summary["steps"] == 2 and summary["model_version"] == 3  # the cold sync, then one per step
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert sum(r["sample/teacher_out_of_vocab_total"] for r in records) > 0
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    warnings = [r.getMessage() for r in caplog.records if "folded into the teacher's tail" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("teacher 'padded' returned candidate ids up to ")
    assert "the student's vocabulary has 512 tokens" in warnings[0]
