"""The self-check's edge cases, its float64 reference and its tolerances (:mod:`fastdistill_kernels.selfcheck`).

A case is one loss on inputs made to hit the kernels' edges: vocabularies and hidden sizes that are no multiple of
any block, rows with no teacher signal (every slot invalid, row weight 0), K = 1 and a large K, the tail bucket
("exact" and "trl"), softcap and temperature, fp32 and bf16, and the dense-teacher loss with a padded teacher
vocabulary. :func:`reference` computes the per-row divergence and the gradients of ``Σ w·div`` in float64 from the
same (rounded) inputs, written in probability buckets independently of the kernels' torch epilogue
(:mod:`fastdistill_kernels.buckets`). :func:`compare` bounds each output's error by what the arithmetic allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .dense_chunk import DenseHeads, chunked_dense_teacher_jsd
from .dense_fused import fused_dense_teacher_jsd
from .logits_chunk import chunked_logits_sparse_jsd
from .ops import fused_sparse_jsd

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRL_TAIL_MAX = math.exp(-1e-7)  # the teacher's (and the "trl" student's) Σp is clamped below 1 before log(1 − Σp)
U32 = 2.0**-24  # unit roundoffs: fp32, and each dtype's (the gradients' rounding)
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# The margin on the root-sum-square rounding estimate: the largest of ~10⁶ errors sits several σ out, and the
# accumulation order differs by device (benchmarks/RESULTS.md: how close the real kernels come, a broken one's miss)
SAFETY = 12.0


@dataclass(frozen=True)
class Case:
    """One check: ``loss`` ("sparse" or "dense") at ``n`` rows, hidden size ``d``, vocabulary ``v``; ``k`` candidate
    slots per row (sparse), the teacher's ``dt`` and ``vt ≥ v`` (dense); ``masked`` rows without teacher signal;
    ``bias`` (the student's, and the dense teacher's) and ``train_weight`` (False: a frozen lm_head, no dW) pick the
    launch pattern (the kernels specialise on both)."""

    name: str
    loss: str
    n: int
    d: int
    v: int
    dtype: str = "bfloat16"
    k: int = 0
    dt: int = 0
    vt: int = 0
    beta: float = 0.0
    tail_mode: str = "exact"
    logit_scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0
    masked: int = 0
    bias: bool = True
    train_weight: bool = True
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# On a GPU: no tile (rows 32–128, vocabulary 32–2048, hidden steps 32–64) divides 304 rows, hidden 144 or 72, or the
# vocabularies 3024, 3040, 2053 and 1999; 3024 / 3040 / 144 / 304 are multiples of 16, as the vocabularies and hidden
# sizes users run are (Triton specialises integer arguments on divisibility by 16: these cases compile the variants a
# user's call runs), 2053 and 1999 are not. Each dtype's cases hold both launch patterns of the bias and dW.
GPU_CASES = (
    Case("unaligned-bf16", "sparse", n=304, d=144, v=3024, k=8, masked=5, bias=False, seed=1),
    Case("k1-fp32-trl-tail-bias", "sparse", n=77, d=72, v=1999, k=1, dtype="float32", beta=1.0, tail_mode="trl",
         masked=3, seed=2),
    Case("large-k-bf16-softcap-frozen", "sparse", n=256, d=128, v=2053, k=320, beta=0.5, logit_scale=1.5,
         softcap=20.0, temperature=0.8, masked=2, bias=False, train_weight=False, seed=3),
    Case("dense-bf16-mixed", "dense", n=304, d=144, v=3024, dt=112, vt=3040, beta=0.5, masked=4, bias=False,
         seed=4),
    Case("dense-fp32-reverse-bias", "dense", n=77, d=72, v=2053, dt=64, vt=2053, dtype="float32", beta=1.0,
         softcap=20.0, masked=2, seed=5),
)
# Under TRITON_INTERPRET=1 on a CPU: the same edges at shapes the interpreter runs in seconds (its tiles: 32 rows,
# 64 vocabulary columns, hidden steps of 32).
REHEARSAL_CASES = (
    Case("unaligned-bf16", "sparse", n=37, d=40, v=203, k=8, masked=3, bias=False, seed=1),
    Case("k1-fp32-trl-tail-bias", "sparse", n=19, d=32, v=131, k=1, dtype="float32", beta=1.0, tail_mode="trl",
         masked=2, seed=2),
    Case("large-k-bf16-softcap-frozen", "sparse", n=32, d=32, v=128, k=48, beta=0.5, logit_scale=1.5,
         softcap=20.0, temperature=0.8, masked=2, bias=False, train_weight=False, seed=3),
    Case("dense-bf16-mixed", "dense", n=29, d=40, v=203, dt=24, vt=211, beta=0.5, masked=3, bias=False, seed=4),
    Case("dense-fp32-reverse-bias", "dense", n=19, d=32, v=131, dt=24, vt=131, dtype="float32", beta=1.0,
         softcap=20.0, masked=2, seed=5),
)


def cases_for(loss: str, dtype: str | None, on_gpu: bool) -> list[Case]:
    """The cases of ``loss`` in ``dtype`` (None: all), from the GPU set or the rehearsal set. A dtype with no case of
    its own (float16) takes the bfloat16 cases, retyped."""
    group = [c for c in (GPU_CASES if on_gpu else REHEARSAL_CASES) if c.loss == loss]
    if dtype is None:
        return group
    own = [c for c in group if c.dtype == dtype]
    return own or [replace(c, dtype=dtype) for c in group if c.dtype == "bfloat16"]


@dataclass
class Inputs:
    """A case's tensors on the check's device: the student's ``hidden (n, d)``, ``weight (v, d)``, ``bias (v,)`` or
    None;
    sparse: ``ids``, ``lps``, ``valid`` ``(n, k)``; dense: the teacher's ``t_hidden``, ``t_weight``, ``t_bias``;
    ``row_weights (n,)`` (0 on the masked rows)."""

    case: Case
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    row_weights: torch.Tensor
    ids: torch.Tensor | None = None
    lps: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    t_hidden: torch.Tensor | None = None
    t_weight: torch.Tensor | None = None
    t_bias: torch.Tensor | None = None


@dataclass
class Outputs:
    """What a design returns: per-row ``divergence (n,)`` and the gradients of ``Σ w·div`` (dW None for a frozen
    lm_head, db None without a bias)."""

    divergence: torch.Tensor
    dh: torch.Tensor
    dw: torch.Tensor | None
    db: torch.Tensor | None


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """Seeded inputs for ``case``, drawn on ``device`` (its own generator) and rounded to the case's dtype."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    f32 = torch.float32

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=f32, device=device) * scale

    dt = case.torch_dtype
    hidden, weight = randn(case.n, case.d).to(dt), randn(case.v, case.d, scale=2.0 / case.d**0.5).to(dt)
    bias = randn(case.v, scale=0.1).to(dt)
    row_w = 0.5 + torch.rand(case.n, generator=g, dtype=f32, device=device)
    masked = torch.randperm(case.n, generator=g, device=device)[: case.masked]
    row_w[masked] = 0.0
    out = Inputs(case, hidden, weight, bias if case.bias else None, row_w)
    if case.loss == "sparse":
        x = hidden.float() @ weight.float().t()  # a teacher that agrees with the student in part
        teacher = torch.log_softmax(0.8 * x + randn(case.n, case.v, scale=1.5), dim=-1)
        lps, ids = teacher.topk(case.k, dim=-1)
        pad = torch.rand(case.n, case.k, generator=g, device=device) < 0.15
        pad[:, 0] = False
        pad[masked] = True  # no valid slot at all: the row is not scored (divergence 0, no gradient)
        out.ids = torch.where(pad, torch.full_like(ids, -1), ids)
        out.lps = torch.where(pad, torch.full_like(lps, -math.inf), lps)
        out.valid = ~pad
    else:
        out.t_hidden = randn(case.n, case.dt).to(dt)
        out.t_weight = randn(case.vt, case.dt, scale=2.0 / case.dt**0.5).to(dt)
        out.t_bias = randn(case.vt, scale=0.1).to(dt) if case.bias else None
    return out


# ----------------------------------------------------------------------------------------------- the designs


def run_design(loss: str, backend: str, x: Inputs, *, chunk_rows: int | None = None) -> Outputs:
    """Forward and backward of one design on ``x``: the per-row divergence and the gradients of ``Σ w·div``."""
    c = x.case
    h = x.hidden.detach().requires_grad_(True)
    w = x.weight.detach().requires_grad_(c.train_weight)
    b = x.bias.detach().requires_grad_(True) if x.bias is not None else None
    with torch.enable_grad(), torch.autocast(h.device.type, enabled=False):
        if loss == "sparse":
            kw = dict(bias=b, logit_scale=c.logit_scale, softcap=c.softcap, beta=c.beta, temperature=c.temperature,
                      add_tail_bucket=True, tail_mode=c.tail_mode)
            if backend == "triton":
                div = fused_sparse_jsd(h, w, x.ids, x.lps, x.valid, **kw).divergence
                (div * x.row_weights).sum().backward()
            else:
                out = chunked_logits_sparse_jsd(h, w, x.ids, x.lps, x.valid, **kw, row_weights=x.row_weights,
                                                chunk_rows=chunk_rows)
                div = out.divergence
                out.loss.backward()
        else:
            heads = DenseHeads(c.logit_scale, c.softcap, c.logit_scale, c.softcap, c.temperature)
            kw = dict(student_bias=b, teacher_bias=x.t_bias, heads=heads, beta=c.beta)
            if backend == "triton":
                div = fused_dense_teacher_jsd(h, w, x.t_hidden, x.t_weight, **kw).divergence
                (div * x.row_weights).sum().backward()
            else:
                out = chunked_dense_teacher_jsd(h, w, x.t_hidden, x.t_weight, **kw, row_weights=x.row_weights,
                                                chunk_rows=chunk_rows)
                div = out.divergence
                out.loss.backward()
    return Outputs(div.detach().float(), h.grad, w.grad if c.train_weight else None, None if b is None else b.grad)


# ----------------------------------------------------------------------------------------------- the reference


@dataclass
class Reference:
    """float64 results and the scales of their tolerances: ``divergence``, ``dh``, ``dw``, ``db`` as
    :class:`Outputs`; ``tol_*`` the allowed absolute error of each entry."""

    divergence: torch.Tensor
    dh: torch.Tensor
    dw: torch.Tensor | None
    db: torch.Tensor | None
    tol_divergence: torch.Tensor
    tol_dh: torch.Tensor
    tol_dw: torch.Tensor
    tol_db: torch.Tensor


def _final(x: torch.Tensor, c: Case) -> torch.Tensor:
    """Final logits ``softcap(scale·x) / T`` of raw logits ``x`` (float64)."""
    y = x * c.logit_scale
    if c.softcap is not None:
        y = c.softcap * torch.tanh(y / c.softcap)
    return y / c.temperature


def _divergence(s: torch.Tensor, t: torch.Tensor, keep: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD per row over buckets with student / teacher log-probs ``s`` / ``t`` (finite where ``keep``),
    β = 0 KL(q‖p), β = 1 KL(p‖q), else β·KL(q‖m) + (1−β)·KL(p‖m) with m = (1−β)p + βq."""
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s, t = torch.where(keep, s, zero), torch.where(keep, t, zero)
    p, q = torch.where(keep, s.exp(), zero), torch.where(keep, t.exp(), zero)
    if beta == 0.0:
        terms = q * (t - s)
    elif beta == 1.0:
        terms = p * (s - t)
    else:
        log_m = torch.log((1.0 - beta) * p + beta * q)
        terms = beta * q * (t - log_m) + (1.0 - beta) * p * (s - log_m)
    return torch.where(keep, terms, zero).sum(dim=-1)


def _sparse_rows(z: torch.Tensor, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row divergence of the sparse loss from final logits ``z (n, v)``, and the teacher's probabilities
    scattered to ``(n, v)`` (for the tolerances)."""
    c = x.case
    logp = torch.log_softmax(z, dim=-1)
    valid, ids = x.valid, x.ids.clamp_min(0).long()
    t = x.lps.double()
    s = logp.gather(1, ids)
    n, v = logp.shape
    spare = torch.where(valid, ids, v)  # invalid slots write to a spare column v, dropped after the scatter
    cand = torch.zeros(n, v + 1, dtype=torch.bool, device=z.device).scatter(1, spare, True)[:, :v]
    covers = cand.all(dim=1)
    p_sum = torch.where(valid, s.exp(), torch.zeros_like(s)).sum(dim=1)
    q_sum = torch.where(valid, t.exp(), torch.zeros_like(t)).sum(dim=1)
    t_tail = torch.log1p(-q_sum.clamp(max=TRL_TAIL_MAX))
    if c.tail_mode == "exact":
        p_rest = torch.where(cand, torch.zeros_like(logp), logp.exp()).sum(dim=1)
        s_tail = torch.log(torch.where(covers, torch.ones_like(p_rest), p_rest))
        tail_keep = ~covers  # the candidates are the whole vocabulary: no tail on either side
    else:
        s_tail = torch.log1p(-p_sum.clamp(max=TRL_TAIL_MAX))
        tail_keep = torch.ones_like(covers)
    buckets = torch.cat([s, s_tail[:, None]], 1), torch.cat([t, t_tail[:, None]], 1)
    div = _divergence(*buckets, torch.cat([valid, tail_keep[:, None]], 1), c.beta)
    q_cols = torch.zeros(n, v + 1, dtype=logp.dtype, device=z.device).scatter(1, spare, t.exp())[:, :v]
    return div, q_cols


def _dense_rows(z: torch.Tensor, zt: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row divergence of the dense-teacher loss (the teacher renormalised over the student's ``v`` ids) and the
    teacher's probabilities over them."""
    v = z.shape[1]
    s = torch.log_softmax(z, dim=-1)
    t_full = torch.log_softmax(zt, dim=-1)
    t = t_full[:, :v] - torch.logsumexp(t_full[:, :v], dim=-1, keepdim=True)
    return _divergence(s, t, torch.ones_like(s, dtype=torch.bool), beta), t.exp()


def _unit_roundoffs(dtype: torch.dtype, interpreted: bool) -> tuple[float, float]:
    """``(u_mm, u_grad)``: the relative error of one GEMM product (fp32 operands: tf32 when torch allows it, else
    three tf32 products; exact in the interpreter and for half-precision operands) and of the gradients' storage."""
    if dtype != torch.float32 or interpreted:
        u_mm = 0.0
    else:
        u_mm = 2.0**-11 if torch.get_float32_matmul_precision() != "highest" else 2.0**-21
    return u_mm, max(UNIT_ROUNDOFF[dtype], u_mm)


def reference(x: Inputs, *, interpreted: bool = False) -> Reference:
    """float64 per-row divergence and gradients of ``Σ w·div`` for ``x``, with per-entry tolerances.

    Tolerances, per entry of a gradient ``Σ_k a_k`` (k over the vocabulary for dh, the rows for dW and db), the
    rounding errors of the terms summed as independent (root-sum-square) with a margin of :data:`SAFETY`:
    ``SAFETY · ((u_grad + u32·√L) · √Σ (dL/dx_k · o_k)² + 2·δz · √Σ (w·(p + q)·dz/dx · o_k)²) + 2·u_out·|ref|``,
    with ``o_k`` the other operand: dL/dx is stored in the compute dtype (``u_grad``) and summed in fp32 over at most
    ``L`` terms; a logit error ``δz`` (fp32 sums of ``d`` products, tf32 for fp32 operands when torch allows it)
    moves p and q by up to ``δz`` relatively; the output is rounded to its dtype (``u_out``) per chunk and at the
    end, a bound. The divergence: ``SAFETY · (δz · Σ_v (|∂div/∂z| + p + q) + u32 · (v + max|z|))``.
    """
    c = x.case
    f64 = torch.float64
    h, w = x.hidden.to(f64), x.weight.to(f64)
    xr = h @ w.t()
    xr = (xr if x.bias is None else xr + x.bias.to(f64)).requires_grad_(True)
    z = _final(xr, c)
    if c.loss == "sparse":
        div, q = _sparse_rows(z, x)
        mm_scale = h.abs() @ w.abs().t()
    else:
        ht, wt = x.t_hidden.to(f64), x.t_weight.to(f64)
        zt = _final(ht @ wt.t() + (0.0 if x.t_bias is None else x.t_bias.to(f64)), c)
        div, q = _dense_rows(z, zt, c.beta)
        mm_scale = torch.maximum((h.abs() @ w.abs().t()).amax(dim=1), (ht.abs() @ wt.abs().t()).amax(dim=1))[:, None]
        mm_scale = mm_scale * (max(c.d, c.dt) / c.d)  # the teacher's sums are dt long
    dx1, = torch.autograd.grad(div.sum(), xr)  # ∂div_n/∂x, unit row weights
    with torch.no_grad():
        dzdx = torch.ones_like(z) * (c.logit_scale / c.temperature)
        if c.softcap is not None:
            dzdx = dzdx * (1.0 - torch.tanh(xr * c.logit_scale / c.softcap) ** 2)
        p = torch.softmax(z, dim=-1)
        rw = x.row_weights.to(f64)[:, None]
        dx = rw * dx1
        dh, dw, db = dx @ w, dx.t() @ h, dx.sum(dim=0)

        u_mm, u_grad = _unit_roundoffs(c.torch_dtype, interpreted)
        dz = (u_mm + c.d * U32) * mm_scale.amax() * c.logit_scale / c.temperature + U32 * z.abs().amax()
        length = max(c.n, c.v)
        grad_scale = (rw * dx1).square()  # s_k²: dL/dx stored rounded (u_grad), summed in fp32 (u32·√L)
        prob_scale = (rw * (p + q) * dzdx).square()  # a logit error δz moves p and q by up to δz relatively
        rel_grad, rel_prob = u_grad + U32 * length**0.5, 2 * dz
        u_out = UNIT_ROUNDOFF[c.torch_dtype]

        def tol(rss2_grad: torch.Tensor, rss2_prob: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
            rounding = SAFETY * (rel_grad * rss2_grad.sqrt() + rel_prob * rss2_prob.sqrt())
            return rounding + 2 * u_out * ref.abs()  # the output's rounding, per chunk and at the end: a bound

        l1 = (dx1.abs() / dzdx.clamp_min(1e-300) + p + q).sum(dim=1)
        tol_div = SAFETY * (dz * l1 + U32 * (c.v + z.abs().amax(dim=1)))
        return Reference(div.detach(), dh, dw if c.train_weight else None, db if x.bias is not None else None,
                         tol_div,
                         tol(grad_scale @ w.square(), prob_scale @ w.square(), dh),
                         tol(grad_scale.t() @ h.square(), prob_scale.t() @ h.square(), dw),
                         tol(grad_scale.sum(dim=0), prob_scale.sum(dim=0), db))


# ----------------------------------------------------------------------------------------------- the comparison


def compare(got: Outputs, ref: Reference) -> tuple[float, str]:
    """``(worst, detail)``: the largest ``|got − ref| / tolerance`` over every output (∞ for a non-finite entry or a
    wrong shape; ≤ 1 passes) and where it is."""
    worst, detail = 0.0, "all outputs within tolerance"
    for name, g, r, tol in (("divergence", got.divergence, ref.divergence, ref.tol_divergence),
                            ("dh", got.dh, ref.dh, ref.tol_dh), ("dW", got.dw, ref.dw, ref.tol_dw),
                            ("db", got.db, ref.db, ref.tol_db)):
        if g is None and r is None:
            continue
        if g is None or r is None or tuple(g.shape) != tuple(r.shape):
            shape = None if g is None else tuple(g.shape)
            return math.inf, f"{name}: shape {shape}, expected {None if r is None else tuple(r.shape)}"
        g = g.detach().to(torch.float64)
        if not bool(torch.isfinite(g).all()):
            bad = (~torch.isfinite(g)).nonzero()[0].tolist()
            return math.inf, f"{name}: non-finite value {float(g[tuple(bad)])} at {bad}"
        err = (g - r).abs()
        ratio = torch.where(err == 0, torch.zeros_like(err), err / tol.clamp_min(1e-300))
        at = int(ratio.argmax())
        value = float(ratio.flatten()[at])
        if value > worst:
            idx = list(torch.unravel_index(torch.tensor(at), ratio.shape))
            where = [int(i) for i in idx]
            worst = value
            detail = (f"{name}{where}: |error| {float(err.flatten()[at]):.3g} = {value:.3g}× its tolerance "
                      f"{float(tol.flatten()[at]):.3g} (reference {float(r.flatten()[at]):.4g})")
    return worst, detail


Fault = Callable[[Outputs], Outputs]


def drop_vocabulary_tail(out: Outputs) -> Outputs:
    """A deliberately broken design (the rehearsal's failing path): dW's last partial vocabulary tile left at 0, as
    a kernel that mishandles a vocabulary that is no multiple of its block would."""
    if out.dw is None:
        return out
    v = out.dw.shape[0]
    dw = out.dw.clone()
    dw[v - (v % 64 or 64):] = 0
    return Outputs(out.divergence, out.dh, dw, out.db)
