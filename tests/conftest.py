"""Session-wide test settings.

Triton fixes its interpreter mode when it is first imported, and several test modules import it indirectly (TRL,
transformers' kernel hub integration) before ``test_kernels.py`` runs. On a machine without CUDA the kernels can only
run in the interpreter, so it is switched on here, before any test module is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
