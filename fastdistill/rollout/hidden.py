"""Scoring completions with a served teacher's final hidden states instead of its top-K log-probs.

A teacher started with ``fastdistill serve-teacher --signal hidden`` is vLLM's pooling runner over the causal LM
(``--runner pooling --convert embed`` with a per-token pooler that applies no activation): ``POST /pooling`` with
``task="token_embed"`` returns, for every input token, the model's final hidden state after the final norm, i.e.
what the teacher's lm_head multiplies. The trainer applies that head itself (``fastdistill.train.teacher_head``),
so the whole vocabulary is available at every position, for ``2 * hidden_size`` bytes per position in bfloat16.

Alignment: the hidden state at sequence position t gives the distribution of token t+1, so completion token j (at
position P+j) is scored by the hidden state at position P+j-1, exactly like ``prompt_logprobs`` entry P+j. The
request therefore sends ``prompt + completion[:-1]`` (the last completion token predicts nothing that is scored)
and keeps rows P-1 .. P+L-2.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastdistill.errors import VLLMResponseError
from fastdistill.http_client import decode_off_loop
from fastdistill.options import HIDDEN_DTYPES
from fastdistill.rollout.client import VLLMEndpoint

# keyed by the names of HIDDEN_DTYPES (fastdistill.options)
_TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Little-endian wire words: float32 as is, bfloat16 as its 16 raw bits (numpy has no bfloat16).
_WIRE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2")}

_NOT_A_HIDDEN_TEACHER = (
    "The server does not serve per-token hidden states: start the teacher with `fastdistill serve-teacher MODEL "
    "--signal hidden` (vLLM `--runner pooling --convert embed --pooler-config "
    "'{\"task\": \"token_embed\", \"tok_pooling_type\": \"ALL\", \"use_activation\": false}'`)."
)


def _pooling_hint(status: int, message: str) -> str | None:
    if status == 404 or (status == 400 and ("pooling_task" in message or "Unsupported task" in message)):
        return _NOT_A_HIDDEN_TEACHER
    return None


def _encoded_length(body: Any) -> int:
    try:
        return len(body["data"][0]["data"])
    except (KeyError, IndexError, TypeError):
        return 0  # malformed: decode_hidden says how


@dataclass(frozen=True)
class TeacherHiddenStates:
    """The teacher's final hidden states for one completion: ``hidden`` (L, D) float32 or bfloat16 on the CPU.

    Row j is the hidden state that predicts completion token j (taken at the position just before it): the teacher's
    logits for that token's position are ``lm_head(hidden[j])``.
    """

    hidden: torch.Tensor


def decode_hidden(url: str, body: Any, rows: int, dtype: str, hidden_size: int | None = None) -> torch.Tensor:
    """Decode a ``/pooling`` answer (``data[0].data``: base64 of ``rows * D`` little-endian ``dtype`` words) into a
    (rows, D) tensor of ``dtype``. ``hidden_size`` (when known) must equal D. ``url`` names the server in the
    :class:`VLLMResponseError` raised on a malformed answer."""
    try:
        encoded = body["data"][0]["data"]
        raw = base64.b64decode(encoded, validate=True)
    except (KeyError, IndexError, TypeError, binascii.Error, ValueError) as error:
        raise VLLMResponseError(f"{url}: expected base64 hidden states in data[0].data, got {body!r:.300}") from error
    wire = _WIRE_DTYPES[dtype]
    words = len(raw) // wire.itemsize
    if len(raw) % wire.itemsize or rows < 1 or words % rows or words == 0:
        raise VLLMResponseError(f"{url}: {len(raw)} bytes of {dtype} hidden states cannot hold {rows} positions")
    width = words // rows
    if hidden_size is not None and width != hidden_size:
        raise VLLMResponseError(f"{url}: hidden states of width {width}, expected hidden_size {hidden_size}")
    array = np.frombuffer(raw, dtype=wire).reshape(rows, width).astype(wire.newbyteorder("="), copy=True)
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


class HiddenTeacherClient(VLLMEndpoint):
    """Scores completions with a hidden-state teacher server (``fastdistill serve-teacher --signal hidden``).

    Same replicas, retries, failover, API key and error classes as :class:`~fastdistill.rollout.TeacherClient`: a
    rejected request (e.g. longer than the server's ``max_model_len``) raises
    :class:`~fastdistill.rollout.VLLMRequestError` at once, transient failures are retried. ``dtype`` is what
    travels and what :meth:`score` returns: ``"bfloat16"`` (2 bytes per value, the default) or ``"float32"`` (exact
    for a float32 teacher). ``hidden_size`` (optional) is checked against every answer.
    """

    def __init__(self, base_url: str | Sequence[str], *, dtype: str = "bfloat16",
                 hidden_size: int | None = None, **kwargs: Any):
        if dtype not in HIDDEN_DTYPES:
            raise ValueError(f"dtype must be one of {list(HIDDEN_DTYPES)}, got {dtype!r}")
        if hidden_size is not None and hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        super().__init__(base_url, **kwargs)
        self.dtype = dtype
        self.hidden_size = hidden_size

    async def score(
        self, prompt_ids: list[int] | np.ndarray, completion_ids: list[int] | np.ndarray
    ) -> TeacherHiddenStates:
        """The teacher's final hidden states that predict each completion token: (len(completion_ids), D).

        Sends ``prompt_ids + completion_ids[:-1]`` to ``POST /pooling`` (``task="token_embed"``, base64,
        ``use_activation=false``) and keeps the rows from position ``len(prompt_ids) - 1`` on. The prompt must
        hold at least one token (nothing predicts the first token of a sequence); the request is at most
        ``len(prompt) + len(completion) - 1`` tokens, which the server's ``max_model_len`` bounds.
        """
        prompt = [int(token) for token in prompt_ids]
        completion = [int(token) for token in completion_ids]
        if not prompt:
            raise ValueError("the prompt must hold at least one token: the hidden state before a completion token "
                             "scores it, and nothing comes before the first token of a sequence")
        sequence = prompt + completion[:-1] if completion else prompt
        payload = {
            "model": await self.model_name(),
            "input": sequence,
            "task": "token_embed",
            "encoding_format": "base64",
            "embed_dtype": self.dtype,
            "endianness": "little",
            "use_activation": False,
            "add_special_tokens": False,
        }
        body = await self._request("POST", "/pooling", payload, rejection_hint=_pooling_hint)
        args = (self._where("/pooling"), body, len(sequence), self.dtype, self.hidden_size)
        hidden = await decode_off_loop(_encoded_length(body), decode_hidden, *args)
        start = len(prompt) - 1
        return TeacherHiddenStates(hidden[start : start + len(completion)])

    async def served_width(self) -> int:
        """The width D of the hidden states the server sends, from one request of a one-token sequence (token 0).

        Checked at start-up against the teacher head's width, so that a server serving another model than the head's
        checkpoint is named before any rollout rather than at the loss."""
        scores = await self.score([0], [0])
        return int(scores.hidden.shape[1])
