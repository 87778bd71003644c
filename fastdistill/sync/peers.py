"""The trainer ranks watching each other through the rendezvous store: a heartbeat that names a silent rank within a
bound, and the store-side wait that parks the other ranks while rank 0 works alone.

Every rank runs a :class:`PeerWatch` thread that writes its own heartbeat key every ``interval_s`` and reads the
others'. A rank whose heartbeat has not changed for ``timeout_s`` (as seen by the reader's own clock: no clock skew)
is lost: the watching rank ends its process (``os._exit(LOST_PEER_EXIT_CODE)``) after printing a
:class:`~fastdistill.errors.LostRankError` naming the rank and its address, because its main thread is usually
blocked in a collective that would otherwise wait out the collective timeout. A store that stops answering for
``timeout_s`` (this rank cut off from rank 0's host, where the store lives) ends it the same way, naming the store's
host. A rank that ends normally marks itself done (no longer watched); one that fails marks itself failed, and the
others end naming its error (after a grace of ``timeout_s``, which their own error path usually beats).

:func:`await_main` is called by every rank before a collective whose data rank 0 produces alone (a broadcast or
scatter of rollouts, held-out completions, the weight push's go-ahead): rank 0 counts one release, the others poll
the store until that release, so their wait is bounded by the heartbeat and by rank 0's own deadlines
(``server_down_deadline_s``, ...) instead of by the collective timeout (NCCL's watchdog, gloo's timeout).
"""

from __future__ import annotations

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
_MAX_INTERVAL_S = 2.0  # the longest time between two heartbeats (a stall's age is known to within two of them)
_STATUS_EVERY_S = 0.5  # how often a parked rank reads rank 0's status (a failure of rank 0 releases it)
# await_main's sleep between two reads of the release counter grows with the wait, so that it adds at most
# max(_MIN_POLL_S, _POLL_SHARE × the wait) to it: a step's short wait costs about a millisecond, and a rank parked
# through rank 0's long work (an evaluation, an export) reads the store twice a second, not hundreds of times.
_MIN_POLL_S = 0.001
_POLL_SHARE = 0.05
_MAX_POLL_S = _STATUS_EVERY_S


def poll_interval(waited_s: float) -> float:
    """Seconds to sleep before the next read of the release counter, after ``waited_s`` seconds of waiting."""
    return min(max(_MIN_POLL_S, _POLL_SHARE * waited_s), _MAX_POLL_S)


def _store_error_types() -> tuple[type[BaseException], ...]:
    return (RuntimeError, OSError, getattr(dist, "DistError", RuntimeError))


class PeerWatch:
    """Rank ``rank`` of ``world_size`` watching the others through ``store`` (a ``torch.distributed.Store`` of its
    own; a round of operations that has not come back after ``timeout_s`` counts as a lost store); ``addresses``
    gives each rank's address (for the messages), ``store_host`` where the store lives. ``on_lost(error)`` is what a
    lost peer triggers (default: print the error and end the process with :data:`LOST_PEER_EXIT_CODE`).
    ``interval_s`` defaults to a fifth of ``timeout_s``, at most 2 s."""

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
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value read, when it last changed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_round = clock()  # when the watching thread last finished a round of store operations
        self._lost_lock = threading.Lock()
        self.lost: LostRankError | None = None

    def key(self, rank: int) -> str:
        return f"beat/{rank}"

    def where(self, rank: int) -> str:
        return self.addresses[rank] if rank < len(self.addresses) else "unknown address"

    # ------------------------------------------------------------------------------------------------ beats

    def beat(self) -> None:
        """Write this rank's heartbeat (a counter)."""
        self._beats += 1
        self.store.set(self.key(self.rank), str(self._beats))

    def check(self) -> LostRankError | None:
        """Read the other ranks' heartbeats once; the error naming the ranks silent for ``timeout_s`` (with those
        silent almost as long: a node's ranks go silent together), or the first that failed; else None."""
        now = self.clock()
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        present = [rank for rank in others if self.store.check([self.key(rank)])]
        values = dict(zip(present, self.store.multi_get([self.key(rank) for rank in present]) if present else [],
                          strict=True))
        silent: list[tuple[int, float]] = []
        for rank in others:
            value = values.get(rank, b"")
            last = self._seen.get(rank)
            if last is None or last[0] != value:
                self._seen[rank] = (value, now)
            if value == _DONE:
                continue
            if value.startswith(_FAILED):
                if now - self._seen[rank][1] > self.timeout_s:
                    # after a grace of timeout_s: a rank failing with the same error (every rank's non-finite loss)
                    # or parked for rank 0 (await_main raises it) ends by itself, through its own error path
                    return LostRankError(
                        f"rank {self.rank}: trainer rank {rank} of {self.world_size} (at {self.where(rank)}) "
                        f"failed: {value[len(_FAILED):].decode(errors='replace')}")
                continue
            silent.append((rank, now - self._seen[rank][1]))
        if not any(silent_s > self.timeout_s for _, silent_s in silent):
            return None
        lost = [(rank, silent_s) for rank, silent_s in silent if silent_s > self.timeout_s - 2 * self.interval_s]
        ranks = ", ".join(str(rank) for rank, _ in lost)
        where = ", ".join(dict.fromkeys(self.where(rank) for rank, _ in lost))
        return LostRankError(
            f"rank {self.rank} lost trainer rank(s) {ranks} of {self.world_size} (at {where}): no heartbeat for "
            f"{max(s for _, s in lost):.0f} s (rank_heartbeat_timeout_s={self.timeout_s:g}): its host stopped "
            "answering or its process is stopped. Resume every node with resume_from_checkpoint=latest once it is "
            "back")

    def silent(self, at_least_s: float) -> list[tuple[int, float]]:
        """``(rank, seconds)`` of the ranks whose heartbeat has not changed for ``at_least_s`` seconds (as last
        read), stalest first."""
        now = self.clock()
        found = [(rank, now - changed) for rank, (value, changed) in self._seen.items()
                 if rank != self.rank and value != _DONE and now - changed >= at_least_s]
        return sorted(found, key=lambda item: -item[1])

    # ------------------------------------------------------------------------------------------------ thread

    def start(self) -> PeerWatch:
        """Write the first heartbeat and start the watching thread, and the one that bounds its store operations (a
        TCPStore read towards a host whose link is cut blocks until TCP gives up, minutes later)."""
        self.beat()
        started = self._last_round = self.clock()
        for rank in range(self.world_size):  # a rank that never writes is silent from now on
            if rank != self.rank:
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

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                error = self.check()
            except _store_error_types() as store_error:
                error = self._store_lost(f"no answer within rank_heartbeat_timeout_s={self.timeout_s:g} s "
                                         f"({str(store_error).splitlines()[0][:200]})")
            self._last_round = self.clock()
            if error is not None:
                self._lose(error)
                return

    def _bound_store(self) -> None:
        """Declare the store lost when the watching thread's round has not come back for ``timeout_s`` (plus one
        interval: its own wait)."""
        while not self._stop.wait(self.interval_s):
            if self.lost is not None:
                return
            stalled_s = self.clock() - self._last_round
            if stalled_s > self.timeout_s + self.interval_s:
                self._lose(self._store_lost(f"no answer for {stalled_s:.0f} s "
                                            f"(rank_heartbeat_timeout_s={self.timeout_s:g})"))
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

        def write_mark() -> None:
            try:
                self.store.set(self.key(self.rank), mark)
            except _store_error_types():
                pass  # the store is gone (rank 0's host ended first): nobody is left to tell

        writer = threading.Thread(target=write_mark, name="fastdistill-peer-mark", daemon=True)
        writer.start()
        writer.join(timeout=self.timeout_s)

    def peer_failure(self, rank: int, store: Any = None) -> str | None:
        """Rank ``rank``'s error when it marked itself failed, else None (one read of ``store``, default the
        watch's: another connection to the same keys keeps the main thread off the heartbeat's)."""
        store = store if store is not None else self.store
        key = self.key(rank)
        value = store.get(key) if store.check([key]) else b""
        return value[len(_FAILED):].decode(errors="replace") if value.startswith(_FAILED) else None


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
    """The count of rank 0's releases in ``store`` (the main thread's connection to the watch's keys, or the process
    group's store without a watch), and the watch whose keys tell rank 0's failure."""

    def __init__(self, store: Any, rank: int, watch: PeerWatch | None):
        self.store, self.rank, self.watch = store, rank, watch
        self.count = 0

    def wait(self) -> None:
        """Rank 0: count a release. Others: return once rank 0 counted as many releases as this rank waited for;
        raise :class:`LostRankError` when rank 0 marked itself failed meanwhile."""
        self.count += 1
        key = "released"
        if self.rank == 0:
            self.store.add(key, 1)
            return
        began = time.monotonic()
        status_at = began + _STATUS_EVERY_S
        while self.store.add(key, 0) < self.count:
            time.sleep(poll_interval(time.monotonic() - began))
            if self.watch is not None and time.monotonic() >= status_at:
                status_at = time.monotonic() + _STATUS_EVERY_S
                failure = self.watch.peer_failure(0, self.store)
                if failure is not None:
                    raise LostRankError(f"rank {self.rank}: trainer rank 0 (at {self.watch.where(0)}) failed while "
                                        f"this rank waited for it: {failure}")


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
