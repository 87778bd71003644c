"""Samples to packed rows: prompt tokenisation, batchers (token budget, fixed count) and the packer."""

from .batching import FixedCountBatcher, TokenBudgetBatcher, balance_by_squared_length, microbatch_metrics
from .packing import PackedRow, pack_row
from .prompts import tokenize_prompts

__all__ = [
    "FixedCountBatcher",
    "PackedRow",
    "TokenBudgetBatcher",
    "balance_by_squared_length",
    "microbatch_metrics",
    "pack_row",
    "tokenize_prompts",
]
