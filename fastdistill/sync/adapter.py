"""Adapter-only weight sync for LoRA runs (``lora_sync="adapter"``): each sync writes the LoRA adapter (a PEFT
folder, a few hundred KB to a few hundred MB instead of the whole model) and asks the student's vLLM server to load
it under a versioned name; the base model stays in the server untouched.

Generation requests name the adapter (``"model": "fastdistill-student-v<N>"``, see :func:`adapter_name`), so a
sample's ``model_version`` is the version of the adapter its request used. The server keeps the last
``keep_versions`` adapters loaded: a request that picked version N just before version N+1 arrived still finds
N. Older versions are unloaded and their folders deleted; a request that still names one is refused with HTTP 404
(``The model ... does not exist``) and the rollout worker retries it with the newest version
(:func:`fastdistill.rollout.adapters.generate_with_adapter`). A request already running when its adapter is
unloaded runs to completion with it (vLLM keeps the adapter's weights for the requests that use it).

The server needs LoRA enabled and runtime adapter loading allowed: ``--enable-lora --max-lora-rank R`` (R at least
``lora_r``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; ``fastdistill serve-student --enable-lora`` sets both.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

from fastdistill.adapter_names import ADAPTER_PREFIX, adapter_name
from fastdistill.auth import check_api_key
from fastdistill.errors import ConfigError, WeightSyncError
from fastdistill.sync.http import CONTROL_TIMEOUT_S, request
from fastdistill.sync.lora import AdapterWeights, adapter_weights, save_adapter
from fastdistill.sync.weights import WeightSync, ranks_agree

logger = logging.getLogger(__name__)

# vLLM's weight version of a server whose weights no weight sync has replaced since it loaded them (``/weight_info``);
# every full sync stamps its own version.
UNTOUCHED_WEIGHT_VERSION = "default"
_START_LORA_SERVER = (
    "start the student with LoRA enabled: `fastdistill serve-student MODEL --enable-lora --max-lora-rank R` "
    "(R >= lora_r, one of vLLM's ranks 1, 8, 16, 32, 64, ...), or add vLLM's --enable-lora --max-lora-rank R and the "
    "environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True yourself; or set lora_sync='merged'"
)


class AdapterWeightSync(WeightSync):
    """Weight sync that sends only the LoRA adapter of a peft model to a LoRA-enabled vLLM server.

    ``adapter_dir`` is where the adapter folders go (``<adapter_dir>/v<N>``; the server reads them from there, so
    it must see the same file system). ``keep_versions`` (>= 1) adapters stay loaded on the server and on disk.
    ``lora_rank`` is the trained rank, checked against the server's ``max_lora_rank`` at :meth:`init`. ``prefix``
    names the adapters (:func:`adapter_name`). ``is_sender`` marks the one rank (rank 0) that writes and talks to the
    server; every rank calls :meth:`push` (the adapter's gather is collective under FSDP2). ``api_key`` is the
    server's key (a bearer token).
    """

    def __init__(
        self,
        base_url: str,
        adapter_dir: str | Path,
        *,
        keep_versions: int = 2,
        lora_rank: int | None = None,
        prefix: str = ADAPTER_PREFIX,
        is_sender: bool = True,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        check_api_key(api_key)
        self.base_url = base_url.rstrip("/")
        self.adapter_dir = Path(adapter_dir)
        self.keep_versions = keep_versions
        self.lora_rank = lora_rank
        self.prefix = prefix
        self.is_sender = is_sender
        self.timeout_s = timeout_s
        self._api_key = api_key
        self.base_model: str | None = None  # the server's base model id, read at init
        self.loaded: list[int] = []  # versions loaded on the server, oldest first
        self._initialized = False

    def __repr__(self) -> str:
        return (f"AdapterWeightSync({self.base_url!r}, adapter_dir={str(self.adapter_dir)!r}, "
                f"keep_versions={self.keep_versions}, api_key={'***' if self._api_key else None})")

    @property
    def served_model_name(self) -> str | None:
        """The ``model`` name of the newest pushed adapter (None before the first push)."""
        return adapter_name(self.loaded[-1], self.prefix) if self.loaded else None

    def _call(self, method: str, route: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        return request(method, self.base_url, route, payload, timeout_s=timeout_s or self.timeout_s, backend=None,
                       api_key=self._api_key)

    # -------------------------------------------------------------------------------------------- init

    def init(self) -> None:
        """Check that the server can load adapters at run time (else :class:`ConfigError` saying how to start it)
        and still holds the base weights it loaded (else :class:`WeightSyncError`), note its base model, and unload
        adapters of this prefix left by an earlier run and delete the version folders left in ``adapter_dir`` (sender
        only)."""
        if self._initialized:
            return
        if self.is_sender:
            self._check_server()
            self._check_base_weights()
            models = self._call("GET", "/v1/models", timeout_s=CONTROL_TIMEOUT_S)["data"]
            self.base_model = next(str(entry["id"]) for entry in models if not entry.get("parent"))
            for entry in models:
                name = str(entry["id"])
                if entry.get("parent") and name.startswith(self.prefix + "-v"):
                    self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s=CONTROL_TIMEOUT_S)
            if self.adapter_dir.is_dir():
                for folder in self.adapter_dir.iterdir():
                    if re.fullmatch(r"\.?v\d+(\..*)?", folder.name) and folder.is_dir():
                        shutil.rmtree(folder, ignore_errors=True)
            self.loaded = []
        self._initialized = True

    def _check_server(self) -> None:
        try:
            info = self._call("GET", "/server_info?config_format=json", timeout_s=CONTROL_TIMEOUT_S)
        except WeightSyncError as error:
            raise WeightSyncError(f"{error}\nlora_sync='adapter' reads the student's LoRA settings from its dev-mode "
                                  "/server_info route: start it with VLLM_SERVER_DEV_MODE=1 (`fastdistill "
                                  "serve-student` does)") from None
        try:
            lora_config = info["vllm_config"]["lora_config"]
        except (KeyError, TypeError):
            raise WeightSyncError(
                f"GET {self.base_url}/server_info did not include vllm_config.lora_config: {info!r:.300}"
            ) from None
        if not lora_config:
            raise ConfigError(f"lora_sync='adapter' needs a student server with LoRA enabled, but the server at "
                                f"{self.base_url} runs without it: {_START_LORA_SERVER}")
        max_rank = int(lora_config.get("max_lora_rank", 0))
        if self.lora_rank is not None and self.lora_rank > max_rank:
            raise ConfigError(f"lora_r={self.lora_rank} is above the student server's --max-lora-rank {max_rank}: "
                                f"{_START_LORA_SERVER}")
        routes = self._call("GET", "/openapi.json", timeout_s=CONTROL_TIMEOUT_S).get("paths", {})
        if "/v1/load_lora_adapter" not in routes:
            raise ConfigError(f"the student server at {self.base_url} has LoRA enabled but cannot load adapters at "
                                f"run time (no /v1/load_lora_adapter route): {_START_LORA_SERVER}")

    def _check_base_weights(self) -> None:
        """The adapters apply over the weights the server holds, which must be the trainer's base model: refuse a
        server whose weights a full weight sync replaced (its ``weight_version`` is no longer vLLM's initial one)."""
        version = self._call("GET", "/weight_info", timeout_s=CONTROL_TIMEOUT_S).get("weight_version")
        if version != UNTOUCHED_WEIGHT_VERSION:
            raise WeightSyncError(
                f"the student server at {self.base_url} serves weights that a weight sync replaced (weight_version "
                f"{version!r}, not {UNTOUCHED_WEIGHT_VERSION!r}); lora_sync='adapter' sends only the adapters, which "
                f"the server applies over the weights it holds, and those must be the trainer's base model. Restart "
                f"the server from the base model, or push the base weights back and then declare them with "
                f"POST {self.base_url}/update_weight_version {{\"new_version\": \"{UNTOUCHED_WEIGHT_VERSION}\"}}")

    # -------------------------------------------------------------------------------------------- push

    def push(self, model: Any, version: int) -> dict[str, float]:
        """Make the server serve ``model``'s adapter as ``adapter_name(version)``; unload versions beyond
        ``keep_versions``.

        ``model`` is a peft model (gathered here, collectively: call on every rank) or an
        :class:`~fastdistill.sync.lora.AdapterWeights` copy. Returns, on the sender, ``perf/weight_sync_s`` (whole
        sync), ``perf/weight_sync_gather_s`` (copying the adapter out of the model), ``perf/weight_sync_write_s``
        (the folder written and renamed), ``perf/weight_sync_load_s`` (``/v1/load_lora_adapter``), in seconds, and
        ``perf/weight_sync_bytes`` (the adapter's tensor bytes); ``{}`` on the other ranks."""
        if not self._initialized:
            raise WeightSyncError("push() before init(): call init() once on every rank first")
        start = time.perf_counter()
        weights = model if isinstance(model, AdapterWeights) else adapter_weights(model)
        gather_s = time.perf_counter() - start
        if not self.is_sender:
            if not ranks_agree(True):
                raise WeightSyncError("the sending rank could not load the adapter (see its error)")
            return {}
        name = adapter_name(version, self.prefix)
        try:
            write_start = time.perf_counter()
            path = save_adapter(weights, self.adapter_dir / f"v{int(version)}")
            write_s = time.perf_counter() - write_start
            load_start = time.perf_counter()
            payload = {"lora_name": name, "lora_path": str(path.resolve())}
            if int(version) in self.loaded:
                payload["load_inplace"] = True
            self._call("POST", "/v1/load_lora_adapter", payload)
            load_s = time.perf_counter() - load_start
        except BaseException:
            ranks_agree(False)
            raise
        ranks_agree(True)
        self.loaded = [v for v in self.loaded if v != int(version)] + [int(version)]
        self._unload_old()
        logger.debug("the student serves adapter %s (%d bytes of tensors)", name, weights.num_bytes)
        return {
            "perf/weight_sync_s": time.perf_counter() - start,
            "perf/weight_sync_gather_s": gather_s,
            "perf/weight_sync_write_s": write_s,
            "perf/weight_sync_load_s": load_s,
            "perf/weight_sync_bytes": float(weights.num_bytes),
        }

    def _unload_old(self) -> None:
        while len(self.loaded) > self.keep_versions:
            old = self.loaded[0]
            self._call("POST", "/v1/unload_lora_adapter", {"lora_name": adapter_name(old, self.prefix)},
                       timeout_s=CONTROL_TIMEOUT_S)
            self.loaded.pop(0)
            shutil.rmtree(self.adapter_dir / f"v{old}", ignore_errors=True)

    # -------------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Forget the connection; the server keeps serving the loaded adapters (and their folders stay)."""
        self._initialized = False

