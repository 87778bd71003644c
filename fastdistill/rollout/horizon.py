"""The training rollouts' generation horizon: a fixed truncation of ``max_tokens``, or a schedule that grows it with
the training step at which a rollout is dispatched (docs/rollout.md, "Horizon").

The rollout learns the training progress from the policy version it stamps a rollout with: version
``first_version`` is served at step ``first_step`` (the cold sync of this trainer process), and each later version
at the next multiple of ``sync_every`` steps (a weight sync after every ``weight_sync_steps``-th step)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HORIZON_SCHEDULES = ("fixed", "linear")


@dataclass(frozen=True)
class HorizonSchedule:
    """``max_tokens`` of a training rollout as a function of the policy version it is dispatched under.

    ``fixed`` (``growth_steps`` 0): ``start_tokens`` throughout. ``linear``: ⌊start + (full − start)·min(1,
    step / growth_steps)⌋ tokens at training step ``step`` (steps trained before the dispatch), so
    ``start_tokens`` at step 0 and ``full_tokens`` from step ``growth_steps`` on."""

    start_tokens: int
    full_tokens: int
    growth_steps: int = 0
    first_version: int = 0
    first_step: int = 0
    sync_every: int = 1

    def __post_init__(self) -> None:
        for name, low in (("start_tokens", 1), ("full_tokens", 1), ("growth_steps", 0), ("first_step", 0),
                          ("sync_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.start_tokens > self.full_tokens:
            raise ValueError(f"start_tokens ({self.start_tokens}) must be at most full_tokens ({self.full_tokens})")

    def step_of_version(self, version: int) -> int:
        """The training step at which ``version`` was served (``first_step`` for ``first_version`` and before)."""
        if version <= self.first_version:
            return self.first_step
        return (self.first_step // self.sync_every + (version - self.first_version)) * self.sync_every

    def tokens_at_step(self, step: int) -> int:
        """The horizon of a rollout dispatched after ``step`` training steps."""
        if self.growth_steps == 0:
            return self.start_tokens
        share = min(1.0, max(0, step) / self.growth_steps)
        return min(self.full_tokens, self.start_tokens + math.floor((self.full_tokens - self.start_tokens) * share))

    def tokens_at_version(self, version: int) -> int:
        """The horizon of a rollout dispatched under policy version ``version``."""
        return self.tokens_at_step(self.step_of_version(version))


def horizon_tokens(horizon: int | float, full_tokens: int) -> int:
    """A ``rollout_horizon`` in tokens: an int as it is, a float in (0, 1] as ⌈that fraction of ``full_tokens``⌉."""
    if isinstance(horizon, float):
        return max(1, min(full_tokens, math.ceil(horizon * full_tokens)))
    return int(horizon)


def horizon_schedule(config: Any, *, step: int, model_version: int, total_steps: int) -> HorizonSchedule | None:
    """The schedule of a training run's ``rollout_horizon`` options (None: no horizon, ``max_completion_length``),
    for a trainer process whose rollouts start at ``step`` under ``model_version``; a linear schedule grows over
    ⌈``rollout_horizon_growth`` × ``total_steps``⌉ steps."""
    if config.rollout_horizon is None:
        return None
    full = config.max_completion_length
    growth = 0
    if config.rollout_horizon_schedule == "linear":
        growth = max(1, math.ceil(config.rollout_horizon_growth * total_steps))
    return HorizonSchedule(start_tokens=horizon_tokens(config.rollout_horizon, full), full_tokens=full,
                           growth_steps=growth, first_version=int(model_version), first_step=int(step),
                           sync_every=int(config.weight_sync_steps))
