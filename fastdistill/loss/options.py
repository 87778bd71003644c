"""The loss's enumerations, spelled once: the loss API, the dense loss and the trainer's config read them here."""

from __future__ import annotations

# which implementation computes the loss (docs/loss.md, "Implementations")
BACKENDS = ("auto", "torch", "reference", "triton", "triton-chunked")
# the student's tail bucket: "exact" (a log-sum-exp over the non-candidates) or "trl" (TRL's subtraction, for parity)
TAIL_MODES = ("exact", "trl")
