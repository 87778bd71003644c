"""The trainer's loss gets its operands in the compute dtype: under autocast (bfloat16 compute on one process) the
hidden states and the lm_head reach the loss in bfloat16, as FSDP2's mixed precision hands them over on several
ranks; without autocast they are the parameters themselves. The gradients still reach the float32 parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastdistill.train.model as model_module
from fastdistill.data.packing import pack_row
from fastdistill.loss import narrow_support
from fastdistill.rollout import RolloutSample
from fastdistill.tiny import build_model, tiny_config
from fastdistill.train.config import AsyncDistillationConfig

VOCAB = 64


def _row():
    rng = np.random.default_rng(0)
    completion = rng.integers(3, VOCAB, 6)
    ids = np.concatenate([rng.integers(3, VOCAB, (6, 3)), completion[:, None]], axis=1).astype(np.int32)
    lps = np.log(rng.dirichlet(np.ones(5), 6)[:, :4]).astype(np.float32)
    sample = RolloutSample(
        input_ids=np.concatenate([rng.integers(3, VOCAB, 4), completion]).astype(np.int32),
        completion_mask=np.r_[np.zeros(4), np.ones(6)].astype(np.int32), teacher_topk_ids=ids,
        teacher_topk_logprobs=lps, rollout_logprobs=np.full(6, -1.0, np.float32), model_version=0,
        teacher_id="default", prompt_id=0, dataset_index=0)
    row = pack_row([sample], ["default"], vocab_size=VOCAB)
    return row, *narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, 0.0)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_loss_gets_the_compute_dtype_and_the_master_weights_their_gradient(monkeypatch, autocast):
    seen = []
    real = model_module.sparse_jsd_loss

    def spy(hidden, weight, *args, **kwargs):
        seen.append((hidden.dtype, weight.dtype))
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(model_module, "sparse_jsd_loss", spy)
    student = build_model(tiny_config(VOCAB, hidden_size=32, intermediate_size=64))
    wrapped = model_module.DistillationModel(student, AsyncDistillationConfig(model_name_or_path="student",
                                                                            loss_backend="torch"))
    row, ids, lps, mask = _row()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = wrapped(row, ids, lps, mask)
    out.loss.backward()
    expected = torch.bfloat16 if autocast else torch.float32
    assert seen == [(expected, expected)]
    head = student.get_output_embeddings().weight
    assert head.dtype == torch.float32 and head.grad is not None and head.grad.dtype == torch.float32
    assert torch.isfinite(head.grad).all() and head.grad.abs().sum() > 0
