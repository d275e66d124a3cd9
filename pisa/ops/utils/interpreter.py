"""Triton's CPU interpreter (``TRITON_INTERPRET=1``): what the library needs to run under it.

The variable must be set before the first ``@triton.jit`` module is imported (Triton reads it at
decoration time); the kernels' modules are imported lazily, at the first ``backend="triton"``
call, so setting it before that call is enough. ``pisa.ops.utils.op``, which every kernel module
imports first, applies ``patch_interpreter`` when the variable is set.
"""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter_for_numpy2() -> bool:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and calls ``int()`` on them for
    loop bounds, which NumPy >= 2.4 refuses; read the element instead. Idempotent; a no-op where
    ``int()`` of a 1-element array still works or Triton / NumPy are missing. Returns whether the
    patch is in place."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "_pisa_numpy2", False):
        return True
    try:
        int(np.ones(1))
        return False
    except TypeError:
        pass

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pisa_numpy2 = True
    interpreter._patch_lang_tensor = patched
    return True


def patch_interpreter() -> None:
    """Apply what the interpreter needs when ``TRITON_INTERPRET=1`` (nothing otherwise)."""
    if interpreting():
        patch_interpreter_for_numpy2()
