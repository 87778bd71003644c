"""``fastdistill score``: score a dataset's own completions with a teacher server once, into a teacher cache.

Rows carry a completion in one of two layouts (the first present decides):
- ``prompt`` + ``completion`` columns: two texts (each tokenised without special tokens), or two lists of chat
  messages (the conversation ``prompt + completion`` rendered with the chat template; the completion is the
  rendered tokens after those of ``prompt`` with the generation prompt);
- ``messages``: a conversation; the completion is its last assistant turn as the chat template renders it (the
  whole conversation up to that turn tokenised, minus the prompt's tokens: every turn before it plus the
  generation prompt).

Scoring runs shard by shard (``rows_per_shard`` dataset rows each) with at most ``concurrency`` requests in flight,
through a top-K teacher client (:func:`~fastdistill.rollout.teacher_client`: replicas, retries and failover). Each
shard is written to a temporary name and renamed, then its ``shard-NNNNN.json`` record is written the same way; a
re-run skips every shard whose record and checksum are in place, so a killed run resumes at its first unfinished
shard. ``shard=(i, n)`` scores the i-th of n contiguous blocks of shards, so n machines can share one dataset. The
run that finds every shard finished writes ``manifest.json`` and ``rejected.jsonl``.

``candidates="topk"`` stores the teacher's top-K (plus the realised token) per completion position;
``candidates="sampled"`` asks for the teacher's full distribution and stores S tokens drawn from it (see
:mod:`fastdistill.cache.sampled`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastdistill.cache.format import (
    MANIFEST_NAME,
    REJECTED_NAME,
    CacheSettings,
    ShardRecord,
    id_dtype_for,
    logprobs_to_storage,
    map_safetensors,
    sentinel_of,
    sha256_of_file,
    shard_stem,
    tokenizer_fingerprint,
    write_json_atomic,
    write_safetensors,
)
from fastdistill.cache.sampled import (
    SampledScores,
    check_full_distribution,
    check_num_samples,
    draw_candidates,
    score_full,
)
from fastdistill.data.sources import load_prompt_source, prompt_messages
from fastdistill.errors import ConfigError, VLLMRequestError
from fastdistill.options import CANDIDATE_MODES, LOGPROB_DTYPES
from fastdistill.rollout.client import TeacherClient
from fastdistill.rollout.decode import TeacherScores
from fastdistill.rollout.http import RetryPolicy
from fastdistill.rollout.sequence import teacher_client
from fastdistill.rollout.vocab import PROBE_TEXTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompletionRow:
    """One dataset row to score: its index and its prompt and completion token ids."""

    dataset_index: int
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass(frozen=True)
class ScoreSummary:
    """What one ``score`` run did: shards it wrote and found finished, rows it scored and rejected, and whether
    the manifest now exists (every shard of the dataset finished)."""

    shards_written: int
    shards_skipped: int
    rows_scored: int
    rows_rejected: int
    manifest_written: bool


def _render(tokenizer: Any, messages: list[Any], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                        add_generation_prompt=generation_prompt)
    if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding whatever return_dict says
        ids = ids["input_ids"]
    return [int(token) for token in ids]


def _chat_completion(tokenizer: Any, prompt: list[Any], conversation: list[Any], index: int, what: str
                     ) -> tuple[list[int], list[int]]:
    prompt_ids = _render(tokenizer, prompt, generation_prompt=True)
    full_ids = _render(tokenizer, conversation, generation_prompt=False)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ConfigError(f"{what}: row {index}: the chat template does not render the conversation as its prompt "
                           "(with the generation prompt) followed by the answer, so the answer's tokens cannot be cut "
                           "from it")
    return prompt_ids, full_ids[len(prompt_ids) :]


def completion_row(row: Mapping[str, Any], index: int, tokenizer: Any, what: str = "dataset") -> CompletionRow:
    """Token ids of one dataset row's prompt and completion (layouts: see the module docstring).

    Raises ConfigError naming the row for a missing column, a value of the wrong type, a conversation without an
    assistant turn or prompt, or an empty prompt or completion."""
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt_ids = [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
            completion_ids = [int(t) for t in tokenizer(completion, add_special_tokens=False)["input_ids"]]
        elif isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
            prompt_ids, completion_ids = _chat_completion(tokenizer, list(prompt), list(prompt) + list(completion),
                                                          index, what)
        else:
            raise ConfigError(f"{what}: row {index}: columns 'prompt' and 'completion' must both hold text or both "
                               f"chat messages, got {type(prompt).__name__} and {type(completion).__name__}")
    elif "messages" in row:
        messages = row["messages"]
        prompt = prompt_messages(messages, index, what)
        last = max(m for m, message in enumerate(messages) if message["role"] == "assistant")
        prompt_ids, completion_ids = _chat_completion(tokenizer, prompt, list(messages[: last + 1]), index, what)
    else:
        raise ConfigError(f"{what}: row {index} has neither 'prompt' and 'completion' columns nor a 'messages' "
                           f"column (it has {sorted(row)}); `fastdistill score` scores a completion the dataset holds")
    if not prompt_ids or not completion_ids:
        raise ConfigError(f"{what}: row {index}: the {'prompt' if not prompt_ids else 'completion'} tokenises to no "
                           "tokens")
    return CompletionRow(index, prompt_ids, completion_ids)


def shard_block(shard: tuple[int, int], num_shards: int) -> range:
    """The shards that ``shard = (i, n)`` scores: the i-th of n contiguous, disjoint blocks covering them all."""
    part, parts = shard
    return range(part * num_shards // parts, (part + 1) * num_shards // parts)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n), with 0 <= i < n; raises ConfigError otherwise."""
    part, sep, parts = text.partition("/")
    try:
        value = (int(part), int(parts)) if sep else None
    except ValueError:
        value = None
    if value is None or not 0 <= value[0] < value[1]:
        raise ConfigError(f"--shard must look like i/n with 0 <= i < n (e.g. 0/4 for the first of 4 machines), got "
                           f"{text!r}")
    return value


def encode_shard(rows: Sequence[CompletionRow], scores: Sequence[TeacherScores | SampledScores],
                 settings: CacheSettings) -> dict[str, tuple[str, np.ndarray]]:
    """The shard arrays (name -> (dtype name, array)) of scored rows, in the layout :mod:`fastdistill.cache.format`
    describes (with ``candidate_counts`` in the sampled mode). Raises ConfigError when the teacher returned a token
    id outside the cache's vocabulary."""
    id_dtype = settings.id_dtype
    width = settings.candidate_width
    tokens = [np.asarray(row.prompt_ids + row.completion_ids, dtype=np.int64) for row in rows]
    token_offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(t) for t in tokens], out=token_offsets[1:])
    candidate_ids = np.concatenate([s.candidate_ids for s in scores]) if scores else np.zeros((0, width), np.int32)
    candidate_logprobs = (np.concatenate([s.logprobs for s in scores]) if scores
                          else np.zeros((0, width), np.float32))
    outside = candidate_ids >= settings.vocab_size
    if outside.any():
        raise ConfigError(f"the teacher returned token id {int(candidate_ids[outside].max())}, outside the "
                           f"tokenizer's {settings.vocab_size} ids: the teacher uses another vocabulary than the "
                           "tokenizer given to `fastdistill score`")
    numpy_ids = np.uint16 if id_dtype == "uint16" else np.int32
    stored_ids = np.where(candidate_ids < 0, sentinel_of(id_dtype), candidate_ids).astype(numpy_ids)
    arrays = {
        "input_ids": (id_dtype, (np.concatenate(tokens) if tokens else np.zeros(0, np.int64)).astype(numpy_ids)),
        "token_offsets": ("int64", token_offsets),
        "prompt_lengths": ("int32", np.asarray([len(row.prompt_ids) for row in rows], dtype=np.int32)),
        "candidate_ids": (id_dtype, stored_ids),
        "candidate_logprobs": (settings.logprob_dtype, logprobs_to_storage(candidate_logprobs,
                                                                           settings.logprob_dtype)),
        "dataset_index": ("int64", np.asarray([row.dataset_index for row in rows], dtype=np.int64)),
    }
    if settings.sampled:
        counts = (np.concatenate([s.counts for s in scores]) if scores else np.zeros((0, width), np.uint8))
        arrays["candidate_counts"] = ("uint8", counts.astype(np.uint8))
    return arrays


def _record_path(folder: Path, shard: int) -> Path:
    return folder / f"{shard_stem(shard)}.json"


def _shard_path(folder: Path, shard: int) -> Path:
    return folder / f"{shard_stem(shard)}.safetensors"


def finished_record(folder: Path, shard: int) -> ShardRecord | None:
    """Shard ``shard``'s record when the shard is finished (record present, file checksum as recorded), else None."""
    record_path, shard_path = _record_path(folder, shard), _shard_path(folder, shard)
    if not record_path.is_file():
        return None
    record = ShardRecord.from_json(json.loads(record_path.read_text()))
    if not shard_path.is_file() or sha256_of_file(shard_path) != record.sha256:
        logger.warning("%s does not match its record %s (missing or changed): scoring it again", shard_path,
                       record_path)
        return None
    return record


async def _score_rows(client: TeacherClient, rows: Sequence[CompletionRow], settings: CacheSettings,
                      concurrency: int) -> list[TeacherScores | SampledScores | VLLMRequestError]:
    gate = asyncio.Semaphore(concurrency)

    async def one(row: CompletionRow) -> TeacherScores | SampledScores | VLLMRequestError:
        async with gate:
            try:
                if not settings.sampled:
                    return await client.score(row.prompt_ids, row.completion_ids, top_k=settings.top_k)
                dense = await score_full(client, row.prompt_ids, row.completion_ids, settings.vocab_size)
            except VLLMRequestError as error:  # the server refused this row (e.g. too long): record it, go on
                return error
        # the draws depend only on (seed, row) and the teacher's log-probs, not on the order rows finish in
        return draw_candidates(dense, int(settings.num_samples), int(settings.seed), row.dataset_index)

    return await asyncio.gather(*(one(row) for row in rows))


def _existing_settings(folder: Path) -> CacheSettings | None:
    for path in sorted(folder.glob("shard-*.json")):
        return ShardRecord.from_json(json.loads(path.read_text())).settings
    return None


def _load_tokenizer(tokenizer: Any, teacher_model: str) -> tuple[Any, int]:
    """The tokenizer object and the vocabulary size (the larger of the tokenizer's length and the model's
    ``vocab_size`` when the folder has a config.json)."""
    from transformers import AutoTokenizer  # here: transformers imports torch, which the cache package does not

    folder = tokenizer if tokenizer is not None else teacher_model
    if isinstance(folder, (str, os.PathLike)):
        if not Path(folder).is_dir():
            hint = "" if tokenizer is not None else (f" (the teacher serves {teacher_model!r}, which is not a folder "
                                                     "here); pass --tokenizer MODEL_DIR")
            raise ConfigError(f"tokenizer folder {str(folder)!r} does not exist{hint}")
        loaded = AutoTokenizer.from_pretrained(folder)
        config_path = Path(folder) / "config.json"
        model_vocab = json.loads(config_path.read_text()).get("vocab_size", 0) if config_path.is_file() else 0
        return loaded, max(len(loaded), int(model_vocab or 0))
    return folder, len(folder)


async def _check_teacher_tokenizer(client: TeacherClient, tokenizer: Any) -> None:
    for text in PROBE_TEXTS:
        local = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        served = await client.tokenize(text)
        if local != served:
            raise ConfigError(f"the teacher server ({client.base_url}) tokenizes {text!r} as {served[:12]} but the "
                               f"tokenizer given to `fastdistill score` as {local[:12]}: cached ids must mean the "
                               "same tokens for the teacher and the student; pass the teacher's tokenizer")


def score_dataset(
    dataset: Any,
    teacher_urls: str | Sequence[str],
    output: str | Path,
    *,
    top_k: int | None = None,
    candidates: str = "topk",
    num_samples: int | None = None,
    seed: int = 0,
    tokenizer: Any = None,
    shard: tuple[int, int] = (0, 1),
    rows_per_shard: int = 1024,
    concurrency: int = 16,
    logprob_dtype: str = "float16",
    split: str = "train",
    dataset_config: str | None = None,
    api_key: str | None = None,
    retry: RetryPolicy | None = None,
) -> ScoreSummary:
    """Score ``dataset``'s completions (see the module docstring) with the teacher at ``teacher_urls`` (one URL or
    replicas) into the cache folder ``output``; resumable, shardable with ``shard=(i, n)``.

    ``candidates="topk"`` (needs ``top_k``) stores the teacher's top-K per position; ``candidates="sampled"``
    (needs ``num_samples`` S in [1, 255]) stores S tokens drawn per position from the teacher's full distribution
    (the server must allow ``prompt_logprobs=-1``: ``--max-logprobs -1``) with generators seeded by ``seed`` and
    the dataset row index.

    ``tokenizer``: a tokenizer object or model folder; None: the folder the teacher serves (its ``/v1/models`` id).
    Raises ConfigError for bad settings or data, a teacher that tokenizes differently from ``tokenizer``, or an
    ``output`` folder scored with other settings; a row the server refuses (HTTP 4xx) is recorded as rejected."""
    if candidates not in CANDIDATE_MODES:
        raise ConfigError(f"--candidates must be one of {list(CANDIDATE_MODES)}, got {candidates!r}")
    if candidates == "topk":
        if num_samples is not None:
            raise ConfigError("--num-samples is for --candidates sampled; top-K scoring takes --top-k")
        if top_k is None:
            raise ConfigError("--top-k K is required with --candidates topk (or use --candidates sampled "
                               "--num-samples S)")
        if not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    else:
        if top_k is not None:
            raise ConfigError("--top-k is for --candidates topk; sampled scoring takes --num-samples")
        check_num_samples(num_samples)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"--seed must be an int, got {seed!r}")
    if rows_per_shard < 1:
        raise ConfigError(f"--rows-per-shard must be >= 1, got {rows_per_shard}")
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
    if logprob_dtype not in LOGPROB_DTYPES:
        raise ConfigError(f"--logprob-dtype must be one of {list(LOGPROB_DTYPES)}, got {logprob_dtype!r}")
    rows = load_prompt_source(dataset, split=split, dataset_config=dataset_config, what="dataset")
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    sampled = dict(num_samples=num_samples, proposal_temperature=1.0, seed=seed) if candidates == "sampled" else {}
    return asyncio.run(_score(rows, teacher_urls, folder, top_k=top_k or 0, sampled=sampled, tokenizer=tokenizer,
                              shard=shard, rows_per_shard=rows_per_shard, concurrency=concurrency,
                              logprob_dtype=logprob_dtype, api_key=api_key, retry=retry))


async def _score(rows: Any, teacher_urls: str | Sequence[str], folder: Path, *, top_k: int, sampled: dict[str, Any],
                 tokenizer: Any, shard: tuple[int, int], rows_per_shard: int, concurrency: int, logprob_dtype: str,
                 api_key: str | None, retry: RetryPolicy | None) -> ScoreSummary:
    async with teacher_client("topk", teacher_urls, api_key=api_key, retry=retry) as client:
        teacher_model = (await client.served_model()).name
        tokenizer, vocab_size = _load_tokenizer(tokenizer, teacher_model)
        await _check_teacher_tokenizer(client, tokenizer)
        settings = CacheSettings(teacher_model=teacher_model, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                 vocab_size=vocab_size, top_k=top_k,
                                 candidate_mode="sampled" if sampled else "topk",
                                 id_dtype=id_dtype_for(vocab_size), logprob_dtype=logprob_dtype,
                                 rows_per_shard=rows_per_shard, dataset_rows=len(rows), **sampled)
        if settings.sampled:
            probe = [int(t) for t in tokenizer(PROBE_TEXTS[0], add_special_tokens=False)["input_ids"]][:3]
            await check_full_distribution(client, probe, vocab_size)  # a server that refuses fails here, not per row
        existing = _existing_settings(folder)
        if existing is not None and existing != settings:
            raise ConfigError(f"{str(folder)!r} holds shards scored with other settings (in the folder != this "
                               f"run: {'; '.join(existing.differences(settings))}): use a new --output folder, or the "
                               "settings it was scored with")
        written = skipped = scored = rejected = 0
        for index in shard_block(shard, settings.num_shards):
            if finished_record(folder, index) is not None:
                skipped += 1
                continue
            start, stop = settings.row_range(index)
            batch = [completion_row(rows[i], i, tokenizer) for i in range(start, stop)]
            results = await _score_rows(client, batch, settings, concurrency)
            kept = [(row, result) for row, result in zip(batch, results, strict=True)
                    if not isinstance(result, VLLMRequestError)]
            refused = [{"dataset_index": row.dataset_index, "status": result.status, "message": result.server_message}
                       for row, result in zip(batch, results, strict=True) if isinstance(result, VLLMRequestError)]
            record = _write_shard(folder, index, kept, refused, settings, start, stop)
            written += 1
            scored += record.rows
            rejected += len(refused)
            logger.info("shard %d: %d rows scored, %d rejected (%s)", index, record.rows, len(refused),
                        _shard_path(folder, index))
        manifest_written = write_manifest_if_complete(folder, settings, client.urls)
    return ScoreSummary(written, skipped, scored, rejected, manifest_written)


def _write_shard(folder: Path, index: int, kept: list[tuple[CompletionRow, TeacherScores | SampledScores]],
                 refused: list[dict[str, Any]], settings: CacheSettings, start: int, stop: int) -> ShardRecord:
    arrays = encode_shard([row for row, _ in kept], [scores for _, scores in kept], settings)
    path = _shard_path(folder, index)
    temporary = path.with_name(path.name + ".tmp")
    write_safetensors(temporary, arrays, {"format": "fastdistill-teacher-cache", "shard": str(index)})
    os.replace(temporary, path)
    record = ShardRecord(index=index, row_start=start, row_stop=stop, rows=len(kept),
                         tokens=int(arrays["token_offsets"][1][-1]),
                         completion_tokens=int(arrays["candidate_ids"][1].shape[0]), sha256=sha256_of_file(path),
                         settings=settings, rejected=refused)
    write_json_atomic(_record_path(folder, index), record.to_json())
    return record


def write_manifest_if_complete(folder: Path, settings: CacheSettings, teacher_urls: Sequence[str] = ()) -> bool:
    """Write ``manifest.json`` and ``rejected.jsonl`` when every shard of ``settings`` is finished; return whether
    it did. Each shard is checked against its record (checksum) and its arrays' sizes."""
    records = []
    for index in range(settings.num_shards):
        record = finished_record(folder, index)
        if record is None:
            return False
        map_safetensors(_shard_path(folder, index))  # raises on a truncated file
        records.append(record)
    with open(folder / (REJECTED_NAME + ".tmp"), "w") as handle:
        for record in records:
            for entry in record.rejected:
                handle.write(json.dumps(entry) + "\n")
    os.replace(folder / (REJECTED_NAME + ".tmp"), folder / REJECTED_NAME)
    shards = [{key: value for key, value in record.to_json().items() if key != "settings"} for record in records]
    dtypes = {"input_ids": settings.id_dtype, "candidate_ids": settings.id_dtype,
              "candidate_logprobs": settings.logprob_dtype, "token_offsets": "int64", "prompt_lengths": "int32",
              "dataset_index": "int64"}
    if settings.sampled:
        dtypes["candidate_counts"] = "uint8"
    manifest = {
        "format_version": settings.format_version,
        "settings": settings.to_json(),
        "teacher_urls": list(teacher_urls),
        "dtypes": dtypes,
        "empty_slot_id": sentinel_of(settings.id_dtype),
        "rows": sum(record.rows for record in records),
        "tokens": sum(record.tokens for record in records),
        "completion_tokens": sum(record.completion_tokens for record in records),
        "rejected_rows": sum(len(record.rejected) for record in records),
        "shards": shards,
    }
    write_json_atomic(folder / MANIFEST_NAME, manifest)
    return True
