"""Addresses for the weight-sync rendezvous: is a host loopback, and which local address reaches a server."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an IP literal, IPv6 with or without brackets) means this machine only: a loopback
    address, ``localhost``, or a name that resolves to loopback addresses alone. ``0.0.0.0``, ``::`` and names that
    do not resolve are not loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def local_address_towards(host: str, port: int = 9) -> str:
    """The address of this machine's interface that the routing table uses to reach ``host`` (the kernel picks it
    when a UDP socket connects; no packet is sent). Raises ``OSError`` when ``host`` does not resolve or has no
    route."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def rendezvous_address(server_url: str) -> str:
    """Where a server at ``server_url`` can reach this trainer: ``127.0.0.1`` for a loopback server, else the local
    address that routes to it. Raises ``OSError`` like :func:`local_address_towards`."""
    parts = urlsplit(server_url)
    host = parts.hostname or ""
    if not host:
        raise OSError(f"no host in server URL {server_url!r}")
    if is_loopback_host(host):
        return LOOPBACK
    return local_address_towards(host, parts.port or (443 if parts.scheme == "https" else 80))


_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interface_addresses() -> list[tuple[str, str]]:
    """``(interface name, IPv4 address)`` of each of this machine's interfaces that has one, loopback included, read
    from the kernel's interface table (independently of routing); empty where that table cannot be read."""
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        found.append((name, socket.inet_ntoa(packed[20:24])))
    return found


def interface_with_address(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 ``address`` (from the kernel's interface
    table), or None (no such interface, an IPv6 address, or not Linux)."""
    return next((name for name, held in interface_addresses() if held == address), None)


def interface_towards(host: str) -> str | None:
    """The interface whose address the routing table uses to reach ``host`` (see :func:`local_address_towards`),
    or None when ``host`` is loopback, does not resolve, has no route or the interface is not found."""
    if is_loopback_host(host):
        return None
    try:
        return interface_with_address(local_address_towards(host))
    except OSError:
        return None
