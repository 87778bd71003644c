"""Planning micro-batches: which samples go into which data-parallel rank's packed row.

A micro-batch is ``num_rows`` rows (one per data-parallel rank), each a non-empty list of samples that will be
packed into one padding-free row. Two planners, with TRL 1.16's semantics: a token budget per row (the default)
and a fixed sample count. Both balance rows by Σ L², because attention costs O(L²) per sample and the slowest rank
stalls the gradient all-reduce.

A sample's length L is its forwarded token count, ``len(sample.input_ids)`` (prompt + completion).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ..rollout.sample import RolloutSample

logger = logging.getLogger(__name__)

MicroBatch = list[list[RolloutSample]]


def _length(sample: RolloutSample) -> int:
    return int(sample.input_ids.shape[0])


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def balance_by_squared_length(samples: Sequence[RolloutSample], num_rows: int) -> MicroBatch:
    """Split ``samples`` into ``num_rows`` rows balancing each row's Σ L².

    Greedy, as TRL: visit samples longest first (stable among equal lengths) and append each to the row with the
    smallest running Σ L² (ties go to the lowest row index). Every row is non-empty when
    ``len(samples) >= num_rows``, since an empty row has load 0.
    """
    _check_positive_int("num_rows", num_rows)
    rows: MicroBatch = [[] for _ in range(num_rows)]
    loads = [0] * num_rows
    for sample in sorted(samples, key=_length, reverse=True):
        row = min(range(num_rows), key=loads.__getitem__)
        rows[row].append(sample)
        loads[row] += _length(sample) ** 2
    return rows


class TokenBudgetBatcher:
    """Fill ``num_rows`` open rows up to ``token_budget`` tokens each; emit them when a sample fits no row.

    Per sample of length n (as TRL 1.16's ``TokenBudgetBatcher``): if ``n > token_budget`` it is dropped and counted in
    ``dropped_oversize_total``; otherwise, if no open row has room for it, the open micro-batch is emitted and
    a fresh one started; the sample then joins the row with room and the smallest Σ L² (ties: lowest index).
    Emitted rows are all non-empty (an empty row always has room and the smallest load) and hold their samples
    in arrival order. A partly filled micro-batch is never emitted; :attr:`pending` shows what it holds.
    """

    def __init__(self, token_budget: int, num_rows: int):
        _check_positive_int("token_budget", token_budget)
        _check_positive_int("num_rows", num_rows)
        self.token_budget = token_budget
        self.num_rows = num_rows
        self.dropped_oversize_total = 0
        self._reset()

    def _reset(self) -> None:
        self._rows: MicroBatch = [[] for _ in range(self.num_rows)]
        self._loads = [0] * self.num_rows
        self._tokens = [0] * self.num_rows

    @property
    def pending(self) -> list[RolloutSample]:
        """Samples accepted but not yet emitted (row by row, each row in arrival order)."""
        return [sample for row in self._rows for sample in row]

    def add(self, sample: RolloutSample) -> MicroBatch | None:
        """Take one sample; return the micro-batch it closed (``num_rows`` non-empty rows) or None."""
        n = _length(sample)
        if n > self.token_budget:
            self.dropped_oversize_total += 1
            logger.warning(
                "Dropping a rollout sample of %d tokens that exceeds token_budget=%d (prompt_id=%s); "
                "raise token_budget to keep such samples.",
                n,
                self.token_budget,
                sample.prompt_id,
            )
            return None
        fits = [r for r in range(self.num_rows) if self._tokens[r] + n <= self.token_budget]
        emitted = None
        if not fits:
            emitted = self._rows
            self._reset()
            fits = list(range(self.num_rows))
        row = min(fits, key=self._loads.__getitem__)
        self._rows[row].append(sample)
        self._loads[row] += n * n
        self._tokens[row] += n
        return emitted


class FixedCountBatcher:
    """Collect ``samples_per_row * num_rows`` samples, then emit them split by :func:`balance_by_squared_length`
    (as TRL 1.16's ``FixedCountBatcher``). No token bound: row sizes, and so peak memory, follow the samples'
    lengths."""

    def __init__(self, samples_per_row: int, num_rows: int):
        _check_positive_int("samples_per_row", samples_per_row)
        _check_positive_int("num_rows", num_rows)
        self.samples_per_row = samples_per_row
        self.num_rows = num_rows
        self._buffer: list[RolloutSample] = []

    @property
    def pending(self) -> list[RolloutSample]:
        """Samples accepted but not yet emitted, in arrival order."""
        return list(self._buffer)

    def add(self, sample: RolloutSample) -> MicroBatch | None:
        """Take one sample; return a micro-batch once ``samples_per_row * num_rows`` have arrived, else None."""
        self._buffer.append(sample)
        if len(self._buffer) < self.samples_per_row * self.num_rows:
            return None
        batch, self._buffer = self._buffer, []
        return balance_by_squared_length(batch, self.num_rows)


def microbatch_metrics(microbatch: MicroBatch, token_budget: int | None) -> dict[str, float]:
    """Sample and packing metrics of one micro-batch, with TRL 1.16's names and definitions.

    Tokens are counted per sample: forwarded = ``len(input_ids)``, trained = ``completion_mask.sum()``.
    - ``sample/forwarded_tokens_mean`` / ``_max``, ``sample/trained_tokens_mean``: per sample;
    - ``batch/masked_token_frac``: (forwarded − trained) / forwarded over the micro-batch;
    - ``batch/samples_per_row``, ``batch/row_tokens_mean`` / ``_max``: per row;
    - ``batch/row_imbalance``: max over rows of Σ L² / mean over rows of Σ L² (1.0 = perfectly balanced);
    - ``batch/row_fill_frac``: Σ row tokens / (token_budget × rows), only when ``token_budget`` is > 0;
    - every key of the samples' ``metrics`` dicts: the NaN-aware mean over the samples that carry it.
    TRL's ``batch/pad_frac`` is absent: rows are never padded. Rates are this micro-batch's ratio.
    """
    if not microbatch or any(len(row) == 0 for row in microbatch):
        raise ValueError(
            f"microbatch must be a non-empty list of non-empty rows, got row sizes {[len(r) for r in microbatch]}"
        )
    samples = [sample for row in microbatch for sample in row]
    forwarded = [_length(s) for s in samples]
    trained = [int(s.completion_mask.sum()) for s in samples]
    row_tokens = [sum(_length(s) for s in row) for row in microbatch]
    row_loads = [sum(_length(s) ** 2 for s in row) for row in microbatch]
    metrics = {
        "sample/forwarded_tokens_mean": sum(forwarded) / len(samples),
        "sample/forwarded_tokens_max": float(max(forwarded)),
        "sample/trained_tokens_mean": sum(trained) / len(samples),
        "batch/masked_token_frac": (sum(forwarded) - sum(trained)) / sum(forwarded),
        "batch/samples_per_row": len(samples) / len(microbatch),
        "batch/row_tokens_mean": sum(row_tokens) / len(microbatch),
        "batch/row_tokens_max": float(max(row_tokens)),
        "batch/row_imbalance": max(row_loads) / (sum(row_loads) / len(microbatch)),
    }
    if token_budget is not None and token_budget > 0:
        metrics["batch/row_fill_frac"] = sum(row_tokens) / (token_budget * len(microbatch))
    for key in dict.fromkeys(key for s in samples for key in s.metrics):
        values = [float(s.metrics[key]) for s in samples if key in s.metrics]
        valid = [v for v in values if not math.isnan(v)]
        metrics[key] = sum(valid) / len(valid) if valid else math.nan
    return metrics
