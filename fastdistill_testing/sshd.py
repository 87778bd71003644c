"""A real OpenSSH server on a namespaced test host (:mod:`fastdistill_testing.cluster`), for the launcher's ssh
tests, set up without touching anyone's ``~/.ssh``: a client key, ``authorized_keys``, the host key and
``known_hosts``, and an ``sshd_config`` of its own, all in a folder the test owns; ``sshd -D`` runs inside the host's
namespace on the host's address, and :meth:`SSHD.client` is the ``ssh`` prefix that reaches it with that key only.

Needs ``/usr/sbin/sshd`` (Debian's ``openssh-server``; ``.ci/run`` installs it), ``ssh`` and ``ssh-keygen``:
:func:`sshd_problem` says what is missing, :func:`require_sshd` skips (or fails under
``FASTDISTILL_REQUIRE_NETNS=1``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastdistill_testing.cluster import REQUIRE_ENV, Host, Listener, wait_for

SSHD_PATH = "/usr/sbin/sshd"
PRIVILEGE_SEPARATION_DIR = "/run/sshd"  # compiled into Debian's sshd; the package's service creates it at boot


def sshd_problem() -> str | None:
    """What is missing to run an OpenSSH server and client here, or None."""
    missing = [name for name, path in (("sshd", SSHD_PATH if os.access(SSHD_PATH, os.X_OK) else None),
                                       ("ssh", shutil.which("ssh")), ("ssh-keygen", shutil.which("ssh-keygen")))
               if path is None]
    return f"the ssh tests need OpenSSH ({', '.join(missing)} missing: apt-get install openssh-server)" \
        if missing else None


def require_sshd() -> None:
    """Skip when :func:`sshd_problem` finds one, or fail under ``FASTDISTILL_REQUIRE_NETNS=1`` (``make test``)."""
    problem = sshd_problem()
    if problem is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{problem} ({REQUIRE_ENV}=1)")
    pytest.skip(problem)


@dataclass
class ClientKey:
    """A key pair of the test's and the files an ssh client and server need for it."""

    folder: Path

    @property
    def private(self) -> Path:
        return self.folder / "client_key"

    @property
    def authorized_keys(self) -> Path:
        return self.folder / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        return self.folder / "known_hosts"

    @classmethod
    def make(cls, folder: Path) -> ClientKey:
        folder.mkdir(parents=True, exist_ok=True)
        key = cls(folder)
        _keygen(key.private)
        shutil.copyfile(key.private.with_suffix(".pub"), key.authorized_keys)
        key.authorized_keys.chmod(0o600)
        key.known_hosts.touch()
        return key

    def client(self, port: int, *, options: Sequence[str] = ()) -> list[str]:
        """The ``ssh`` prefix (up to the host, ``{host}``) that uses this key and these known hosts only: no
        ``~/.ssh/config``, no agent, no other identity, no password prompt."""
        return ["ssh", "-F", "/dev/null", "-i", str(self.private), "-o", "IdentitiesOnly=yes",
                "-o", "IdentityAgent=none", "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=30", "-o", "LogLevel=ERROR", "-p", str(port), *options, "{host}"]


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fastdistill-test", "-f", str(path)],
                   check=True, capture_output=True)


class SSHD:
    """``sshd -D`` inside ``host``'s namespace on ``host.address:port``, accepting ``key`` for the current user;
    its host key is added to ``key``'s known hosts. Use as a context manager (stops the server)."""

    def __init__(self, host: Host, key: ClientKey, folder: Path, *, port: int = 22):
        self.host, self.key, self.folder, self.port = host, key, folder, port
        self.process: subprocess.Popen | None = None

    def start(self) -> SSHD:
        self.folder.mkdir(parents=True, exist_ok=True)
        host_key = self.folder / "host_key"
        _keygen(host_key)
        config = self.folder / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", f"ListenAddress {self.host.address}", f"HostKey {host_key}",
            f"AuthorizedKeysFile {self.key.authorized_keys}", "PidFile none", "StrictModes no", "UsePAM no",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes", "UseDNS no", "X11Forwarding no", "AllowTcpForwarding no",
            "PrintMotd no", "MaxStartups 50", "LogLevel INFO", ""]))
        os.makedirs(PRIVILEGE_SEPARATION_DIR, mode=0o755, exist_ok=True)
        checked = subprocess.run([SSHD_PATH, "-t", "-f", str(config)], capture_output=True, text=True)
        if checked.returncode != 0:
            raise RuntimeError(f"sshd refused its test config: {checked.stderr.strip()}")
        entry = self.host.address if self.port == 22 else f"[{self.host.address}]:{self.port}"
        key_type, key_text = host_key.with_suffix(".pub").read_text().split()[:2]
        with open(self.key.known_hosts, "a") as known:
            known.write(f"{entry} {key_type} {key_text}\n")
        self.log = self.folder / "sshd.log"
        self.process = self.host.popen([SSHD_PATH, "-D", "-f", str(config), "-E", str(self.log)])
        wait_for(lambda: self.process.poll() is not None or Listener(self.host.address, self.port)
                 in self.host.listeners(), timeout_s=60, what=f"sshd on {self.host.address}:{self.port}")
        if self.process.poll() is not None:
            raise RuntimeError(f"sshd exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> SSHD:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``Z`` for a zombie), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def processes_with_variable(name: str, value: str) -> list[int]:
    """Running processes (zombies left out) whose environment holds ``name=value``: everything a command started
    with that variable runs, its children included, on any namespaced host (they share this machine's pids)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:
            continue
        if wanted in variables and process_state(int(entry.name)) not in (None, "Z"):
            found.append(int(entry.name))
    return found
