"""How the Triton kernels take their arguments, and the compile-time pieces they share.

Names (every kernel file)
-------------------------
``p_`` pointers, ``b_`` loaded blocks and register tiles, ``o_`` offsets and index vectors, ``m_``
masks, ``i_`` program indices, ``s_`` strides, ``n_`` counts; CAPITAL names are ``tl.constexpr``.
A trailing ``P`` is the power-of-two padding of the size before it (``DP`` of ``D``, ``GP`` of
``G``, ``W2P`` of ``W2``). Sizes follow ``docs/spec.md``: ``D`` head dim, ``G`` query heads per KV
head (the GQA group), ``C`` keys a block, ``BRANCH`` the pyramid's branching (``g``), ``W`` /
``W2`` the beams above / at level 2 (``beam_leaf``), ``QT`` query positions a selection row
(``query_tile``), ``TOPK`` the blocks a row keeps, ``SLOTS`` its width. Runtime lengths are
``Tq`` / ``Tk`` (queries, keys) and ``n_tiles`` (selection rows).

Arguments
---------
Pointers first, then strides and runtime sizes, then constexpr bundles. A kernel keeps the
flattened order its parameters had (tuples flatten in place): moving the sizes before the strides
changed the SASS of the attention kernels (how ptxas loads and schedules the parameters) while
their PTX was the same. Each tensor's batch stride is an int64 scalar ``s_<x>b``: its value
passes 2**31 from ~256K tokens, and a tuple element's integer type follows its value, so in a
tuple it would turn int64 there and recompile the kernel. Its other strides come as one tuple
``s_<x>`` in dim order (``strides_of``: ``x.stride()[1:3]`` of ``[B, T, H, D]``). Triton
specializes tuple elements as it does scalar arguments (an element equal to 1 becomes a constant,
one divisible by 16 carries that hint into the address arithmetic), so the compiled code is that
of separate arguments. Runtime lengths stay scalars in ``do_not_specialize``, which does not reach
into tuples: a length's divisibility must not recompile a kernel (``docs/design.md``, "Cold
start").

Compile-time sizes and switches come in ``typing.NamedTuple`` bundles by role (a kernel file's
rows, tree, scoring ...), passed as one ``tl.constexpr`` and handed whole to the ``@triton.jit``
helpers; a field reads as ``ROWS.GP``. The compiler reads a field of a constexpr tuple as a plain
Python value: fine as a bound, an operand or an int / bool argument of a helper, but a shape list
and a string argument need constexprs (``tl.zeros([ROWS.TB, ROWS.D])`` fails to compile, while
the interpreter runs it), so a kernel binds such a field first: ``TB: tl.constexpr = ROWS.TB``.
(Bundles holding ``tl.constexpr`` fields would lift that rule, at ~20 us more host time a launch:
building them, and Triton hashing and comparing them for its kernel cache.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from .config import SelectConfig
from .geometry import pow2
from .op import F32_PRECISION

# tl.dot precision of fp32 operands (``op.F32_PRECISION``) for the kernels' own dots.
F32_PREC: tl.constexpr = tl.constexpr(F32_PRECISION)
# An empty int32 sort-key slot (the selection's (tile, parent) pairs): above every real key.
SLOT_NONE: tl.constexpr = tl.constexpr(torch.iinfo(torch.int32).max)

# Shared memory a pipelined loop may fill with the tiles it loads ahead (``num_stages``). The H100
# / H200 give a block up to 227 KB; what else is live beside the staged tiles differs by kernel:
# - selection (walk, leaf stage): the whole kernel's staged tiles, with the leaf stage's parent
#   keys, must stay under this, or the kernel runs unpipelined (1 stage). The bound scorer's four
#   [128, 128] child tiles at g = 3, 4 asked for 279 KB with 2 stages (compiled for sm_90).
SELECT_STAGE_SMEM = 160_000
# - decode: per loop, the tiles loaded ahead; the queries and the dots' operands hold the rest.
DECODE_STAGE_SMEM = 128 * 1024


class Pick(NamedTuple):
    """How a selection row is filled (``op.selection_row`` / ``op.store_selection``): the best
    ``TOPK`` blocks (``TOPK`` free ones beside the forced blocks unless ``IN_BUDGET``), ascending
    in ``SLOTS`` columns (``SLOTS_P`` padded)."""

    TOPK: int
    IN_BUDGET: bool
    SLOTS: int
    SLOTS_P: int


def strides_of(x: torch.Tensor) -> tuple[int, tuple[int, int]]:
    """``x``'s batch stride and the tuple of its next two (token and head for ``[B, T, H, D]``),
    as the kernels take a tensor's strides."""
    return x.stride(0), x.stride()[1:3]


def pick_of(cfg: SelectConfig) -> Pick:
    """The ``Pick`` of a resolved selection config."""
    return Pick(cfg.topk, cfg.forced_in_budget, cfg.slots, pow2(cfg.slots))
