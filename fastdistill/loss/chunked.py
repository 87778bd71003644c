"""Memory-bounded torch path: row chunks, exact tail, gradients computed in the same pass as the loss.

For each chunk of ``c`` scored rows it materialises one ``(c, V)`` logits tile, reduces it to ``z_cand``,
``lse`` and ``lse_nc`` (walking it in small row blocks so that one tile is all it needs), evaluates the bucket
divergence and its gradient with respect to those few numbers, and turns the tile into ``dL/dz`` in place,
which two GEMMs fold into ``dh`` and ``dW``. Nothing is recomputed in backward (TRL checkpoints and redoes the
whole chunk), so the work is the three unavoidable matmuls; extra memory is one tile plus O(N·S),
independent of N.

The per-row math (divergence, and its gradient in the form ``dL/dz_v = exp(z_v − m_nc)·coef_nc`` at
non-candidates, ``cand_grad`` at candidates) is :mod:`fastdistill_kernels.buckets`, shared with the Triton
kernels. Shifting by the non-candidate max ``m_nc`` keeps every exponent ≤ 0, and candidate entries are
written separately and exactly (no dense-minus-correction form, which cancels catastrophically when the tail
is tiny).
"""

from __future__ import annotations

import torch
from fastdistill_kernels.buckets import bucket_divergence, logit_gradients

DEFAULT_TILE_BYTES = 32 * 2**20  # budget for the (rows × V) logits tile
MAX_CHUNK_ROWS = 256  # beyond this the GEMMs gain little, and smaller vocabularies keep a smaller tile
BLOCK_ROWS = 16  # rows per block of the in-tile reductions (two small (BLOCK_ROWS, V) scratch buffers)


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


def default_chunk_rows(vocab_size: int, dtype: torch.dtype, tile_bytes: int = DEFAULT_TILE_BYTES) -> int:
    """Rows per chunk: at most ``MAX_CHUNK_ROWS``, and the ``(rows, V)`` logits tile fits in ``tile_bytes``."""
    elem = torch.finfo(dtype).bits // 8
    return max(1, min(MAX_CHUNK_ROWS, tile_bytes // (vocab_size * elem)))


class Workspace:
    """The buffers every chunk of one call reuses, allocated once: the ``(rows, V)`` logits tile, two
    ``(BLOCK_ROWS, V)`` scratch blocks, ``(rows, D)`` buffers for the chunk's hidden states in the compute dtype
    (only when they are not in it) and scaled by ``logit_scale / T`` (only without a softcap), and a ``(V,)``
    column-sum buffer (only for the bias gradient). Per chunk only O(rows·S) tensors are allocated, so the
    allocator does not churn through tile-sized temporaries whatever its thresholds (glibc's defaults included)."""

    def __init__(self, rows: int, vocab: int, hidden: torch.Tensor, dtype: torch.dtype, cfg: LossConfig,
                 need_db: bool):
        def buf(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=hidden.device)

        self.tile = buf(rows, vocab)
        self.scratch = (buf(min(BLOCK_ROWS, rows), vocab), buf(min(BLOCK_ROWS, rows), vocab))
        self.cast = buf(rows, hidden.shape[1]) if hidden.dtype != dtype else None
        self.scaled = buf(rows, hidden.shape[1]) if cfg.softcap is None else None
        self.colsum = buf(vocab) if need_db else None

    def hidden_chunk(self, h: torch.Tensor) -> torch.Tensor:
        """The chunk's hidden states ``h`` ``(c, D)`` in the compute dtype (a copy into the cast buffer if needed)."""
        return h if self.cast is None else self.cast[: h.shape[0]].copy_(h)


def logit_bias(b: torch.Tensor | None, cfg: LossConfig) -> torch.Tensor | None:
    """The bias as :func:`_student_logits` adds it: times ``logit_scale / T`` without a softcap (computed once
    per call, not per chunk)."""
    if b is None or cfg.softcap is not None:
        return b
    return b * (cfg.logit_scale / cfg.temperature)


def _student_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: LossConfig, out: torch.Tensor,
                    operand: torch.Tensor | None = None):
    """Final student logits ``softcap(scale·(h Wᵀ + b)) / T`` into ``out`` ``(c, V)``; ``b`` comes from
    :func:`logit_bias`. ``operand`` ``(c, D)``, if given, receives the scaled hidden states (no temporary)."""
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
                 scratch: tuple[torch.Tensor, torch.Tensor]):
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
    for i in range(0, z.shape[0], BLOCK_ROWS):
        rows = slice(i, i + BLOCK_ROWS)
        zb = z[rows]
        y, r = (buf[: zb.shape[0]] for buf in scratch)
        torch.sub(zb, m_nc[rows].unsqueeze(1), out=y)
        torch.exp(y, out=r)
        y.scatter_(1, ids_safe[rows], 0.0)  # candidates: r = 0 there, and r·y must not be 0·(−inf)
        s_nc[rows] = r.sum(dim=1)
        sum_ry[rows] = torch.bmm(r.unsqueeze(1), y.unsqueeze(2)).view(-1)
        if cfg.softcap is None:
            zb.copy_(r)
        else:  # softcap'(·) = 1 − u², u = tanh(scale·x/c) = z·T/c with z = y + m_nc
            y.add_(m_nc[rows].unsqueeze(1)).mul_(cfg.temperature / cfg.softcap).square_().neg_().add_(1.0)
            torch.mul(r, y, out=zb)
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
    w = weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    c_rows = chunk_rows or default_chunk_rows(V, cdt)
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
    dw = (torch.empty_like(w) if n else torch.zeros_like(w)) if need_dw else None
    db = torch.zeros(V, dtype=cdt, device=dev) if need_db else None
    ws = Workspace(c_rows, V, hidden, cdt, cfg, need_db)
    b_logits = logit_bias(b, cfg)

    for start in range(0, n, c_rows):
        end = min(start + c_rows, n)
        rows = slice(start, end)
        c = end - start
        h = ws.hidden_chunk(hidden[rows])
        z = ws.tile[:c]
        _student_logits(h, w, b_logits, cfg, out=z, operand=None if ws.scaled is None else ws.scaled[:c])
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
        z.mul_((coef_nc * alpha).unsqueeze(1))
        cand_grad = cand_grad * alpha
        if cfg.softcap is not None:
            cand_grad = cand_grad * (1.0 - (z_cand * (cfg.temperature / cfg.softcap)) ** 2)
        cand_grad = torch.where(valid[rows], cand_grad, torch.zeros_like(cand_grad))
        z.scatter_add_(1, ids_safe[rows], cand_grad)  # candidate entries of z are 0 before this
        if need_dh:
            torch.mm(z, w, out=dh[rows])
        if need_dw:
            if start == 0:
                torch.mm(z.t(), h, out=dw)
            else:
                dw.addmm_(z.t(), h)
        if need_db:
            db.add_(torch.sum(z, dim=0, out=ws.colsum))
    return div, ent, tent, dh, dw, db
