"""Supervision of the server processes fastdistill starts: they end when asked, and when whoever started them dies.

A server runs as the leader of its own process group, under a supervisor (``fastdistill serve-*`` itself, or
``python -m fastdistill.supervise`` for :class:`fastdistill.serve.VLLMServer`). The supervisor

- forwards the stop signals it receives (SIGTERM, SIGINT, SIGHUP) to the server's group, and kills the group
  ``grace_s`` seconds after the first one if the server has not exited by then (vLLM can hang on SIGTERM while its
  engine starts: the API server's interrupt waits on an engine core stuck in its own shutdown);
- gets SIGTERM from the kernel when the thread that started it ends, however it ends (SIGKILL included:
  ``PR_SET_PDEATHSIG``), so that the same path runs when its parent is killed;
- once the server's leader has exited, ends what is left of its group (engine-core children): SIGTERM, then SIGKILL
  after ``grace_s`` seconds;
- with ``keepalive_s`` (what ``fastdistill launch`` runs on an ssh host): stops the group as for SIGTERM when its
  stdin (the ssh channel) closes or brings nothing for ``keepalive_s`` seconds (the launcher killed, its host or the
  link lost), so nothing outlives the launcher by more than ``keepalive_s + grace_s``;
- with ``torchrun_status``: exits with the status of torchrun's first failing worker (its error file) instead of
  torchrun's own 1.

This module imports only the standard library (and ``fastdistill.errors``): the supervisor process starts in a few
tens of milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from fastdistill.errors import read_torchrun_error_file

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


def say(text: str) -> None:
    """A line on stderr, prefixed; nothing when stderr is gone (the ssh connection that carried it closed)."""
    try:
        print(f"fastdistill supervise: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def watch_stdin(keepalive_s: float, on_lost: Callable[[str], None]) -> threading.Thread:
    """Start a daemon thread that reads stdin and calls ``on_lost(why)`` once, when stdin reaches its end or brings
    nothing for ``keepalive_s`` seconds (the launcher writes a byte to it every ``keepalive_s / 6`` seconds)."""

    def watch() -> None:
        fd = sys.stdin.fileno()
        while True:
            readable, _, _ = select.select([fd], [], [], keepalive_s)
            if not readable:
                on_lost(f"nothing on stdin for {keepalive_s:g} s (the launcher or its link lost)")
                return
            try:
                data = os.read(fd, 4096)
            except OSError as error:
                data, why = b"", f"stdin unreadable ({error})"
            else:
                why = "stdin closed (the launcher stopped, killed, or its connection gone)"
            if not data:
                on_lost(why)
                return

    thread = threading.Thread(target=watch, name="fastdistill-keepalive", daemon=True)
    thread.start()
    return thread


def torchrun_failure(error_file: str, returncode: int) -> tuple[int, str]:
    """The exit status and ``Class: message`` of torchrun's first failing worker, read from torchrun's own error
    file (``error_file``: what ``TORCHELASTIC_ERROR_FILE`` named for it); ``(returncode, "")`` when it wrote none."""
    code, message = read_torchrun_error_file(error_file)
    return (code if code is not None and 0 < code < 256 else returncode), message


def supervise(command: Sequence[str], *, env: Mapping[str, str] | None = None, grace_s: float = DEFAULT_GRACE_S,
              preexec: Callable[[], None] | None = None, keepalive_s: float | None = None,
              torchrun_status: bool = False) -> int:
    """Run ``command`` as the leader of a new process group until it exits, as the module docstring says (signals
    forwarded, the group killed ``grace_s`` seconds after the first stop request, the rest of the group ended
    after the leader; ``keepalive_s``: stopped when stdin closes or stays silent that long; ``torchrun_status``:
    the status of torchrun's first failing worker). Call from the main thread (signal handlers; the child's death
    signal follows the thread that started it). ``preexec`` runs in the child before exec (CPU pinning). Returns
    the exit status: 128 + the signal's number when a signal ended the server."""
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

    def lost(why: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread: the same path as a stop request
        say(f"{why}: stopping {shlex.join(command)[:200]}")

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    die_with_parent = death_signal_setter(signal.SIGTERM)

    def prepare_child() -> None:
        die_with_parent()
        if preexec is not None:
            preexec()

    error_dir = tempfile.mkdtemp(prefix="fastdistill-torchrun-") if torchrun_status else None
    error_file = os.path.join(error_dir, "error.json") if error_dir else ""
    if error_file:
        env = {**(os.environ if env is None else env), "TORCHELASTIC_ERROR_FILE": error_file}
    try:
        if keepalive_s is not None:
            watch_stdin(keepalive_s, lost)
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
        status = 128 - returncode if returncode < 0 else returncode
        if error_file and status != 0:
            status, message = torchrun_failure(error_file, status)
            if message:
                say(f"torchrun's first failure (exit {status}): {message.splitlines()[0]}")
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started:
            end_group(started[0], grace_s)
        if error_dir:
            shutil.rmtree(error_dir, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The supervisor's options (``python -m fastdistill.supervise`` and ``fastdistill supervise``)."""
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="seconds a stop request or the leader's exit leaves the server's group before SIGKILL")
    parser.add_argument("--keepalive-s", type=float, default=None,
                        help="stop the command when stdin closes or brings nothing for this many seconds (the "
                             "launcher's ssh channel: it writes a byte every keepalive_s / 6 s)")
    parser.add_argument("--torchrun-status", action="store_true",
                        help="the command is torchrun: exit with its first failing worker's status (its error "
                             "file), not torchrun's 1")


def run_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace, command: Sequence[str]) -> int:
    """Check the parsed options and :func:`supervise` ``command``."""
    if not command:
        parser.error("no command to supervise (give it after --)")
    if not args.grace_s >= 0:
        parser.error(f"--grace-s must be >= 0, got {args.grace_s}")
    if args.keepalive_s is not None and not args.keepalive_s > 0:
        parser.error(f"--keepalive-s must be > 0, got {args.keepalive_s}")
    return supervise(command, grace_s=args.grace_s, keepalive_s=args.keepalive_s,
                     torchrun_status=args.torchrun_status)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastdistill.supervise [--grace-s S] [--keepalive-s S] [--torchrun-status] -- command ...``:
    :func:`supervise` the command; exits with its status."""
    parser = argparse.ArgumentParser(prog="python -m fastdistill.supervise", description=main.__doc__)
    add_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the server's command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_parsed(parser, args, command)


if __name__ == "__main__":
    sys.exit(main())
