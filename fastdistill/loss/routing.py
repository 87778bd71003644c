"""What ``backend="auto"`` runs: the fastest Triton design that passed on this device and fits its memory, else torch.

For CUDA tensors in a kernel dtype, with triton installed, a loss has two designs: ``"triton-chunked"`` (cuBLAS
logits per row chunk, 6·N·D·V FLOPs, an fp32 ``(C, V)`` logits buffer, sized by the kernels' own
``chunk_row_bytes`` / ``chunk_rows_for``) and ``"triton"`` (the fused kernels, no logits in memory, 8·N·D·V FLOPs).
``auto`` takes the first, in the order below, that fits the memory budget (the chunked design needs a buffer of at
least :data:`MIN_CHUNK_ROWS` rows, or all rows when fewer, within :func:`memory_budget`, and gets the largest chunk up
to its default that fits; the fused design's workspace is bounded by its tile config, so it always fits):

- by default, the designs that passed :mod:`fastdistill_kernels.selfcheck` on this device (run on the first ``auto``
  call per device key, or read from its cache; the committed record spares the check of a design it validated on
  this compute capability), fastest first at the caller's shape class; a refused design is never picked;
- under ``FASTDISTILL_SELFCHECK=0``, the designs the committed record validated
  (:func:`fastdistill_kernels.validation.is_validated`), chunked first; when none is, a warning says why;
- under ``FASTDISTILL_TRITON=1``, every design, chunked first, unchecked.

Otherwise, and always under ``FASTDISTILL_TRITON=0``, CPU tensors or other dtypes: the torch path.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch
from fastdistill_kernels.validation import design_state, is_validated

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRITON_ENV = "FASTDISTILL_TRITON"  # "1": auto may pick any design, unchecked; "0": auto never picks kernels
DESIGN_ORDER = ("triton-chunked", "triton")  # predicted fastest first
BUDGET_ENV = "FASTDISTILL_AUTO_MEMORY_MIB"  # MiB auto's design may take for its buffers; default: free − margin
MIN_CHUNK_ROWS = 1024  # below this the chunked design rereads the weight too often to stay ahead of the fused one
MARGIN_FRACTION = 0.10  # of the device's memory, left free by auto's choice (the allocator's fragmentation, the rest)
MIN_MARGIN_BYTES = 2**30


@dataclass(frozen=True)
class Route:
    """What ``auto`` picked: ``backend`` ("triton-chunked", "triton" or "torch") and, for the chunked design, the
    rows per chunk that fit the budget (None: the design's default)."""

    backend: str
    chunk_rows: int | None = None


def _is_cuda(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on a CUDA device (a separate function so tests can route without a GPU)."""
    return x.is_cuda


def free_device_bytes(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` can get: the driver's free memory plus what torch's caching allocator
    holds reserved but unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def total_device_bytes(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory)


def memory_budget(device: torch.device) -> int:
    """Bytes ``auto``'s design may take for its buffers on ``device``: ``FASTDISTILL_AUTO_MEMORY_MIB`` when set,
    else the free memory (:func:`free_device_bytes`) minus a margin of 10 % of the device (at least 1 GiB)."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if raw:
        try:
            mib = float(raw)
        except ValueError:
            mib = -1.0
        if not mib >= 0:
            raise ValueError(f"{BUDGET_ENV} must be a number of MiB >= 0, got {raw!r}")
        return int(mib * 2**20)
    margin = max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * total_device_bytes(device)))
    return max(0, free_device_bytes(device) - margin)


def kernel_designs_allowed(loss: str, pairs=None, k: int | None = None, fitting=DESIGN_ORDER) -> list[str]:
    """The Triton designs ``auto`` may pick for ``loss`` ("sparse" or "dense"), fastest first: with ``pairs`` (the
    caller's CUDA tensors) and the self-check on, those that passed it on their device (the first call per process
    runs or reads it, timing the ``fitting`` designs at the caller's shape, ``k`` candidate slots); else the
    record's; all under ``FASTDISTILL_TRITON=1``, none under ``FASTDISTILL_TRITON=0``."""
    flag = os.environ.get(TRITON_ENV, "").strip()
    if flag == "0":
        return []
    if flag == "1":
        return list(DESIGN_ORDER)
    if pairs is not None:
        from fastdistill_kernels import selfcheck  # the kernel package's check needs triton: on this path only

        if selfcheck.enabled():
            return selfcheck.auto_designs(loss, pairs, tuple(fitting), k)
    allowed = [b for b in DESIGN_ORDER if is_validated(loss, b)]
    if pairs is not None and not allowed:
        _warn_unvalidated(loss)
    return allowed


_WARNED: set[str] = set()


def _warn_unvalidated(loss: str) -> None:
    """Say once per process and loss why ``auto`` runs the torch path on CUDA without the self-check: no design of
    the record matches what is installed (each design's reason)."""
    if loss in _WARNED:
        return
    _WARNED.add(loss)
    why = "; ".join(f"{b}: {design_state(loss, b).reason()}" for b in DESIGN_ORDER)
    warnings.warn(f"backend='auto' runs the torch path for the {loss} loss on CUDA: with the self-check off "
                  f"(FASTDISTILL_SELFCHECK=0) it takes only designs the committed GPU record validated, and none "
                  f"matches what is installed ({why}). Turn the self-check on, or set {TRITON_ENV}=1 to run them "
                  "unchecked.", stacklevel=5)  # the loss's caller


def kernels_usable(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether every ``(hidden, weight)`` pair is CUDA tensors in a kernel dtype, with triton installed."""
    return (all(_is_cuda(h) and h.dtype in TRITON_DTYPES and w.dtype in TRITON_DTYPES for h, w in pairs)
            and importlib.util.find_spec("triton") is not None)


def chunk_rows_within(budget: int, n_rows: int, row_bytes: int, default_rows: int) -> int | None:
    """The most rows per chunk, up to ``default_rows``, whose buffer (``row_bytes`` each) fits ``budget``; None when
    not even ``min(n_rows, MIN_CHUNK_ROWS)`` rows fit."""
    rows = min(default_rows, budget // max(1, row_bytes))
    return rows if rows >= max(1, min(n_rows, MIN_CHUNK_ROWS)) else None


def route(loss: str, pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...], chunk_rows: int | None = None,
          k: int | None = None) -> Route:
    """``auto``'s choice for ``loss`` ("sparse": one ``(hidden, weight)`` pair and ``k`` candidate slots per row;
    "dense": the student's, then the teacher's). ``chunk_rows``, if given, is the caller's chunk size: the chunked
    design then needs that buffer."""
    if not kernels_usable(*pairs) or os.environ.get(TRITON_ENV, "").strip() == "0":
        return Route("torch")
    chunked = _chunked_route(loss, pairs, chunk_rows)
    fitting = [b for b in DESIGN_ORDER if b == "triton" or chunked is not None]
    for backend in kernel_designs_allowed(loss, pairs, k, fitting):
        if backend == "triton":
            return Route("triton")
        if backend == "triton-chunked" and chunked is not None:
            return chunked
    return Route("torch")


def _chunked_route(loss: str, pairs, chunk_rows: int | None) -> Route | None:
    """The chunked design's route if its buffer fits the budget (the caller's ``chunk_rows``, else the largest chunk
    up to the kernel's default), else None."""
    row_bytes, default = _chunk_buffer(loss, pairs)
    budget = memory_budget(pairs[0][0].device)
    if chunk_rows is not None:
        return Route("triton-chunked", chunk_rows) if chunk_rows * row_bytes <= budget else None
    rows = chunk_rows_within(budget, pairs[0][0].shape[0], row_bytes, default)
    return None if rows is None else Route("triton-chunked", None if rows == default else rows)


def _chunk_buffer(loss: str, pairs) -> tuple[int, int]:
    """``(row_bytes, default_rows)`` of the chunked design for these inputs, from the kernels' own functions: bytes
    per row of its raw-logits buffer(s) (fp32, whatever the operands' dtype) and its default rows per chunk."""
    (hs, ws), *rest = pairs
    if loss == "sparse":  # the kernel modules import triton (optional): only when a kernel design is chosen
        from fastdistill_kernels.logits_chunk import chunk_row_bytes, chunk_rows_for

        return chunk_row_bytes(ws.shape[0]), chunk_rows_for(hs.shape[0], ws.shape[0])
    from fastdistill_kernels.dense_chunk import dense_chunk_row_bytes, dense_chunk_rows_for

    (_, wt), = rest
    return dense_chunk_row_bytes(ws.shape[0], wt.shape[0]), dense_chunk_rows_for(hs.shape[0], ws.shape[0], wt.shape[0])
