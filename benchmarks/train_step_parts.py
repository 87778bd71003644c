"""The parts of ``bench_train_step.py``: model shapes, the in-process teacher cache, the phase timer, the plain
cross-entropy floor, the packed-attention check and the predicted cost split.

Nothing here reaches a hub or a server: models are built from configs written below (random weights), the teacher
cache is scored by a synthetic teacher in this process and written with fastdistill's own cache writer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# Real configurations (Qwen2.5-0.5B and -1.5B as published: tied embeddings, qkv bias), and a tiny one for the CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Workload:
    """Sample lengths (inclusive ranges, tokens), the packed row's token budget and the synthetic teacher's
    sub-vocabulary (the ids its text uses)."""

    prompt: tuple[int, int]
    completion: tuple[int, int]
    token_budget: int
    used_vocab: int


WORKLOADS = {"gpu": Workload(prompt=(64, 256), completion=(512, 2048), token_budget=8192, used_vocab=4096),
             "tiny": Workload(prompt=(4, 12), completion=(16, 48), token_budget=256, used_vocab=256)}


def build_model(shape: str, device: torch.device, attn_implementation: str, seed: int = 0) -> nn.Module:
    """A Qwen2 causal LM of ``shape`` with random weights, float32 master weights, built on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], use_cache=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    return model


# ------------------------------------------------------------------------------------------------ the teacher cache
class SyntheticTeacher:
    """A peaked bigram teacher over ``used`` ids of a ``vocab_size`` vocabulary: after token x its top-K are
    ``used[(a_x + k·b_x) mod n]`` with probabilities ∝ 2^-k holding 90 % of the mass, the rest spread over the used
    ids. Learnable (the student sees x), so a few steps lower the loss; realistic in shape (peaked, K ≪ V)."""

    def __init__(self, vocab_size: int, used_vocab: int, top_k: int, seed: int):
        rng = np.random.default_rng(seed)
        self.vocab_size, self.top_k = vocab_size, top_k
        self.used = rng.choice(vocab_size, size=used_vocab, replace=False).astype(np.int64)
        self.offset = rng.integers(0, used_vocab, vocab_size)
        self.stride = 1 + 2 * rng.integers(0, used_vocab // 2, vocab_size)  # odd: K distinct ids when n is even
        probs = 0.5 ** np.arange(top_k)
        self.top_logprobs = np.log(0.9 * probs / probs.sum()).astype(np.float32)
        self.tail_logprob = float(np.log(0.1 / used_vocab))
        self.cumulative = np.cumsum(0.9 * probs / probs.sum())

    def candidates(self, previous: np.ndarray) -> np.ndarray:
        """(L, K) top-K ids after each token of ``previous``."""
        k = np.arange(self.top_k)
        return self.used[(self.offset[previous][:, None] + k * self.stride[previous][:, None]) % len(self.used)]

    def sample(self, rng: np.random.Generator, prompt_length: int, completion_length: int) -> tuple[list, list]:
        """A prompt of used ids and a completion drawn from the teacher, token by token."""
        prompt = self.used[rng.integers(0, len(self.used), prompt_length)].tolist()
        draws, tails = rng.random(completion_length), rng.integers(0, len(self.used), completion_length)
        n, previous, completion = len(self.used), prompt[-1], []
        for draw, tail in zip(draws.tolist(), tails.tolist(), strict=True):
            rank = int(np.searchsorted(self.cumulative, draw, side="right"))
            index = tail if rank >= self.top_k else (self.offset[previous] + rank * self.stride[previous]) % n
            previous = int(self.used[index])
            completion.append(previous)
        return prompt, completion

    def scores(self, prompt: list, completion: list) -> Any:
        """The cache's (L, K+1) candidates: the top-K and, when the realised token is not among them, it in the
        extra slot with its tail log-prob (else -1 / -inf), as ``fastdistill score`` stores them."""
        from fastdistill.rollout.decode import TeacherScores

        previous = np.asarray(prompt[-1:] + completion[:-1], dtype=np.int64)
        top = self.candidates(previous)
        actual = np.asarray(completion, dtype=np.int64)
        outside = ~(top == actual[:, None]).any(axis=1)
        ids = np.concatenate([top, np.where(outside, actual, -1)[:, None]], axis=1).astype(np.int32)
        logprobs = np.concatenate([np.broadcast_to(self.top_logprobs, top.shape),
                                   np.where(outside, self.tail_logprob, -np.inf)[:, None]], axis=1)
        return TeacherScores(ids, logprobs.astype(np.float32))


def write_teacher_cache(folder: Path, tokenizer: Any, vocab_size: int, top_k: int, rows: int, workload: Workload,
                        seed: int = 0) -> Path:
    """A finished top-K teacher cache of ``rows`` synthetic rows in ``folder``, written by fastdistill's cache writer
    (one shard, its record and the manifest); the tokenizer's fingerprint is the run's."""
    from fastdistill.cache.format import CacheSettings, id_dtype_for, tokenizer_fingerprint
    from fastdistill.cache.score import CompletionRow, _write_shard, write_manifest_if_complete

    teacher = SyntheticTeacher(vocab_size, workload.used_vocab, top_k, seed)
    rng = np.random.default_rng(seed + 1)
    kept = []
    for index in range(rows):
        prompt, completion = teacher.sample(rng, int(rng.integers(workload.prompt[0], workload.prompt[1] + 1)),
                                            int(rng.integers(workload.completion[0], workload.completion[1] + 1)))
        kept.append((CompletionRow(index, prompt, completion), teacher.scores(prompt, completion)))
    settings = CacheSettings(teacher_model="synthetic-bigram", tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                             vocab_size=vocab_size, top_k=top_k, candidate_mode="topk",
                             id_dtype=id_dtype_for(vocab_size), logprob_dtype="float16", rows_per_shard=rows,
                             dataset_rows=rows)
    folder.mkdir(parents=True, exist_ok=True)
    _write_shard(folder, 0, kept, [], settings, 0, rows)
    if not write_manifest_if_complete(folder, settings):
        raise RuntimeError(f"the teacher cache in {folder} did not complete")
    return folder


# ------------------------------------------------------------------------------------------------ the phase timer
class PhaseTimer:
    """Marks a training step's phase boundaries from hooks, with CUDA events on a GPU (no synchronisation inside the
    step) or the host clock on a CPU: per micro-batch ``start`` (model forward begins), ``backbone`` (backbone
    forward ends), ``loss`` (the loss's forward ends), ``dh`` (the gradient of the backbone's output is ready: the
    loss's backward ends), ``embed`` (the gradient reaches the embeddings: the backbone's backward ends); per step
    ``opt0`` / ``opt1`` around the optimizer step, which closes the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.current: dict[str, list] = {}
        self.steps: list[dict[str, list]] = []
        self.handles: list[Any] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self.current.setdefault(name, []).append(event)

    def close_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}

    def attach(self, wrapper: nn.Module | None, backbone: nn.Module, embeddings: nn.Module, optimizer: Any,
               on_row: Callable[[Any], None] | None = None) -> None:
        """Hooks on the trainer's model ``wrapper`` (None: the caller marks ``start`` and ``loss`` itself), its
        ``backbone`` and input ``embeddings``, and the ``optimizer``; ``on_row`` gets each packed row forwarded."""

        def grad_mark(name: str) -> Callable:
            def hook(grad: torch.Tensor) -> None:
                self.mark(name)
            return hook

        def backbone_end(module, args, output) -> None:
            self.mark("backbone")
            if output.last_hidden_state.requires_grad:
                output.last_hidden_state.register_hook(grad_mark("dh"))

        def embed_end(module, args, output) -> None:
            if output.requires_grad:
                output.register_hook(grad_mark("embed"))

        if wrapper is not None:
            def wrapper_start(module, args) -> None:
                if on_row is not None:
                    on_row(args[0])
                self.mark("start")
            self.handles += [wrapper.register_forward_pre_hook(wrapper_start),
                             wrapper.register_forward_hook(lambda module, args, output: self.mark("loss"))]
        self.handles += [backbone.register_forward_hook(backbone_end), embeddings.register_forward_hook(embed_end),
                         optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.mark("opt0")),
                         optimizer.register_step_post_hook(lambda opt, args, kwargs: (self.mark("opt1"),
                                                                                       self.close_step()))]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def phases(self, index: int) -> dict[str, float]:
        """Seconds of step ``index``: ``backbone_fwd``, ``loss`` (forward + backward), ``backbone_bwd`` and
        ``optimizer`` (a step whose embeddings get no gradient ends its backward at the optimizer)."""
        if self.cuda:
            torch.cuda.synchronize()
        step = self.steps[index]
        ends = step.get("embed") or [step["opt0"][0]] * len(step["start"])
        out = {"backbone_fwd": 0.0, "loss": 0.0, "backbone_bwd": 0.0}
        for i in range(len(step["start"])):
            out["backbone_fwd"] += self._seconds(step["start"][i], step["backbone"][i])
            out["loss"] += self._seconds(step["backbone"][i], step["loss"][i])
            out["loss"] += self._seconds(step["loss"][i], step["dh"][i])
            out["backbone_bwd"] += self._seconds(step["dh"][i], ends[i])
        out["optimizer"] = self._seconds(step["opt0"][0], step["opt1"][0])
        return out


# ------------------------------------------------------------------------------------------------ the floor
class CrossEntropyModel(nn.Module):
    """A plain causal-LM cross-entropy on a packed row: the forward the floor step runs, the root module FSDP2 shards
    like the trainer's (its decoder layers on their own, this module for the rest)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    def forward(self, row: Any, tokens: int) -> torch.Tensor:
        """The summed cross-entropy of ``row``'s trained positions against its realised tokens, over ``tokens``."""
        from fastdistill.logit_head import causal_lm_parts

        backbone, head = causal_lm_parts(self.hf_model)
        hidden = backbone(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False)
        hidden = hidden.last_hidden_state[0].index_select(0, row.target_positions)
        logits = nn.functional.linear(hidden, head.weight, head.bias)
        return nn.functional.cross_entropy(logits.float(), row.actual_ids, reduction="sum") / tokens


def cross_entropy_step(model: CrossEntropyModel, optimizer: Any, rows: list[Any], *, autocast: bool,
                       max_grad_norm: float, device: torch.device) -> tuple[float, float]:
    """One plain causal-LM cross-entropy step on the packed ``rows`` (each row's trained positions against its
    realised tokens, a token mean over the step), with the trainer's optimizer settings and clipping: the floor a
    distillation step is measured against. Returns (wall seconds, loss)."""
    tokens = sum(int(row.target_positions.numel()) for row in rows)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    total = 0.0
    for row in rows:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(row, tokens)
        loss.backward()
        total += float(loss.detach())
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm.full_tensor()  # a sharded norm is reduced lazily: the trainer reads it, so the floor does too
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began, total


# ------------------------------------------------------------------------------------------------ packed attention
BF16_UNIT_ROUNDOFF = 2.0**-8


def packed_attention_check(model: nn.Module, lengths: list[int], device: torch.device, attn_implementation: str,
                           seed: int = 0, restart_positions: bool = True) -> dict[str, Any]:
    """A packed row (position_ids restarting per sample, no attention mask) against each sample alone, both in bf16
    (autocast, as the trainer runs) with ``attn_implementation``, and each sample alone in float32 as the reference.

    The bound, derived: the packed row and the lone samples do the same arithmetic in bf16, so each differs from the
    float32 result by bf16 rounding carried through the layers, |packed − ref| ≲ |alone − ref| per element; the gate
    allows twice the lone samples' largest deviation plus one bf16 unit roundoff of the scale (kernels may tile a
    longer row differently). A sample that saw another sample's tokens differs by the activations' own size.
    ``restart_positions=False`` packs the row as one continuous sequence (samples attend to earlier ones): what the
    check exists to catch."""
    from fastdistill.logit_head import causal_lm_parts

    backbone, _ = causal_lm_parts(model)
    previous = model.config._attn_implementation
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = [torch.randint(0, vocab, (n,), generator=generator).to(device) for n in lengths]
    positions = [torch.arange(n, device=device) for n in lengths]
    was_training = model.training
    model.eval()
    try:
        model.set_attn_implementation(attn_implementation)

        def run(input_ids: torch.Tensor, position_ids: torch.Tensor, bf16: bool) -> torch.Tensor:
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = backbone(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False)
            return out.last_hidden_state[0].float()

        packed_positions = torch.cat(positions) if restart_positions else torch.arange(sum(lengths), device=device)
        packed = run(torch.cat(ids), packed_positions, True)
        alone = torch.cat([run(x, p, True) for x, p in zip(ids, positions, strict=True)])
        model.set_attn_implementation("sdpa")  # the float32 reference
        reference = torch.cat([run(x, p, False) for x, p in zip(ids, positions, strict=True)])
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    scale = float(reference.abs().max())
    alone_error = float((alone - reference).abs().max())
    packed_error = float((packed - reference).abs().max())
    tolerance = 2.0 * alone_error + BF16_UNIT_ROUNDOFF * scale
    return {"status": "ok" if packed_error <= tolerance else "failed", "attn_implementation": attn_implementation,
            "lengths": lengths, "scale": scale, "max_abs_error_alone_bf16": alone_error,
            "max_abs_error_packed_bf16": packed_error, "max_abs_diff_packed_vs_alone": float(
                (packed - alone).abs().max()), "tolerance": tolerance}


# ------------------------------------------------------------------------------------------------ the loss's inputs
def loss_input_dtypes(head_weight: torch.Tensor, rows: int, top_k: int, device: torch.device, backend: str = "auto",
                      repeats: int = 3) -> dict[str, Any]:
    """The loss alone (forward + backward, median ms of ``repeats`` after a warm-up) on ``rows`` trained positions
    against ``head_weight``, under bf16 autocast, with float32 hidden states and the float32 head (uncast: the
    backbone's last norm returns float32, the master weights are float32) and with both in bf16 (what the trainer
    passes): how much the loss's input dtype costs."""
    from fastdistill.loss import sparse_jsd_loss

    generator = torch.Generator().manual_seed(0)
    vocab, dim = head_weight.shape
    ids = torch.randint(0, vocab, (rows, top_k + 1), generator=generator).to(device)
    lps = torch.log_softmax(torch.randn(rows, top_k + 1, generator=generator), -1).to(device)
    mask = torch.ones(rows, top_k + 1, dtype=torch.bool, device=device)
    base = (0.5 * torch.randn(rows, dim, generator=generator)).to(device)
    out: dict[str, Any] = {"rows": rows, "top_k": top_k, "backend": backend}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        weight = head_weight.detach().to(dtype).requires_grad_(True)
        hidden = base.to(dtype).requires_grad_(True)
        times = []
        for index in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = sparse_jsd_loss(hidden, weight, ids, lps, mask, beta=0.5, backend=backend).loss
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if index:
                times.append(time.perf_counter() - began)
            hidden.grad = weight.grad = None
        out[f"{name}_ms"] = 1e3 * sorted(times)[len(times) // 2]
        del weight
    return out
