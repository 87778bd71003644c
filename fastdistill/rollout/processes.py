"""What the child processes of one rollout worker share besides the sample queue: counts that make its bounds global.

With ``rollout_processes`` > 1 every child keeps, in shared memory, its own slot of: rollouts in flight, rollouts
finished (the slow start grows with the sum), rollouts scored and prompts dropped (the "every rollout failed" check
is about the whole run), and whether its dispatcher has anything left. Each child writes only its own slots; the
reads that decide something (how many rollouts a child may dispatch, whether the whole worker is idle) sum every
slot under one lock, so the in-flight and lookahead caps hold for all children together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOCK_WAIT_S = 0.05  # a child that cannot take the lock this long (another one stopped holding it) tries again later


class SharedCounts:
    """Per-process counters of a worker's ``processes`` children (from the spawn ``context``; pickled to each)."""

    def __init__(self, context: Any, processes: int):
        self.processes = processes
        self.lock = context.Lock()
        self.inflight = context.Array("q", processes, lock=False)
        self.finished = context.Array("q", processes, lock=False)
        self.scored = context.Array("q", processes, lock=False)
        self.dropped = context.Array("q", processes, lock=False)
        self.active = context.Array("b", [1] * processes, lock=False)  # a child starting up has prompts to dispatch
        # a child that recorded its final totals (settle) and got no prompt back since: the run is idle only when
        # every child did, or a child that ran out of prompts but had not yet recorded its drops would be left out
        self.settled = context.Array("b", processes, lock=False)

    def reserve(self, process: int, own: int, has_work: bool, cap_of: Callable[[int], int]) -> int:
        """How many more rollouts ``process`` (with ``own`` in flight) may dispatch now; they count as in flight
        from this call on (:meth:`publish` corrects the count once dispatched). ``cap_of(finished)`` is the cap on
        rollouts in flight of all children together, given how many finished so far.

        The cap is shared fairly: a child takes at most its share, ``ceil(cap / children with prompts left)``, so
        that the first child to start cannot hold every slot while the others wait. 0 when the lock stays taken
        (the caller beats and asks again)."""
        if not self.lock.acquire(timeout=LOCK_WAIT_S):
            return 0
        try:
            self.active[process] = has_work
            if has_work:
                self.settled[process] = 0
            else:
                self.inflight[process] = own
                return 0
            cap = cap_of(sum(self.finished))
            others = sum(self.inflight) - self.inflight[process]
            share = -(-cap // max(1, sum(self.active)))
            room = max(0, min(cap - others, share) - own)
            self.inflight[process] = own + room
            return room
        finally:
            self.lock.release()

    def publish(self, process: int, inflight: int, finished: int) -> None:
        """This child's rollouts in flight and finished so far (its own slots: no lock needed)."""
        self.inflight[process] = inflight
        self.finished[process] = finished

    def total_inflight(self) -> int:
        """Rollouts in flight across every child (a moment's view, for metrics)."""
        return int(sum(self.inflight))

    def settle(self, process: int, scored: int, dropped: int) -> tuple[bool, int, int] | None:
        """``process`` has nothing left and nothing in flight: record it and its totals; return (every child is in
        that state, rollouts scored by all, prompts dropped by all), or None when the lock stays taken (ask
        again)."""
        if not self.lock.acquire(timeout=LOCK_WAIT_S):
            return None
        try:
            self.active[process] = 0
            self.inflight[process] = 0
            self.scored[process] = scored
            self.dropped[process] = dropped
            self.settled[process] = 1
            idle = all(self.settled) and not any(self.active) and not any(self.inflight)
            return idle, int(sum(self.scored)), int(sum(self.dropped))
        finally:
            self.lock.release()
