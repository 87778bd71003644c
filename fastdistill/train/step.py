"""One optimizer step on this rank's packed rows: pack, forward and backward, clip, check, step.

Every rank packs its rows of the window (one per micro-batch; a ghost row, for a rank left without samples in a final
partial micro-batch, runs with zero loss weight so that every rank makes the same collective calls), runs the model
and the loss on the trained positions scaled by the window's token count across ranks (a token mean over the whole
step), clips the gradient, refuses a non-finite loss or gradient norm, and steps the optimizer. What it measured
comes back as :class:`StepStats` (summed over ranks) and :func:`step_record` turns it into the step's metrics.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdistill.data.packing import PackedRow, pack_row
from fastdistill.errors import NonFiniteLossError
from fastdistill.loss import narrow_support, scored_positions, window_loss_scale, window_token_count
from fastdistill.rollout import RolloutSample
from fastdistill.train.config_checks import QUERY_LOSS_TYPES, SAMPLED_TOKEN_LOSS_TYPES
from fastdistill.train.staleness import PolicySteps
from fastdistill.train.timing import PhaseClock

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Sums over a step's rows (of this rank, or of every rank after :meth:`all_reduced`): scored ``tokens`` and the
    loss's ``jsd``, ``entropy`` and ``teacher_entropy`` sums over them; ``forwarded_tokens``, ``trained_tokens`` and
    ``samples`` of the packed rows; ``folded`` teacher candidates beyond the student's vocabulary; the aligned groups
    of cross-tokenizer targets and their unweighted JSD and ULD sums (``cross_*``; their loss is in ``jsd`` and their
    groups in ``tokens``); and per teacher ``(tokens, jsd, teacher entropy)`` in ``per_teacher`` (num_teachers,
    3)."""

    num_teachers: int
    tokens: float = 0.0
    jsd: float = 0.0
    entropy: float = 0.0
    teacher_entropy: float = 0.0
    forwarded_tokens: float = 0.0
    trained_tokens: float = 0.0
    samples: float = 0.0
    folded: float = 0.0
    cross_groups: float = 0.0
    cross_jsd: float = 0.0
    cross_uld: float = 0.0
    per_teacher: torch.Tensor = field(default=None)  # type: ignore[assignment]

    _SCALARS = ("tokens", "jsd", "entropy", "teacher_entropy", "forwarded_tokens", "trained_tokens", "samples",
                "folded", "cross_groups", "cross_jsd", "cross_uld")

    def __post_init__(self) -> None:
        if self.per_teacher is None:
            self.per_teacher = torch.zeros(self.num_teachers, 3, dtype=torch.float64)

    def add(self, out: Any, row: PackedRow) -> None:
        """Add one row's loss output (``num_tokens``, ``jsd_sum``, ... , ``per_teacher``)."""
        self.tokens += float(out.num_tokens)
        self.jsd += float(out.jsd_sum)
        self.entropy += float(out.entropy_sum)
        self.teacher_entropy += float(out.teacher_entropy_sum)
        self.forwarded_tokens += row.num_tokens
        self.trained_tokens += row.num_trained
        self.samples += row.num_samples
        self.folded += row.folded_ids.numel()
        if hasattr(out, "cross_groups"):
            self.cross_groups += float(out.cross_groups)
            self.cross_jsd += float(out.cross_jsd_sum)
            self.cross_uld += float(out.cross_uld_sum)
        self.per_teacher += out.per_teacher.detach().double().cpu()[:, :3]

    def all_reduced(self, dist: Any) -> StepStats:
        """The sums over every rank (collective with several ranks)."""
        flat = torch.tensor([getattr(self, name) for name in self._SCALARS], dtype=torch.float64)
        flat = dist.all_reduce_sum(torch.cat([flat, self.per_teacher.flatten()]))
        scalars = dict(zip(self._SCALARS, flat[: len(self._SCALARS)].tolist(), strict=True))
        return StepStats(self.num_teachers, **scalars, per_teacher=flat[len(self._SCALARS):].view(-1, 3))


@dataclass
class StepResult:
    """What one step measured: summed :class:`StepStats`, the gradient norm (None without clipping), seconds of
    forward + backward and of the optimizer, the learning rate it stepped with, and the importance-ratio metrics of
    the stale positions (rank 0's, empty otherwise)."""

    stats: StepStats
    grad_norm: float | None
    fwd_bwd_s: float
    optimizer_s: float
    learning_rate: float
    importance: list[dict[str, Any]]


class TrainStep:
    """Runs steps of ``model`` (a :class:`~fastdistill.train.model.DistillationModel`) with ``optimizer`` and
    ``scheduler`` under ``config``; ``dist`` gives the device, rank and the collectives; ``clock`` takes the phases
    (``pack``, ``fwd_bwd``, ``grad_clip``, ``optimizer``)."""

    def __init__(self, model: Any, optimizer: Any, scheduler: Any, config: Any, dist: Any, teacher_ids: list[str], *,
                 vocab_size: int, bf16: bool, clock: PhaseClock, policy: PolicySteps | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.policy = policy  # staleness in optimizer steps (None: one version per step)
        self.config, self.dist, self.teacher_ids = config, dist, teacher_ids
        self.vocab_size = vocab_size
        self.bf16 = bf16  # compute in bf16 (float32 master weights)
        self.autocast = bf16 and not dist.sharded  # sharded: FSDP2 casts to bf16 itself
        self.clock = clock
        self._warned_out_of_vocab: set[str] = set()

    def __call__(self, window: list[tuple[list[RolloutSample], bool]], step: int, model_version: int) -> StepResult:
        """Step ``step`` (0-based: the steps trained before it) on this rank's ``(samples, ghost)`` micro-batch rows,
        at policy version ``model_version``. Raises :class:`~fastdistill.errors.NonFiniteLossError` (every rank)
        before the optimizer steps when any loss or the gradient norm is not finite."""
        config, device, clock = self.config, self.dist.device, self.clock
        rows, supports, counts = [], [], []
        with clock.phase("pack"):
            for samples, ghost in window:
                row = pack_row(samples, self.teacher_ids, vocab_size=self.vocab_size)
                if not ghost:
                    self._warn_out_of_vocab(row)
                row = row.to(device)
                support = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, config.beta)
                rows.append(row)
                supports.append(support)
                counts.append(0 if ghost else self._scored_count(row, support))
            window_tokens = window_token_count(counts)  # a collective with several ranks
        scale = window_loss_scale(window_tokens)
        stats = StepStats(len(self.teacher_ids))
        importance = []
        fwd_bwd_started = time.perf_counter()
        for row, (ids, lps, mask), (_, ghost) in zip(rows, supports, window, strict=True):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
                staleness = self._position_staleness(row, model_version)
                out, ratios = self.model(row, ids, lps, mask, self._stale_positions(staleness),
                                         drifting=staleness > 0 if self.config.freshness_weight else None)
            (out.loss * (0.0 if ghost else scale)).backward()
            if ghost:
                continue
            if ratios and self.dist.is_main:
                importance.append(ratios)
            stats.add(out, row)
        fwd_bwd_s = time.perf_counter() - fwd_bwd_started
        clock.add("fwd_bwd", fwd_bwd_s)
        grad_norm = None
        with clock.phase("grad_clip"):
            if config.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                grad_norm = float(grad_norm)
        self._check_finite(stats, grad_norm, step)
        learning_rate = self.scheduler.apply(step)
        optimizer_started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - optimizer_started
        clock.add("optimizer", optimizer_s)
        with clock.phase("bookkeeping"):
            stats = stats.all_reduced(self.dist)
        return StepResult(stats, grad_norm, fwd_bwd_s, optimizer_s, learning_rate, importance)

    def _check_finite(self, stats: StepStats, grad_norm: float | None, step: int) -> None:
        """Raise :class:`NonFiniteLossError` on every rank when any rank's loss sum or the gradient norm is NaN or
        infinite: a step on such gradients would ruin the weights."""
        bad = torch.tensor([0.0 if math.isfinite(stats.jsd) else 1.0,
                            0.0 if grad_norm is None or math.isfinite(grad_norm) else 1.0], dtype=torch.float64)
        bad = self.dist.all_reduce_sum(bad)
        if bad.any():
            raise NonFiniteLossError(
                f"step {step + 1}: the {'loss' if bad[0] else 'gradient norm'} is not finite (on {int(bad.max())} "
                "rank(s)); the optimizer did not step and the step's prompts are not marked trained. Lower the "
                "learning rate or check the teacher's scores; resume from the last checkpoint to go on.")

    def _warn_out_of_vocab(self, row: PackedRow) -> None:
        """Warn once per teacher whose candidates reach beyond the student's vocabulary (they are folded into the
        teacher's tail and counted in ``sample/teacher_out_of_vocab_total``)."""
        if row.folded_ids.numel() == 0:
            return
        for index in row.folded_teacher.unique().tolist():
            teacher_id = self.teacher_ids[index]
            if teacher_id in self._warned_out_of_vocab:
                continue
            self._warned_out_of_vocab.add(teacher_id)
            largest = int(row.folded_ids[row.folded_teacher == index].max())
            logger.warning(
                "teacher %r returned candidate ids up to %d, but the student's vocabulary has %d tokens (lm_head "
                "rows): the teacher's vocabulary is at least %d tokens, padded beyond the student's. Those "
                "candidates are folded into the teacher's tail bucket (the student cannot produce them) and "
                "counted in sample/teacher_out_of_vocab_total; warned once per teacher.",
                teacher_id, largest, self.vocab_size, largest + 1)

    def _scored_count(self, row: PackedRow, support: tuple[torch.Tensor, ...]) -> int:
        """Positions the loss will score: those with teacher signal (jsd), whose sampled token the teacher scored
        (reverse_kl_pg, topd_pg), or whose every student query the teacher scored with finite rollout log-probs
        (reverse_kl_mc, reverse_kl_student_topk); a hidden-state teacher scores every id (its head, in the model).
        A cross-tokenizer teacher's targets count their aligned groups (the unit its losses sum over; their
        candidate rows are empty, so they count nothing else)."""
        loss_type = self.config.loss_type
        groups = row.num_cross_groups  # the model scores every group (it refuses targets of a teacher it has no map of)
        hidden = torch.isin(row.teacher_index, torch.tensor(sorted(row.teacher_hidden), dtype=torch.long,
                                                            device=row.teacher_index.device))
        if loss_type in SAMPLED_TOKEN_LOSS_TYPES:
            match = (row.candidate_ids == row.actual_ids[:, None]) & torch.isfinite(row.candidate_logprobs)
            return int((match.any(dim=1) | hidden).sum()) + groups
        if loss_type in QUERY_LOSS_TYPES:
            if row.query_ids is None:
                return 0  # the model refuses the row with the reason
            teacher = row.query_teacher_logprobs
            scored = hidden if teacher is None else torch.isfinite(teacher).all(dim=1) | hidden
            return int((scored & torch.isfinite(row.query_behaviour_logprobs).all(dim=1)).sum())
        # hidden-state teachers' targets have empty candidate rows; the dense loss scores every one of them
        dense = sum(int(row.hidden_targets(index).numel()) for index in row.teacher_hidden)
        return int(scored_positions(*support)) + dense + groups

    def _position_staleness(self, row: PackedRow, model_version: int) -> torch.Tensor:
        """(M,) int64: the optimizer steps each trained position lags the trainer's weights: its sample's
        (``staleness_unit="sample"``) or its token's (``"token"``: the version that generated it)."""
        by_token = self.config.staleness_unit == "token" and row.token_versions is not None
        versions = (row.token_versions if by_token else row.model_versions).cpu()
        if self.policy is not None:
            staleness = torch.from_numpy(self.policy.staleness_array(versions))
        else:
            staleness = model_version - versions
        staleness = staleness.to(row.token_sample.device)
        return staleness if by_token else staleness[row.token_sample]

    def _stale_positions(self, staleness: torch.Tensor) -> torch.Tensor | None:
        """(M,) bool: the positions the importance ratio weights, those more than ``max_staleness`` optimizer steps
        old (``stale_policy="importance"``) or at least one step old (``"importance_all"``); None under ``"drop"``."""
        policy = self.config.stale_policy
        if policy == "drop":
            return None
        return staleness > (self.config.max_staleness if policy == "importance" else 0)


def step_record(result: StepResult, teacher_ids: list[str], divergence_name: str, model_version: int,
                microbatches: int) -> dict[str, float]:
    """The step's metrics from its :class:`StepResult`: ``loss`` and ``<divergence_name>`` (nats per scored token),
    entropies, the batch's token and sample counts, timings, ``grad_norm``, the learning rate and, with several
    teachers, each one's token share and divergence."""
    stats = result.stats
    tokens = max(stats.tokens, 1.0)
    record: dict[str, Any] = {
        "loss": stats.jsd / tokens,
        divergence_name: stats.jsd / tokens,
        "entropy": stats.entropy / tokens,
        "teacher_entropy": stats.teacher_entropy / tokens,
        "model_version": float(model_version),
        "batch/microbatches_per_step": float(microbatches),
        "batch/forwarded_tokens_per_step": stats.forwarded_tokens,
        "batch/trained_tokens_per_step": stats.trained_tokens,
        "batch/samples_per_step": stats.samples,
        "sample/teacher_out_of_vocab_total": stats.folded,
        "perf/fwd_bwd_s": result.fwd_bwd_s,
        "perf/optimizer_s": result.optimizer_s,
        "perf/forwarded_tok_s_fwd_bwd": stats.forwarded_tokens / max(result.fwd_bwd_s, 1e-9),
        "learning_rate": result.learning_rate,
    }
    if result.grad_norm is not None:
        record["grad_norm"] = result.grad_norm
    if stats.cross_groups:  # cross-tokenizer targets: their groups and their loss's two terms per group
        record["batch/cross_groups_per_step"] = stats.cross_groups
        if stats.cross_jsd or stats.cross_uld:  # loss_type jsd (the group policy gradient has neither)
            record["cross/jsd"] = stats.cross_jsd / stats.cross_groups
            record["cross/uld"] = stats.cross_uld / stats.cross_groups
    if len(teacher_ids) > 1:
        for index, teacher_id in enumerate(teacher_ids):
            count = float(stats.per_teacher[index, 0])
            record[f"teacher_token_frac/{teacher_id}"] = count / tokens
            if count:
                record[f"teacher_{divergence_name}/{teacher_id}"] = float(stats.per_teacher[index, 1]) / count
                record[f"teacher_entropy/{teacher_id}"] = float(stats.per_teacher[index, 2]) / count
    return record
