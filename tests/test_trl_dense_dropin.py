"""Dense-teacher drop-ins for TRL 1.16's ``GKDTrainer`` and ``DistillationTrainer``: the patched losses against TRL's
own functions (value and student gradients), real one-step trainings with and without the patch, and the undo."""

from __future__ import annotations

import math
import os

import pytest
import torch

from fastdistill.integrations import trl as integ
from fastdistill.tiny import build_model, build_tokenizer, tiny_config

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
gkd_module = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
dist_module = pytest.importorskip("trl.trainer.distillation_trainer")
EPS32 = torch.finfo(torch.float32).eps
B, T, DS, DT, V = 3, 9, 16, 24, 70


def make_inputs(seed: int, dtype: torch.dtype, bias: bool):
    """Hidden states and heads of both sides, labels with prompt (-100) prefixes, one fully masked row."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, DS, generator=g, dtype=torch.float64)
    ht = torch.randn(B, T, DT, generator=g, dtype=torch.float64)
    ws = torch.randn(V, DS, generator=g, dtype=torch.float64) * (1.5 / DS**0.5)
    wt = torch.randn(V, DT, generator=g, dtype=torch.float64) * (2.0 / DT**0.5)
    bs = 0.1 * torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    bt = 0.1 * torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :4] = -100
    labels[1, :2] = -100
    labels[1, -1] = -100  # a padded tail
    labels[2] = -100  # nothing to score in this row
    leaves = [x.to(dtype).requires_grad_(True) for x in (hs, ws)] + [None if bs is None else bs.to(dtype)
                                                                    .requires_grad_(True)]
    teacher = [ht.to(dtype), wt.to(dtype), None if bt is None else bt.to(dtype)]
    return leaves, teacher, labels


def logits(h, w, b, scale, softcap):
    """Model logits as transformers produces them: softcap(scale · (h Wᵀ + b))."""
    z = h @ w.t()
    if b is not None:
        z = z + b
    z = z * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def fp32_bounds(leaves, teacher, mask, scale, softcap, temperature, n_norm):
    """Bounds on |fp32 result − exact| for the loss and each student gradient, from float64 values: each per-entry
    term of the divergence p·(log p − log m) etc. is rounded a handful of times, so an fp32 evaluation is off by a
    few eps32 · Σ_v (p + q)(1 + |log p| + |log q|) per row, plus the logits' own rounding (eps32 · Σ_d |h_d W_vd|,
    which moves the divergence by at most twice that); the gradient entries inherit that per-entry error through one
    more product with |W| (dh) or |h| (dW). The factor 16 covers both sides' evaluations."""
    hs, ws, bs = (None if x is None else x.detach().double() for x in leaves)
    ht, wt, bt = (None if x is None else x.double() for x in teacher)
    hs, ht = hs.reshape(-1, hs.shape[-1])[mask], ht.reshape(-1, ht.shape[-1])[mask]
    s = (logits(hs, ws, bs, scale, softcap) / temperature).log_softmax(-1)
    t = (logits(ht, wt, bt, 1.0, None) / temperature).log_softmax(-1)
    terms = (s.exp() + t.exp()) * (1 + s.abs() + t.abs())
    logit_err = EPS32 * (hs.abs() @ ws.abs().t()).amax(-1) * scale / temperature
    loss = 16 * EPS32 * float(terms.sum()) + 32 * float(logit_err.sum())
    unit = terms * 16 * EPS32 * scale / temperature + 16 * logit_err[:, None] * (s.exp() + t.exp())
    dh = float((unit @ ws.abs()).max()) if unit.numel() else 0.0
    dw = float((unit.t() @ hs.abs()).max()) if unit.numel() else 0.0
    db = float(unit.sum(0).max()) if unit.numel() else 0.0
    return [x / n_norm for x in (loss, dh, dw, db)]


def grads_of(loss, leaves):
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


CASES = [(beta, items, bias) for beta in (0.0, 0.5, 1.0) for items, bias in ((None, False), (17, True))]


@pytest.mark.parametrize("beta,num_items,bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gkd_loss_equals_trl_generalized_jsd_loss(beta, num_items, bias, dtype):
    """Ours from hidden states and heads == TRL's ``generalized_jsd_loss`` on the materialised logits."""
    leaves, teacher, labels = make_inputs(int(beta * 4) + 7 * bool(bias), dtype, bias)
    scale, softcap, temperature = 1.3, 4.0, 0.7
    mask = (labels != -100).reshape(-1)
    theirs = gkd_module.GKDTrainer.generalized_jsd_loss(
        logits(*leaves, scale, softcap), logits(*teacher, 1.0, None), labels, beta=beta, temperature=temperature,
        num_items_in_batch=num_items)
    ours = integ.dense_generalized_jsd_loss(
        leaves[0], teacher[0], leaves[1], teacher[1], labels, beta=beta, temperature=temperature,
        num_items_in_batch=num_items, student_lm_head_bias=leaves[2], teacher_lm_head_bias=teacher[2],
        student_logit_scale=scale, student_softcap=softcap)
    assert ours.dtype == theirs.dtype
    if dtype == torch.float64:
        bounds = [1e-12] * 4
    else:
        bounds = fp32_bounds(leaves, teacher, mask, scale, softcap, temperature, num_items or int(mask.sum()))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=bounds[0])
    for mine, trls, bound, name in zip(grads_of(ours, leaves), grads_of(theirs, leaves), bounds[1:],
                                       ("dh", "dW", "db"), strict=False):
        torch.testing.assert_close(mine, trls, rtol=0, atol=bound, msg=name)


def test_gkd_reductions_and_no_labels():
    leaves, teacher, labels = make_inputs(3, torch.float64, False)
    sl, tl = logits(*leaves, 1.0, None), logits(*teacher, 1.0, None)
    for reduction in integ.GKD_REDUCTIONS:
        for lab in (labels, None):
            theirs = gkd_module.GKDTrainer.generalized_jsd_loss(sl, tl, lab, beta=0.5, reduction=reduction)
            ours = integ.dense_generalized_jsd_loss(leaves[0], teacher[0], leaves[1], teacher[1], lab, beta=0.5,
                                                    reduction=reduction)
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0, msg=f"{reduction} {lab is None}")
    with pytest.raises(ValueError, match="reduction must be one of"):
        integ.dense_generalized_jsd_loss(leaves[0], teacher[0], leaves[1], teacher[1], labels, reduction="none")
    with pytest.raises(ValueError, match="labels must have shape"):
        integ.dense_generalized_jsd_loss(leaves[0], teacher[0], leaves[1], teacher[1], labels[:, 1:])
    with pytest.raises(ValueError, match="must be \\(B, T, H\\) with the same \\(B, T\\)"):
        integ.dense_generalized_jsd_loss(leaves[0], teacher[0][:, 1:], leaves[1], teacher[1], labels)


def test_patch_without_trl_is_a_clear_import_error(monkeypatch):
    def missing(name, *args, **kwargs):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(integ.importlib, "import_module", missing)
    for patch in (integ.patch_trl_gkd, integ.patch_trl_distillation, integ.unpatch_trl_dense):
        with pytest.raises(ImportError, match=r"needs TRL's trl\..*pip install 'trl==1.16.0'"):
            patch()


@pytest.mark.parametrize("beta,num_items,bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_distillation_loss_equals_trl_chunked_divergence_loss(beta, num_items, bias, dtype):
    """Ours == TRL's ``_chunked_divergence_loss`` (which computes in fp32 whatever the input dtype): float64 inputs
    are held to the float64 oracle (TRL GKD's ``generalized_jsd_loss`` on float64 logits, the same divergence) and
    TRL's fp32 result to the fp32 bound around it; fp32 inputs to TRL's own result within the fp32 bound."""
    leaves, teacher, labels = make_inputs(11 + int(beta * 4) + 7 * bool(bias), dtype, bias)
    scale, softcap, temperature = 0.8, 6.0, 1.6
    completion_mask = (labels != -100).long()
    mask = completion_mask.reshape(-1) != 0
    kwargs = dict(num_items_in_batch=num_items, student_lm_head_bias=leaves[2], teacher_lm_head_bias=teacher[2],
                  student_logit_scale=scale, student_final_logit_softcapping=softcap, temperature=temperature)
    args = (leaves[0], teacher[0], leaves[1], teacher[1], completion_mask, beta)
    theirs = dist_module._chunked_divergence_loss(*args, **kwargs)
    ours = integ.trl_chunked_divergence_loss(*args, **kwargs)
    bounds = fp32_bounds(leaves, teacher, mask, scale, softcap, temperature, num_items or int(mask.sum()))
    assert int(ours[2]) == int(theirs[2]) == int(mask.sum())
    # entropy: a sum of positive terms -Σ p log p; fp32 relative error only
    torch.testing.assert_close(ours[1].double(), theirs[1].double(), rtol=16 * EPS32 * math.log(V), atol=0)
    trl_grads = grads_of(theirs[0], leaves)
    if dtype == torch.float64:
        oracle = gkd_module.GKDTrainer.generalized_jsd_loss(
            logits(*leaves, scale, softcap), logits(*teacher, 1.0, None), labels, beta=beta, temperature=temperature,
            num_items_in_batch=num_items)
        oracle_grads = grads_of(oracle, leaves)
        torch.testing.assert_close(ours[0], oracle, rtol=0, atol=1e-12)
        for mine, exact in zip(grads_of(ours[0], leaves), oracle_grads, strict=True):
            torch.testing.assert_close(mine, exact, rtol=0, atol=1e-12)
        reference, reference_grads = oracle, oracle_grads
    else:
        reference, reference_grads = ours[0], grads_of(ours[0], leaves)
    torch.testing.assert_close(theirs[0].to(dtype), reference, rtol=0, atol=bounds[0])
    for trls, ref, bound, name in zip(trl_grads, reference_grads, bounds[1:], ("dh", "dW", "db"), strict=False):
        torch.testing.assert_close(trls.to(dtype), ref, rtol=0, atol=bound, msg=name)


def test_patches_are_idempotent_and_reversible():
    original_loss = dist_module._chunked_divergence_loss
    original_compute = gkd_module.GKDTrainer.__dict__["compute_loss"]
    integ.patch_trl_dense()
    integ.patch_trl_dense()
    assert dist_module._chunked_divergence_loss is integ.trl_chunked_divergence_loss
    assert gkd_module.GKDTrainer.compute_loss is integ.gkd_compute_loss
    integ.unpatch_trl_dense()
    integ.unpatch_trl_dense()
    assert dist_module._chunked_divergence_loss is original_loss
    assert gkd_module.GKDTrainer.__dict__["compute_loss"] is original_compute
    with integ.fastdistill_dense_loss_in_trl():
        assert gkd_module.GKDTrainer.compute_loss is integ.gkd_compute_loss
    assert gkd_module.GKDTrainer.__dict__["compute_loss"] is original_compute
    assert dist_module._chunked_divergence_loss is original_loss


class Zero3Like(torch.nn.Module):
    """A wrapper that partitions like DeepSpeed ZeRO-3 / FSDP with resharding: outside its forward every parameter of
    the wrapped model is an empty tensor; inside, the full values are put back, and released when it returns."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.full = {name: p.data for name, p in module.named_parameters()}
        self._release()

    def _release(self) -> None:
        for p in self.module.parameters():
            p.data = torch.empty(0, dtype=p.dtype)

    def forward(self, *args, **kwargs):
        for name, p in self.module.named_parameters():
            p.data = self.full[name]
        try:
            return self.module(*args, **kwargs)
        finally:
            self._release()


def _gkd_self(teacher, beta):
    from types import SimpleNamespace

    def unwrap(m):
        return m.module if isinstance(m, Zero3Like) else m

    return SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=unwrap), teacher_model=teacher, beta=beta)


def _gkd_batch(vocab_size):
    g = torch.Generator().manual_seed(8)
    input_ids = torch.randint(3, vocab_size, (2, 7), generator=g)
    labels = input_ids.clone()
    labels[:, :3] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def test_gkd_loss_reads_the_lm_heads_inside_the_wrapped_forwards():
    """With both models partitioned outside their forward (ZeRO-3 / FSDP), the patched loss is the unwrapped one:
    nothing reads a parameter outside a forward."""
    tokenizer = build_tokenizer()
    student, teacher = models(tokenizer)
    batch = _gkd_batch(len(tokenizer))
    with torch.no_grad():
        expected = integ.gkd_compute_loss(_gkd_self(teacher, 0.5), student, batch)
        got = integ.gkd_compute_loss(_gkd_self(Zero3Like(teacher), 0.5), Zero3Like(student), batch)
    assert torch.isfinite(expected) and float(got) == pytest.approx(float(expected), rel=1e-6)


def test_gkd_loss_uses_each_models_logit_head():
    """A Granite student (logits divided by logits_scaling = 8) and a Gemma2-style softcapped teacher: the patched
    loss equals TRL's generalized_jsd_loss on the models' own logits (their forwards)."""
    import transformers

    common = dict(vocab_size=70, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(3)
    student = transformers.AutoModelForCausalLM.from_config(transformers.GraniteConfig(**common, logits_scaling=8.0))
    teacher = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(**common, final_logit_softcapping=2.0)).eval()
    for model in (student, teacher):
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, 1.0)
    student, teacher = student.double(), teacher.double()
    batch = _gkd_batch(70)
    ours = integ.gkd_compute_loss(_gkd_self(teacher, 0.5), student, batch)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=batch["input_ids"]).logits
    student_logits = student(input_ids=batch["input_ids"]).logits
    theirs = gkd_module.GKDTrainer.generalized_jsd_loss(student_logits[:, :-1], teacher_logits[:, :-1],
                                                        labels=batch["labels"][:, 1:], beta=0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


# --- real trainers, one optimizer step each, with and without the patch ---------------------------------------------

MESSAGES = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "The answer is 5."}],
    [{"role": "user", "content": "Spell 'cat' backwards."}, {"role": "assistant", "content": "tac"}],
    [{"role": "user", "content": "Count to 5."}, {"role": "assistant", "content": "1 2 3 4 5."}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "How can I help you today?"}],
]


def models(tokenizer):
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    teacher_config = tiny_config(len(tokenizer), hidden_size=96, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    return build_model(config, seed=1), build_model(teacher_config, seed=2).eval()


def train_one_step(make_trainer):
    trainer = make_trainer()
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(trainer.model.lm_head.weight, before), "the step did not move the student"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return losses, params, trainer


def common_args(tmp_path):
    return dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=0.5,
                optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                seed=3, use_cpu=True, bf16=False, disable_dropout=True)


def assert_same_training(plain, patched):
    (their_losses, their_params, _), (our_losses, our_params, _) = plain, patched
    assert len(their_losses) == len(our_losses) == 1
    # fp32 losses of order 1 nat; the step moves parameters by lr · grad with fp32-rounded gradients
    assert our_losses[0] == pytest.approx(their_losses[0], rel=1e-5, abs=1e-6)
    for name, p in their_params.items():
        torch.testing.assert_close(our_params[name], p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_gkd_trainer_step_same_with_and_without_patch(beta, tmp_path):
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig

    tokenizer = build_tokenizer()
    head_calls = []  # lm_head forwards: each one materialises (B, T, V) logits

    def make():
        student, teacher = models(tokenizer)
        for m in (student, teacher):
            m.lm_head.register_forward_hook(lambda *_: head_calls.append(1))
        args = GKDConfig(**common_args(tmp_path), lmbda=0.0, seq_kd=False, beta=beta, max_length=64)
        return gkd_module.GKDTrainer(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                                     train_dataset=Dataset.from_list([{"messages": m} for m in MESSAGES]))

    integ.unpatch_trl_gkd()
    plain = train_one_step(make)
    assert len(head_calls) == 2  # TRL: both models' full forward
    head_calls.clear()
    with integ.fastdistill_dense_loss_in_trl():
        patched = train_one_step(make)
        assert not head_calls, "the patched GKD step ran an lm_head forward (materialised logits)"
        # return_outputs: the student backbone's output instead of logits
        trainer = patched[2]
        batch = next(iter(trainer.get_train_dataloader()))
        loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
        assert outputs.last_hidden_state.shape[:2] == batch["input_ids"].shape
        assert torch.isfinite(loss)
    assert_same_training(plain, patched)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_distillation_trainer_step_same_with_and_without_patch(beta, tmp_path):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"

    def make():
        student, teacher = models(tokenizer)
        args = DistillationConfig(**common_args(tmp_path), beta=beta, max_completion_length=8, temperature=0.9)
        prompts = [{"prompt": m[:1]} for m in MESSAGES]
        return DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                                   train_dataset=Dataset.from_list(prompts))

    integ.unpatch_trl_distillation()
    plain = train_one_step(make)
    calls = []
    with integ.fastdistill_dense_loss_in_trl():
        original = integ.trl_chunked_divergence_loss
        dist_module._chunked_divergence_loss = lambda *a, **k: calls.append(1) or original(*a, **k)
        patched = train_one_step(make)
    assert calls, "the patched loss was not called"
    assert dist_module._chunked_divergence_loss.__module__ == "trl.trainer.distillation_trainer"
    assert_same_training(plain, patched)
