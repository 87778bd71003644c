"""``fastdistill launch`` over a real ssh: every remote process ends when the launcher stops it, when the launcher is
killed (SIGKILL) and when a host's link is cut, with nothing left on any host.

Three namespaced hosts (fastdistill_testing.cluster): the launcher's, and two remote hosts each running Debian's
OpenSSH server (fastdistill_testing.sshd: a key, ``authorized_keys``, host keys and ``sshd_config`` made by the test;
nothing of ``~/.ssh`` is read). The launcher runs ``fastdistill launch`` with the default kind of exec prefix
(``ssh ... HOST``, one shell string, the keep-alive on): the student and a teacher on host 1, trainer node 0 on host 2,
trainer node 1 on host 1. The remote commands run under the real ``fastdistill supervise``; the servers and trainer
nodes are stand-ins that start a child (as vLLM and torchrun do) and run until stopped. Every process a remote
command starts carries a marker variable in its environment, so "nothing left" is read from ``/proc`` (the hosts
share this machine's process table). The bounds waited for are hang guards, not timings; the times measured are
printed (``-s``).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fastdistill_testing import sshd as sshd_module
from fastdistill_testing.cluster import NetnsCluster, require_netns, wait_for
from fastdistill_testing.sshd import (
    SSHD,
    ClientKey,
    command_name,
    process_state,
    processes_with_variable,
    require_sshd,
)

KEEPALIVE_S = 10.0  # the remote side stops its command 10 s after the launcher goes silent (ssh probes 3 s apart)
STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL on the remote side
MARKER = "FASTDISTILL_SSH_TEST_MARKER"
# `fastdistill` on the remote hosts: the real `fastdistill supervise`; a server: a child (its engine core), then wait
FAKE_FASTDISTILL = """
import os, subprocess, sys, time
from pathlib import Path
if sys.argv[1:2] == ["supervise"]:
    from fastdistill.cli import main
    sys.exit(main(sys.argv[1:]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path(os.environ["FASTDISTILL_SSH_TEST_READY"], f"{sys.argv[1]}-{os.getpid()}").write_text(str(child.pid))
time.sleep(600)
"""
# `torchrun` on the remote hosts: a child (its rank), then wait
FAKE_TORCHRUN = """
import os, subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
node = sys.argv[sys.argv.index("--node-rank") + 1]
Path(os.environ["FASTDISTILL_SSH_TEST_READY"], f"trainer-{node}-{os.getpid()}").write_text(str(child.pid))
time.sleep(600)
"""
REMOTE_COMMANDS = 4  # student, teacher, two trainer nodes
SSH_SERVER = ("sshd", "sshd-session", "sshd-auth")  # the server's processes (OpenSSH 9.8+ splits the session out)


@dataclass
class Run:
    cluster: NetnsCluster
    launcher: subprocess.Popen
    token: str
    log: Path

    def marked(self) -> list[int]:
        return processes_with_variable(MARKER, self.token)

    def leftovers(self) -> dict[str, list[str]]:
        """Processes still running on each host, the ssh servers' own left out (the listener, and a session whose
        connection was cut: sshd keeps it until its TCP gives up; it holds nothing of the run)."""
        found = {}
        for name, host in self.cluster.hosts.items():
            names = [f"{pid}:{command_name(pid)}" for pid in host.pids() if command_name(pid) not in SSH_SERVER]
            if names:
                found[name] = names
        return found

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def test_require_sshd_fails_instead_of_skipping_when_required(monkeypatch):
    """``make test`` (FASTDISTILL_REQUIRE_NETNS=1) fails these tests on a machine without OpenSSH, not skips them."""
    monkeypatch.setattr(sshd_module, "sshd_problem", lambda: "no sshd here")
    monkeypatch.setenv("FASTDISTILL_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="no sshd here"):
        require_sshd()
    monkeypatch.delenv("FASTDISTILL_REQUIRE_NETNS")
    with pytest.raises(pytest.skip.Exception, match="no sshd here"):
        require_sshd()


SLEEPER = "import os, pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)"


def supervised_sleeper(tmp_path: Path, *, stderr) -> tuple[subprocess.Popen, int]:
    """``fastdistill supervise --keepalive-s 2`` around a sleeper, its stdin a pipe of the test's; returns the
    supervisor and the sleeper's pid once it runs."""
    pid_file = tmp_path / f"sleeper-{secrets.token_hex(4)}"
    supervisor = subprocess.Popen([sys.executable, "-m", "fastdistill.cli", "supervise", "--grace-s", "2",
                                   "--keepalive-s", "2", "--", sys.executable, "-c", SLEEPER, str(pid_file)],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr)
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), timeout_s=120, what="the sleeper's start")
    return supervisor, int(pid_file.read_text())


def test_the_supervisor_stops_its_command_when_stdin_ends_or_stays_silent_even_with_its_stderr_gone(tmp_path):
    """The keep-alive without ssh: stdin closed -> stopped; stdin open but silent for keepalive_s -> stopped; and
    so when its stderr is a closed pipe (an ssh session already gone: its message must not stop the stop)."""
    supervisor, sleeper = supervised_sleeper(tmp_path, stderr=subprocess.PIPE)
    supervisor.stdin.write(b"\n")  # a keep-alive byte: nothing happens
    supervisor.stdin.flush()
    supervisor.stderr.close()  # the channel its messages went to is gone
    supervisor.stdin.close()
    assert supervisor.wait(timeout=120) == 143  # 128 + SIGTERM: the command was stopped
    assert process_state(sleeper) in (None, "Z")

    supervisor, sleeper = supervised_sleeper(tmp_path, stderr=subprocess.PIPE)
    try:
        assert supervisor.wait(timeout=120) == 143  # nothing on stdin for 2 s (a hang guard only)
        assert "nothing on stdin for 2 s" in supervisor.stderr.read().decode()
        assert process_state(sleeper) in (None, "Z")
    finally:
        supervisor.stdin.close()


@pytest.fixture
def ssh_run(tmp_path):
    """Start ``fastdistill launch`` on the launcher host over ssh to the two remote hosts; yields a :class:`Run`
    once every remote command runs."""
    require_netns()
    require_sshd()
    with NetnsCluster(["launcher", "host1", "host2"]) as cluster:
        key = ClientKey.make(tmp_path / "ssh")
        servers = [SSHD(cluster[name], key, tmp_path / f"sshd-{name}").start() for name in ("host1", "host2")]
        try:
            yield start_launch(cluster, key, tmp_path)
        finally:
            for server in servers:
                server.stop()


def start_launch(cluster: NetnsCluster, key: ClientKey, root: Path) -> Run:
    host1, host2 = cluster["host1"].address, cluster["host2"].address
    token, ready = secrets.token_hex(8), root / "ready"
    ready.mkdir()
    (root / "fake_fastdistill.py").write_text(FAKE_FASTDISTILL)
    (root / "fake_torchrun.py").write_text(FAKE_TORCHRUN)
    config = {
        "exec": key.client(22),
        "student": {"host": host1, "address": host1, "port": 8000, "model": "student-model"},
        "teacher_model": "teacher-model", "teachers": {"default": [{"host": host1, "address": host1, "port": 8001}]},
        "trainers": [{"host": host2, "address": host2}, {"host": host1, "address": host1}],
        "key_files": {"student": str(root / "keys" / "student.key"), "teacher": str(root / "keys" / "teacher.key")},
        "train_config": str(root / "train.yaml"), "logs": str(root / "logs"),
        "fastdistill": [sys.executable, str(root / "fake_fastdistill.py")],
        "torchrun": [sys.executable, str(root / "fake_torchrun.py")],
        "env": {MARKER: token, "FASTDISTILL_SSH_TEST_READY": str(ready), "PYTHONUNBUFFERED": "1"},
        "keepalive_s": KEEPALIVE_S, "stop_grace_s": STOP_GRACE_S, "failure_grace_s": 3,
    }
    (root / "cluster.yaml").write_text(yaml.safe_dump(config))
    log = root / "launcher.log"
    env = {k: v for k, v in os.environ.items() if k not in (MARKER, "FASTDISTILL_SSH_TEST_READY")}
    with open(log, "wb") as out:
        launcher = cluster["launcher"].popen([sys.executable, "-m", "fastdistill.cli", "launch",
                                              str(root / "cluster.yaml")], stdout=out, stderr=subprocess.STDOUT,
                                             env=env)
    run = Run(cluster, launcher, token, log)

    def all_running() -> bool:
        if launcher.poll() is not None:
            raise AssertionError(f"the launcher exited ({launcher.returncode}):\n{run.output()}\n"
                                 + "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}"
                                             for p in sorted((root / "logs").glob("*.log"))))
        return len(list(ready.iterdir())) == REMOTE_COMMANDS

    wait_for(all_running, timeout_s=180, what="every remote command running")
    # each remote command: its supervisor, the command and its child, all with the marker
    assert len(run.marked()) >= 3 * REMOTE_COMMANDS, run.marked()
    return run


def wait_gone(run: Run, since: float, bound_s: float, what: str) -> float:
    """Wait (hang guard: ``bound_s`` plus a margin for a loaded machine) until no marked process runs anywhere;
    returns the seconds it took since ``since``."""
    wait_for(lambda: not run.marked(), timeout_s=bound_s + 60, poll_s=0.1, what=f"every remote process gone ({what})")
    elapsed = time.monotonic() - since
    print(f"{what}: every remote process gone {elapsed:.1f} s after the event (bound {bound_s:g} s)")
    return elapsed


@pytest.mark.netns
def test_a_stopped_launcher_stops_every_remote_process(ssh_run):
    """SIGTERM to the launcher: it closes each command's stdin, each host's supervisor stops its group (SIGTERM, then
    SIGKILL after stop_grace_s) and ends; the launcher exits 143 once every ssh session has ended: by then nothing
    is left anywhere."""
    start = time.monotonic()
    ssh_run.launcher.send_signal(signal.SIGTERM)
    assert ssh_run.launcher.wait(timeout=120) == 143, ssh_run.output()
    assert ssh_run.marked() == [], ssh_run.output()  # gone before the launcher returned
    print(f"clean stop: the launcher returned {time.monotonic() - start:.1f} s after SIGTERM")
    assert ssh_run.leftovers() == {}


@pytest.mark.netns
def test_a_killed_launcher_leaves_no_remote_process(ssh_run):
    """SIGKILL to the launcher: its ssh clients get SIGTERM from the kernel (their parent died) and their stdin
    closes; each remote supervisor reads the end of its stdin and stops its group."""
    start = time.monotonic()
    ssh_run.launcher.kill()
    ssh_run.launcher.wait(timeout=60)
    wait_gone(ssh_run, start, STOP_GRACE_S, "launcher SIGKILL")
    wait_for(lambda: not ssh_run.leftovers(), timeout_s=60, what="no process but sshd on any host")


@pytest.mark.netns
def test_a_cut_link_ends_the_cut_host_s_processes_and_the_launcher_names_it(ssh_run):
    """Host 2's link cut (its bridge port down: no error, no reset on either side): its supervisor hears nothing for
    keepalive_s and stops trainer node 0 (SIGTERM, SIGKILL after stop_grace_s); the launcher's ssh to it gives up
    after its ServerAlive probes (about keepalive_s), the launcher reports the lost trainer host (exit 75) and
    stops the rest."""
    host2 = ssh_run.cluster["host2"]

    def on_host2() -> list[int]:
        return sorted(set(ssh_run.marked()) & set(host2.pids()))

    assert on_host2(), "trainer node 0 runs on host 2"
    start = time.monotonic()
    host2.partition()
    wait_for(lambda: not on_host2(), timeout_s=KEEPALIVE_S + STOP_GRACE_S + 60, poll_s=0.1,
             what="host 2's processes gone")
    print(f"cut link: host 2's processes gone {time.monotonic() - start:.1f} s after the cut "
          f"(bound keepalive_s + stop_grace_s = {KEEPALIVE_S + STOP_GRACE_S:g} s)")
    status = ssh_run.launcher.wait(timeout=KEEPALIVE_S * 2 + 120)  # hang guard
    output = ssh_run.output()
    assert status == 75, output
    assert "the ssh connection to trainer node trainer-0's host failed" in output, output
    print(f"cut link: the launcher exited {time.monotonic() - start:.1f} s after the cut")
    assert ssh_run.marked() == [], output  # the other hosts' processes: stopped before the launcher returned
    assert ssh_run.leftovers() == {}
