"""Gloo transport for weight sync between independently launched processes (torch only, no vLLM import).

Wire format: the trainer (rank 0) and every receiver derive the same chunk plan from a manifest (names, dtypes,
shapes). Each chunk is one ``uint8`` buffer broadcast from rank 0; every tensor occupies a slot starting at a
64-byte-aligned offset so that the receiver can ``.view(dtype)`` any slot in place, whatever the dtypes around it.
A chunk closes before the tensor that would take it past ``bucket_bytes``; a tensor larger than ``bucket_bytes``
travels alone in a chunk of its own size.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fastdistill.sync.network import LOOPBACK, is_loopback_host, local_address_towards

ALIGN_BYTES = 64
DEFAULT_BUCKET_BYTES = 256 << 20
STORE_PREFIX = "fastdistill_sync"


@dataclass(frozen=True)
class TensorSpec:
    """One entry of a manifest: the tensor's name, dtype and full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _itemsize(self.dtype)


Manifest = Sequence[TensorSpec]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in its chunk: byte ``offset`` (a multiple of 64) and ``nbytes``."""

    spec: TensorSpec
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class Chunk:
    """One broadcast buffer: its slots in manifest order and its size in bytes (end of the last slot)."""

    slots: tuple[Slot, ...]
    nbytes: int


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling vLLM's update info uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; a clear error for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype name: {name!r}")
    return dtype


def manifest_from_lists(
    names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorSpec]:
    """Build a manifest from the three parallel lists of vLLM's update info; they must have equal lengths."""
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(
            "names, dtype_names and shapes must have equal lengths, "
            f"got {len(names)}, {len(dtype_names)}, {len(shapes)}"
        )
    return [
        TensorSpec(name, dtype_from_name(d), tuple(int(s) for s in shape))
        for name, d, shape in zip(names, dtype_names, shapes, strict=True)
    ]


def manifest_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The manifest of concrete tensors (reads dtype and shape only; for a DTensor its global shape)."""
    return [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in named_tensors]


def plan_chunks(manifest: Manifest, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Chunk]:
    """Split ``manifest`` into chunks of at most ``bucket_bytes`` (except lone oversize tensors), in order.

    Deterministic: sender and receivers call it on the same manifest and get the same boundaries.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    chunks: list[Chunk] = []
    slots: list[Slot] = []
    end = 0
    for spec in manifest:
        offset = _align(end) if slots else 0
        if slots and offset + spec.nbytes > bucket_bytes:
            chunks.append(Chunk(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(spec, offset))
        end = offset + spec.nbytes
    if slots:
        chunks.append(Chunk(tuple(slots), end))
    return chunks


# ------------------------------------------------------------------------------------------------ the group


def _gloo_device(master_address: str) -> dist.ProcessGroupGloo.Device:
    """The interface this rank's gloo connections use. Loopback: 127.0.0.1 on every rank, so a hostname resolving to
    some other interface cannot break a same-host group. Across hosts: ``$GLOO_SOCKET_IFNAME`` if set, else the
    local address that routes to ``master_address`` (gloo's own default follows the hostname, which container
    images often map to 127.0.0.1, unreachable from another host)."""
    if is_loopback_host(master_address):
        return dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    try:
        return dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))
    except OSError:
        return dist.ProcessGroupGloo.create_default_device()


def _listening_socket(address: str, port: int) -> int:
    """A TCP socket bound to ``address:port`` (``0``: a free port) and listening, as a bare file descriptor for
    the store to own."""
    family, kind, protocol, _, where = socket.getaddrinfo(address.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener.detach()


def create_store(
    master_address: str, master_port: int, *, rank: int, world_size: int, timeout_s: float
) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it (``master_port=0`` picks a free port; read it back from ``.port``).

    Rank 0's store listens on ``master_address`` only (a socket bound there is handed to it): left to itself, a
    ``TCPStore`` listens on every interface of the host whatever address it is given."""
    listen_fd = _listening_socket(master_address, master_port) if rank == 0 else None
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=(rank == 0),
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def create_gloo_group(
    store: dist.Store, master_address: str, *, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """Join a standalone gloo group of ``world_size`` ranks over ``store`` (blocks until every rank has joined).

    The group is not registered with ``torch.distributed``'s default group, so it coexists with the trainer's
    own (FSDP) group and with vLLM's.
    """
    options = dist.ProcessGroupGloo._Options()
    options._devices = [_gloo_device(master_address)]
    options._timeout = timedelta(seconds=timeout_s)
    options._threads = 2
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, options)


def join_gloo_group(
    master_address: str, master_port: int, *, rank: int, world_size: int, timeout_s: float = 600.0
) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
    """Store + group in one call (what a receiver does). Keep the store alive as long as the group."""
    store = create_store(master_address, master_port, rank=rank, world_size=world_size, timeout_s=timeout_s)
    return store, create_gloo_group(store, master_address, rank=rank, world_size=world_size, timeout_s=timeout_s)


# ------------------------------------------------------------------------------------------------ send / receive


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def send_tensors(
    group: dist.ProcessGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    manifest: Manifest | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    src: int = 0,
) -> int:
    """Broadcast ``named_tensors`` from rank ``src`` chunk by chunk; returns the number of bytes broadcast.

    ``named_tensors`` is consumed lazily, one tensor at a time, so a generator that gathers each parameter just in
    time keeps at most one chunk plus one tensor in memory. It must match ``manifest`` (names, dtypes, shapes, order);
    a mismatch raises ``ValueError`` naming the first divergent entry. Without ``manifest`` the tensors are listed
    first and the manifest is read from them.
    """
    if manifest is None:
        named_tensors = list(named_tensors)
        manifest = manifest_of(named_tensors)
    iterator = iter(named_tensors)
    sent = 0
    for chunk in plan_chunks(manifest, bucket_bytes):
        if len(chunk.slots) == 1:  # a lone tensor goes out as-is: no copy into a staging buffer
            buffer = _as_bytes(_next_checked(iterator, chunk.slots[0].spec))
        else:
            buffer = torch.empty(chunk.nbytes, dtype=torch.uint8)
            for slot in chunk.slots:
                buffer[slot.offset : slot.end].copy_(_as_bytes(_next_checked(iterator, slot.spec)))
        if chunk.nbytes:  # a chunk of empty tensors has nothing to send (both sides skip it)
            group.broadcast(buffer, src).wait()
        sent += chunk.nbytes
    extra = next(iterator, None)
    if extra is not None:
        raise ValueError(f"more tensors than the manifest's {len(manifest)}; first extra is {extra[0]!r}")
    return sent


def _next_checked(iterator: Iterator[tuple[str, torch.Tensor]], spec: TensorSpec) -> torch.Tensor:
    item = next(iterator, None)
    if item is None:
        raise ValueError(f"the tensors ran out before the manifest did: {spec.name!r} is missing")
    name, tensor = item
    if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"tensor disagrees with the manifest: expected {spec.name!r} {dtype_name(spec.dtype)} {list(spec.shape)}, "
            f"got {name!r} {dtype_name(tensor.dtype)} {list(tensor.shape)}"
        )
    return tensor


def receive_tensors(
    group: dist.ProcessGroup,
    manifest: Manifest,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    src: int = 0,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive what :func:`send_tensors` broadcasts: yields one list of ``(name, tensor)`` per chunk, in order.

    Each chunk lands in a freshly allocated CPU buffer and the tensors are views into it, so a consumer may keep
    references across chunks (vLLM's layerwise loader holds them until a layer is complete).
    """
    for chunk in plan_chunks(manifest, bucket_bytes):
        buffer = torch.empty(chunk.nbytes, dtype=torch.uint8)
        if chunk.nbytes:
            group.broadcast(buffer, src).wait()
        yield [(slot.spec.name, _view(buffer, slot)) for slot in chunk.slots]


def _view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    spec = slot.spec
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    return buffer[slot.offset : slot.end].view(spec.dtype).view(spec.shape)
