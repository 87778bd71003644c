"""A roofline model of the two designs of the fused loss, for shapes no GPU has measured yet.

Counts are per forward + backward over N positions, hidden size D, vocabulary V, S candidate slots, with operands of
``elem_bytes`` bytes (2 for bf16) and fp32 gradients of the weight:

- ``no-logits``: fastdistill's kernels. The forward streams W once per row block (BN rows) and keeps online
  log-sum-exp statistics; the backward recomputes each logit tile and accumulates dh and dW from it. Matmul FLOPs:
  2·N·D·V (forward) + 2·N·D·V (recompute) + 2·N·D·V (dh) + 2·N·D·V (dW) = 8·N·D·V. No N×V tensor exists.
- ``chunked-logits``: the design Liger and fastdistill's torch path use — a GEMM writes a chunk of C rows of logits,
  one pass over the chunk computes the loss and its logit gradient in place, two GEMMs give dh and dW. Matmul FLOPs:
  6·N·D·V; the chunk's logits are written, read, overwritten with their gradient and read twice (dh, dW).

Bytes are HBM traffic under the stated reuse (W re-read once per row block or chunk: it does not fit in L2 at the
shapes that matter; hidden states read once per pass); they are estimates, not measurements. Time on a device is
``max(FLOPs / peak FLOP/s, bytes / peak bytes/s)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Dense bf16 tensor-core peak and HBM bandwidth of the GPUs this project targets (vendor figures).
DEVICES = {
    "H200": (989e12, 4.8e12),
    "H100-SXM": (989e12, 3.35e12),
    "A100-SXM-80GB": (312e12, 2.04e12),
}


@dataclass(frozen=True)
class DesignCost:
    """One design at one shape: matmul FLOPs, HBM bytes and the peak extra memory it holds (bytes)."""

    design: str
    flops: float
    bytes: float
    extra_memory: float

    def seconds(self, peak_flops: float, peak_bytes_per_s: float) -> float:
        """The roofline time: bound by compute or by memory traffic, whichever is slower."""
        return max(self.flops / peak_flops, self.bytes / peak_bytes_per_s)

    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.bytes


def no_logits_cost(N: int, D: int, V: int, S: int, *, elem_bytes: int = 2, block_rows: int = 128) -> DesignCost:
    """fastdistill's kernels: W streamed once per row block in the forward and again in the backward; dW
    accumulated in fp32 (read and written once per row block of the backward)."""
    row_blocks = math.ceil(N / block_rows)
    weight = V * D * elem_bytes
    hidden = N * D * elem_bytes
    stats = N * (S + 4) * 4  # candidate logits and the per-row statistics, fp32
    forward = row_blocks * weight + hidden + stats
    backward = row_blocks * weight + hidden + stats + N * D * 4 + row_blocks * V * D * 4 * 2  # dh, dW read+write
    return DesignCost("no-logits", 8.0 * N * D * V, float(forward + backward), float(V * D * 4 + N * D * 4))


def chunked_logits_cost(N: int, D: int, V: int, S: int, *, elem_bytes: int = 2, chunk_rows: int = 4096
                        ) -> DesignCost:
    """The chunked-logits design: per chunk of C rows, W is read by three GEMMs (logits, dh, dW) and the C×V logits
    (in ``elem_bytes``) are written, read, rewritten as their gradient and read by the two gradient GEMMs; dW
    accumulates in fp32 across chunks."""
    chunks = math.ceil(N / chunk_rows)
    weight = V * D * elem_bytes
    logits = N * V * elem_bytes
    hidden = N * D * elem_bytes
    traffic = (3 * chunks * weight + 5 * logits + 2 * hidden + N * D * 4 + chunks * V * D * 4 * 2
               + N * (S + 4) * 4)
    extra = min(chunk_rows, N) * V * elem_bytes + V * D * 4 + N * D * 4
    return DesignCost("chunked-logits", 6.0 * N * D * V, float(traffic), float(extra))


def roofline_rows(shapes: list[tuple[int, int, int, int]], *, elem_bytes: int = 2) -> list[dict]:
    """For each ``(N, D, V, S)``: both designs' FLOPs, bytes, intensity, extra memory and roofline time on every
    device of :data:`DEVICES` (milliseconds)."""
    rows = []
    for N, D, V, S in shapes:
        for cost in (no_logits_cost(N, D, V, S, elem_bytes=elem_bytes),
                     chunked_logits_cost(N, D, V, S, elem_bytes=elem_bytes)):
            row = {"N": N, "D": D, "V": V, "S": S, "design": cost.design, "tflop": cost.flops / 1e12,
                   "gbytes": cost.bytes / 1e9, "flop_per_byte": cost.arithmetic_intensity(),
                   "extra_gib": cost.extra_memory / 2**30}
            for name, (flops, bandwidth) in DEVICES.items():
                row[f"ms_{name}"] = 1e3 * cost.seconds(flops, bandwidth)
            rows.append(row)
    return rows


def print_roofline(rows: list[dict]) -> None:
    """A table of :func:`roofline_rows`."""
    devices = list(DEVICES)
    header = (f"{'N':>6} {'D':>5} {'V':>7} {'S':>3} {'design':<15} {'TFLOP':>7} {'GB':>7} {'FLOP/B':>7} "
              f"{'extra GiB':>9} " + " ".join(f"{'ms ' + d:>16}" for d in devices))
    print("roofline model (estimates, not measurements):")
    print(header)
    for r in rows:
        print(f"{r['N']:>6} {r['D']:>5} {r['V']:>7} {r['S']:>3} {r['design']:<15} {r['tflop']:>7.2f} "
              f"{r['gbytes']:>7.1f} {r['flop_per_byte']:>7.0f} {r['extra_gib']:>9.2f} "
              + " ".join(f"{r['ms_' + d]:>16.2f}" for d in devices))


if __name__ == "__main__":
    print_roofline(roofline_rows([(4096, 3584, 152064, 9), (16384, 3584, 152064, 9), (16384, 3584, 152064, 65)]))
