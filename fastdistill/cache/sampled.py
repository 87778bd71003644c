"""The sampled cache mode: the teacher's full distribution at every completion position, S tokens drawn from it.

The teacher server is asked for ``prompt_logprobs=-1`` (vLLM: every token of the vocabulary; the server must run
with ``--max-logprobs -1``, as ``fastdistill serve-teacher`` does). At each completion position S tokens are drawn
i.i.d. from the teacher (proposal temperature 1, so a drawn token's weight is exactly count / S) with
:func:`fastdistill.loss.sample_teacher_candidates`, from a ``torch.Generator`` seeded by (seed, dataset row index):
a resumed or re-sharded run draws the same tokens from the same teacher log-probs. What is stored per position:
the distinct drawn ids, their counts (uint8) and the teacher's log-probs of them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdistill.cache.format import MAX_NUM_SAMPLES
from fastdistill.errors import ConfigError, VLLMRequestError, VLLMResponseError

FULL_VOCABULARY = -1  # vLLM's prompt_logprobs value for every token of the vocabulary
MASS_TOLERANCE = 1e-3  # |sum of returned probabilities - 1| above this: not the full distribution


@dataclass(frozen=True)
class SampledScores:
    """One row's sampled candidates, (L, S) each: ``candidate_ids`` int32 (distinct drawn ids ascending, -1 in
    empty slots), ``counts`` uint8 (draws per id, summing to S per position; 0 in empty slots) and ``logprobs``
    float32 (the teacher's log-probs of the ids as the server sent them, nats; -inf in empty slots)."""

    candidate_ids: np.ndarray
    counts: np.ndarray
    logprobs: np.ndarray


def check_num_samples(num_samples: Any) -> None:
    """ConfigError unless 1 <= ``num_samples`` <= 255 (counts are stored as uint8)."""
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise ConfigError(f"--num-samples must be an int in [1, {MAX_NUM_SAMPLES}] (counts are stored as uint8), "
                           f"got {num_samples!r}")


def row_seed(seed: int, dataset_index: int) -> int:
    """The 63-bit generator seed of dataset row ``dataset_index`` under the run's ``seed`` (a hash of both, so
    rows draw independently and a row's draws do not depend on which run, shard or order scored it)."""
    digest = hashlib.sha256(f"fastdistill-sampled-cache:{int(seed)}:{int(dataset_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def draw_candidates(teacher_logprobs: np.ndarray, num_samples: int, seed: int, dataset_index: int) -> SampledScores:
    """Draw ``num_samples`` tokens per position from ``teacher_logprobs`` (L, V) float32 (full-vocabulary log-probs,
    -inf = no mass) with the generator of (``seed``, ``dataset_index``), merged into distinct ids and counts; the
    teacher log-probs returned are the input's values at the drawn ids (not renormalised)."""
    import torch  # here, not at the top: `fastdistill score` of top-K candidates starts without torch

    from fastdistill.loss import sample_teacher_candidates

    length = teacher_logprobs.shape[0]
    if length == 0:
        return SampledScores(np.full((0, num_samples), -1, np.int32), np.zeros((0, num_samples), np.uint8),
                             np.full((0, num_samples), -np.inf, np.float32))
    generator = torch.Generator().manual_seed(row_seed(seed, dataset_index))
    dense = torch.from_numpy(np.ascontiguousarray(teacher_logprobs, dtype=np.float32))
    drawn = sample_teacher_candidates(dense, num_samples, generator=generator)
    ids = drawn.ids.numpy()
    used = ids >= 0
    logprobs = np.where(used, np.take_along_axis(teacher_logprobs, np.maximum(ids, 0), axis=1), -np.inf)
    return SampledScores(ids.astype(np.int32), drawn.counts.numpy().astype(np.uint8), logprobs.astype(np.float32))


def parse_full_prompt_logprobs(url: str, per_position: Any, prompt_length: int, completion_length: int,
                               vocab_size: int) -> np.ndarray:
    """vLLM's ``choices[0].prompt_logprobs`` of a ``prompt_logprobs=-1`` request as dense log-probs (L, vocab_size)
    float32 over the completion positions (-inf for a token the answer does not list; NaN is read as -inf).

    Raises ConfigError for a token id at or beyond ``vocab_size`` (another vocabulary) and for an answer whose
    probabilities do not sum to 1 (a server that truncated the distribution); VLLMResponseError when malformed."""
    if not isinstance(per_position, list) or len(per_position) != prompt_length + completion_length:
        raise VLLMResponseError(f"{url}: expected prompt_logprobs with {prompt_length + completion_length} entries, "
                                f"got {per_position!r:.300}")
    dense = np.full((completion_length, vocab_size), -np.inf, dtype=np.float32)
    for row, entry in enumerate(per_position[prompt_length:]):
        if not isinstance(entry, dict) or not entry:
            raise VLLMResponseError(f"{url}: no prompt_logprobs at completion position {row}: {entry!r:.300}")
        try:
            ids = np.fromiter((int(token) for token in entry), dtype=np.int64, count=len(entry))
            values = np.fromiter((float(candidate["logprob"]) for candidate in entry.values()), dtype=np.float64,
                                 count=len(entry))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise VLLMResponseError(f"{url}: malformed prompt_logprobs entry at completion position {row}") from error
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ConfigError(f"the teacher returned token id {int(ids.max())}, outside the tokenizer's {vocab_size} "
                               "ids: the teacher uses another vocabulary than the tokenizer given to `fastdistill "
                               "score`")
        values[np.isnan(values)] = -np.inf
        mass = float(np.exp(values).sum())
        if abs(mass - 1.0) > MASS_TOLERANCE:
            raise ConfigError(
                f"the teacher server ({url}) returned {len(entry)} log-probs holding {mass:.6f} of the probability "
                f"mass at completion position {row}, not the full distribution over {vocab_size} tokens that "
                "--candidates sampled draws from: serve the teacher with `--max-logprobs -1` (fastdistill "
                "serve-teacher does)")
        dense[row, ids] = values.astype(np.float32)
    return dense


def _refused_full_vocabulary(url: str, error: VLLMRequestError) -> Exception:
    return ConfigError(
        f"the teacher server ({url}) refuses full-vocabulary prompt_logprobs (prompt_logprobs=-1), which --candidates "
        f"sampled needs: HTTP {error.status}: {error.server_message[:300]}. Start it with `--max-logprobs -1` "
        "(fastdistill serve-teacher does)")


async def score_full(client: Any, prompt_ids: list[int], completion_ids: list[int], vocab_size: int) -> np.ndarray:
    """The teacher's full-vocabulary log-probs (L, vocab_size) float32 at every completion position of one row,
    teacher-forced through ``prompt_logprobs=-1`` on a :class:`~fastdistill.rollout.TeacherClient` (replicas,
    retries and failover as for top-K scoring). Raises VLLMRequestError when the server refuses the row."""
    url, per_position = await client.prompt_logprobs([*prompt_ids, *completion_ids], FULL_VOCABULARY)
    return parse_full_prompt_logprobs(url, per_position, len(prompt_ids), len(completion_ids), vocab_size)


async def check_full_distribution(client: Any, probe_ids: list[int], vocab_size: int) -> None:
    """Before scoring: the teacher answers a ``prompt_logprobs=-1`` request for ``probe_ids`` (at least 2 tokens)
    with its whole distribution; ConfigError naming ``--max-logprobs -1`` otherwise."""
    try:
        await score_full(client, probe_ids[:1], probe_ids[1:], vocab_size)
    except VLLMRequestError as error:
        if error.status == 400 and "logprobs" in error.server_message.lower():
            raise _refused_full_vocabulary(error.url, error) from error
        raise


def log_weights(counts: np.ndarray, num_samples: int) -> np.ndarray:
    """log(count / S) as float32, -inf where the count is 0: the weights of draws from the teacher itself (computed
    as :func:`fastdistill.loss.sample_teacher_candidates` computes them, in float64 then rounded)."""
    counts = np.asarray(counts)
    with np.errstate(divide="ignore"):
        weights = np.log(counts.astype(np.float64)) - math.log(num_samples)
    return weights.astype(np.float32)
