"""The trainer's side of a teacher with another tokenizer: its vocabulary map, loaded once, and the loss of its
targets in a packed row.

A cross-tokenizer teacher (``teacher_tokenizers`` names it) sends per student completion position the targets of
:mod:`fastdistill.cross_tokenizer.targets` (``PackedRow.cross_*``). Their loss, per ``loss_type``:

- ``jsd``: :func:`~fastdistill.loss.cross_losses.hybrid_loss` (``cross_tokenizer_loss: hybrid``, GOLD's: the
  generalized JSD at ``beta`` over the shared candidates with an exact tail per side, plus the sorted-probability ULD
  on the unshared tokens; weights ``cross_tokenizer_weights`` or GOLD's adaptive ones of that teacher's pair) or
  :func:`~fastdistill.loss.cross_losses.uld_loss` (``uld``: ULD over every token, the teacher's ranked top-K
  whatever the map shares);
- ``reverse_kl_pg``: :func:`~fastdistill.loss.cross_losses.group_reverse_kl_pg_loss` (the aligned group as the
  action, advantage = the teacher's log-prob of the group's text minus the student's; ``pg_importance_ratio`` /
  ``pg_ratio_clip`` as for the same-tokenizer policy gradient).

Each loss is a sum over aligned groups, and the trainer counts a cross-tokenizer target's groups (not its tokens)
in the window's scored count: a group is the unit the loss scores, as a token is for the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from fastdistill.cross_tokenizer import TokenizerPair
from fastdistill.errors import ConfigError
from fastdistill.loss import SparseJSDOutput
from fastdistill.loss.cross_losses import group_reverse_kl_pg_loss, hybrid_loss, uld_loss


@dataclass
class CrossTeacher:
    """What the loss needs of one cross-tokenizer teacher: ``student_shared`` bool ``(V,)`` (the student ids its
    vocabulary shares, V = the student's lm_head rows) and the hybrid's two weights."""

    student_shared: torch.Tensor
    shared_weight: float
    unshared_weight: float


@dataclass
class CrossTokenizerOutput(SparseJSDOutput):
    """:class:`~fastdistill.SparseJSDOutput` of a row with cross-tokenizer targets (``num_tokens`` counts their
    groups, ``jsd_sum`` adds their loss sum, ``per_teacher`` a cross teacher's (groups, loss sum, 0)) plus the
    cross-tokenizer sums: ``cross_groups`` (G), ``cross_jsd_sum`` (Σ_g JSD_g, unweighted), ``cross_uld_sum``
    (Σ_g ULD_g, unweighted), 0-dim, detached."""

    cross_groups: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    cross_jsd_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    cross_uld_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))


def load_cross_teachers(config: Any, tokenizer: Any, *, vocab_size: int,
                        device: torch.device | str = "cpu") -> dict[int, CrossTeacher]:
    """Teacher index -> :class:`CrossTeacher` of every teacher ``config.teacher_tokenizers`` names: its
    :class:`~fastdistill.cross_tokenizer.TokenizerPair` loaded once against the student's ``tokenizer`` with
    the student's ``vocab_size`` (lm_head rows), its weights ``config.cross_tokenizer_weights`` or GOLD's adaptive
    ones. ConfigError naming the teacher for a folder that does not load."""
    teachers = {}
    for teacher_id in config.cross_tokenizer_teacher_ids:
        folder = config.teacher_tokenizers[teacher_id]
        try:
            pair = TokenizerPair.load(tokenizer, folder, student_vocab_size=vocab_size,
                                      trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError) as error:
            raise ConfigError(f"teacher_tokenizers[{teacher_id!r}] = {folder!r}: the teacher's tokenizer does not "
                              f"load against the student's ({vocab_size} lm_head rows): {error}") from error
        shared, unshared = config.cross_tokenizer_weights or pair.vocab.gold_weights()
        teachers[config.teacher_ids.index(teacher_id)] = CrossTeacher(
            torch.from_numpy(pair.vocab.student_shared).to(device), float(shared), float(unshared))
    return teachers


def cross_tokenizer_rows(row: Any, teachers: Mapping[int, CrossTeacher]) -> torch.Tensor | None:
    """(M,) bool: the targets of cross-tokenizer teachers in ``row``, or None when the row has no cross targets.
    ValueError when a teacher without a loaded :class:`CrossTeacher` sent cross-tokenizer targets (they would go
    untrained)."""
    if row.cross_group_index is None:
        return None
    index = torch.tensor(sorted(teachers), dtype=torch.long, device=row.teacher_index.device)
    cross = torch.isin(row.teacher_index, index)
    stray = (row.cross_group_index >= 0) & ~cross
    if bool(stray.any()):
        which = sorted(set(row.teacher_index[stray].tolist()))
        raise ValueError(f"teacher index(es) {which} sent cross-tokenizer targets, but the model has no vocabulary "
                         f"map for them (loaded: {sorted(teachers)}): name them in teacher_tokenizers")
    return cross


def cross_tokenizer_loss(hidden: torch.Tensor, head: Any, row: Any,
                         teachers: Mapping[int, CrossTeacher], *, loss: str, num_teachers: int, beta: float,
                         temperature: float, logit_scale: float, softcap: float | None, backend: str = "auto",
                         sampling_temperature: float | None = None, importance_ratio: bool = False,
                         ratio_clip: float | None = None) -> tuple[CrossTokenizerOutput, Any]:
    """The loss of ``row``'s cross-tokenizer targets, summed over aligned groups, one call per cross teacher
    present (each with its own vocabulary map and weights).

    Args:
        hidden: ``(M, D)`` the student's hidden states at ``row``'s targets (row i predicts ``row.actual_ids[i]``).
        head: the student's lm_head (``weight`` ``(V, D)``, ``bias``).
        loss: ``"hybrid"``, ``"uld"`` or ``"reverse_kl_pg"``.
        beta: the hybrid's JSD β; temperature, logit_scale, softcap: the loss temperature and the student's head.
        sampling_temperature, importance_ratio, ratio_clip: the group policy gradient's importance ratio
            (``rollout_logprobs`` used when ``importance_ratio``).

    Returns:
        ``(output, pg)``: the :class:`CrossTokenizerOutput` and, for ``reverse_kl_pg``, the sums of the policy
        gradient's statistics (``advantage_sum``, ``advantage_sq_sum``, ``ratio_sum``, ``ratio_max``, ``clipped``,
        ``masked``, ``num_tokens`` = groups) for :func:`~fastdistill.train.model.pg_metrics`; None otherwise.
    """
    device = hidden.device
    compute_dtype = torch.promote_types(hidden.dtype, head.weight.dtype)
    weight, bias = head.weight, head.bias
    per_teacher = torch.zeros(num_teachers, 3, dtype=torch.float64, device=device)
    total = 0.0 * hidden.sum()
    sums = {"groups": 0, "jsd": 0.0, "uld": 0.0, "loss": 0.0}
    pg = {"advantage_sum": 0.0, "advantage_sq_sum": 0.0, "ratio_sum": 0.0, "ratio_max": 0.0, "clipped": 0.0}
    common = dict(bias=None if bias is None else bias.to(compute_dtype), logit_scale=logit_scale, softcap=softcap,
                  temperature=temperature)
    with torch.autocast(device.type, enabled=False):  # the cross losses compute in the student's compute dtype
        weight = weight.to(compute_dtype)
        for index in sorted(teachers):
            rows = (row.teacher_index == index).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            h = hidden.index_select(0, rows).to(compute_dtype)
            groups, starts = row.cross_group_index[rows], row.cross_group_start[rows]
            actual = row.actual_ids[rows]
            if loss == "reverse_kl_pg":
                out = group_reverse_kl_pg_loss(
                    h, weight, actual, groups, starts, row.cross_group_logprob[rows],
                    sampling_temperature=sampling_temperature,
                    rollout_logprobs=row.rollout_logprobs[rows] if importance_ratio else None, ratio_clip=ratio_clip,
                    **common)
                count, value = int(out.num_tokens), out.reverse_kl_sum.detach()
                for name in pg:
                    part = getattr(out, name)
                    pg[name] = max(pg[name], float(part)) if name == "ratio_max" else pg[name] + float(part)
            else:
                lps = (row.cross_unshared_logprobs, row.cross_continuation_logprob)
                if loss == "uld":
                    out = uld_loss(h, weight, actual, groups, starts, lps[0][rows], lps[1][rows], **common)
                else:
                    teacher = teachers[index]
                    out = hybrid_loss(
                        h, weight, actual, groups, starts, row.cross_shared_ids[rows],
                        row.cross_shared_logprobs[rows], lps[0][rows], lps[1][rows], teacher.student_shared,
                        shared_weight=teacher.shared_weight, unshared_weight=teacher.unshared_weight, beta=beta,
                        backend=backend, **common)
                count, value = int(out.num_groups), out.loss.detach()
                sums["jsd"] += float(out.jsd_sum)
                sums["uld"] += float(out.uld_sum)
            total = total + out.loss
            sums["groups"] += count
            sums["loss"] += float(value)
            per_teacher[index] += torch.tensor([count, float(value), 0.0], dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    output = CrossTokenizerOutput(
        loss=total, jsd_sum=zero + sums["loss"], entropy_sum=zero, teacher_entropy_sum=zero,
        num_tokens=torch.tensor(sums["groups"], dtype=torch.int64, device=device), per_teacher=per_teacher,
        cross_groups=zero + sums["groups"], cross_jsd_sum=zero + sums["jsd"], cross_uld_sum=zero + sums["uld"])
    stats = None
    if loss == "reverse_kl_pg":
        stats = SimpleNamespace(**pg, masked=0.0, num_tokens=sums["groups"])
    return output, stats


def combined_output(parts: list[SparseJSDOutput]) -> CrossTokenizerOutput:
    """One :class:`CrossTokenizerOutput` of a row's parts (same-tokenizer outputs and the cross one): every field
    the sum of the parts'."""
    def total(name: str) -> torch.Tensor:
        values = [getattr(p, name) for p in parts if hasattr(p, name)]
        result = values[0].double() if values[0].is_floating_point() else values[0]
        for value in values[1:]:
            result = result + (value.double() if value.is_floating_point() else value)
        return result

    loss = parts[0].loss
    for part in parts[1:]:
        loss = loss + part.loss
    device = parts[0].jsd_sum.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    cross = [p for p in parts if isinstance(p, CrossTokenizerOutput)]
    extra = {name: sum((getattr(p, name).double() for p in cross), zero) for name in
             ("cross_groups", "cross_jsd_sum", "cross_uld_sum")}
    return CrossTokenizerOutput(loss=loss, jsd_sum=total("jsd_sum"), entropy_sum=total("entropy_sum"),
                                teacher_entropy_sum=total("teacher_entropy_sum"), num_tokens=total("num_tokens"),
                                per_teacher=sum(p.per_teacher.double() for p in parts), **extra)


def combined_pg_stats(parts: list[Any]) -> Any:
    """The policy-gradient statistics of a row's parts summed (``ratio_max`` their max), for ``pg_metrics``."""
    names = ("advantage_sum", "advantage_sq_sum", "ratio_sum", "clipped", "masked")
    combined = {name: sum(float(getattr(p, name) if getattr(p, name, None) is not None else 0.0) for p in parts)
                for name in names}
    combined["ratio_max"] = max(float(p.ratio_max) for p in parts)
    combined["num_tokens"] = sum(int(p.num_tokens) for p in parts)
    return SimpleNamespace(**combined)
