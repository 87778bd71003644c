"""The process group: one process, or torchrun's ranks (gloo on CPU, NCCL on GPU), and the few collectives the
loop needs beyond FSDP2's."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastdistill.errors import ConfigError

# Options that need a single trainer process, and why.
SINGLE_PROCESS_OPTIONS = {
    "weight_sync_overlap": "its snapshot is gathered on the training thread, but a sharded push would run "
                           "collectives from another thread",
    "verify_weight_sync": "the check compares the server with one process's whole model",
}


def check_world_size(config: Any, world_size: int) -> None:
    """Raise :class:`ConfigError` at start-up when ``config`` turns on an option of :data:`SINGLE_PROCESS_OPTIONS`
    and ``world_size`` trainer processes run (rather than after the first weight sync)."""
    if world_size == 1:
        return
    for name, why in SINGLE_PROCESS_OPTIONS.items():
        if getattr(config, name, False):
            raise ConfigError(f"{name}=True needs a single trainer process, but {world_size} run ({why}): set "
                              f"{name}=False or run one process")


@dataclass
class Distributed:
    """This process's place: ``rank`` of ``world_size`` data-parallel ranks, on ``device``."""

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # init_distributed created the process group: close() destroys it

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

    def close(self) -> None:
        """Destroy the process group if :func:`init_distributed` created it (a group made by the caller stays);
        calling it again does nothing. Every rank calls it, at the end of the run."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def init_distributed(init_method: str | None = None) -> Distributed:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``; gloo on CPU, NCCL on
    GPU), or run as one process. ``init_method`` (default: torchrun's ``MASTER_ADDR``/``MASTER_PORT``) is where the
    ranks meet. A group that already exists is used as it is, and left to its creator to destroy."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns_group = world_size > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, world_size=world_size,
                                rank=int(os.environ["RANK"]))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Distributed(rank, world_size, device, owns_group=owns_group)
