"""The trainer ranks watching each other through the rendezvous store: a heartbeat that names a silent rank within a
bound, and the store-side wait that parks the other ranks while rank 0 works alone.

Each rank's :class:`PeerWatch` thread writes its own heartbeat key every ``interval_s``; rank 0 reads every other
rank's, the others read rank 0's and one shared loss key: two store round trips per rank and interval, O(ranks) in
all (docs/multinode.md gives the load). Whoever finds a rank silent for ``timeout_s`` (by its own clock: no skew), or
marked failed for as long, publishes the loss once; every rank reads it and ends (``os._exit(LOST_PEER_EXIT_CODE)``),
because its main thread is usually blocked in a collective. A rank whose own heartbeat thread could not run (its main
thread held Python's lock, or the process was stopped) says so, rather than blaming the store or a peer.

:func:`await_main` is called by every rank before a collective whose data rank 0 produces alone: rank 0 writes one
key per release, the others block on it in the store (woken by the release or by rank 0's failure written there), so
their wait is bounded by the heartbeat and rank 0's own deadlines instead of the collective timeout.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from fastdistill.errors import LostRankError

logger = logging.getLogger(__name__)

LOST_PEER_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: resume with resume_from_checkpoint=latest
_PREFIX = "fastdistill/peers/"
_DONE = b"done"
_FAILED = b"failed:"
_LOST_KEY = "lost"  # the first loss any rank found, JSON {"by", "ranks", "why", "message"}; b"" while there is none
_MAX_INTERVAL_S = 2.0  # the longest time between two heartbeats (a stall's age is known to within two of them)
_CHECK_EVERY_S = 30.0  # a parked rank's blocking wait returns this often to read rank 0's failure mark
_KEPT_RELEASES = 64  # release keys rank 0 keeps; a rank further behind reads the release counter instead


def _store_error_types() -> tuple[type[BaseException], ...]:
    return (RuntimeError, OSError, getattr(dist, "DistError", RuntimeError))


class PeerWatch:
    """Rank ``rank`` of ``world_size`` watching the others through ``store`` (a ``torch.distributed.Store`` of its
    own; a round of operations that has not come back after ``timeout_s`` counts as a lost store); ``addresses``
    gives each rank's address (for the messages), ``store_host`` where the store lives. ``on_lost(error)`` is what a
    loss triggers (default: print the error and end the process with :data:`LOST_PEER_EXIT_CODE`). ``interval_s``
    defaults to a fifth of ``timeout_s``, at most 2 s. Rank 0 watches every other rank; the others watch rank 0."""

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout_s: float, addresses: Sequence[str] = (),
                 store_host: str = "", interval_s: float | None = None,
                 on_lost: Callable[[LostRankError], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else min(timeout_s / 5, _MAX_INTERVAL_S)
        self.addresses = tuple(addresses)
        self.store_host = store_host
        self.on_lost = on_lost or exit_naming
        self.clock = clock
        self._beats = 0
        self._last_beat: float | None = None  # when this rank last wrote its heartbeat
        self.starved: tuple[float, float] | None = None  # (seconds, when it ended) of this rank's last long gap
        self._seen: dict[int, tuple[bytes, float]] = {}  # watched rank -> (last value read, when it last changed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round_started: float | None = None  # when the store round in flight began (None: none in flight)
        self._observed_from = clock()  # the store bound counts a stall only from here (set after this rank stalled)
        self._last_tick = clock()
        self._lost_lock = threading.Lock()
        self.lost: LostRankError | None = None

    def key(self, rank: int) -> str:
        return f"beat/{rank}"

    def where(self, rank: int) -> str:
        return self.addresses[rank] if rank < len(self.addresses) else "unknown address"

    def watched(self) -> list[int]:
        """The ranks whose heartbeat this rank reads: every other rank on rank 0, rank 0 on the others."""
        return list(range(1, self.world_size)) if self.rank == 0 else [0]

    # ------------------------------------------------------------------------------------------------ beats

    def announce(self) -> None:
        """Write the first heartbeat and create the loss key (empty) if no rank has: call on every rank before a
        collective that all ranks pass before any watch starts, so every key a watch reads exists."""
        self.beat()
        self.store.compare_set(_LOST_KEY, "", "")

    def beat(self) -> None:
        """Write this rank's heartbeat (a counter), noting how long this rank went without one."""
        now = self.clock()
        if self._last_beat is not None:
            gap = now - self._last_beat
            if gap > 2 * self.interval_s:
                self.starved = (gap, now)
            if gap > self.timeout_s / 2:
                logger.warning("rank %d: this rank's heartbeat thread did not run for %.1f s "
                               "(rank_heartbeat_timeout_s=%g): %s", self.rank, gap, self.timeout_s, _STARVED_WHY)
        self._beats += 1
        self.store.set(self.key(self.rank), str(self._beats))
        self._last_beat = now

    def check(self) -> LostRankError | None:
        """Read the watched ranks' heartbeats and the loss key (one store operation); publish a loss found here
        (the ranks silent for ``timeout_s``, with those silent almost as long: a node's ranks go silent together;
        or a rank marked failed for ``timeout_s``). The error of the loss published first, else None."""
        watched = self.watched()
        values = self.store.multi_get([_LOST_KEY] + [self.key(rank) for rank in watched])
        if values[0]:
            return self._error_of(values[0])
        now = self.clock()
        silent: list[tuple[int, float]] = []
        for rank, value in zip(watched, values[1:], strict=True):
            last = self._seen.get(rank)
            if last is None or last[0] != value:
                self._seen[rank] = (value, now)
            if value == _DONE:
                continue
            if value.startswith(_FAILED):
                if now - self._seen[rank][1] > self.timeout_s:
                    # after a grace of timeout_s: a rank failing with the same error (every rank's non-finite loss)
                    # or parked for rank 0 (await_main raises it) ends by itself, through its own error path
                    return self._publish([rank], "failed", f": trainer rank {rank} of {self.world_size} (at "
                                         f"{self.where(rank)}) failed: {value[len(_FAILED):].decode(errors='replace')}")
                continue
            silent.append((rank, now - self._seen[rank][1]))
        if not any(silent_s > self.timeout_s for _, silent_s in silent):
            return None
        lost = [(rank, silent_s) for rank, silent_s in silent if silent_s > self.timeout_s - 2 * self.interval_s]
        ranks = ", ".join(str(rank) for rank, _ in lost)
        where = ", ".join(dict.fromkeys(self.where(rank) for rank, _ in lost))
        silent_s = max(s for _, s in lost)
        return self._publish([rank for rank, _ in lost], f"no heartbeat for {silent_s:.0f} s", (
            f" lost trainer rank(s) {ranks} of {self.world_size} (at {where}): no heartbeat for {silent_s:.0f} s "
            f"(rank_heartbeat_timeout_s={self.timeout_s:g}, seen by rank {self.rank}): its host stopped answering, "
            "its process is stopped, or its main thread held Python's lock that long. Resume every node with "
            "resume_from_checkpoint=latest once it is back"))

    def _publish(self, ranks: list[int], why: str, message: str) -> LostRankError:
        """Store this loss (``ranks``, a short ``why``, the ``message`` that follows a rank's name) unless another
        rank stored one first; the error of the one stored."""
        value = json.dumps({"by": self.rank, "ranks": ranks, "why": why, "message": message}).encode()
        return self._error_of(self.store.compare_set(_LOST_KEY, "", value))

    def _error_of(self, value: bytes) -> LostRankError:
        """This rank's error for the stored loss ``value``: the loss as found, or, when it names this silent rank,
        what this rank knows of its own silence."""
        try:
            loss = json.loads(value)
        except ValueError:  # not written by this version: the text is all there is
            return LostRankError(f"rank {self.rank}: another trainer rank reported a loss: {value[:500]!r}")
        if self.rank not in loss["ranks"] or loss["why"] == "failed":
            return LostRankError(f"rank {self.rank}{loss['message']}")
        told = f"rank {loss['by']} counted it lost ({loss['why']})"
        starved = self.starved is not None and self.starved[0] > self.timeout_s - 2 * self.interval_s and \
            self.clock() - self.starved[1] <= 2 * self.interval_s  # a gap that just ended: the one the others saw
        if starved:
            return LostRankError(
                f"rank {self.rank} of {self.world_size}: its own heartbeat was starved: its heartbeat thread did not "
                f"run for {self.starved[0]:.0f} s (rank_heartbeat_timeout_s={self.timeout_s:g}), so {told}: "
                f"{_STARVED_WHY}; not a lost store or peer. Keep rank_heartbeat_timeout_s above the longest such "
                "call, then resume every node with resume_from_checkpoint=latest")
        return LostRankError(
            f"rank {self.rank} of {self.world_size}: {told}, though its heartbeat thread ran: its heartbeats did not "
            f"reach the store at {self.store_host or '?'} in time (the store or the link to it stalled). Resume every "
            "node with resume_from_checkpoint=latest")

    def silent(self, at_least_s: float) -> list[tuple[int, float]]:
        """``(rank, seconds)`` of the watched ranks whose heartbeat has not changed for ``at_least_s`` seconds (as
        last read), stalest first."""
        now = self.clock()
        found = [(rank, now - changed) for rank, (value, changed) in self._seen.items()
                 if rank != self.rank and value != _DONE and now - changed >= at_least_s]
        return sorted(found, key=lambda item: -item[1])

    # ------------------------------------------------------------------------------------------------ thread

    def start(self) -> PeerWatch:
        """Start the watching thread, and the one that bounds its store operations (a TCPStore read towards a host
        whose link is cut blocks until TCP gives up, minutes later); :meth:`announce` first if not done."""
        if self._last_beat is None:
            self.announce()
        started = self._observed_from = self._last_tick = self.clock()
        for rank in self.watched():  # a rank that never writes is silent from now on
            self._seen.setdefault(rank, (b"", started))
        self._thread = threading.Thread(target=self._run, name="fastdistill-peer-watch", daemon=True)
        self._thread.start()
        threading.Thread(target=self._bound_store, name="fastdistill-peer-store-bound", daemon=True).start()
        return self

    def _store_lost(self, why: str) -> LostRankError:
        return LostRankError(
            f"rank {self.rank} of {self.world_size} lost the rendezvous store at {self.store_host or '?'} (trainer "
            f"rank 0's host): {why}. Resume every node with resume_from_checkpoint=latest once it is back")

    def _lose(self, error: LostRankError) -> None:
        with self._lost_lock:
            if self.lost is not None or self._stop.is_set():
                return
            self.lost = error
        self.on_lost(error)

    def round(self) -> LostRankError | None:
        """One round of the watching thread: beat, then :meth:`check`; a store that fails is lost."""
        self._round_started = self.clock()
        try:
            self.beat()
            return self.check()
        except _store_error_types() as store_error:
            return self._store_lost(f"no answer within rank_heartbeat_timeout_s={self.timeout_s:g} s "
                                    f"({str(store_error).splitlines()[0][:200]})")
        finally:
            self._round_started = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            error = self.round()
            if error is not None:
                self._lose(error)
                return

    def bound_tick(self) -> LostRankError | None:
        """The bounding thread's check: the store is lost when a round has been in flight for ``timeout_s`` (plus
        one interval) while this thread saw it. A tick that comes late (this thread itself did not run: the main
        thread held Python's lock, or the process was stopped) restarts the count: the stall was this process's."""
        now = self.clock()
        late = now - self._last_tick > 2 * self.interval_s + 1.0
        self._last_tick = now
        if late:
            self._observed_from = now
            return None
        started = self._round_started
        if started is None:
            return None
        stalled_s = now - max(started, self._observed_from)
        if stalled_s > self.timeout_s + self.interval_s:
            return self._store_lost(f"no answer for {stalled_s:.0f} s (rank_heartbeat_timeout_s={self.timeout_s:g})")
        return None

    def _bound_store(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.lost is not None:
                return
            error = self.bound_tick()
            if error is not None:
                self._lose(error)
                return

    def stop(self, error: BaseException | None = None) -> None:
        """Stop watching; mark this rank done (or failed with ``error``) so that the others stop watching it (or end
        naming its error). Each step is bounded by ``timeout_s``: a store that no longer answers (rank 0's host
        gone) does not hold up the end. Calling it again does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + self.timeout_s)  # its last beat lands before the mark
        mark = _DONE if error is None else _FAILED + f"{type(error).__name__}: {error}".encode()[:500]
        _bounded(lambda: self.store.set(self.key(self.rank), mark), self.timeout_s)

    def peer_failure(self, rank: int, store: Any = None) -> str | None:
        """Rank ``rank``'s error when it marked itself failed, else None (one read of ``store``, default the
        watch's: another connection to the same keys keeps the main thread off the heartbeat's)."""
        store = store if store is not None else self.store
        key = self.key(rank)
        value = store.get(key) if store.check([key]) else b""
        return value[len(_FAILED):].decode(errors="replace") if value.startswith(_FAILED) else None


_STARVED_WHY = ("this process's main thread held Python's lock (a long call into native code that does not release "
                "it) or the process was stopped")


def _bounded(write: Callable[[], Any], timeout_s: float) -> None:
    """Run the store ``write`` on a thread for at most ``timeout_s``; a store that is gone (rank 0's host ended
    first) leaves nobody to tell."""

    def run() -> None:
        try:
            write()
        except _store_error_types():
            pass

    writer = threading.Thread(target=run, name="fastdistill-peer-mark", daemon=True)
    writer.start()
    writer.join(timeout=timeout_s)


def exit_naming(error: LostRankError) -> None:
    """End this process with ``error``: log it, print it as an uncaught error would (the line the launcher and the
    tests read), record it in torchelastic's error file when torchrun set one, then ``os._exit``. The main thread is
    blocked in a collective it would otherwise leave only at the collective timeout."""
    text = f"{type(error).__module__}.{type(error).__name__}: {error}"
    logger.error("%s", text)
    print(text, file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            ErrorHandler().record_exception(error)
        except Exception:  # the printed line is the record that matters
            pass
    sys.stdout.flush()
    os._exit(LOST_PEER_EXIT_CODE)


# ---------------------------------------------------------------------------------------------- parking


def prefixed(store: Any, sub: str = "") -> Any:
    """``store`` with fastdistill's key prefix (``fastdistill/peers/<sub>``)."""
    return dist.PrefixStore(_PREFIX + sub, store)


class MainRelease:
    """Rank 0's releases in ``store`` (the main thread's connection to the watch's keys, or the process group's
    store without a watch): release ``n`` is the key ``release/<n>``, and the counter ``released``; ``watch`` tells
    rank 0's failure. A parked rank's blocking wait returns every ``check_every_s`` to read that failure."""

    def __init__(self, store: Any, rank: int, watch: PeerWatch | None, check_every_s: float = _CHECK_EVERY_S):
        self.store, self.rank, self.watch = store, rank, watch
        self.check_every_s = check_every_s
        self.count = 0

    def wait(self) -> None:
        """Rank 0: write the next release. Others: block until rank 0 wrote as many releases as this rank waited
        for; raise :class:`LostRankError` when rank 0 failed meanwhile (written in the release, or marked)."""
        self.count += 1
        key = f"release/{self.count}"
        if self.rank == 0:
            self.store.set(key, b"go")
            self.store.add("released", 1)
            if self.count > _KEPT_RELEASES:
                self.store.delete_key(f"release/{self.count - _KEPT_RELEASES}")
            return
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=self.check_every_s))
            except _store_error_types():  # the wait timed out (a store that failed fails the reads below too)
                if self.store.add("released", 0) >= self.count:
                    return  # rank 0 is releases ahead and deleted this one
                failure = self.watch.peer_failure(0, self.store) if self.watch is not None else None
                if failure is not None:
                    raise self._failed(failure) from None
                continue
            value = self.store.get(key)
            if value.startswith(_FAILED):
                raise self._failed(value[len(_FAILED):].decode(errors="replace"))
            return

    def _failed(self, failure: str) -> LostRankError:
        where = f" (at {self.watch.where(0)})" if self.watch is not None else ""
        return LostRankError(f"rank {self.rank}: trainer rank 0{where} failed while this rank waited for it: "
                             f"{failure}")

    def fail(self, error: BaseException) -> None:
        """Rank 0: write ``error`` as the next release, which wakes the ranks parked for it (nothing on others)."""
        if self.rank == 0:
            text = _FAILED + f"{type(error).__name__}: {error}".encode()[:500]
            _bounded(lambda: self.store.set(f"release/{self.count + 1}", text),
                     self.watch.timeout_s if self.watch is not None else 10.0)


_active: MainRelease | None = None


def activate(release: MainRelease | None) -> None:
    """Make ``release`` the one :func:`await_main` uses (None: none; a single process)."""
    global _active
    _active = release


def active_watch() -> PeerWatch | None:
    """The running :class:`PeerWatch` of this process's trainer group, or None."""
    return _active.watch if _active is not None else None


def await_main() -> None:
    """Call on every rank before a collective whose data rank 0 produces alone: the other ranks wait here, in the
    store, not in the collective (see the module docstring). Nothing without an active group."""
    if _active is not None:
        _active.wait()


def release_failed(error: BaseException) -> None:
    """Rank 0 failed with ``error``: wake the ranks parked in :func:`await_main` with it (nothing elsewhere)."""
    if _active is not None:
        _active.fail(error)
