"""GEMMs of the torch paths on a GPU: half-precision operands, fp32 results, and an fp32 tile split into two bf16 terms.

On CUDA, bf16 inputs keep their dtype as GEMM operands (tensor cores; no fp32 copy of the weight) and the products
land in fp32 (``torch.addmm(..., out_dtype=torch.float32)``, the overload the kernels' deterministic backward ran
on an H200: exact products, fp32 sums, as an fp32 GEMM of the upcast operands). A GEMM whose operand is an fp32
tile (``dL/dz`` of a chunk) takes it as ``hi + lo``, two bf16 tiles (``hi = bf16(z)``, ``lo = bf16(z − hi)``):
about 16 significant bits, so the gradients keep the accuracy of an fp32 ``dL/dz`` (a single bf16 rounding would
put 2⁻⁹ relative error on every element) for twice the gradient GEMMs.

This module needs only torch (the torch path runs without triton); the kernels package has its own helpers.
"""

from __future__ import annotations

import functools

import torch

SPLIT_DTYPE = torch.bfloat16  # fp32's exponent range: a split term never under- or overflows where fp32 does not
UPCAST_BLOCK_ELEMS = 2**24  # elements of one upcast block where torch has no fp32-output GEMM for the operands


@functools.cache
def mixed_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(out, a, b, beta=0 or 1, out_dtype=torch.float32, out=out)`` takes ``dtype`` operands and
    an fp32 ``out`` on ``device`` (CUDA in torch ≥ 2.8; not on CPU). Tried once per (device, dtype) on 2×2 tensors,
    a transposed operand and a NaN-filled ``out`` under ``beta=0`` included, and the result checked."""
    try:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
        out = torch.full((2, 2), float("nan"), device=device)
        torch.addmm(out, a.to(dtype).t(), a.to(dtype), beta=0, out_dtype=torch.float32, out=out)
        torch.addmm(out, a.to(dtype).t(), a.to(dtype), out_dtype=torch.float32, out=out)
        return out.dtype == torch.float32 and torch.equal(out.cpu(), 2 * (a.cpu().t() @ a.cpu()))
    except (TypeError, RuntimeError):  # unknown keyword (old torch), or no kernel for this backend / dtype
        return False


def split_operands(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a torch path keeps ``hidden`` / ``weight`` as bf16 GEMM operands (fp32 results, split ``dL/dz``):
    both bf16 on a device with fp32-output GEMMs. Otherwise they are upcast to the compute dtype (fp32 or fp64)."""
    return (hidden.dtype == weight.dtype == SPLIT_DTYPE and hidden.device.type == "cuda"
            and mixed_mm_supported(hidden.device, SPLIT_DTYPE))


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool = False) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) into ``out`` (fp32 or fp64). Operands of ``out``'s dtype: a
    plain GEMM; half-precision operands: the fp32-output GEMM where torch has it, else fp32 GEMMs of upcast row blocks
    of ``a`` (the same numerics: half-precision products are exact in fp32)."""
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif mixed_mm_supported(a.device, a.dtype):  # beta=0: out's old contents (NaN included) are not read
        torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=torch.float32, out=out)
    else:
        b_up = b.to(out.dtype)
        rows = max(1, UPCAST_BLOCK_ELEMS // max(1, a.shape[1]))
        for r0 in range(0, a.shape[0], rows):
            block = a[r0:r0 + rows].to(out.dtype)
            if accumulate:
                out[r0:r0 + rows].addmm_(block, b_up)
            else:
                torch.mm(block, b_up, out=out[r0:r0 + rows])


def split_tile(z: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Write ``z`` (fp32 ``(c, V)``) as ``hi + lo`` into the bf16 tiles ``hi``, ``lo``; ``z`` is left holding the
    residual ``z − hi`` (no further use)."""
    hi.copy_(z)
    z.sub_(hi)
    lo.copy_(z)


def split_gemm_into(out: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, b: torch.Tensor, *,
                    accumulate: bool = False) -> None:
    """``out (+)= (hi + lo) @ b`` as two fp32-output GEMMs (see :func:`split_tile`)."""
    gemm_into(out, hi, b, accumulate=accumulate)
    gemm_into(out, lo, b, accumulate=True)


def split_weight_grad(dw: torch.Tensor, terms: torch.Tensor, h: torch.Tensor, h_twice: torch.Tensor, *,
                      accumulate: bool) -> None:
    """``dw (+)= (hi + lo)ᵀ @ h`` as one fp32-output GEMM over the stacked terms: ``terms`` is ``[hi; lo]``
    ``(2c, V)`` (contiguous), ``h_twice`` a buffer of at least ``2c`` rows that receives ``[h; h]``. One GEMM of
    depth 2c reads and writes the fp32 ``dw`` once, where two GEMMs would each."""
    c = h.shape[0]
    stacked = h_twice[: 2 * c]
    stacked[:c].copy_(h)
    stacked[c:].copy_(h)
    gemm_into(dw, terms.t(), stacked, accumulate=accumulate)
