"""Trainer side of weight sync: push a model's weights into the student's vLLM server.

The HTTP sequence is vLLM's own weight-transfer API (dev mode), identical for both backends:
``/pause?mode=keep&clear_cache=true`` -> ``/start_weight_update`` -> ``/update_weights`` (while the trainer
broadcasts) -> ``/finish_weight_update`` -> ``/resume``; or, with ``one_call=True`` (gloo), one ``/collective_rpc``
into fastdistill's worker extension, then ``/reset_prefix_cache?reset_running_requests=true``. Either way no KV of the
old weights outlives the sync: in-flight requests recompute theirs under the new weights (docs/sync.md, "Requests in
flight"). The broadcast goes through a channel (:mod:`fastdistill.sync.channels`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist

from fastdistill.auth import check_api_key
from fastdistill.errors import LostRankError, WeightSyncError
from fastdistill.options import TRANSFER_BACKENDS
from fastdistill.sync import peers
from fastdistill.sync.channels import Channel, GlooChannel, NcclChannel
from fastdistill.sync.http import CONTROL_TIMEOUT_S, request, served_dtype
from fastdistill.sync.naming import GatherClock, WeightSource, iter_named_weights, weight_manifest
from fastdistill.sync.network import rendezvous_address
from fastdistill.sync.threads import TaskFailed, run_together
from fastdistill.sync.transport import DEFAULT_BUCKET_BYTES, TensorSpec, dtype_name

logger = logging.getLogger(__name__)

_CLEANUP_S = 30.0  # best-effort calls after a failure
_DEADLINE_POLL_S = 0.1  # how often the student's deadline is checked during a transfer
# a gather still running this long when the student's part fails is the stall, not a gather that happened to run
_GATHER_STALL_S = 10.0
_GATHER_BACKSTOP_S = 7200.0  # beyond the student's timeout: a transfer whose gathers never return still ends


class WeightSync(ABC):
    """Pushes the trainer's weights to the rollout engine. Call :meth:`init` once, :meth:`push` per sync, then
    :meth:`close`; every trainer rank calls all three (only the sender talks to the server)."""

    @abstractmethod
    def init(self) -> None:
        """Connect to the rollout engine (once, before the first push)."""

    @abstractmethod
    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Make the engine serve ``model``'s current weights as ``version``; returns timings in seconds."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection (the server keeps serving the last pushed weights)."""

    def __enter__(self) -> WeightSync:
        self.init()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class VLLMWeightSync(WeightSync):
    """Weight sync into a vLLM server through its weight-transfer API (``backend="gloo"`` or ``"nccl"``).

    The server needs ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "<backend>"}'``.
    ``is_sender`` marks the one trainer rank (usually rank 0) that drives the HTTP calls and broadcasts; the others
    only take part in the parameter all-gathers.

    The trainer hosts the rendezvous at ``master_address:master_port``, which the server must reach:
    ``master_address=None`` takes 127.0.0.1 for a loopback server and otherwise the address of this host's interface
    that routes to the server; ``master_port=None`` a free port. ``dtype`` is what the weights travel and load as:
    ``"auto"`` (default) reads the dtype the server serves at :meth:`init` (``/server_info``) and casts every
    floating-point tensor to it (fp32 master weights go to a bf16 server as bf16: half the bytes); ``None`` sends
    them as trained; a ``torch.dtype`` names it. ``api_key`` is the server's key (sent as a bearer token).

    ``bucket_bytes`` is the size of each packed broadcast chunk. ``timeout_s`` bounds the rendezvous, the transfer
    and each long HTTP call. ``include_tied`` also sends tied aliases (``lm_head.weight``); not needed with
    fastdistill's gloo engine, which re-packs tied CPU heads itself. ``one_call=True`` (gloo only) replaces
    ``/pause`` → start → update → finish → ``/resume`` by one ``/collective_rpc`` into fastdistill's worker
    extension, which the engine core runs between two steps: generation does not pause. It needs a server that runs
    one engine step at a time (vLLM-CPU) launched with ``--worker-extension-cls
    fastdistill.sync.vllm_engine.WorkerExtension`` (``VLLMServer`` and ``fastdistill serve-student`` add it).
    """

    def __init__(
        self,
        base_url: str,
        *,
        backend: str = "gloo",
        is_sender: bool = True,
        master_address: str | None = None,
        master_port: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
        include_tied: bool = False,
        dtype: torch.dtype | str | None = "auto",
        one_call: bool = False,
        api_key: str | None = None,
    ):
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"backend must be one of {list(TRANSFER_BACKENDS)}, got {backend!r}")
        if one_call and backend != "gloo":
            raise ValueError("one_call=True needs backend='gloo' (GPU engines overlap steps: use vLLM's /pause)")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not (dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype)):
            raise ValueError(f"dtype must be 'auto', None or a torch.dtype, got {dtype!r}")
        check_api_key(api_key)
        self.base_url = base_url.rstrip("/")
        self.backend = backend
        self.is_sender = is_sender
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.include_tied = include_tied
        self.requested_dtype = dtype
        # What the tensors are cast to: resolved by init() on the sender when "auto" (None until then: as trained).
        self.dtype: torch.dtype | None = dtype if isinstance(dtype, torch.dtype) else None
        self.one_call = one_call
        self._api_key = api_key
        self.world_size: int | None = None
        self._initialized = False
        self._channel: Channel | None = None

    def __repr__(self) -> str:
        return (f"VLLMWeightSync({self.base_url!r}, backend={self.backend!r}, is_sender={self.is_sender}, "
                f"api_key={'***' if self._api_key else None})")

    @property
    def group_address(self) -> str | None:
        """The trainer address the server's workers join the group at (None before :meth:`init` on the sender)."""
        return self._channel.master_address if self._channel is not None else None

    # -------------------------------------------------------------------------------------------- HTTP

    def _call(self, method: str, route: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        return request(method, self.base_url, route, payload, timeout_s=timeout_s or self.timeout_s,
                       backend=self.backend, api_key=self._api_key)

    # -------------------------------------------------------------------------------------------- init

    def init(self) -> None:
        """Rendezvous with the server's workers (sender only; other ranks just mark themselves ready)."""
        if self._initialized and (self._channel is not None or not self.is_sender):
            return
        if self.is_sender:
            answer = self._call("GET", "/get_world_size", timeout_s=CONTROL_TIMEOUT_S)
            self.world_size = int(answer["world_size"]) + 1  # the trainer is rank 0, the workers 1..Wv
            if self.requested_dtype == "auto":
                self.dtype = served_dtype(self.base_url, timeout_s=CONTROL_TIMEOUT_S, api_key=self._api_key)
            if self.one_call:
                self._check_worker_extension()
            channel = self._new_channel()
            channel.open(self.world_size, lambda info: self._call(
                "POST", "/init_weight_transfer_engine", {"init_info": info}))
            self._channel = channel
            logger.info("weight sync to %s: %s group of %d at %s, sending %s", self.base_url, self.backend,
                        self.world_size, channel.master_address, "as trained" if self.dtype is None else self.dtype)
        self._initialized = True

    def _new_channel(self) -> Channel:
        address = self.master_address
        if address is None:
            try:
                address = rendezvous_address(self.base_url)
            except OSError as error:
                raise WeightSyncError(
                    f"cannot tell which local address the server at {self.base_url} can reach ({error}): set "
                    "weight_sync_master_address (VLLMWeightSync(master_address=...)) to this trainer's address"
                ) from None
        kind = GlooChannel if self.backend == "gloo" else NcclChannel
        return kind(address, self.master_port, bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s)

    def _check_worker_extension(self) -> None:
        try:
            answer = self._call("POST", "/collective_rpc", {"method": "fastdistill_ping"}, timeout_s=CONTROL_TIMEOUT_S)
        except WeightSyncError as error:
            error.add_note(
                "one_call=True needs fastdistill's worker extension in the student server: start it with "
                "`fastdistill serve-student` or add --worker-extension-cls "
                "fastdistill.sync.vllm_engine.WorkerExtension (or set weight_sync_one_call=False)"
            )
            raise
        if answer != {"results": ["fastdistill"]}:
            raise WeightSyncError(f"{self.base_url}/collective_rpc fastdistill_ping answered {answer!r:.200}")

    # -------------------------------------------------------------------------------------------- push

    def push(self, model: WeightSource, version: int) -> dict[str, float]:
        """Send ``model``'s weights (a module or :class:`NamedTensors`); the server then serves them as
        ``weight_version=str(version)``.

        Call on every trainer rank (FSDP gathers are collective). Returns, on the sender, ``perf/weight_sync_s``
        (whole sync), ``perf/weight_sync_pause_s`` (``/pause``), ``perf/weight_sync_barrier_s`` (ranks agreeing to
        go on) and ``perf/weight_sync_transfer_s`` (``/start_weight_update`` to ``/finish_weight_update``, the
        broadcast included), in seconds; ``{}`` on the other ranks. On failure raises :class:`WeightSyncError`
        after trying to leave the server resumed; after a failed transfer, call :meth:`init` again.
        """
        if not self._initialized:
            raise WeightSyncError("push() before init(): call init() once on every rank first")
        if not self.is_sender:
            if not ranks_agree(True):  # the sender tells whether the server accepted /pause and /start
                raise WeightSyncError("the sending rank could not start the weight update (see its error)")
            for _ in iter_named_weights(model, include_tied=self.include_tied):
                pass
            return {}
        manifest = weight_manifest(model, include_tied=self.include_tied, dtype=self.dtype)
        if self.one_call:
            return self._push_in_one_call(model, manifest, version)
        start = time.perf_counter()
        paused = started = False
        try:
            if self._channel is None:
                raise WeightSyncError("no weight-transfer group (a previous sync failed): call init() again")
            # clear_cache (vLLM's default, said here): the kept requests' KV and the prefix cache are dropped, so their
            # later tokens attend to KV recomputed under the new weights (docs/sync.md, "Requests in flight")
            self._call("POST", "/pause?mode=keep&clear_cache=true", timeout_s=CONTROL_TIMEOUT_S)
            paused = True
            pause_s = time.perf_counter() - start
            transfer_start = time.perf_counter()
            self._call("POST", "/start_weight_update", {"is_checkpoint_format": True}, timeout_s=CONTROL_TIMEOUT_S)
            started = True
        except BaseException as error:
            ranks_agree(False)
            self._cleanup(error, paused=paused, started=started)
            raise
        barrier_start = time.perf_counter()
        ranks_agree(True)
        barrier_s = time.perf_counter() - barrier_start
        update_info = _update_info(manifest)

        def receive() -> Any:  # bounded by _transfer's student deadline, which does not count the gathers
            return self._call("POST", "/update_weights", {"update_info": update_info},
                              timeout_s=self.timeout_s + _GATHER_BACKSTOP_S)

        try:
            # The server's /update_weights returns once it has received everything: both sides must run at once.
            self._transfer("/update_weights", receive, model, manifest)
        except _TransferFailed as failure:
            if failure.server_blocked:
                # The server's worker is still blocked in the broadcast: it cannot take other calls until its gloo
                # timeout, so do not wait on cleanup calls it would queue behind it.
                failure.error.add_note(
                    f"the server is still receiving and stays paused until the transfer times out "
                    f"(timeout_s={self.timeout_s:.0f}); then call init() and push again, or restart it"
                )
            else:
                self._cleanup(failure.error, paused=True, started=False)
            raise failure.error from failure.cause
        try:
            self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
            transfer_s = time.perf_counter() - transfer_start
            self._call("POST", "/resume", timeout_s=CONTROL_TIMEOUT_S)
        except BaseException as error:
            self._cleanup(error, paused=True, started=False)
            raise
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "perf/weight_sync_pause_s": pause_s,
            "perf/weight_sync_barrier_s": barrier_s,
            "perf/weight_sync_transfer_s": transfer_s,
        }

    def _push_in_one_call(self, model: WeightSource, manifest: list[TensorSpec], version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self._channel is None:
            ranks_agree(False)
            raise WeightSyncError("no weight-transfer group (a previous sync failed): call init() again")
        ranks_agree(True)
        barrier_s = time.perf_counter() - start
        rpc = {"method": "fastdistill_update_weights", "kwargs": {"update_info": json.dumps(_update_info(manifest))},
               "timeout": self.timeout_s}
        try:
            http_s = self.timeout_s + _GATHER_BACKSTOP_S  # the transfer's student deadline bounds it instead
            self._transfer("/collective_rpc", lambda: self._call("POST", "/collective_rpc", rpc, timeout_s=http_s),
                           model, manifest)
        except _TransferFailed as failure:
            raise failure.error from failure.cause
        transfer_s = time.perf_counter() - start - barrier_s
        # the update leaves every KV block of the old weights in place: the requests in flight would attend to it and
        # new ones would read it from the prefix cache; drop it, running requests recompute theirs
        reset = self._call("POST", "/reset_prefix_cache?reset_running_requests=true", timeout_s=CONTROL_TIMEOUT_S)
        if not (isinstance(reset, dict) and reset.get("success")):
            raise WeightSyncError(f"{self.base_url}/reset_prefix_cache answered {reset!r:.200} after the weight "
                                  "update: the server may still serve KV of the previous weights")
        self._call("POST", "/update_weight_version", {"new_version": str(version)})
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "perf/weight_sync_pause_s": 0.0,
            "perf/weight_sync_barrier_s": barrier_s,
            "perf/weight_sync_transfer_s": transfer_s,
        }

    def _transfer(self, route: str, call: Any, model: WeightSource, manifest: list[TensorSpec]) -> None:
        """Run the server's receiving call and the broadcast at once; on failure drop the channel and raise
        :class:`_TransferFailed`.

        ``timeout_s`` bounds the student's part only: the seconds the broadcast spends in the trainer ranks' own
        all-gathers (FSDP ``full_tensor``, bounded by the collective timeout and the ranks' heartbeat) are not
        counted, and a failure while a gather runs (or raised in one) is reported as the trainer ranks', naming the
        silent rank when the heartbeat knows it, not as the student's."""
        assert self._channel is not None
        gathers = GatherClock()
        weights = iter_named_weights(model, include_tied=self.include_tied, dtype=self.dtype, gathers=gathers)
        finished = threading.Event()
        pending = {route, "broadcast"}

        def tracked(name: str, function: Any) -> Any:
            def run() -> Any:
                try:
                    return function()
                finally:
                    pending.discard(name)
                    if not pending:
                        finished.set()
            return run

        def student_deadline() -> None:
            started = time.monotonic()
            while not finished.wait(_DEADLINE_POLL_S):
                student_s = time.monotonic() - started - gathers.seconds()
                if student_s > self.timeout_s:
                    raise WeightSyncError(
                        f"weight transfer to {self.base_url} failed: the student's part ({route} and the broadcast "
                        f"to it) did not finish within weight_sync_timeout={self.timeout_s:g} s (the trainer's own "
                        f"all-gathers, {gathers.seconds():.1f} s, not counted); still running: "
                        f"{', '.join(sorted(pending))}")

        tasks = {route: tracked(route, call), "broadcast": tracked("broadcast", self._channel.broadcaster(weights,
                                                                                                       manifest)),
                 "student deadline": student_deadline}
        try:
            # the deadline task ends the wait; the outer bound is only a backstop against a gather that never
            # returns (the collective timeout and the heartbeat end those first)
            run_together(tasks, self.timeout_s + _GATHER_BACKSTOP_S)
        except TaskFailed as failure:
            self._channel.drop()  # a broken broadcast leaves the group unusable
            self._channel = None
            trainer = self._trainer_stall(gathers, failure)
            error = trainer or (failure.error if isinstance(failure.error, WeightSyncError) else None)
            error = error or WeightSyncError(f"weight transfer to {self.base_url} failed in {failure}")
            error.add_note("the server may hold partially updated weights until the next successful push")
            cause = None if error is failure.error else failure.error
            raise _TransferFailed(error, cause, server_blocked=route in failure.running()) from None
        finally:
            finished.set()

    def _trainer_stall(self, gathers: GatherClock, failure: TaskFailed) -> RuntimeError | None:
        """The error of a transfer that failed while (or because) the trainer ranks' own all-gather did not
        finish: a :class:`LostRankError` naming the silent rank(s) when the heartbeat knows them, else a
        :class:`WeightSyncError` saying it was the trainer's collective; None when no gather was involved."""
        name = gathers.current or gathers.failed
        if name is None:
            return None
        watch = peers.active_watch()
        silent = watch.silent(2 * watch.interval_s) if watch is not None else []
        if gathers.current is not None:
            if not silent and gathers.running_s() < _GATHER_STALL_S:
                return None  # the student failed while a gather ran as usual: the student's error stands
            how = f"has not returned for {gathers.running_s():.0f} s"
        else:
            how = f"failed ({str(failure.error).splitlines()[0][:300] if failure.error else failure})"
        what = f"the trainer ranks' own all-gather of {name} (FSDP full_tensor, a collective of every trainer rank)"
        student = f"the student ({self.base_url}) was waiting for the weights, not failing"
        if silent:
            ranks = ", ".join(str(rank) for rank, _ in silent)
            where = ", ".join(watch.where(rank) for rank, _ in silent)
            return LostRankError(
                f"rank {watch.rank} lost trainer rank(s) {ranks} of {watch.world_size} (at {where}) during a weight "
                f"push: {what} {how}, its heartbeat is {silent[0][1]:.0f} s old; {student}")
        return WeightSyncError(f"weight push stalled in {what}: it {how}; a trainer rank stopped answering or "
                               f"lags; {student}")

    def _cleanup(self, error: BaseException, *, paused: bool, started: bool) -> None:
        """Best effort after a failure: close an open update, then resume generation. Failures become notes."""
        routes = (["/finish_weight_update"] if started else []) + (["/resume"] if paused else [])
        for route in routes:
            try:
                self._call("POST", route, {} if route == "/finish_weight_update" else None, timeout_s=_CLEANUP_S)
            except WeightSyncError as cleanup_error:
                error.add_note(f"cleanup {route} also failed: {cleanup_error}")

    # -------------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Drop the group (the server keeps its weights; a later :meth:`init` may re-initialise it)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._initialized = False


class _TransferFailed(Exception):
    """A failed transfer: the :class:`WeightSyncError` to raise, its cause, and whether the server's receiving call
    was still blocked in the broadcast."""

    def __init__(self, error: WeightSyncError, cause: BaseException | None, *, server_blocked: bool):
        super().__init__(str(error))
        self.error = error
        self.cause = cause
        self.server_blocked = server_blocked


def _update_info(manifest: list[TensorSpec]) -> dict[str, list]:
    """The ``update_info`` vLLM's ``/update_weights`` takes: parallel lists of names, dtype names and shapes."""
    return {
        "names": [spec.name for spec in manifest],
        "dtype_names": [dtype_name(spec.dtype) for spec in manifest],
        "shapes": [list(spec.shape) for spec in manifest],
    }


def ranks_agree(ok: bool) -> bool:
    """All ranks of the default group learn whether every rank is ``ok`` (trivially ``ok`` without a group). The
    sender may have spent up to the control calls' timeout on the server first: the others wait in the store
    (:func:`~fastdistill.sync.peers.await_main`), not in the collective. Call with the sender as rank 0."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    peers.await_main()
    backend = str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
