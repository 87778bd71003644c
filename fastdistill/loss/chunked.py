"""Memory-bounded torch path: row chunks, exact tail, gradients computed in the same pass as the loss.

For each chunk of ``c`` scored rows it materialises one ``(c, V)`` logits tile, reduces it to ``z_cand``,
``lse`` and ``lse_nc`` (walking it in small row blocks so that one tile is all it needs), evaluates the bucket
divergence and its gradient with respect to those few numbers, and turns the tile into ``dL/dz`` in place,
which two GEMMs fold into ``dh`` and ``dW``. Nothing is recomputed in backward (TRL checkpoints and redoes the
whole chunk), so the work is the three unavoidable matmuls; extra memory is one tile plus O(N·S),
independent of N.

On a GPU the chunks are large (a 1 GiB fp32 tile, at most 4096 rows: every chunk rereads the weight, so small
chunks would leave the GEMMs waiting on memory), and bf16 inputs stay bf16 GEMM operands with fp32 results; the
gradient GEMMs take ``dL/dz`` rounded once to bf16 and sum dh and dW in fp32 (:mod:`fastdistill.loss.gemm`; the
precision policy of docs/loss.md). Per chunk of ``c`` rows that is 2·c·D·V FLOPs for the logits and 4·c·D·V for dh
and dW (6·N·D·V in all, at tensor-core rate); the weight is never copied to fp32.

The per-row math (divergence, and its gradient in the form ``dL/dz_v = exp(z_v − m_nc)·coef_nc`` at
non-candidates, ``cand_grad`` at candidates) is :mod:`fastdistill_kernels.buckets`, shared with the Triton
kernels. Shifting by the non-candidate max ``m_nc`` keeps every exponent ≤ 0, and candidate entries are
written separately and exactly (no dense-minus-correction form, which cancels catastrophically when the tail
is tiny).
"""

from __future__ import annotations

import torch
from fastdistill_kernels.buckets import bucket_divergence, logit_gradients

from .gemm import gemm_into, half_operands, round_gradient_tile

DEFAULT_TILE_BYTES = 32 * 2**20  # budget for the (rows × V) logits tile on the CPU
MAX_CHUNK_ROWS = 256  # beyond this the CPU's GEMMs gain little, and smaller vocabularies keep a smaller tile
GPU_TILE_BYTES = 2**30  # on a GPU: each chunk rereads the weight; hundreds of rows keep the GEMMs compute-bound
GPU_MAX_CHUNK_ROWS = 4096
BLOCK_ROWS = 16  # rows per block of the in-tile reductions on the CPU (a small (BLOCK_ROWS, V) scratch buffer)
GPU_SCRATCH_BYTES = 2**27  # the scratch block on a GPU: few, large blocks (every block costs a few kernel launches)


class LossConfig:
    """Static loss settings shared by the torch paths (plain attributes; validated by the public API)."""

    __slots__ = ("logit_scale", "softcap", "beta", "temperature", "add_tail_bucket", "tail_mode")

    def __init__(self, *, logit_scale, softcap, beta, temperature, add_tail_bucket, tail_mode):
        self.logit_scale = float(logit_scale)
        self.softcap = None if softcap is None else float(softcap)
        self.beta = float(beta)
        self.temperature = float(temperature)
        self.add_tail_bucket = bool(add_tail_bucket)
        self.tail_mode = tail_mode


def default_chunk_rows(vocab_size: int, dtype: torch.dtype, tile_bytes: int | None = None, *,
                       on_gpu: bool = False) -> int:
    """Rows per chunk: the ``(rows, V)`` logits tile fits in ``tile_bytes`` (default :data:`DEFAULT_TILE_BYTES`, on a
    GPU :data:`GPU_TILE_BYTES`), at most :data:`MAX_CHUNK_ROWS` (GPU: :data:`GPU_MAX_CHUNK_ROWS`), at least one."""
    elem = torch.finfo(dtype).bits // 8
    tile = tile_bytes or (GPU_TILE_BYTES if on_gpu else DEFAULT_TILE_BYTES)
    return max(1, min(GPU_MAX_CHUNK_ROWS if on_gpu else MAX_CHUNK_ROWS, tile // (vocab_size * elem)))


def scratch_rows(vocab_size: int, dtype: torch.dtype, on_gpu: bool) -> int:
    """Rows of the in-tile reductions' scratch block: :data:`BLOCK_ROWS` on the CPU, :data:`GPU_SCRATCH_BYTES` worth
    on a GPU."""
    if not on_gpu:
        return BLOCK_ROWS
    return max(1, GPU_SCRATCH_BYTES // (vocab_size * (torch.finfo(dtype).bits // 8)))


class Workspace:
    """The buffers every chunk of one call reuses, allocated once: the ``(rows, V)`` logits tile, a scratch block
    of :func:`scratch_rows` rows, ``(rows, D)`` buffers for the chunk's hidden states in the compute dtype (only
    when they are upcast) and scaled by ``logit_scale / T`` (only when that folds into the operand), a ``(V,)``
    column-sum buffer (only for the bias gradient) and, for half-precision GEMM operands
    (:mod:`fastdistill.loss.gemm`), ``dL/dz`` rounded to the operands' dtype ``(rows, V)``. Per chunk only
    O(rows·S) tensors are allocated, so the allocator does not churn through tile-sized temporaries whatever its
    thresholds (glibc's defaults included)."""

    def __init__(self, rows: int, vocab: int, hidden: torch.Tensor, dtype: torch.dtype, cfg: LossConfig,
                 need_db: bool, *, half: bool = False, need_grad: bool = True):
        def buf(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(*shape, dtype=dt, device=hidden.device)

        on_gpu = hidden.device.type == "cuda"
        self.tile = buf(rows, vocab)
        self.scratch = buf(min(scratch_rows(vocab, dtype, on_gpu), rows), vocab)
        self.cast = buf(rows, hidden.shape[1]) if hidden.dtype != dtype and not half else None
        self.scaled = buf(rows, hidden.shape[1]) if cfg.softcap is None and not half else None
        self.colsum = buf(vocab) if need_db and not half else None
        self.grad = buf(rows, vocab, dt=hidden.dtype) if half and need_grad else None

    def hidden_chunk(self, h: torch.Tensor) -> torch.Tensor:
        """The chunk's hidden states ``h`` ``(c, D)`` in the compute dtype (a copy into the cast buffer if needed)."""
        return h if self.cast is None else self.cast[: h.shape[0]].copy_(h)


def logit_bias(b: torch.Tensor | None, cfg: LossConfig, fold: bool = True) -> torch.Tensor | None:
    """The bias as :func:`_student_logits` adds it: times ``logit_scale / T`` when that scale folds into the
    operand (``fold``, no softcap; computed once per call, not per chunk), else as it is."""
    if b is None or cfg.softcap is not None or not fold:
        return b
    return b * (cfg.logit_scale / cfg.temperature)


def _student_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: LossConfig, out: torch.Tensor,
                    operand: torch.Tensor | None = None, half: bool = False):
    """Final student logits ``softcap(scale·(h Wᵀ + b)) / T`` into ``out`` ``(c, V)``; ``b`` comes from
    :func:`logit_bias`. ``operand`` ``(c, D)``, if given, receives the scaled hidden states (no temporary).
    ``half``: ``h`` and ``w`` are bf16 operands of an fp32-output GEMM, the bias and scales applied to ``out``
    (scaling a bf16 operand would round it again)."""
    if half:
        gemm_into(out, h, w.t())
        if b is not None:
            out.add_(b)
        if cfg.softcap is None:
            alpha = cfg.logit_scale / cfg.temperature
            return out if alpha == 1.0 else out.mul_(alpha)
        c = cfg.softcap
        return out.mul_(cfg.logit_scale / c).tanh_().mul_(c / cfg.temperature)
    if cfg.softcap is None:
        alpha = cfg.logit_scale / cfg.temperature  # fold the scalars into the (c, D) operand, not the (c, V) tile
        a = h * alpha if operand is None else torch.mul(h, alpha, out=operand)
        if b is None:
            torch.mm(a, w.t(), out=out)
        else:
            torch.addmm(b, a, w.t(), out=out)
        return out
    if b is None:
        torch.mm(h, w.t(), out=out)
    else:
        torch.addmm(b, h, w.t(), out=out)
    c = cfg.softcap
    out.mul_(cfg.logit_scale / c).tanh_().mul_(c / cfg.temperature)
    return out


def _chunk_stats(z: torch.Tensor, ids_safe: torch.Tensor, valid: torch.Tensor, cfg: LossConfig,
                 scratch: torch.Tensor):
    """Reduce one logits tile ``z`` ``(c, V)`` and overwrite it, in place, with ``exp(z − m_nc)`` at
    non-candidates (times the softcap derivative ``1 − u²`` when softcap is set) and 0 at candidates, ready to
    be scaled into ``dL/dz``.

    Returns ``(z_cand, m_nc, s_nc, lse, entropy)``: the candidates' logits ``(c, S)``; per row the
    non-candidate max, the shifted non-candidate sum of exps, the full log-sum-exp and the entropy.
    """
    neg_inf = float("-inf")
    z_cand = z.gather(1, ids_safe)
    z.scatter_(1, ids_safe, neg_inf)  # invalid slots point at a valid id of the same row: same value written
    m_nc = z.amax(dim=1)
    m_nc = torch.where(torch.isfinite(m_nc), m_nc, torch.zeros_like(m_nc))  # a row whose candidates are all of V
    s_nc = torch.empty_like(m_nc)
    sum_ry = torch.empty_like(m_nc)  # Σ_v exp(y_v)·y_v over non-candidates, y = z − m_nc (for the entropy)
    block = scratch.shape[0]
    for i in range(0, z.shape[0], block):
        rows = slice(i, i + block)
        zb = z[rows]
        y = scratch[: zb.shape[0]]
        torch.sub(zb, m_nc[rows].unsqueeze(1), out=y)
        r = torch.exp(y, out=zb)  # the tile now holds r = exp(z − m_nc), 0 at candidates (z = −inf there)
        y.scatter_(1, ids_safe[rows], 0.0)  # candidates: r·y must not be 0·(−inf)
        s_nc[rows] = r.sum(dim=1)
        sum_ry[rows] = torch.bmm(r.unsqueeze(1), y.unsqueeze(2)).view(-1)
        if cfg.softcap is not None:  # softcap'(·) = 1 − u², u = tanh(scale·x/c) = z·T/c with z = y + m_nc
            y.add_(m_nc[rows].unsqueeze(1)).mul_(cfg.temperature / cfg.softcap).square_().neg_().add_(1.0)
            r.mul_(y)
    lse_nc = m_nc + torch.log(s_nc)
    z_valid = torch.where(valid, z_cand, torch.full_like(z_cand, neg_inf))
    lse = torch.logaddexp(lse_nc, torch.logsumexp(z_valid, dim=1))
    # Entropy −Σ p log p = Σ p (lse − z): non-candidates from the shifted sums, candidates directly.
    p_cand = torch.where(valid, torch.exp(z_cand - lse.unsqueeze(1)), torch.zeros_like(z_cand))
    ent_nc = torch.exp(m_nc - lse) * ((lse - m_nc) * s_nc - sum_ry)
    ent_c = (p_cand * torch.where(valid, lse.unsqueeze(1) - z_cand, torch.zeros_like(z_cand))).sum(dim=1)
    return z_cand, m_nc, s_nc, lse, ent_nc + ent_c


def _row_losses(z_cand, m_nc, s_nc, lse, lps, valid, covers, cfg: LossConfig, need_grad: bool, row_weights=None):
    """Bucket divergence and teacher entropy per row and, when asked, the logit-gradient coefficients
    ``(coef_nc, cand_grad)`` of :func:`fastdistill_kernels.buckets.logit_gradients` (w.r.t. the final logits z)."""
    kw = dict(beta=cfg.beta, add_tail_bucket=cfg.add_tail_bucket, tail_mode=cfg.tail_mode)
    lse_nc = m_nc + torch.log(s_nc)
    div, tent = bucket_divergence(z_cand, lse, lse_nc, lps, valid, covers, **kw)
    if not need_grad:
        return div, tent, None
    upstream = torch.ones_like(lse) if row_weights is None else row_weights.to(lse.dtype)
    grads = logit_gradients(z_cand, lse, m_nc, s_nc, lps, valid, covers, upstream, **kw)
    return div.detach(), tent, grads


def sparse_jsd_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    lps: torch.Tensor,
    valid: torch.Tensor,
    cfg: LossConfig,
    *,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    chunk_rows: int | None = None,
    row_weights: torch.Tensor | None = None,
):
    """Loss statistics (and optionally gradients) over rows that all carry teacher signal.

    Args:
        hidden: ``(n, D)``; weight ``(V, D)``; bias ``(V,)`` or None.
        ids, lps, valid: ``(n, S)``; canonical slots, every row has at least one valid slot.

    Returns:
        ``(div, entropy, teacher_entropy, dh, dw, db)``: per-row ``(n,)`` tensors in the compute dtype, and the
        gradients of ``Σ w·div`` (``w = row_weights``, default 1; compute dtype) or None when not asked for.
    """
    n, S = ids.shape
    V = weight.shape[0]
    cdt = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    dev = hidden.device
    half = half_operands(hidden, weight)  # bf16 operands, fp32 results (GPU); else operands upcast to cdt
    w = weight if half else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    c_rows = chunk_rows or default_chunk_rows(V, cdt, on_gpu=dev.type == "cuda")
    c_rows = max(1, min(c_rows, n))
    need_grad = need_dh or need_dw or need_db

    # Invalid slots borrow the id of the row's first valid slot, so scatters/gathers stay in range and benign.
    first_valid = valid.long().argmax(dim=1, keepdim=True)
    ids_safe = torch.where(valid, ids.long(), ids.long().gather(1, first_valid))
    covers = valid.sum(dim=1) >= V
    lps_c = lps.to(cdt)

    div = torch.empty(n, dtype=cdt, device=dev)
    ent = torch.empty(n, dtype=cdt, device=dev)
    tent = torch.empty(n, dtype=cdt, device=dev)
    dh = torch.empty(n, hidden.shape[1], dtype=cdt, device=dev) if need_dh else None
    # the first chunk writes dw, later ones accumulate into it (no zero-fill pass over V×D)
    dw = (torch.empty if n else torch.zeros)(V, w.shape[1], dtype=cdt, device=dev) if need_dw else None
    db = torch.zeros(V, dtype=cdt, device=dev) if need_db else None
    ws = Workspace(c_rows, V, hidden, cdt, cfg, need_db, half=half, need_grad=need_grad)
    b_logits = logit_bias(b, cfg, fold=not half)

    for start in range(0, n, c_rows):
        end = min(start + c_rows, n)
        rows = slice(start, end)
        c = end - start
        h = ws.hidden_chunk(hidden[rows])
        z = ws.tile[:c]
        _student_logits(h, w, b_logits, cfg, out=z, operand=None if ws.scaled is None else ws.scaled[:c],
                        half=half)
        z_cand, m_nc, s_nc, lse, ent[rows] = _chunk_stats(z, ids_safe[rows], valid[rows], cfg, ws.scratch)
        div[rows], tent[rows], grads = _row_losses(
            z_cand, m_nc, s_nc, lse, lps_c[rows], valid[rows], covers[rows], cfg, need_grad,
            None if row_weights is None else row_weights[rows],
        )
        if not need_grad:
            continue
        # dL/dz: exp(z − m_nc)·coef_nc at non-candidates (z now holds exp(z − m_nc), times 1 − u² under
        # softcap), cand_grad at candidates; alpha is the chain factor of z w.r.t. the raw logit.
        coef_nc, cand_grad = grads
        alpha = cfg.logit_scale / cfg.temperature
        cand_grad = cand_grad * alpha
        if cfg.softcap is not None:
            cand_grad = cand_grad * (1.0 - (z_cand * (cfg.temperature / cfg.softcap)) ** 2)
        cand_grad = torch.where(valid[rows], cand_grad, torch.zeros_like(cand_grad))
        if half:  # dL/dz rounded once to bf16 (one pass over the tile), dh and dW summed in fp32
            dz = round_gradient_tile(z, coef_nc * alpha, ids_safe[rows], cand_grad, ws.grad[:c])
            if need_db:
                db.add_(torch.sum(dz, dim=0, dtype=db.dtype))
            if need_dh:
                gemm_into(dh[rows], dz, w)
            if need_dw:
                gemm_into(dw, dz.t(), h, accumulate=start > 0)
            continue
        z.mul_((coef_nc * alpha).unsqueeze(1))
        z.scatter_add_(1, ids_safe[rows], cand_grad)  # candidate entries of z are 0 before this
        if need_db:
            db.add_(torch.sum(z, dim=0, out=ws.colsum))
        if need_dh:
            torch.mm(z, w, out=dh[rows])
        if need_dw:
            if start == 0:
                torch.mm(z.t(), h, out=dw)
            else:
                dw.addmm_(z.t(), h)
    return div, ent, tent, dh, dw, db
