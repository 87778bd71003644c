"""Dataset rows to token-id prompts, the form the rollout worker consumes (``{"prompt_ids", "teacher_id"?}``).

Chat prompts go through the tokenizer's chat template exactly as TRL 1.16's rollout worker does
(``apply_chat_template(prompt, return_dict=False, add_generation_prompt=True, **chat_template_kwargs)``), so a prompt
tokenised here matches TRL's token for token.
Tokenising once up front (instead of per rollout, as TRL does) keeps the tokenizer out of the worker process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

# apply_chat_template arguments this function sets itself; a user value for them would silently change the layout.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "return_dict", "add_generation_prompt")


def tokenize_prompts(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any = None,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_prompt_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Tokenise each row's prompt.

    Each row is a mapping holding one of:
    - ``"prompt_ids"``: token ids already (a list or 1-D integer array), used as they are;
    - ``"prompt"`` as a list of chat messages (``{"role", "content"}``): rendered with the chat template,
      ``add_generation_prompt=True`` plus ``chat_template_kwargs``;
    - ``"prompt"`` as a string: ``tokenizer(text, add_special_tokens=False)`` (no template, no BOS).
    An optional string ``"teacher_id"`` is copied (MOPD routing).

    Returns one ``{"prompt_ids": list[int], "teacher_id": str (only when the row has one), "prompt": the row's
    "prompt" or None}`` per row. ``tokenizer`` may be None when every row has ``prompt_ids``.

    Raises ValueError naming the row index for a row without a prompt, a prompt of the wrong type, an empty result,
    token ids outside the tokenizer's vocabulary, or more than ``max_prompt_tokens`` tokens.
    """
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    elif not isinstance(chat_template_kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be a mapping or None, got {type(chat_template_kwargs).__name__}")
    reserved = sorted(set(chat_template_kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: tokenize_prompts sets them itself")
    if max_prompt_tokens is not None and (
        isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1
    ):
        raise ValueError(f"max_prompt_tokens must be a positive int or None, got {max_prompt_tokens!r}")

    out = []
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"row {index}: expected a mapping with 'prompt' or 'prompt_ids', got {type(row).__name__}")
        prompt_ids = _row_prompt_ids(index, row, tokenizer, chat_template_kwargs)
        if len(prompt_ids) == 0:
            raise ValueError(f"row {index}: the prompt tokenises to no tokens")
        if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
            raise ValueError(
                f"row {index}: the prompt has {len(prompt_ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
            )
        entry: dict[str, Any] = {"prompt_ids": prompt_ids}
        teacher_id = row.get("teacher_id")
        if teacher_id is not None:
            if not isinstance(teacher_id, str):
                raise ValueError(f"row {index}: teacher_id must be a string, got {teacher_id!r:.100}")
            entry["teacher_id"] = teacher_id
        entry["prompt"] = row.get("prompt")
        out.append(entry)
    return out


def _row_prompt_ids(
    index: int, row: Mapping[str, Any], tokenizer: Any, template_kwargs: Mapping[str, Any]
) -> list[int]:
    """One row's prompt as a list of Python ints (see :func:`tokenize_prompts`)."""
    if row.get("prompt_ids") is not None:
        ids = _as_id_list(index, row["prompt_ids"])
        vocab_size = _vocab_size(tokenizer)
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"row {index}: prompt_ids holds id {max(ids)}, outside the tokenizer's {vocab_size} ids")
        return ids

    prompt = row.get("prompt")
    if prompt is None:
        raise ValueError(f"row {index}: no 'prompt' (chat messages or text) and no 'prompt_ids'")
    if tokenizer is None:
        raise ValueError(f"row {index}: a tokenizer is needed to tokenise 'prompt' (only 'prompt_ids' rows need none)")
    if isinstance(prompt, str):
        return _as_id_list(index, tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, (list, tuple)):
        if len(prompt) == 0:
            raise ValueError(f"row {index}: 'prompt' is an empty list of messages")
        for m, message in enumerate(prompt):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(
                    f"row {index}: message {m} of 'prompt' must be a mapping with a 'role', got {message!r:.100}"
                )
        ids = tokenizer.apply_chat_template(
            list(prompt), tokenize=True, return_dict=False, add_generation_prompt=True, **template_kwargs
        )
        if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding whatever return_dict says
            ids = ids["input_ids"]
        return _as_id_list(index, ids)
    raise ValueError(f"row {index}: 'prompt' must be a list of chat messages or a string, got {type(prompt).__name__}")


def _as_id_list(index: int, ids: Any) -> list[int]:
    array = np.asarray(ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"row {index}: prompt ids must be a flat sequence of ints, got {ids!r:.100}")
    if array.size and array.min() < 0:
        raise ValueError(f"row {index}: prompt ids must be non-negative, got {int(array.min())}")
    return [int(t) for t in array]


def _vocab_size(tokenizer: Any) -> int | None:
    if tokenizer is None:
        return None
    try:
        return len(tokenizer)
    except TypeError:
        return None
