"""Several replica URLs behind one logical server: least-in-flight balancing, cooldown after failures, failover.

A :class:`ReplicaPool` lives in one asyncio loop (no locks). The HTTP layer asks it for a replica per attempt
(:meth:`ReplicaPool.acquire`), reports the outcome, and releases it. A replica that failed with a transient error
is *down* for a cooldown (doubling on each further failure, capped) and is skipped while another replica is up.
Only a request sent after the replica's last failure can double it: the requests in flight when a replica goes down
fail together, one outage, and leave the first cooldown as it is (a blip under load must not bench a replica for the
cap).
When its cooldown ends it is *probing*: it takes at most one request at a time until one succeeds, so a replica
that is still dead costs one fast failure per cooldown, not a burst. When every replica is down, requests go to
the one whose cooldown ends first (the caller's backoff paces them), so a single-URL pool behaves like a plain URL.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Replica:
    """One server URL and its health bookkeeping (monotonic seconds)."""

    url: str
    index: int
    inflight: int = 0
    down_until: float = 0.0
    cooldown_s: float = 0.0  # current cooldown; 0 while healthy
    errors: int = 0  # transient failures since the pool was built
    failed_at: float = float("-inf")  # when the last failure that set the cooldown was recorded

    def is_up(self, now: float) -> bool:
        return now >= self.down_until


def normalize_urls(urls: str | Sequence[str], what: str) -> tuple[str, ...]:
    """``urls`` (one URL or several) as a non-empty tuple of base URLs without trailing ``/``.

    Raises ValueError naming ``what`` (e.g. ``"teacher 'math'"``) for an empty list or a non-string entry."""
    items = (urls,) if isinstance(urls, str) else tuple(urls)
    if not items:
        raise ValueError(f"{what}: the list of replica URLs is empty")
    for url in items:
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"{what}: every replica URL must be a non-empty string, got {url!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{what}: a replica URL is listed twice: {list(items)}")
    return tuple(url.rstrip("/") for url in items)


class ReplicaPool:
    """Replicas of one server. ``cooldown_s`` is the first cooldown after a failure, doubled per further failure
    up to ``max_cooldown_s``; a success resets it.

    ``down_since`` is the monotonic time of the first failure since the last success while no replica has
    succeeded since (None while the pool is healthy); :meth:`down_for_s` turns it into a duration."""

    def __init__(self, urls: str | Sequence[str], *, cooldown_s: float = 2.0, max_cooldown_s: float = 30.0):
        if cooldown_s < 0 or max_cooldown_s < cooldown_s:
            raise ValueError(f"need 0 <= cooldown_s <= max_cooldown_s, got {cooldown_s} and {max_cooldown_s}")
        self.replicas = [Replica(url, index) for index, url in enumerate(normalize_urls(urls, "replica pool"))]
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.down_since: float | None = None
        self.last_error: BaseException | None = None
        self._next = 0  # round-robin start for ties

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(replica.url for replica in self.replicas)

    def acquire(self, avoid: Replica | None = None) -> Replica:
        """Pick a replica for one attempt and count it in flight; pair with :meth:`release`.

        Up replicas first, least in flight, ties broken round-robin; a probing replica (cooldown over after a
        failure) only while it has nothing in flight. ``avoid`` (the replica that just failed) is taken only when
        nothing else is up. With nothing up, the replica whose cooldown ends first."""
        now = time.monotonic()
        count = len(self.replicas)
        order = [self.replicas[(self._next + offset) % count] for offset in range(count)]
        candidates = [r for r in order if r.is_up(now) and (r.cooldown_s == 0 or r.inflight == 0) and r is not avoid]
        if not candidates and avoid is not None and avoid.is_up(now) and avoid.inflight == 0:
            candidates = [avoid]
        if candidates:
            chosen = min(candidates, key=lambda r: r.inflight)  # min keeps the first of equals: round-robin
        else:
            chosen = min(order, key=lambda r: r.down_until)
        self._next = (chosen.index + 1) % count
        chosen.inflight += 1
        return chosen

    def release(self, replica: Replica) -> None:
        replica.inflight -= 1

    def record_success(self, replica: Replica) -> None:
        replica.cooldown_s = 0.0
        replica.down_until = 0.0
        self.down_since = None

    def record_failure(self, replica: Replica, error: BaseException, sent_at: float | None = None) -> None:
        """A transient failure of a request to ``replica`` sent at monotonic time ``sent_at`` (None: now): put it down
        for its cooldown, doubled when the request was sent after its last failure (a probe that failed too), and
        remember the error. A request already in flight at that failure only counts as an error."""
        now = time.monotonic()
        replica.errors += 1
        self.last_error = error
        if self.down_since is None:
            self.down_since = now
        if replica.cooldown_s > 0 and (now if sent_at is None else sent_at) < replica.failed_at:
            return  # the same outage as the failure that set the cooldown
        replica.cooldown_s = min(self.max_cooldown_s, max(self.cooldown_s, 2.0 * replica.cooldown_s))
        replica.down_until = now + replica.cooldown_s
        replica.failed_at = now

    def has_other_up(self, replica: Replica) -> bool:
        """Whether a replica other than ``replica`` is up now (so a retry can fail over without backing off)."""
        now = time.monotonic()
        return any(other is not replica and other.is_up(now) for other in self.replicas)

    def down_for_s(self) -> float:
        """Seconds since the pool's first failure with no success after it; 0 while healthy."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since
