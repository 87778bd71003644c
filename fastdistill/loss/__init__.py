"""The sparse generalized-JSD loss: public API, torch paths and normalisation helpers."""

from .api import SparseJSDOutput, sparse_jsd_loss
from .normalization import scored_positions, window_loss_scale, window_token_count
from .support import narrow_support

__all__ = [
    "SparseJSDOutput",
    "narrow_support",
    "scored_positions",
    "sparse_jsd_loss",
    "window_loss_scale",
    "window_token_count",
]
