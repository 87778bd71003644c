"""Samples to packed rows: prompt sources and tokenisation, batchers (token budget, fixed count) and the packer.

The Hugging Face dataset loading lives in :mod:`fastdistill.data.sources` (imported on use: it imports
``datasets``); the packer (torch) is loaded on first use of ``PackedRow`` / ``pack_row``. :class:`PromptTable`,
what the rollout consumes, lives in :mod:`fastdistill.rollout.prompt_table` (data flows rollout → data) and is
re-exported here.
"""

import importlib
from typing import Any

from fastdistill.rollout.prompt_table import DatasetPrompts, PromptTable, routed_table

from .batching import FixedCountBatcher, TokenBudgetBatcher, balance_by_squared_length, microbatch_metrics
from .prompts import tokenize_prompts

_LAZY = {"PackedRow": "fastdistill.data.packing", "pack_row": "fastdistill.data.packing"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastdistill.data' has no attribute {name!r}")


__all__ = [
    "DatasetPrompts",
    "FixedCountBatcher",
    "PackedRow",
    "PromptTable",
    "TokenBudgetBatcher",
    "balance_by_squared_length",
    "microbatch_metrics",
    "pack_row",
    "routed_table",
    "tokenize_prompts",
]
