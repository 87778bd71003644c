"""Check that a sync took: compare the server's log-probs with the trainer's."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdistill.sync.http import request


def served_logprob_gap(
    base_url: str,
    model: torch.nn.Module,
    prompt_ids_list: Sequence[Sequence[int]],
    served_model_name: str | None = None,
    *,
    timeout_s: float = 120.0,
    api_key: str | None = None,
) -> float:
    """Max |served - trainer| log-prob of the realised prompt tokens, over all prompts (nats).

    The server's side comes from one ``POST /v1/completions`` with every prompt, ``max_tokens=1`` and
    ``prompt_logprobs=0``; the trainer's from ``log_softmax`` of ``model``'s fp32 logits on the same ids (positions
    1..L-1 of each prompt). Run it on every rank if the model is FSDP-sharded (the forward is collective). After a
    sync the gap should be at the level of kernel noise (~1e-6 on CPU in fp32; a bf16 server is coarser).
    ``served_model_name``: the ``model`` field of the request (default: the first model of ``GET /v1/models``, one
    more request). ``api_key``: the server's key.
    """
    base_url = base_url.rstrip("/")
    prompts = [[int(token) for token in prompt] for prompt in prompt_ids_list]
    if any(len(ids) < 2 for ids in prompts):
        raise ValueError("each prompt needs at least two tokens (the first has no log-prob)")
    if not prompts:
        return 0.0
    if served_model_name is None:
        models = request("GET", base_url, "/v1/models", timeout_s=timeout_s, api_key=api_key)
        served_model_name = models["data"][0]["id"]
    body = {"model": served_model_name, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    answer = request("POST", base_url, "/v1/completions", body, timeout_s=timeout_s, api_key=api_key)
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    device = next(model.parameters()).device
    gap = 0.0
    for ids, choice in zip(prompts, choices, strict=True):
        served_positions = choice["prompt_logprobs"]
        served = torch.tensor(
            [float(served_positions[i][str(token)]["logprob"]) for i, token in enumerate(ids) if i > 0],
            dtype=torch.float64,
        )
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
        gap = max(gap, (served - expected[:, 0].double().cpu()).abs().max().item())
    return gap
