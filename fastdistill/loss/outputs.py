"""The loss results and how per-row statistics become one: :class:`SparseJSDOutput`, :class:`DenseJSDOutput` and
their ``summarize`` functions, below every loss path (the torch paths, the kernels' wrappers and the float64
references all import them from here, so no loss module imports another in a cycle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseJSDOutput:
    """Result of :func:`sparse_jsd_loss`. All fields are tensors on the input device.

    Attributes:
        loss: 0-dim, differentiable: Σ over scored positions of the per-position divergence (nats). Divide by
            the window's token count yourself (see :mod:`fastdistill.loss.normalization`).
        jsd_sum: 0-dim, the same sum, detached.
        entropy_sum: 0-dim, Σ of the student's full-vocabulary entropy at the temperature (nats), detached.
        teacher_entropy_sum: 0-dim, Σ of the teacher's entropy over support + tail (nats), detached.
        num_tokens: 0-dim int64, number of scored positions (those with at least one valid slot).
        per_teacher: ``(num_teachers, 3)``: per teacher index, (scored positions, jsd sum, teacher-entropy sum).
    """

    loss: torch.Tensor
    jsd_sum: torch.Tensor
    entropy_sum: torch.Tensor
    teacher_entropy_sum: torch.Tensor
    num_tokens: torch.Tensor
    per_teacher: torch.Tensor


@dataclass
class DenseJSDOutput(SparseJSDOutput):
    """Result of :func:`dense_teacher_jsd_loss`: the fields of :class:`SparseJSDOutput` (``teacher_entropy_sum`` is
    the teacher's entropy over the student's vocabulary after renormalisation) plus

    Attributes:
        teacher_dropped_mass_sum: 0-dim, Σ over scored positions of the teacher's probability on ids ≥ V_s (rows of
            a padded teacher vocabulary), before renormalisation; 0 when the vocabularies have the same size.
    """

    teacher_dropped_mass_sum: torch.Tensor | None = None


def summarize(loss, div, ent, tent, teacher_index, num_teachers) -> SparseJSDOutput:
    """Pack per-row statistics of the scored rows into a :class:`SparseJSDOutput`."""
    with torch.no_grad():
        per_row = torch.stack([torch.ones_like(div), div, tent], dim=1)
        per_teacher = torch.zeros(num_teachers, 3, dtype=div.dtype, device=div.device)
        if teacher_index is None:  # a single teacher: everything is teacher 0
            per_teacher[0] = per_row.sum(dim=0)
        else:
            per_teacher.index_add_(0, teacher_index.long(), per_row)
        return SparseJSDOutput(
            loss=loss,
            jsd_sum=div.sum(),
            entropy_sum=ent.sum(),
            teacher_entropy_sum=tent.sum(),
            num_tokens=torch.tensor(div.numel(), dtype=torch.int64, device=div.device),
            per_teacher=per_teacher,
        )


def summarize_dense(loss, div, ent, tent, dropped, teacher_index, num_teachers) -> DenseJSDOutput:
    """Pack per-row statistics of the scored rows into a :class:`DenseJSDOutput`."""
    out = summarize(loss, div, ent, tent, teacher_index, num_teachers)
    return DenseJSDOutput(**vars(out), teacher_dropped_mass_sum=dropped.detach().sum())
