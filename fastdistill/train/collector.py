"""Rank 0's window collector: from a stream of scored samples to the rows of one optimizer step.

A window is up to ``gradient_accumulation_steps`` micro-batches, each one row of samples per data-parallel rank.
The collector owns the rules that decide what is trained and when the run ends:

- a sample is discarded when its prompt is beyond the run's last prompt, already trained, already waiting in the
  batcher, or given up on;
- a prompt is *done* when it is trained or dropped: rejected by a server, out of rollout attempts (the source
  passes a :class:`~fastdistill.rollout.dropped.DroppedPrompt` for it), or longer than the token budget of a row (the
  batcher refuses it). Dropped prompts are listed in :attr:`WindowCollector.new_drops` for the trainer to report;
- a source that generates in waves with the current weights (the synchronous source: ``ends_step_with_wave``)
  makes each window exactly one wave, however many micro-batches the batcher packs it into: once the wave is
  consumed, what waits in the batcher is flushed as the window's last, partial micro-batch, so that no sample is
  trained after a newer weight sync;
- the run ends once every prompt below ``total_prompts`` is done: when the prompts not yet done all wait in the
  batcher, they are flushed as a final, partial micro-batch. A rank left without samples in that micro-batch gets an
  empty row (the trainer runs it as a zero-weight ghost so that every rank makes the same collective calls).

It knows no model, no process group and no server: it is driven by a source with ``next(model_version)`` and
tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastdistill.data.batching import balance_by_squared_length
from fastdistill.errors import SourceExhausted
from fastdistill.rollout import RolloutSample
from fastdistill.rollout.dropped import OVERSIZE, DroppedPrompt
from fastdistill.train.checkpoint import RolloutState


class Source(Protocol):
    def next(self, model_version: int) -> RolloutSample | DroppedPrompt: ...


class Batcher(Protocol):
    pending: list[RolloutSample]

    def add(self, sample: RolloutSample) -> list[list[RolloutSample]] | None: ...


MicroBatch = list[list[RolloutSample]]


@dataclass
class Window:
    """One optimizer step's rows: ``microbatches[m][rank]`` is the list of samples of that rank's packed row (empty
    for a ghost row). ``last``: no prompt is left to train after this window (only known when the run has a
    prompt count)."""

    microbatches: list[MicroBatch]
    last: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        """The window's prompt ids, sorted."""
        return sorted(s.prompt_id for mb in self.microbatches for row in mb for s in row)

    @property
    def num_samples(self) -> int:
        return sum(len(row) for mb in self.microbatches for row in mb)


@dataclass
class CollectorCounters:
    """What happened since the counters were last read (then reset): samples discarded, prompts dropped per
    reason."""

    discarded_total: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


class WindowCollector:
    """Rank 0: builds the next :class:`Window` from ``source``.

    Args:
        total_prompts: prompt ids 0 … total_prompts-1 are the run (every prompt of every epoch); None for a run
            bounded by steps only (it then ends when the source is exhausted).
        world_size: rows per micro-batch (one per data-parallel rank).
        microbatches_per_step: ``gradient_accumulation_steps``.
        make_batcher: a new, empty batcher (:class:`~fastdistill.data.batching.TokenBudgetBatcher` or
            :class:`~fastdistill.data.batching.FixedCountBatcher`); one is replaced after every flush.
        state: which prompts are done; the collector marks dropped prompts done in it, and trained ones when the
            trainer reports their step (:meth:`mark_trained`).
        token_budget: the batcher's budget (for the message of an oversize drop), or None.
    """

    def __init__(self, *, total_prompts: int | None, world_size: int, microbatches_per_step: int,
                 make_batcher: Callable[[], Any], state: RolloutState, token_budget: int | None = None):
        if total_prompts is not None and total_prompts < 0:
            raise ValueError(f"total_prompts must be None or >= 0, got {total_prompts}")
        self.total_prompts = total_prompts
        self.world_size = world_size
        self.microbatches_per_step = microbatches_per_step
        self.make_batcher = make_batcher
        self.batcher = make_batcher()
        self.state = state
        self.token_budget = token_budget
        self.new_drops: list[DroppedPrompt] = []  # dropped since the trainer last took them
        self.counters = CollectorCounters()
        self.exhausted = False
        self.session_steps = self.session_samples = 0  # trained by this process (for the step-count estimate)

    # ------------------------------------------------------------------------------------------------ queries

    def _limit(self) -> int:
        return self.total_prompts if self.total_prompts is not None else 2**62

    def remaining(self) -> int | float:
        """Prompts of the run not done yet (trained or dropped), those waiting in the batcher included;
        ``math.inf`` for a run without a prompt count."""
        if self.total_prompts is None:
            return math.inf
        return self.total_prompts - self.state.count_below(self.total_prompts)

    def is_done(self, prompt_id: int) -> bool:
        return self.state.is_trained(prompt_id)

    def take_counters(self) -> CollectorCounters:
        counters, self.counters = self.counters, CollectorCounters()
        return counters

    def take_drops(self) -> list[DroppedPrompt]:
        drops, self.new_drops = self.new_drops, []
        return drops

    def planned_steps(self, window: Window, step: int, max_steps: int) -> int:
        """The schedule's step count once ``window`` is trained as step ``step + 1``: ``max_steps`` when set (not
        -1); else exact on the last window, and otherwise the steps so far plus the prompts left at the samples per
        step seen so far in this process."""
        if max_steps != -1:
            return max_steps
        if window.last:
            return step + 1
        samples_per_step = (self.session_samples + window.num_samples) / (self.session_steps + 1)
        left = self.remaining() - window.num_samples
        return step + 1 + max(1, math.ceil(left / samples_per_step))

    def mark_trained(self, window: Window) -> None:
        """Record ``window``'s prompts (every rank's rows) as trained, after its step."""
        for prompt_id in window.prompt_ids:
            self.state.add(prompt_id)
        self.session_steps += 1
        self.session_samples += window.num_samples

    # ------------------------------------------------------------------------------------------------ the rule

    def collect(self, source: Source, model_version: int) -> Window | None:
        """The next window, or None when the run is over (every prompt done, or the source exhausted with nothing
        pending). With a wave source (``ends_step_with_wave``) the window is the source's next wave, in as many
        micro-batches as it fills."""
        microbatches: list[MicroBatch] = []
        collected = 0  # samples in this window's micro-batches (not yet marked trained)
        last = False
        by_wave = getattr(source, "ends_step_with_wave", False)
        while by_wave or len(microbatches) < self.microbatches_per_step:
            pending = self.batcher.pending
            if by_wave and source.wave_consumed and (microbatches or pending):
                if pending:  # the wave's rest: trained now, with the weights that generated it
                    microbatches.append(self._flush())
                    collected += len(pending)
                break
            if self.remaining() - collected <= len(pending):
                if pending:  # the run's last prompts: a final, partial micro-batch
                    microbatches.append(self._flush())
                last = True
                break
            if self.exhausted:
                break
            try:
                item = source.next(model_version)
            except SourceExhausted:
                self.exhausted = True
                if self.batcher.pending:
                    microbatches.append(self._flush())
                last = True
                break
            if isinstance(item, DroppedPrompt):
                self._record_drop(item, pending)
                continue
            if not self._wanted(item, pending):
                self.counters.discarded_total += 1
                continue
            oversize_before = getattr(self.batcher, "dropped_oversize_total", 0)
            microbatch = self.batcher.add(item)
            if getattr(self.batcher, "dropped_oversize_total", 0) > oversize_before:
                length = int(item.input_ids.shape[0])
                self._record_drop(DroppedPrompt(
                    prompt_id=item.prompt_id, dataset_index=item.dataset_index, reason=OVERSIZE,
                    message=f"prompt + completion = {length} tokens, more than token_budget={self.token_budget}"),
                    pending)
            if microbatch is not None:
                collected += sum(len(row) for row in microbatch)
                microbatches.append(microbatch)
        if not microbatches:
            return None
        if not last and self.total_prompts is not None:
            last = self.remaining() - collected == 0
        return Window(microbatches, last=last)

    def _wanted(self, sample: RolloutSample, pending: list[RolloutSample]) -> bool:
        prompt_id = sample.prompt_id
        return (prompt_id < self._limit() and not self.state.is_trained(prompt_id)
                and all(s.prompt_id != prompt_id for s in pending))

    def _record_drop(self, notice: DroppedPrompt, pending: list[RolloutSample]) -> None:
        """Count a dropped prompt as done, once (a notice for a prompt already done or waiting is ignored)."""
        prompt_id = notice.prompt_id
        if prompt_id is None or prompt_id >= self._limit() or self.state.is_trained(prompt_id) or any(
                s.prompt_id == prompt_id for s in pending):
            return
        self.state.add(prompt_id)
        self.new_drops.append(notice)
        self.counters.dropped[notice.reason] = self.counters.dropped.get(notice.reason, 0) + 1

    def _flush(self) -> MicroBatch:
        """Everything in the batcher as one micro-batch (rows balanced by Σ L²; empty rows when fewer samples than
        ranks); the batcher is replaced by a new one."""
        pending = self.batcher.pending
        self.batcher = self.make_batcher()
        rows = balance_by_squared_length(pending, self.world_size)
        return [row for row in rows if row] + [[] for row in rows if not row]
