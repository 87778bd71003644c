"""Weight sync from the trainer into the student's vLLM server through vLLM's weight-transfer API.

``VLLMWeightSync`` drives the HTTP sequence and the broadcast (``gloo`` into fastdistill's plugin engine on CPU
servers, ``nccl`` into vLLM's engine on GPU servers); ``served_logprob_gap`` checks that a sync took.
"""

from fastdistill.sync.weights import (
    NamedTensors,
    VLLMWeightSync,
    WeightSync,
    WeightSyncError,
    hf_name,
    iter_named_weights,
    served_logprob_gap,
    weight_manifest,
)

__all__ = [
    "NamedTensors",
    "VLLMWeightSync",
    "WeightSync",
    "WeightSyncError",
    "hf_name",
    "iter_named_weights",
    "served_logprob_gap",
    "weight_manifest",
]
