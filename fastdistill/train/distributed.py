"""The process group: one process, or torchrun's ranks (gloo on CPU, NCCL on GPU), and the few collectives the
loop needs beyond FSDP2's."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastdistill.errors import CollectiveTimeoutError, ConfigError, LostRankError
from fastdistill.sync import peers
from fastdistill.sync.network import LOOPBACK, interface_towards, is_loopback_host, local_address_towards

# A collective that timed out: gloo's "Timed out waiting 1800000ms for recv operation to complete", NCCL's watchdog
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ ?ms|collective operation timeout", re.IGNORECASE)

# Options that need a single trainer process, and why.
SINGLE_PROCESS_OPTIONS = {
    "weight_sync_overlap": "its snapshot is gathered on the training thread, but a sharded push would run "
                           "collectives from another thread",
    "verify_weight_sync": "the check compares the server with one process's whole model",
}


def check_world_size(config: Any, world_size: int, sharded: bool = False) -> None:
    """Raise :class:`ConfigError` at start-up when ``config`` turns on an option of :data:`SINGLE_PROCESS_OPTIONS`
    and ``world_size`` trainer processes run, or the one process's student is ``sharded`` with FSDP2 over a process
    group (rather than after the first weight sync)."""
    if world_size == 1 and not sharded:
        return
    running = (f"{world_size} run" if world_size > 1 else
               "its student is FSDP2-sharded over a process group of one rank")
    for name, why in SINGLE_PROCESS_OPTIONS.items():
        if getattr(config, name, False):
            raise ConfigError(f"{name}=True needs a single trainer process, but {running} ({why}): set "
                              f"{name}=False or run one process without a process group")


@dataclass
class Distributed:
    """This process's place: ``rank`` of ``world_size`` data-parallel ranks, on ``device``."""

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # init_distributed created the process group: close() destroys it
    addresses: tuple[str, ...] = ()  # per rank, its address towards MASTER_ADDR (what gloo's errors name)
    timeout_s: float | None = None  # the collectives' timeout (ddp_timeout); None: torch's default
    watch: peers.PeerWatch | None = None  # the heartbeat of the ranks (rank_heartbeat_timeout_s > 0)
    sharded: bool = False  # a process group exists: the student is FSDP2-sharded over it (also with one rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if self.world_size == 1:
            return value
        peers.await_main()  # rank 0 may have worked alone for long: the others wait in the store
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def scatter(self, per_rank: list[Any] | None) -> Any:
        """Rank 0 passes one picklable object per rank; every rank gets its own."""
        if self.world_size == 1:
            return per_rank[0] if per_rank is not None else None
        received: list[Any] = [None]
        peers.await_main()
        dist.scatter_object_list(received, per_rank if self.is_main else None, src=0)
        return received[0]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of a CPU tensor (moved to the device for NCCL and back)."""
        if self.world_size == 1:
            return tensor
        reduced = tensor.to(self.device)
        dist.all_reduce(reduced)
        return reduced.cpu()

    def lost_rank_error(self, error: BaseException) -> RuntimeError | None:
        """A :class:`LostRankError` naming the other ranks at the peer addresses a failed collective's ``error``
        names (gloo: ``Read error [10.0.0.2]:41234: Connection reset by peer``), or, for a collective that timed out
        (gloo: ``Timed out waiting 1800000ms for recv``; NCCL's watchdog), the ranks whose heartbeat went silent
        (a :class:`CollectiveTimeoutError` when none did); None when it is neither."""
        text = str(error)
        first_line = text.splitlines()[0][:300] if text else type(error).__name__
        named = set(re.findall(r"\[([0-9A-Fa-f.:]+)\]:\d+", text))
        lost = [rank for rank, address in enumerate(self.addresses) if address in named and rank != self.rank]
        if lost:
            where = ", ".join(sorted(named & set(self.addresses)))
            ranks = ", ".join(map(str, lost))
            return LostRankError(
                f"rank {self.rank} lost trainer rank(s) {ranks} of {self.world_size} (at {where}): a collective with "
                f"it failed ({first_line}). Resume every node with resume_from_checkpoint=latest once it is back")
        # torch's own timeout texts only (gloo; NCCL's watchdog): fastdistill's errors mention their own timeouts
        if type(error).__module__.startswith("fastdistill") or not _COLLECTIVE_TIMEOUT.search(text):
            return None
        silent = self.watch.silent(2 * self.watch.interval_s) if self.watch is not None else []
        if silent:
            ranks = ", ".join(str(rank) for rank, _ in silent)
            where = ", ".join(self.addresses[rank] for rank, _ in silent if rank < len(self.addresses))
            return LostRankError(
                f"rank {self.rank} lost trainer rank(s) {ranks} of {self.world_size} (at {where}): a collective "
                f"timed out ({first_line}) and its heartbeat is {silent[0][1]:.0f} s old. Resume every node with "
                "resume_from_checkpoint=latest once it is back")
        limit = f"ddp_timeout={self.timeout_s:g} s" if self.timeout_s else "torch's default timeout"
        alive = ("every rank's heartbeat is current: a rank is alive but did not join the collective"
                 if self.watch is not None else "no heartbeat to tell which rank (rank_heartbeat_timeout_s=0)")
        return CollectiveTimeoutError(
            f"rank {self.rank}: a collective of the {self.world_size} trainer ranks timed out after {limit} "
            f"({first_line}); {alive}")

    def close(self, error: BaseException | None = None) -> None:
        """Stop the heartbeat (marking this rank done, or failed with ``error``: the other ranks then end naming
        it; on rank 0 the ranks parked for it wake with ``error`` at once) and destroy the process group if
        :func:`init_distributed` created it (a group made by the caller stays); calling it again does nothing. Every
        rank calls it, at the end of the run."""
        if error is not None and self.is_main:
            peers.release_failed(error)  # the ranks parked for rank 0 wake with its error
        if self.watch is not None:
            self.watch.stop(error)
            self.watch = None
        if self.world_size > 1:
            peers.activate(None)
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


@contextlib.contextmanager
def _gloo_interface_towards_master(*, enabled: bool) -> Iterator[None]:
    """While the gloo group forms: ``$GLOO_SOCKET_IFNAME`` set to the interface that routes to ``$MASTER_ADDR``,
    unless it is set already or the master is loopback. Gloo's own default is the address the host name resolves
    to, which many images map to 127.0.0.1: a rank on another host would then be told to connect to its own
    loopback."""
    master = os.environ.get("MASTER_ADDR", "")
    interface = interface_towards(master) if enabled and master and "GLOO_SOCKET_IFNAME" not in os.environ else None
    if interface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def init_distributed(init_method: str | None = None, *, timeout_s: float | None = None,
                     heartbeat_timeout_s: float = 0.0) -> Distributed:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``; gloo on CPU, NCCL on
    GPU), or run as one process: unsharded, or sharded with FSDP2 over a group of one rank its caller created (the
    multi-GPU code path on one device). ``init_method`` (default: torchrun's ``MASTER_ADDR``/``MASTER_PORT``) is
    where the ranks meet; ``timeout_s`` (the config's ``ddp_timeout``) bounds every collective of the group (None:
    torch's default). A group that already exists is used as it is, and left to its creator to destroy.

    With several ranks and ``heartbeat_timeout_s > 0`` every rank starts a :class:`~fastdistill.sync.peers.
    PeerWatch` (a rank silent that long ends the others, naming it); the rank-0-only waits park the other ranks in
    the store (:func:`~fastdistill.sync.peers.await_main`)."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns_group = world_size > 1 and not dist.is_initialized()
    if owns_group:
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        with _gloo_interface_towards_master(enabled=not cuda and init_method is None):
            dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, world_size=world_size,
                                    rank=int(os.environ["RANK"]), **timeout)
        if not cuda:
            atexit.unregister(_gloo_exit_grace)  # once per process, however many groups it makes in turn
            atexit.register(_gloo_exit_grace)
    rank = dist.get_rank() if dist.is_initialized() else 0
    addresses: tuple[str, ...] = ()
    watch = None
    if world_size > 1:
        main_store = dist.distributed_c10d._get_default_store()
        release_store = peers.prefixed(main_store, _attempt())
        if heartbeat_timeout_s > 0:
            store, release_store, host = _heartbeat_stores(main_store, heartbeat_timeout_s)
            watch = peers.PeerWatch(store, rank, world_size, timeout_s=heartbeat_timeout_s, store_host=host)
            watch.announce()  # before the collective below: every key a watch reads exists once any starts
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, _address_towards_master())
        addresses = tuple(gathered)
        if watch is not None:
            watch.addresses = addresses
            watch.start()
        peers.activate(peers.MainRelease(release_store, rank, watch))
    return Distributed(rank, world_size, device, owns_group=owns_group, addresses=addresses, timeout_s=timeout_s,
                       watch=watch, sharded=dist.is_initialized())


GLOO_EXIT_GRACE_S = 0.5


def _gloo_exit_grace() -> None:
    """At interpreter exit, before finalisation: release the GIL for a moment. A gloo worker thread frees a finished
    collective's tensors after the waiting thread has moved on, and that needs the GIL; one still doing so when the
    interpreter finalises is killed inside C++ and aborts the process ("terminate called without an active
    exception", seen on a loaded machine right after a run's last scatter). The process group's own threads are
    joined only when its last reference goes, and FSDP keeps one until the model is freed."""
    time.sleep(GLOO_EXIT_GRACE_S)


def _heartbeat_stores(store: Any, timeout_s: float) -> tuple[Any, Any, str]:
    """The heartbeat thread's store, whose operations time out after ``timeout_s``, the main thread's view of the
    same keys (its release counter and rank 0's failure, on another connection: a blocked read on one does not
    hold up the other), and the host the store lives on. With the group's store a TCPStore (torchrun's, on node
    0) the heartbeat gets a client of its own; a file store (local, it does not hang) serves both."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        client = dist.TCPStore(base.host, base.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_for_workers=False)
        return peers.prefixed(client, _attempt()), peers.prefixed(base, _attempt()), f"{base.host}:{base.port}"
    return peers.prefixed(store, _attempt()), peers.prefixed(store, _attempt()), ""


def _attempt() -> str:
    """The key prefix of this torchrun attempt (run id and restart count): torchrun's agent store outlives a
    restart, and a restarted rank must not read the previous attempt's heartbeats or releases."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _address_towards_master() -> str:
    """This rank's address that routes to ``$MASTER_ADDR`` (loopback for a loopback or unknown master)."""
    master = os.environ.get("MASTER_ADDR", "")
    if not master or is_loopback_host(master):
        return LOOPBACK
    try:
        return local_address_towards(master)
    except OSError:
        return LOOPBACK


# ------------------------------------------------------------------------------------------------ samples as tensors
#
# Rollout samples carry numpy arrays (token ids, teacher candidates, a hidden-state teacher's (L, D) states: at a 7B
# teacher's width that is MBs per sample); the helpers below pickle only a skeleton of them (the arrays replaced by
# references, plus each array's dtype and shape) and send the arrays' bytes as uint8 tensors, packed into chunks of
# at most CHUNK_BYTES, on the training device (NCCL sends device tensors; gloo CPU ones).

CHUNK_BYTES = 256 << 20
_ALIGN = 16  # every array starts on a 16-byte boundary of its chunk, so the received views are aligned


@dataclass(frozen=True)
class _ArrayRef:
    index: int


@dataclass(frozen=True)
class ArrayPayload:
    """A payload split for sending: ``skeleton`` (its structure, arrays replaced by references), ``specs`` (dtype
    string and shape per array) and ``chunk_bytes`` (pickled, the :attr:`metadata`), and the ``arrays`` themselves
    (sent as tensors). Both sides derive the chunk layout from the metadata (:func:`chunk_layout`)."""

    skeleton: Any
    specs: list[tuple[str, tuple[int, ...]]]
    chunk_bytes: int
    arrays: list[np.ndarray]

    @property
    def metadata(self) -> tuple[Any, list[tuple[str, tuple[int, ...]]], int]:
        """What travels pickled: the skeleton, the specs and the chunk size."""
        return self.skeleton, self.specs, self.chunk_bytes

    @property
    def chunks(self) -> list[tuple[list[tuple[int, int]], int]]:
        """The chunk layout (see :func:`chunk_layout`)."""
        return chunk_layout(self.specs, self.chunk_bytes)


def chunk_layout(specs: list[tuple[str, tuple[int, ...]]], chunk_bytes: int) -> list[tuple[list[tuple[int, int]], int]]:
    """Per chunk, the ``(array index, byte offset)`` of its arrays and its byte count: arrays in order, each at a
    16-byte aligned offset, a chunk closed before it would pass ``chunk_bytes`` (a larger array gets its own)."""
    chunks: list[tuple[list[tuple[int, int]], int]] = []
    members: list[tuple[int, int]] = []
    size = 0
    for index, (dtype, shape) in enumerate(specs):
        nbytes = np.dtype(dtype).itemsize * math.prod(shape)
        start = -(-size // _ALIGN) * _ALIGN
        if members and start + nbytes > chunk_bytes:
            chunks.append((members, size))
            members, start = [], 0
        members.append((index, start))
        size = start + nbytes
    if members:
        chunks.append((members, size))
    return chunks


def split_arrays(payload: Any, chunk_bytes: int | None = None) -> ArrayPayload:
    """``payload`` (lists, tuples and dicts of dataclass instances such as
    :class:`~fastdistill.rollout.RolloutSample`, bare numpy arrays and other picklable values) split into a skeleton
    and its numpy arrays: every array that is a top-level field of a dataclass instance, or an element of a list,
    tuple or dict, is replaced by a reference. The inputs are not modified. Chunks hold up to ``chunk_bytes``
    (default :data:`CHUNK_BYTES`); a larger array gets a chunk of its own."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    arrays: list[np.ndarray] = []

    def strip(value: Any) -> Any:
        if isinstance(value, np.ndarray) and value.dtype != object:
            arrays.append(np.ascontiguousarray(value))
            return _ArrayRef(len(arrays) - 1)
        if isinstance(value, list):
            return [strip(item) for item in value]
        if isinstance(value, tuple):
            return tuple(strip(item) for item in value)
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {f.name: strip(getattr(value, f.name)) for f in dataclasses.fields(value)
                       if f.init and isinstance(getattr(value, f.name), np.ndarray)}
            return dataclasses.replace(value, **changes) if changes else value
        return value

    skeleton = strip(payload)
    specs = [(array.dtype.str, tuple(array.shape)) for array in arrays]
    return ArrayPayload(skeleton, specs, chunk_bytes, arrays)


def join_arrays(skeleton: Any, arrays: list[np.ndarray]) -> Any:
    """The payload of :func:`split_arrays`'s ``skeleton`` with its references replaced by ``arrays``."""

    def fill(value: Any) -> Any:
        if isinstance(value, _ArrayRef):
            return arrays[value.index]
        if isinstance(value, list):
            return [fill(item) for item in value]
        if isinstance(value, tuple):
            return tuple(fill(item) for item in value)
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {f.name: fill(getattr(value, f.name)) for f in dataclasses.fields(value)
                       if f.init and isinstance(getattr(value, f.name), _ArrayRef)}
            return dataclasses.replace(value, **changes) if changes else value
        return value

    return fill(skeleton)


def _chunk_tensor(split: ArrayPayload, members: list[tuple[int, int]], size: int,
                  device: torch.device) -> torch.Tensor:
    buffer = np.zeros(size, np.uint8)
    for index, offset in members:
        array = split.arrays[index]
        buffer[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    return torch.from_numpy(buffer).to(device)


def _unpack_chunks(metadata: Any, received: list[torch.Tensor]) -> Any:
    skeleton, specs, chunk_bytes = metadata
    chunks = chunk_layout(specs, chunk_bytes)
    arrays: list[np.ndarray] = [np.empty(0)] * len(specs)
    for (members, _), tensor in zip(chunks, received, strict=True):
        host = tensor.cpu().numpy()
        for index, offset in members:
            dtype, shape = np.dtype(specs[index][0]), specs[index][1]
            count = math.prod(shape)
            arrays[index] = host[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
    return join_arrays(skeleton, arrays)


def broadcast_samples(group: Distributed, payload: Any) -> Any:
    """Rank 0's ``payload`` (e.g. a list of :class:`~fastdistill.rollout.RolloutSample`) on every rank, its numpy
    arrays sent as tensors (``dist.broadcast`` of uint8 chunks) and only the small rest pickled. Collective; other
    ranks pass anything (ignored). Rank 0 gets its own object back."""
    if group.world_size == 1:
        return payload
    split = split_arrays(payload) if group.is_main else None
    metadata = group.broadcast(split.metadata if split is not None else None)
    received = []
    for members, size in chunk_layout(*metadata[1:]):
        tensor = (_chunk_tensor(split, members, size, group.device) if split is not None
                  else torch.empty(size, dtype=torch.uint8, device=group.device))
        if size:  # a chunk of empty arrays (e.g. a hidden teacher's (L, 0) candidates) has nothing to send
            dist.broadcast(tensor, src=0)
        received.append(tensor)
    return payload if group.is_main else _unpack_chunks(metadata, received)


def scatter_samples(group: Distributed, per_rank: list[Any] | None) -> Any:
    """Rank 0 passes one payload per rank (lists, tuples of samples, ...); every rank gets its own, the numpy arrays
    sent point to point as tensors (``dist.send`` / ``dist.recv`` of uint8 chunks) and only the small rest pickled
    (``scatter_object_list``). Rank 0 keeps its own payload without a copy."""
    if group.world_size == 1:
        return per_rank[0] if per_rank is not None else None
    splits = [split_arrays(payload) for payload in per_rank] if group.is_main else None
    metadata = group.scatter([split.metadata for split in splits] if splits is not None else None)
    if group.is_main:
        for rank in range(1, group.world_size):
            for members, size in splits[rank].chunks:
                if size:
                    dist.send(_chunk_tensor(splits[rank], members, size, group.device), dst=rank)
        return per_rank[0]
    received = []
    for _, size in chunk_layout(*metadata[1:]):
        tensor = torch.empty(size, dtype=torch.uint8, device=group.device)
        if size:
            dist.recv(tensor, src=0)
        received.append(tensor)
    return _unpack_chunks(metadata, received)
