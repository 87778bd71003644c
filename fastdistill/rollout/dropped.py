"""A prompt the rollout gave up on, and why: it travels in the sample queue so the trainer can count it as done."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Why a prompt was dropped.
REJECTED = "rejected"  # a server refused the request (a 4xx other than 429) or answered a malformed body
UNAVAILABLE = "unavailable"  # every attempt (max_rollout_attempts) failed on an unavailable server
TOO_LONG = "too_long"  # prompt + max_completion_length does not fit a server's max_model_len (skipped up front)
OVERSIZE = "oversize"  # prompt + completion is longer than the token budget of a packed row
# a teacher with its own tokenizer cannot score the completion: its text is not valid UTF-8, the teacher's tokenizer
# does not spell it back byte for byte, or the row has no conversation to render for the teacher
UNALIGNED = "unaligned"


@dataclass(frozen=True, slots=True)
class DroppedPrompt:
    """One prompt that will not be trained.

    ``prompt_id``: the id in the worker's (epoch, shuffled order) stream, None for a row skipped before training;
    ``dataset_index``: the dataset row; ``reason``: one of ``rejected``, ``unavailable``, ``too_long``,
    ``oversize``, ``unaligned``; ``server``: the server that refused (``student`` or ``teacher <id>``) when known;
    ``message``: the server's own message or the rule that was broken.
    """

    prompt_id: int | None
    dataset_index: int
    reason: str
    message: str
    server: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
