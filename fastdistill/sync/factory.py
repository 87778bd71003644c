"""Build the trainer's weight sync from an :class:`~fastdistill.train.config.AsyncDistillationConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastdistill.sync.adapter import AdapterWeightSync
from fastdistill.sync.weights import VLLMWeightSync, WeightSync


def resolve_backend(backend: str, device_type: str) -> str:
    """``weight_sync_backend`` with ``"auto"`` resolved: ``"nccl"`` for a CUDA trainer, ``"gloo"`` otherwise."""
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    return backend


def adapter_keep_versions(max_staleness: int) -> int:
    """How many adapter versions stay loaded under ``lora_sync="adapter"``: every version a sample may still be
    trained from (``max_staleness + 1``), and at least two, so that a request that picked the previous version just
    before a sync still finds it."""
    return max(2, max_staleness + 1)


def weight_sync_from_config(config: Any, *, device_type: str, is_sender: bool) -> WeightSync | None:
    """The :class:`VLLMWeightSync` a run with ``config`` pushes through, or None for ``weight_sync_backend="none"``.

    With ``lora_r > 0`` and ``lora_sync="adapter"`` it is an :class:`~fastdistill.sync.adapter.AdapterWeightSync`
    instead: adapters written under ``<output_dir>/adapters``, :func:`adapter_keep_versions` of them loaded.

    ``device_type`` is the trainer's device (``"cuda"`` or ``"cpu"``); ``is_sender`` marks the rank that talks to the
    server (rank 0). Reads ``vllm_server_base_url``, ``weight_sync_backend`` (auto: NCCL on CUDA, gloo otherwise),
    ``weight_sync_one_call`` (None: with gloo), ``weight_sync_master_address`` and ``weight_sync_port`` (None: the
    local address that routes to the server and a free port), ``weight_sync_timeout`` and ``vllm_server_api_key``.
    The weights travel in the dtype the server serves.
    """
    if config.weight_sync_backend == "none":
        return None
    if config.lora_r > 0 and config.lora_sync == "adapter":
        return AdapterWeightSync(
            config.vllm_server_base_url,
            Path(config.output_dir) / "adapters",
            keep_versions=adapter_keep_versions(config.max_staleness),
            lora_rank=config.lora_r,
            is_sender=is_sender,
            timeout_s=config.weight_sync_timeout,
            api_key=config.vllm_server_api_key,
        )
    backend = resolve_backend(config.weight_sync_backend, device_type)
    one_call = config.weight_sync_one_call if config.weight_sync_one_call is not None else backend == "gloo"
    return VLLMWeightSync(
        config.vllm_server_base_url,
        backend=backend,
        is_sender=is_sender,
        master_address=config.weight_sync_master_address,
        master_port=config.weight_sync_port,
        timeout_s=config.weight_sync_timeout,
        one_call=one_call,
        api_key=config.vllm_server_api_key,
    )
