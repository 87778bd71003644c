"""Every error a user can hit from the loss API: a ValueError that names the offending argument."""

from __future__ import annotations

import pytest
import torch

from fastdistill import narrow_support, sparse_jsd_loss


def _inputs(N=4, D=6, V=10, S=3):
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden=torch.randn(N, D, generator=g),
        weight=torch.randn(V, D, generator=g),
        ids=torch.randint(V, (N, S), generator=g),
        lps=torch.full((N, S), -2.0),
        mask=torch.ones(N, S, dtype=torch.bool),
    )


def _call(**overrides):
    args = _inputs()
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return sparse_jsd_loss(args["hidden"], args["weight"], args["ids"], args["lps"], args["mask"], **kwargs)


BAD = [
    (dict(hidden=torch.randn(4)), "hidden must be 2-D"),
    (dict(hidden=torch.ones(4, 6, dtype=torch.long)), "hidden must be a floating-point"),
    (dict(weight=torch.randn(10, 5)), "weight must be 2-D \\(V, D\\) with D = 6"),
    (dict(weight=torch.ones(10, 6, dtype=torch.int32)), "weight must be a floating-point"),
    (dict(weight=torch.randn(0, 6)), "weight must have at least one vocabulary row"),
    (dict(weight=[[1.0]]), "weight must be a torch.Tensor"),
    (dict(bias=torch.randn(9)), "bias must have shape \\(10,\\)"),
    (dict(bias=torch.ones(10, dtype=torch.long)), "bias must be a floating-point"),
    (dict(ids=torch.zeros(3, 3, dtype=torch.long)), "ids must be 2-D \\(N, S\\) with N = 4"),
    (dict(ids=torch.zeros(4, 0, dtype=torch.long), lps=torch.zeros(4, 0), mask=torch.zeros(4, 0, dtype=torch.bool)),
     "ids must have at least one candidate slot"),
    (dict(ids=torch.zeros(4, 3)), "ids must be an integer tensor"),
    (dict(ids=torch.full((4, 3), 10)), "ids must lie in \\[-1, V\\) = \\[-1, 10\\)"),
    (dict(ids=torch.full((4, 3), -2)), "ids must lie in \\[-1, V\\)"),
    (dict(lps=torch.zeros(4, 2)), "lps must have the shape of ids"),
    (dict(lps=torch.zeros(4, 3, dtype=torch.long)), "lps must be a floating-point"),
    (dict(lps=torch.tensor([[float("nan"), -1.0, -1.0]] * 4)), "lps has 4 NaN or \\+inf teacher log-probs"),
    (dict(lps=torch.tensor([[float("inf"), -1.0, -1.0]] * 4)), "lps has 4 NaN or \\+inf"),
    (dict(mask=torch.ones(4, 3, dtype=torch.long)), "mask must be a bool tensor"),
    (dict(mask=torch.ones(4, 2, dtype=torch.bool)), "mask must have the shape of ids"),
    (dict(lps=torch.zeros(4, 3, device="meta")), "lps is on meta but hidden is on cpu"),
    (dict(bias=torch.zeros(10, device="meta")), "bias is on meta but hidden is on cpu"),
    (dict(beta=1.5), "beta must be a number in \\[0, 1\\]"),
    (dict(beta=-0.1), "beta must be a number in \\[0, 1\\]"),
    (dict(beta="0.5"), "beta must be a number"),
    (dict(temperature=0.0), "temperature must be a finite number > 0"),
    (dict(temperature=-1.0), "temperature must be a finite number > 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number > 0"),
    (dict(logit_scale=0.0), "logit_scale must be a finite number > 0"),
    (dict(softcap=0.0), "softcap must be None or a finite number > 0"),
    (dict(softcap=float("nan")), "softcap must be None or a finite number > 0"),
    (dict(add_tail_bucket=1), "add_tail_bucket must be a bool"),
    (dict(tail_mode="subtract"), "tail_mode must be one of \\('exact', 'trl'\\)"),
    (dict(backend="cuda"), "backend must be one of \\('auto', 'torch', 'reference', 'triton', 'triton-chunked'\\)"),
    (dict(num_teachers=0), "num_teachers must be an int >= 1"),
    (dict(teacher_index=torch.zeros(3, dtype=torch.long)), "teacher_index must have shape \\(4,\\)"),
    (dict(teacher_index=torch.zeros(4)), "teacher_index must be an integer tensor"),
    (dict(teacher_index=torch.tensor([0, 1, 2, 0]), num_teachers=2), "teacher_index values must lie in \\[0, num_"),
    (dict(teacher_index=[0, 0, 0, 0]), "teacher_index must be a torch.Tensor"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_input_raises_value_error_naming_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


def test_single_slot_without_tail_is_rejected():
    args = _inputs(S=1)
    with pytest.raises(ValueError, match="add_tail_bucket=False with a single support slot"):
        sparse_jsd_loss(*args.values(), beta=1.0, add_tail_bucket=False)


def test_nan_on_unused_slots_is_allowed():
    args = _inputs()
    args["lps"][:, 2] = float("nan")
    args["mask"][:, 2] = False
    out = sparse_jsd_loss(*args.values())
    assert torch.isfinite(out.loss)


NARROW_BAD = [
    (dict(beta=2.0), "beta must be a number in \\[0, 1\\]"),
    (dict(teacher_logprobs=torch.zeros(4, 2)), "teacher_logprobs must have the shape of candidate_ids"),
    (dict(actual_ids=torch.zeros(3, dtype=torch.long)), "actual_ids must have shape \\(4,\\)"),
    (dict(candidate_ids=torch.zeros(4, 3)), "candidate_ids must be an integer tensor"),
    (dict(actual_ids=torch.zeros(4)), "actual_ids must be an integer tensor"),
    (dict(teacher_logprobs=torch.zeros(4, 3, dtype=torch.long)), "teacher_logprobs must be a floating-point"),
    (dict(candidate_ids=torch.zeros(4, 0, dtype=torch.long), teacher_logprobs=torch.zeros(4, 0)),
     "candidate_ids must have at least one candidate slot"),
]


@pytest.mark.parametrize("overrides,message", NARROW_BAD)
def test_narrow_support_bad_input(overrides, message):
    args = dict(candidate_ids=torch.zeros(4, 3, dtype=torch.long), teacher_logprobs=torch.zeros(4, 3),
                actual_ids=torch.zeros(4, dtype=torch.long), beta=0.5)
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        narrow_support(**args)
