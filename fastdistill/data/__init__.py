"""Samples to packed rows: prompt sources and tokenisation, batchers (token budget, fixed count) and the packer.

The Hugging Face dataset loading lives in :mod:`fastdistill.data.sources` (imported on use: it imports ``datasets``
only when a dataset is loaded).
"""

from ..rollout.table import PromptTable
from .batching import FixedCountBatcher, TokenBudgetBatcher, balance_by_squared_length, microbatch_metrics
from .packing import PackedRow, pack_row
from .prompts import tokenize_prompts

__all__ = [
    "FixedCountBatcher",
    "PackedRow",
    "PromptTable",
    "TokenBudgetBatcher",
    "balance_by_squared_length",
    "microbatch_metrics",
    "pack_row",
    "tokenize_prompts",
]
