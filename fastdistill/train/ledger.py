"""The run's ledgers in ``output_dir`` and what a resume checks against them.

Three JSON-lines files, one record per line, each with the ``step`` it belongs to:

- ``trained_prompts.jsonl``: one line per step, ``{"step", "prompt_ids"}``, the prompts that step trained (all
  ranks' rows): the evidence that every prompt is trained exactly once;
- ``dropped_prompts.jsonl``: one line per prompt that will not be trained, ``{"step", "prompt_id",
  "dataset_index", "reason", "message", "server"}`` (``step``: the step whose window was being collected);
- ``metrics.jsonl``: one line per logged step (see :class:`~fastdistill.train.metrics.MetricsLogger`).

Appends are one ``write`` call on an ``O_APPEND`` descriptor, so a killed process leaves whole lines; a crash of
the machine can still leave half a line at the end. Reading tolerates exactly that: a last line without its newline
that is not a JSON object is dropped with a warning; any other unreadable line is an error naming the file and line.
A resume cuts the ledgers back to the checkpoint's step by writing a temporary file, fsyncing it and renaming it
over the ledger, so a crash during the cut leaves the old file or the new one, never a mix.

:class:`DataIdentity` is what a checkpoint records of the data (row count, seed, shuffle flag, epochs and a
fingerprint of the prompts or of the teacher cache); :func:`resume_problem` refuses a resume whose data differ and a
run that would append to an earlier run's ledgers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastdistill.errors import ConfigError
from fastdistill.rollout.dropped import TOO_LONG
from fastdistill.train.checkpoint import (
    ResumedState,
    RolloutState,
    latest_checkpoint,
    load_checkpoint,
    read_rollout_state,
)

logger = logging.getLogger(__name__)

TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"
DROPPED_PROMPTS_FILE = "dropped_prompts.jsonl"
METRICS_FILE = "metrics.jsonl"
LEDGER_FILES = (TRAINED_PROMPTS_FILE, DROPPED_PROMPTS_FILE, METRICS_FILE)


# ------------------------------------------------------------------------------------------------ JSON lines


def read_step_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` for every line of a ledger (none when the file is missing), each record a JSON object
    with an int ``step``.

    A torn last line (no newline at its end and not a JSON object) is left out with a warning; an unreadable line
    anywhere else, or a record without an int ``step``, raises :class:`ConfigError` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline, else its unterminated last line
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append((line, _parse(path, number, line)))
    if tail.strip():
        try:
            record = _parse(path, len(lines) + 1, tail)
        except ConfigError:
            logger.warning("%s ends in a torn line (line %d, %d characters, no newline), left by a process killed "
                           "while writing it; it is dropped", path, len(lines) + 1, len(tail))
        else:
            records.append((tail, record))
    return records


def _parse(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as error:
        record, reason = None, str(error)
    else:
        reason = "it has no int 'step'"
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ConfigError(f"{path} line {number} is not a JSON record of a step ({reason}). Only the last line of a "
                          "ledger can be torn by a kill during a write, so this file was damaged otherwise: restore "
                          "it from a copy, or start a new run in another output_dir")
    return record


def append_lines(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` to ``path`` as JSON lines in one ``write`` call (created with its folder if missing)."""
    data = "".join(json.dumps(record) + "\n" for record in records).encode("utf-8")
    if not data:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view):]
    finally:
        os.close(descriptor)


def rewrite_atomically(path: str | Path, text: str) -> None:
    """Replace ``path``'s content by ``text``: a temporary file beside it, fsynced, then renamed over it (and the
    folder fsynced), so a reader or a crash sees the old file or the new one."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    try:  # the rename itself is durable only once the folder is
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def truncate_step_log(path: str | Path, step: int) -> None:
    """Keep the records of a ledger whose ``step`` is at most ``step`` (the later ones were written by a run that
    died before its next checkpoint, so a resume from ``step`` writes them again) and drop a torn last line; the
    file is rewritten atomically, and only when something is dropped."""
    path = Path(path)
    if not path.is_file():
        return
    records = read_step_records(path)
    kept = [line for line, record in records if record["step"] <= step]
    text = "".join(line + "\n" for line in kept)
    if text.encode("utf-8") != path.read_bytes():
        rewrite_atomically(path, text)


class RunLedger:
    """The ledgers of ``output_dir`` (see the module docstring). Holds no open file: every call opens and closes,
    so any number of these may point at one folder (rank 0 writes; the other ranks never call these)."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.trained_path = self.output_dir / TRAINED_PROMPTS_FILE
        self.dropped_path = self.output_dir / DROPPED_PROMPTS_FILE
        self.metrics_path = self.output_dir / METRICS_FILE

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        """The trained, dropped and metrics files."""
        return self.trained_path, self.dropped_path, self.metrics_path

    def append_trained(self, step: int, prompt_ids: Sequence[int]) -> None:
        """Record that ``step`` trained ``prompt_ids`` (one line)."""
        append_lines(self.trained_path, [{"step": step, "prompt_ids": [int(p) for p in prompt_ids]}])

    def append_drops(self, step: int, drops: Sequence[Any]) -> None:
        """Record ``drops`` (:class:`~fastdistill.rollout.dropped.DroppedPrompt`), one line each, with ``step`` (the
        step whose window was being collected, so that a resume from an earlier checkpoint forgets them), and log each
        once (prompts too long for a server are summarised in one warning where they are found)."""
        for drop in drops:
            if drop.reason != TOO_LONG:
                logger.warning("prompt %s (dataset row %d) will not be trained: %s by %s: %s", drop.prompt_id,
                               drop.dataset_index, drop.reason, drop.server or "the batcher", drop.message)
        append_lines(self.dropped_path, [{"step": step, **drop.to_json()} for drop in drops])

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one logged step's metrics (``record`` holds its ``step``)."""
        append_lines(self.metrics_path, [record])

    def truncate(self, step: int) -> None:
        """Cut every ledger back to ``step`` (a resume from ``checkpoint-<step>``); see :func:`truncate_step_log`."""
        for path in self.paths:
            truncate_step_log(path, step)

    def check_readable(self) -> None:
        """Raise :class:`ConfigError` naming the file and line when a ledger has a damaged line before its last."""
        for path in self.paths:
            read_step_records(path)

    def trained(self) -> list[dict[str, Any]]:
        """The trained ledger's records, in file order."""
        return [record for _, record in read_step_records(self.trained_path)]

    def dropped(self) -> list[dict[str, Any]]:
        """The dropped ledger's records, in file order."""
        return [record for _, record in read_step_records(self.dropped_path)]

    def metrics(self) -> list[dict[str, Any]]:
        """The metrics ledger's records, in file order."""
        return [record for _, record in read_step_records(self.metrics_path)]

    def trained_prompt_ids(self) -> list[int]:
        """Every trained prompt id, in the order the steps trained them (an id twice means it trained twice)."""
        return [prompt_id for record in self.trained() for prompt_id in record["prompt_ids"]]

    def earlier_run_files(self) -> list[str]:
        """The names of the ledgers that exist and are not empty (an earlier run wrote them)."""
        return [path.name for path in self.paths if path.is_file() and path.stat().st_size > 0]


# ------------------------------------------------------------------------------------------------ the data


@dataclass(frozen=True)
class DataIdentity:
    """What makes a prompt id mean the same row: prompt ``i`` of a run is row ``order(seed, epoch)[i % num_prompts]``
    of epoch ``i // num_prompts`` (no order for ``samples``: the samples carry their ids). ``num_train_epochs`` only
    says where the ids end: a resume may raise it (the ids already trained keep their rows, the new epochs' ids
    follow them), not lower it below what the checkpoint was written for.

    ``source``: ``"dataset"`` (the tokenised prompt table), ``"teacher_cache"`` or ``"samples"``;
    ``data_fingerprint``: sha256 (hex) of the tokenised prompts and their teachers
    (:meth:`~fastdistill.data.PromptTable.fingerprint`), of the cache's settings and shard checksums
    (:func:`cache_fingerprint`) or of the samples (:func:`samples_fingerprint`)."""

    source: str
    num_prompts: int
    seed: int
    shuffle: bool
    num_train_epochs: float
    data_fingerprint: str

    def to_json(self) -> dict[str, Any]:
        """The identity as a JSON-ready dict (what ``rollout_state.json`` stores under ``data``)."""
        return asdict(self)

    def differences(self, recorded: dict[str, Any]) -> list[str]:
        """``"<name>: <recorded> in the checkpoint, <this> now"`` for every field that differs from ``recorded``
        (a :meth:`to_json` dict), except a raised ``num_train_epochs`` (prompt ids do not depend on the epoch
        count: :func:`~fastdistill.rollout.order.epoch_order`); fingerprints are shown by their first 16 hex
        digits."""
        changed = []
        for name, value in self.to_json().items():
            old = recorded.get(name)
            if old != value:
                if name == "num_train_epochs" and isinstance(old, (int, float)) and value > old:
                    continue  # more epochs: the same ids, and more after them
                if name == "data_fingerprint":
                    old, value = f"{str(old)[:16]}…", f"{value[:16]}…"
                suffix = " (only raising it is allowed)" if name == "num_train_epochs" else ""
                changed.append(f"{name}: {old} in the checkpoint, {value} now{suffix}")
        return changed


def samples_fingerprint(samples: Sequence[Any]) -> str:
    """sha256 (hex) of a list of :class:`~fastdistill.rollout.RolloutSample` (prompt id, dataset row, teacher and
    token ids) and :class:`~fastdistill.rollout.dropped.DroppedPrompt` notices (prompt id, row, reason), in order.
    The teachers' candidate and hidden-state arrays are not read (they follow the tokens)."""
    digest = hashlib.sha256()
    for item in samples:
        input_ids = getattr(item, "input_ids", None)
        if input_ids is None:  # a dropped-prompt notice
            digest.update(json.dumps(["dropped", item.prompt_id, item.dataset_index, item.reason]).encode())
            continue
        header = [item.prompt_id, item.dataset_index, item.teacher_id, int(input_ids.shape[0]), item.prompt_length]
        digest.update(json.dumps(header).encode())
        digest.update(np.ascontiguousarray(input_ids, dtype="<i4").tobytes())
    return digest.hexdigest()


def cache_fingerprint(cache: Any) -> str:
    """sha256 (hex) of a :class:`~fastdistill.cache.TeacherCache`'s manifest settings and shard records (row
    ranges, counts and each shard file's sha256): equal exactly when the cached rows are."""
    manifest = cache.manifest
    payload = json.dumps({"settings": manifest["settings"], "shards": manifest["shards"]}, sort_keys=True,
                         separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def data_identity(config: Any, *, samples: Sequence[Any] | None = None, cache: Any = None,
                  rows: Any = None) -> DataIdentity:
    """The :class:`DataIdentity` of a run of ``config`` (its ``seed``, ``shuffle``, ``num_train_epochs``) on the
    given ``samples``, else the teacher ``cache`` (also for a mixed run, whose prompts are the cache's), else the
    tokenised ``rows`` (a :class:`~fastdistill.data.PromptTable`)."""
    if samples is not None:
        source, count, fingerprint = "samples", len(samples), samples_fingerprint(samples)
    elif cache is not None:
        source, count, fingerprint = "teacher_cache", len(cache), cache_fingerprint(cache)
    elif rows is not None:
        source, count, fingerprint = "dataset", len(rows), rows.fingerprint()
    else:
        raise ValueError("data_identity needs samples, a teacher cache or the prompt table")
    return DataIdentity(source=source, num_prompts=count, seed=int(config.seed), shuffle=bool(config.shuffle),
                        num_train_epochs=config.num_train_epochs, data_fingerprint=fingerprint)


def resume_problem(ledger: RunLedger, checkpoint: Path | None, data: DataIdentity, setting: str | None) -> str | None:
    """Why this run must not start, or None. ``checkpoint``: the folder it resumes from (None: from scratch);
    ``setting``: ``resume_from_checkpoint`` as configured.

    From scratch, ``output_dir`` must hold no earlier run's ledgers or checkpoint (the new run would append to
    them). Resuming, the ledgers must be readable and the checkpoint's recorded data (see :class:`DataIdentity`)
    must equal ``data``; a checkpoint that records none (written by an older fastdistill) resumes with a
    warning."""
    folder = ledger.output_dir
    if checkpoint is None:
        earlier = latest_checkpoint(folder)
        if earlier is not None:
            return (f"output_dir {str(folder)!r} holds {earlier.name} of an earlier run, and this run starts from "
                    f"scratch (resume_from_checkpoint={setting!r}): it would append to that run's ledgers. Set "
                    "resume_from_checkpoint='latest' to continue it, or choose another output_dir")
        files = ledger.earlier_run_files()
        if files:
            return (f"output_dir {str(folder)!r} holds the ledgers of an earlier run ({', '.join(files)}) and no "
                    f"checkpoint to resume from (resume_from_checkpoint={setting!r}): a run from scratch would "
                    "append to them and mix two runs' records. Move them aside (or delete them) to start afresh, or "
                    "choose another output_dir")
        return None
    if not (checkpoint / "rollout_state.json").is_file():
        return None  # not a checkpoint: loading it raises, on every rank
    try:
        ledger.check_readable()
        recorded = read_rollout_state(checkpoint).data
    except ConfigError as error:
        return str(error)
    except (OSError, ValueError, KeyError) as error:
        return f"resume_from_checkpoint: {checkpoint}/rollout_state.json cannot be read: {error!r}"
    if recorded is None:
        logger.warning("%s records no data identity (written by an older fastdistill): resuming without checking "
                       "that the dataset, seed, shuffle and epochs are the ones it was trained on", checkpoint)
        return None
    changed = data.differences(recorded)
    if not changed:
        return None
    return (f"resume_from_checkpoint: {checkpoint} was written for other data or another prompt order: "
            f"{'; '.join(changed)}. A prompt id stands for a row of an epoch's order, so resuming would train some "
            "prompts twice and others never. Restore what changed, or start a new run in another output_dir")


def resume_path(value: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint folder ``resume_from_checkpoint`` names: None for None, the newest ``checkpoint-<step>`` of
    ``output_dir`` (or None) for ``"latest"``/``"true"``, else that folder (FileNotFoundError when it is not one)."""
    if value is None:
        return None
    if value in ("latest", "true", "True"):
        return latest_checkpoint(output_dir)
    path = Path(value)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={value!r} is not a checkpoint folder")
    return path


def resume_run(config: Any, dist: Any, model: Any, optimizer: Any, scheduler: Any, *,
               data: Any) -> Any:
    """Where a run starts (collective): from ``resume_from_checkpoint`` (its weights, optimizer, schedule and rollout
    state loaded, the ledgers truncated to its step) or from scratch. Rank 0 judges the start against the ledgers and
    the checkpoint's recorded data (``data``, this run's :class:`~fastdistill.train.ledger.DataIdentity`); every rank
    raises its :class:`~fastdistill.errors.ConfigError` (the others would otherwise wait in the next collective).
    The returned state's rollout state records ``data`` for the next checkpoint."""
    ledger = RunLedger(config.output_dir)
    resume = resume_path(config.resume_from_checkpoint, config.output_dir)
    problem = dist.broadcast(resume_problem(ledger, resume, data, config.resume_from_checkpoint)
                             if dist.is_main else None)
    if problem is not None:
        raise ConfigError(problem)
    if resume is None:
        state = ResumedState(step=0, model_version=0, rollout=RolloutState())
    else:
        state = load_checkpoint(resume, model, optimizer, scheduler)
        if dist.is_main:
            ledger.truncate(state.step)
    state.rollout.data = data.to_json() if data is not None else None
    return state
