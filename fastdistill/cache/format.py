"""The on-disk format of a teacher cache: safetensors shards of flat arrays, a JSON sidecar per shard, a manifest.

A cache folder holds, for shard ``s`` (5-digit, zero-padded):

- ``shard-00000.safetensors``: one shard's rows as flat arrays (R rows, T = sum of their P+L tokens, C = sum of
  their L completion tokens, W = K + 1 candidate slots):

  - ``input_ids`` (T,) uint16 when the vocabulary has at most 65535 ids, else int32: each row's prompt then
    completion ids, rows one after another;
  - ``token_offsets`` (R+1,) int64: row r's tokens are ``input_ids[token_offsets[r]:token_offsets[r+1]]``;
  - ``prompt_lengths`` (R,) int32: P of each row;
  - ``candidate_ids`` (C, W), the id dtype: the teacher's top-K per completion position by rank, then the realised
    token when it is outside the top-K; empty slots hold the sentinel (65535 for uint16, -1 for int32);
  - ``candidate_logprobs`` (C, W) float16 (default) or bfloat16: natural-log probabilities, -inf in empty slots;
  - ``dataset_index`` (R,) int64: each row's index in the scored dataset.

  In the sampled mode (``candidate_mode = "sampled"``, W = S = ``num_samples``) ``candidate_ids`` holds the distinct
  tokens of S i.i.d. draws from the teacher per completion position (ascending id), ``candidate_counts`` (C, S)
  uint8 how many draws gave each (a position's counts sum to S; 0 in empty slots) and ``candidate_logprobs`` the
  teacher's log-probs of those tokens; the realised token has no slot of its own.

  Row r's candidate rows start at its tokens' start minus the prompt lengths of the rows before it (the candidate
  arrays hold completion positions only); the reader derives them from ``token_offsets`` and ``prompt_lengths``.
- ``shard-00000.json``: that shard's dataset row range, row and token counts, rejected rows, the settings it was
  scored with and the sha256 of the shard file (written after the shard, so its presence marks a finished shard).
- ``manifest.json``: the format version (1: top-K, unchanged since the first version; 2: sampled), the cache's
  settings and every shard's range and checksum, written once all shards exist.
- ``rejected.jsonl``: the rows the teacher server refused, one JSON object per line with the server's message.

Log-prob precision: float16 keeps 11 significant bits, so a stored log-prob differs from the teacher's float32 value
by at most 2**-11 of its magnitude (round to nearest; |x| >= 2**-14), e.g. <= 0.0078 at -20; values below -65504
become -inf. bfloat16 keeps 8 bits: <= 2**-8 relative. The files are standard safetensors (any safetensors reader,
e.g. ``safetensors.torch.load_file``, loads them); this module reads them by memory-mapping the data section.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastdistill.errors import CacheError

FORMAT_VERSION = 1  # top-K caches (unchanged since version 1, so older readers still read them)
SAMPLED_FORMAT_VERSION = 2  # version 2 adds the sampled mode (settings num_samples, proposal_temperature, seed)
READABLE_VERSIONS = (FORMAT_VERSION, SAMPLED_FORMAT_VERSION)
MAX_NUM_SAMPLES = 255  # counts are uint8
MANIFEST_NAME = "manifest.json"
REJECTED_NAME = "rejected.jsonl"
UINT16_MAX_VOCAB = 65535  # uint16 ids 0..65534; 65535 is the empty-slot sentinel
ARRAY_NAMES = ("input_ids", "token_offsets", "prompt_lengths", "candidate_ids", "candidate_logprobs", "dataset_index")
SAMPLED_ARRAY_NAMES = (*ARRAY_NAMES, "candidate_counts")

_SAFETENSORS_DTYPES = {"uint8": "U8", "uint16": "U16", "int32": "I32", "int64": "I64", "float16": "F16",
                       "bfloat16": "BF16"}
_NUMPY_OF_SAFETENSORS = {"U8": np.uint8, "U16": np.uint16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
                         "BF16": np.uint16}


def id_dtype_for(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits below the uint16 sentinel, else ``"int32"``."""
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "int32"


def sentinel_of(id_dtype: str) -> int:
    """The empty-slot id stored in ``candidate_ids``: 65535 for uint16, -1 for int32."""
    return 65535 if id_dtype == "uint16" else -1


def shard_stem(index: int) -> str:
    """``shard-00007`` for shard 7."""
    return f"shard-{index:05d}"


def sha256_of_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of what makes token ids mean the same text: the vocabulary (token -> id, added tokens
    included), the special tokens and the chat template. Two tokenizers with equal fingerprints encode alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(token) for token in getattr(tokenizer, "all_special_tokens", []))
    template = getattr(tokenizer, "chat_template", None)
    payload = json.dumps({"vocab": vocab, "special_tokens": special, "chat_template": template},
                         ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(values)
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def logprobs_to_storage(logprobs: np.ndarray, logprob_dtype: str) -> np.ndarray:
    """float32 log-probs in their stored representation: float16 values, or bfloat16 bit patterns as uint16."""
    if logprob_dtype == "float16":
        with np.errstate(over="ignore"):  # below -65504 is -inf, as documented
            return np.asarray(logprobs, dtype=np.float32).astype(np.float16)
    return to_bfloat16_bits(logprobs)


def logprobs_from_storage(stored: np.ndarray, logprob_dtype: str) -> np.ndarray:
    """Stored log-probs (see :func:`logprobs_to_storage`) as float32, exactly."""
    if logprob_dtype == "float16":
        return np.asarray(stored, dtype=np.float16).astype(np.float32)
    return from_bfloat16_bits(stored)


def write_safetensors(path: Path, arrays: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> None:
    """Write ``arrays`` (name -> (dtype name, array already in that representation)) as one safetensors file.

    The dtype names are ``uint16``, ``int32``, ``int64``, ``float16`` and ``bfloat16`` (its array holds bit
    patterns as uint16). The file is written to ``path`` directly; callers write to a temporary name and rename."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    blobs = []
    for name, (dtype, array) in arrays.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for data in blobs:
            handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def map_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Memory-map a safetensors file: (name -> read-only numpy view, metadata). bfloat16 arrays come back as their
    uint16 bit patterns. Raises :class:`CacheError` for a file that is missing, truncated or not safetensors."""
    if not path.is_file():
        raise CacheError(f"shard {str(path)!r} is missing")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CacheError(f"shard {str(path)!r} is truncated: {size} bytes, not even a safetensors header")
        (header_length,) = struct.unpack("<Q", head)
        if 8 + header_length > size:
            raise CacheError(f"shard {str(path)!r} is truncated: its header needs {8 + header_length} bytes, the file "
                             f"has {size}")
        try:
            header = json.loads(handle.read(header_length))
        except ValueError as error:
            raise CacheError(f"shard {str(path)!r} is not a safetensors file (unreadable header)") from error
    metadata = header.pop("__metadata__", {}) or {}
    data_start = 8 + header_length
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if data_start + end > size:
        raise CacheError(f"shard {str(path)!r} is truncated: its arrays need {data_start + end} bytes, the file has "
                         f"{size}")
    whole = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    arrays = {}
    for name, entry in header.items():
        start, stop = entry["data_offsets"]
        dtype = np.dtype(_NUMPY_OF_SAFETENSORS[entry["dtype"]])
        arrays[name] = whole[data_start + start : data_start + stop].view(dtype).reshape(entry["shape"])
    return arrays, metadata


@dataclass(frozen=True)
class CacheSettings:
    """What every shard of one cache shares; a resumed or extended run must match it exactly.

    ``teacher_model``: the id the teacher server reports in ``/v1/models``; ``vocab_size``: ids are < this;
    ``top_k``: K (candidate width K + 1; 0 in the sampled mode); ``candidate_mode``: ``"topk"`` or ``"sampled"``;
    ``rows_per_shard``: dataset rows per shard (the last shard may hold fewer); ``dataset_rows``: rows of the
    scored dataset. Sampled mode only (None for top-K, and then left out of the JSON): ``num_samples`` S (the
    candidate width), ``proposal_temperature`` (1.0: draws from the teacher itself) and ``seed``."""

    teacher_model: str
    tokenizer_fingerprint: str
    vocab_size: int
    top_k: int
    candidate_mode: str
    id_dtype: str
    logprob_dtype: str
    rows_per_shard: int
    dataset_rows: int
    num_samples: int | None = None
    proposal_temperature: float | None = None
    seed: int | None = None

    @property
    def sampled(self) -> bool:
        """Whether the cache holds sampled candidates (else the teacher's top-K)."""
        return self.candidate_mode == "sampled"

    @property
    def candidate_width(self) -> int:
        """Candidate slots per completion position: K + 1 (top-K), S (sampled)."""
        return int(self.num_samples) if self.sampled else self.top_k + 1

    @property
    def format_version(self) -> int:
        """The format version a cache with these settings is written as: 1 for top-K, 2 for sampled."""
        return SAMPLED_FORMAT_VERSION if self.sampled else FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict, without the sampled-mode fields of a top-K cache (so a top-K cache
        reads exactly as format version 1)."""
        return {key: value for key, value in asdict(self).items() if value is not None or key not in _SAMPLED_KEYS}

    @property
    def num_shards(self) -> int:
        """Shards covering the dataset: ceil(dataset_rows / rows_per_shard)."""
        return -(-self.dataset_rows // self.rows_per_shard)

    def row_range(self, shard: int) -> tuple[int, int]:
        """The dataset rows [start, stop) shard ``shard`` covers."""
        start = shard * self.rows_per_shard
        return start, min(self.dataset_rows, start + self.rows_per_shard)

    def differences(self, other: CacheSettings) -> list[str]:
        """``name: <self's value> != <other's value>`` for every differing setting."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: {mine[key]!r} != {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]


_SAMPLED_KEYS = ("num_samples", "proposal_temperature", "seed")


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard (its ``shard-NNNNN.json``): dataset rows [row_start, row_stop), ``rows`` stored (the
    others were rejected, listed in ``rejected`` as {"dataset_index", "message"}), ``tokens`` (P+L summed),
    ``completion_tokens`` (L summed), and the sha256 of the shard file."""

    index: int
    row_start: int
    row_stop: int
    rows: int
    tokens: int
    completion_tokens: int
    sha256: str
    settings: CacheSettings
    rejected: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (settings nested, see :meth:`CacheSettings.to_json`)."""
        return {**asdict(self), "settings": self.settings.to_json()}

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> ShardRecord:
        """The record of a :meth:`to_json` dict."""
        values = dict(payload)
        values["settings"] = CacheSettings(**values["settings"])
        return cls(**values)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write ``payload`` as JSON to ``path`` through a temporary file and a rename (never a half-written file)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        json.dump(payload, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
