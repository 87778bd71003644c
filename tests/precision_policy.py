"""The precision policy of docs/loss.md ("Precision policy") as an element-wise error bound against float64, and the
designs it covers, run in bf16 on the CPU (the torch path with its GPU numerics forced, the Triton designs in the
interpreter). Shared by tests/test_kernel_precision.py (asserts the bound) and, run as a script, prints each design's
measured error:

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 .venv/bin/python tests/precision_policy.py [--json out.json]

The bound, for bf16 operands ``h`` ``(N, D)`` and ``W`` ``(V, D)`` (exact in float64) and the float64 gradient ``G``
``(N, V)`` of the loss with respect to the raw logits ``x = h Wᵀ``:

- fp32 logits and statistics: ``|δx| ≤ ε_z = γ_D·max Σ_d |h||w|`` (fp32 sums of exact products, any order) moves
  each probability by at most ``2ε_z·p``; with the fp32 arithmetic of exp and the row sums (16·2⁻²⁴ relative,
  generous) ``dL/dx`` is off by at most ``e = (8·ε_z + 16·2⁻²⁴)·(|G| + p + q)`` (p, q: student, teacher);
- ``dL/dx`` rounded once to bf16: ``u_dx·|G|`` (``u_dx`` = 2⁻⁸ round to nearest; 2⁻⁷ in Triton's interpreter, which
  converts fp32 to bf16 by truncation);
- fp32 sums inside each gradient GEMM: ``γ_K·|G|`` per term, K = V (dh) or N (dW);
- the rounding of each gradient to bf16 (``u`` = 2⁻⁸): dh once, ``u·|dh|``; dW once per rounding of its running sum
  ``T_i`` (the partial sum over the rows before break i): ``u·Σ_i |T_i|``, one term when dW is summed in fp32;

so ``|δdh| ≤ A_V |W| + u|dh|`` and ``|δdW| ≤ A_Nᵀ |h| + u Σ_i |T_i|`` with ``A_K = (u_dx + γ_K)|G| + e``, times 1.01
for the second-order terms (an error's own rounding).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

N, D, V, K = 48, 64, 384, 8
CHUNK = 6  # rows per chunk of the chunked designs: 8 roundings of dW's running sum (the 7B head's default has 10)
SCALE = 4.0  # logit standard deviation: |z| up to ≈ 15, where bf16 logits lose 3·10⁻² of each probability
U = 2.0**-8  # bf16 unit roundoff (round to nearest)
EPS32 = 2.0**-24


def gamma(n: int) -> float:
    """γ_n = n·u / (1 − n·u) for fp32: the relative error bound of an n-term fp32 sum, any order."""
    return n * EPS32 / (1 - n * EPS32)


def dx_unit() -> float:
    """Relative error of dL/dx stored to bf16 by a Triton kernel: truncation in the interpreter, rounding on a GPU."""
    from fastdistill_kernels.config import interpreting

    return 2.0**-7 if interpreting() else U


def inputs(seed: int):
    """bf16 student (h, w) and teacher (ht, wt) heads, the teacher's top-K ids and log-probs, all slots valid."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * SCALE / D**0.5).bfloat16()
    ht = torch.randn(N, D, generator=g).bfloat16()
    wt = (torch.randn(V, D, generator=g) * SCALE / D**0.5).bfloat16()
    lps, ids = torch.log_softmax(ht.double() @ wt.double().t(), dim=-1).topk(K, dim=-1)
    return h, w, ht, wt, ids, lps.float(), torch.ones(N, K, dtype=torch.bool)


@dataclass
class Reference:
    """float64 results of one loss: ``G = dL/dx`` ``(N, V)``, student and teacher probabilities, dh, dW."""

    G: torch.Tensor
    p: torch.Tensor
    q: torch.Tensor
    dh: torch.Tensor
    dw: torch.Tensor


def sparse_reference(h, w, ids, lps) -> Reference:
    """KL(teacher ‖ student) over K candidates + the exact tail bucket, float64."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    x = h64 @ w64.t()
    x.retain_grad()
    ls = torch.log_softmax(x, dim=-1)
    s = ls.gather(1, ids)
    s_tail = torch.log1p(-s.exp().sum(1))
    t = lps.double()
    t_tail = torch.log1p(-t.exp().sum(1))
    loss = ((t.exp() * (t - s)).sum(1) + t_tail.exp() * (t_tail - s_tail)).sum()
    loss.backward()
    return Reference(x.grad, ls.exp().detach(), torch.zeros_like(x.grad), h64.grad, w64.grad)


def dense_reference(h, w, ht, wt, beta: float) -> Reference:
    """Generalized JSD (β = 0: KL(teacher ‖ student), β = 1: KL(student ‖ teacher)) over the vocabulary, float64."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    x = h64 @ w64.t()
    x.retain_grad()
    s = torch.log_softmax(x, dim=-1)
    t = torch.log_softmax(ht.double() @ wt.double().t(), dim=-1)
    if beta == 0.0:
        loss = (t.exp() * (t - s)).sum()
    elif beta == 1.0:
        loss = (s.exp() * (s - t)).sum()
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        loss = (beta * t.exp() * (t - m) + (1 - beta) * s.exp() * (s - m)).sum()
    loss.backward()
    return Reference(x.grad, s.exp().detach(), t.exp(), h64.grad, w64.grad)


def eps_logits(*pairs) -> float:
    """ε_z: the fp32 logits' error bound over the (hidden, weight) pairs."""
    return gamma(D) * max(float((h.double().abs() @ w.double().abs().t()).max()) for h, w in pairs)


def policy_bounds(ref: Reference, h, w, eps_z: float, *, u_dx: float, dw_breaks: list[int]):
    """Element-wise bounds ``(B_dh, B_dW)`` of the policy (module docstring). ``dw_breaks``: the row counts after
    which dW's running sum is rounded to bf16, ascending, the last one N (``[N]``: summed in fp32, rounded once)."""
    h64, w64 = h.double(), w.double()
    absG = ref.G.abs()
    e = (8 * eps_z + 16 * EPS32) * (absG + ref.p + ref.q)
    n, v = ref.G.shape
    b_dh = ((u_dx + gamma(v)) * absG + e) @ w64.abs() + U * ref.dh.abs()
    running = sum((ref.G[:end].t() @ h64[:end]).abs() for end in dw_breaks)
    b_dw = ((u_dx + gamma(n)) * absG + e).t() @ h64.abs() + U * running
    return 1.01 * b_dh, 1.01 * b_dw


def rel_l2(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def worst_ratio(got, ref, bound) -> float:
    """The largest element's error as a multiple of its bound (≤ 1: within the policy)."""
    return float(((got.double() - ref).abs() / bound).max())


@contextlib.contextmanager
def torch_path_gpu_numerics():
    """The torch path as it runs on a GPU, on CPU tensors: bf16 GEMM operands with fp32 results (CPU torch has no
    fp32-output bf16 GEMM; :func:`fastdistill.loss.gemm.gemm_into` upcasts, the same numerics), ``dL/dz`` rounded
    once to bf16, chunks of :data:`CHUNK` rows."""
    import fastdistill.loss.chunked as chunked
    import fastdistill.loss.dense as dense

    def half(hidden, weight):
        return hidden.dtype == weight.dtype == torch.bfloat16

    with mock.patch.object(chunked, "half_operands", half), mock.patch.object(dense, "half_operands", half), \
            mock.patch.object(chunked, "default_chunk_rows", lambda *a, **k: CHUNK):
        yield


@dataclass(frozen=True)
class Design:
    """One design in bf16: ``loss(h, w, x)`` (``x``: the :func:`inputs` tuple) a scalar whose backward gives dh and
    dW; ``dense``: the dense-teacher loss (else the sparse one); ``u_dx`` the rounding unit of its ``dL/dx``;
    ``dw_breaks(n)``: where its dW running sum is rounded; ``triton``: needs the kernels (the interpreter on CPU)."""

    name: str
    loss: Callable
    dense: bool
    u_dx: Callable[[], float]
    dw_breaks: Callable[[int], list[int]]
    triton: bool = True


def _once(n: int) -> list[int]:
    return [n]


def _chunks(n: int) -> list[int]:
    return list(range(CHUNK, n, CHUNK)) + [n]


def _row_blocks(n: int) -> list[int]:
    """The deterministic backward's row blocks (each rounds dW[chunk] once) for the interpreter's tiles."""
    import triton
    from fastdistill_kernels.backward import deterministic_blocks
    from fastdistill_kernels.config import INTERPRETER_TILES

    rows, _ = deterministic_blocks(INTERPRETER_TILES, n, D, triton.cdiv(V, INTERPRETER_TILES.block_vocab), 2)
    return list(range(rows, n, rows)) + [n]


def _torch_sparse(h, w, x):
    from fastdistill import sparse_jsd_loss

    *_, ids, lps, valid = x
    with torch_path_gpu_numerics():
        return sparse_jsd_loss(h, w, ids, lps, valid, backend="torch").loss


def _torch_dense(h, w, x):
    from fastdistill.loss.dense import dense_teacher_jsd_loss

    _, _, ht, wt, *_ = x
    with torch_path_gpu_numerics():
        return dense_teacher_jsd_loss(h, w, ht, wt, backend="torch", chunk_rows=CHUNK).loss


def _chunked_sparse(fp32_accumulator: bool):
    def loss(h, w, x):
        from fastdistill_kernels import logits_chunk

        *_, ids, lps, valid = x
        return logits_chunk.chunked_logits_sparse_jsd(h, w, ids, lps, valid, chunk_rows=CHUNK,
                                                      fp32_accumulator=fp32_accumulator).loss
    return loss


def _fused_sparse(mode: str):
    def loss(h, w, x):
        from fastdistill_kernels import ops

        *_, ids, lps, valid = x
        return ops.fused_sparse_jsd(h, w, ids, lps, valid, backward_mode=mode).divergence.sum()
    return loss


def _chunked_dense(h, w, x):
    from fastdistill_kernels import dense_chunk

    _, _, ht, wt, *_ = x
    return dense_chunk.chunked_dense_teacher_jsd(h, w, ht, wt, chunk_rows=CHUNK).loss


def _fused_dense(mode: str):
    def loss(h, w, x):
        from fastdistill_kernels import dense_fused

        _, _, ht, wt, *_ = x
        return dense_fused.fused_dense_teacher_jsd(h, w, ht, wt, backward_mode=mode).divergence.sum()
    return loss


DESIGNS = (
    Design("torch", _torch_sparse, False, lambda: U, _once, triton=False),
    Design("torch dense", _torch_dense, True, lambda: U, _once, triton=False),
    Design("triton-chunked", _chunked_sparse(False), False, dx_unit, _chunks),
    Design("triton-chunked fp32_accumulator", _chunked_sparse(True), False, dx_unit, _once),
    Design("triton deterministic", _fused_sparse("deterministic"), False, dx_unit, _row_blocks),
    Design("triton fused", _fused_sparse("fused"), False, dx_unit, _once),
    Design("triton-chunked dense", _chunked_dense, True, dx_unit, _chunks),
    Design("triton dense deterministic", _fused_dense("deterministic"), True, dx_unit, _row_blocks),
    Design("triton dense fused", _fused_dense("fused"), True, dx_unit, _once),
)


def gradients(design: Design, x):
    """bf16 dh, dW of ``design`` on the :func:`inputs` tuple ``x``."""
    h, w = (t.clone().requires_grad_() for t in x[:2])
    design.loss(h, w, x).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16, design.name
    return h.grad, w.grad


def measure(design: Design, seed: int = 0) -> dict:
    """The design's bf16 gradients against float64 on :func:`inputs` (``seed``): relative L2 errors, the worst
    element's error as a multiple of the policy's bound, and the rounding counts the bound assumed."""
    x = inputs(seed)
    h, w, ht, wt, ids, lps, _ = x
    ref = dense_reference(h, w, ht, wt, 0.0) if design.dense else sparse_reference(h, w, ids, lps)
    eps_z = eps_logits((h, w), (ht, wt)) if design.dense else eps_logits((h, w))
    breaks = design.dw_breaks(N)
    b_dh, b_dw = policy_bounds(ref, h, w, eps_z, u_dx=design.u_dx(), dw_breaks=breaks)
    dh, dw = gradients(design, x)
    return {"design": design.name, "u_dx": design.u_dx(), "dw_roundings": len(breaks),
            "rel_l2_dh": rel_l2(dh, ref.dh), "rel_l2_dw": rel_l2(dw, ref.dw),
            "worst_dh": worst_ratio(dh, ref.dh, b_dh), "worst_dw": worst_ratio(dw, ref.dw, b_dw),
            "floor_dh": rel_l2(ref.dh.bfloat16(), ref.dh), "floor_dw": rel_l2(ref.dw.bfloat16(), ref.dw)}


def main(argv=None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--seeds", type=int, default=3)
    cli = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 (the Triton designs run in the CPU interpreter)")
    rows = [measure(d, seed) for d in DESIGNS for seed in range(cli.seeds)]
    print(f"bf16, N={N} D={D} V={V} K={K}, chunk {CHUNK} rows, {cli.seeds} seeds; relative L2 error against float64 "
          "(max over seeds); worst element error ÷ policy bound (max over seeds)")
    print("| design | u_dx | dW roundings | rel. L2 dh | rel. L2 dW | worst ÷ bound dh | worst ÷ bound dW |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for d in DESIGNS:
        mine = [r for r in rows if r["design"] == d.name]
        top = {k: max(r[k] for r in mine) for k in ("rel_l2_dh", "rel_l2_dw", "worst_dh", "worst_dw")}
        print(f"| {d.name} | 2^{math.log2(mine[0]['u_dx']):.0f} | {mine[0]['dw_roundings']} | "
              f"{top['rel_l2_dh']:.2e} | {top['rel_l2_dw']:.2e} | {top['worst_dh']:.2f} | {top['worst_dw']:.2f} |")
    floor = max(max(r["floor_dh"], r["floor_dw"]) for r in rows)
    print(f"\nthe float64 gradients rounded once to bf16 (the floor no bf16 output avoids): rel. L2 ≤ {floor:.2e}")
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
