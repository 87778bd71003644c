"""Which prompt a rollout source dispatches next: re-dispatched and redo prompts first, then the cursor.

One dispatcher serves the rollout worker's child and the synchronous source, so that both skip the same prompts
(already trained ones on resume, rows too long for a server, the ids a mixed run takes from its teacher cache) and
both know when nothing is left to dispatch. With several rollout processes, each runs its own dispatcher over the
same cursor and keeps the prompt ids :func:`owner_of` gives it: every id has exactly one owner.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from fastdistill.rollout.config import RolloutConfig
from fastdistill.rollout.order import epoch_order, prompt_cursor
from fastdistill.rollout.sequence import Kept

_MASK64 = 2**64 - 1


def owner_of(prompt_id: int, processes: int) -> int:
    """The rollout process (``0 … processes-1``) that dispatches prompt ``prompt_id``.

    A fixed function of the id (splitmix64's finaliser, then modulo), so that every id has exactly one owner
    whichever process asks, and any regular pattern of ids (an on-policy share that selects every other id, a
    resume's skips) spreads evenly over the processes, which ``prompt_id % processes`` would not."""
    if processes == 1:
        return 0
    z = (int(prompt_id) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % processes


class PromptDispatcher:
    """The ``(prompt_id, row_index, kept)`` dispatch order of a run over ``num_rows`` dataset rows.

    The cursor walks ``config``'s epoch order from ``start_index`` up to ``end_index`` (None: endless), skipping
    ``skip_prompt_ids``, ``skip_rows`` and, with ``on_policy``, the ids the share leaves to the teacher cache; a
    share that settles at 0 ends the cursor at its horizon. :meth:`redo` and :meth:`again` queue prompts ahead of
    it (an id redone before the cursor reached it is then skipped by the cursor, so it still runs once).

    ``process`` of ``processes``: the cursor yields only the ids this process owns (:func:`owner_of`); redo and
    re-dispatched ids are its own by construction (the parent routes each redo id to its owner)."""

    _ORDERS_KEPT = 4  # redo ids cluster in a few recent epochs

    def __init__(self, config: RolloutConfig, num_rows: int, process: int = 0, processes: int = 1):
        if not 0 <= process < processes:
            raise ValueError(f"process must be in [0, processes={processes}), got {process}")
        self.config = config
        self.num_rows = num_rows
        self.process, self.processes = process, processes
        self.cursor = prompt_cursor(num_rows, config.seed, config.start_index, config.shuffle)
        self.cursor_next = config.start_index  # the prompt id the cursor yields next
        ends = [config.end_index]
        if config.on_policy is not None:
            ends.append(config.on_policy.settled_from(on_policy=True))
        bounded = [end for end in ends if end is not None]
        self.end = min(bounded) if bounded else None
        self.skip = set(config.skip_prompt_ids)
        self.pending: collections.deque[tuple[int, Kept | None]] = collections.deque()
        self.orders: dict[int, np.ndarray] = {}  # epoch -> row order, for redo ids

    def redo(self, prompt_ids: Sequence[int]) -> None:
        """Dispatch these prompt ids again, ahead of the cursor."""
        for prompt_id in prompt_ids:
            if prompt_id >= self.cursor_next:
                self.skip.add(prompt_id)  # dispatched now: the cursor must not dispatch it again
            self.pending.append((int(prompt_id), None))

    def again(self, prompt_id: int, kept: Kept | None) -> None:
        """Re-dispatch a failed rollout (with its generation when only the scoring failed)."""
        self.pending.append((prompt_id, kept))

    @property
    def cursor_done(self) -> bool:
        """The cursor reached its end (only redo and re-dispatched prompts can come now)."""
        return self.end is not None and self.cursor_next >= self.end

    @property
    def exhausted(self) -> bool:
        """Nothing is left to dispatch (until a redo request)."""
        return self.cursor_done and not self.pending

    def row_of(self, prompt_id: int) -> int:
        """The dataset row prompt ``prompt_id`` visits."""
        epoch, position = divmod(prompt_id, self.num_rows)
        if epoch not in self.orders:
            if len(self.orders) >= self._ORDERS_KEPT:
                self.orders.pop(next(iter(self.orders)))
            self.orders[epoch] = epoch_order(self.num_rows, self.config.seed, epoch, self.config.shuffle)
        return int(self.orders[epoch][position])

    def next(self) -> tuple[int, int, Kept | None] | None:
        """The next ``(prompt_id, row_index, kept)``; None when the cursor is done and nothing waits."""
        if self.pending:
            prompt_id, kept = self.pending.popleft()
            return prompt_id, self.row_of(prompt_id), kept
        config = self.config
        while not self.cursor_done:
            prompt_id, row_index = next(self.cursor)
            self.cursor_next = prompt_id + 1
            if prompt_id in self.skip:
                self.skip.discard(prompt_id)
                continue
            if self.processes > 1 and owner_of(prompt_id, self.processes) != self.process:
                continue  # another rollout process dispatches it
            if row_index in config.skip_rows:
                continue
            if config.on_policy is not None and not config.on_policy.selects(prompt_id):
                continue  # a mixed run takes this prompt from the teacher cache
            return prompt_id, row_index, None
        return None
