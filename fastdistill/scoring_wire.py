"""The wire format of fastdistill's teacher-scoring plugin for vLLM: what a ``/v1/completions`` request puts in
``vllm_xargs`` and what the answer's choice carries back.

The plugin (:mod:`fastdistill.sync.vllm_scoring`, inside the vLLM server) and the client
(:class:`fastdistill.rollout.TeacherClient`) both read this module; it imports nothing but numpy and the standard
library.

Request (``vllm_xargs``, values str or int; the prompt is a flat list of token ids, sequence length N):

- ``fastdistill_score_start`` (int): the first scored row; row p holds the teacher's distribution of token p + 1
  given tokens 0..p, so a completion after a P-token prompt starts at row P - 1. Rows start..N-2 are scored:
  ``rows = N - 1 - start`` (the prompt rows before ``start`` are never computed into log-probs).
- ``fastdistill_top_k`` (int K >= 0): the teacher's top-K candidates per row.
- ``fastdistill_num_queries`` (int S >= 0) and ``fastdistill_query_ids`` (str, with S > 0): base64 of the
  little-endian int32 array (rows, S) in C order, the ids whose log-probs the request asks for (duplicates allowed).

Answer: ``choices[i]["fastdistill_scores"] = {"version": 1, "rows": L, "top_k": K, "num_queries": S, "data": b64}``
(or ``{"error": message}``). ``data`` is base64 of one little-endian float32 matrix (L, 2 + 2K + S) in C order:

- column 0: the log-prob of the sequence's own next token (the realised token);
- column 1: that token's rank (1 = most likely), an int32 stored bit for bit in the float32 slot;
- columns 2..2+K: the top-K log-probs, in ``torch.topk`` order;
- columns 2+K..2+2K: the top-K ids (int32 bits, as column 1);
- columns 2+2K..2+2K+S: the log-probs at the query ids.

The log-probs are vLLM's prompt log-probs: fp32 log-softmax of the raw logits over the full vocabulary (``-inf`` is
sent as is; stock ``prompt_logprobs`` JSON clamps it to -9999).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

XARG_START = "fastdistill_score_start"
XARG_TOP_K = "fastdistill_top_k"
XARG_NUM_QUERIES = "fastdistill_num_queries"
XARG_QUERY_IDS = "fastdistill_query_ids"
REPLY_FIELD = "fastdistill_scores"
VERSION = 1
FIXED_COLUMNS = 2  # realised log-prob, realised rank

_LITTLE_INT32 = np.dtype("<i4")
_LITTLE_FLOAT32 = np.dtype("<f4")


def row_width(top_k: int, num_queries: int) -> int:
    """Columns of the reply matrix: 2 + 2 * top_k + num_queries."""
    return FIXED_COLUMNS + 2 * top_k + num_queries


def encode_int32(array: np.ndarray) -> str:
    """Base64 of ``array`` as little-endian int32 in C order."""
    return base64.b64encode(np.ascontiguousarray(array, dtype=_LITTLE_INT32).tobytes()).decode("ascii")


def decode_int32(text: str, rows: int, columns: int) -> np.ndarray:
    """The int32 (rows, columns) array of :func:`encode_int32`'s ``text``; ValueError naming what does not fit."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) != rows * columns * 4:
        raise ValueError(f"expected {rows} x {columns} int32 ids ({rows * columns * 4} bytes), got {len(raw)} bytes")
    return np.frombuffer(raw, dtype=_LITTLE_INT32).reshape(rows, columns)


def request_xargs(start: int, top_k: int, query_ids: np.ndarray | None) -> dict[str, Any]:
    """The ``vllm_xargs`` of a scoring request: rows from ``start``, top-``top_k`` candidates and, when given, the
    log-probs at ``query_ids`` int (rows, S)."""
    xargs: dict[str, Any] = {XARG_START: int(start), XARG_TOP_K: int(top_k), XARG_NUM_QUERIES: 0}
    if query_ids is not None:
        xargs[XARG_NUM_QUERIES] = int(query_ids.shape[1])
        xargs[XARG_QUERY_IDS] = encode_int32(query_ids)
    return xargs


def reply(matrix: np.ndarray, top_k: int, num_queries: int) -> dict[str, Any]:
    """The choice field for the float32 reply ``matrix`` (rows, :func:`row_width`)."""
    data = base64.b64encode(np.ascontiguousarray(matrix, dtype=_LITTLE_FLOAT32).tobytes()).decode("ascii")
    return {"version": VERSION, "rows": int(matrix.shape[0]), "top_k": int(top_k), "num_queries": int(num_queries),
            "data": data}


@dataclass(frozen=True)
class ScoredRows:
    """A decoded reply: per scored row, the realised token's log-prob float32 (L,) and rank int32 (L,), the top-K
    log-probs float32 (L, K) and ids int32 (L, K), and the query log-probs float32 (L, S)."""

    token_logprobs: np.ndarray
    token_ranks: np.ndarray
    topk_logprobs: np.ndarray
    topk_ids: np.ndarray
    query_logprobs: np.ndarray


def unpack(data: bytes | str, rows: int, top_k: int, num_queries: int) -> ScoredRows:
    """Split the base64 ``data`` of a reply of ``rows`` rows into :class:`ScoredRows` (views of one buffer);
    ValueError when its size does not match."""
    raw = base64.b64decode(data, validate=True)
    width = row_width(top_k, num_queries)
    if len(raw) != rows * width * 4:
        raise ValueError(f"expected {rows} x {width} float32 values ({rows * width * 4} bytes), got {len(raw)} bytes")
    matrix = np.frombuffer(raw, dtype=_LITTLE_FLOAT32).reshape(rows, width)
    ids = matrix.view(_LITTLE_INT32)
    k0, k1 = FIXED_COLUMNS, FIXED_COLUMNS + top_k
    return ScoredRows(
        token_logprobs=matrix[:, 0],
        token_ranks=ids[:, 1],
        topk_logprobs=matrix[:, k0:k1],
        topk_ids=ids[:, k1:k1 + top_k],
        query_logprobs=matrix[:, k1 + top_k:],
    )
