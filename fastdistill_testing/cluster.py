"""A test cluster on one machine: N "hosts", each a Linux network namespace with its own interface and address on
a private bridge, so that trainer nodes, student and teacher servers talk across real interfaces (not loopback).

Layout of one cluster (``with NetnsCluster(["trainer0", "trainer1", "student"]) as cluster``):

- a *switch* namespace ``fdc-<pid>-<token>-sw`` holding the bridge ``br0``; nothing is added to the machine's own
  namespace (no interface, route or address), so concurrent clusters (other test runs) cannot collide even when
  they use the same subnet;
- per host a namespace ``fdc-<pid>-<token>-<index>`` with loopback up and ``eth0`` (one end of a veth pair, the other
  end ``h<index>`` a port of the bridge) holding the host's address (``10.77.0.<index + 1>/24`` by default).

:meth:`Host.partition` takes the host's bridge port down (its packets go nowhere, its address stays, the processes
inside see no error: a cut cable) and :meth:`Host.heal` brings it back. :meth:`NetnsCluster.close` kills every process
left in the cluster's namespaces and deletes them; it runs on ``with`` exit, at interpreter exit (``atexit``), and
namespaces of earlier runs whose creating process is gone (their names carry its pid) are deleted by
:func:`remove_stale_namespaces` when a new cluster starts. Only the cluster's own addresses are ever contacted.

Needs root and iproute2 (``ip netns``): :func:`netns_problem` says why not, :func:`require_netns` skips a test (or
fails it under ``FASTDISTILL_REQUIRE_NETNS=1``).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

T = TypeVar("T")
PREFIX = "fdc-"  # every namespace a cluster makes: fdc-<pid>-<token>-<host index or "sw">
DEFAULT_SUBNET = "10.77.0.0/24"
REQUIRE_ENV = "FASTDISTILL_REQUIRE_NETNS"
_TCP_LISTEN = "0A"  # /proc/net/tcp state of a listening socket


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_problem() -> str | None:
    """Why network-namespace clusters cannot be made here (not root, no ``ip``, ``ip netns add`` refused), or None."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2's `ip`"
    probe = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def require_netns() -> None:
    """In a pytest test or fixture: skip when :func:`netns_problem` finds one, or fail under
    ``FASTDISTILL_REQUIRE_NETNS=1`` (what ``make test`` sets, so CI runs these tests instead of skipping them)."""
    problem = netns_problem()
    if problem is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{problem} ({REQUIRE_ENV}=1)")
    pytest.skip(problem)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(namespace: str) -> list[int]:
    listed = _ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in listed.stdout.split()] if listed.returncode == 0 else []


def _delete_namespace(namespace: str) -> None:
    """SIGKILL what still runs in ``namespace`` (its processes were started by the cluster's user), then delete it."""
    for pid in _namespace_pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "delete", namespace, check=False)


def cluster_namespaces() -> list[str]:
    """Names of every namespace on this machine made by a cluster (``fdc-`` prefix), any owner."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def remove_stale_namespaces() -> list[str]:
    """Delete the cluster namespaces whose creating process (the pid in their name) no longer runs: what a killed
    earlier test run left. Namespaces of live processes (other engineers' runs) are left alone. Returns the names
    deleted."""
    removed = []
    for namespace in cluster_namespaces():
        owner = namespace[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _delete_namespace(namespace)
            removed.append(namespace)
    return removed


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: the address it is bound to (``0.0.0.0`` / ``::`` for every interface) and port."""

    address: str
    port: int

    @property
    def on_every_interface(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified


def _parse_proc_net_tcp(text: str, family: int) -> list[Listener]:
    listeners = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != _TCP_LISTEN:
            continue
        hex_address, hex_port = fields[1].split(":")
        raw = bytes.fromhex(hex_address)
        # the kernel prints the address as 32-bit words in host byte order (little-endian here)
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        listeners.append(Listener(socket.inet_ntop(family, raw), int(hex_port, 16)))
    return listeners


@dataclass
class Host:
    """One namespaced host of a :class:`NetnsCluster`: ``name`` (the test's), ``namespace``, ``address`` (on
    ``eth0``), and ``port_name``, its port on the bridge (in the switch namespace)."""

    name: str
    namespace: str
    address: str
    port_name: str
    switch: str
    interface: str = "eth0"
    partitioned: bool = field(default=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host: ``ip netns exec <namespace> argv...`` (what ``ssh host`` is elsewhere)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host and wait (``subprocess.run`` keywords)."""
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside this host (``subprocess.Popen`` keywords)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def partition(self) -> None:
        """Cut this host off: its bridge port goes down, so nothing it sends or is sent arrives (no error, no reset:
        connections just stop; new ones time out or find no route once the neighbours forget its address)."""
        _ip("-n", self.switch, "link", "set", "dev", self.port_name, "down")
        self.partitioned = True

    def heal(self) -> None:
        """Undo :meth:`partition`."""
        _ip("-n", self.switch, "link", "set", "dev", self.port_name, "up")
        self.partitioned = False

    def listeners(self) -> list[Listener]:
        """Every listening TCP socket (IPv4 and IPv6) of this host's network namespace, from ``/proc/net/tcp[6]``
        read inside it."""
        found = []
        for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
            read = self.run(["cat", path], capture_output=True, text=True, check=False)
            if read.returncode == 0:
                found += _parse_proc_net_tcp(read.stdout, family)
        return found

    def pids(self) -> list[int]:
        """Processes running inside this host's namespace."""
        return _namespace_pids(self.namespace)


class NetnsCluster:
    """N namespaced hosts on one private bridge (see the module docstring). ``hosts``: their names, in address
    order (host ``i`` gets the ``i + 1``-th address of ``subnet``). Use as a context manager; :meth:`close` is also
    registered with ``atexit``."""

    def __init__(self, hosts: Sequence[str], *, subnet: str = DEFAULT_SUBNET):
        network = ipaddress.ip_network(subnet)
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"host names must be distinct and at least one, got {list(hosts)}")
        if len(hosts) > network.num_addresses - 2:
            raise ValueError(f"{len(hosts)} hosts do not fit in {subnet}")
        self.subnet = network
        self.token = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.token}-sw"
        addresses = list(network.hosts())
        self.hosts = {name: Host(name, f"{self.token}-{index}", str(addresses[index]), f"h{index}", self.switch)
                      for index, name in enumerate(hosts)}
        self._made: list[str] = []
        self._closed = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> NetnsCluster:
        """Delete stale namespaces of dead runs, then make the switch and the hosts (on failure: undo and raise)."""
        remove_stale_namespaces()
        atexit.register(self.close)
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "dev", "br0", "up")
            for host in self.hosts.values():
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("-n", namespace, "link", "set", "dev", "lo", "up")

    def _add_host(self, host: Host) -> None:
        self._add_namespace(host.namespace)
        _ip("-n", host.namespace, "link", "add", host.interface, "type", "veth", "peer", "name", host.port_name,
            "netns", self.switch)
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.interface)
        _ip("-n", host.namespace, "link", "set", "dev", host.interface, "up")
        _ip("-n", self.switch, "link", "set", "dev", host.port_name, "master", "br0")
        _ip("-n", self.switch, "link", "set", "dev", host.port_name, "up")

    def close(self) -> None:
        """Kill every process left in the cluster's namespaces and delete them; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        for namespace in reversed(self._made):
            _delete_namespace(namespace)
        atexit.unregister(self.close)

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def wait_for(condition: Callable[[], T], *, timeout_s: float, poll_s: float = 0.2, what: str = "condition") -> T:
    """Poll ``condition()`` until it returns something truthy (returned) or ``timeout_s`` seconds pass
    (``TimeoutError`` naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(poll_s)
