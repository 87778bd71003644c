"""Addresses for the weight-sync rendezvous: is a host loopback, and which local address reaches a server."""

from __future__ import annotations

import ipaddress
import socket
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
