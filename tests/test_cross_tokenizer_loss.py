"""Cross-tokenizer losses against TRL 1.16 GOLD's ``ULDLoss`` (where the definitions coincide), a float64 dense
reference written from the definitions (loss and gradients), gradcheck, and their failure paths."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastdistill.cross_tokenizer import (
    TokenizerBytes,
    VocabularyMap,
    build_targets,
    realised_logprobs,
    render_teacher_sequence,
    student_completion_spans,
    teacher_completion_ids,
)
from fastdistill.loss.cross_losses import group_reverse_kl_pg_loss, hybrid_loss, sorted_student_logprobs, uld_loss
from fastdistill_testing.cross_tokenizer_samples import student_tokenizer, teacher_tokenizer

TEXT = "Hello! café 🙂 — the answer is 12345, said the teacher model."
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def case():
    """One completion aligned across the two tiny tokenizers, random float64 student head and dense teacher."""
    student, teacher = TokenizerBytes.of(student_tokenizer()), TokenizerBytes.of(teacher_tokenizer())
    ids = student.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    seq = render_teacher_sequence(student, teacher, MESSAGES, ids)
    a = seq.alignment
    sizes_s = np.bincount(a.student_group[a.student_group >= 0])
    sizes_t = np.bincount(a.teacher_group)
    assert (sizes_s > 1).any() and (sizes_t > 1).any() and ((sizes_s == 1) & (sizes_t == 1)).any()
    gen = torch.Generator().manual_seed(0)
    v_s, v_t, d = len(student.pieces), len(teacher.pieces), 16
    return SimpleNamespace(
        student=student, teacher=teacher, seq=seq, alignment=a, ids=torch.tensor(ids),
        hidden=torch.randn(len(ids), d, generator=gen, dtype=torch.float64),
        weight=torch.randn(v_s, d, generator=gen, dtype=torch.float64) * 0.7,
        bias=torch.randn(v_s, generator=gen, dtype=torch.float64) * 0.3,
        teacher_logprobs=torch.log_softmax(torch.randn(len(seq.completion_ids), v_t, generator=gen,
                                                       dtype=torch.float64) * 2.0, dim=1),
        vocab=VocabularyMap.from_token_bytes(student, teacher),
    )


def sparse_teacher(case, k: int):
    """The teacher's wire rows: top-k by probability, then the realised token when outside (K+1 slots)."""
    lps = case.teacher_logprobs.numpy()
    order = np.argsort(-lps, axis=1, kind="stable")[:, :k]
    realised = case.seq.completion_ids.astype(np.int64)
    extra = np.where((order == realised[:, None]).any(axis=1), -1, realised)
    cand = np.concatenate([order, extra[:, None]], axis=1)
    cand_lps = np.where(cand >= 0, np.take_along_axis(lps, np.clip(cand, 0, None), axis=1), -np.inf)
    return cand, cand_lps


def target_tensors(case, vocab, k):
    cand, lps = sparse_teacher(case, k)
    # float64 log-probs give float64 targets (float32 ones ship), so the oracles compare to float64 rounding
    t = build_targets(case.alignment, case.seq.completion_ids, cand, lps, vocab, top_k=k)
    assert t.shared_logprobs.dtype == np.float64
    names = ("group_index", "group_start", "shared_ids", "shared_logprobs", "unshared_logprobs",
             "continuation_logprob", "group_logprob")
    return {name: torch.from_numpy(np.asarray(getattr(t, name))) for name in names}, cand, lps


def gold_uld(case, hybrid: bool, beta: float = 0.5):
    from trl.experimental.gold.gold_trainer import ULDLoss

    config = SimpleNamespace(
        uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
        uld_teacher_temperature=1.0, uld_skip_student_eos=False, uld_skip_teacher_eos=False, use_extended_uld=True,
        uld_token_merge_strategy="observed", uld_use_hybrid_loss=hybrid, uld_hybrid_matched_weight=None,
        uld_hybrid_unmatched_weight=None, beta=beta)

    def vocab_of(tb):  # GOLD pairs vocabulary strings; special tokens left out, as the byte map leaves them out
        return SimpleNamespace(get_vocab=lambda: {p: i for p, i in tb.tokenizer.get_vocab().items()
                                                  if tb.pieces[i] is not None})

    loss_fn = ULDLoss(config, vocab_of(case.student), vocab_of(case.teacher)) if hybrid else ULDLoss(config)
    s_spans = student_completion_spans(case.student, case.ids.tolist()).spans
    t_ids = torch.from_numpy(case.seq.completion_ids.astype(np.int64))
    _, t_spans, _ = teacher_completion_ids(case.teacher, case.seq.text)
    logits = case.hidden @ case.weight.T + case.bias
    loss = loss_fn(student_logits=logits[None], teacher_logits=case.teacher_logprobs[None],
                   student_labels=case.ids[None], teacher_labels=t_ids[None], student_input_ids=case.ids[None],
                   teacher_input_ids=t_ids[None], student_byte_offsets=torch.from_numpy(s_spans)[None],
                   teacher_byte_offsets=torch.from_numpy(t_spans)[None])
    return loss, loss_fn


def test_uld_loss_matches_gold_uld_with_a_dense_teacher(case):
    v_t = case.teacher_logprobs.shape[1]
    t, _, _ = target_tensors(case, VocabularyMap.empty(case.weight.shape[0], v_t), k=v_t)
    out = uld_loss(case.hidden, case.weight, case.ids, t["group_index"], t["group_start"], t["unshared_logprobs"],
                   t["continuation_logprob"], bias=case.bias)
    gold, _ = gold_uld(case, hybrid=False)
    groups = case.alignment.num_groups
    assert int(out.num_groups) == groups
    torch.testing.assert_close(out.loss / groups, gold, rtol=1e-10, atol=1e-12)


def test_hybrid_unshared_term_and_weights_match_gold(case):
    v_t = case.teacher_logprobs.shape[1]
    t, _, _ = target_tensors(case, case.vocab, k=v_t)
    shared = torch.from_numpy(case.vocab.student_shared)
    w_shared, w_unshared = case.vocab.gold_weights()
    out = hybrid_loss(case.hidden, case.weight, case.ids, t["group_index"], t["group_start"], t["shared_ids"],
                      t["shared_logprobs"], t["unshared_logprobs"], t["continuation_logprob"], shared,
                      shared_weight=w_shared, unshared_weight=w_unshared, beta=0.5, bias=case.bias)
    _, gold = gold_uld(case, hybrid=True)
    groups = case.alignment.num_groups
    torch.testing.assert_close(out.uld_sum / groups, gold.last_unmatched_loss, rtol=1e-9, atol=1e-12)
    assert w_shared == pytest.approx(case.vocab.num_shared / v_t)
    assert torch.isfinite(out.jsd_sum) and float(out.jsd_sum) > 0


def head(hidden, weight, bias, scale, softcap, temperature):
    z = (hidden @ weight.T + (0 if bias is None else bias)) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def divergence(p, q, beta):
    """Generalized JSD of two probability vectors (p student, q teacher), zero entries contributing 0."""
    def kl(a, b):
        return torch.where(a > 0, a * (torch.log(a) - torch.log(torch.where(a > 0, b, torch.ones_like(b)))),
                           torch.zeros_like(a)).sum()
    if beta == 0.0:
        return kl(q, p)
    if beta == 1.0:
        return kl(p, q)
    m = (1 - beta) * p + beta * q
    return beta * kl(q, m) + (1 - beta) * kl(p, m)


def reference_hybrid(case, cand, lps, vocab, k, *, beta, w_shared, w_unshared, scale=1.0, softcap=None,
                     temperature=1.0):
    """Float64, dense, one group at a time, from the alignment and the teacher's wire rows (not the targets)."""
    logp = torch.log_softmax(head(case.hidden, case.weight, case.bias, scale, softcap, temperature), dim=1)
    probs = logp.exp()
    a = case.alignment
    realised = realised_logprobs(case.seq.completion_ids.astype(np.int64), cand, lps)
    shared_mask = torch.from_numpy(vocab.student_shared)
    total = torch.zeros((), dtype=torch.float64)
    for g in range(a.num_groups):
        s_rows = np.nonzero(a.student_group == g)[0]
        t_rows = np.nonzero(a.teacher_group == g)[0]
        p = probs[s_rows[0]]
        c_s = torch.exp(sum((logp[r, case.ids[r]] for r in s_rows[1:]), torch.zeros((), dtype=torch.float64)))
        c_t = math.exp(realised[t_rows[1:]].sum())
        shared_q: dict[int, float] = {}
        ranked = []
        for slot, (u, lp) in enumerate(zip(cand[t_rows[0]], lps[t_rows[0]], strict=True)):
            if u < 0 or not np.isfinite(lp):
                continue
            v = int(vocab.teacher_to_student[u])
            if v >= 0:
                shared_q[v] = shared_q.get(v, 0.0) + math.exp(lp)
            elif slot < k:
                ranked.append(math.exp(lp))
        if shared_q:
            ids = torch.tensor(sorted(shared_q))
            q = torch.tensor([shared_q[v] for v in sorted(shared_q)], dtype=torch.float64)
            off = torch.ones_like(p, dtype=torch.bool)
            off[ids] = False
            p_b = torch.cat([p[ids], p[off].sum()[None]])
            q_b = torch.cat([q, (1 - q.sum())[None]])
            total = total + w_shared * divergence(p_b, q_b, beta)
        unshared = torch.sort(p[~shared_mask], descending=True).values
        n = len(ranked)
        top = torch.cat([unshared, torch.zeros(max(0, n - unshared.numel()), dtype=torch.float64)])[:n]
        s_rest = c_s * (unshared.sum() - top.sum())
        t_rest = c_t * max(0.0, 1 - sum(shared_q.values()) - sum(ranked))
        t_ranked = c_t * torch.tensor(sorted(ranked, reverse=True), dtype=torch.float64)
        uld = (c_s * top - t_ranked).abs().sum() + (s_rest - t_rest).abs()
        total = total + w_unshared * uld
    return total


def run_hybrid(case, t, vocab, *, beta, w_shared, w_unshared, chunk_rows=128, **head_kw):
    return hybrid_loss(case.hidden, case.weight, case.ids, t["group_index"], t["group_start"], t["shared_ids"],
                       t["shared_logprobs"], t["unshared_logprobs"], t["continuation_logprob"],
                       torch.from_numpy(vocab.student_shared), shared_weight=w_shared, unshared_weight=w_unshared,
                       beta=beta, bias=case.bias, chunk_rows=chunk_rows, **head_kw)


@pytest.mark.parametrize("beta, k, head_kw", [
    (0.0, 8, {}),
    (0.5, 5, {"temperature": 0.7}),
    (1.0, 12, {"logit_scale": 1.3, "softcap": 4.0}),
    (0.3, 380, {}),
])
def test_hybrid_loss_and_gradients_match_the_dense_float64_reference(case, beta, k, head_kw):
    t, cand, lps = target_tensors(case, case.vocab, k)
    w_shared, w_unshared = 0.6, 0.4
    for x in (case.hidden, case.weight, case.bias):
        x.requires_grad_(True)
    try:
        out = run_hybrid(case, t, case.vocab, beta=beta, w_shared=w_shared, w_unshared=w_unshared, chunk_rows=7,
                         **head_kw)
        got = torch.autograd.grad(out.loss, (case.hidden, case.weight, case.bias))
        ref_kw = {"scale": head_kw.get("logit_scale", 1.0), "softcap": head_kw.get("softcap"),
                  "temperature": head_kw.get("temperature", 1.0)}
        ref = reference_hybrid(case, cand, lps, case.vocab, k, beta=beta, w_shared=w_shared, w_unshared=w_unshared,
                               **ref_kw)
        want = torch.autograd.grad(ref, (case.hidden, case.weight, case.bias))
    finally:
        for x in (case.hidden, case.weight, case.bias):
            x.requires_grad_(False)
    torch.testing.assert_close(out.loss, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    assert int(out.num_groups) == case.alignment.num_groups


def test_chunking_does_not_change_the_loss(case):
    t, _, _ = target_tensors(case, case.vocab, 6)
    one = run_hybrid(case, t, case.vocab, beta=0.5, w_shared=1.0, w_unshared=1.0, chunk_rows=1)
    many = run_hybrid(case, t, case.vocab, beta=0.5, w_shared=1.0, w_unshared=1.0, chunk_rows=1000)
    torch.testing.assert_close(one.loss, many.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(one.uld, many.uld, rtol=1e-12, atol=1e-12)


def small_problem(seed=0, v=11, d=3):
    """Two groups of 2 and 1 student rows; 3 unshared ranks, shared ids 0..3."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64)
    group_index = torch.tensor([0, 0, 1, -1])
    group_start = torch.tensor([True, False, True, False])
    ids = torch.tensor([2, 5, 7, 1])
    shared_ids = torch.tensor([[0, 3, -1], [-1, -1, -1], [1, 2, 0], [-1, -1, -1]])
    shared_lps = torch.log(torch.tensor([[0.3, 0.1, 0.0], [0, 0, 0], [0.2, 0.2, 0.1], [0, 0, 0]], dtype=torch.float64))
    unshared = torch.log(torch.tensor([[0.2, 0.1, 0.05], [0, 0, 0], [0.25, 0.0, 0.0], [0, 0, 0]], dtype=torch.float64))
    cont = torch.tensor([math.log(0.5), 0.0, math.log(0.8), 0.0], dtype=torch.float64)
    shared_mask = torch.zeros(v, dtype=torch.bool)
    shared_mask[:4] = True
    return SimpleNamespace(hidden=hidden, weight=weight, ids=ids, group_index=group_index, group_start=group_start,
                           shared_ids=shared_ids, shared_lps=shared_lps, unshared=unshared, cont=cont,
                           shared_mask=shared_mask)


def test_gradcheck_hybrid_and_uld():
    c = small_problem()

    def hybrid(h, w):
        return hybrid_loss(h, w, c.ids, c.group_index, c.group_start, c.shared_ids, c.shared_lps, c.unshared,
                           c.cont, c.shared_mask, shared_weight=0.7, unshared_weight=0.3, beta=0.4,
                           chunk_rows=1).loss

    def uld(h, w):
        return uld_loss(h, w, c.ids, c.group_index, c.group_start, c.unshared, c.cont, chunk_rows=2).loss

    for fn in (hybrid, uld):
        assert torch.autograd.gradcheck(fn, (c.hidden.clone().requires_grad_(), c.weight.clone().requires_grad_()))


def test_sorted_student_logprobs_against_a_dense_sort():
    c = small_problem(seed=3, v=40, d=5)
    top, mass = sorted_student_logprobs(c.hidden, c.weight, 6, excluded=c.shared_mask, chunk_rows=3)
    logp = torch.log_softmax(c.hidden @ c.weight.T, dim=1)
    torch.testing.assert_close(top, logp[:, 4:].sort(dim=1, descending=True).values[:, :6])
    torch.testing.assert_close(mass, torch.logsumexp(logp[:, 4:], dim=1))


def test_reverse_kl_pg_over_groups_matches_a_dense_reference(case):
    t, cand, lps = target_tensors(case, case.vocab, 6)
    gen = torch.Generator().manual_seed(1)
    rollout = (torch.log_softmax(case.hidden @ case.weight.T + case.bias, dim=1)
               .gather(1, case.ids[:, None]).squeeze(1) + 0.1 * torch.randn(len(case.ids), generator=gen,
                                                                              dtype=torch.float64))
    for x in (case.hidden, case.weight):
        x.requires_grad_(True)
    try:
        out = group_reverse_kl_pg_loss(case.hidden, case.weight, case.ids, t["group_index"], t["group_start"],
                                       t["group_logprob"], bias=case.bias, rollout_logprobs=rollout, ratio_clip=1.05)
        got = torch.autograd.grad(out.loss, (case.hidden, case.weight))
        logp = torch.log_softmax(case.hidden @ case.weight.T + case.bias, dim=1)
        lp = logp.gather(1, case.ids[:, None]).squeeze(1)
        a = case.alignment
        realised = realised_logprobs(case.seq.completion_ids.astype(np.int64), cand, lps)
        ref, advantages, ratios = torch.zeros((), dtype=torch.float64), [], []
        for g in range(a.num_groups):
            rows = torch.from_numpy(np.nonzero(a.student_group == g)[0])
            advantage = float(realised[a.teacher_group == g].sum()) - float(lp[rows].sum().detach())
            ratio = math.exp(float((lp[rows] - rollout[rows]).sum().detach()))
            ref = ref - advantage * min(ratio, 1.05) * lp[rows].sum()
            advantages.append(advantage)
            ratios.append(ratio)
        want = torch.autograd.grad(ref, (case.hidden, case.weight))
    finally:
        for x in (case.hidden, case.weight):
            x.requires_grad_(False)
    torch.testing.assert_close(out.loss, ref, rtol=1e-9, atol=1e-9)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-10)
    assert int(out.num_tokens) == a.num_groups
    torch.testing.assert_close(out.reverse_kl, -torch.tensor(advantages, dtype=torch.float64))
    assert float(out.ratio_max) == pytest.approx(max(ratios))
    assert int(out.clipped) == sum(r > 1.05 for r in ratios) > 0


def test_training_on_the_hybrid_loss_moves_the_student_toward_the_teacher(case):
    t, _, _ = target_tensors(case, case.vocab, 20)
    weight = case.weight.clone().float().requires_grad_(True)
    hidden = case.hidden.float()
    opt = torch.optim.Adam([weight], lr=0.1)
    parts = []
    for _ in range(8):
        out = hybrid_loss(hidden, weight, case.ids, t["group_index"], t["group_start"], t["shared_ids"],
                          t["shared_logprobs"].float(), t["unshared_logprobs"].float(),
                          t["continuation_logprob"].float(), torch.from_numpy(case.vocab.student_shared),
                          shared_weight=0.75, unshared_weight=0.25, beta=0.5)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        parts.append((float(out.loss.detach()), float(out.jsd_sum), float(out.uld_sum)))
    (loss0, jsd0, uld0), (loss1, jsd1, uld1) = parts[0], parts[-1]
    assert loss1 < 0.75 * loss0 and jsd1 < jsd0 and uld1 < uld0


def test_no_groups_still_gives_a_connected_zero_loss():
    c = small_problem()
    none = torch.full((4,), -1)
    no_start = torch.zeros(4, dtype=torch.bool)
    h = c.hidden.clone().requires_grad_()
    out = hybrid_loss(h, c.weight, c.ids, none, no_start, c.shared_ids, c.shared_lps, c.unshared, c.cont,
                      c.shared_mask, shared_weight=1.0, unshared_weight=1.0)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and int(out.num_groups) == 0 and torch.equal(h.grad, torch.zeros_like(h))
    pg = group_reverse_kl_pg_loss(h, c.weight, c.ids, none, no_start, c.cont)
    assert float(pg.loss.detach()) == 0.0 and int(pg.num_tokens) == 0


def test_errors():
    c = small_problem()
    args = (c.hidden, c.weight, c.ids, c.group_index, c.group_start, c.shared_ids, c.shared_lps, c.unshared, c.cont,
            c.shared_mask)
    kw = dict(shared_weight=1.0, unshared_weight=1.0)
    with pytest.raises(ValueError, match="group_index and group_start must have shape"):
        hybrid_loss(*args[:3], c.group_index[:3], *args[4:], **kw)
    with pytest.raises(ValueError, match="a group start has group_index -1"):
        hybrid_loss(*args[:3], torch.tensor([0, 0, 1, -1]), torch.tensor([True, False, True, True]), *args[5:], **kw)
    with pytest.raises(ValueError, match="exactly one start"):
        hybrid_loss(*args[:4], torch.tensor([True, True, True, False]), *args[5:], **kw)
    with pytest.raises(ValueError, match="student_shared must be a bool tensor"):
        hybrid_loss(*args[:9], c.shared_mask[:-1], **kw)
    with pytest.raises(ValueError, match="shared_weight must be a finite number"):
        hybrid_loss(*args, shared_weight=-1.0, unshared_weight=1.0)
    with pytest.raises(ValueError, match="unshared_logprobs must have 4 rows"):
        hybrid_loss(*args[:7], c.unshared[:2], *args[8:], **kw)
    with pytest.raises(ValueError, match="actual_ids must lie in"):
        uld_loss(c.hidden, c.weight, c.ids + 20, c.group_index, c.group_start, c.unshared, c.cont)
    with pytest.raises(ValueError, match="hidden must be"):
        uld_loss(c.hidden[:, :2], c.weight, c.ids, c.group_index, c.group_start, c.unshared, c.cont)
    with pytest.raises(ValueError, match="ratio_clip needs rollout_logprobs"):
        group_reverse_kl_pg_loss(c.hidden, c.weight, c.ids, c.group_index, c.group_start, c.cont, ratio_clip=2.0)
    with pytest.raises(ValueError, match="group_logprob must be finite"):
        group_reverse_kl_pg_loss(c.hidden, c.weight, c.ids, c.group_index, c.group_start,
                                 torch.full((4,), float("-inf"), dtype=torch.float64))
