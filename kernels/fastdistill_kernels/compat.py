"""Differences between the Triton releases the kernels run under, worked around in one place (feature-detected).

Triton's CPU interpreter (``TRITON_INTERPRET=1``) passes every integer kernel argument as a one-element numpy array,
and a Python ``range(...)`` over such a value (``for d0 in range(0, D, BLOCK_D)``, the binary search's
``range(search_steps)``) converts it with ``tensor.__index__``. Triton 3.6 defines that as ``int(data)``, which numpy
2.4 and later refuse for an array of one dimension (``TypeError: only 0-dimensional arrays can be converted to
Python scalars``); later Triton releases squeeze the array first. Compiled kernels never take this path, so the fix
touches the interpreter only and the kernels compile to the same code on every release.
"""

from __future__ import annotations

import operator

import numpy as np


def _interpreter_index_broken(interpreter, tl) -> bool:
    """Whether the interpreter's ``tensor.__index__`` fails on a scalar kernel argument (a one-element array)."""
    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(tl.tensor, scope)
    try:
        scalar = tl.tensor(interpreter.TensorHandle(np.array([3], dtype=np.int32), tl.int32), tl.int32)
        return operator.index(scalar) != 3
    except TypeError:
        return True
    finally:
        scope.restore()


def patch_interpreter_scalar_index() -> bool:
    """Make the interpreter's ``tensor.__index__`` squeeze its one-element array first (what Triton 3.7 and later
    do), only where the installed Triton needs it. Returns True when it patched, False when nothing was needed or
    this Triton's interpreter has a different shape (then it is left alone)."""
    try:  # triton is optional (and absent from CPU-only installs)
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter, "_fastdistill_index_patched", False):
        return True
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope") or not hasattr(interpreter, "TensorHandle"):
        return False
    if not _interpreter_index_broken(interpreter, tl):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._fastdistill_index_patched = True
    return True
