"""The training rollouts' generation horizon: a fixed truncation of ``max_tokens``, or a schedule that grows it with
the training step at which a rollout is dispatched (docs/rollout.md, "Horizon").

The rollout reads the training progress as the trainer's count of optimizer steps, which the trainer publishes after
each step (with or without weight syncs), not from the policy versions it serves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HORIZON_SCHEDULES = ("fixed", "linear")


@dataclass(frozen=True)
class HorizonSchedule:
    """``max_tokens`` of a training rollout as a function of the training step it is dispatched at.

    ``fixed`` (``growth_steps`` 0): ``start_tokens`` throughout. ``linear``: ⌊start + (full − start)·min(1,
    step / growth_steps)⌋ tokens at training step ``step`` (steps trained before the dispatch), so
    ``start_tokens`` at step 0 and ``full_tokens`` from step ``growth_steps`` on."""

    start_tokens: int
    full_tokens: int
    growth_steps: int = 0

    def __post_init__(self) -> None:
        for name, low in (("start_tokens", 1), ("full_tokens", 1), ("growth_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.start_tokens > self.full_tokens:
            raise ValueError(f"start_tokens ({self.start_tokens}) must be at most full_tokens ({self.full_tokens})")

    def tokens_at_step(self, step: int) -> int:
        """The horizon of a rollout dispatched after ``step`` training steps."""
        if self.growth_steps == 0:
            return self.start_tokens
        share = min(1.0, max(0, step) / self.growth_steps)
        return min(self.full_tokens, self.start_tokens + math.floor((self.full_tokens - self.start_tokens) * share))


def horizon_tokens(horizon: int | float, full_tokens: int) -> int:
    """A ``rollout_horizon`` in tokens: an int as it is, a float in (0, 1] as ⌈that fraction of ``full_tokens``⌉."""
    if isinstance(horizon, float):
        return max(1, min(full_tokens, math.ceil(horizon * full_tokens)))
    return int(horizon)


def horizon_schedule(config: Any, *, total_steps: int) -> HorizonSchedule | None:
    """The schedule of a training run's ``rollout_horizon`` options (None: no horizon, ``max_completion_length``);
    a linear schedule grows over ⌈``rollout_horizon_growth`` × ``total_steps``⌉ steps."""
    if config.rollout_horizon is None:
        return None
    full = config.max_completion_length
    growth = 0
    if config.rollout_horizon_schedule == "linear":
        growth = max(1, math.ceil(config.rollout_horizon_growth * total_steps))
    return HorizonSchedule(start_tokens=horizon_tokens(config.rollout_horizon, full), full_tokens=full,
                           growth_steps=growth)
