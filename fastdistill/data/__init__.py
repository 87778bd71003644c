"""Samples to packed rows: prompt tokenisation, batchers (token budget, fixed count) and the packing collator."""
