"""Where a run's wall-clock time goes: named phases that add up to the whole run.

The trainer wraps every part of a run in :meth:`PhaseClock.phase` (start-up, collecting a window, packing, forward
and backward, the optimizer, weight sync, evaluation, logging, checkpoints, shut-down, ...). ``totals()`` then
attributes every second between :meth:`PhaseClock.start` and :meth:`PhaseClock.stop`: what no phase measured is
reported as ``other`` (Python between the phases), so the parts always sum to ``total``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


class PhaseClock:
    """Accumulates wall-clock seconds per phase, for the whole run and since the last :meth:`take_step`.

    Phases may nest: a phase's seconds exclude those of the phases inside it, so that no second counts twice.
    :meth:`move` re-attributes seconds that another component measured inside a phase (e.g. the rollout wait inside
    window collection)."""

    def __init__(self) -> None:
        self._run: dict[str, float] = defaultdict(float)
        self._step: dict[str, float] = defaultdict(float)
        self._started: float | None = None
        self._stopped: float | None = None
        self._open: list[list[float]] = []  # per open phase: [seconds of the phases inside it]

    def start(self) -> None:
        """Mark the beginning of the run (the reference for ``total`` and ``other``)."""
        self._started = time.perf_counter()
        self._stopped = None

    def stop(self) -> None:
        """Mark the end of the run."""
        self._stopped = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the seconds spent inside the ``with`` block as ``name`` (also when it raises)."""
        inner = [0.0]
        self._open.append(inner)
        began = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            self._open.pop()
            if self._open:
                self._open[-1][0] += elapsed
            self.add(name, elapsed - inner[0])

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` as ``name``."""
        self._run[name] += seconds
        self._step[name] += seconds

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-attribute ``seconds`` (at most what ``source`` holds in this step) from ``source`` to ``target``."""
        seconds = max(0.0, min(seconds, self._step.get(source, 0.0)))
        self.add(source, -seconds)
        self.add(target, seconds)

    def take_step(self) -> dict[str, float]:
        """Seconds per phase since the previous call, then reset that window."""
        step, self._step = dict(self._step), defaultdict(float)
        return step

    def step_record(self, step_s: float) -> dict[str, float]:
        """``perf/<phase>_s`` for the phases since the previous call (a step's window: from the previous step's end,
        its evaluation, logging and checkpoint, then this step's collection, packing, ... weight sync) and
        ``perf/other_s``, the step's seconds no phase measured, so that they add up to ``step_s``."""
        phases = self.take_step()
        record = {f"perf/{name}_s": seconds for name, seconds in phases.items()}
        record["perf/other_s"] = step_s - sum(phases.values())
        return record

    def totals(self) -> dict[str, float]:
        """Seconds per phase over the run, plus ``other`` (the rest) and ``total`` (start to stop, or to now)."""
        if self._started is None:
            raise RuntimeError("the clock was never started")
        end = self._stopped if self._stopped is not None else time.perf_counter()
        total = end - self._started
        totals = dict(sorted(self._run.items(), key=lambda item: -item[1]))
        totals["other"] = total - sum(self._run.values())
        totals["total"] = total
        return totals
