"""Drop-in for TRL 1.16's ``AsyncDistillationTrainer``: replace its chunked JSD loss with :func:`sparse_jsd_loss`.

```python
from fastdistill.integrations.trl import patch_trl
patch_trl()   # every AsyncDistillationTrainer from now on uses fastdistill's loss
```

TRL's ``_compute_loss`` looks ``_chunked_jsd_loss`` up in its module at every call, so swapping that module attribute
is enough: batching, normalisation and metrics stay TRL's. The replacement uses ``tail_mode="trl"`` (TRL's clamped
student tail), so the loss, its gradients and the metrics equal TRL's; it is faster and never holds more than one
bounded logits tile (``backend="auto"``: see :func:`fastdistill.sparse_jsd_loss`).

Dense-teacher drop-ins (a local teacher model, its full next-token distribution), both built on
:func:`fastdistill.loss.dense.dense_teacher_jsd_loss`:

```python
from fastdistill.integrations.trl import fastdistill_dense_loss_in_trl
with fastdistill_dense_loss_in_trl():   # or patch_trl_dense() / unpatch_trl_dense()
    trainer.train()                     # GKDTrainer or DistillationTrainer
```

- ``DistillationTrainer`` looks ``_chunked_divergence_loss`` up in its module at every call; the patch swaps that
  attribute for :func:`trl_chunked_divergence_loss` (same arguments, same ``(loss, entropy_sum, n_valid)``).
- ``GKDTrainer.compute_loss`` runs both full models for ``(B, T, V)`` logits; the patch replaces it (on the class) by
  :func:`gkd_compute_loss`, which runs both backbones for last hidden states and calls
  :func:`dense_generalized_jsd_loss` with both lm_heads, so no ``(B, T, V)`` tensor exists; each lm_head is read
  inside its model's forward (FSDP / ZeRO-3 gather parameters only there) and each model's logit scale and softcap
  come from :func:`fastdistill.logit_head.logit_head_from_config`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fastdistill.logit_head import LogitHead, causal_lm_parts, logit_head_from_config
from fastdistill.loss import sparse_jsd_loss
from fastdistill.loss.dense import dense_teacher_jsd_loss

TRL_MODULE = "trl.experimental.async_distillation.async_distillation_trainer"
GKD_MODULE = "trl.experimental.gkd.gkd_trainer"
DISTILLATION_MODULE = "trl.trainer.distillation_trainer"
GKD_REDUCTIONS = ("batchmean", "sum", "mean")


def trl_chunked_jsd_loss(
    hidden_valid: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    logit_scale: float,
    final_logit_softcapping: float | None,
    target_ids: torch.Tensor,
    teacher_target_logps: torch.Tensor,
    valid_candidate_mask: torch.Tensor,
    beta: float,
    temperature: float,
    add_tail_bucket: bool,
    teacher_id_idx: torch.Tensor | None,
    num_teachers: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's ``_chunked_jsd_loss`` signature and return value, computed by :func:`sparse_jsd_loss`.

    Shapes: ``hidden_valid`` (n, H); ``target_ids`` / ``teacher_target_logps`` / ``valid_candidate_mask`` (n, K).
    Returns ``(loss, jsd_sum, entropy_sum, teacher_entropy_sum, per_teacher_stats)`` where ``per_teacher_stats``
    is ``[count, jsd_sum, teacher_entropy_sum]`` per teacher, flattened (3·num_teachers,). ``chunk_size`` is
    ignored: the tile height is chosen by the backend.
    """
    out = sparse_jsd_loss(
        hidden_valid, lm_head_weight, target_ids, teacher_target_logps, valid_candidate_mask, bias=lm_head_bias,
        logit_scale=float(logit_scale), softcap=final_logit_softcapping, beta=float(beta),
        temperature=float(temperature), add_tail_bucket=bool(add_tail_bucket), tail_mode="trl",
        teacher_index=teacher_id_idx, num_teachers=int(num_teachers),
    )
    stats = out.per_teacher.reshape(-1).to(torch.float32)
    return out.loss, out.jsd_sum.float(), out.entropy_sum.float(), out.teacher_entropy_sum.float(), stats


def _trl_module():
    try:
        return importlib.import_module(TRL_MODULE)
    except ImportError as error:
        raise ImportError(f"patch_trl needs TRL's async distillation trainer ({TRL_MODULE}); pip install "
                          "'trl==1.16.0'") from error


def patch_trl() -> None:
    """Make TRL's ``AsyncDistillationTrainer`` compute its loss with fastdistill (idempotent)."""
    module = _trl_module()
    if module._chunked_jsd_loss is not trl_chunked_jsd_loss:
        module._fastdistill_original_chunked_jsd_loss = module._chunked_jsd_loss
        module._chunked_jsd_loss = trl_chunked_jsd_loss


def unpatch_trl() -> None:
    """Restore TRL's own loss."""
    module = _trl_module()
    original = getattr(module, "_fastdistill_original_chunked_jsd_loss", None)
    if original is not None:
        module._chunked_jsd_loss = original
        del module._fastdistill_original_chunked_jsd_loss


@contextmanager
def fastdistill_loss_in_trl() -> Iterator[None]:
    """``with fastdistill_loss_in_trl(): trainer.train()`` — patched inside the block only."""
    patch_trl()
    try:
        yield
    finally:
        unpatch_trl()


# --- dense teacher: TRL's DistillationTrainer and GKDTrainer ---------------------------------------------------------


def trl_chunked_divergence_loss(
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's ``distillation_trainer._chunked_divergence_loss`` signature and return value, computed by
    :func:`dense_teacher_jsd_loss`.

    Shapes: hidden states ``(B, K, H_s)`` / ``(B, K, H_t)``, lm_head weights ``(V, H)``, ``completion_mask``
    ``(B, K)`` (non-zero = scored). Returns ``(loss, entropy_sum, n_valid)``: the divergence summed over scored
    positions divided by ``num_items_in_batch`` (or by ``max(n_valid, 1)`` when None), the student's entropy at
    ``temperature`` summed over scored positions (nats, no gradient), and the number of scored positions.
    """
    student_lm_head_weight, student_lm_head_bias = _gathered(student_lm_head_weight, student_lm_head_bias,
                                                             student_hidden_states.dtype)
    teacher_lm_head_weight, teacher_lm_head_bias = _gathered(teacher_lm_head_weight, teacher_lm_head_bias,
                                                             teacher_hidden_states.dtype)
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    out = _dense_on_positions(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                              teacher_lm_head_weight, student_lm_head_bias, teacher_lm_head_bias,
                              student_logit_scale, student_final_logit_softcapping, teacher_logit_scale,
                              teacher_final_logit_softcapping, beta, temperature, valid)
    if num_items_in_batch is None:
        return out.loss / n_valid.clamp(min=1), out.entropy_sum.float(), n_valid
    return _divided(out.loss, num_items_in_batch), out.entropy_sum.float(), n_valid


def _gathered(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """An FSDP2-sharded (DTensor) lm_head gathered once into full tensors, the weight in ``dtype``, as TRL does;
    plain tensors unchanged."""
    if not isinstance(weight, torch.distributed.tensor.DTensor):
        return weight, bias
    return weight.full_tensor().to(dtype), None if bias is None else bias.full_tensor()


def _dense_on_positions(student_hidden, teacher_hidden, student_weight, teacher_weight, student_bias, teacher_bias,
                        student_scale, student_softcap, teacher_scale, teacher_softcap, beta, temperature, mask):
    """:func:`dense_teacher_jsd_loss` on ``(B, T, H)`` hidden states flattened to their ``B·T`` positions, ``mask``
    ``(B·T,)`` bool or None."""
    return dense_teacher_jsd_loss(
        student_hidden.reshape(-1, student_hidden.size(-1)), student_weight,
        teacher_hidden.reshape(-1, teacher_hidden.size(-1)), teacher_weight,
        student_bias=student_bias, teacher_bias=teacher_bias,
        student_logit_scale=float(student_scale), student_softcap=student_softcap,
        teacher_logit_scale=float(teacher_scale), teacher_softcap=teacher_softcap,
        beta=float(beta), temperature=float(temperature), mask=mask,
    )


def _divided(loss: torch.Tensor, num_items_in_batch: torch.Tensor | int) -> torch.Tensor:
    """``loss / num_items_in_batch`` (TRL's normalisation by the items of the whole gradient-accumulation batch)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def dense_generalized_jsd_loss(
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: torch.Tensor | int | None = None,
    *,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
) -> torch.Tensor:
    """TRL's ``GKDTrainer.generalized_jsd_loss`` on the logits ``softcap(scale · (h Wᵀ + b))`` of both heads,
    computed by :func:`dense_teacher_jsd_loss` without materialising them.

    Shapes: hidden states ``(B, T, H_s)`` / ``(B, T, H_t)`` (already aligned with ``labels``: pass the causally
    shifted ones), weights ``(V, H)``, ``labels`` ``(B, T)`` with -100 at positions to skip, or None (all scored).
    Reductions as TRL's: with ``num_items_in_batch`` the sum over scored positions divided by it; else
    ``"batchmean"`` divides by the number of scored positions (at least 1; by ``B`` when ``labels`` is None),
    ``"sum"`` does not divide, ``"mean"`` divides by the number of (position, vocabulary id) elements. TRL's
    ``"none"`` (a ``(n, V)`` tensor) is not offered: it is what this function avoids.
    """
    if reduction not in GKD_REDUCTIONS:
        raise ValueError(f"reduction must be one of {GKD_REDUCTIONS} (a per-element (n, V) result would "
                         f"materialise the logits), got {reduction!r}")
    if student_hidden_states.dim() != 3 or teacher_hidden_states.shape[:2] != student_hidden_states.shape[:2]:
        raise ValueError("student_hidden_states and teacher_hidden_states must be (B, T, H) with the same (B, T), "
                         f"got {tuple(student_hidden_states.shape)} and {tuple(teacher_hidden_states.shape)}")
    if labels is not None and labels.shape != student_hidden_states.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(student_hidden_states.shape[:2])} (the hidden states' "
                         f"(B, T)), got {tuple(labels.shape)}")
    mask = None if labels is None else (labels != -100).reshape(-1)
    out = _dense_on_positions(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                              teacher_lm_head_weight, student_lm_head_bias, teacher_lm_head_bias,
                              student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap, beta,
                              temperature, mask)
    loss = out.loss
    if num_items_in_batch is not None:
        return _divided(loss, num_items_in_batch)
    n_scored = out.num_tokens if mask is None else mask.sum()
    if reduction == "batchmean":
        return loss / (n_scored.clamp_min(1) if labels is not None else max(student_hidden_states.size(0), 1))
    if reduction == "sum":
        return loss
    return loss / (n_scored * student_lm_head_weight.size(0))


def _gkd_teacher_side(teacher: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      copy_head: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inside the teacher wrapper's forward (its parameters gathered): the backbone's last hidden states ``(B, L, H)``
    and the lm_head's weight and bias, detached; copied when ``copy_head`` (a sharded teacher frees the gathered
    tensors when its forward returns)."""
    backbone, head = causal_lm_parts(teacher)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    weight, bias = _gathered(head.weight.detach(), None if head.bias is None else head.bias.detach(), hidden.dtype)
    if copy_head:
        weight, bias = weight.clone(), None if bias is None else bias.clone()
    return hidden, weight, bias


def _gkd_student_loss(student: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      labels: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                      teacher_head: LogitHead, beta: float, num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
    """Inside the student wrapper's forward (its parameters gathered, so the lm_head is whole under FSDP and
    ZeRO-3): the backbone, the lm_head and the loss; returns ``(loss, the backbone's output)``."""
    backbone, head = causal_lm_parts(student)
    outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    weight, bias = _gathered(head.weight, head.bias, outputs.last_hidden_state.dtype)
    student_head = logit_head_from_config(student.config)
    teacher_hidden, teacher_weight, teacher_bias = teacher
    device = weight.device
    # causal shift: the hidden state at position i predicts the token at i + 1
    loss = dense_generalized_jsd_loss(
        outputs.last_hidden_state[:, :-1, :].to(device), teacher_hidden[:, :-1, :].to(device), weight,
        teacher_weight.to(device), labels=labels[:, 1:].to(device), beta=beta, num_items_in_batch=num_items_in_batch,
        student_lm_head_bias=bias, teacher_lm_head_bias=None if teacher_bias is None else teacher_bias.to(device),
        student_logit_scale=student_head.scale, student_softcap=student_head.softcap,
        teacher_logit_scale=teacher_head.scale, teacher_softcap=teacher_head.softcap,
    )
    return loss, outputs


def gkd_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """Replacement for TRL's ``GKDTrainer.compute_loss``: the same loss (``generalized_jsd_loss`` with the causal
    shift, ``labels != -100`` mask, ``self.beta``, temperature 1 and ``num_items_in_batch``) from both backbones'
    last hidden states and lm_heads, without ``(B, T, V)`` logits.

    Both sides run inside their wrapper's forward (TRL's ``_ForwardRedirection``), lm_head included: under FSDP or
    DeepSpeed ZeRO-3 a parameter read outside the forward is a shard. The teacher's gathered head is copied out of
    its forward when the teacher is wrapped (sharded); the student's loss is computed inside its own forward. Each
    model's logit head is read by :func:`fastdistill.logit_head.logit_head_from_config`.

    With ``return_outputs=True`` it returns ``(loss, outputs)`` where ``outputs`` is the student backbone's output
    (``last_hidden_state`` ``(B, L, H)``, unshifted) instead of TRL's ``CausalLMOutput`` with logits.
    """
    from trl.models.utils import _ForwardRedirection  # TRL is optional: only a patched TRL trainer calls this

    redirect = _ForwardRedirection()
    self.teacher_model.eval()
    unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
    with torch.no_grad():
        teacher = redirect(self.teacher_model, unwrapped_teacher, _gkd_teacher_side, unwrapped_teacher,
                           inputs["input_ids"], inputs["attention_mask"], self.teacher_model is not unwrapped_teacher)
    unwrapped_student = self.accelerator.unwrap_model(model)
    loss, student_outputs = redirect(model, unwrapped_student, _gkd_student_loss, unwrapped_student,
                                     inputs["input_ids"], inputs["attention_mask"], inputs["labels"], teacher,
                                     logit_head_from_config(unwrapped_teacher.config), self.beta, num_items_in_batch)
    return (loss, student_outputs) if return_outputs else loss


def _import_trl(name: str, what: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"{what} needs TRL's {name}; pip install 'trl==1.16.0'") from error


def patch_trl_gkd() -> None:
    """Make TRL's ``GKDTrainer`` (and subclasses that keep its ``compute_loss``) use :func:`gkd_compute_loss`
    (idempotent)."""
    trainer = _import_trl(GKD_MODULE, "patch_trl_gkd").GKDTrainer
    if trainer.__dict__["compute_loss"] is not gkd_compute_loss:
        trainer._fastdistill_original_compute_loss = trainer.__dict__["compute_loss"]
        trainer.compute_loss = gkd_compute_loss


def unpatch_trl_gkd() -> None:
    """Restore TRL's ``GKDTrainer.compute_loss``."""
    trainer = _import_trl(GKD_MODULE, "unpatch_trl_gkd").GKDTrainer
    original = trainer.__dict__.get("_fastdistill_original_compute_loss")
    if original is not None:
        trainer.compute_loss = original
        del trainer._fastdistill_original_compute_loss


def patch_trl_distillation() -> None:
    """Make TRL's ``DistillationTrainer`` compute its loss with :func:`trl_chunked_divergence_loss` (idempotent)."""
    module = _import_trl(DISTILLATION_MODULE, "patch_trl_distillation")
    if module._chunked_divergence_loss is not trl_chunked_divergence_loss:
        module._fastdistill_original_chunked_divergence_loss = module._chunked_divergence_loss
        module._chunked_divergence_loss = trl_chunked_divergence_loss


def unpatch_trl_distillation() -> None:
    """Restore TRL's ``_chunked_divergence_loss``."""
    module = _import_trl(DISTILLATION_MODULE, "unpatch_trl_distillation")
    original = getattr(module, "_fastdistill_original_chunked_divergence_loss", None)
    if original is not None:
        module._chunked_divergence_loss = original
        del module._fastdistill_original_chunked_divergence_loss


def patch_trl_dense() -> None:
    """Both dense-teacher patches: :func:`patch_trl_gkd` and :func:`patch_trl_distillation`."""
    patch_trl_gkd()
    patch_trl_distillation()


def unpatch_trl_dense() -> None:
    """Undo :func:`patch_trl_dense`."""
    unpatch_trl_gkd()
    unpatch_trl_distillation()


@contextmanager
def fastdistill_dense_loss_in_trl() -> Iterator[None]:
    """``with fastdistill_dense_loss_in_trl(): trainer.train()`` — GKD and Distillation patched inside the block."""
    patch_trl_dense()
    try:
        yield
    finally:
        unpatch_trl_dense()
