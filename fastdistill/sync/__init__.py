"""Weight sync from the trainer into the student's vLLM server through vLLM's weight-transfer API.

``VLLMWeightSync`` drives the HTTP sequence and the broadcast (``gloo`` into fastdistill's plugin engine on CPU
servers, ``nccl`` into vLLM's engine on GPU servers); ``weight_sync_from_config`` builds it from a training config;
``served_logprob_gap`` checks that a sync took (``served_sampled_logprob_gap`` for a LoRA adapter).

Modules: ``naming`` (what is sent: names, manifests, ``NamedTensors``), ``http`` (the calls to the server),
``channels`` (the gloo / NCCL broadcast groups), ``transport`` (gloo chunking, both ends), ``network``
(rendezvous addresses), ``weights`` (the sync itself), ``verify``, ``factory``; ``vllm_engine`` and
``vllm_plugin`` run inside vLLM; ``adapter`` is the LoRA adapter-only sync
(``AdapterWeightSync``, ``lora_sync="adapter"``).
"""

from fastdistill.errors import WeightSyncError
from fastdistill.sync.factory import weight_sync_from_config
from fastdistill.sync.naming import NamedTensors, hf_name, iter_named_weights, snapshot_weights, weight_manifest
from fastdistill.sync.verify import served_logprob_gap, served_sampled_logprob_gap
from fastdistill.sync.weights import VLLMWeightSync, WeightSync

__all__ = [
    "NamedTensors",
    "VLLMWeightSync",
    "WeightSync",
    "WeightSyncError",
    "hf_name",
    "iter_named_weights",
    "served_logprob_gap",
    "served_sampled_logprob_gap",
    "snapshot_weights",
    "weight_manifest",
    "weight_sync_from_config",
]
