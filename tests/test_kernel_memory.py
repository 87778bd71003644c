"""Memory of the kernels' default paths: gradients in the weight's dtype, no fp32 ``(V, D)`` buffer, and the peak
beyond the inputs within the bounds docs/kernels-memory.md derives for the Qwen2.5-7B head.

CPU, in Triton's interpreter: the gradients' dtypes; every tensor the ops allocate, recorded by a
``TorchDispatchMode`` (with the CPU GEMM emulation's upcast blocks made small): none is an fp32 tensor of ``V·D``
elements or more, while the opt-in fp32 accumulator and the atomics backward do allocate one (the check can fail);
the chunked loss's backward allocates nothing gradient-sized. CPU, plain arithmetic: the scratch sizes at the 7B head
within the bounds. CUDA (compiled; skipped elsewhere): ``torch.cuda.max_memory_allocated`` at the 7B head.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

import triton  # noqa: E402
from fastdistill_kernels import backward, dense_chunk, dense_fused, logits_chunk, ops  # noqa: E402
from fastdistill_kernels.config import TileConfig  # noqa: E402

MiB, GiB = 2**20, 2**30
N, D, V, K = 40, 32, 200, 5
CUDA_COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


class Allocations(TorchDispatchMode):
    """Records ``(op, dtype, shape)`` of every op output whose storage is none of the op's inputs' (a new tensor)."""

    def __init__(self):
        super().__init__()
        self.new: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.new.append((str(func), t.dtype, tuple(t.shape)))
        return out

    def large(self, dtype: torch.dtype | None, numel: int) -> list:
        return [a for a in self.new if (dtype is None or a[1] == dtype) and torch.Size(a[2]).numel() >= numel]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, generator=g) / D**0.5).bfloat16().requires_grad_()
    ht = torch.randn(N, D, generator=g).bfloat16()
    lps, ids = torch.log_softmax(torch.randn(N, V, generator=g), dim=-1).topk(K, dim=-1)
    return h, w, ht, ids, lps, torch.ones(N, K, dtype=torch.bool)


LOSSES = {  # name -> (h, w, ht, ids, lps, valid, **options) -> scalar loss
    "sparse chunked": lambda h, w, ht, ids, lps, valid, **kw: logits_chunk.chunked_logits_sparse_jsd(
        h, w, ids, lps, valid, chunk_rows=16, **kw).loss,
    "dense chunked": lambda h, w, ht, ids, lps, valid, **kw: dense_chunk.chunked_dense_teacher_jsd(
        h, w, ht, w.detach(), beta=0.5, chunk_rows=16, **kw).loss,
    "sparse fused": lambda h, w, ht, ids, lps, valid, **kw: ops.fused_sparse_jsd(
        h, w, ids, lps, valid, **kw).divergence.sum(),
    "dense fused": lambda h, w, ht, ids, lps, valid, **kw: dense_fused.fused_dense_teacher_jsd(
        h, w, ht, w.detach(), beta=0.5, **kw).divergence.sum(),
}


@pytest.fixture
def small_upcast_blocks(monkeypatch):
    """The CPU emulation of cuBLAS's mixed-precision GEMMs upcasts operand blocks to fp32: keep them far below V·D."""
    monkeypatch.setattr(backward, "UPCAST_BLOCK_ELEMS", 256)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(LOSSES))
def test_bf16_gradients_without_an_fp32_weight_sized_buffer(name, small_upcast_blocks):
    h, w, ht, ids, lps, valid = _inputs()
    with Allocations() as rec:
        LOSSES[name](h, w, ht, ids, lps, valid).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert w.grad.shape == (V, D) and torch.isfinite(w.grad.float()).all() and w.grad.abs().max() > 0
    assert not rec.large(torch.float32, V * D), rec.large(torch.float32, V * D)


@pytest.mark.interpreter
@pytest.mark.parametrize("name,options", [("sparse chunked", dict(fp32_accumulator=True)),
                                          ("dense chunked", dict(fp32_accumulator=True)),
                                          ("sparse fused", dict(backward_mode="fused")),
                                          ("dense fused", dict(backward_mode="fused"))])
def test_the_opt_in_fp32_accumulators_are_seen(name, options, small_upcast_blocks):
    """Positive control: the fp32 accumulation options do allocate an fp32 (V, D) buffer, and the recorder sees it;
    the gradients still come back in bf16."""
    h, w, ht, ids, lps, valid = _inputs()
    with Allocations() as rec:
        LOSSES[name](h, w, ht, ids, lps, valid, **options).backward()
    assert any(a[1] == torch.float32 and a[2] == (V, D) for a in rec.new), rec.new
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16


@pytest.mark.interpreter
@pytest.mark.parametrize("upstream", [1.0, 2.5])
def test_chunked_backward_hands_over_the_forward_gradients_without_a_copy(upstream):
    """The backward scales the gradients its forward computed in place (on the device, by the upstream tensor, in
    fp32, then one rounding to bf16) and hands them to autograd: no tensor of N·D or more elements is allocated, and
    the result is the scaled gradient to that one rounding: 2^-8 relative where the conversion rounds to nearest (a
    GPU), 2^-7 under the CPU interpreter, whose fp32 → bf16 conversion truncates."""
    h, w, ht, ids, lps, valid = _inputs()
    ref_h, ref_w = (x.detach().clone().requires_grad_() for x in (h, w))
    LOSSES["sparse chunked"](ref_h, ref_w, ht, ids, lps, valid).backward()
    loss = LOSSES["sparse chunked"](h, w, ht, ids, lps, valid)
    with Allocations() as rec:
        (loss * upstream).backward()
    assert not rec.large(None, N * D), rec.large(None, N * D)
    rounding = 2**-7 if os.environ.get("TRITON_INTERPRET") == "1" else 2**-8
    torch.testing.assert_close(h.grad.float(), upstream * ref_h.grad.float(), rtol=rounding, atol=0)
    torch.testing.assert_close(w.grad.float(), upstream * ref_w.grad.float(), rtol=rounding, atol=0)


# ------------------------------------------------------------------------------- the bounds at the 7B head
QWEN7B = dict(n=16384, d=3584, v=152064)  # Qwen2.5-7B's lm_head, bf16; 16,384 rows (the shape)


def gradient_bytes(n: int, d: int, v: int) -> int:
    """dh and dW in bf16: what any implementation returns."""
    return 2 * (n * d + v * d)


def test_scratch_at_the_7b_head_is_within_the_bounds():
    """docs/kernels-memory.md's arithmetic: the chunked paths' fp32 logits buffer(s) within 1 GiB less 64 MiB of
    headroom; the deterministic backward's fp32 dh row block plus workspace within 128 MiB, under the 15 % of the
    gradients the fused kernels may add (the O(N·S) statistics take the rest: ≤ 1 MiB per 16 slots here)."""
    n, d, v = QWEN7B["n"], QWEN7B["d"], QWEN7B["v"]
    grads = gradient_bytes(n, d, v)
    assert grads == 1_207_435_264  # 1,151.5 MiB
    c = logits_chunk.chunk_rows_for(n, v, torch.float32)
    assert c == 1654 and c * v * 4 <= GiB - 64 * MiB
    cd = dense_chunk.dense_chunk_rows_for(n, v, v, torch.float32, torch.float32)
    assert cd == 827 and cd * 2 * v * 4 <= GiB - 64 * MiB
    cfg = TileConfig()
    rows, tiles = backward.deterministic_blocks(cfg, n, d, triton.cdiv(v, cfg.block_vocab), 2)
    assert (rows, tiles) == (4096, 72)  # four row blocks: dW rounded four times; 17 vocabulary chunks per block
    scratch = rows * d * 4 + rows * tiles * cfg.block_vocab * 2
    assert scratch <= cfg.workspace_bytes == 128 * MiB
    assert grads + scratch + 16 * MiB <= 1.15 * grads


def test_deterministic_blocks_rule():
    """All rows in one block when their fp32 dh fits in half the budget; else equal blocks (multiples of the tile's
    rows); the workspace gets the rest, at least one tile, at most the vocabulary."""
    cfg = TileConfig(block_rows=128, block_vocab=128, workspace_bytes=2**27)
    assert backward.deterministic_blocks(cfg, 1000, 1024, 100, 2) == (1000, 100)  # everything fits: one chunk
    rows, tiles = backward.deterministic_blocks(cfg, 20000, 4096, 1188, 2)
    assert rows % 128 == 0 and rows * 4096 * 4 <= 2**26 and triton.cdiv(20000, rows) == triton.cdiv(20000, 4096)
    assert rows * 4096 * 4 + rows * tiles * 128 * 2 <= 2**27 < rows * 4096 * 4 + rows * (tiles + 1) * 128 * 2
    assert backward.deterministic_blocks(TileConfig(block_rows=32, workspace_bytes=1), 100, 64, 9, 2) == (32, 1)


# ------------------------------------------------------------------------------- measured on a GPU
def _peak_beyond_inputs(run, leaves) -> int:
    """Peak allocated during ``run()`` beyond what was allocated before it (the inputs, no gradients yet)."""
    run()  # warm-up: Triton compiles, cuBLAS workspaces
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(not CUDA_COMPILED, reason="measures the compiled kernels on a CUDA GPU (TRITON_INTERPRET unset)")
def test_compiled_logits_gemm_writes_fp32_directly():
    """The chunked paths' bound assumes cuBLAS writes the fp32 logits from bf16 operands (``mm`` with
    ``out_dtype``, torch >= 2.8); the upcast fallback would add ≈ 95 MiB at the 7B head."""
    assert backward.mixed_mm_supported(torch.device("cuda"), torch.bfloat16)


@pytest.mark.skipif(not CUDA_COMPILED, reason="measures the compiled kernels on a CUDA GPU (TRITON_INTERPRET unset)")
@pytest.mark.parametrize("name", list(LOSSES))
def test_compiled_peak_memory_at_the_7b_head(name):
    """Peak beyond the inputs of one forward + backward at the Qwen2.5-7B head (N=16384, D=3584, V=152064, K=8,
    bf16), gradients included: chunked ≤ gradients + 1 GiB, fused (deterministic backward) ≤ 1.15 × gradients."""
    n, d, v = QWEN7B["n"], QWEN7B["d"], QWEN7B["v"]
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, d, generator=g, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=g, device="cuda") * 0.02).bfloat16().requires_grad_()
    ht = torch.randn(n, d, generator=g, device="cuda").bfloat16()
    ids = torch.randint(0, v, (n, 8), generator=g, device="cuda")
    ids[:, 1:] = (ids[:, :1] + torch.arange(1, 8, device="cuda")) % v  # distinct within a row
    lps = torch.log_softmax(torch.randn(n, 9, generator=g, device="cuda"), dim=-1)[:, :8].contiguous()
    valid = torch.ones(n, 8, dtype=torch.bool, device="cuda")

    def run():
        LOSSES[name](h, w, ht, ids, lps, valid).backward()

    peak = _peak_beyond_inputs(run, (h, w))
    grads = gradient_bytes(n, d, v)
    bound = grads + GiB if "chunked" in name else 1.15 * grads
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert peak <= bound, f"{name}: {peak / MiB:,.0f} MiB beyond the inputs, bound {bound / MiB:,.0f} MiB"
