"""Supervision of the server processes fastdistill starts: they end when asked, and when whoever started them dies.

A server runs as the leader of its own process group, under a supervisor (``fastdistill serve-*`` itself, or
``python -m fastdistill.supervise`` for :class:`fastdistill.serve.VLLMServer`). The supervisor

- forwards the stop signals it receives (SIGTERM, SIGINT, SIGHUP) to the server's group, and kills the group
  ``grace_s`` seconds after the first one if the server has not exited by then (vLLM can hang on SIGTERM while its
  engine starts: the API server's interrupt waits on an engine core stuck in its own shutdown);
- gets SIGTERM from the kernel when the thread that started it ends, however it ends (SIGKILL included:
  ``PR_SET_PDEATHSIG``), so that the same path runs when its parent is killed;
- once the server's leader has exited, ends what is left of its group (engine-core children): SIGTERM, then SIGKILL
  after ``grace_s`` seconds.

This module imports only the standard library: the supervisor process starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Signals a supervisor passes on to the server: stop requests (kill, Ctrl-C, a closed terminal).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
DEFAULT_GRACE_S = 15.0


def death_signal_setter(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` step: ask the kernel to send the child ``sig`` when this process's current thread ends,
    however it ends (SIGKILL included; ``PR_SET_PDEATHSIG``, Linux only, kept across exec), and send it at once when
    the parent is already gone. libc is loaded here, in the parent: loading a library between fork and exec can
    deadlock."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the child only gets the forwarded signals
        return lambda: None

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)

    return set_death_signal


def signal_group(group_id: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``group_id``; nothing when the group is gone."""
    try:
        os.killpg(group_id, sig)
    except ProcessLookupError:
        pass


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children now (``/proc``; none where there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except OSError:
        return []


def group_is_empty(group_id: int) -> bool:
    """No running process is left in process group ``group_id``: zombies (exited, waiting for a parent that may
    never reap them) do not count. Reads ``/proc`` where there is one."""
    try:
        os.killpg(group_id, 0)
    except ProcessLookupError:
        return True
    if not os.path.isdir("/proc/self"):
        return False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == group_id:  # state, ppid, pgrp, ...
            return False
    return True


def end_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """After the group leader ``process`` exited (or on an error): TERM what is left of its group, KILL it after
    ``grace_s`` seconds, and reap the leader."""
    signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while not group_is_empty(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(process.pid, signal.SIGKILL)
    process.wait()


def supervise(command: Sequence[str], *, env: Mapping[str, str] | None = None, grace_s: float = DEFAULT_GRACE_S,
              preexec: Callable[[], None] | None = None) -> int:
    """Run ``command`` as the leader of a new process group until it exits, as the module docstring says (signals
    forwarded, the group killed ``grace_s`` seconds after the first stop request, the rest of the group ended
    after the leader). Call from the main thread (signal handlers; the child's death signal follows the thread that
    started it). ``preexec`` runs in the child before exec (CPU pinning). Returns the exit status: 128 + the
    signal's number when a signal ended the server."""
    started: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []  # signals that arrived before the child existed
    kill_at: list[float] = []  # when the first stop request's grace runs out

    def forward(signum: int, _frame: object) -> None:
        if not kill_at:
            kill_at.append(time.monotonic() + grace_s)
        if started:
            signal_group(started[0].pid, signal.Signals(signum))
        else:
            pending.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    die_with_parent = death_signal_setter(signal.SIGTERM)

    def prepare_child() -> None:
        die_with_parent()
        if preexec is not None:
            preexec()

    try:
        process = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, env=None if env is None else dict(env),
                                   start_new_session=True, preexec_fn=prepare_child)
        started.append(process)
        for signum in pending:
            signal_group(process.pid, signal.Signals(signum))
        while True:
            # bounded waits: a signal handler runs between them (a blocking wait would be resumed after it)
            try:
                returncode = process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if kill_at and time.monotonic() >= kill_at[0]:
                    signal_group(process.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started:
            end_group(started[0], grace_s)
    return 128 - returncode if returncode < 0 else returncode


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastdistill.supervise [--grace-s S] -- command ...``: :func:`supervise` the command; exits with
    its status."""
    parser = argparse.ArgumentParser(prog="python -m fastdistill.supervise", description=main.__doc__)
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="seconds a stop request or the leader's exit leaves the server's group before SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the server's command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to supervise (give it after --)")
    if not args.grace_s >= 0:
        parser.error(f"--grace-s must be >= 0, got {args.grace_s}")
    return supervise(command, grace_s=args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
