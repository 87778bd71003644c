"""Held-out evaluation through the servers: the student answers, the teacher scores, the trainer's model measures.

``collect_scored_samples`` runs the same two calls as a rollout (student generation, teacher scoring) for a list of
prompts; ``divergence_per_token`` computes the sparse generalized JSD of a model on those samples without a
gradient. Greedy decoding (``temperature=0``) makes before/after comparisons deterministic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fastdistill.data.packing import pack_row
from fastdistill.loss import narrow_support, sparse_jsd_loss
from fastdistill.rollout import RolloutSample, StudentClient, TeacherClient


async def _collect(student_url: str, teacher_urls: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                   top_k: int, max_tokens: int, temperature: float, seed: int, student_api_key: str | None,
                   teacher_api_keys: Mapping[str, str] | None, student_model: str | None) -> list[RolloutSample]:
    keys = teacher_api_keys or {}
    async with StudentClient(student_url, api_key=student_api_key) as student:
        teachers = {tid: TeacherClient(url, api_key=keys.get(tid)) for tid, url in teacher_urls.items()}
        try:
            default_teacher = next(iter(teachers))

            async def one(index: int, row: Mapping[str, Any]) -> RolloutSample:
                prompt = [int(t) for t in row["prompt_ids"]]
                generation = await student.generate(prompt, max_tokens=max_tokens, temperature=temperature,
                                                    seed=seed + index, model=student_model)
                teacher_id = row.get("teacher_id") or default_teacher
                scores = await teachers[teacher_id].score(prompt, generation.token_ids, top_k=top_k)
                return RolloutSample.assemble(prompt, generation, scores, model_version=-1, teacher_id=teacher_id,
                                              prompt_id=index, dataset_index=index, prompt=row.get("prompt"))

            return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))
        finally:
            for teacher in teachers.values():
                await teacher.close()


def collect_scored_samples(
    student_url: str,
    teacher_urls: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    top_k: int,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    student_api_key: str | None = None,
    teacher_api_keys: Mapping[str, str] | None = None,
    student_model: str | None = None,
) -> list[RolloutSample]:
    """One scored sample per row ``{"prompt_ids", "teacher_id"?}``: the student server's completion (greedy by
    default) scored by the row's teacher (the first teacher when the row names none). ``teacher_urls`` maps teacher
    id to a URL or a list of replica URLs; API keys as in :class:`~fastdistill.train.AsyncDistillationConfig`.
    ``student_model`` names what the student generates with (a LoRA adapter's name; None: the served model)."""
    return asyncio.run(_collect(student_url, teacher_urls, rows, top_k, max_tokens, temperature, seed,
                                student_api_key, teacher_api_keys, student_model))


@torch.no_grad()
def divergence_per_token(model: torch.nn.Module, samples: Sequence[RolloutSample], teacher_ids: Sequence[str], *,
                         beta: float = 0.0, temperature: float = 1.0, add_tail_bucket: bool = True) -> float:
    """Mean over scored completion tokens of the sparse generalized JSD between ``model`` (a Hugging Face causal
    LM) and the teacher candidates of ``samples`` (nats/token)."""
    samples = [s for s in samples if len(s.completion_ids) > 0]
    if not samples:
        raise ValueError("no sample has a completion token to score")
    row = pack_row(samples, teacher_ids).to(next(model.parameters()).device)
    hidden = model.base_model(input_ids=row.input_ids, position_ids=row.position_ids,
                              use_cache=False).last_hidden_state[0]
    ids, lps, mask = narrow_support(row.candidate_ids, row.candidate_logprobs, row.actual_ids, beta)
    head = model.get_output_embeddings()
    out = sparse_jsd_loss(hidden.index_select(0, row.target_positions).float(), head.weight.float(), ids, lps, mask,
                          bias=None if head.bias is None else head.bias.float(), beta=beta, temperature=temperature,
                          add_tail_bucket=add_tail_bucket)
    return float(out.jsd_sum) / max(int(out.num_tokens), 1)
