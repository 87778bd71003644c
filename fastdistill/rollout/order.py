"""The order prompts are visited in: a seeded shuffle per epoch, a cursor that resumes mid-epoch, and teacher routing.

A ``prompt_id`` counts across epochs: prompt ``epoch · num_rows + position`` is the row at ``position`` of that
epoch's order, so a cursor can resume at any prompt and a checkpoint only stores ids.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Row indices (num_rows,) in the order epoch ``epoch`` visits them: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(num_rows)
    return np.random.default_rng((seed, epoch)).permutation(num_rows)


def prompt_cursor(num_rows: int, seed: int, start_index: int = 0, shuffle: bool = True) -> Iterator[tuple[int, int]]:
    """Endless ``(prompt_id, row_index)`` pairs from ``prompt_id = start_index`` on; epoch = prompt_id // num_rows."""
    first_epoch, offset = divmod(start_index, num_rows)
    for epoch in itertools.count(first_epoch):
        order = epoch_order(num_rows, seed, epoch, shuffle)
        for position in range(offset, num_rows):
            yield epoch * num_rows + position, int(order[position])
        offset = 0


def row_of_prompt(prompt_id: int, num_rows: int, seed: int, shuffle: bool = True) -> int:
    """The dataset row that ``prompt_id`` visits (the inverse view of :func:`prompt_cursor`)."""
    epoch, position = divmod(prompt_id, num_rows)
    return int(epoch_order(num_rows, seed, epoch, shuffle)[position])


def route_rows(dataset: Sequence[Mapping[str, Any]], teacher_ids: Sequence[str]) -> list[str]:
    """The teacher id of every row; raise ValueError naming the known ids for a missing or unknown one.

    With a single teacher every row goes to it, whatever its ``teacher_id`` says. Also checks ``prompt_ids``.
    """
    if not dataset:
        raise ValueError("the dataset is empty")
    routes = []
    for index, row in enumerate(dataset):
        prompt_ids = row.get("prompt_ids")
        if not isinstance(prompt_ids, (list, tuple, np.ndarray)) or len(prompt_ids) == 0:
            raise ValueError(f"row {index}: prompt_ids must be a non-empty list of token ids, got {prompt_ids!r:.100}")
        if len(teacher_ids) == 1:
            routes.append(teacher_ids[0])
            continue
        teacher_id = row.get("teacher_id")
        if teacher_id not in teacher_ids:
            raise ValueError(
                f"row {index} has teacher_id={teacher_id!r}, which is not a configured teacher; "
                f"expected one of {sorted(teacher_ids)}"
            )
        routes.append(teacher_id)
    return routes


def is_on_policy(prompt_id: int, fraction: float) -> bool:
    """Whether prompt ``prompt_id`` of a mixed run is generated on-policy (else taken from the teacher cache):
    exactly ``floor(n · fraction)`` of the first ``n`` prompt ids are, spread evenly (every run of consecutive ids
    holds its share, within one), so each step's samples hold ``fraction`` of on-policy ones whatever the batch."""
    return math.floor((prompt_id + 1) * fraction) > math.floor(prompt_id * fraction)
