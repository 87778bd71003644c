"""Reading a teacher cache: memory-mapped shards, verified against the manifest, served as :class:`RolloutSample`s.

A cached row becomes exactly the sample the rollout worker produces for the same prompt, completion and teacher
scores, with two fields that have no online meaning: ``model_version = -1`` (no student policy produced the
completion) and ``rollout_logprobs`` all NaN (the student's sampling log-probs do not exist for a completion taken
from a dataset, so anything that needs them, such as an importance ratio, fails visibly instead of using zeros).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fastdistill.cache.format import (
    ARRAY_NAMES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    CacheError,
    CacheSettings,
    ShardRecord,
    config_error,
    logprobs_from_storage,
    map_safetensors,
    sentinel_of,
    sha256_of_file,
    shard_stem,
    tokenizer_fingerprint,
)
from fastdistill.rollout.sample import RolloutSample

CACHE_TEACHER_ID = "default"  # the teacher id of every cached sample (one teacher per cache)


class _Shard:
    """One memory-mapped shard and the offsets of its rows."""

    def __init__(self, path: Path, record: ShardRecord):
        arrays, _ = map_safetensors(path)
        missing = [name for name in ARRAY_NAMES if name not in arrays]
        if missing:
            raise CacheError(f"shard {str(path)!r} lacks the arrays {missing}")
        self.arrays = arrays
        self.token_offsets = np.asarray(arrays["token_offsets"], dtype=np.int64)
        prompt_lengths = np.asarray(arrays["prompt_lengths"], dtype=np.int64)
        rows = record.rows
        sizes_agree = (len(prompt_lengths) == rows and len(self.token_offsets) == rows + 1
                       and len(arrays["dataset_index"]) == rows
                       and self.token_offsets[-1] == len(arrays["input_ids"]) == record.tokens
                       and arrays["candidate_ids"].shape == arrays["candidate_logprobs"].shape
                       and arrays["candidate_ids"].shape[1:] == (record.settings.top_k + 1,)
                       and len(arrays["candidate_ids"]) == record.completion_tokens)
        if sizes_agree:
            self.completion_offsets = np.zeros(rows + 1, np.int64)
            np.cumsum(np.diff(self.token_offsets) - prompt_lengths, out=self.completion_offsets[1:])
            sizes_agree = self.completion_offsets[-1] == record.completion_tokens
        if not sizes_agree:
            raise CacheError(f"shard {str(path)!r} does not hold the {record.rows} rows and {record.tokens} tokens "
                             "its record describes (array sizes disagree)")


class TeacherCache:
    """A finished cache folder, read-only: ``len(cache)`` rows in dataset order, ``cache[i]`` the i-th as a
    :class:`RolloutSample` (``prompt_id = i``, ``dataset_index`` the scored dataset's row), iteration in order.

    Opening checks the manifest (format version, every shard present with the recorded size) and, with
    ``verify_checksums=True`` (the default; it reads every byte once), each shard's sha256. Raises
    :class:`CacheError` naming the folder or shard for a missing manifest or shard, a checksum mismatch or a
    truncated shard."""

    def __init__(self, folder: str | Path, *, verify_checksums: bool = True):
        self.folder = Path(folder)
        manifest_path = self.folder / MANIFEST_NAME
        if not manifest_path.is_file():
            raise CacheError(f"{str(self.folder)!r} is not a finished teacher cache: it has no {MANIFEST_NAME} (run "
                             "`fastdistill score` until every shard is scored)")
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError as error:
            raise CacheError(f"{str(manifest_path)!r} is not valid JSON: {error}") from error
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CacheError(f"{str(manifest_path)!r} has format version {manifest.get('format_version')!r}; this "
                             f"fastdistill reads version {FORMAT_VERSION}")
        self.manifest: dict[str, Any] = manifest
        self.settings = CacheSettings(**manifest["settings"])
        self.records = [ShardRecord.from_json({**entry, "settings": manifest["settings"]})
                        for entry in manifest["shards"]]
        self._shards: list[_Shard] = []
        for record in self.records:
            path = self.folder / record_file(record)
            if not path.is_file():
                raise CacheError(f"shard {str(path)!r} listed in the manifest is missing")
            if verify_checksums and (digest := sha256_of_file(path)) != record.sha256:
                raise CacheError(f"shard {str(path)!r} is corrupted: its sha256 is {digest}, the manifest records "
                                 f"{record.sha256}")
            self._shards.append(_Shard(path, record))
        self._row_starts = np.zeros(len(self.records) + 1, np.int64)
        np.cumsum([record.rows for record in self.records], out=self._row_starts[1:])
        self._sentinel = sentinel_of(self.settings.id_dtype)

    def __len__(self) -> int:
        return int(self._row_starts[-1])

    def __iter__(self) -> Iterator[RolloutSample]:
        for index in range(len(self)):
            yield self[index]

    @property
    def teacher_model(self) -> str:
        """The teacher server's model id the rows were scored with."""
        return self.settings.teacher_model

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise ConfigError when ``tokenizer``'s fingerprint differs from the one the cache was scored with (the
        cached ids would mean other tokens)."""
        fingerprint = tokenizer_fingerprint(tokenizer)
        if fingerprint != self.settings.tokenizer_fingerprint:
            raise config_error(
                f"teacher cache {str(self.folder)!r} was scored with another tokenizer (fingerprint "
                f"{self.settings.tokenizer_fingerprint[:16]}…, this one {fingerprint[:16]}…): its token ids would "
                "mean other tokens; use the tokenizer the cache was scored with, or score the dataset again")

    def __getitem__(self, index: int) -> RolloutSample:
        """Row ``index`` (0 <= index < len(self)) as a :class:`RolloutSample`: int32 ids, candidate ids with -1 in
        empty slots, float32 log-probs (-inf in empty slots), NaN rollout log-probs, ``model_version=-1``."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a cache with {len(self)} rows")
        shard_number = int(np.searchsorted(self._row_starts, index, side="right")) - 1
        shard = self._shards[shard_number]
        row = index - int(self._row_starts[shard_number])
        arrays = shard.arrays
        tokens = arrays["input_ids"][shard.token_offsets[row] : shard.token_offsets[row + 1]].astype(np.int32)
        prompt_length = int(arrays["prompt_lengths"][row])
        first, last = shard.completion_offsets[row], shard.completion_offsets[row + 1]
        stored_ids = arrays["candidate_ids"][first:last]
        candidate_ids = stored_ids.astype(np.int32)
        candidate_ids[stored_ids == self._sentinel] = -1
        logprobs = logprobs_from_storage(arrays["candidate_logprobs"][first:last], self.settings.logprob_dtype)
        completion_length = tokens.shape[0] - prompt_length
        return RolloutSample(
            input_ids=tokens,
            completion_mask=np.concatenate([np.zeros(prompt_length, np.int32), np.ones(completion_length, np.int32)]),
            teacher_topk_ids=candidate_ids,
            teacher_topk_logprobs=logprobs,
            rollout_logprobs=np.full(completion_length, np.nan, dtype=np.float32),
            model_version=-1,
            teacher_id=CACHE_TEACHER_ID,
            prompt_id=index,
            dataset_index=int(arrays["dataset_index"][row]),
        )


def record_file(record: ShardRecord) -> str:
    """The shard file name of ``record``."""
    return shard_stem(record.index) + ".safetensors"
