"""Samples to packed rows: prompt sources and tokenisation, the prompt table, batchers (token budget, fixed count)
and the packer.

The Hugging Face dataset loading lives in :mod:`fastdistill.data.sources` (imported on use: it imports
``datasets``). Importing this package imports no torch: the rollout worker's child unpickles a
:class:`PromptTable` from it, so the packer (torch) is loaded on first use of ``PackedRow`` / ``pack_row``.
"""

import importlib
from typing import Any

from .batching import FixedCountBatcher, TokenBudgetBatcher, balance_by_squared_length, microbatch_metrics
from .prompt_table import DatasetPrompts, PromptTable, routed_table
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
