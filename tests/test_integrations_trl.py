"""``fastdistill.integrations.trl``: TRL 1.16's own loss entry point (``_compute_loss``) patched vs unpatched."""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from loss_cases import divergence_term_scale, fp32_divergence_slack
from transformers import AutoModelForCausalLM

from fastdistill.integrations.trl import fastdistill_loss_in_trl, patch_trl, trl_chunked_jsd_loss, unpatch_trl
from fastdistill.tiny import build_model, build_tokenizer, tiny_config
from fastdistill_testing.synthetic import synthetic_samples

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_module = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
ACCUMULATION_STEPS = 2


def fake_trainer(beta: float, teacher_ids: list[str]) -> SimpleNamespace:
    """The attributes TRL's ``_compute_loss`` reads from its trainer, for one CPU process."""
    accelerator = SimpleNamespace(autocast=contextlib.nullcontext, num_processes=1,
                                  reduce=lambda tensor, reduction="sum": tensor)
    return SimpleNamespace(
        args=SimpleNamespace(beta=beta, teacher_temperature=1.0, add_tail_bucket=True), accelerator=accelerator,
        _teacher_ids=teacher_ids, _metrics={"train": defaultdict(list)},
        current_gradient_accumulation_steps=ACCUMULATION_STEPS, _step_forward_tokens=0.0, _step_trained_tokens=0.0,
        _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0,
    )


def collated_batch(teacher_ids: list[str]):
    """TRL's collator output for 6 synthetic samples packed into one row."""
    tokenizer = build_tokenizer()
    teacher = build_model(tiny_config(len(tokenizer)), seed=5).eval()
    samples = synthetic_samples(teacher, len(tokenizer), 6, teacher_ids=teacher_ids, seed=1)
    collator = trl_module.DataCollatorForRollout(pad_token_id=0, num_processes=1,
                                                  teacher_id_to_idx={t: i for i, t in enumerate(teacher_ids)})
    rows = [[{**s.to_trl_layout(), "teacher_id": s.teacher_id, "prompt_id": s.prompt_id, "metrics": {}}
             for s in samples]]
    return collator.torch_call([rows])


def run_trl_compute_loss(model, batch, beta, teacher_ids):
    trainer = fake_trainer(beta, teacher_ids)
    model.zero_grad()
    loss = trl_module.AsyncDistillationTrainer._compute_loss(trainer, model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, {k: v for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_patched_trl_computes_the_same_loss_gradients_and_metrics(beta, monkeypatch):
    teacher_ids = ["math", "code"]
    batch = collated_batch(teacher_ids)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tokenizer)), attn_implementation="sdpa")
    unpatch_trl()
    calls = []
    original = trl_module._chunked_jsd_loss
    monkeypatch.setattr(trl_module, "_chunked_jsd_loss", lambda *args: calls.append(args) or original(*args))
    theirs = run_trl_compute_loss(model, batch, beta, teacher_ids)
    monkeypatch.undo()
    with fastdistill_loss_in_trl():
        assert trl_module._chunked_jsd_loss is trl_chunked_jsd_loss
        ours = run_trl_compute_loss(model, batch, beta, teacher_ids)
    assert trl_module._chunked_jsd_loss is not trl_chunked_jsd_loss  # restored
    # Both losses are fp32 sums of terms a·log a, a·log b far larger than the divergence (~1e-4 nats at β=0.5):
    # the absolute slack follows those terms' size (fp32_divergence_slack), plus 1e-5 relative for the sums.
    (args,) = calls
    scale, teacher_index = divergence_term_scale(*args), args[11]
    slack = {"jsd": fp32_divergence_slack(scale)} | {
        f"teacher_jsd/{t}": fp32_divergence_slack(scale[teacher_index == i]) for i, t in enumerate(teacher_ids)}
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=slack["jsd"] / ACCUMULATION_STEPS)
    for name, grad in theirs[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert ours[2].keys() == theirs[2].keys()
    for key, values in theirs[2].items():
        for mine, trls in zip(ours[2][key], values, strict=True):
            if isinstance(trls, tuple):
                assert mine == trls, key  # (count, total) token counts: exact
            else:
                # entropies are sums of positive terms: relative fp32 error only
                assert mine == pytest.approx(trls, rel=1e-5, abs=slack.get(key, 0.0)), key


def test_patch_is_idempotent_and_reversible():
    original = trl_module._chunked_jsd_loss
    patch_trl()
    patch_trl()
    assert trl_module._chunked_jsd_loss is trl_chunked_jsd_loss
    unpatch_trl()
    unpatch_trl()
    assert trl_module._chunked_jsd_loss is original
