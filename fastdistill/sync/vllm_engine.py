"""vLLM worker-side ``gloo`` weight-transfer engine (imported only inside a vLLM worker, through the plugin).

It speaks the same HTTP payloads as vLLM's NCCL engine and applies weights the same way: ``start_weight_update``
opens a layerwise reload, each received chunk goes through ``model.load_weights``, ``finish_weight_update``
finalises the reload. On top of that, on CPU it re-packs tied LM heads that were not sent explicitly: vLLM-CPU keeps
a prepacked GEMM copy of the head's weight that the layerwise reload never refreshes when ``lm_head.weight`` is
absent from the stream (the trainer usually sends only ``model.embed_tokens.weight`` for a tied model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from vllm.platforms import current_platform

from fastdistill.sync.transport import DEFAULT_BUCKET_BYTES, join_gloo_group, manifest_from_lists, receive_tensors

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under vLLM's logger tree, so the messages land in the server log with vLLM's own.
logger = init_logger("vllm.fastdistill.sync")


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``POST /init_weight_transfer_engine``: the NCCL engine's keys plus ``timeout_s``.

    The trainer is rank 0 and hosts the TCPStore at ``master_address:master_port``; this worker joins as
    ``rank_offset + dp_index * (TP*PP) + rank`` of ``world_size``. ``packed_buffer_size_bytes`` is the chunk size
    both sides plan with. ``packed=False`` sends one tensor per chunk. ``packed_num_buffers`` is accepted for
    payload compatibility and unused (gloo broadcasts are synchronous).
    """

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = 1
    timeout_s: float = 600.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``POST /update_weights``: parallel lists of HF names, dtype names and full shapes.

    ``packed`` is accepted (and ignored) for payloads built for older vLLM versions, which carried it here.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have equal lengths, got "
                f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives checkpoint-format weights over a gloo group from a trainer at rank 0 (CPU or GPU workers)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._store = None
        self._group = None
        self._packed = True
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        self._received: set[str] = set()

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group (blocks until the trainer joins too); replaces any previous group."""
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._group = self._store = None  # a new trainer may re-initialise: drop the old group first
        self._packed = init_info.packed
        self._bucket_bytes = init_info.packed_buffer_size_bytes
        self._store, self._group = join_gloo_group(
            init_info.master_address,
            init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        logger.info("fastdistill gloo weight transfer: joined as rank %d of %d", rank, init_info.world_size)

    def start_weight_update(self) -> None:
        """Open a layerwise reload: checkpoint-format weights may now be loaded with ``model.load_weights``."""
        self._received = set()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive the broadcast chunk by chunk and load each chunk as soon as it lands."""
        if self._group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call /init_weight_transfer_engine first")
        manifest = manifest_from_lists(update_info.names, update_info.dtype_names, update_info.shapes)
        # Unpacked: a bucket of one byte puts every tensor in a chunk of its own on both sides.
        bucket_bytes = self._bucket_bytes if self._packed else 1
        with disable_mtp_completeness_check():
            for chunk in receive_tensors(self._group, manifest, bucket_bytes=bucket_bytes):
                if self.device.type != "cpu":
                    chunk = [(name, tensor.to(self.device, non_blocking=True)) for name, tensor in chunk]
                self.model.load_weights(chunk)
                self._received.update(name for name, _ in chunk)

    def update_weights(self, update_info: dict) -> None:
        """Parse ``update_info`` and receive the weights; if that fails, abandon the update (see below) and
        re-raise."""
        try:
            super().update_weights(update_info)
        except BaseException:
            self._abandon_update(len(update_info.get("names", ())) if isinstance(update_info, dict) else 0)
            raise

    def _abandon_update(self, expected: int) -> None:
        # vLLM's worker ends the update session when a receive raises but does not finalise the layerwise reload, so
        # every layer not yet complete would stay on the meta device and the next engine step would kill the engine
        # (a trainer that dies or is cut off mid-broadcast). Drop what partly-received layers buffered and finalise:
        # those layers get their previous weights back, completed layers keep the new ones, and the engine serves on
        # until the next successful update.
        for layer in self.model.modules():
            info = get_layerwise_info(layer)
            if info.can_load():
                info.loaded_weights, info.load_numel = [], 0
        finalize_layerwise_reload(self.model, self.model_config)
        self._refresh_tied_cpu_heads()
        self._group = self._store = None  # a broken broadcast leaves the group unusable
        logger.warning("fastdistill gloo weight transfer: the update broke off after %d of %d tensors; layers received "
                       "in full serve the new weights, the others their previous ones, until the next update "
                       "(after a new /init_weight_transfer_engine)", len(self._received), expected)

    def finish_weight_update(self) -> None:
        """Finalise the layerwise reload, then re-pack tied CPU LM heads that were not sent."""
        finalize_layerwise_reload(self.model, self.model_config)
        self._refresh_tied_cpu_heads()

    def _refresh_tied_cpu_heads(self) -> None:
        # vLLM-CPU's embedding/LM-head post-load processing builds a prepacked GEMM handle from a copy of the weight.
        # A tied head shares its Parameter with the embedding; when only the embedding's name was received the head
        # is never re-processed and keeps serving the old logits. Re-running its processing rebuilds the handle.
        if not current_platform.is_cpu() or not self._received:
            return
        modules = dict(self.model.named_modules())
        owners: dict[int, list[str]] = {}
        for name, module in modules.items():
            weight = getattr(module, "weight", None)
            if isinstance(module, VocabParallelEmbedding) and isinstance(weight, torch.Tensor):
                owners.setdefault(id(weight), []).append(name)
        for names in owners.values():
            if len(names) < 2:
                continue  # not tied
            for name in names:
                module = modules[name]
                quant_method = getattr(module, "quant_method", None)
                if f"{name}.weight" in self._received or quant_method is None:
                    continue
                quant_method.process_weights_after_loading(module)
                logger.info("fastdistill gloo weight transfer: re-packed tied %s (%s)", name, type(module).__name__)

    def shutdown(self) -> None:
        """Drop the group and the store (the trainer's store outlives us; nothing to tear down remotely)."""
        self._group = None
        self._store = None


class WorkerExtension:
    """Methods fastdistill adds to vLLM's worker (``--worker-extension-cls
    fastdistill.sync.vllm_engine.WorkerExtension``; ``VLLMServer`` passes it for gloo students).

    ``fastdistill_update_weights`` runs a whole weight update (start, receive, finish) in one call. The trainer sends
    it through ``POST /collective_rpc``; the engine core runs it between two engine steps, so no step sees a
    half-loaded model and the server need not ``/pause`` (whose HTTP round trips and fixed 20 ms sleep stall
    generation at every sync). Only for engines that run one step at a time: vLLM-CPU, which has no asynchronous
    scheduling.
    """

    def fastdistill_ping(self) -> str:
        """Lets the trainer check that the extension is installed."""
        return "fastdistill"

    def fastdistill_update_weights(self, update_info: str) -> None:
        """``update_info``: the ``/update_weights`` payload's ``update_info`` as a JSON string (``/collective_rpc``
        passes only strings)."""
        self.start_weight_update()  # type: ignore[attr-defined]
        # A failed update ends the session itself (vLLM's worker, then the engine's abandon path): no finish then.
        self.update_weights(json.loads(update_info))  # type: ignore[attr-defined]
        self.finish_weight_update()  # type: ignore[attr-defined]
