"""The one home of the lm_head loss's cost formulas: per implementation, the FLOPs it does, the useful FLOPs, the
HBM bytes it moves outside its GEMMs, and the memory it holds beyond its inputs; and the predicted time.

Shapes: N positions, hidden size D, vocabulary V, S = K + 1 candidate slots, operands of ``e`` bytes (2: bf16); a
dense teacher has its own head (D_t, V_t). Sizes used below: W = V·D·e (a weight or its gradient in the operand
dtype), W32 = V·D·4, H = N·D·e, H32 = N·D·4, and a logits chunk of C rows C·V·e (or ·4 in fp32).

- Useful FLOPs: the lm_head's forward and backward, 6·N·D·V (logits, dL/dh, dL/dW), plus 2·N·D_t·V_t for a dense
  teacher's logits. A design that recomputes the logits in its backward does 8·N·D·V: the recomputation is
  overhead, not useful work, so MFU divides the useful FLOPs only.
- Predicted time = GEMM FLOPs / matmul rate + bytes / copy bandwidth, both measured in the same call (or the rates
  of :data:`H200_RECORDED`). The GEMMs' own operand reads and output writes are inside the matmul rate (at these
  shapes a GEMM is compute-bound); ``bytes`` counts every other pass over memory: the elementwise passes over
  logits chunks, the read-modify-write of accumulators, zero fills and casts.
- Memory: the named buffers alive at the peak (forward or backward, whichever is larger), beyond the inputs,
  gradients included; :func:`memory_lines` prints the arithmetic.

The designs are those of the kernels as committed (``ours-*``, ``torch``), plus the 17cb676 designs the H200
measured, the three bare GEMMs (the floor) and Cut Cross-Entropy. The current designs' chunk rows, row blocks and
tiles come from the kernels' and the torch path's own functions (:func:`kernel_code`), so the model cannot drift from
them. Every prediction is printed twice: raw, and **calibrated** by the factor measured ÷ predicted of its design's
17cb676 counterpart on the H200 (:data:`H200_MEASURED`, :func:`calibration_factor`).
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

DATASHEET_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 tensor-core peak (vendor datasheet)
MiB = 2**20


@dataclass(frozen=True)
class Rates:
    """The two ceilings a prediction divides by, and where they come from."""

    matmul_flops: float  # bf16 (or the run's dtype) GEMM FLOP/s
    copy_bytes: float  # bytes/s of a device-to-device copy (read + write counted)
    source: str
    matmul_fp32_flops: float | None = None  # fp32 GEMMs (the torch path computes in fp32); None: matmul_flops


# The H200 of the 2026-12-04 run (torch 2.11, cuBLAS): its two torch.mm (8192³, bf16) rates were 736.8 and
# 775.0 TFLOP/s (the mean below); the three bare GEMMs at the Qwen2.5-7B head ran at ≈ 700 TFLOP/s. That run measured
# no copy bandwidth and no fp32 GEMM: those two are datasheet figures (HBM3e 4.8 TB/s, fp32 67 TFLOP/s), upper
# bounds, so the predicted byte and fp32 terms are optimistic.
H200_RECORDED = Rates(matmul_flops=756e12, copy_bytes=4.8e12, matmul_fp32_flops=67e12,
                      source="H200 recorded 2026-12-04: bf16 torch.mm 756 TFLOP/s measured (mean of 737, 775); "
                             "copy 4.8 TB/s and fp32 67 TFLOP/s from the datasheet (not measured)")


@functools.cache
def kernel_code() -> SimpleNamespace:
    """The host functions whose sizing the model uses: the kernels' ``config``, ``backward``, ``logits_chunk`` and
    ``dense_chunk`` modules and the torch path's ``fastdistill.loss.chunked``. Imported on first use: they need torch
    and triton, which the GPU check's bootstrap interpreter (it imports :mod:`gpu_results`, hence this module) lacks;
    this checkout's ``kernels/`` and root serve where the packages are not installed."""
    root = Path(__file__).resolve().parents[1]
    for path in (root / "kernels", root):
        if str(path) not in sys.path:
            sys.path.append(str(path))
    names = {"config": "fastdistill_kernels.config", "backward": "fastdistill_kernels.backward",
             "logits_chunk": "fastdistill_kernels.logits_chunk", "dense_chunk": "fastdistill_kernels.dense_chunk",
             "torch_path": "fastdistill.loss.chunked", "torch": "torch"}
    return SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})


def tile_config(dense_teacher: bool = False):
    """The kernels' GPU tiles for half-precision operands: ``TileConfig()`` (the sparse fused kernels), or the dense
    fused kernels' sm_90 tiles (``config.DENSE_TILES``)."""
    config = kernel_code().config
    return config.DENSE_TILES[(True, False)] if dense_teacher else config.TileConfig()


@dataclass(frozen=True)
class Shape:
    """One loss call: N rows, hidden D, vocabulary V, K teacher candidates, ``elem_bytes`` per operand; a dense
    teacher's head (D_t, V_t) defaults to the student's."""

    N: int
    D: int
    V: int
    K: int = 8
    elem_bytes: int = 2
    D_t: int | None = None
    V_t: int | None = None

    @property
    def S(self) -> int:
        return self.K + 1

    @property
    def teacher(self) -> tuple[int, int]:
        return (self.D_t or self.D, self.V_t or self.V)


@dataclass(frozen=True)
class Cost:
    """One implementation at one shape. ``gemm_flops`` (all matmul FLOPs done), ``gemm_fp32_flops`` (the part done
    by fp32 GEMMs), ``useful_flops``, ``bytes`` (HBM traffic outside the GEMMs) and ``memory`` (named buffers alive
    at the peak, bytes)."""

    impl: str
    gemm_flops: float
    useful_flops: float
    bytes: float
    memory: dict[str, float] = field(default_factory=dict)
    gemm_fp32_flops: float = 0.0
    note: str = ""

    def predicted_s(self, rates: Rates) -> float:
        """GEMM FLOPs over the matmul rate (fp32 GEMMs over the fp32 rate) plus bytes over the copy bandwidth."""
        fp32_rate = rates.matmul_fp32_flops or rates.matmul_flops
        return ((self.gemm_flops - self.gemm_fp32_flops) / rates.matmul_flops
                + self.gemm_fp32_flops / fp32_rate + self.bytes / rates.copy_bytes)

    @property
    def peak_memory(self) -> float:
        return float(sum(self.memory.values()))


def useful_flops(s: Shape, dense_teacher: bool = False) -> float:
    """6·N·D·V (+ 2·N·D_t·V_t for a dense teacher's logits)."""
    d_t, v_t = s.teacher
    return 6.0 * s.N * s.D * s.V + (2.0 * s.N * d_t * v_t if dense_teacher else 0.0)


def _sizes(s: Shape) -> tuple[float, float, float, float]:
    """(W, W32, H, H32) in bytes."""
    return s.V * s.D * s.elem_bytes, s.V * s.D * 4.0, s.N * s.D * s.elem_bytes, s.N * s.D * 4.0


# ---------------------------------------------------------------------------------------------------- the floor
def bare_gemms(s: Shape, dense_teacher: bool = False) -> Cost:
    """The floor: logits = h·Wᵀ, dL/dh = G·W, dL/dW = Gᵀ·h as three plain GEMMs (a dense teacher: four, its
    logits too). Their outputs are the memory: the (N, V) logits (reused as G), dh, dW."""
    W, _, H, _ = _sizes(s)
    d_t, v_t = s.teacher
    memory = {"logits (N, V)": s.N * s.V * s.elem_bytes, "dW": W, "dh": H}
    if dense_teacher:
        memory["teacher logits (N, V_t)"] = s.N * v_t * s.elem_bytes
    name = "gemms-dense" if dense_teacher else "gemms"
    return Cost(name, useful_flops(s, dense_teacher), useful_flops(s, dense_teacher), 0.0, memory)


# ------------------------------------------------------------------------------------------ chunked logits designs
# The 17cb676 chunked design's sizing (that commit's logits_chunk.MAX_CHUNK_ROWS / DEFAULT_CHUNK_BYTES: a buffer in
# the operand dtype within 2 GiB); a past commit's constants, kept to model what the H200 measured.
CHUNK_ROWS_MAX_17CB676, CHUNK_BYTES_17CB676 = 4096, 2**31


def chunk_rows(s: Shape, elem: int, chunk_bytes: int = CHUNK_BYTES_17CB676,
               max_rows: int = CHUNK_ROWS_MAX_17CB676) -> int:
    """Rows per chunk of the 17cb676 chunked design: ≤ ``max_rows``, ≤ N, the (C, V) buffer of ``elem``-byte
    elements within ``chunk_bytes``."""
    return max(1, min(max_rows, s.N, chunk_bytes // (s.V * elem)))


def chunked_17cb676(s: Shape, dense_teacher: bool = False) -> Cost:
    """The chunked design as measured on the H200 (commit 17cb676): per chunk of C ≤ 4096 rows a cuBLAS GEMM writes
    the raw logits in the operand dtype, a Triton stats pass reads them, a grad pass rewrites them as dL/dx, dh and
    dW GEMMs follow, dW accumulating into an fp32 (V, D) buffer (addmm: read + write per chunk). The backward
    multiplies the saved gradients by the upstream scalar (a second fp32 dW) and casts dW to the operand dtype."""
    W, W32, H, _ = _sizes(s)
    C = chunk_rows(s, s.elem_bytes)
    chunks = math.ceil(s.N / C)
    logits = s.N * s.V * s.elem_bytes
    passes = 3 * logits  # stats: read; grad: read + write
    d_t, v_t = s.teacher
    if dense_teacher:
        passes += 2 * s.N * v_t * s.elem_bytes  # the teacher's logits read by both passes
    dw_bytes = W32 + chunks * 2 * W32  # zero fill, then read + write per chunk
    backward = 2 * H + 3 * W32 + W  # dh·g; dW·g (fp32 read, write) and the cast (fp32 read, bf16 write)
    fwd_peak = W32 + C * s.V * s.elem_bytes + H + (C * v_t * s.elem_bytes if dense_teacher else 0)
    bwd_peak = {"fp32 dW (saved)": W32, "fp32 dW·g": W32, "dW": W, "dh (saved)": H, "dh·g": H}
    memory = bwd_peak if sum(bwd_peak.values()) >= fwd_peak else {"fp32 dW": W32, "logits chunk": fwd_peak - W32 - H,
                                                                  "dh": H}
    flops = useful_flops(s, dense_teacher)
    name = "ours-dense-chunked@17cb676" if dense_teacher else "ours-chunked@17cb676"
    return Cost(name, flops, flops, passes + dw_bytes + backward, memory, note=f"C={C}, {chunks} chunks")


def fp32_chunk_row_bytes(s: Shape, dense_teacher: bool = False) -> int:
    """Bytes per row of the chunked design's fp32 raw-logits buffer(s) (``logits_chunk.chunk_row_bytes``, both
    sides' for a dense teacher: ``dense_chunk.dense_chunk_row_bytes``)."""
    k = kernel_code()
    if dense_teacher:
        return k.dense_chunk.dense_chunk_row_bytes(s.V, s.teacher[1])
    return k.logits_chunk.chunk_row_bytes(s.V)


def fp32_chunk_rows(s: Shape, dense_teacher: bool = False) -> int:
    """Rows per chunk of the chunked design now: ``logits_chunk.chunk_rows_for`` (dense teacher:
    ``dense_chunk.dense_chunk_rows_for``) at the default chunk bytes."""
    k = kernel_code()
    if dense_teacher:
        return k.dense_chunk.dense_chunk_rows_for(s.N, s.V, s.teacher[1])
    return k.logits_chunk.chunk_rows_for(s.N, s.V)


def chunked(s: Shape, dense_teacher: bool = False) -> Cost:
    """The chunked-logits design as the kernels hold it now (``logits_chunk.py`` / ``dense_chunk.py``): per chunk of
    C rows a cuBLAS GEMM writes fp32 raw logits (C·V·4 bytes ≤ 960 MiB, both sides' buffers together for a dense
    teacher), a Triton stats pass reads them, a grad pass reads them again and writes dL/dx in the operand dtype over
    the first half of each row's fp32 storage; the dh GEMM writes dh[chunk], the dW GEMM accumulates in the operand
    dtype (fp32 sums inside the GEMM: its read + write of dW for every chunk after the first). No fp32 (V, D)
    buffer; the backward scales dW and dh in place by the upstream gradient, read on the device (one read + write
    of each: ``logits_chunk.scale_in_place``)."""
    W, _, H, _ = _sizes(s)
    row_bytes = fp32_chunk_row_bytes(s, dense_teacher)
    C = fp32_chunk_rows(s, dense_teacher)
    chunks = math.ceil(s.N / C)
    passes = 2 * s.N * row_bytes + s.N * s.V * s.elem_bytes  # two fp32 reads of the chunk(s), dL/dx written
    dw_bytes = (chunks - 1) * 2 * W
    backward = 2 * (W + H)  # the in-place scale by the upstream gradient
    buffer = "fp32 logits chunks (student, teacher)" if dense_teacher else "fp32 logits chunk"
    memory = {"dW": W, "dh": H, buffer: C * row_bytes}
    flops = useful_flops(s, dense_teacher)
    return Cost("ours-dense-chunked" if dense_teacher else "ours-chunked", flops, flops,
                passes + dw_bytes + backward, memory, note=f"C={C}, {chunks} chunks")


# --------------------------------------------------------------------------------------------- no-logits designs
WORKSPACE_BYTES_17CB676 = 2**28  # that commit's TileConfig.workspace_bytes


def deterministic_blocks(s: Shape, dense_teacher: bool = False) -> tuple[int, int]:
    """``(rows per row block, vocabulary columns per chunk)`` of the deterministic backward: the kernels' own
    ``backward.deterministic_blocks`` with their GPU tiles (:func:`tile_config`)."""
    cfg = tile_config(dense_teacher)
    rows, tiles = kernel_code().backward.deterministic_blocks(cfg, s.N, s.D, math.ceil(s.V / cfg.block_vocab),
                                                              s.elem_bytes)
    return rows, tiles * cfg.block_vocab


def no_logits(s: Shape, mode: str = "deterministic", dense_teacher: bool = False) -> Cost:
    """fastdistill's fused kernels: the forward keeps online statistics (no logits written), the backward recomputes
    each logit tile (8·N·D·V; a dense teacher's logits twice: + 4·N·D_t·V_t). "deterministic": per row block and
    vocabulary chunk (:func:`deterministic_blocks`) dL/dx goes into a workspace, cuBLAS GEMMs fold it into an fp32
    dh block (read + write per chunk, rounded once) and into dW in the operand dtype (written by the first row
    block, read + written by the others): no fp32 (V, D) buffer. "fused": fp32 atomics into fp32 dh and dW from
    every (row block, vocabulary tile) program, then casts to the operand dtype."""
    W, W32, H, H32 = _sizes(s)
    d_t, v_t = s.teacher
    flops = 8.0 * s.N * s.D * s.V + (4.0 * s.N * d_t * v_t if dense_teacher else 0.0)
    if mode == "deterministic":
        rows, cols = deterministic_blocks(s, dense_teacher)
        n_blocks, vchunks = math.ceil(s.N / rows), math.ceil(s.V / cols)
        one_chunk = vchunks == 1
        dh_bytes = 0 if one_chunk else H32 + vchunks * 2 * H32 + (H32 + H)  # zero, read + write per chunk, round
        work = s.N * s.V * s.elem_bytes + dh_bytes + (n_blocks - 1) * 2 * W
        memory = {"dW": W, "dh": H, "workspace": rows * min(cols, s.V) * s.elem_bytes}
        if not one_chunk:
            memory["fp32 dh block"] = rows * s.D * 4
        note = f"{n_blocks} row blocks × {vchunks} vocabulary chunks"
    else:
        cfg = tile_config(dense_teacher)
        row_blocks, tiles = math.ceil(s.N / cfg.block_rows), math.ceil(s.V / cfg.block_vocab)
        # zero fills, the atomics' read-modify-writes of dW and dh, the casts
        work = (W32 + H32) + row_blocks * 2 * W32 + tiles * 2 * H32 + (W32 + W) + (H32 + H)
        memory, note = {"fp32 dW": W32, "fp32 dh": H32, "dW": W, "dh": H}, "fp32 atomics"
    name = "ours-dense" if dense_teacher else {"deterministic": "ours-det", "fused": "ours-fused"}[mode]
    return Cost(name, flops, useful_flops(s, dense_teacher), work, memory, note=note)


def no_logits_17cb676(s: Shape, dense_teacher: bool = False) -> Cost:
    """The deterministic no-logits design as measured on the H200 (17cb676): per vocabulary chunk an (N, chunk)
    workspace (≤ 256 MiB), dW[chunk] into an fp32 (V, D) buffer, dh accumulated in fp32 (N, D), both cast at the
    end."""
    W, W32, H, H32 = _sizes(s)
    d_t, v_t = s.teacher
    bv = 128  # that commit's block_vocab (as today's)
    cols = max(bv, WORKSPACE_BYTES_17CB676 // (s.N * s.elem_bytes) // bv * bv)
    vchunks = math.ceil(s.V / cols)
    work = s.N * s.V * s.elem_bytes + vchunks * 2 * H32 + (W32 + H32) + (W32 + W) + (H32 + H)
    memory = {"fp32 dW": W32, "fp32 dh": H32, "dW": W, "dh": H}
    flops = 8.0 * s.N * s.D * s.V + (4.0 * s.N * d_t * v_t if dense_teacher else 0.0)
    return Cost("ours-dense@17cb676" if dense_teacher else "ours-det@17cb676", flops, useful_flops(s, dense_teacher),
                work, memory, note=f"{vchunks} vocabulary chunks")


# ------------------------------------------------------------------------------------------------- torch path
def torch_chunk_rows(s: Shape) -> tuple[int, int]:
    """``(rows per chunk, rows of the scratch block)`` of the torch path on a GPU for an fp32 logits tile:
    ``fastdistill.loss.chunked.default_chunk_rows`` (≤ N) and ``scratch_rows``."""
    k = kernel_code()
    fp32 = k.torch.float32
    return (min(s.N, k.torch_path.default_chunk_rows(s.V, fp32, on_gpu=True)),
            k.torch_path.scratch_rows(s.V, fp32, on_gpu=True))


# Elementwise bytes per logit of a chunk, read off fastdistill.loss.chunked (fp32 tile): amax 4; per scratch block
# sub 8, exp 8, sum 4, bmm 8; dL/dz scaled and rounded once to bf16 in one pass (fp32 read 4, bf16 write 2).
TORCH_BYTES_PER_LOGIT = 38


def torch_path(s: Shape) -> Cost:
    """fastdistill's torch path on a GPU (bf16 inputs): per chunk of c rows (:func:`torch_chunk_rows`) an fp32
    logits tile from a bf16 GEMM with fp32 output, elementwise passes over it (:data:`TORCH_BYTES_PER_LOGIT`),
    dL/dz rounded once to bf16 through the dh and dW GEMMs (6·N·D·V in all, fp32 sums), fp32 dh and dW (dW written
    by the first chunk, read and written by the others); the backward multiplies the saved fp32 gradients by the
    upstream gradient and casts them."""
    W, W32, H, H32 = _sizes(s)
    c, scratch = torch_chunk_rows(s)
    chunks = math.ceil(s.N / c)
    backward = (3 * W32 + W) + (3 * H32 + H)  # g·saved (read, write), the cast (read, write)
    work = s.N * s.V * TORCH_BYTES_PER_LOGIT + H32 + (2 * chunks - 1) * W32 + backward
    tile = c * s.V * 4
    forward = {"fp32 dW": W32, "fp32 dh": H32, "fp32 logits tile": tile,
               "scratch": min(c, scratch) * s.V * 4, "bf16 dL/dz tile": c * s.V * 2}
    backward_peak = {"fp32 dW (saved)": W32, "fp32 dW·g": W32, "dW": W, "fp32 dh (saved)": H32, "dh": H}
    memory = max(forward, backward_peak, key=lambda m: sum(m.values()))
    return Cost("torch", 6.0 * s.N * s.D * s.V, useful_flops(s), work, memory, note=f"c={c}, {chunks} chunks")


def torch_path_17cb676(s: Shape) -> Cost:
    """The torch path as measured on the H200 (17cb676): everything in fp32 (a copy of W, fp32 GEMMs without tensor
    cores) over chunks of c ≤ 256 rows whose fp32 tile fits 32 MiB, twelve elementwise passes over each tile; dW
    accumulates in fp32 (read + write per chunk); the backward multiplies and casts the saved gradients."""
    W, W32, H, H32 = _sizes(s)
    c = max(1, min(256, s.N, 32 * 2**20 // (s.V * 4)))
    chunks = math.ceil(s.N / c)
    work = (W + W32) + 12 * s.N * s.V * 4.0 + (chunks - 1) * 2 * W32 + (2 * H32 + H) + (2 * W32 + W)
    flops = 6.0 * s.N * s.D * s.V
    memory = {"fp32 dW (saved)": W32, "fp32 dW·g": W32, "dW": W, "fp32 dh (saved)": H32, "dh": H}
    return Cost("torch@17cb676", flops, useful_flops(s), work, memory, gemm_fp32_flops=flops,
                note=f"fp32 GEMMs, c={c}, {chunks} chunks")


# -------------------------------------------------------------------------------------------- Cut Cross-Entropy
def kept_tile_share(tokens_per_row: float, V: int, tile: int = 128) -> float:
    """Share of CCE's 128 × 128 backward tiles holding a gradient entry ≥ 2⁻¹² when each row has
    ``tokens_per_row`` such entries at unrelated ids (the target among them): 1 − exp(−tile²·tokens/V)."""
    return 1.0 - math.exp(-tile * tile * max(1.0, tokens_per_row) / V)


def cut_cross_entropy(s: Shape, tokens_per_row: float = 1.0) -> Cost:
    """Cut Cross-Entropy (``linear_cross_entropy``, one target): the forward's logits tiles stay on chip (2·N·D·V),
    the backward recomputes them (2·N·D·V) and does the dh / dW products only for kept tiles
    (:func:`kept_tile_share`; 4·N·D·V when all are kept). Memory: dh and dW in the operand dtype."""
    W, _, H, _ = _sizes(s)
    kept = kept_tile_share(tokens_per_row, s.V)
    flops = s.N * s.D * s.V * (4.0 + 4.0 * kept)
    return Cost("cce", flops, useful_flops(s), 0.0, {"dW": W, "dh": H}, note=f"{100 * kept:.0f} % tiles kept")


# ------------------------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Measured:
    """One H200 measurement of a 17cb676 design (forward + backward ms, median) at a head, with the bf16 matmul
    rate its prediction is made at (the rate measured in the same call where there was one)."""

    design: str  # the roofline model of what ran (an impl_cost name)
    head: str
    ms: float
    matmul_tflops: float


# The H200 run of 17cb676 (2026-12-04; benchmarks/RESULTS.md, "Kernels validated on an H200"): bench-16384 at
# N = 16384, K = 8, random inputs (its torch.mm rate 736.8 TFLOP/s), and the same session's separate measurements
# (the three bare GEMMs 76.1–76.6 ms, the torch path 2,725–2,895 ms: their midpoints; the Llama-3-8B and
# Qwen2.5-0.5B heads), compared at the recorded rate.
H200_MEASURED = (
    Measured("ours-det@17cb676", "Qwen2.5-7B", 138.9, 736.8),
    Measured("ours-fused", "Qwen2.5-7B", 367.9, 736.8),
    Measured("ours-chunked@17cb676", "Qwen2.5-7B", 94.2, 736.8),
    Measured("ours-dense@17cb676", "Qwen2.5-7B", 292.7, 736.8),
    Measured("ours-dense-chunked@17cb676", "Qwen2.5-7B", 118.1, 736.8),
    Measured("cce", "Qwen2.5-7B", 154.9, 736.8),
    Measured("gemms", "Qwen2.5-7B", 76.35, 756.0),
    Measured("torch@17cb676", "Qwen2.5-7B", 2810.0, 756.0),
    Measured("ours-det@17cb676", "Llama-3-8B", 137.0, 756.0),
    Measured("ours-chunked@17cb676", "Llama-3-8B", 90.0, 756.0),
    Measured("cce", "Llama-3-8B", 193.0, 756.0),
    Measured("ours-det@17cb676", "Qwen2.5-0.5B", 43.0, 756.0),
    Measured("ours-chunked@17cb676", "Qwen2.5-0.5B", 37.0, 756.0),
    Measured("cce", "Qwen2.5-0.5B", 43.0, 756.0),
)
# each design -> the design the H200 measured whose factor it takes (its own 17cb676 version; the fused backward
# and Cut Cross-Entropy are unchanged; the four-GEMM floor takes the three's)
CALIBRATED_BY = {
    "gemms": "gemms", "gemms-dense": "gemms", "ours-chunked": "ours-chunked@17cb676",
    "ours-det": "ours-det@17cb676", "ours-fused": "ours-fused", "ours-filter": "ours-fused",
    "ours-dense": "ours-dense@17cb676", "ours-dense-chunked": "ours-dense-chunked@17cb676",
    "torch": "torch@17cb676", "cce": "cce",
}
CALIBRATION_HEAD = "Qwen2.5-7B"  # a head the H200 did not measure a design at takes this head's factor


def measured_over_predicted(m: Measured, copy_bytes: float = None) -> float:
    """A measurement's factor: its ms over its design's prediction at its head and rate (copy bandwidth: the
    recorded one, as in :data:`H200_RECORDED`)."""
    rates = Rates(m.matmul_tflops * 1e12, copy_bytes or H200_RECORDED.copy_bytes,
                  matmul_fp32_flops=H200_RECORDED.matmul_fp32_flops, source="")
    return m.ms / (1e3 * impl_cost(m.design, HEADS[m.head]).predicted_s(rates))


def calibration_factor(impl: str, head: str | None = None) -> float | None:
    """The H200's measured ÷ predicted factor that calibrates ``impl``'s prediction at ``head``: its
    :data:`CALIBRATED_BY` design's measurement at that head, else at :data:`CALIBRATION_HEAD`; None when the H200
    measured nothing of it."""
    design = CALIBRATED_BY.get(impl)
    for h in (head, CALIBRATION_HEAD):
        for m in H200_MEASURED:
            if m.design == design and m.head == h:
                return measured_over_predicted(m)
    return None


# ------------------------------------------------------------------------------------------------- the table
def impl_cost(impl: str, s: Shape, tokens_per_row: float = 1.0) -> Cost | None:
    """The cost model of a benchmark implementation (None: not modelled, e.g. TRL's and Liger's own code)."""
    models = {
        "gemms": lambda: bare_gemms(s),
        "gemms-dense": lambda: bare_gemms(s, dense_teacher=True),
        "ours-chunked": lambda: chunked(s),
        "ours-chunked@17cb676": lambda: chunked_17cb676(s),
        "ours-det": lambda: no_logits(s, "deterministic"),
        "ours-det@17cb676": lambda: no_logits_17cb676(s),
        "ours-dense@17cb676": lambda: no_logits_17cb676(s, dense_teacher=True),
        "ours-fused": lambda: no_logits(s, "fused"),
        "ours-filter": lambda: no_logits(s, "fused"),  # an upper bound: the filter only skips work
        "ours-dense": lambda: no_logits(s, "deterministic", dense_teacher=True),
        "ours-dense-chunked": lambda: chunked(s, dense_teacher=True),
        "ours-dense-chunked@17cb676": lambda: chunked_17cb676(s, dense_teacher=True),
        "torch": lambda: torch_path(s),
        "torch@17cb676": lambda: torch_path_17cb676(s),
        "cce": lambda: cut_cross_entropy(s, tokens_per_row),
    }
    return models[impl]() if impl in models else None


DENSE_TEACHER_IMPLS = ("gemms-dense", "ours-dense", "ours-dense-chunked", "ours-dense-chunked@17cb676",
                       "ours-dense@17cb676", "liger")


def floor_of(impl: str) -> str:
    """The bare-GEMM floor a row is compared with: four GEMMs for a dense teacher, else three."""
    return "gemms-dense" if impl in DENSE_TEACHER_IMPLS else "gemms"


HEADS = {  # the lm_heads of the predicted table (N = 16384 rows, K = 8, bf16)
    "Qwen2.5-7B": Shape(16384, 3584, 152064),
    "Llama-3-8B": Shape(16384, 4096, 128256),
    "Qwen2.5-0.5B": Shape(16384, 896, 152064),
}
PREDICTED_IMPLS = ("gemms", "ours-chunked", "ours-det", "ours-fused", "torch", "gemms-dense", "ours-dense-chunked",
                   "ours-dense", "cce")


def predicted_rows(heads: dict[str, Shape], rates: Rates, impls=PREDICTED_IMPLS, tokens_per_row: float = 5.0
                   ) -> list[dict]:
    """Per head and implementation: FLOPs, bytes, predicted ms raw and calibrated (:func:`calibration_factor`; a
    head the H200 did not measure takes the 7B head's factor), ratio to its bare-GEMM floor (both predicted alike),
    MFU of the useful FLOPs against the matmul rate and the datasheet (raw and calibrated), peak memory beyond the
    inputs."""
    rows = []
    for head, s in heads.items():
        for impl in impls:
            cost = impl_cost(impl, s, tokens_per_row)
            floor_impl = floor_of(impl)
            floor = impl_cost(floor_impl, s).predicted_s(rates)
            t = cost.predicted_s(rates)
            factor, floor_factor = calibration_factor(impl, head), calibration_factor(floor_impl, head)
            t_cal = None if factor is None else t * factor
            rows.append({"head": head, "N": s.N, "D": s.D, "V": s.V, "K": s.K, "impl": impl,
                         "gemm_tflop": cost.gemm_flops / 1e12, "useful_tflop": cost.useful_flops / 1e12,
                         "gbytes": cost.bytes / 1e9, "ms": 1e3 * t, "x_floor": t / floor,
                         "factor": factor, "ms_calibrated": None if t_cal is None else 1e3 * t_cal,
                         "x_floor_calibrated": None if t_cal is None or floor_factor is None
                         else t_cal / (floor * floor_factor),
                         "mfu_measured_rate": cost.useful_flops / t / rates.matmul_flops,
                         "mfu_datasheet": cost.useful_flops / t / DATASHEET_BF16_FLOPS,
                         "mfu_datasheet_calibrated": None if t_cal is None
                         else cost.useful_flops / t_cal / DATASHEET_BF16_FLOPS,
                         "peak_mib": cost.peak_memory / MiB, "note": cost.note})
    return rows


def _num(x, spec: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def predicted_markdown(rows: list[dict], rates: Rates) -> str:
    """A markdown table of :func:`predicted_rows`: every time and ratio raw, then calibrated."""
    lines = [f"Rates: {rates.source}. Calibrated: × the H200's measured ÷ predicted factor of the design's 17cb676 "
             "version (roofline.H200_MEASURED; the 7B head's where that head was not measured).", "",
             "| head | impl | GEMM TFLOP | bytes GB | predicted ms: raw / calibrated (factor) | × floor: raw / "
             "calibrated | MFU (rate) | MFU (989): raw / calibrated | peak MiB | |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['impl']} | {r['gemm_tflop']:.1f} | {r['gbytes']:.1f} | {r['ms']:.1f} / "
                     f"**{_num(r['ms_calibrated'], '.1f')}** ({_num(r['factor'], '.2f')}) | {r['x_floor']:.2f} / "
                     f"**{_num(r['x_floor_calibrated'], '.2f')}** | {100 * r['mfu_measured_rate']:.0f} % | "
                     f"{100 * r['mfu_datasheet']:.0f} % / "
                     f"{_num(r['mfu_datasheet_calibrated'] and 100 * r['mfu_datasheet_calibrated'], '.0f', ' %')} | "
                     f"{r['peak_mib']:,.0f} | {r['note']} |")
    return "\n".join(lines)


def memory_lines(heads: dict[str, Shape], impls=("ours-chunked", "ours-det", "torch", "ours-dense-chunked",
                                                  "cce")) -> list[str]:
    """The memory arithmetic: per head and implementation, the buffers alive at the peak and their sum (MiB)."""
    out = []
    for head, s in heads.items():
        for impl in impls:
            cost = impl_cost(impl, s)
            parts = " + ".join(f"{name} {b / MiB:,.0f}" for name, b in cost.memory.items())
            out.append(f"{head} {impl}: {parts} = {cost.peak_memory / MiB:,.0f} MiB")
    return out


AT_17CB676 = {"ours-chunked": "ours-chunked@17cb676", "ours-det": "ours-det@17cb676", "ours-fused": "ours-fused",
              "ours-dense": "ours-dense@17cb676", "ours-dense-chunked": "ours-dense-chunked@17cb676",
              "torch": "torch@17cb676", "cce": "cce"}


def calibration_rows(record: dict, copy_bytes: float = H200_RECORDED.copy_bytes) -> list[dict]:
    """The 17cb676 designs' predictions against a ``gpu_check`` record of that commit (each benchmark step's own
    measured matmul rate; ``copy_bytes``: the record measured none): measured and predicted ms and peak MiB."""
    rows = []
    for name, step in record.get("steps", {}).items():
        tflops = (step.get("machine") or {}).get("bf16_matmul_peak_tflops")
        for r in step.get("rows", []) if tflops else []:
            rates = Rates(tflops * 1e12, copy_bytes, source=f"{name}: torch.mm {tflops:.0f} TFLOP/s")
            shape = Shape(r["N"], r["D"], r["V"], r["K"])
            for impl, m in r["impls"].items():
                if impl not in AT_17CB676 or m.get("status") != "ok":
                    continue
                cost = impl_cost(AT_17CB676[impl], shape)
                measured = m["total_s"] if "total_s" in m else m["fwd_s"] + m["bwd_s"]
                rows.append({"step": name, "N": r["N"], "K": r["K"], "impl": impl, "tflops": tflops,
                             "measured_ms": 1e3 * measured, "predicted_ms": 1e3 * cost.predicted_s(rates),
                             "measured_mib": m.get("peak_mb"), "predicted_mib": cost.peak_memory / MiB})
    return rows


def calibration_markdown(rows: list[dict]) -> str:
    lines = ["| step | N | K | impl | measured ms | predicted ms | measured ÷ predicted | "
             "peak MiB measured / predicted |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['N']} | {r['K']} | {r['impl']} | {r['measured_ms']:.1f} | "
                     f"{r['predicted_ms']:.1f} | {r['measured_ms'] / r['predicted_ms']:.2f} | "
                     f"{r['measured_mib']:,.0f} / {r['predicted_mib']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", type=Path, help="a gpu_check JSON of commit 17cb676: its designs' predictions "
                        "against its measurements")
    cli = parser.parse_args()
    if cli.calibrate:
        print(calibration_markdown(calibration_rows(json.loads(cli.calibrate.read_text()))))
    else:
        print(predicted_markdown(predicted_rows(HEADS, H200_RECORDED), H200_RECORDED))
        print("\n".join(memory_lines(HEADS)))
