"""Tokenised prompts in compact form: one flat int32 array of token ids plus row offsets (and teacher id codes),
the routing of every row to its teacher, and the lazy view of a Hugging Face dataset's prompt column.

Short prompts as Python lists of ints cost a 28-byte int object and an 8-byte list slot per token, plus a dict per
row; as a :class:`PromptTable` they cost 4 bytes per token plus 8 per row, and pickling one (to the spawned rollout
worker) copies a few numpy buffers instead of millions of objects. Indexing a row gives the dict the rest of the code
expects, built on access. Imports no torch: the rollout worker's child unpickles these.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_NO_TEACHER = -1  # teacher code of a row without a teacher_id


class PromptTable(Sequence):
    """A read-only sequence of tokenised prompt rows.

    Storage: ``token_ids`` int32 (T,), every row's ids back to back; ``offsets`` int64 (N+1,), row i is
    ``token_ids[offsets[i]:offsets[i+1]]``; ``teacher_codes`` int32 (N,), an index into ``teacher_names`` or -1 for
    a row without a teacher id; ``prompts`` (optional) a sequence of N prompts (the rows' ``prompt`` entries), read
    only when a row is indexed, so it may be lazy (e.g. backed by an Arrow dataset).

    ``table[i]`` is ``{"prompt_ids": list[int], "teacher_id": str (only when the row has one), "prompt": any}``, the
    row form of :func:`~fastdistill.data.tokenize_prompts`; a slice gives a list of such dicts.
    """

    def __init__(self, token_ids: np.ndarray, offsets: np.ndarray, teacher_codes: np.ndarray | None = None,
                 teacher_names: Sequence[str] = (), prompts: Sequence[Any] | None = None):
        self.token_ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        num_rows = self.offsets.shape[0] - 1
        if self.token_ids.ndim != 1 or self.offsets.ndim != 1 or num_rows < 0:
            raise ValueError("token_ids and offsets must be 1-D, offsets of length N+1")
        if self.offsets[0] != 0 or self.offsets[-1] != self.token_ids.shape[0] or np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must start at 0, never decrease and end at len(token_ids)")
        if teacher_codes is None:
            teacher_codes = np.full(num_rows, _NO_TEACHER, np.int32)
        self.teacher_codes = np.ascontiguousarray(teacher_codes, dtype=np.int32)
        self.teacher_names = tuple(teacher_names)
        codes = self.teacher_codes
        if codes.shape != (num_rows,) or (
            num_rows and not _NO_TEACHER <= codes.min() <= codes.max() < len(self.teacher_names)
        ):
            raise ValueError("teacher_codes must hold one code in [-1, len(teacher_names)) per row")
        if prompts is not None and len(prompts) != num_rows:
            raise ValueError(f"prompts has {len(prompts)} entries for {num_rows} rows")
        self.prompts = prompts

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], teacher_ids: Sequence[str | None] | None = None
                  ) -> PromptTable:
        """The table of rows ``{"prompt_ids", "teacher_id"?, "prompt"?}`` (as :func:`tokenize_prompts` returns);
        ``teacher_ids`` (one per row) replaces the rows' own ``teacher_id``. Keeps the rows' prompts as a list
        (the objects themselves, not copies) unless every one is None. Raises ValueError naming the row whose
        ``prompt_ids`` is missing or not a list of token ids."""
        for index, row in enumerate(rows):
            prompt_ids = row.get("prompt_ids")
            if not isinstance(prompt_ids, (list, tuple, np.ndarray)):
                raise ValueError(f"row {index}: prompt_ids must be a non-empty list of token ids, "
                                 f"got {prompt_ids!r:.100}")
        lengths = np.fromiter((len(row["prompt_ids"]) for row in rows), np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        token_ids = np.empty(int(offsets[-1]), np.int32)
        for index, row in enumerate(rows):
            token_ids[offsets[index]:offsets[index + 1]] = row["prompt_ids"]
        if teacher_ids is None:
            teacher_ids = [row.get("teacher_id") for row in rows]
        names = sorted({t for t in teacher_ids if t is not None})
        code_of = {name: code for code, name in enumerate(names)}
        codes = np.fromiter((_NO_TEACHER if t is None else code_of[t] for t in teacher_ids), np.int32,
                            count=len(rows))
        prompts = [row.get("prompt") for row in rows]
        return cls(token_ids, offsets, codes, names, prompts if any(p is not None for p in prompts) else None)

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for a table of {len(self)} rows")
        row: dict[str, Any] = {"prompt_ids": self.token_ids[self.offsets[index]:self.offsets[index + 1]].tolist()}
        teacher_id = self.teacher_id(index)
        if teacher_id is not None:
            row["teacher_id"] = teacher_id
        row["prompt"] = self.prompts[index] if self.prompts is not None else None
        return row

    def __repr__(self) -> str:
        return (f"PromptTable({len(self)} rows, {self.token_ids.shape[0]} tokens, teachers={list(self.teacher_names)}"
                f"{', with prompts' if self.prompts is not None else ''})")

    def teacher_id(self, index: int) -> str | None:
        """Row ``index``'s teacher id (None when it has none), without building the row."""
        code = self.teacher_codes[index]
        return None if code == _NO_TEACHER else self.teacher_names[code]

    @property
    def lengths(self) -> np.ndarray:
        """int64 (N,): every row's number of prompt tokens."""
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        """Bytes held by the numpy arrays (prompts not counted)."""
        return self.token_ids.nbytes + self.offsets.nbytes + self.teacher_codes.nbytes

    def fingerprint(self) -> str:
        """sha256 (hex) of the rows' token ids, offsets and teacher ids (not the prompts: the tokens are what
        trains). Equal tables give equal fingerprints; any edited, added, removed or reordered row, or another
        teacher for a row, changes it. Reads each array once."""
        digest = hashlib.sha256()
        header = {"rows": len(self), "tokens": int(self.token_ids.shape[0]), "teachers": list(self.teacher_names)}
        digest.update(json.dumps(header).encode("utf-8"))
        for array, dtype in ((self.offsets, "<i8"), (self.token_ids, "<i4"), (self.teacher_codes, "<i4")):
            digest.update(memoryview(np.ascontiguousarray(array, dtype=dtype)).cast("B"))
        return digest.hexdigest()

    def routed(self, teacher_ids: Sequence[str]) -> PromptTable:
        """The same rows with every row's teacher resolved among the configured ``teacher_ids``: with a single
        teacher every row goes to it, whatever its own ``teacher_id``; with several, each row's ``teacher_id`` must
        be one of them. Raises ValueError for an empty table, an empty prompt, or a missing or unknown teacher
        id (naming the row and the configured ids)."""
        if len(self) == 0:
            raise ValueError("the dataset is empty")
        empty = np.flatnonzero(self.lengths == 0)
        if empty.size:
            raise ValueError(f"row {int(empty[0])}: prompt_ids must be a non-empty list of token ids, got []")
        teacher_ids = list(teacher_ids)
        if len(teacher_ids) == 1:
            codes = np.zeros(len(self), np.int32)
        else:
            # the table's code -> the code among teacher_ids (-2: not configured); index 0 is the table's "no teacher"
            lookup = np.array([-2] + [teacher_ids.index(name) if name in teacher_ids else -2
                                      for name in self.teacher_names], np.int32)
            codes = lookup[self.teacher_codes + 1]
            bad = np.flatnonzero(codes < 0)
            if bad.size:
                index = int(bad[0])
                code = self.teacher_codes[index]
                teacher_id = None if code == _NO_TEACHER else self.teacher_names[code]
                raise ValueError(f"row {index} has teacher_id={teacher_id!r}, which is not a configured teacher; "
                                 f"expected one of {sorted(teacher_ids)}")
        return PromptTable(self.token_ids, self.offsets, codes, teacher_ids, self.prompts)


def routed_table(dataset: PromptTable | Sequence[Mapping[str, Any]], teacher_ids: Sequence[str]) -> PromptTable:
    """``dataset`` (a :class:`PromptTable`, or rows ``{"prompt_ids", "teacher_id"?, "prompt"?}``) as a
    :class:`PromptTable` whose every row names its teacher among ``teacher_ids`` (:meth:`PromptTable.routed`'s
    rules and errors)."""
    table = dataset if isinstance(dataset, PromptTable) else PromptTable.from_rows(dataset)
    return table.routed(teacher_ids)


def before_last_assistant_turn(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The turns of a conversation before its last assistant turn (all of them when it has none)."""
    last = max((m for m, message in enumerate(messages) if message["role"] == "assistant"), default=len(messages))
    return list(messages[:last])


class DatasetPrompts(Sequence):
    """The rows' prompts, read from one column of a ``datasets.Dataset`` only when indexed (no Python copy of the
    whole column). ``column="messages"`` gives each conversation cut before its last assistant turn.

    Pickles as the one-column dataset: a file reference when the dataset is backed by Arrow files on disk, the
    column's Arrow buffers when it is in memory."""

    def __init__(self, dataset: Any, column: str):
        self.dataset = dataset.select_columns([column])
        self.column = column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        value = self.dataset[int(index)][self.column]
        return before_last_assistant_turn(value) if self.column == "messages" else value
