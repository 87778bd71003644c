"""Tile sizes and launch settings of the kernels, and how they are chosen for a device."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton

from .compat import patch_interpreter_scalar_index


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


if interpreting():  # every module that launches a kernel imports this one
    patch_interpreter_scalar_index()


def is_cuda_device(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch on a CUDA device (a separate function so tests can pretend)."""
    return device.type == "cuda"


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Context in which Triton launches on ``device``: Triton launches on the *current* CUDA device, not on the
    tensors' one, so every launch runs inside ``torch.cuda.device(device)``. A no-op off CUDA (CPU, interpreter)."""
    return torch.cuda.device(device) if is_cuda_device(device) else contextlib.nullcontext()


@dataclass(frozen=True)
class TileConfig:
    """Block sizes shared by the forward and backward kernels (the same vocabulary tiles).

    Attributes:
        block_rows: rows of hidden states per tile (BN).
        block_vocab: vocabulary columns per tile (BV).
        block_d: hidden-dimension step of the tile matmul and of the fused dh/dW accumulation (BD).
        vocab_splits: forward programs per row block, each owning a contiguous run of vocabulary tiles;
            None picks enough to fill the device.
        workspace_bytes: bound on the deterministic backward's scratch memory: a row block's fp32 dh accumulator
            (at most half of it) plus its ``(rows, vocabulary chunk)`` workspace of ``dL/dx`` in the GEMM dtype
            (as many vocabulary tiles as fit, at least one); see docs/kernels-memory.md.
        num_warps, num_stages: Triton launch settings (ignored by the interpreter).
    """

    block_rows: int = 128
    block_vocab: int = 128
    block_d: int = 64
    vocab_splits: int | None = None
    workspace_bytes: int = 2**27  # 128 MiB: within 15 % of the 7B head's gradients (docs/kernels-memory.md)
    num_warps: int = 8
    num_stages: int = 3


# The interpreter costs ~10–30 µs per Triton op per program, so it wants few, large-ish tiles.
INTERPRETER_TILES = TileConfig(block_rows=32, block_vocab=64, block_d=32, vocab_splits=2, workspace_bytes=16384,
                               num_warps=4, num_stages=1)


# GPU tiles for 4-byte (fp32) operands: the half-precision tiles would need 212,992–295,936 B of shared memory per
# block in the fused backward (over sm_80's 166,912 B and sm_90's 232,448 B, so the launch fails). Halving the
# vocabulary tile and the hidden-dimension step fits every fp32 variant on both (≤ 148,480 B, see
# docs/kernels-compile.md) and keeps the tensor-core tiles without spills in the forward.
FP32_TILES = TileConfig(block_vocab=64, block_d=32)


def default_config(device: torch.device, dtype: torch.dtype | None = None) -> TileConfig:
    """Fixed tiles for ``device`` and the operand ``dtype``: the interpreter's small ones on CPU; on a GPU the
    half-precision tensor-core tiles, or :data:`FP32_TILES` for 4-byte operands."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    return FP32_TILES if dtype is not None and dtype.itemsize >= 4 else TileConfig()


# Tiles of the fused dense-teacher kernels, which hold two logit tiles (student and teacher) per program. Chosen
# with benchmarks/compile_report.py's dense-fused report at the Qwen-like shape (D = 3584, V = 152064): the largest
# tiles of 8 warps with no spills in any of the forward, mixed-β and backward kernels (both backward modes, bias and
# softcap on). The sparse kernels' 128×128×64 spilled 20–1,416 B per thread here; sm_80's mma.sync keeps the
# accumulators in registers where sm_90's wgmma does not, so it gets half the tile. See docs/kernels-compile.md.
DENSE_TILES = {  # (sm_90 and later, half precision), ... -> tiles
    (True, False): TileConfig(block_rows=128, block_vocab=64, block_d=64),
    (True, True): TileConfig(block_rows=64, block_vocab=64, block_d=32),
    (False, False): TileConfig(block_rows=64, block_vocab=64, block_d=64),
    (False, True): TileConfig(block_rows=64, block_vocab=32, block_d=32),
}


def dense_default_config(device: torch.device, dtype: torch.dtype | None = None) -> TileConfig:
    """Tiles of the fused dense-teacher kernels for ``device`` and the student's operand ``dtype``: the
    interpreter's on CPU; on a GPU :data:`DENSE_TILES` by architecture (sm_90+ or older) and operand size."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    return DENSE_TILES[(hopper, dtype is not None and dtype.itemsize >= 4)]


def vocab_splits(cfg: TileConfig, n_row_blocks: int, n_vocab_tiles: int, device: torch.device) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` of the forward grid; every split owns at least one vocabulary tile."""
    if cfg.vocab_splits is not None:
        wanted = cfg.vocab_splits
    elif device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = triton.cdiv(4 * sms, max(1, n_row_blocks))  # >= 4 programs per SM
    else:
        wanted = 1
    tiles_per_split = triton.cdiv(n_vocab_tiles, max(1, min(wanted, n_vocab_tiles)))
    return triton.cdiv(n_vocab_tiles, tiles_per_split), tiles_per_split


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision. fp32 inputs follow ``torch.get_float32_matmul_precision()``: "tf32" when torch
    itself allows it, else "tf32x3" (three tf32 tensor-core products, ≈ fp32 accuracy; "ieee" fp32 has no tensor
    cores and spilled heavily). The interpreter accepts "tf32x3" and computes exact fp32 products for every
    precision. Half-precision inputs are exact products accumulated in fp32 either way ("ieee")."""
    if dtype == torch.float32:
        return "tf32" if torch.get_float32_matmul_precision() != "highest" else "tf32x3"
    return "ieee"
