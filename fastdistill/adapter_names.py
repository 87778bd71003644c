"""The names a LoRA-enabled student server serves the trainer's adapters under (``lora_sync="adapter"``).

The weight sync loads adapter version ``v`` under :func:`adapter_name`; the rollout side names that model in its
generation requests. Both import the naming from here, below either layer.
"""

from __future__ import annotations

ADAPTER_PREFIX = "fastdistill-student"


def adapter_name(version: int, prefix: str = ADAPTER_PREFIX) -> str:
    """The name the student server serves adapter ``version`` under: ``"<prefix>-v<version>"``."""
    return f"{prefix}-v{int(version)}"
