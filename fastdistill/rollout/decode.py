"""Fast decoding of a vLLM teacher's ``prompt_logprobs`` answer into :class:`~fastdistill.rollout.TeacherScores`.

A scoring answer carries one entry per sequence token, prompt rows included, each ``{token_id_str: {"logprob",
"rank", "decoded_token"}}`` with K or K+1 candidates. Decoding it with ``json.loads`` and sorting every row in Python
can make the rollout worker's CPU, rather than the GPUs, set the pace (``benchmarks/bench_worker_ceiling.py``).
Two faster paths with the contract of :func:`~fastdistill.rollout.parse_prompt_logprobs`:

- :func:`scores_from_prompt_logprobs`: the already-decoded JSON (as the HTTP layer returns it); the rows are
  flattened once and sorted by numpy (rank, then token id, then log-prob: the order of the reference's tuples).
- :func:`scores_from_body`: the raw body bytes. msgspec skips the prompt rows without building Python objects for
  them (``msgspec.Raw``) and decodes the completion rows into typed structs (``decoded_token`` is never built).

Both are bit-identical to the reference: anything the fast path does not handle exactly as the reference would
(a body that is not strict JSON, such as a ``NaN`` literal; a value of another type; a token id beyond int32; two
keys naming one token id; a row with too many candidates; a wrong row count) is handed to the reference path, which
then produces the same result or raises the same :class:`~fastdistill.errors.VLLMResponseError`.

A teacher running fastdistill's scoring plugin answers in a compact form instead (:mod:`fastdistill.scoring_wire`:
one base64 float32 matrix per request with the top-K, the realised token and the log-probs at the request's query
ids, completion rows only); :func:`scores_from_compact_body` turns it into the same :class:`TeacherScores`, the
candidates ordered as stock ``prompt_logprobs`` order them, plus ``query_logprobs``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import msgspec
import numpy as np

from fastdistill.errors import VLLMResponseError
from fastdistill.scoring_wire import REPLY_FIELD, ScoredRows, unpack

__all__ = ["TeacherScores", "missing_plugin_message", "parse_prompt_logprobs", "scores_from_body",
           "scores_from_compact_body", "scores_from_prompt_logprobs"]


@dataclass(frozen=True)
class TeacherScores:
    """Teacher candidates per completion position, shape (L, K+1) each.

    Row i holds the candidates for predicting completion token i: the teacher's top-K sorted by rank, then the
    realised token when it is outside the top-K. Empty slots are id -1 with log-prob -inf.
    ``query_logprobs``: None, or float32 (L, S) the teacher's log-probs at the ids the request asked for
    (``TeacherClient.score(query_ids=...)``).
    """

    candidate_ids: np.ndarray
    logprobs: np.ndarray
    query_logprobs: np.ndarray | None = None


def first_choice(url: str, body: Any) -> dict[str, Any]:
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError) as error:
        raise VLLMResponseError(f"{url}: completion body without choices: {body!r:.300}") from error
    if not isinstance(choice, dict):
        raise VLLMResponseError(f"{url}: completion choice is not an object: {choice!r:.300}")
    return choice


def parse_prompt_logprobs(
    url: str, per_position: Any, prompt_length: int, completion_length: int, top_k: int
) -> TeacherScores:
    """Turn vLLM's ``choices[0].prompt_logprobs`` (one entry per sequence token: None or ``{token_id_str:
    {"logprob", "rank", ...}}``) into :class:`TeacherScores` (completion_length, top_k + 1) for the completion
    positions: candidates sorted by rank, NaN log-probs dropped, -1 / -inf padding. ``url`` names the server in
    the :class:`VLLMResponseError` raised on a malformed answer."""
    width = top_k + 1
    candidate_ids = np.full((completion_length, width), -1, dtype=np.int32)
    logprobs = np.full((completion_length, width), -np.inf, dtype=np.float32)
    if not isinstance(per_position, list) or len(per_position) != prompt_length + completion_length:
        raise VLLMResponseError(
            f"{url}: expected prompt_logprobs with {prompt_length + completion_length} entries, "
            f"got {per_position!r:.300}"
        )
    for row, entry in enumerate(per_position[prompt_length:]):
        if not entry:
            continue
        try:
            ranked = sorted(
                (int(candidate["rank"]), int(token), float(candidate["logprob"])) for token, candidate in entry.items()
            )
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise VLLMResponseError(f"{url}: malformed prompt_logprobs entry {entry!r:.300}") from error
        ranked = [item for item in ranked if not math.isnan(item[2])]
        if len(ranked) > width:
            raise VLLMResponseError(
                f"{url}: {len(ranked)} candidates at completion position {row}, expected at most {width}"
            )
        for slot, (_, token, logprob) in enumerate(ranked):
            candidate_ids[row, slot] = token
            logprobs[row, slot] = logprob
    return TeacherScores(candidate_ids, logprobs)

_INT32 = np.iinfo(np.int32)
_RANK_SPAN = 1 << 32  # ranks below this share one sort key with their row


class _Candidate(msgspec.Struct, gc=False):
    logprob: float
    rank: int


class _Choice(msgspec.Struct, gc=False):
    prompt_logprobs: list[msgspec.Raw] | None = None


class _Body(msgspec.Struct, gc=False):
    choices: list[_Choice]


_BODY_DECODER = msgspec.json.Decoder(_Body)
_ROWS_DECODER = msgspec.json.Decoder(list[dict[int, _Candidate] | None])


class _NotExact(Exception):
    """The fast path cannot promise the reference's result: decode this answer with the reference."""


def _scores_from_flat(counts: np.ndarray, tokens: np.ndarray, ranks: np.ndarray, logprobs: np.ndarray,
                      completion_length: int, top_k: int) -> TeacherScores:
    """TeacherScores from the candidates of every completion row flattened in row order: ``counts`` int64 (L,)
    candidates per row, ``tokens`` / ``ranks`` int64 and ``logprobs`` float64 (sum(counts),). Raises
    :class:`_NotExact` where the reference would raise or could order differently."""
    width = top_k + 1
    candidate_ids = np.full((completion_length, width), -1, dtype=np.int32)
    scores = np.full((completion_length, width), -np.inf, dtype=np.float32)
    if tokens.size == 0:
        return TeacherScores(candidate_ids, scores)
    if tokens.min() < _INT32.min or tokens.max() > _INT32.max:
        raise _NotExact  # the reference's int32 assignment raises OverflowError
    rows = np.repeat(np.arange(completion_length, dtype=np.int64), counts)
    tied = True
    if ranks.min() >= 0 and ranks.max() < _RANK_SPAN:
        # one int64 key (row, rank) sorts in one pass; only ties in rank need the reference's full key order
        order = np.argsort(rows * _RANK_SPAN + ranks, kind="stable")
        rows, tokens, ranks, logprobs = rows[order], tokens[order], ranks[order], logprobs[order]
        tied = bool(np.any((rows[1:] == rows[:-1]) & (ranks[1:] == ranks[:-1])))
    if tied:
        order = np.lexsort((logprobs, tokens, ranks, rows))
        rows, tokens, ranks, logprobs = rows[order], tokens[order], ranks[order], logprobs[order]
        if np.any((rows[1:] == rows[:-1]) & (ranks[1:] == ranks[:-1]) & (tokens[1:] == tokens[:-1])):
            raise _NotExact  # two keys of one row name one id ("5" and "05"): tuple order with NaN is not total
    kept = ~np.isnan(logprobs)
    rows, tokens, logprobs = rows[kept], tokens[kept], logprobs[kept]
    per_row = np.bincount(rows, minlength=completion_length)
    if per_row.max(initial=0) > width:
        raise _NotExact  # the reference names the row in its error
    starts = np.zeros(completion_length, dtype=np.int64)
    np.cumsum(per_row[:-1], out=starts[1:])
    slots = np.arange(rows.shape[0], dtype=np.int64) - starts[rows]
    candidate_ids[rows, slots] = tokens
    scores[rows, slots] = logprobs
    return TeacherScores(candidate_ids, scores)


def _flatten_decoded(rows: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(counts, tokens, ranks, logprobs) of json-decoded rows, converted as the reference converts them
    (``int(token)``, ``int(rank)``, ``float(logprob)``); any conversion error raises it."""
    present = [entry if entry else {} for entry in rows]
    counts = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
    total = int(counts.sum())
    candidates = list(chain.from_iterable(entry.values() for entry in present))
    tokens = np.fromiter(map(int, chain.from_iterable(present)), dtype=np.int64, count=total)
    ranks = np.fromiter(map(int, map(itemgetter("rank"), candidates)), dtype=np.int64, count=total)
    logprobs = np.fromiter(map(float, map(itemgetter("logprob"), candidates)), dtype=np.float64, count=total)
    return counts, tokens, ranks, logprobs


def scores_from_prompt_logprobs(url: str, per_position: Any, prompt_length: int, completion_length: int,
                                top_k: int) -> TeacherScores:
    """:func:`~fastdistill.rollout.parse_prompt_logprobs` (same arguments, result and errors), faster: vLLM's
    decoded ``choices[0].prompt_logprobs`` (prompt_length + completion_length entries) to :class:`TeacherScores`
    (completion_length, top_k + 1)."""
    if isinstance(per_position, list) and len(per_position) == prompt_length + completion_length:
        try:
            flat = _flatten_decoded(per_position[prompt_length:])
            return _scores_from_flat(*flat, completion_length, top_k)
        except (_NotExact, AttributeError, KeyError, TypeError, ValueError, OverflowError):
            pass
    return parse_prompt_logprobs(url, per_position, prompt_length, completion_length, top_k)


def _fast_body_scores(body: bytes, prompt_length: int, completion_length: int, top_k: int) -> TeacherScores:
    choices = _BODY_DECODER.decode(body).choices
    if not choices or choices[0].prompt_logprobs is None:
        raise _NotExact
    raw_rows = choices[0].prompt_logprobs
    if len(raw_rows) != prompt_length + completion_length:
        raise _NotExact
    segment = b"[" + b",".join(raw_rows[prompt_length:]) + b"]"
    if b'"-0"' in segment:
        raise _NotExact  # "-0" and "0" are one int key for msgspec, two candidates for the reference
    rows = _ROWS_DECODER.decode(segment)
    present = [entry if entry else {} for entry in rows]
    counts = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
    total = int(counts.sum())
    candidates = list(chain.from_iterable(entry.values() for entry in present))
    tokens = np.fromiter(chain.from_iterable(present), dtype=np.int64, count=total)
    ranks = np.fromiter(map(attrgetter("rank"), candidates), dtype=np.int64, count=total)
    logprobs = np.fromiter(map(attrgetter("logprob"), candidates), dtype=np.float64, count=total)
    return _scores_from_flat(counts, tokens, ranks, logprobs, completion_length, top_k)


def scores_from_body(url: str, body: bytes, prompt_length: int, completion_length: int,
                     top_k: int) -> TeacherScores:
    """The raw body of a teacher's ``/v1/completions`` answer (``prompt_logprobs=top_k``, prompt_length +
    completion_length sequence tokens) to :class:`TeacherScores` (completion_length, top_k + 1): the result and the
    errors of ``json.loads`` + the client's first-choice check + :func:`~fastdistill.rollout.parse_prompt_logprobs`
    (:class:`VLLMResponseError` naming ``url`` for a body that is not JSON, has no choices or malformed rows)."""
    try:
        return _fast_body_scores(body, prompt_length, completion_length, top_k)
    except (_NotExact, msgspec.DecodeError, OverflowError):  # ValidationError is a DecodeError
        pass
    try:
        decoded = json.loads(body)
    except ValueError as error:
        raise VLLMResponseError(f"{url} answered with a body that is not JSON: {body[:200]!r}") from error
    per_position = first_choice(url, decoded).get("prompt_logprobs")
    return parse_prompt_logprobs(url, per_position, prompt_length, completion_length, top_k)


# --------------------------------------------------------------------------------------- the scoring plugin's reply


def missing_plugin_message(url: str) -> str:
    """What to do about a teacher at ``url`` whose answers lack the scoring plugin's field."""
    return (f"{url}: the teacher's answer has no {REPLY_FIELD!r}: the server does not run fastdistill's "
            "teacher-scoring plugin, which scoring at the student's query ids needs. Install fastdistill into the vLLM "
            "server's Python environment (vLLM then loads its `vllm.general_plugins` entry point `fastdistill_gloo` in "
            "every process) and do not leave that plugin out of $VLLM_PLUGINS; `fastdistill serve-teacher` starts "
            "such a server.")


class _CompactReply(msgspec.Struct, gc=False):
    version: int = 0
    rows: int = -1
    top_k: int = -1
    num_queries: int = -1
    data: str = ""
    error: str | None = None


class _CompactChoice(msgspec.Struct, gc=False):
    fastdistill_scores: _CompactReply | None = None


class _CompactBody(msgspec.Struct, gc=False):
    choices: list[_CompactChoice]


_COMPACT_DECODER = msgspec.json.Decoder(_CompactBody)
_LAST_RANK = np.iinfo(np.int64).max


def candidates_from_rows(rows: ScoredRows, completion_ids: np.ndarray, top_k: int) -> TeacherScores:
    """:class:`TeacherScores` (L, top_k + 1) from a decoded plugin reply, as stock ``prompt_logprobs`` give them: the
    top-K and the realised token ``completion_ids`` int (L,) when outside the top-K, ordered by rank then token id
    (vLLM's rank of the realised token counts the ids at least as likely, so a tie at the top-K boundary can sort it
    in among them)."""
    length = completion_ids.shape[0]
    realised = completion_ids.astype(np.int32).reshape(length, 1)
    candidate_ids = np.concatenate([rows.topk_ids, realised], axis=1)
    logprobs = np.concatenate([rows.topk_logprobs, rows.token_logprobs.reshape(length, 1)], axis=1)
    in_top_k = (rows.topk_ids == realised).any(axis=1)
    candidate_ids[in_top_k, top_k] = -1
    logprobs[in_top_k, top_k] = -np.inf
    tied = ~in_top_k & (rows.token_ranks <= top_k)
    if tied.any():
        ranks = np.empty((int(tied.sum()), top_k + 1), dtype=np.int64)
        ranks[:, :top_k] = np.arange(1, top_k + 1)
        ranks[:, top_k] = rows.token_ranks[tied]
        order = np.lexsort((candidate_ids[tied], ranks), axis=-1)
        candidate_ids[tied] = np.take_along_axis(candidate_ids[tied], order, axis=1)
        logprobs[tied] = np.take_along_axis(logprobs[tied], order, axis=1)
    return TeacherScores(candidate_ids, logprobs)


def scores_from_compact_body(url: str, body: bytes, completion_ids: np.ndarray, top_k: int,
                             num_queries: int) -> TeacherScores:
    """The raw body of a scoring-plugin answer for ``completion_ids`` int (L,) with ``top_k`` candidates and
    ``num_queries`` query ids per row to :class:`TeacherScores` (L, top_k + 1), with ``query_logprobs`` float32
    (L, num_queries) (None when ``num_queries`` is 0). Raises :class:`VLLMResponseError` naming ``url`` for a body
    without the plugin's field (the message says how to start the teacher), with its error, or malformed."""
    try:
        choices = _COMPACT_DECODER.decode(body).choices
    except msgspec.DecodeError as error:
        raise VLLMResponseError(f"{url}: unexpected scoring answer ({error}): {body[:200]!r}") from error
    if not choices:
        raise VLLMResponseError(f"{url}: completion body without choices: {body[:200]!r}")
    answer = choices[0].fastdistill_scores
    if answer is None:
        raise VLLMResponseError(missing_plugin_message(url))
    if answer.error is not None:
        raise VLLMResponseError(f"{url}: the scoring plugin answered: {answer.error}")
    length = int(completion_ids.shape[0])
    if (answer.rows, answer.top_k, answer.num_queries) != (length, top_k, num_queries):
        raise VLLMResponseError(f"{url}: scoring answer for {answer.rows} rows, K={answer.top_k}, "
                                f"S={answer.num_queries}; asked for {length} rows, K={top_k}, S={num_queries}")
    try:
        rows = unpack(answer.data, length, top_k, num_queries)
    except ValueError as error:  # binascii.Error is a ValueError
        raise VLLMResponseError(f"{url}: malformed scoring data: {error}") from error
    scores = candidates_from_rows(rows, completion_ids, top_k)
    query_logprobs = np.ascontiguousarray(rows.query_logprobs) if num_queries else None
    return TeacherScores(scores.candidate_ids, scores.logprobs, query_logprobs)
