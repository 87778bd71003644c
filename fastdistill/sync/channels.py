"""The trainer's end of the broadcast group a weight sync streams through: ``gloo`` (a hand-built group with
fastdistill's plugin engine in the server) or ``nccl`` (vLLM's own engine and trainer-side helpers, GPU only).

A channel opens once (a rendezvous that runs while the server's ``/init_weight_transfer_engine`` call blocks), then
hands out one broadcaster per push. Nothing here imports vLLM unless the channel is NCCL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastdistill.errors import WeightSyncError
from fastdistill.sync.threads import TaskFailed, run_together
from fastdistill.sync.transport import TensorSpec, create_gloo_group, create_store, send_tensors

NCCL_NUM_BUFFERS = 2  # vLLM's packed NCCL default; both sides must agree

Weights = Iterator[tuple[str, torch.Tensor]]
PostInit = Callable[[dict[str, Any]], Any]  # POST /init_weight_transfer_engine with this init_info


def init_info(master_address: str, port: int, world_size: int, bucket_bytes: int) -> dict[str, Any]:
    """The keys of vLLM's NCCL ``init_info`` (the trainer is rank 0, the server's workers follow)."""
    return {
        "master_address": master_address,
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        "packed": True,
        "packed_buffer_size_bytes": bucket_bytes,
    }


def open_together(rendezvous: Callable[[], Any], post_init: Callable[[], Any], name: str, timeout_s: float) -> Any:
    """Run the trainer's rendezvous and the server's init call at once (each blocks until the other side arrives);
    return the rendezvous' result. An HTTP failure surfaces at once; the abandoned rendezvous times out on its
    thread."""
    try:
        return run_together({name: rendezvous, "/init_weight_transfer_engine": post_init}, timeout_s)[name]
    except TaskFailed as failure:
        if isinstance(failure.error, WeightSyncError):
            raise failure.error from None
        raise WeightSyncError(f"weight sync failed in {failure}") from failure.error


class _Channel:
    """What both channels hold: where the trainer hosts the group, the broadcast bucket size and the timeout."""

    def __init__(self, master_address: str, master_port: int | None, *, bucket_bytes: int, timeout_s: float):
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._store: Any = None
        self._group: Any = None

    @property
    def is_open(self) -> bool:
        return self._group is not None


class GlooChannel(_Channel):
    """A gloo group hosted by the trainer at ``master_address:master_port`` (a free port when ``None``)."""

    backend = "gloo"

    def open(self, world_size: int, post_init: PostInit) -> None:
        """Host the store, then join the group while the server's workers join through ``post_init``."""
        store = create_store(
            self.master_address, self.master_port or 0, rank=0, world_size=world_size, timeout_s=self.timeout_s
        )
        info = init_info(self.master_address, store.port, world_size, self.bucket_bytes)
        info.update(packed_num_buffers=1, timeout_s=self.timeout_s)
        group = open_together(
            lambda: create_gloo_group(store, self.master_address, rank=0, world_size=world_size,
                                      timeout_s=self.timeout_s),
            lambda: post_init(info),
            "gloo rendezvous",
            self.timeout_s,
        )
        self._store, self._group = store, group

    def broadcaster(self, weights: Weights, manifest: list[TensorSpec]) -> Callable[[], None]:
        """The broadcast of ``weights`` as a callable for a worker thread (it also drives FSDP gathers)."""
        group = self._group

        def send() -> None:
            send_tensors(group, weights, manifest, bucket_bytes=self.bucket_bytes)

        return send

    def drop(self) -> None:
        """Forget the group and the store (after a broken broadcast, which leaves them unusable)."""
        self._group = self._store = None

    def close(self) -> None:
        """Drop the group and the store (the server keeps its side until it is re-initialised)."""
        self.drop()


class NcclChannel(_Channel):
    """vLLM's NCCL group (``nccl_common.trainer_init``) on the current CUDA device."""

    backend = "nccl"

    def open(self, world_size: int, post_init: PostInit) -> None:
        """Rendezvous through vLLM's helper while the server's workers join through ``post_init``."""
        nccl_common = _import_vllm_nccl()
        from vllm.utils.network_utils import get_open_port  # vLLM: only the NCCL channel needs it (see above)

        info = init_info(self.master_address, self.master_port or get_open_port(), world_size, self.bucket_bytes)
        info["packed_num_buffers"] = NCCL_NUM_BUFFERS
        device = torch.cuda.current_device()

        def rendezvous() -> Any:
            torch.cuda.set_device(device)  # the CUDA device is per thread
            return nccl_common.trainer_init(info)

        self._group = open_together(rendezvous, lambda: post_init(info), "nccl rendezvous", self.timeout_s)

    def broadcaster(self, weights: Weights, manifest: list[TensorSpec]) -> Callable[[], None]:
        """vLLM's packed NCCL producer over ``weights`` (moved to the device), as a callable for a worker thread."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer  # as above

        device = torch.device("cuda", torch.cuda.current_device())
        group = self._group

        def broadcast() -> None:
            torch.cuda.set_device(device)  # the CUDA device is per thread
            packed_nccl_broadcast_producer(
                iterator=((name, tensor.to(device, non_blocking=True)) for name, tensor in weights),
                group=group,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.bucket_bytes,
                num_buffers=NCCL_NUM_BUFFERS,
            )
            torch.cuda.current_stream().synchronize()

        return broadcast

    def drop(self) -> None:
        """Forget the communicator without tearing it down (after a broken broadcast)."""
        self._group = None

    def close(self) -> None:
        """Destroy the communicator."""
        group, self._group = self._group, None
        destroy = getattr(group, "destroy", None)
        if callable(destroy):
            destroy()


Channel = GlooChannel | NcclChannel


def _import_vllm_nccl() -> Any:
    """vLLM's NCCL helpers, imported here: only a trainer that pushes over NCCL needs vLLM installed."""
    try:
        from vllm.distributed.weight_transfer import nccl_common  # noqa: PLC0415
    except ImportError as error:
        raise WeightSyncError(
            f"backend='nccl' needs vLLM importable in the trainer's environment ({error}); install vllm, "
            "or use backend='gloo' with a server that loads fastdistill's gloo engine"
        ) from error
    return nccl_common
