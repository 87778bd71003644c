"""Start a multi-host fastdistill run from one config: the student server, the teacher replicas and the trainer
nodes (``torchrun``, one per trainer host), each on its own host through an "exec" prefix (``ssh HOST``, ``srun -w
HOST``, or ``ip netns exec NS`` in the tests), supervise them and stop them all when one fails.

Each remote command runs under ``fastdistill supervise`` on its host: its own process group, stopped with it; over
ssh also when the launcher's keep-alive on its stdin stops (the launcher stopped or killed, the link lost), and a
trainer node exits with its first failing rank's status (:func:`fastdistill.errors.exit_status`). The config's
fields, the exit statuses and what happens on each failure: ``docs/multinode.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fastdistill.auth import key_from_file_or_new
from fastdistill.errors import EXIT_MEANINGS, EXIT_OTHER, EXIT_TEMPFAIL, EXIT_UNAVAILABLE, ConfigError
from fastdistill.supervise import death_signal_setter, signal_group  # the servers' own supervision

STUDENT_KEY_FILE_ENV = "FASTDISTILL_STUDENT_API_KEY_FILE"
TEACHER_KEY_FILE_ENV = "FASTDISTILL_TEACHER_API_KEY_FILE"
REQUIRED_FIELDS = ("student", "teacher_model", "teachers", "trainers", "key_files", "train_config")
OPTIONAL_FIELDS = ("exec", "exec_shell", "teacher_args", "master_port", "logs", "env", "fastdistill", "torchrun",
                   "failure_grace_s", "keepalive_s", "stop_grace_s")
DEFAULT_KEEPALIVE_S = 30.0  # ssh: the remote side stops its command after this long without the launcher
DEFAULT_STOP_GRACE_S = 15.0  # a stopped command's group gets this long between SIGTERM and SIGKILL
SSH_SERVER_ALIVE_COUNT = 3  # ssh -o ServerAliveCountMax: the launcher's ssh gives up after 3 unanswered probes
SSH_LOST = 255  # ssh's own exit status: the connection failed or was lost


@dataclass(frozen=True)
class Endpoint:
    """One server: the host it runs on (what ``exec`` receives), the address others reach it at, its port."""

    host: str
    address: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"


@dataclass(frozen=True)
class TrainerNode:
    host: str
    address: str
    nproc: int = 1


@dataclass
class Cluster:
    """A parsed launcher config (its fields: ``docs/multinode.md``, "The launcher's config")."""

    student: Endpoint
    student_model: str
    teachers: dict[str, list[Endpoint]]
    teacher_model: str
    trainers: list[TrainerNode]
    master_port: int
    key_files: dict[str, Path]
    train_config: Path
    logs: Path
    exec_prefix: list[str] = field(default_factory=lambda: ["ssh", "{host}"])
    exec_shell: bool = True
    student_args: list[str] = field(default_factory=list)
    teacher_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    fastdistill: list[str] = field(default_factory=lambda: ["fastdistill"])
    torchrun: list[str] = field(default_factory=lambda: ["torchrun"])
    failure_grace_s: float = 90.0
    keepalive_s: float | None = None
    stop_grace_s: float = DEFAULT_STOP_GRACE_S

    @property
    def over_ssh(self) -> bool:
        return bool(self.exec_prefix) and os.path.basename(self.exec_prefix[0]) == "ssh"

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Read and check a launcher config; relative paths are taken from the config's folder."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such launcher config")
        raw = yaml.safe_load(path.read_text())
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a launcher config is a mapping of fields, not {type(raw).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in raw]
        unknown = sorted(set(raw) - {*REQUIRED_FIELDS, *OPTIONAL_FIELDS})
        if missing or unknown:
            raise ConfigError(f"{path}: " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])))
        roles = sorted(raw["key_files"] or ())
        if roles != ["student", "teacher"]:
            raise ConfigError(f"{path}: key_files names a 'student' and a 'teacher' file, not {roles}")
        here = path.resolve().parent

        def local(value: str) -> Path:
            return (here / value).resolve()

        def endpoint(entry: dict[str, Any], what: str) -> Endpoint:
            missing = {"host", "address", "port"} - set(entry)
            if missing:
                raise ConfigError(f"{what} needs {sorted(missing)}")
            return Endpoint(str(entry["host"]), str(entry["address"]), int(entry["port"]))

        exec_prefix = list(raw.get("exec", ["ssh", "{host}"]))
        student = raw["student"]
        if "model" not in student:
            raise ConfigError("student needs ['model']")
        teachers = {str(tid): [endpoint(e, f"teacher {tid!r}") for e in (entries if isinstance(entries, list)
                                                                          else [entries])]
                    for tid, entries in raw["teachers"].items()}
        for index, node in enumerate(raw["trainers"] or ()):
            if {"host", "address"} - set(node):
                raise ConfigError(f"trainer {index} needs {sorted({'host', 'address'} - set(node))}")
        trainers = [TrainerNode(str(t["host"]), str(t["address"]), int(t.get("nproc", 1)))
                    for t in raw["trainers"] or ()]
        if not trainers:
            raise ConfigError("trainers: at least one trainer node")
        return cls(
            student=endpoint(student, "student"), student_model=str(student["model"]), teachers=teachers,
            teacher_model=str(raw["teacher_model"]), trainers=trainers, master_port=int(raw.get("master_port", 29500)),
            key_files={role: local(p) for role, p in raw["key_files"].items()},
            train_config=local(raw["train_config"]), logs=local(raw.get("logs", "logs")),
            exec_prefix=exec_prefix, exec_shell=bool(raw.get("exec_shell", exec_prefix[:1] == ["ssh"])),
            student_args=[str(a) for a in student.get("args", [])],
            teacher_args=[str(a) for a in raw.get("teacher_args", [])],
            env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
            fastdistill=list(raw.get("fastdistill", ["fastdistill"])), torchrun=list(raw.get("torchrun", ["torchrun"])),
            failure_grace_s=float(raw.get("failure_grace_s", 90.0)),
            keepalive_s=_keepalive(raw, exec_prefix), stop_grace_s=float(raw.get("stop_grace_s", DEFAULT_STOP_GRACE_S)),
        )

    # ---------------------------------------------------------------------------------------------- commands

    def prefix(self, host: str) -> list[str]:
        """The exec prefix for ``host``; over ssh with a keep-alive, ssh's own probes are added before the host
        (``ServerAliveInterval`` = ``keepalive_s / 4``, ``ServerAliveCountMax`` 3: ssh probes after each interval
        of silence and gives up when a fourth finds three unanswered, so the launcher's ssh ends about
        ``keepalive_s`` after a cut link; options the prefix sets itself come first and win)."""
        prefix = [part.replace("{host}", host) for part in self.exec_prefix]
        if self.over_ssh and self.keepalive_s is not None:
            at = next((i for i, part in enumerate(self.exec_prefix) if "{host}" in part), len(prefix))
            interval = max(1, math.ceil(self.keepalive_s / (SSH_SERVER_ALIVE_COUNT + 1)))
            prefix[at:at] = ["-o", f"ServerAliveInterval={interval}", "-o",
                             f"ServerAliveCountMax={SSH_SERVER_ALIVE_COUNT}"]
        return prefix

    def on_host(self, host: str, argv: Sequence[str], env: dict[str, str] | None = None, *,
                torchrun: bool = False) -> list[str]:
        """``argv`` run on ``host`` through the exec prefix, under ``fastdistill supervise`` (with the keep-alive
        over ssh; ``torchrun``: the node's status is its first failing rank's), with ``env`` (and the config's
        ``env``) set by ``env(1)`` on the far side (ssh does not forward variables)."""
        variables = {**self.env, **(env or {})}
        supervisor = [*self.fastdistill, "supervise", "--grace-s", f"{self.stop_grace_s:g}",
                      *(["--keepalive-s", f"{self.keepalive_s:g}"] if self.keepalive_s is not None else []),
                      *(["--torchrun-status"] if torchrun else []), "--"]
        command = [*supervisor, *argv]
        if variables:
            command = ["env", *(f"{k}={v}" for k, v in variables.items()), *command]
        prefix = self.prefix(host)
        return [*prefix, shlex.join(command)] if self.exec_shell else [*prefix, *command]

    def server_commands(self) -> dict[str, tuple[str, list[str]]]:
        """``{name: (host, command)}`` of every server: ``student``, ``teacher-<id>-<replica>``."""
        commands = {"student": (self.student.host, self.on_host(self.student.host, [
            *self.fastdistill, "serve-student", self.student_model, "--host", self.student.address,
            "--port", str(self.student.port), "--api-key-file", str(self.key_files["student"]),
            *self.student_args]))}
        for teacher_id, replicas in self.teachers.items():
            for index, replica in enumerate(replicas):
                commands[f"teacher-{teacher_id}-{index}"] = (replica.host, self.on_host(replica.host, [
                    *self.fastdistill, "serve-teacher", self.teacher_model, "--host", replica.address,
                    "--port", str(replica.port), "--api-key-file", str(self.key_files["teacher"]),
                    *self.teacher_args]))
        return commands

    def server_overrides(self) -> list[str]:
        """The ``fastdistill train`` overrides that point the trainer at the servers (JSON-quoted values)."""
        teachers = {tid: [r.url for r in replicas] if len(replicas) > 1 else replicas[0].url
                    for tid, replicas in self.teachers.items()}
        return [f"vllm_server_base_url={json.dumps(self.student.url)}",
                f"teacher_server_urls={json.dumps(teachers)}"]

    def trainer_commands(self, overrides: Sequence[str] = ()) -> dict[str, tuple[str, list[str]]]:
        """``{trainer-<node>: (host, command)}``: ``torchrun --nnodes N --node-rank i`` on each trainer host, static
        rendezvous at node 0's address and ``master_port``, the keys' files in the environment."""
        keys = {STUDENT_KEY_FILE_ENV: str(self.key_files["student"]),
                TEACHER_KEY_FILE_ENV: str(self.key_files["teacher"])}
        commands = {}
        for rank, node in enumerate(self.trainers):
            commands[f"trainer-{rank}"] = (node.host, self.on_host(node.host, [
                *self.torchrun, "--nnodes", str(len(self.trainers)), "--node-rank", str(rank),
                "--nproc-per-node", str(node.nproc), "--master-addr", self.trainers[0].address,
                "--master-port", str(self.master_port), "-m", "fastdistill.cli", "train",
                "--config", str(self.train_config), *self.server_overrides(), *overrides], env=keys, torchrun=True))
        return commands

    def ensure_keys(self) -> None:
        """Generate the key files that do not exist yet (mode 0600)."""
        for path in self.key_files.values():
            path.parent.mkdir(parents=True, exist_ok=True)
            key_from_file_or_new(path)


def _keepalive(raw: dict[str, Any], exec_prefix: list[str]) -> float | None:
    """``keepalive_s`` of a raw config: default 30 s over ssh, none otherwise; ``null`` turns it off."""
    over_ssh = bool(exec_prefix) and os.path.basename(str(exec_prefix[0])) == "ssh"
    value = raw.get("keepalive_s", DEFAULT_KEEPALIVE_S if over_ssh else None)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"keepalive_s must be a number of seconds > 0 (or null: off), not {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------- processes


@dataclass
class Launched:
    """A started command: its name, host, process (its own process group) and log file; ``keepalive_s``: the
    launcher writes a byte to its stdin every ``keepalive_s / 6`` seconds, and closing that stdin asks it to stop
    (its host's ``fastdistill supervise`` watches it)."""

    name: str
    host: str
    process: subprocess.Popen
    log: Path
    keepalive_s: float | None = None
    via_ssh: bool = False  # its status 255 is ssh's own: the connection to its host failed or was lost

    def request_stop(self) -> None:
        """Ask the command to stop: with a keep-alive, close its stdin (its host's supervisor stops its group and
        ends with its status); without, SIGTERM the local process group."""
        if self.process.poll() is not None:
            return
        if self.keepalive_s is not None and self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        else:
            signal_group(self.process.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 20.0) -> int:
        """:meth:`request_stop`, wait up to ``grace_s`` seconds, SIGTERM the local process group (ssh: the
        connection closes, which the far side reads as a stop request too), wait ``grace_s`` more, SIGKILL it;
        returns the exit status."""
        return self.finish_stop(time.monotonic() + grace_s, grace_s, requested=False)

    def finish_stop(self, deadline: float, grace_s: float, *, requested: bool = True) -> int:
        """The rest of :meth:`stop` after :meth:`request_stop` (``requested``), waiting until ``deadline``."""
        if not requested:
            self.request_stop()
        for escalate in (True, False):
            try:
                self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                if escalate and self.keepalive_s is not None:
                    signal_group(self.process.pid, signal.SIGTERM)
                    deadline = time.monotonic() + grace_s
                elif escalate:
                    break
        signal_group(self.process.pid, signal.SIGKILL)
        return self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _keep_alive(process: subprocess.Popen, interval_s: float) -> None:
    """Write a byte to ``process``'s stdin every ``interval_s`` seconds until it exits or its stdin is closed."""
    while process.poll() is None:
        try:
            process.stdin.write(b"\n")
            process.stdin.flush()
        except (OSError, ValueError):  # the process went away, or stop() closed its stdin
            return
        time.sleep(interval_s)


def launch(name: str, host: str, command: list[str], logs: Path, *, keepalive_s: float | None = None,
           via_ssh: bool = False) -> Launched:
    """Start ``command`` in its own process group, its output to ``logs/<name>.log``. It gets SIGTERM when the
    thread that launched it ends, however the launcher ends (SIGKILL included; Linux): call from the main thread.
    ``keepalive_s``: its stdin is a pipe the launcher writes a byte to every ``keepalive_s / 6`` seconds (closed,
    however the launcher ends, when the launcher ends)."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL if keepalive_s is None else subprocess.PIPE,
                                   start_new_session=True, preexec_fn=death_signal_setter(signal.SIGTERM))
    if keepalive_s is not None:
        threading.Thread(target=_keep_alive, args=(process, keepalive_s / 6), name=f"keepalive-{name}",
                         daemon=True).start()
    return Launched(name, host, process, log, keepalive_s, via_ssh)


def start_servers(cluster: Cluster) -> dict[str, Launched]:
    """Generate missing keys and start every server (not waiting for them: the trainer does)."""
    cluster.ensure_keys()
    return {name: launch(name, host, command, cluster.logs, keepalive_s=cluster.keepalive_s,
                         via_ssh=cluster.over_ssh)
            for name, (host, command) in cluster.server_commands().items()}


def start_trainers(cluster: Cluster, overrides: Sequence[str] = (), *, tag: str = "") -> dict[str, Launched]:
    """Start every trainer node; ``tag`` suffixes the log names (``trainer-0<tag>.log``)."""
    return {name: launch(f"{name}{tag}", host, command, cluster.logs, keepalive_s=cluster.keepalive_s,
                         via_ssh=cluster.over_ssh)
            for name, (host, command) in cluster.trainer_commands(overrides).items()}


@dataclass
class Supervision:
    """How a run ended: each trainer node's exit status and, when something failed, the first process that did
    (``failed``: its name, ``failed_status``, ``failed_error``: the error line of its log; ``failed_server``:
    whether it was a server; ``failed_link``: its ssh connection failed or was lost)."""

    statuses: dict[str, int]
    failed: str | None = None
    failed_status: int = 0
    failed_error: str = ""
    failed_server: bool = False
    failed_link: bool = False

    @property
    def exit_code(self) -> int:
        """0 when every node succeeded; else what the first failure means (``docs/multinode.md``): a server's exit
        69 (whatever its status), a trainer host's lost ssh connection 75, a trainer node's own status (its first
        failing rank's: :func:`fastdistill.errors.exit_status`), 1 for a node ended by a signal."""
        if self.failed is None:
            return next((EXIT_OTHER for status in self.statuses.values() if status != 0), 0)
        if self.failed_server:
            return EXIT_UNAVAILABLE
        if self.failed_link:
            return EXIT_TEMPFAIL
        return self.failed_status if 0 < self.failed_status < 256 else EXIT_OTHER

    @property
    def meaning(self) -> str:
        """What :attr:`exit_code` says, in words."""
        if self.failed_server:
            return f"server {self.failed} exited: {EXIT_MEANINGS[EXIT_UNAVAILABLE]}"
        if self.failed_link:
            return f"the ssh connection to trainer node {self.failed}'s host failed: {EXIT_MEANINGS[EXIT_TEMPFAIL]}"
        return EXIT_MEANINGS.get(self.exit_code, "the node's own status")


def error_line(text: str) -> str:
    """The line of a log that says why its process failed: the last fastdistill error, else the last
    ``SomethingError: ...`` line (torchrun's own summary comes after the worker's error: it is skipped when the
    worker's is there)."""
    lines = text.splitlines()
    for pattern in (r"fastdistill\.errors\.\w+: ", r"\b[\w.]*(Error|Exception)\b: "):
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[-1].strip()[:500]
    return lines[-1].strip()[:500] if lines else ""


def supervise(trainers: dict[str, Launched], servers: dict[str, Launched], *, timeout_s: float | None = None,
              grace_s: float = 90.0, poll_s: float = 0.5) -> Supervision:
    """Wait until every trainer node has exited. A server that exits while nodes run stops them at once; a node
    that fails (non-zero) gives the others ``grace_s`` seconds to end by themselves (they notice the lost peer
    within the trainer's heartbeat bound and name it in their logs), then stops them. The first failure is
    reported on stderr (name, host, status, its error line) and in the result. Past ``timeout_s`` the remaining
    nodes are stopped and ``TimeoutError`` is raised."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    result = Supervision({})
    stop_at: float | None = None
    watched = dict(servers)

    def fail(launched: Launched, what: str) -> None:
        status = launched.process.returncode
        result.failed, result.failed_status = launched.name, status
        result.failed_server = what == "server"
        result.failed_link = launched.via_ssh and status == SSH_LOST
        result.failed_error = error_line(launched.log_tail(200))
        print(f"launch: {what} {launched.name} on {launched.host} exited early ({status}): {result.failed_error}\n"
              f"{launched.log_tail()}", file=sys.stderr)

    while any(t.process.poll() is None for t in trainers.values()):
        now = time.monotonic()
        for server in list(watched.values()):
            if server.process.poll() is not None:
                del watched[server.name]
                if result.failed is None:
                    fail(server, "server")
                    stop_at = now
        for trainer in trainers.values():
            if result.failed is None and trainer.process.poll() not in (None, 0):
                fail(trainer, "trainer node")
                stop_at = now + grace_s
        if stop_at is not None and now >= stop_at:
            running = [t.name for t in trainers.values() if t.process.poll() is None]
            print(f"launch: stopping {running} after {result.failed} failed", file=sys.stderr)
            stop_all(trainers)
            break
        if deadline is not None and now > deadline:
            running = [t.name for t in trainers.values() if t.process.poll() is None]
            stop_all(trainers)
            raise TimeoutError(f"trainer nodes {running} still running after {timeout_s:.0f} s: stopped")
        time.sleep(poll_s)
    result.statuses = {name: t.process.wait() for name, t in trainers.items()}
    if result.failed is None:  # every node ended before a failure was seen: the first non-zero one
        for trainer in trainers.values():
            if trainer.process.returncode != 0:
                fail(trainer, "trainer node")
                break
    return result


def wait_trainers(trainers: dict[str, Launched], servers: dict[str, Launched], *, timeout_s: float | None = None,
                  grace_s: float = 90.0, poll_s: float = 0.5) -> dict[str, int]:
    """:func:`supervise`'s exit status of each node."""
    return supervise(trainers, servers, timeout_s=timeout_s, grace_s=grace_s, poll_s=poll_s).statuses


def stop_all(*groups: dict[str, Launched], grace_s: float = 20.0) -> None:
    """Stop every launched process, group by group (trainers first, then servers): each group's processes are asked
    together and given ``grace_s`` seconds together (see :meth:`Launched.stop`)."""
    for group in groups:
        for launched in group.values():
            launched.request_stop()
        deadline = time.monotonic() + grace_s
        for launched in group.values():
            launched.finish_stop(deadline, grace_s)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: every launched process is stopped


def run(config: str | Path, overrides: Sequence[str] = ()) -> int:
    """Start the run ``config`` describes (``overrides``: ``fastdistill train`` field=value arguments), supervise it
    to the end, stop everything and return the exit status (0: every trainer node succeeded)."""
    cluster = Cluster.from_yaml(config)
    servers: dict[str, Launched] = {}
    trainers: dict[str, Launched] = {}
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)  # SIGINT raises KeyboardInterrupt already
    try:
        servers = start_servers(cluster)
        trainers = start_trainers(cluster, overrides)
        outcome = supervise(trainers, servers, grace_s=cluster.failure_grace_s)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop at a time: a second SIGTERM does not cut it short
        try:
            stop_all(trainers, servers, grace_s=cluster.stop_grace_s + 5)
        finally:
            signal.signal(signal.SIGTERM, previous)
    for name, status in outcome.statuses.items():
        print(f"launch: {name} exited with {status} (log {cluster.logs / (name + '.log')})", file=sys.stderr)
    if outcome.failed is not None:
        print(f"launch: failed: {outcome.failed} (exit {outcome.failed_status}): {outcome.failed_error}\n"
              f"launch: exit {outcome.exit_code}: {outcome.meaning}", file=sys.stderr)
    return outcome.exit_code
