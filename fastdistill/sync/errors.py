"""The one error type of weight sync."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says which step, what the server answered and, where known, the fix."""
