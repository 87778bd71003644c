"""The one HTTP layer of fastdistill: aiohttp for every call to a vLLM server (rollouts, health checks, weight sync,
evaluation, the launcher's start-up wait), a thin blocking wrapper for the callers that are not asynchronous, and the
one parser of a server's error body.

Proxies: every request goes straight to the server, whatever the proxy variables (``http_proxy``, ``https_proxy``,
``all_proxy``, upper- or lower-case) say, for loopback and every other address alike (aiohttp's ``trust_env`` is
off). Those variables are usually set for package downloads; a proxy between the trainer and its servers would make
loopback servers unreachable and would see every bearer key sent to them. A server that can only be reached through
a proxy needs a tunnel (e.g. ``ssh -L``) instead.

The retry and replica logic of rollouts lives in :mod:`fastdistill.rollout.http`, on top of this module; the weight
sync's routes and hints in :mod:`fastdistill.sync.http`. This module imports neither ``torch`` nor anything of
fastdistill but :mod:`fastdistill.auth` (the rollout worker's child imports it). It is not named ``http``: a script run
from inside the package folder would then shadow the standard library's ``http``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp

from fastdistill.auth import bearer_headers

_T = TypeVar("_T")

# Bodies larger than this are decoded in a worker thread so that a big answer (prompt_logprobs of a long sequence)
# does not stall the event loop, and the other requests in flight, while it parses.
DECODE_IN_THREAD_BYTES = 1 << 20
# Exceptions that mean "no answer" (the server is down, restarting, or too slow): worth retrying.
NO_ANSWER_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
)
_MESSAGE_LIMIT = 2000  # characters of a server's message kept in an error


class HTTPFailure(Exception):
    """One failed request: ``status`` is None when there was no answer; ``message`` is the server's own words (or
    what went wrong on the way)."""

    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def server_message(body: bytes | str) -> str:
    """The human-readable message of an error body, at most 2000 characters.

    Understands vLLM/OpenAI's ``{"error": {"message": ...}}``, FastAPI's ``{"detail": ...}`` (a string or a list of
    validation errors), ``{"error": "..."}`` and ``{"message": ...}``; any other body is returned as its text."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    text = text.strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:_MESSAGE_LIMIT]
    if isinstance(payload, dict):
        for key in ("error", "detail", "message"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return (value if isinstance(value, str) else json.dumps(value))[:_MESSAGE_LIMIT]
    return text[:_MESSAGE_LIMIT]


def unauthorized_hint(sent_key: bool, how_to_give: str) -> str:
    """What to fix after an HTTP 401: the key sent differs from the server's, or none was sent (then
    ``how_to_give`` says where the caller takes its key from). Never names the key."""
    if sent_key:
        return "the server refused the API key sent: the client's key differs from the server's"
    return f"the server requires an API key: {how_to_give}"


def new_session(*, connection_limit: int = 100, keep_alive: bool = True) -> aiohttp.ClientSession:
    """An aiohttp session that never uses a proxy (``trust_env=False``, see the module's note) and keeps at most
    ``connection_limit`` connections open (``keep_alive=False``: none is reused, each request opens its own). Every
    session fastdistill opens comes from here."""
    connector = aiohttp.TCPConnector(limit=connection_limit, force_close=not keep_alive)
    return aiohttp.ClientSession(connector=connector, trust_env=False)


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    payload: Any = None,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request with ``payload`` as its JSON body (None: no body); returns the status and the whole body.

    ``timeout_s`` bounds connect + send + the full answer, in seconds. Raises one of :data:`NO_ANSWER_ERRORS` when no
    answer came."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.request(method, url, json=payload, timeout=timeout, headers=headers) as response:
        return response.status, await response.read()


async def decode_off_loop(size: int, decode: Callable[..., _T], *args: Any) -> _T:
    """``decode(*args)`` for an answer of ``size`` bytes: in a worker thread above :data:`DECODE_IN_THREAD_BYTES`
    (the event loop keeps serving the other requests in flight), else at once."""
    if size > DECODE_IN_THREAD_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, decode, *args)
    return decode(*args)


async def decode_json(url: str, body: bytes) -> Any:
    """``body`` decoded as JSON (:func:`decode_off_loop`); ``ValueError`` naming ``url`` when it is not JSON."""
    try:
        return await decode_off_loop(len(body), json.loads, body)
    except ValueError as error:
        raise ValueError(f"{url} answered with a body that is not JSON: {body[:200]!r}") from error


def _lenient(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


async def request_json(
    method: str,
    url: str,
    payload: Any = None,
    *,
    timeout_s: float,
    api_key: str | None = None,
    session: aiohttp.ClientSession | None = None,
) -> Any:
    """One JSON request without retries: the decoded answer (None for an empty body, the text for a body that is not
    JSON), or :class:`HTTPFailure` (an HTTP status >= 400 with the server's message, or no answer). ``api_key`` goes
    as a bearer token and never into a message. ``session`` (default: a new one for this call) carries it."""
    if session is None:
        async with new_session() as own:
            return await request_json(method, url, payload, timeout_s=timeout_s, api_key=api_key, session=own)
    try:
        status, body = await send(session, method, url, payload=payload, timeout_s=timeout_s,
                                  headers=bearer_headers(api_key))
    except NO_ANSWER_ERRORS as error:
        raise HTTPFailure(None, f"no answer ({type(error).__name__}: {error})") from None
    except aiohttp.ClientError as error:  # e.g. an invalid URL
        raise HTTPFailure(None, f"request not sent ({type(error).__name__}: {error})") from None
    if status >= 400:
        raise HTTPFailure(status, server_message(body))
    return _lenient(body)


async def health_problem(
    session: aiohttp.ClientSession, base_url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None
) -> str | None:
    """None when ``GET base_url/health`` answers 200 within ``timeout_s`` seconds, else what it did instead
    (``"HTTP 503"``, ``"no answer (...)"``)."""
    try:
        status, _ = await send(session, "GET", base_url + "/health", timeout_s=timeout_s, headers=headers)
    except (NO_ANSWER_ERRORS + (aiohttp.ClientError,)) as error:
        return f"no answer ({type(error).__name__}: {error})"
    return None if status == 200 else f"HTTP {status}"


def run_blocking(make_coroutine: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run the coroutine ``make_coroutine()`` to completion and return its result, from any thread: in a new event
    loop, or, when this thread already runs one (a blocking call from async code), in a helper thread's loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coroutine())
    with ThreadPoolExecutor(1, thread_name_prefix="fastdistill-http") as helper:
        return helper.submit(lambda: asyncio.run(make_coroutine())).result()


def request_json_blocking(
    method: str, url: str, payload: Any = None, *, timeout_s: float, api_key: str | None = None
) -> Any:
    """:func:`request_json` for callers that are not asynchronous (weight sync, its checks): same answer, same
    :class:`HTTPFailure`."""
    return run_blocking(lambda: request_json(method, url, payload, timeout_s=timeout_s, api_key=api_key))


async def poll_until_healthy(
    base_url: str,
    *,
    alive: Callable[[], bool],
    timeout_s: float,
    poll_s: float = 0.5,
    headers: Mapping[str, str] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> str:
    """Poll ``base_url/health`` every ``poll_s`` seconds until it answers 200 (returns ``"healthy"``), ``alive()``
    turns False (``"exited"``: e.g. the server process died during start-up) or ``timeout_s`` seconds pass
    (``"timeout"``)."""
    deadline = time.monotonic() + timeout_s
    async with new_session(connection_limit=1) as session:
        while time.monotonic() < deadline:
            if not alive():
                return "exited"
            remaining = max(0.1, deadline - time.monotonic())
            if await health_problem(session, base_url, timeout_s=min(5.0, remaining), headers=headers) is None:
                return "healthy"
            await sleep(poll_s)
    return "timeout"
