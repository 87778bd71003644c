"""fastdistill: asynchronous on-policy distillation around a fused sparse generalized-JSD loss.

The loss API is imported lazily, so that processes that only need the rollout side (the rollout worker's child,
spawned fresh) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "DenseJSDOutput",
    "SparseJSDOutput",
    "dense_teacher_jsd_loss",
    "fold_out_of_vocab",
    "narrow_support",
    "scored_positions",
    "sparse_jsd_loss",
    "window_loss_scale",
    "window_token_count",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("fastdistill.loss"), name)
    raise AttributeError(f"module 'fastdistill' has no attribute {name!r}")
