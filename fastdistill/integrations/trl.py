"""Drop-in for TRL 1.16's ``AsyncDistillationTrainer``: replace its chunked JSD loss with :func:`sparse_jsd_loss`.

```python
from fastdistill.integrations.trl import patch_trl
patch_trl()   # every AsyncDistillationTrainer from now on uses fastdistill's loss
```

TRL's ``_compute_loss`` looks ``_chunked_jsd_loss`` up in its module at every call, so swapping that module attribute
is enough: batching, normalisation and metrics stay TRL's. The replacement uses ``tail_mode="trl"`` (TRL's clamped
student tail), so the loss, its gradients and the metrics equal TRL's; it is faster and never holds more than one
bounded logits tile (``backend="auto"``: see :func:`fastdistill.sparse_jsd_loss`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastdistill.loss import sparse_jsd_loss

TRL_MODULE = "trl.experimental.async_distillation.async_distillation_trainer"


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
    import importlib

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
