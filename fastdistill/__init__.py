"""fastdistill: asynchronous on-policy distillation around a fused sparse generalized-JSD loss."""

from .loss import (
    SparseJSDOutput,
    narrow_support,
    scored_positions,
    sparse_jsd_loss,
    window_loss_scale,
    window_token_count,
)

__version__ = "0.1.0"

__all__ = [
    "SparseJSDOutput",
    "narrow_support",
    "scored_positions",
    "sparse_jsd_loss",
    "window_loss_scale",
    "window_token_count",
]
