"""tail_mode="trl" reproduces TRL 1.16's own loss (called from the installed package) and its gradients.

TRL casts hidden states and weights to float32 (``.float()``) whatever their dtype, so parity is checked in
float32 at float32 tolerances.
"""

from __future__ import annotations

import os

import pytest
import torch
from loss_cases import make_case, rel_close

from fastdistill import narrow_support, sparse_jsd_loss

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_loss = pytest.importorskip(
    "trl.experimental.async_distillation.async_distillation_trainer",
    reason="trl is not installed (it comes with the 'test' extra)",
)


def _trl(case, ids, lps, mask, scored, h, w, b, beta, T, tail, scale, softcap, chunk):
    """TRL's chunked loss on the scored rows only (TRL's caller selects those rows itself)."""
    return trl_loss._chunked_jsd_loss(
        h[scored], w, b, scale, softcap, ids[scored].long(), lps[scored], mask[scored], beta, T, tail,
        case.teacher_index[scored], 2, chunk,
    )


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("softcap,scale,T,bias", [(None, 1.0, 1.0, False), (5.0, 1.3, 0.7, True)])
def test_matches_trl_chunked_jsd_loss(beta, tail, softcap, scale, T, bias):
    if beta == 1.0 and not tail:
        pytest.skip("TRL returns an identically zero loss here; fastdistill rejects it (tested elsewhere)")
    case = make_case(seed=int(beta * 8) + 2 * tail, N=40, K=8, dup_frac=0.0)  # TRL does not deduplicate at β=0
    ids, lps, mask = case.narrowed(beta)
    scored = mask.any(dim=1)

    lps = lps.float()
    h, w, b = case.leaves(torch.float32, bias=bias)
    theirs = _trl(case, ids, lps, mask, scored, h, w, b, beta, T, tail, scale, softcap, chunk=7)
    their_grads = torch.autograd.grad(theirs[0], [x for x in (h, w, b) if x is not None])

    h2, w2, b2 = case.leaves(torch.float32, bias=bias)
    ours = sparse_jsd_loss(h2, w2, ids, lps, mask, bias=b2, logit_scale=scale, softcap=softcap, beta=beta,
                           temperature=T, add_tail_bucket=tail, tail_mode="trl",
                           teacher_index=case.teacher_index, num_teachers=2)
    our_grads = torch.autograd.grad(ours.loss, [x for x in (h2, w2, b2) if x is not None])

    assert int(ours.num_tokens) == int(scored.sum())
    for mine, trls, name in zip((ours.loss, ours.jsd_sum, ours.entropy_sum, ours.teacher_entropy_sum), theirs[:4],
                                ("loss", "jsd_sum", "entropy_sum", "teacher_entropy_sum"), strict=True):
        rel_close(mine, trls, 1e-5, name)
    # TRL's per-teacher vector is [count, jsd, teacher_entropy] * num_teachers
    rel_close(ours.per_teacher.reshape(-1), theirs[4], 1e-5, "per_teacher")
    for mine, trls, name in zip(our_grads, their_grads, ("dh", "dW", "db")[: len(our_grads)], strict=True):
        rel_close(mine, trls, 1e-5, name)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_narrow_support_matches_trl(beta):
    case = make_case(seed=3, N=50, K=6)
    ours = narrow_support(case.wide_ids, case.wide_lps, case.actual, beta)
    if beta == 0.0:
        assert torch.equal(ours[2], case.wide_ids != -1)
        return
    theirs = trl_loss._narrow_top1_actual_support(
        case.wide_ids[None], case.wide_lps[None], case.actual[None], case.wide_ids[None] != -1, beta
    )
    for mine, trls in zip(ours, theirs, strict=True):
        assert torch.equal(mine, trls[0])

