"""Per-token levers of on-policy distillation computed from the sampled tokens' log-probabilities: IW-OPD position
weights (:func:`position_weights`) and TOP-D's bounded-reward advantages (:func:`topd_advantages`), each with a
packed-row form that the trainer applies per sample (docs/loss.md, "Position weights and the bounded reward")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

POSITION_WEIGHTINGS = ("none", "iw_opd")
DISAGREEMENT_FLOOR = 1e-8  # the denominator of the position weights: a sample whose Σ|a| is 0 gets w = 1 + γ
STD_FLOOR = 1e-6  # the z-score's floor on the group's standard deviation


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (never a half precision)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_gamma(gamma: float) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")


def check_alpha(alpha: float) -> None:
    """ValueError unless ``alpha`` is a number in the open interval (0, 1) (TOP-D's proximal-teacher mix)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")


def _check_pair(teacher: object, behaviour: object, where: str) -> None:
    for name, x in (("teacher_logprobs", teacher), ("behaviour_logprobs", behaviour)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}{where} must be a 1-D floating-point tensor (one sample's sampled-token "
                             f"log-probs), got {shape}")
    if teacher.shape != behaviour.shape:  # type: ignore[union-attr]
        raise ValueError(f"teacher_logprobs{where} and behaviour_logprobs{where} must have the same length, got "
                         f"{teacher.shape[0]} and {behaviour.shape[0]}")  # type: ignore[union-attr]
    if bool(torch.isnan(teacher).any() | torch.isnan(behaviour).any()):  # type: ignore[arg-type]
        raise ValueError(f"teacher_logprobs{where} and behaviour_logprobs{where} must not contain NaN")
    if not bool(torch.isfinite(behaviour).all()):  # type: ignore[arg-type]
        raise ValueError(f"behaviour_logprobs{where} must be finite (the log-prob of a token the policy sampled)")
    if bool((teacher == float("inf")).any()):  # type: ignore[operator]
        raise ValueError(f"teacher_logprobs{where} must not contain +inf (a log-probability)")


def position_weights(teacher_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                     gamma: float = 0.5) -> torch.Tensor:
    """IW-OPD's weights of one sample's T completion positions.

    With a_t = log π_T(y_t) − log π_b(y_t) (detached; π_b the behaviour policy that sampled y),

        w_t = 1 + γ·(1 − Σ_{s<t} |a_s| / max(Σ_s |a_s|, 1e-8))

    the share of the sample's teacher–behaviour disagreement still ahead of position t: w_1 = 1 + γ, falling to
    1 + γ·|a_T|/Σ|a| at the last position (1 + γ everywhere when every a_t is 0).

    Args:
        teacher_logprobs: ``(T,)`` log π_T of the sampled tokens (nats), finite.
        behaviour_logprobs: ``(T,)`` log π_b of the same tokens (nats), finite.
        gamma: γ >= 0 (0: every weight 1).

    Returns:
        ``(T,)`` weights in [1, 1 + γ], float32 (float64 for float64 inputs), detached, on the inputs' device.
    """
    _check_pair(teacher_logprobs, behaviour_logprobs, "")
    _check_gamma(gamma)
    if not bool(torch.isfinite(teacher_logprobs).all()):
        raise ValueError("teacher_logprobs must be finite (the teacher's log-prob of every sampled token)")
    dtype = _work_dtype(teacher_logprobs, behaviour_logprobs)
    size = (teacher_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype)).abs()
    before = torch.cumsum(size, 0) - size  # Σ_{s<t} |a_s|
    total = size.sum().clamp(min=DISAGREEMENT_FLOOR)
    return 1.0 + gamma * (1.0 - before / total)


def _bounded_rewards(teacher: torch.Tensor, behaviour: torch.Tensor, alpha: float) -> torch.Tensor:
    """r̃_t = log(α·π_T/π_b + 1 − α) as a logaddexp (−inf teacher log-probs give log(1 − α)), in float64."""
    log_ratio = teacher.detach().double() - behaviour.detach().double()
    return torch.logaddexp(math.log(alpha) + log_ratio, torch.full_like(log_ratio, math.log1p(-alpha)))


def _returns(rewards: torch.Tensor) -> torch.Tensor:
    """R̃_k = r̃_k + mean(r̃_{k+1..T}) (R̃_T = r̃_T) of one sample's rewards ``(T,)``."""
    count = rewards.shape[0]
    if count == 0:
        return rewards
    after = torch.flip(torch.cumsum(torch.flip(rewards, (0,)), 0), (0,)) - rewards  # Σ_{s>k} r̃_s
    remaining = torch.arange(count - 1, -1, -1, dtype=rewards.dtype, device=rewards.device)  # T − k
    return rewards + torch.where(remaining > 0, after / remaining.clamp(min=1), torch.zeros_like(after))


def _zscore(values: torch.Tensor) -> torch.Tensor:
    """(x − mean) / max(unbiased std, 1e-6) over every entry (std 0 for fewer than two entries)."""
    if values.numel() == 0:
        return values
    std = values.std(correction=1) if values.numel() > 1 else values.new_zeros(())
    return (values - values.mean()) / std.clamp(min=STD_FLOOR)


def topd_advantages(teacher_logprobs: Sequence[torch.Tensor], behaviour_logprobs: Sequence[torch.Tensor],
                    alpha: float = 0.2) -> list[torch.Tensor]:
    """TOP-D's advantages of a group of samples, from the bounded reward toward the proximal teacher
    α·π_T + (1 − α)·π_b.

    Per sample, with ρ_t = π_T(y_t)/π_b(y_t): r̃_t = log(α·ρ_t + 1 − α) (≥ log(1 − α), computed as
    logaddexp(log α + log π_T − log π_b, log(1 − α))), the return R̃_k = r̃_k + mean(r̃_{k+1..T}) (R̃_T = r̃_T),
    and the advantage is the z-score of R̃ over every token of the group: (R̃ − mean) / max(std, 1e-6), the
    unbiased std (0 for a group of one token).

    Args:
        teacher_logprobs: one ``(T_i,)`` tensor per sample, log π_T of its sampled tokens (nats; −inf allowed: a
            token the teacher rejects gets the bounded reward log(1 − α)).
        behaviour_logprobs: one ``(T_i,)`` tensor per sample, log π_b of the same tokens (nats), finite.
        alpha: α in (0, 1).

    Returns:
        One ``(T_i,)`` advantage tensor per sample, float32 (float64 for float64 inputs), detached.
    """
    if isinstance(teacher_logprobs, torch.Tensor) or isinstance(behaviour_logprobs, torch.Tensor):
        raise ValueError("teacher_logprobs and behaviour_logprobs must be lists of 1-D tensors (one per sample of "
                         "the group), not a tensor")
    teacher_logprobs, behaviour_logprobs = list(teacher_logprobs), list(behaviour_logprobs)
    if len(teacher_logprobs) != len(behaviour_logprobs):
        raise ValueError(f"teacher_logprobs and behaviour_logprobs must hold as many samples, got "
                         f"{len(teacher_logprobs)} and {len(behaviour_logprobs)}")
    if not teacher_logprobs:
        raise ValueError("a group needs at least one sample")
    check_alpha(alpha)
    for i, (teacher, behaviour) in enumerate(zip(teacher_logprobs, behaviour_logprobs, strict=True)):
        _check_pair(teacher, behaviour, f"[{i}]")
    returns = [_returns(_bounded_rewards(t, b, alpha)) for t, b in zip(teacher_logprobs, behaviour_logprobs,
                                                                       strict=True)]
    advantages = _zscore(torch.cat(returns))
    dtype = _work_dtype(*teacher_logprobs, *behaviour_logprobs)
    return [part.to(dtype) for part in torch.split(advantages, [r.shape[0] for r in returns])]


# ----------------------------------------------------------------------------------------- packed rows


def _sample_runs(token_sample: torch.Tensor) -> list[int]:
    """The lengths of the runs of equal sample indices of ``token_sample`` (M,), which must be grouped (each sample's
    positions contiguous, as a packed row lays them out)."""
    if token_sample.numel() == 0:
        return []
    ids, counts = torch.unique_consecutive(token_sample, return_counts=True)
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError("token_sample must keep each sample's positions contiguous (a packed row's order)")
    return counts.tolist()


def packed_position_weights(teacher_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                            token_sample: torch.Tensor, gamma: float = 0.5) -> torch.Tensor:
    """:func:`position_weights` of every sample of a packed row at once.

    ``teacher_logprobs``, ``behaviour_logprobs`` and ``token_sample`` are ``(M,)``: the row's trained positions in
    order, the sample each belongs to (contiguous). A position whose teacher log-prob is not finite (the teacher did
    not score its token) counts as no disagreement (a_t = 0) and gets its place's weight; every other position
    gets :func:`position_weights` of its sample. Returns ``(M,)`` float32 (float64 for float64 inputs)."""
    _check_gamma(gamma)
    dtype = _work_dtype(teacher_logprobs, behaviour_logprobs)
    teacher, behaviour = teacher_logprobs.detach().to(dtype), behaviour_logprobs.detach().to(dtype)
    scored = torch.isfinite(teacher) & torch.isfinite(behaviour)
    gap = torch.where(scored, teacher - behaviour, torch.zeros_like(teacher))
    parts = [position_weights(g, torch.zeros_like(g), gamma) for g in torch.split(gap, _sample_runs(token_sample))]
    return torch.cat(parts) if parts else teacher.new_zeros(0)


def packed_topd_advantages(teacher_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                           token_sample: torch.Tensor, alpha: float = 0.2) -> torch.Tensor:
    """:func:`topd_advantages` with the packed row's samples as the group: ``(M,)`` inputs in row order, the sample
    of each position in ``token_sample`` (contiguous); returns the ``(M,)`` advantages, float32 (float64 for float64
    inputs)."""
    lengths = _sample_runs(token_sample)
    if not lengths:
        return teacher_logprobs.new_zeros(0, dtype=_work_dtype(teacher_logprobs, behaviour_logprobs))
    parts = topd_advantages(list(torch.split(teacher_logprobs, lengths)), list(torch.split(behaviour_logprobs,
                                                                                            lengths)), alpha)
    return torch.cat(parts)
