"""Window-level normalisation: a token mean over the whole gradient-accumulation window across ranks.

TRL 1.16 divides each micro-batch by its own token count, so a step's gradient is a mean of micro-batch
means; short micro-batches then weigh as much as long ones. Here every scored token of the window weighs
the same: count the window's tokens first (cheap: masks only), then scale each micro-batch's summed loss.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .support import canonical_mask


def scored_positions(ids: torch.Tensor, lps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Number of positions :func:`fastdistill.sparse_jsd_loss` will score (0-dim int64), from ``(N, S)`` inputs."""
    return canonical_mask(ids, lps, mask).any(dim=-1).sum()


def window_token_count(counts: Iterable[int | torch.Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Scored tokens in the window: the sum of this rank's micro-batch ``counts``, all-reduced over ``group``.

    Call it on every rank (it is a collective when ``torch.distributed`` is initialised).
    """
    total = torch.tensor(float(sum(int(c) for c in counts)), dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        total = total.to(device)
        dist.all_reduce(total, group=group)
    return int(total.item())


def window_loss_scale(window_tokens: int, group: dist.ProcessGroup | None = None) -> float:
    """Factor turning a micro-batch's summed loss into its share of the window's token mean.

    DDP and FSDP average gradients over the ranks of ``group``, so the factor carries the world size:
    ``Σ_ranks Σ_microbatches scale · loss_sum`` averaged over ranks equals the window's token mean.
    A window without scored tokens gives 0-weight losses (scale = world / 1).
    """
    if isinstance(window_tokens, bool) or not isinstance(window_tokens, int) or window_tokens < 0:
        raise ValueError(f"window_tokens must be an int >= 0, got {window_tokens!r}")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return world / max(window_tokens, 1)
