"""Fixtures of the op tests: a faster Triton interpreter and poisoned output buffers.

Triton test modules take both with ``pytestmark = pytest.mark.usefixtures(...)``; on a GPU the
interpreter fixture does nothing but pin torch to one thread.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py without CUDA
# The integer sentinel of poisoned selection buffers (never a valid block index or count).
POISON = 12345


@pytest.fixture(scope="module")
def fast_interpreter():
    """Make triton 3.6's interpreter usable for these kernels, for one module (restored after;
    a no-op on GPU or when the interpreter's internals differ).

    - Every call of a nested ``@triton.jit`` helper re-patches the whole language module (~3 ms a
      call, most of the run time here): patch ``triton.language`` and ``triton.language.core``
      once per launch instead.
    - Integer-overflow sanitising doubles the cost of every integer op; the shapes here are tiny.
    - ``tl.sort`` / ``tl.topk`` interpret their bitonic networks element by element in Python
      (~2 s a call): numpy sorts stand in (same results; the GPU sections run Triton's own).
    (``tests/conftest.py`` runs torch on one thread for every test.)
    """
    yield from _interpreter_patched()


def _interpreter_patched():
    if not INTERPRET:
        yield
        return
    try:
        import dataclasses

        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp

        saved = (interp._patch_lang, interp.InterpretedFunction.__call__,
                 interp.interpreter_builder.options, tl.sort, tl.topk)
        def patch_lang_once(fn):
            scope = interp._LangPatchScope()
            for lang in (tl, tl.core):
                interp._patch_builtin(lang, interp.interpreter_builder, scope)
                interp._patch_builtin(lang.tensor, interp.interpreter_builder, scope)
                if lang is tl:
                    interp._patch_builtin(lang.math, interp.interpreter_builder, scope)
                interp._patch_lang_tensor(lang.tensor, scope)  # with pisa's NumPy-2.4 shim
                interp._patch_lang_core(lang, scope)
            interp._patch_builtin(tl.core.tensor_descriptor_base, interp.interpreter_builder, scope)
            return scope

        def as_tensor(x, data):
            data = np.ascontiguousarray(data)
            return tl.core.tensor(interp.TensorHandle(data, x.dtype),
                                  tl.block_type(x.dtype, list(data.shape)))

        def np_sort(x, dim=None, descending=False):
            data = np.sort(x.handle.data, axis=-1)
            return as_tensor(x, data[..., ::-1] if getattr(descending, "value", descending)
                             else data)

        def np_topk(x, k, dim=None):
            return as_tensor(x, np.sort(x.handle.data, axis=-1)[..., ::-1][
                ..., :int(getattr(k, "value", k))])

        def call_nested(self, *args, **kwargs):
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:  # the wrapping of the interpreter's own __call__
                raise interp.InterpreterError(repr(e)) from e

        interp._patch_lang = patch_lang_once
        interp.InterpretedFunction.__call__ = call_nested
        interp.interpreter_builder.options = dataclasses.replace(
            interp.interpreter_builder.options, sanitize_overflow=False)
        tl.sort, tl.topk = np_sort, np_topk
    except (ImportError, AttributeError, TypeError):
        yield
        return
    yield
    (interp._patch_lang, interp.InterpretedFunction.__call__, interp.interpreter_builder.options,
     tl.sort, tl.topk) = saved


@pytest.fixture
def poison_outputs(monkeypatch):
    """Outputs of the attention and decode kernels start as NaN (``PISA_TRITON_POISON``), so a
    match with the oracle proves every element was written."""
    monkeypatch.setenv("PISA_TRITON_POISON", "1")


@pytest.fixture
def poison_empty(monkeypatch):
    """Every ``torch.empty`` buffer (the selection and pyramid launchers' outputs, through
    ``utils.op.empty``, and their scratch buffers) starts as NaN, or ``POISON`` for int32 / int64, so an element a kernel forgets to
    write shows up as a mismatch with the oracle."""
    real = torch.empty

    def empty(*args, **kwargs):
        x = real(*args, **kwargs)
        if x.dtype.is_floating_point:
            x.fill_(math.nan)
        elif x.dtype in (torch.int32, torch.int64):
            x.fill_(POISON)
        return x

    monkeypatch.setattr(torch, "empty", empty)


def per_token_config(*args, **kwargs):
    """A ``SelectConfig`` of the per-token walk (``DECODE_DEFAULTS`` over the public defaults)
    but for what ``args`` (fields in order) and ``kwargs`` say: the configs the op tests were
    written against."""
    from dataclasses import fields

    from pisa.ops.utils.config import DECODE_DEFAULTS, SelectConfig
    names = [f.name for f in fields(SelectConfig)]
    return SelectConfig(**{**DECODE_DEFAULTS, **dict(zip(names, args)), **kwargs})
