"""Sampled teacher candidates: an unbiased estimate of the full-vocabulary forward KL from S teacher draws.

Per position, draw S tokens i.i.d. from a proposal r (the teacher π_T itself, or r ∝ π_T^(1/t)), merge duplicate
draws into counts c_v, and give each distinct token the weight

    a_v = c_v · π_T(v) / (S · r(v))          (E[a_v] = π_T(v), because E[c_v] = S · r(v))

Then, for the student's full-vocabulary log-probs log π_θ,

    Ĥ  = − Σ_v a_v · log π_θ(v)                      E[Ĥ]  = H(π_T, π_θ) = − Σ_v π_T(v) log π_θ(v)
    K̂L = Σ_v a_v · (log π_T(v) − log π_θ(v))         E[K̂L] = KL(π_T ‖ π_θ)

are unbiased, and so are their gradients with respect to the student's logits (and everything upstream of them):
each estimate is linear in the a_v, which do not depend on the student. The dense gradient is
∂H/∂z_u = π_θ(u) − π_T(u); the estimate's is (Σ_v a_v) · π_θ(u) − a_u. Ĥ and K̂L differ by a student-free term,
so their gradients are identical; K̂L needs the teacher log-probs of the sampled tokens.

Only β = 0 (forward KL) is estimated. The generalized JSD with β > 0 is not linear in the teacher distribution, so
treating the samples as a sparse teacher distribution is biased; see :func:`sampled_kd_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from fastdistill.logit_head import LogitHead, head_logits

CHUNK_ROWS = 256  # rows per checkpointed chunk: at most one (CHUNK_ROWS, V) logits tile is alive


@dataclass
class SampledCandidates:
    """Distinct sampled teacher tokens per position, as :func:`sample_teacher_candidates` returns them.

    All tensors are ``(N, S)`` (S = the number of draws); each row holds its distinct tokens first (ascending id),
    then empty slots. Empty slots: id -1, count 0, log-weight and teacher log-prob -inf.

    Attributes:
        ids: int64 token ids.
        counts: int64, how many of the S draws gave the token (a row's counts sum to S).
        log_weights: float, log a_v = log(c_v · π_T(v) / (S · r(v))) (nats); with proposal temperature 1 it is
            log(c_v / S) and a row's weights sum to 1. float32 (float64 for a float64 teacher), never a half
            precision, whose rounding would bias the weights.
        teacher_logprobs: float, log π_T(v) of the token (nats, renormalised, same dtype as ``log_weights``), for the
            exact KL form.
    """

    ids: torch.Tensor
    counts: torch.Tensor
    log_weights: torch.Tensor
    teacher_logprobs: torch.Tensor


@dataclass
class SampledKDOutput:
    """Result of :func:`sampled_kd_loss`. All fields are tensors on the input device.

    Attributes:
        loss: 0-dim, differentiable: Σ over scored positions of the per-position estimate (nats): K̂L with teacher
            log-probs, Ĥ without. Divide by the window's token count yourself.
        estimate: ``(N,)`` the per-position estimates, detached (0 at unscored positions).
        num_tokens: 0-dim int64, positions with at least one valid slot.
    """

    loss: torch.Tensor
    estimate: torch.Tensor
    num_tokens: torch.Tensor


def sample_teacher_candidates(
    teacher_logprobs: torch.Tensor,
    num_samples: int,
    *,
    generator: torch.Generator | None = None,
    proposal_temperature: float = 1.0,
) -> SampledCandidates:
    """Draw ``num_samples`` tokens per position from the proposal r ∝ π_T^(1/proposal_temperature), with
    replacement, and merge them into distinct tokens with counts and importance weights.

    Args:
        teacher_logprobs: ``(N, V)`` float, the teacher's full-vocabulary log-probs (nats; -inf = no mass). They
            are renormalised with ``log_softmax``, so logits are accepted too.
        num_samples: S, draws per position (int >= 1).
        generator: the ``torch.Generator`` to draw with (on the tensor's device), or None for torch's default.
        proposal_temperature: t > 0; 1 samples from the teacher itself (weights c_v / S, lowest storage); t > 1
            flattens the proposal (more distinct tokens from the teacher's tail, weights below c_v / S for them).

    Returns:
        :class:`SampledCandidates` with ``(N, S)`` tensors, on the input's device.
    """
    _check_teacher(teacher_logprobs)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    _check_temperature(proposal_temperature)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    proposal = _proposal_logprobs(teacher_logprobs.to(_work_dtype(teacher_logprobs)), proposal_temperature)
    draws = torch.multinomial(proposal.exp(), num_samples, replacement=True, generator=generator) \
        if teacher_logprobs.shape[0] else teacher_logprobs.new_zeros(0, num_samples, dtype=torch.long)
    return candidates_from_draws(draws, teacher_logprobs, proposal_temperature=proposal_temperature)


def candidates_from_draws(
    draws: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    proposal_temperature: float = 1.0,
) -> SampledCandidates:
    """Merge given draws into :class:`SampledCandidates` (what :func:`sample_teacher_candidates` does after drawing).

    Args:
        draws: ``(N, S)`` integer token ids in [0, V), drawn i.i.d. from r ∝ π_T^(1/proposal_temperature).
        teacher_logprobs: ``(N, V)`` float, the teacher's full-vocabulary log-probs (renormalised here).
        proposal_temperature: the t the draws were made with.
    """
    _check_teacher(teacher_logprobs)
    _check_temperature(proposal_temperature)
    N, V = teacher_logprobs.shape
    if draws.dim() != 2 or draws.shape[0] != N or draws.shape[1] == 0:
        raise ValueError(f"draws must be 2-D (N, S) with N = {N} and S >= 1, got shape {tuple(draws.shape)}")
    if draws.is_floating_point() or draws.is_complex() or draws.dtype == torch.bool:
        raise ValueError(f"draws must be an integer tensor, got {draws.dtype}")
    if draws.numel() and (int(draws.min()) < 0 or int(draws.max()) >= V):
        raise ValueError(f"draws must lie in [0, V) = [0, {V}), got values in [{int(draws.min())}, "
                         f"{int(draws.max())}]")
    S = draws.shape[1]
    logp = torch.log_softmax(teacher_logprobs.to(_work_dtype(teacher_logprobs)), dim=-1)
    proposal = _proposal_logprobs(logp, proposal_temperature)
    sorted_draws = torch.sort(draws.long(), dim=1).values
    starts = torch.ones_like(sorted_draws, dtype=torch.bool)
    starts[:, 1:] = sorted_draws[:, 1:] != sorted_draws[:, :-1]
    slot = starts.long().cumsum(dim=1) - 1  # the distinct token's slot, in ascending id order
    ids = torch.full_like(sorted_draws, -1).scatter_(1, slot, sorted_draws)
    counts = torch.zeros_like(sorted_draws).scatter_add_(1, slot, torch.ones_like(sorted_draws))
    used = counts > 0
    safe = ids.clamp(min=0)
    teacher = logp.gather(1, safe)
    if bool((used & ~torch.isfinite(teacher)).any()):
        raise ValueError("draws contain a token to which the teacher gives no mass (log-prob -inf)")
    ratio = teacher - proposal.gather(1, safe) if proposal_temperature != 1.0 else torch.zeros_like(teacher)
    log_weights = (counts.double().log() - math.log(S)).to(ratio.dtype) + ratio
    neg_inf = torch.tensor(float("-inf"), dtype=ratio.dtype, device=draws.device)
    return SampledCandidates(
        ids=ids,
        counts=counts,
        log_weights=torch.where(used, log_weights, neg_inf),
        teacher_logprobs=torch.where(used, teacher, neg_inf),
    )


def sampled_kd_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    log_weights: torch.Tensor,
    *,
    teacher_logprobs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    beta: float = 0.0,
    chunk_rows: int = CHUNK_ROWS,
) -> SampledKDOutput:
    """Unbiased estimate of the full-vocabulary forward KL(π_T ‖ π_θ) (β = 0) from sampled teacher candidates.

    Per position ``Σ_k a_k · (log π_T(id_k) − log π_θ(id_k))`` with ``teacher_logprobs`` (an unbiased estimate of
    the KL), else ``−Σ_k a_k · log π_θ(id_k)`` (of the cross-entropy H(π_T, π_θ), the KL plus the teacher's
    entropy). Both have the same gradient, an unbiased estimate of the dense forward-KL gradient with respect to
    the student's logits, hidden states, weight and bias. The student logits are those of
    :func:`fastdistill.sparse_jsd_loss`, ``softcap(logit_scale · (hidden @ weight.T + bias)) / temperature``, over
    the full vocabulary, computed in float32 (float64 when the inputs are) in checkpointed row chunks.

    Args:
        hidden: ``(N, D)`` student hidden states; weight ``(V, D)``; bias ``(V,)`` or None.
        ids: ``(N, S)`` integer sampled token ids, -1 = empty slot. A repeated id adds its weights (the estimate is
            linear), so raw unmerged draws with log-weight ``−log S`` each are valid too.
        log_weights: ``(N, S)`` float, log a_k (:attr:`SampledCandidates.log_weights`); -inf = weight 0.
        teacher_logprobs: ``(N, S)`` float log π_T(id_k), or None for the cross-entropy form.
        beta: must be 0: β > 0 raises ``ValueError`` (no unbiased estimate from teacher samples, see the docs).
        chunk_rows: rows per checkpointed chunk.

    Returns:
        :class:`SampledKDOutput`.
    """
    _check_inputs(hidden, weight, bias, ids, log_weights, teacher_logprobs, logit_scale, softcap, temperature,
                  beta, chunk_rows)
    valid = (ids >= 0) & (log_weights > float("-inf"))
    dtype = torch.float64 if torch.promote_types(hidden.dtype, weight.dtype) == torch.float64 else torch.float32
    a = torch.where(valid, log_weights.to(dtype).exp(), torch.zeros((), dtype=dtype, device=ids.device))
    safe_ids = torch.where(valid, ids.long(), torch.zeros_like(ids, dtype=torch.long))
    student = _candidate_logprobs(hidden, weight, bias, safe_ids, logit_scale, softcap, temperature, dtype,
                                  chunk_rows)
    target = -student
    if teacher_logprobs is not None:
        target = target + torch.where(valid, teacher_logprobs.to(dtype), torch.zeros((), dtype=dtype,
                                                                                      device=ids.device))
    per_row = (a * target).sum(dim=1)
    scored = valid.any(dim=1)
    anchor = hidden.sum() + weight.sum() + (0.0 if bias is None else bias.sum())
    loss = per_row.sum() + 0.0 * anchor  # connected to every input even with nothing to score
    return SampledKDOutput(loss=loss, estimate=per_row.detach(),
                           num_tokens=scored.sum().to(torch.int64))


def _candidate_logprobs(hidden, weight, bias, ids, logit_scale, softcap, temperature, dtype, chunk_rows):
    """log π_θ at ``ids`` ``(N, S)`` over the full vocabulary, in ``dtype``, one checkpointed row chunk at a time."""
    parts = []
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (hidden[rows], weight, bias, ids[rows], logit_scale, softcap, temperature, dtype)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(ids.shape, dtype=dtype)


def _chunk_logprobs(hidden, weight, bias, ids, logit_scale, softcap, temperature, dtype):
    logits = head_logits(hidden, weight, bias, LogitHead(float(logit_scale), softcap), temperature=temperature,
                         dtype=dtype)
    return logits.gather(1, ids) - torch.logsumexp(logits, dim=1, keepdim=True)


def _work_dtype(teacher_logprobs: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32 (an (N, V) float64 copy of a large vocabulary would be costly)."""
    return torch.float64 if teacher_logprobs.dtype == torch.float64 else torch.float32


def _proposal_logprobs(teacher_logprobs: torch.Tensor, proposal_temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(teacher_logprobs, dim=-1)
    return logp if proposal_temperature == 1.0 else torch.log_softmax(logp / proposal_temperature, dim=-1)


def _check_teacher(teacher_logprobs) -> None:
    if not isinstance(teacher_logprobs, torch.Tensor) or teacher_logprobs.dim() != 2:
        shape = tuple(teacher_logprobs.shape) if isinstance(teacher_logprobs, torch.Tensor) else None
        raise ValueError(f"teacher_logprobs must be a 2-D (N, V) tensor, got {shape or type(teacher_logprobs)}")
    if not teacher_logprobs.is_floating_point():
        raise ValueError(f"teacher_logprobs must be a floating-point tensor, got {teacher_logprobs.dtype}")
    if teacher_logprobs.shape[1] == 0:
        raise ValueError("teacher_logprobs must have at least one vocabulary column (V = 0)")
    if bool((torch.isnan(teacher_logprobs) | (teacher_logprobs == float("inf"))).any()):
        raise ValueError("teacher_logprobs must not contain NaN or +inf")
    if teacher_logprobs.numel() and not bool((teacher_logprobs > float("-inf")).any(dim=1).all()):
        raise ValueError("every row of teacher_logprobs needs a token with mass (a row is all -inf)")


def _check_temperature(proposal_temperature) -> None:
    if not _is_number(proposal_temperature) or not (math.isfinite(proposal_temperature) and proposal_temperature > 0):
        raise ValueError(f"proposal_temperature must be a finite number > 0, got {proposal_temperature!r}")


def _check_inputs(hidden, weight, bias, ids, log_weights, teacher_logprobs, logit_scale, softcap, temperature, beta,
                  chunk_rows) -> None:
    if not _is_number(beta) or beta != 0:
        raise ValueError(
            f"sampled teacher candidates estimate only beta=0 (forward KL), got beta={beta!r}: the generalized JSD "
            "with beta > 0 is not linear in the teacher distribution, so the samples used as a sparse teacher give "
            "a biased loss; use top-K candidates (fastdistill.sparse_jsd_loss) or online training for beta > 0"
        )
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be (N, D) and weight (V, D) with the same D, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"hidden and weight must be floating-point tensors, got {hidden.dtype} and {weight.dtype}")
    N, V = hidden.shape[0], weight.shape[0]
    if bias is not None and bias.shape != (V,):
        raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
    if ids.dim() != 2 or ids.shape[0] != N or ids.shape[1] == 0:
        raise ValueError(f"ids must be 2-D (N, S) with N = {N} and S >= 1, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= V):
        raise ValueError(f"ids must lie in [-1, V) = [-1, {V}) (-1 = empty slot), got values in [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    for name, x in (("log_weights", log_weights), ("teacher_logprobs", teacher_logprobs)):
        if x is None:
            continue
        if x.shape != ids.shape:
            raise ValueError(f"{name} must have the shape of ids {tuple(ids.shape)}, got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if bool(((ids >= 0) & (torch.isnan(log_weights) | (log_weights == float("inf")))).any()):
        raise ValueError("log_weights must be finite or -inf (weight 0) on slots with an id")
    used = (ids >= 0) & (log_weights > float("-inf"))
    if teacher_logprobs is not None and bool((used & ~torch.isfinite(teacher_logprobs)).any()):
        raise ValueError("teacher_logprobs must be finite on every slot with a weight (the teacher's log-prob of a "
                         "sampled token)")
    for name, value in (("temperature", temperature), ("logit_scale", logit_scale)):
        if not _is_number(value) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if softcap is not None and (not _is_number(softcap) or not (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
