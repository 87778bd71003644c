"""Scored samples made in-process (no server): random prompts and completions scored by a local teacher model.

They have exactly the layout the rollout worker produces (completion-only (L, K+1) candidate arrays: top-K by rank,
then the realised token when it is outside the top-K), so trainer tests and offline replays need no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastdistill.rollout import RolloutSample


@torch.no_grad()
def score_completion(teacher: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int],
                     top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher candidates for each completion token: int32 ids and float32 log-probs, (L, K+1) each."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = teacher(ids, use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # position t predicts token t+1
    targets = torch.tensor(list(completion))
    top_logprobs, top_ids = logprobs.topk(top_k, dim=-1)
    in_top = (top_ids == targets[:, None]).any(dim=-1)
    extra_ids = torch.where(in_top, -1, targets)
    extra_logprobs = torch.where(in_top, float("-inf"), logprobs.gather(1, targets[:, None]).squeeze(1))
    candidate_ids = torch.cat([top_ids, extra_ids[:, None]], dim=1).to(torch.int32).numpy()
    candidate_logprobs = torch.cat([top_logprobs, extra_logprobs[:, None]], dim=1).numpy().astype(np.float32)
    return candidate_ids, candidate_logprobs


def synthetic_samples(
    teacher: torch.nn.Module,
    vocab_size: int,
    num_samples: int,
    *,
    top_k: int = 4,
    prompt_lengths: tuple[int, int] = (3, 8),
    completion_lengths: tuple[int, int] = (2, 10),
    teacher_ids: Sequence[str] = ("default",),
    seed: int = 0,
    first_token: int = 3,
) -> list[RolloutSample]:
    """``num_samples`` samples with uniformly drawn lengths (inclusive ranges) and token ids in
    ``[first_token, vocab_size)``; sample i has ``prompt_id = i`` and teacher ``teacher_ids[i % len]``."""
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(num_samples):
        prompt = rng.integers(first_token, vocab_size, rng.integers(prompt_lengths[0], prompt_lengths[1] + 1))
        completion = rng.integers(first_token, vocab_size,
                                  rng.integers(completion_lengths[0], completion_lengths[1] + 1))
        ids, logprobs = score_completion(teacher, prompt.tolist(), completion.tolist(), top_k)
        samples.append(RolloutSample(
            input_ids=np.concatenate([prompt, completion]).astype(np.int32),
            completion_mask=np.concatenate([np.zeros(len(prompt)), np.ones(len(completion))]).astype(np.int32),
            teacher_topk_ids=ids,
            teacher_topk_logprobs=logprobs,
            rollout_logprobs=np.full(len(completion), -1.0, dtype=np.float32),
            model_version=0,
            teacher_id=teacher_ids[index % len(teacher_ids)],
            prompt_id=index,
            dataset_index=index,
        ))
    return samples
