"""The one error type of weight sync."""

from __future__ import annotations

from fastdistill.errors import WeightSyncError

__all__ = ["WeightSyncError"]
