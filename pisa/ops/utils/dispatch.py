"""When a call goes through its ``torch.library`` custom op.

The ops (``pisa::select``, ``pisa::sparse_attn`` and its backward, ``pisa::write_kv``,
``pisa::decode_step``) exist for what traces a program: ``torch.compile`` and ``torch.export``
(opaque calls with fake implementations) and Python dispatch modes such as ``FakeTensorMode``
(shapes without data) or meta tensors. An eager call runs the op's function directly: the op's
dispatch costs host time every call, and its first use imports ``torch._dynamo`` (seconds of a
process's first call).
"""
from __future__ import annotations

import torch


def use_op(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` (an input tensor) should go through the custom op: while
    compiling or exporting, under a Python dispatch mode, or for a meta tensor."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 \
        or x.is_meta
