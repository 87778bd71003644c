"""Staleness in optimizer steps: which optimizer step the weights of each served policy version are from.

A weight sync gives the served weights the next version (TRL's ``model_version``, one per sync). With
``weight_sync_steps > 1`` several optimizer steps pass between two versions, so a sample's age is counted as the
optimizer steps its weights are behind the trainer's: ``staleness = step − step_of(version)``, for the metrics, the
``max_staleness`` bound and the importance correction alike.

The student server keeps requests in flight across a sync, so a long completion is part old weights, part new. The
trainer knows when each version started being served; with the wall-clock times a generation's request was sent and
answered, :meth:`PolicySteps.token_versions` gives each of its tokens the version served when it was (by estimate)
generated.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["PolicySteps"]


class PolicySteps:
    """The trainer's policy ``version`` (syncs so far) and ``step`` (optimizer steps trained so far), and the step of
    every version pushed since the run (or its resume) started.

    A version the run never pushed (an offline replay's stamp, a version from before a resume) is placed
    ``weight_sync_steps`` steps per version before the oldest one it knows (or before the current ``version`` at the
    current ``step`` when it knows none): the schedule it would have had."""

    def __init__(self, weight_sync_steps: int = 1, *, version: int = 0, step: int = 0):
        self.weight_sync_steps = int(weight_sync_steps)
        self.version = int(version)
        self.step = int(step)
        self._steps: dict[int, int] = {}
        self._served_at: dict[int, float] = {}

    def served(self, version: int, at: float | None = None) -> None:
        """The server serves ``version`` from wall-clock second ``at`` (``time.time()``; None: now)."""
        self._served_at[int(version)] = time.time() if at is None else float(at)

    def token_versions(self, version: int, started_at: float | None, ended_at: float | None,
                       length: int) -> np.ndarray:
        """int64 (length,): the version that generated each token of a generation dispatched on ``version`` whose
        request was sent at ``started_at`` and answered at ``ended_at`` (wall-clock seconds). Token j is placed at
        ``started_at + (j + 1) / length · (ended_at − started_at)`` (an even pace: the server streams nothing back
        to time it by), and takes the newest version served at or before then, never older than ``version``. Without
        times every token is ``version``."""
        versions = np.full(length, int(version), dtype=np.int64)
        if started_at is None or ended_at is None or length == 0:
            return versions
        times = started_at + np.arange(1, length + 1) / length * max(ended_at - started_at, 0.0)
        for served, at in sorted(self._served_at.copy().items()):  # a push thread may add one
            if served > version and started_at < at <= ended_at:
                versions[times >= at] = served
        return versions

    def pushed(self, version: int) -> None:
        """``version`` is the weights after the current ``step`` optimizer steps (called when it is made, before the
        server serves it)."""
        self.version = int(version)
        self._steps[self.version] = self.step

    def step_of(self, version: int) -> int:
        """The optimizer step whose weights ``version`` serves."""
        version = int(version)
        known = self._steps.get(version)
        if known is not None:
            return known
        anchor = min(self._steps) if self._steps else self.version
        anchor_step = self._steps[anchor] if self._steps else self.step
        return anchor_step - (anchor - version) * self.weight_sync_steps

    def staleness(self, version: int) -> int:
        """Optimizer steps between the weights of ``version`` and the trainer's (``step − step_of(version)``)."""
        return self.step - self.step_of(version)

    def staleness_array(self, versions: Any) -> np.ndarray:
        """int64 staleness of each version of a 1-D sequence (a numpy array, a tensor or a list)."""
        values = np.asarray(versions.cpu() if hasattr(versions, "cpu") else versions, dtype=np.int64)
        unique, inverse = np.unique(values, return_inverse=True)
        return np.asarray([self.staleness(v) for v in unique.tolist()], dtype=np.int64)[inverse].reshape(-1)
