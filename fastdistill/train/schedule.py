"""The learning-rate schedule: warmup, then linear or cosine decay (or constant), over a step count that the trainer
may correct while the run goes.

With ``max_steps=-1`` the number of optimizer steps is only known at the end: under a token budget a step holds as
many samples as fit its rows, which depends on the lengths of completions not yet generated. The trainer starts from
an estimate and corrects :attr:`LRSchedule.total_steps` as rows are packed, and sets it exactly when it collects the
last window, so that the decay ends on the run's last step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

KINDS = ("linear", "cosine", "constant", "constant_with_warmup")


class LRSchedule:
    """``lr(step) = base_lr × factor(step)`` for 0-based optimizer steps.

    ``factor``: ``(step + 1) / (warmup + 1)`` during warmup; then ``1 − progress`` (linear), ``(1 + cos(π·progress))
    / 2`` (cosine) or 1 (constant kinds), with ``progress = (step − warmup) / (total_steps − warmup)`` clipped to
    [0, 1]. ``constant`` has no warmup. :meth:`apply` sets the optimizer's learning rates for a step; call it right
    before that step's ``optimizer.step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, total_steps: int, warmup_steps: int = 0):
        if kind not in KINDS:
            raise ValueError(f"lr schedule kind must be one of {list(KINDS)}, got {kind!r}")
        if total_steps < 1 or warmup_steps < 0:
            raise ValueError(f"total_steps must be >= 1 and warmup_steps >= 0, got {total_steps} and {warmup_steps}")
        self.optimizer = optimizer
        self.kind = kind
        self.total_steps = total_steps
        self.warmup_steps = 0 if kind == "constant" else warmup_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.apply(0)

    def factor(self, step: int) -> float:
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if self.kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    def apply(self, step: int) -> float:
        """Set every parameter group's learning rate for optimizer step ``step``; return the first group's."""
        factor = self.factor(step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        return self.optimizer.param_groups[0]["lr"]

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the state of a torch ``LambdaLR`` (older checkpoints) keeps this schedule's
        length and warmup and takes its base learning rates."""
        self.total_steps = int(state.get("total_steps", self.total_steps))
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
