"""Metric sink of the trainer: TRL's names and reduction rules, a JSONL file, a progress bar and optional trackers.

Values are collected between two :meth:`MetricsLogger.log` calls (every step's values, also with ``logging_steps >
1``) and reduced per key as TRL 1.16 does: a ``(numerator, denominator)`` pair is a rate Σnum/Σden; otherwise the last
``/``-segment, split on ``_``, decides: ``total`` sums, ``max`` / ``min`` take the extreme, anything else averages.
Unlike TRL, the per-teacher families (``teacher_jsd/<id>`` …) always average, whatever the teacher id is called (TRL
sums ``teacher_jsd/total``), and the gauges ``learning_rate`` and ``model_version`` keep their last value.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fastdistill.data.batching import microbatch_metrics
from fastdistill.train.ledger import RunLedger

PER_TEACHER_FAMILIES = ("teacher_jsd/", "teacher_reverse_kl/", "teacher_entropy/", "teacher_token_frac/",
                        "teacher_score_s/")
GAUGES = ("learning_rate", "model_version")


def reduction(key: str) -> str:
    """``"sum"``, ``"max"``, ``"min"``, ``"last"`` or ``"mean"`` for a metric name."""
    if key in GAUGES:
        return "last"
    if key.startswith(PER_TEACHER_FAMILIES):
        return "mean"
    words = key.rsplit("/", 1)[-1].split("_")
    if "total" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


def reduce_values(key: str, values: list[Any]) -> float | None:
    """Reduce the values collected for ``key``; NaNs are ignored, and no valid value gives None."""
    pairs = [v for v in values if isinstance(v, tuple)]
    if pairs:
        numerator = sum(float(n) for n, _ in pairs)
        denominator = sum(float(d) for _, d in pairs)
        return numerator / denominator if denominator else None
    numbers = [float(v) for v in values if not math.isnan(float(v))]
    if not numbers:
        return None
    how = reduction(key)
    if how == "last":
        return numbers[-1]
    if how == "sum":
        return sum(numbers)
    if how == "max":
        return max(numbers)
    if how == "min":
        return min(numbers)
    return sum(numbers) / len(numbers)


class MetricsLogger:
    """Collects metrics on the main rank and writes them every ``log`` call.

    Writes ``<output_dir>/metrics.jsonl`` (one JSON object per logged step, with ``step`` and wall-clock
    ``time``; appended through :class:`~fastdistill.train.ledger.RunLedger`, so a kill leaves whole lines),
    updates a tqdm progress bar over ``total_steps`` and forwards to the trackers in ``report_to``
    (``tensorboard``, ``wandb``, ``trackio``; each needs its package, a clear error otherwise). On other ranks
    every method is a no-op.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        total_steps: int,
        is_main: bool = True,
        report_to: list[str] | tuple[str, ...] = (),
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        disable_progress: bool = False,
        initial_step: int = 0,
    ):
        self.is_main = is_main
        self._values: dict[str, list[Any]] = defaultdict(list)
        self._trackers: list[Any] = []
        self.history: list[dict[str, float]] = []
        if not is_main:
            return
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._ledger = RunLedger(self.output_dir)
        self._progress = None
        if not disable_progress:
            self._progress = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                                  dynamic_ncols=True)
        for name in report_to:
            self._trackers.append(_make_tracker(name, self.output_dir, run_name, config or {}))

    def add(self, key: str, value: float | tuple[float, float]) -> None:
        """Record one value (or a ``(numerator, denominator)`` pair) for ``key``."""
        if self.is_main:
            self._values[key].append(value)

    def update(self, values: dict[str, float | tuple[float, float]]) -> None:
        for key, value in values.items():
            self.add(key, value)

    def has_values(self) -> bool:
        """Whether anything was recorded since the last :meth:`log`."""
        return bool(self._values)

    def set_total(self, total_steps: int) -> None:
        """Correct the progress bar's step count (the run's length is estimated while it goes)."""
        if self.is_main and self._progress is not None:
            self._progress.total = total_steps

    def log(self, step: int, extra: dict[str, float] | None = None) -> dict[str, float]:
        """Reduce everything collected since the last call, write it out and return it (empty on other ranks)."""
        if not self.is_main:
            return {}
        record: dict[str, float] = {}
        for key in sorted(self._values):
            value = reduce_values(key, self._values[key])
            if value is not None:
                record[key] = value
        record.update(extra or {})
        self._values.clear()
        self.history.append({"step": step, **record})
        self._ledger.append_metrics({"step": step, "time": time.time(), **record})
        for tracker in self._trackers:
            tracker.log(record, step)
        if self._progress is not None:
            self._progress.n = step
            shown = {k: record[k] for k in ("jsd", "loss", "perf/step_s") if k in record}
            self._progress.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
            self._progress.refresh()
        return record

    def close(self) -> None:
        if not self.is_main:
            return
        if self._progress is not None:
            self._progress.close()
        for tracker in self._trackers:
            tracker.close()


class _TensorBoard:
    def __init__(self, output_dir: Path):
        try:  # tensorboard is optional: only report_to=['tensorboard'] needs it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            message = "report_to=['tensorboard'] needs the tensorboard package: pip install tensorboard"
            raise RuntimeError(message) from error
        self.writer = SummaryWriter(log_dir=str(output_dir / "runs"))

    def log(self, record: dict[str, float], step: int) -> None:
        for key, value in record.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _ModuleTracker:
    """W&B and Trackio share the ``init`` / ``log`` / ``finish`` shape."""

    def __init__(self, module_name: str, run_name: str | None, config: dict[str, Any]):
        try:
            self.module = __import__(module_name)
        except ImportError as error:
            raise RuntimeError(f"report_to=['{module_name}'] needs the {module_name} package: pip install "
                               f"{module_name}") from error
        self.run = self.module.init(project="fastdistill", name=run_name, config=config)

    def log(self, record: dict[str, float], step: int) -> None:
        self.module.log(record, step=step)

    def close(self) -> None:
        self.module.finish()


def _make_tracker(name: str, output_dir: Path, run_name: str | None, config: dict[str, Any]) -> Any:
    if name == "tensorboard":
        return _TensorBoard(output_dir)
    if name in ("wandb", "trackio"):
        return _ModuleTracker(name, run_name, config)
    raise ValueError(f"unknown tracker {name!r}; expected one of ['tensorboard', 'wandb', 'trackio']")


def rank0_step_metrics(metrics: MetricsLogger, collector: Any, source: Any, window: Any,
                       token_budget: int) -> dict[str, Any]:
    """Rank 0's share of a step's record: the collector's counters (discarded and dropped samples, by reason) and the
    source's rollout wait as values; the source's and the rollout worker's metrics and the window's packing metrics
    (ghost rows left out) go into ``metrics`` to be reduced with the step's. Resets the source's wait and metrics."""
    counters = collector.take_counters()
    dropped = counters.dropped
    record: dict[str, Any] = {"perf/rollout_wait_s": source.wait_s,
                              "sample/discarded_total": float(counters.discarded_total),
                              "sample/dropped_prompts_total": float(sum(dropped.values()))}
    for reason, count in dropped.items():
        record[f"sample/dropped_prompts_{reason}_total"] = float(count)
    if token_budget > 0:
        record["batch/dropped_oversize_total"] = float(dropped.get("oversize", 0))
    source.wait_s = 0.0
    for key, values in source.metrics.items():
        for value in values:
            metrics.add(key, value)
    source.metrics = {}
    for payload in source.drain_worker_metrics():
        metrics.update(payload)
    for microbatch in window.microbatches:
        metrics.update(microbatch_metrics([row for row in microbatch if row], token_budget or None))
    return record
