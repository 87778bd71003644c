"""Where training and held-out prompts come from, and how a Hugging Face dataset becomes a :class:`PromptTable`.

A source is one of: a ``datasets.Dataset``; a list of row dicts (tokenised row by row by :func:`tokenize_prompts`,
as before); a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` file; a local dataset folder or a Hugging Face
dataset name, loaded with ``datasets.load_dataset(name, dataset_config, split=split)`` (a folder written by
``save_to_disk`` with ``datasets.load_from_disk``).

Columns, looked up in this order (the first present decides for every row):
- ``prompt_ids``: token ids already;
- ``prompt``: chat messages (``[{"role", "content"}, ...]``, rendered with the chat template and a generation
  prompt) or text (tokenised without special tokens);
- ``messages``: a whole conversation; the prompt is every turn before the last assistant turn (TRL's conversational
  layout). A conversation without an assistant turn, or with no turn other than the assistant's before its last
  assistant turn, is an error: it has no prompt to answer.
An optional ``teacher_id`` column routes rows to teachers (MOPD).

Tokenisation runs through ``Dataset.map`` (batched, cached next to a file-backed dataset, in ``num_proc``
processes for large datasets); the ids end up in a :class:`PromptTable`, and a row's ``prompt`` is read from the
dataset only when the row is indexed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from fastdistill.data.prompts import _RESERVED_TEMPLATE_KWARGS, tokenize_prompts
from fastdistill.errors import ConfigError
from fastdistill.rollout.prompt_table import DatasetPrompts, PromptTable, before_last_assistant_turn

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
PROMPT_COLUMNS = ("prompt_ids", "prompt", "messages")  # in order of precedence
PARALLEL_MIN_ROWS = 100_000  # tokenise in several processes from this many rows on (num_proc="auto")
_BATCH_SIZE = 1000


def load_prompt_source(
    source: Any,
    *,
    split: str = "train",
    dataset_config: str | None = None,
    what: str = "train_dataset",
) -> Any:
    """The rows of ``source``: a ``datasets.Dataset``, or a list of row dicts when ``source`` is one.

    ``split`` and ``dataset_config`` apply to dataset folders and names only (a single file is one split holding
    every row). ``what`` names the source in error messages. Raises ConfigError for a missing file, an unsupported
    file type, a dataset that cannot be loaded (e.g. a Hub name while offline), an unknown split, a ``DatasetDict``
    or ``IterableDataset`` passed directly, or an empty dataset."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ConfigError(f"{what}: the dataset is empty")
        return list(source)
    if isinstance(source, (str, os.PathLike)):
        dataset = _load_named(os.fspath(source), split, dataset_config, what)
    else:
        dataset = _as_dataset(source, what)
    if len(dataset) == 0:
        raise ConfigError(f"{what}: the dataset is empty")
    return dataset


def _load_named(source: str, split: str, dataset_config: str | None, what: str) -> Any:
    """The dataset at ``source``: a file, a folder or a Hub name."""
    path = Path(source).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(f"{what}: unsupported file type {path.suffix!r} ({source!r}); expected a .json, "
                                ".jsonl, .parquet or .csv file, a dataset folder or a Hugging Face dataset name")
        if path.stat().st_size <= 4096 and not path.read_bytes().strip():
            raise ConfigError(f"{what}: the dataset file {source!r} is empty")
        return _call_loader(source, what, lambda: datasets.load_dataset(builder, data_files=str(path), split="train"))
    if path.suffix.lower() in FILE_BUILDERS:
        raise ConfigError(f"{what}: dataset file {source!r} does not exist")
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        loaded = _call_loader(source, what, lambda: datasets.load_from_disk(str(path)))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"{what}: {source!r} has no split {split!r}; its splits are {sorted(loaded)}")
            return loaded[split]
        return loaded
    return _call_loader(source, what, lambda: datasets.load_dataset(source, dataset_config, split=split),
                        split=split, dataset_config=dataset_config)


def _call_loader(source: str, what: str, load: Any, split: str | None = None, dataset_config: str | None = None
                 ) -> Any:
    try:
        return load()
    except Exception as error:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError, ...)
        settings = "" if split is None else f" (dataset_config={dataset_config!r}, split={split!r})"
        hint = ""
        if not Path(source).expanduser().exists():
            offline = " in offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if _offline() else ""
            hint = (f" It is not a local file or folder, so it was looked up on the Hugging Face Hub{offline}; pass a "
                    "local file or folder, or a dataset name the Hub can serve.")
        reason = f"{type(error).__name__}: {error or '(no message)'}"
        raise ConfigError(f"{what}: could not load {source!r}{settings}: {reason}.{hint}") from error


def _offline() -> bool:
    return bool(datasets.config.HF_HUB_OFFLINE)


def _as_dataset(source: Any, what: str) -> Any:
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, datasets.DatasetDict):
        raise ConfigError(f"{what}: got a DatasetDict with splits {sorted(source)}; pass one split, e.g. "
                          f"dataset[{next(iter(source), 'train')!r}]")
    if isinstance(source, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ConfigError(f"{what}: an IterableDataset (streaming=True) is not supported: the run needs the "
                          "number of rows up front; load the dataset without streaming")
    raise ConfigError(f"{what}: expected a datasets.Dataset, a list of row dicts, a file path, a dataset folder or "
                        f"a Hugging Face dataset name, got {type(source).__name__}")


def prepare_prompts(
    source: Any,
    tokenizer: Any,
    *,
    what: str = "train_dataset",
    split: str = "train",
    dataset_config: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_prompt_tokens: int | None = None,
    num_proc: int | str | None = "auto",
) -> PromptTable:
    """Load ``source`` (see :func:`load_prompt_source`) and tokenise it into a :class:`PromptTable`.

    A list of row dicts goes through :func:`tokenize_prompts` (its errors re-raised as ConfigError prefixed with
    ``what``); a dataset through :func:`tokenize_dataset`."""
    rows = load_prompt_source(source, split=split, dataset_config=dataset_config, what=what)
    if isinstance(rows, list):
        try:
            return PromptTable.from_rows(tokenize_prompts(rows, tokenizer, chat_template_kwargs=chat_template_kwargs,
                                                          max_prompt_tokens=max_prompt_tokens))
        except ValueError as error:
            raise ConfigError(f"{what}: {error}") from error
    return tokenize_dataset(rows, tokenizer, what=what, chat_template_kwargs=chat_template_kwargs,
                            max_prompt_tokens=max_prompt_tokens, num_proc=num_proc)


def tokenize_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    what: str = "train_dataset",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_prompt_tokens: int | None = None,
    num_proc: int | str | None = "auto",
) -> PromptTable:
    """Tokenise the prompts of a ``datasets.Dataset`` (columns: see the module docstring) with ``Dataset.map``.

    Chat prompts are rendered exactly as :func:`tokenize_prompts` renders them (``apply_chat_template(...,
    add_generation_prompt=True, **chat_template_kwargs)``), texts tokenised without special tokens.
    ``num_proc``: processes for the map ("auto": all usable CPUs, at most 8, from ``PARALLEL_MIN_ROWS`` rows on;
    None: this process). The table's prompts read the ``prompt`` column (or the ``messages`` column, cut before the
    last assistant turn) lazily. Raises ConfigError naming ``what``, the column and the row index for a missing
    column, an empty dataset, a row of the wrong shape, an empty prompt, token ids outside the tokenizer's
    vocabulary or more than ``max_prompt_tokens`` tokens.
    """
    template_kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(template_kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ConfigError(f"chat_template_kwargs may not set {reserved}: the prompt tokenisation sets them itself")
    if max_prompt_tokens is not None and (
        isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1
    ):
        raise ConfigError(f"max_prompt_tokens must be a positive int or None, got {max_prompt_tokens!r}")
    if len(dataset) == 0:
        raise ConfigError(f"{what}: the dataset is empty")
    column = next((name for name in PROMPT_COLUMNS if name in dataset.column_names), None)
    if column is None:
        raise ConfigError(f"{what}: the dataset has no 'prompt', 'messages' or 'prompt_ids' column (it has "
                            f"{dataset.column_names}); rename the column that holds the prompts")
    if column != "prompt_ids" and tokenizer is None:
        raise ConfigError(f"{what}: a tokenizer is needed to tokenise the {column!r} column")
    has_teacher = "teacher_id" in dataset.column_names
    output = {"prompt_ids": datasets.List(datasets.Value("int32"))}
    if has_teacher:
        output["teacher_id"] = datasets.Value("string")
    mapped = dataset.map(
        _tokenize_batch,
        batched=True,
        batch_size=_BATCH_SIZE,
        with_indices=True,
        input_columns=[column, "teacher_id"] if has_teacher else [column],
        remove_columns=dataset.column_names,
        features=datasets.Features(output),
        num_proc=_resolve_num_proc(num_proc, len(dataset)),
        fn_kwargs={"column": column, "tokenizer": tokenizer, "template_kwargs": template_kwargs, "what": what,
                   "max_prompt_tokens": max_prompt_tokens, "has_teacher": has_teacher},
        desc=f"Tokenizing {what}",
    )
    table = _table_of(mapped, has_teacher)
    _check_vocabulary(table, tokenizer, what, column)
    if column == "prompt_ids":
        prompts = DatasetPrompts(dataset, "prompt") if "prompt" in dataset.column_names else None
    else:
        prompts = DatasetPrompts(dataset, column)
    return PromptTable(table.token_ids, table.offsets, table.teacher_codes, table.teacher_names, prompts)


def _resolve_num_proc(num_proc: int | str | None, num_rows: int) -> int | None:
    if num_proc != "auto":
        return num_proc  # type: ignore[return-value]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, 8) if num_rows >= PARALLEL_MIN_ROWS and cpus > 1 else None


def prompt_messages(messages: Any, index: int, what: str = "dataset") -> list[Any]:
    """The prompt of a ``messages`` conversation: every turn before its last assistant turn.

    Raises ConfigError naming the row ``index`` when ``messages`` is not a non-empty list of mappings with a
    ``role``, has no assistant turn, or has no turn other than the assistant's before its last assistant turn."""
    _check_messages(messages, index, "messages", what)
    if not any(message["role"] == "assistant" for message in messages):
        raise ConfigError(f"{what}: row {index}: column 'messages' has no assistant turn, so no prompt can be cut "
                            "from it (the prompt is every turn before the last assistant turn); put prompts without "
                            "an answer in a 'prompt' column instead")
    prompt = before_last_assistant_turn(messages)
    if all(message["role"] == "assistant" for message in prompt):
        raise ConfigError(f"{what}: row {index}: column 'messages' has no user (or system) turn before its last "
                            "assistant turn, so its prompt would be empty or the assistant's own words")
    return prompt


def _check_messages(messages: Any, index: int, column: str, what: str) -> None:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        got = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise ConfigError(f"{what}: row {index}: column {column!r} must be a non-empty list of chat messages, "
                            f"got {got}")
    for m, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ConfigError(f"{what}: row {index}: message {m} of column {column!r} must be a mapping with a "
                                f"string 'role', got {message!r:.100}")


def _tokenize_batch(values: list[Any], *rest: Any, column: str, tokenizer: Any, template_kwargs: dict[str, Any],
                    what: str, max_prompt_tokens: int | None, has_teacher: bool) -> dict[str, list[Any]]:
    """``Dataset.map`` function: one batch of ``column`` values (and teacher ids) to ``prompt_ids`` lists."""
    teacher_ids, indices = (rest[0], rest[1]) if has_teacher else (None, rest[0])
    ids: list[Any] = [None] * len(values)
    texts: list[tuple[int, str]] = []  # (position in the batch, text)
    chats: list[tuple[int, list[Any]]] = []
    for position, (index, value) in enumerate(zip(indices, values, strict=True)):
        if value is None:
            raise ConfigError(f"{what}: row {index}: column {column!r} is empty (None)")
        if column == "prompt_ids":
            ids[position] = _checked_ids(value, index, what)
        elif column == "messages":
            chats.append((position, prompt_messages(value, index, what)))
        elif isinstance(value, str):
            texts.append((position, value))
        elif isinstance(value, (list, tuple)):
            _check_messages(value, index, column, what)
            chats.append((position, list(value)))
        else:
            raise ConfigError(f"{what}: row {index}: column 'prompt' must hold chat messages or text, got "
                                f"{type(value).__name__}")
    if texts:
        encoded = tokenizer([text for _, text in texts], add_special_tokens=False)["input_ids"]
        for (position, _), row_ids in zip(texts, encoded, strict=True):
            ids[position] = row_ids
    if chats:
        rendered = tokenizer.apply_chat_template([chat for _, chat in chats], tokenize=True, return_dict=False,
                                                 add_generation_prompt=True, **template_kwargs)
        if isinstance(rendered, Mapping):  # some tokenizers return a BatchEncoding whatever return_dict says
            rendered = rendered["input_ids"]
        for (position, _), row_ids in zip(chats, rendered, strict=True):
            ids[position] = row_ids
    for index, row_ids in zip(indices, ids, strict=True):
        if len(row_ids) == 0:
            raise ConfigError(f"{what}: row {index}: the prompt in column {column!r} tokenises to no tokens")
        if max_prompt_tokens is not None and len(row_ids) > max_prompt_tokens:
            raise ConfigError(f"{what}: row {index}: the prompt has {len(row_ids)} tokens, more than "
                                f"max_prompt_tokens={max_prompt_tokens}")
    output: dict[str, list[Any]] = {"prompt_ids": ids}
    if has_teacher:
        for index, teacher_id in zip(indices, teacher_ids, strict=True):
            if teacher_id is not None and not isinstance(teacher_id, str):
                raise ConfigError(f"{what}: row {index}: column 'teacher_id' must hold strings, got "
                                    f"{teacher_id!r:.100}")
        output["teacher_id"] = teacher_ids
    return output


def _checked_ids(value: Any, index: int, what: str) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ConfigError(f"{what}: row {index}: column 'prompt_ids' must hold a flat list of ints, got "
                            f"{value!r:.100}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        bad = int(array.min()) if array.min() < 0 else int(array.max())
        raise ConfigError(f"{what}: row {index}: column 'prompt_ids' holds id {bad}, not a token id")
    return array


def _table_of(mapped: Any, has_teacher: bool) -> PromptTable:
    """The tokenised dataset's Arrow columns as numpy arrays (no per-row Python objects)."""
    arrow = mapped.with_format("arrow")[:]  # a pyarrow.Table, memory-mapped when the map wrote a cache file
    prompt_ids = arrow.column("prompt_ids")
    lengths = pc.list_value_length(prompt_ids).to_numpy()
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    token_ids = pc.list_flatten(prompt_ids).to_numpy()
    codes, names = None, ()
    if has_teacher:
        encoded = arrow.column("teacher_id").combine_chunks().dictionary_encode()
        codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        names = tuple(encoded.dictionary.to_pylist())
    return PromptTable(token_ids, offsets, codes, names)


def _check_vocabulary(table: PromptTable, tokenizer: Any, what: str, column: str) -> None:
    try:
        vocab_size = len(tokenizer) if tokenizer is not None else None
    except TypeError:
        vocab_size = None
    if vocab_size is None or table.token_ids.size == 0:
        return
    outside = np.flatnonzero(table.token_ids >= vocab_size)
    if outside.size:
        row = int(np.searchsorted(table.offsets, outside[0], side="right")) - 1
        raise ConfigError(f"{what}: row {row}: column {column!r} holds id {int(table.token_ids[outside[0]])}, "
                            f"outside the tokenizer's {vocab_size} ids")
