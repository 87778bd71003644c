"""GEMMs of the torch paths on a GPU: half-precision operands and fp32 results.

On CUDA, bf16 inputs keep their dtype as GEMM operands (tensor cores; no fp32 copy of the weight) and the products
land in fp32 (``torch.addmm(..., out_dtype=torch.float32)``, the overload the kernels' deterministic backward ran
on an H200: exact products, fp32 sums, as an fp32 GEMM of the upcast operands). The fp32 ``dL/dz`` tile of a chunk
enters the gradient GEMMs rounded once to bf16 (:func:`round_gradient_tile`), the one rounding the precision policy
allows before the sums (docs/loss.md, "Precision policy"); dh and dW are summed in fp32.

This module needs only torch (the torch path runs without triton); the kernels package has its own helpers.
"""

from __future__ import annotations

import functools

import torch

HALF_OPERAND_DTYPE = torch.bfloat16  # fp32's exponent range: dL/dz rounded to it never under- or overflows sooner
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


def half_operands(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a torch path keeps ``hidden`` / ``weight`` as bf16 GEMM operands (fp32 results, ``dL/dz`` rounded once
    to bf16): both bf16 on a device with fp32-output GEMMs. Otherwise they are upcast to the compute dtype (fp32 or
    fp64) and ``dL/dz`` stays in it."""
    return (hidden.dtype == weight.dtype == HALF_OPERAND_DTYPE and hidden.device.type == "cuda"
            and mixed_mm_supported(hidden.device, HALF_OPERAND_DTYPE))


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


def round_gradient_tile(z: torch.Tensor, row_scale: torch.Tensor, ids: torch.Tensor, cand: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """``dL/dz`` of a chunk as the bf16 GEMM operand ``out`` ``(c, V)``, in one pass over the fp32 tile: ``z``
    ``(c, V)`` (0 at the candidate columns) times ``row_scale`` ``(c,)``, rounded once to ``out``'s dtype, then the
    candidates' entries ``cand`` ``(c, S)`` at columns ``ids`` ``(c, S)`` (added to the 0 there: slots that repeat an
    id carry 0). Returns ``out``."""
    torch.mul(z, row_scale.unsqueeze(1), out=out)
    return out.scatter_add_(1, ids, cand.to(out.dtype))
