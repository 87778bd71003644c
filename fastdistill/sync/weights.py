"""Trainer side of weight sync: push a model's weights into the student's vLLM server, and check they arrived.

The HTTP sequence is vLLM's own weight-transfer API (dev mode), identical for both backends:
``/pause?mode=keep`` -> ``/start_weight_update`` -> ``/update_weights`` (while the trainer broadcasts) ->
``/finish_weight_update`` -> ``/resume``. ``backend="gloo"`` broadcasts over a hand-built gloo group into
fastdistill's plugin engine (CPU servers; see :mod:`fastdistill.sync.vllm_engine`); ``backend="nccl"`` uses vLLM's
NCCL engine and its trainer-side helpers (GPU servers). Nothing here imports vLLM unless ``backend="nccl"``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastdistill.sync.transport import (
    DEFAULT_BUCKET_BYTES,
    TensorSpec,
    create_gloo_group,
    create_store,
    dtype_name,
    send_tensors,
)

# Wrapper segments that activation checkpointing, torch.compile, FSDP1 and DDP add to parameter names; vLLM's
# load_weights expects the plain Hugging Face names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_CONTROL_TIMEOUT_S = 300.0  # /pause, /start_weight_update, /resume (TRL's value)
_CLEANUP_S = 30.0  # best-effort calls after a failure
_NCCL_NUM_BUFFERS = 2  # vLLM's packed NCCL default; both sides must agree


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says which step, what the server answered and, where known, the fix."""


# ------------------------------------------------------------------------------------------------ model weights


def hf_name(name: str) -> str:
    """Strip wrapper segments (checkpoint wrapper, ``torch.compile``, FSDP1, a leading DDP ``module.``)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name.removeprefix("module.")


def _named_parameters(model: torch.nn.Module, include_tied: bool) -> list[tuple[str, torch.nn.Parameter]]:
    return [(hf_name(name), p) for name, p in model.named_parameters(remove_duplicate=not include_tied)]


def weight_manifest(
    model: torch.nn.Module, *, include_tied: bool = False, dtype: torch.dtype | None = None
) -> list[TensorSpec]:
    """What :func:`iter_named_weights` will yield (names, dtypes, full shapes), without gathering anything."""
    return [TensorSpec(name, dtype or p.dtype, tuple(p.shape)) for name, p in _named_parameters(model, include_tied)]


def iter_named_weights(
    model: torch.nn.Module, *, include_tied: bool = False, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every parameter, one at a time, detached.

    Names are the Hugging Face names vLLM's ``load_weights`` expects. FSDP2 ``DTensor`` parameters are all-gathered
    with ``full_tensor()``: a collective, so every rank of the mesh must run this iteration in lockstep. A tied
    parameter is yielded once under its first name (``model.embed_tokens.weight``), like ``named_parameters()``;
    ``include_tied=True`` also yields its aliases (``lm_head.weight``), as ``state_dict()`` would. ``dtype`` casts
    each tensor (e.g. fp32 master weights to a bf16 server).
    """
    for name, param in _named_parameters(model, include_tied):
        with torch.no_grad():
            full_tensor = getattr(param, "full_tensor", None)
            tensor = full_tensor() if callable(full_tensor) else param
            tensor = tensor.detach()
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
        yield name, tensor


class NamedTensors:
    """A fixed list of ``(hf_name, tensor)`` that :meth:`VLLMWeightSync.push` accepts in place of a model: a
    snapshot taken on the training thread and sent from another, or weights that come as an iterator (TRL's
    ``send_weights``)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]):
        self.tensors = tensors

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


# ------------------------------------------------------------------------------------------------ HTTP


class _HTTPError(Exception):
    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _server_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:2000]
    if isinstance(payload, dict):
        for key in ("error", "detail", "message"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:2000]
    return text[:2000]


def _http_json(method: str, url: str, payload: Any = None, *, timeout_s: float) -> Any:
    """One JSON request; the decoded answer, or :class:`_HTTPError` (status ``None`` when there was no answer)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        raise _HTTPError(error.code, _server_message(error.read())) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise _HTTPError(None, f"no answer ({type(reason).__name__}: {reason})") from None
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


def _hint(route: str, error: _HTTPError, backend: str) -> str | None:
    flag = f'--weight-transfer-config \'{{"backend": "{backend}"}}\''
    if error.status == 404:
        return (
            f"the server has no {route} route: vLLM serves its weight-transfer routes only in dev mode, "
            "so start it with the environment variable VLLM_SERVER_DEV_MODE=1"
        )
    if "Weight transfer not configured" in error.message or "weight_transfer_config" in error.message:
        return f"the server was started without a weight-transfer engine: start it with {flag}"
    if "Invalid init_info" in error.message or "Invalid update_info" in error.message:
        return f"the server's weight-transfer engine does not take backend={backend!r} payloads: start it with {flag}"
    return None


def _request(
    method: str, base_url: str, route: str, payload: Any = None, *, timeout_s: float, backend: str = "gloo"
) -> Any:
    """:func:`_http_json` whose failures are :class:`WeightSyncError` with the server's message and a hint."""
    try:
        return _http_json(method, base_url + route, payload, timeout_s=timeout_s)
    except _HTTPError as error:
        status = f" (HTTP {error.status})" if error.status is not None else ""
        message = f"{method} {base_url}{route} failed{status}: {error.message}"
        hint = _hint(route.split("?")[0], error, backend)
        raise WeightSyncError(f"{message}\n{hint}" if hint else message) from None


# ------------------------------------------------------------------------------------------------ threads


class _Task:
    """A callable run on a daemon thread (a hung rendezvous must not block interpreter exit); sets ``changed``
    when it ends."""

    def __init__(self, name: str, function: Callable[[], Any], changed: threading.Event):
        self.name = name
        self._function = function
        self._changed = changed
        self._done = threading.Event()
        self._result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"fastdistill-sync-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._function()
        except BaseException as error:  # re-raised in the caller's thread
            self.error = error
        finally:
            self._done.set()
            self._changed.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Any:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self._result


def _run_together(functions: dict[str, Callable[[], Any]], timeout_s: float) -> dict[str, Any]:
    """Run ``functions`` on threads at once; return their results by name once all succeed.

    The first failure is raised as soon as it happens, without waiting for the others (a peer blocked in a
    collective that will never complete would otherwise hang the caller), as :class:`_TaskFailed`, which also
    tells which tasks are still running; the same after ``timeout_s``.
    """
    changed = threading.Event()
    tasks = [_Task(name, function, changed) for name, function in functions.items()]
    deadline = time.monotonic() + timeout_s
    while True:
        changed.clear()
        for task in tasks:
            if task.done and task.error is not None:
                raise _TaskFailed(task, tasks) from task.error
        if all(task.done for task in tasks):
            return {task.name: task.result() for task in tasks}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pending = ", ".join(task.name for task in tasks if not task.done)
            raise _TaskFailed(None, tasks, f"still running after {timeout_s:.0f} s: {pending}")
        changed.wait(remaining)


class _TaskFailed(Exception):
    def __init__(self, task: _Task | None, tasks: list[_Task], message: str | None = None):
        self.task = task
        self.tasks = tasks
        self.error = task.error if task is not None else None
        super().__init__(message or f"{task.name}: {type(self.error).__name__}: {self.error}")

    def running(self) -> list[str]:
        return [task.name for task in self.tasks if not task.done]


# ------------------------------------------------------------------------------------------------ weight sync


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
    only take part in the parameter all-gathers. The trainer hosts the rendezvous at ``master_address:master_port``
    (a free port when ``None``); the server must reach that address. ``bucket_bytes`` is the size of each packed
    broadcast chunk. ``timeout_s`` bounds the rendezvous, the transfer and each long HTTP call. ``include_tied``
    also sends tied aliases (``lm_head.weight``); not needed with fastdistill's gloo engine, which re-packs tied CPU
    heads itself. ``dtype`` casts the weights before sending (default: as trained). ``one_call=True`` (gloo only)
    replaces ``/pause`` → start → update → finish → ``/resume`` by one ``/collective_rpc`` into fastdistill's worker
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
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
        include_tied: bool = False,
        dtype: torch.dtype | None = None,
        one_call: bool = False,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if one_call and backend != "gloo":
            raise ValueError("one_call=True needs backend='gloo' (GPU engines overlap steps: use vLLM's /pause)")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.backend = backend
        self.is_sender = is_sender
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.include_tied = include_tied
        self.dtype = dtype
        self.one_call = one_call
        self.world_size: int | None = None
        self._initialized = False
        self._store: Any = None
        self._group: Any = None  # gloo ProcessGroup, or vLLM's PyNcclCommunicator

    # -------------------------------------------------------------------------------------------- HTTP

    def _call(self, method: str, route: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        return _request(
            method, self.base_url, route, payload, timeout_s=timeout_s or self.timeout_s, backend=self.backend
        )

    # -------------------------------------------------------------------------------------------- init

    def init(self) -> None:
        """Rendezvous with the server's workers (sender only; other ranks just mark themselves ready)."""
        if self._initialized and (self._group is not None or not self.is_sender):
            return
        if self.is_sender:
            answer = self._call("GET", "/get_world_size", timeout_s=_CONTROL_TIMEOUT_S)
            self.world_size = int(answer["world_size"]) + 1  # the trainer is rank 0, the workers 1..Wv
            if self.one_call:
                self._check_worker_extension()
            if self.backend == "gloo":
                self._init_gloo()
            else:
                self._init_nccl()
        self._initialized = True

    def _check_worker_extension(self) -> None:
        try:
            answer = self._call("POST", "/collective_rpc", {"method": "fastdistill_ping"}, timeout_s=_CONTROL_TIMEOUT_S)
        except WeightSyncError as error:
            error.add_note(
                "one_call=True needs fastdistill's worker extension in the student server: start it with "
                "`fastdistill serve-student` or add --worker-extension-cls "
                "fastdistill.sync.vllm_engine.WorkerExtension (or set weight_sync_one_call=False)"
            )
            raise
        if answer != {"results": ["fastdistill"]}:
            raise WeightSyncError(f"{self.base_url}/collective_rpc fastdistill_ping answered {answer!r:.200}")

    def _init_info(self, port: int) -> dict[str, Any]:
        info: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_bytes,
        }
        if self.backend == "gloo":
            info.update(packed_num_buffers=1, timeout_s=self.timeout_s)
        return info

    def _init_gloo(self) -> None:
        assert self.world_size is not None
        world_size = self.world_size
        store = create_store(
            self.master_address, self.master_port or 0, rank=0, world_size=world_size, timeout_s=self.timeout_s
        )
        # The server's init call blocks until its workers have joined the group, and joining blocks until they call
        # in: run both at once. An HTTP failure surfaces immediately; the abandoned join times out on its thread.
        results = self._together(
            {
                "gloo rendezvous": lambda: create_gloo_group(
                    store, self.master_address, rank=0, world_size=world_size, timeout_s=self.timeout_s
                ),
                "/init_weight_transfer_engine": lambda: self._call(
                    "POST", "/init_weight_transfer_engine", {"init_info": self._init_info(store.port)}
                ),
            }
        )
        self._store, self._group = store, results["gloo rendezvous"]

    def _init_nccl(self) -> None:
        nccl_common = _import_vllm_nccl()
        from vllm.utils.network_utils import get_open_port

        info = self._init_info(self.master_port or get_open_port())
        info["packed_num_buffers"] = _NCCL_NUM_BUFFERS
        device = torch.cuda.current_device()

        def rendezvous() -> Any:
            torch.cuda.set_device(device)  # the CUDA device is per thread
            return nccl_common.trainer_init(info)

        results = self._together(
            {
                "nccl rendezvous": rendezvous,
                "/init_weight_transfer_engine": lambda: self._call(
                    "POST", "/init_weight_transfer_engine", {"init_info": info}
                ),
            }
        )
        self._group = results["nccl rendezvous"]

    def _together(self, functions: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        try:
            return _run_together(functions, self.timeout_s)
        except _TaskFailed as failure:
            if isinstance(failure.error, WeightSyncError):
                raise failure.error from None
            raise WeightSyncError(f"weight sync failed in {failure}") from failure.error

    # -------------------------------------------------------------------------------------------- push

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Send ``model``'s weights; the server then serves them as ``weight_version=str(version)``.

        Call on every trainer rank (FSDP gathers are collective). Returns, on the sender, ``perf/weight_sync_s``
        (whole sync), ``perf/weight_sync_pause_s`` (``/pause``), ``perf/weight_sync_barrier_s`` (ranks agreeing to
        go on) and ``perf/weight_sync_transfer_s`` (``/start_weight_update`` to ``/finish_weight_update``, the
        broadcast included), in seconds; ``{}`` on the other ranks. On failure raises :class:`WeightSyncError`
        after trying to leave the server resumed; after a failed transfer, call :meth:`init` again.
        """
        if not self._initialized:
            raise WeightSyncError("push() before init(): call init() once on every rank first")
        manifest = weight_manifest(model, include_tied=self.include_tied, dtype=self.dtype)
        if self.one_call and self.is_sender:
            return self._push_in_one_call(model, manifest, version)
        if not self.is_sender:
            if not _ranks_agree(True):  # the sender tells whether the server accepted /pause and /start
                raise WeightSyncError("the sending rank could not start the weight update (see its error)")
            for _ in iter_named_weights(model, include_tied=self.include_tied, dtype=self.dtype):
                pass
            return {}
        start = time.perf_counter()
        paused = started = False
        try:
            if self._group is None:
                raise WeightSyncError("no weight-transfer group (a previous sync failed): call init() again")
            self._call("POST", "/pause?mode=keep", timeout_s=_CONTROL_TIMEOUT_S)
            paused = True
            pause_s = time.perf_counter() - start
            transfer_start = time.perf_counter()
            self._call("POST", "/start_weight_update", {"is_checkpoint_format": True}, timeout_s=_CONTROL_TIMEOUT_S)
            started = True
        except BaseException as error:
            _ranks_agree(False)
            self._cleanup(error, paused=paused, started=started)
            raise
        barrier_start = time.perf_counter()
        _ranks_agree(True)
        barrier_s = time.perf_counter() - barrier_start

        update_info = _update_info(manifest)
        weights = iter_named_weights(model, include_tied=self.include_tied, dtype=self.dtype)
        try:
            # The server's /update_weights returns once it has received everything: both sides must run at once.
            _run_together(
                {
                    "/update_weights": lambda: self._call("POST", "/update_weights", {"update_info": update_info}),
                    "broadcast": self._broadcaster(weights, manifest),
                },
                self.timeout_s,
            )
        except _TaskFailed as failure:
            self._group = self._store = None  # a broken broadcast leaves the group unusable
            error = failure.error if isinstance(failure.error, WeightSyncError) else None
            error = error or WeightSyncError(f"weight transfer failed in {failure}")
            if "/update_weights" in failure.running():
                # The server's worker is still blocked in the broadcast: it cannot take other calls until its gloo
                # timeout, so do not wait on cleanup calls it would queue behind it.
                error.add_note(
                    f"the server is still receiving and stays paused until the transfer times out "
                    f"(timeout_s={self.timeout_s:.0f}); then call init() and push again, or restart it"
                )
            else:
                self._cleanup(error, paused=True, started=False)
            error.add_note("the server may hold partially updated weights until the next successful push")
            raise error from (None if error is failure.error else failure.error)
        try:
            self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
            transfer_s = time.perf_counter() - transfer_start
            self._call("POST", "/resume", timeout_s=_CONTROL_TIMEOUT_S)
        except BaseException as error:
            self._cleanup(error, paused=True, started=False)
            raise
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "perf/weight_sync_pause_s": pause_s,
            "perf/weight_sync_barrier_s": barrier_s,
            "perf/weight_sync_transfer_s": transfer_s,
        }

    def _push_in_one_call(self, model: torch.nn.Module, manifest: list[TensorSpec], version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self._group is None:
            _ranks_agree(False)
            raise WeightSyncError("no weight-transfer group (a previous sync failed): call init() again")
        _ranks_agree(True)
        barrier_s = time.perf_counter() - start
        weights = iter_named_weights(model, include_tied=self.include_tied, dtype=self.dtype)
        rpc = {"method": "fastdistill_update_weights", "kwargs": {"update_info": json.dumps(_update_info(manifest))},
               "timeout": self.timeout_s}
        try:
            _run_together(
                {"/collective_rpc": lambda: self._call("POST", "/collective_rpc", rpc),
                 "broadcast": self._broadcaster(weights, manifest)},
                self.timeout_s,
            )
        except _TaskFailed as failure:
            self._group = self._store = None  # a broken broadcast leaves the group unusable
            error = failure.error if isinstance(failure.error, WeightSyncError) else None
            error = error or WeightSyncError(f"weight transfer failed in {failure}")
            error.add_note("the server may hold partially updated weights until the next successful push")
            raise error from (None if error is failure.error else failure.error)
        transfer_s = time.perf_counter() - start - barrier_s
        self._call("POST", "/update_weight_version", {"new_version": str(version)})
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "perf/weight_sync_pause_s": 0.0,
            "perf/weight_sync_barrier_s": barrier_s,
            "perf/weight_sync_transfer_s": transfer_s,
        }

    def _broadcaster(
        self, weights: Iterator[tuple[str, torch.Tensor]], manifest: list[TensorSpec]
    ) -> Callable[[], None]:
        """The broadcast, as a callable for a worker thread (it also drives the FSDP gathers of ``weights``)."""
        if self.backend == "gloo":
            group = self._group

            def send() -> None:
                send_tensors(group, weights, manifest, bucket_bytes=self.bucket_bytes)

            return send
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        device = torch.device("cuda", torch.cuda.current_device())

        def broadcast() -> None:
            torch.cuda.set_device(device)  # the CUDA device is per thread
            packed_nccl_broadcast_producer(
                iterator=((name, tensor.to(device, non_blocking=True)) for name, tensor in weights),
                group=self._group,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.bucket_bytes,
                num_buffers=_NCCL_NUM_BUFFERS,
            )
            torch.cuda.current_stream().synchronize()

        return broadcast

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
        group, self._group, self._store = self._group, None, None
        if group is not None and self.backend == "nccl":
            destroy = getattr(group, "destroy", None)
            if callable(destroy):
                destroy()
        self._initialized = False


def _update_info(manifest: list[TensorSpec]) -> dict[str, list]:
    """The ``update_info`` vLLM's ``/update_weights`` takes: parallel lists of names, dtype names and shapes."""
    return {
        "names": [spec.name for spec in manifest],
        "dtype_names": [dtype_name(spec.dtype) for spec in manifest],
        "shapes": [list(spec.shape) for spec in manifest],
    }


def _ranks_agree(ok: bool) -> bool:
    """All ranks of the default group learn whether every rank is ``ok`` (trivially ``ok`` without a group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    backend = str(dist.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _import_vllm_nccl() -> Any:
    try:
        from vllm.distributed.weight_transfer import nccl_common  # noqa: PLC0415
    except ImportError as error:
        raise WeightSyncError(
            f"backend='nccl' needs vLLM importable in the trainer's environment ({error}); install vllm, "
            "or use backend='gloo' with a server that loads fastdistill's gloo engine"
        ) from error
    return nccl_common


# ------------------------------------------------------------------------------------------------ verification


def served_logprob_gap(
    base_url: str,
    model: torch.nn.Module,
    prompt_ids_list: Sequence[Sequence[int]],
    served_model_name: str | None = None,
    *,
    timeout_s: float = 120.0,
) -> float:
    """Max |served - trainer| log-prob of the realised prompt tokens, over all prompts (nats).

    The server's side comes from ``POST /v1/completions`` with ``max_tokens=1, prompt_logprobs=0``; the trainer's
    from ``log_softmax`` of ``model``'s fp32 logits on the same ids (positions 1..L-1 of each prompt). Run it on
    every rank if the model is FSDP-sharded (the forward is collective). After a sync the gap should be at the
    level of fp32 kernel noise (~1e-6 on CPU).
    """
    base_url = base_url.rstrip("/")
    if served_model_name is None:
        models = _request("GET", base_url, "/v1/models", timeout_s=timeout_s)
        served_model_name = models["data"][0]["id"]
    device = next(model.parameters()).device
    gap = 0.0
    for prompt in prompt_ids_list:
        ids = [int(token) for token in prompt]
        if len(ids) < 2:
            raise ValueError("each prompt needs at least two tokens (the first has no log-prob)")
        body = {"model": served_model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        answer = _request("POST", base_url, "/v1/completions", body, timeout_s=timeout_s)
        served_positions = answer["choices"][0]["prompt_logprobs"]
        served = torch.tensor(
            [float(served_positions[i][str(token)]["logprob"]) for i, token in enumerate(ids) if i > 0],
            dtype=torch.float64,
        )
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
        gap = max(gap, (served - expected[:, 0].double().cpu()).abs().max().item())
    return gap
