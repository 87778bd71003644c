"""Reading a teacher cache: memory-mapped shards, verified against the manifest, served as :class:`RolloutSample`s.

A cached row becomes exactly the sample the rollout worker produces for the same prompt, completion and teacher
scores, with two fields that have no online meaning: ``model_version = -1`` (no student policy produced the
completion) and ``rollout_logprobs`` all NaN (the student's sampling log-probs do not exist for a completion taken
from a dataset, so anything that needs them, such as an importance ratio, fails visibly instead of using zeros).

A sampled cache's row carries its distinct drawn tokens as the candidates, with the log-weights log(count / S) as
the "teacher log-probs": with ``beta=0`` and ``add_tail_bucket=True`` the sparse JSD loss then carries the unbiased
sampled estimate of the forward-KL gradient (docs/estimators.md). The teacher's stored log-probs of the drawn tokens
are :meth:`TeacherCache.teacher_logprobs`, the counts :meth:`TeacherCache.counts`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fastdistill.cache.format import (
    ARRAY_NAMES,
    MANIFEST_NAME,
    READABLE_VERSIONS,
    SAMPLED_ARRAY_NAMES,
    CacheError,
    CacheSettings,
    ShardRecord,
    logprobs_from_storage,
    map_safetensors,
    sentinel_of,
    sha256_of_file,
    shard_stem,
    tokenizer_fingerprint,
)
from fastdistill.cache.sampled import log_weights
from fastdistill.errors import ConfigError
from fastdistill.rollout.prompt_table import PromptTable
from fastdistill.rollout.sample import RolloutSample

CACHE_TEACHER_ID = "default"  # the teacher id of every cached sample (one teacher per cache)


class _Shard:
    """One memory-mapped shard and the offsets of its rows."""

    def __init__(self, path: Path, record: ShardRecord):
        arrays, _ = map_safetensors(path)
        settings = record.settings
        missing = [name for name in (SAMPLED_ARRAY_NAMES if settings.sampled else ARRAY_NAMES) if name not in arrays]
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
                       and arrays["candidate_ids"].shape[1:] == (settings.candidate_width,)
                       and len(arrays["candidate_ids"]) == record.completion_tokens
                       and (not settings.sampled or arrays["candidate_counts"].shape == arrays["candidate_ids"].shape))
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
        if manifest.get("format_version") not in READABLE_VERSIONS:
            raise CacheError(f"{str(manifest_path)!r} has format version {manifest.get('format_version')!r}; this "
                             f"fastdistill reads versions {list(READABLE_VERSIONS)}")
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
    def candidate_mode(self) -> str:
        """``"topk"`` (the teacher's top-K per position) or ``"sampled"`` (S draws from the teacher per position)."""
        return self.settings.candidate_mode

    @property
    def candidate_width(self) -> int:
        """Candidate slots per completion position of every row: K + 1 (top-K) or S (sampled)."""
        return self.settings.candidate_width

    def check_loss_settings(self, *, beta: float, add_tail_bucket: bool) -> None:
        """Raise ConfigError when a sampled cache would train a biased loss: its rows estimate the forward KL
        (``beta=0``) only, and only with the tail bucket (without it the student is renormalised over the drawn
        tokens, so its mass on tokens not drawn gets no gradient). A top-K cache accepts any setting."""
        if not self.settings.sampled:
            return
        if beta != 0:
            raise ConfigError(
                f"teacher cache {str(self.folder)!r} holds sampled teacher candidates, which estimate the forward KL "
                f"(beta=0) only; beta={beta!r} would train a biased loss (the generalized JSD is not linear in the "
                "teacher distribution): set beta: 0, or score a top-K cache")
        if not add_tail_bucket:
            raise ConfigError(
                f"teacher cache {str(self.folder)!r} holds sampled teacher candidates, which need add_tail_bucket: "
                "true: without the tail bucket the student is renormalised over the drawn tokens, so its mass on "
                "the tokens not drawn gets no gradient (a biased estimate)")

    @property
    def teacher_model(self) -> str:
        """The teacher server's model id the rows were scored with."""
        return self.settings.teacher_model

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise ConfigError when ``tokenizer``'s fingerprint differs from the one the cache was scored with (the
        cached ids would mean other tokens)."""
        fingerprint = tokenizer_fingerprint(tokenizer)
        if fingerprint != self.settings.tokenizer_fingerprint:
            raise ConfigError(
                f"teacher cache {str(self.folder)!r} was scored with another tokenizer (fingerprint "
                f"{self.settings.tokenizer_fingerprint[:16]}…, this one {fingerprint[:16]}…): its token ids would "
                "mean other tokens; use the tokenizer the cache was scored with, or score the dataset again")

    def _locate(self, index: int) -> tuple[_Shard, int, slice]:
        """(shard, row within it, its completion positions' slice of the candidate arrays) of row ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a cache with {len(self)} rows")
        shard_number = int(np.searchsorted(self._row_starts, index, side="right")) - 1
        shard = self._shards[shard_number]
        row = index - int(self._row_starts[shard_number])
        return shard, row, slice(int(shard.completion_offsets[row]), int(shard.completion_offsets[row + 1]))

    def prompt_table(self) -> PromptTable:
        """Every row's prompt as a :class:`~fastdistill.data.PromptTable` (a mixed run generates from them), read
        from the shards' token arrays: only the prompt tokens are touched, not the candidates."""
        pieces, lengths = [], []
        for shard in self._shards:
            prompt_lengths = np.asarray(shard.arrays["prompt_lengths"], dtype=np.int64)
            starts = shard.token_offsets[:-1]
            # the token positions of every prompt, back to back: start_i + 0 .. start_i + length_i - 1
            within = np.arange(int(prompt_lengths.sum())) - np.repeat(np.cumsum(prompt_lengths) - prompt_lengths,
                                                                      prompt_lengths)
            pieces.append(np.asarray(shard.arrays["input_ids"])[np.repeat(starts, prompt_lengths) + within])
            lengths.append(prompt_lengths)
        lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths_all) + 1, np.int64)
        np.cumsum(lengths_all, out=offsets[1:])
        return PromptTable(np.concatenate(pieces) if pieces else np.zeros(0, np.int32), offsets)

    def teacher_logprobs(self, index: int) -> np.ndarray:
        """The stored teacher log-probs of row ``index``'s candidates, float32 (L, width), -inf in empty slots: in a
        sampled cache the teacher's log-probs of the drawn tokens (for the exact KL value Σ a·(log π_T − log π_θ)
        and metrics); in a top-K cache the same values as the sample's ``teacher_topk_logprobs``."""
        shard, _, positions = self._locate(index)
        return logprobs_from_storage(shard.arrays["candidate_logprobs"][positions], self.settings.logprob_dtype)

    def counts(self, index: int) -> np.ndarray:
        """How many of the S draws gave each candidate of row ``index`` (sampled caches only), int64 (L, S), 0 in
        empty slots; a position's counts sum to S."""
        if not self.settings.sampled:
            raise CacheError(f"teacher cache {str(self.folder)!r} holds top-K candidates: it has no draw counts")
        shard, _, positions = self._locate(index)
        return shard.arrays["candidate_counts"][positions].astype(np.int64)

    def __getitem__(self, index: int) -> RolloutSample:
        """Row ``index`` (0 <= index < len(self)) as a :class:`RolloutSample`: int32 ids, candidate ids with -1 in
        empty slots, float32 log-probs (-inf in empty slots), NaN rollout log-probs, ``model_version=-1``. In a
        sampled cache the log-probs are the draws' log-weights log(count / S) (see the module docstring)."""
        shard, row, positions = self._locate(index)
        arrays = shard.arrays
        tokens = arrays["input_ids"][shard.token_offsets[row] : shard.token_offsets[row + 1]].astype(np.int32)
        prompt_length = int(arrays["prompt_lengths"][row])
        stored_ids = arrays["candidate_ids"][positions]
        candidate_ids = stored_ids.astype(np.int32)
        candidate_ids[stored_ids == self._sentinel] = -1
        if self.settings.sampled:
            logprobs = log_weights(arrays["candidate_counts"][positions], int(self.settings.num_samples))
        else:
            logprobs = logprobs_from_storage(arrays["candidate_logprobs"][positions], self.settings.logprob_dtype)
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
