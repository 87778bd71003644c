"""Property tests: invariances of the torch path that must hold for any input."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_cases import make_case, rel_close

from fastdistill.loss.api import torch_sparse_jsd
from fastdistill.loss.chunked import LossConfig

configs = st.builds(
    LossConfig,
    logit_scale=st.sampled_from([0.5, 1.0, 2.0]),
    softcap=st.sampled_from([None, 3.0]),
    beta=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    temperature=st.sampled_from([0.7, 1.0, 2.0]),
    add_tail_bucket=st.just(True),
    tail_mode=st.sampled_from(["exact", "trl"]),
)


def _loss_and_grads(case, cfg, ids, lps, mask, chunk_rows):
    h, w, b = case.leaves(torch.float64)
    out = torch_sparse_jsd(h, w, b, ids, lps, mask, cfg, case.teacher_index, 2, chunk_rows=chunk_rows)
    return out, torch.autograd.grad(out.loss, (h, w, b))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 20), chunk=st.integers(1, 25), cfg=configs)
def test_chunk_size_does_not_change_results(seed, n, chunk, cfg):
    case = make_case(seed=seed, N=n, V=50, K=4)
    ids, lps, mask = case.narrowed(cfg.beta)
    one, g_one = _loss_and_grads(case, cfg, ids, lps, mask, chunk_rows=chunk)
    all_, g_all = _loss_and_grads(case, cfg, ids, lps, mask, chunk_rows=n)
    for f in ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum", "per_teacher"):
        rel_close(getattr(one, f), getattr(all_, f), 1e-12, f)
    for a, b in zip(g_one, g_all, strict=True):
        rel_close(a, b, 1e-12, "grad")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cfg=configs, perm_seed=st.integers(0, 10_000))
def test_permuting_candidate_slots_does_not_change_the_loss(seed, cfg, perm_seed):
    case = make_case(seed=seed, N=12, V=60, K=6, dup_frac=0.0)
    ids, lps, mask = case.narrowed(cfg.beta)
    perm = torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(perm_seed))
    base, g_base = _loss_and_grads(case, cfg, ids, lps, mask, chunk_rows=5)
    permuted, g_perm = _loss_and_grads(case, cfg, ids[:, perm], lps[:, perm], mask[:, perm], chunk_rows=5)
    rel_close(permuted.loss, base.loss, 1e-12, "loss")
    for a, b in zip(g_perm, g_base, strict=True):
        rel_close(a, b, 1e-10, "grad")
