"""The process group: one process, or torchrun's ranks (gloo on CPU, NCCL on GPU), and the few collectives the
loop needs beyond FSDP2's."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    """This process's place: ``rank`` of ``world_size`` data-parallel ranks, on ``device``."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if self.world_size == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def scatter(self, per_rank: list[Any] | None) -> Any:
        """Rank 0 passes one picklable object per rank; every rank gets its own."""
        if self.world_size == 1:
            return per_rank[0] if per_rank is not None else None
        received: list[Any] = [None]
        dist.scatter_object_list(received, per_rank if self.is_main else None, src=0)
        return received[0]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of a CPU tensor (moved to the device for NCCL and back)."""
        if self.world_size == 1:
            return tensor
        reduced = tensor.to(self.device)
        dist.all_reduce(reduced)
        return reduced.cpu()


def init_distributed() -> Distributed:
    """Join the process group torchrun describes (gloo on CPU, NCCL on GPU), or run as one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Distributed(rank, world_size, device)
