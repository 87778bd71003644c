"""Stand-ins for the network in tests: an HTTP stub server around one handler, and this machine's addresses."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from fastdistill.serve import free_port
from fastdistill.sync.network import interface_addresses


def serve_and_call(handler: Callable[[Any], Awaitable[Any]], client_call: Callable[[str], Awaitable[Any]]) -> Any:
    """Serve every path and method with the aiohttp ``handler`` on 127.0.0.1:<free port>, run ``client_call(url)``
    against it, stop the server. Returns what the call returned, or the exception it raised."""
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


@contextlib.contextmanager
def serving(handler: Callable[[Any], Awaitable[Any]], host: str = "127.0.0.1") -> Iterator[str]:
    """Serve every path and method with the aiohttp ``handler`` on ``host``:<free port> from a background thread's
    event loop (so blocking clients can call it from this thread); yields the base URL, stops the server on exit."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    port = free_port(host)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()

    thread = threading.Thread(target=loop.run_forever, name="stub-server", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()


def interface_ipv4_addresses() -> list[str]:
    """IPv4 addresses of this machine's interfaces, read from the kernel's interface table (independently of
    routing), loopback included."""
    return [address for _, address in interface_addresses()]
