"""The order prompts are visited in: a seeded shuffle per epoch and a cursor that resumes mid-epoch.

A ``prompt_id`` counts across epochs: prompt ``epoch · num_rows + position`` is the row at ``position`` of that
epoch's order, so a cursor can resume at any prompt and a checkpoint only stores ids. An epoch's order depends on
the seed and the epoch alone, never on how many epochs the run has: a resume may raise ``num_train_epochs``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Row indices (num_rows,) in the order epoch ``epoch`` visits them: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(num_rows)
    return np.random.default_rng((seed, epoch)).permutation(num_rows)


def prompt_cursor(num_rows: int, seed: int, start_index: int = 0, shuffle: bool = True) -> Iterator[tuple[int, int]]:
    """Endless ``(prompt_id, row_index)`` pairs from ``prompt_id = start_index`` on; epoch = prompt_id // num_rows."""
    first_epoch, offset = divmod(start_index, num_rows)
    for epoch in itertools.count(first_epoch):
        order = epoch_order(num_rows, seed, epoch, shuffle)
        for position in range(offset, num_rows):
            yield epoch * num_rows + position, int(order[position])
        offset = 0


def row_of_prompt(prompt_id: int, num_rows: int, seed: int, shuffle: bool = True) -> int:
    """The dataset row that ``prompt_id`` visits (the inverse view of :func:`prompt_cursor`)."""
    epoch, position = divmod(prompt_id, num_rows)
    return int(epoch_order(num_rows, seed, epoch, shuffle)[position])


@dataclass(frozen=True)
class OnPolicyShare:
    """Which prompt ids of a run that mixes in a teacher cache are generated on-policy (GKD's ``lmbda``).

    The share of prompt ``j`` is ``start``, or, with ``final`` and ``horizon`` (prompts), moves linearly from
    ``start`` at prompt 0 to ``final`` at prompt ``horizon`` and stays at ``final`` after it (annealing from
    off-policy to on-policy, or back). Exactly ``floor(F(n))`` of the first ``n`` prompt ids are on-policy, where
    ``F(n)`` is the sum of the first ``n`` shares, spread evenly: every run of consecutive ids holds its share within
    one, so each step's samples hold the share of their stretch of the run, whatever the batch.
    """

    start: float
    final: float | None = None
    horizon: int | None = None

    def __post_init__(self) -> None:
        for name in ("start", "final"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"on-policy share {name} must be in [0, 1], got {value!r}")
        if self.final is not None and not (isinstance(self.horizon, int) and self.horizon >= 1):
            raise ValueError(f"an annealed on-policy share needs a horizon of >= 1 prompts, got {self.horizon!r}")

    @property
    def always(self) -> bool:
        """Every prompt is on-policy."""
        return self.start == 1.0 and self.final in (None, 1.0)

    @property
    def never(self) -> bool:
        """No prompt is on-policy."""
        return self.start == 0.0 and self.final in (None, 0.0)

    def cumulative(self, n: int) -> float:
        """``F(n)``: the sum of the shares of prompt ids ``0 … n-1``."""
        if self.final is None or self.final == self.start:
            return n * self.start
        h = self.horizon
        m = min(n, h)
        ramp = m * self.start + (self.final - self.start) / h * (m * (m - 1) / 2)
        return ramp + max(0, n - h) * self.final

    def count(self, n: int) -> int:
        """How many of prompt ids ``0 … n-1`` are on-policy."""
        return math.floor(self.cumulative(n))

    def selects(self, prompt_id: int) -> bool:
        """Whether prompt ``prompt_id`` is generated on-policy (else taken from the teacher cache)."""
        return self.count(prompt_id + 1) > self.count(prompt_id)

    def settled_from(self, on_policy: bool) -> int | None:
        """The first prompt id from which :meth:`selects` never again answers ``on_policy``, or None when it may
        always do so again: a cursor that keeps only such ids is exhausted there instead of searching forever
        (a share annealed to 0 has no on-policy id past its horizon; one annealed to 1 no cached id)."""
        settled = 0.0 if on_policy else 1.0
        if self.start == settled and self.final in (None, settled):
            return 0
        if self.final == settled:
            return self.horizon
        return None


def is_on_policy(prompt_id: int, fraction: float) -> bool:
    """Whether prompt ``prompt_id`` of a mixed run with a fixed on-policy share ``fraction`` is generated on-policy:
    exactly ``floor(n · fraction)`` of the first ``n`` prompt ids are (see :class:`OnPolicyShare`)."""
    return OnPolicyShare(fraction).selects(prompt_id)
