"""The rollouts' retry and replica logic on top of :mod:`fastdistill.http_client` (which sends the requests, never
through a proxy, and parses error bodies): retries for transient failures only, and failover between replicas.

Transient: connection errors, timeouts, HTTP 429 and 5xx. Those are retried with capped exponential backoff and
jitter. Any other 4xx fails at once with the server's own message; a body that is not the expected JSON fails at
once too (retrying would not change it). A socket this machine could not open (out of file descriptors, buffers,
memory or local ports: :data:`LOCAL_ERRNOS`) is retried after the backoff too, but never held against the replica.
"""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from fastdistill.errors import VLLMRequestError, VLLMResponseError, VLLMUnavailableError
from fastdistill.http_client import (
    NO_ANSWER_ERRORS,
    decode_json,
    decode_off_loop,
    new_session,
    send,
    server_message,
    unauthorized_hint,
)
from fastdistill.rollout.replicas import Replica, ReplicaPool

# errno values of a failure on this side of the connection: the server was never reached
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


def is_local_error(error: BaseException) -> bool:
    """Whether ``error`` (e.g. aiohttp's ``ClientConnectorError`` around ``OSError(EMFILE)``) says this process could
    not open or use a socket, rather than that the server did not answer."""
    return isinstance(error, OSError) and error.errno in LOCAL_ERRNOS


class _TransientHTTPStatus(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one request.

    ``max_attempts`` counts the first try. Before retry ``a`` (0-based) the client sleeps
    ``min(max_backoff_s, initial_backoff_s * 2**a)`` seconds scaled by a random factor in [0.5, 1).
    ``request_timeout_s`` bounds each attempt (connect + send + full response), in seconds.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 16.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    def backoff_s(self, retry_index: int) -> float:
        """Seconds to sleep before retry number ``retry_index`` (0-based)."""
        capped = min(self.max_backoff_s, self.initial_backoff_s * 2.0**retry_index)
        return capped * random.uniform(0.5, 1.0)


GIVE_CLIENT_KEY = (
    "give the client api_key= (training config: vllm_server_api_key and teacher_api_keys, or the environment "
    "variables FASTDISTILL_STUDENT_API_KEY and FASTDISTILL_TEACHER_API_KEY[_<ID>], or their _FILE forms naming a key "
    "file). A key that `fastdistill serve-*` generated is in ~/.cache/fastdistill/keys/<role>.key (its log names the "
    "file), which the training config reads by default"
)


def _is_dropped_pooled_connection(error: BaseException) -> bool:
    """The server closed or reset an established connection before answering (not a failed connect): what a
    keep-alive server does to connections it believes idle when its timer fires, even with a request already
    waiting on them. vLLM's server (uvicorn on uvloop, 5 s keep-alive) does it to every pooled connection after a
    stall longer than that (CPU contention, a GC or swap pause), though it is healthy again."""
    if isinstance(error, aiohttp.ClientConnectorError):
        return False
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(error, aiohttp.ClientOSError) and error.errno in (errno.ECONNRESET, errno.EPIPE)


def _is_transient_status(status: int) -> bool:
    return status == 429 or status >= 500


async def _decode_json(url: str, body: bytes, decode: Callable[[str, bytes], Any] | None = None) -> Any:
    """The body as JSON, or as ``decode(url, body)`` makes it (in a worker thread when it is large:
    :func:`~fastdistill.http_client.decode_off_loop`)."""
    if decode is not None:
        return await decode_off_loop(len(body), decode, url, body)
    try:
        return await decode_json(url, body)
    except ValueError as error:
        raise VLLMResponseError(str(error)) from error


@dataclass
class RequestStats:
    """Counters the HTTP layer adds to: ``retries`` (attempts after the first, any server) and ``failovers``
    (retries sent to another replica than the one that just failed). The owner reads and resets them."""

    retries: int = 0
    failovers: int = 0


async def request_json_pooled(
    session: aiohttp.ClientSession,
    method: str,
    pool: ReplicaPool,
    path: str,
    *,
    payload: dict[str, Any] | None = None,
    retry: RetryPolicy,
    rejection_hint: Callable[[int, str], str | None] | None = None,
    stats: RequestStats | None = None,
    headers: Mapping[str, str] | None = None,
    decode: Callable[[str, bytes], Any] | None = None,
) -> Any:
    """Send one request to ``replica.url + path`` for a replica of ``pool`` and return the decoded JSON body (or
    ``decode(url, body)`` of a 2xx body), retrying transient failures as ``retry`` says; ``headers`` (e.g. the API
    key's) go with every attempt.

    ``rejection_hint(status, server_message)`` may return an extra line for the :class:`VLLMRequestError` raised on a
    non-transient 4xx (e.g. which server flag to change); a 401 without one says how to give the key.

    A transient failure puts that replica down for a cooldown; when another replica is up the retry goes there at
    once (a failover, no backoff), otherwise after the usual backoff. The first time a replica closes or resets the
    (pooled) connection before answering, the request is resent to it at once on a new connection instead, without
    counting a failure (a retry, not a failover): keep-alive servers drop connections they believe idle after a
    stall, with requests waiting on them. A request that finds every replica down waits
    for the first cooldown to end before its first attempt. ``retry.max_attempts`` bounds the attempts; that resend
    comes on top.
    """
    last_error: BaseException | None = None
    failed: Replica | None = None
    backoffs = 0
    resend: Replica | None = None  # a replica that dropped the pooled connection: resent there at once, once
    resent = False
    attempt = -1
    while (attempt := attempt + 1) < retry.max_attempts + resent:  # the one resend comes on top of the attempts
        if attempt > 0 and stats is not None:
            stats.retries += 1
        fresh = resend is not None
        if resend is not None:
            replica, resend = resend, None
            replica.inflight += 1  # what acquire counts; released below like any attempt
        else:
            if attempt > 0:
                failover = failed is not None and pool.has_other_up(failed)
                if stats is not None:
                    stats.failovers += int(failover)
                if not failover:
                    await asyncio.sleep(retry.backoff_s(backoffs))
                    backoffs += 1
            replica = pool.acquire(avoid=failed)
        wait_s = replica.down_until - time.monotonic()
        if attempt == 0 and wait_s > 0:
            # Every replica is cooling down after failures: wait for the probe time instead of hammering a
            # server that is known to be down (a restarting vLLM server would also be slowed by it).
            await asyncio.sleep(wait_s)
        url = replica.url + path
        sent_at = time.monotonic()
        try:
            if fresh:  # the session's other pooled connections to this replica may have been dropped too
                async with new_session(connection_limit=1, keep_alive=False) as once:
                    status, body = await send(once, method, url, payload=payload, timeout_s=retry.request_timeout_s,
                                              headers=headers)
            else:
                status, body = await send(session, method, url, payload=payload, timeout_s=retry.request_timeout_s,
                                          headers=headers)
            if status < 400:
                pool.record_success(replica)
                return await _decode_json(url, body, decode)
            if _is_transient_status(status):
                raise _TransientHTTPStatus(status, body.decode("utf-8", errors="replace"))
            pool.record_success(replica)  # the server is up; it rejected this request
            message = server_message(body)
            hint = rejection_hint(status, message) if rejection_hint else None
            if hint is None and status == 401:
                clause = unauthorized_hint(bool(headers and "Authorization" in headers), GIVE_CLIENT_KEY)
                hint = f"{clause[0].upper()}{clause[1:]}."  # a line of its own, like the other rejection hints
            raise VLLMRequestError(url, status, message, hint)
        except (*NO_ANSWER_ERRORS, _TransientHTTPStatus) as error:
            last_error = error
            if is_local_error(error):  # this machine's limit, not the replica's: retried after the backoff
                failed = None
                continue
            if not resent and _is_dropped_pooled_connection(error):
                resent, resend = True, replica  # on a new connection: not the replica's failure
                continue
            failed = replica
            pool.record_failure(replica, error, sent_at)
        finally:
            pool.release(replica)
    where = pool.urls[0] + path if len(pool.urls) == 1 else f"{path} on replicas {list(pool.urls)}"
    local = (" (on this machine, not the server: it ran out of sockets, file descriptors or memory; raise `ulimit -n` "
             "or lower max_inflight_tasks)") if last_error is not None and is_local_error(last_error) else ""
    raise VLLMUnavailableError(
        f"{method} {where} failed {attempt} times with transient errors; last: {last_error!r}{local}"
    ) from last_error
