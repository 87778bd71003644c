"""Stand-ins for the network in tests: an HTTP stub server around one handler, and this machine's addresses."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from fastdistill.serve import free_port

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def serve_and_call(handler: Callable[[Any], Awaitable[Any]], client_call: Callable[[str], Awaitable[Any]]) -> Any:
    """Serve every path and method with the aiohttp ``handler`` on 127.0.0.1:<free port>, run ``client_call(url)``
    against it, stop the server. Returns what the call returned, or the exception it raised."""
    from aiohttp import web

    async def main() -> Any:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await client_call(f"http://127.0.0.1:{port}")
        except Exception as error:  # the tests assert on the exception
            return error
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def interface_ipv4_addresses() -> list[str]:
    """IPv4 addresses of this machine's interfaces, read from the kernel's interface table (independently of
    routing), loopback included."""
    addresses = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        addresses.append(socket.inet_ntoa(packed[20:24]))
    return addresses
