"""Row gathers in one pass (``varlen.gather_rows`` on the ``triton`` backend): the layout row of
packed sequences and back. ``torch.index_copy`` into a zeroed row and the ``index_add`` of
``index_select``'s backward cost 3-9 ms a pass at 128K tokens of config A (H200, atomics and a
separate zero fill); a gather by the inverse map writes each output element once (~1 ms).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .op import poisoned

_ELEMS = 8192  # elements a program moves (rows x columns)


@triton.jit(do_not_specialize=["M"])
def _gather_rows_kernel(p_x, p_src, p_w, p_out, M, s_x: tl.int64, F: tl.constexpr,
                        BR: tl.constexpr, BF: tl.constexpr, WEIGHT: tl.constexpr):
    """``out [M, F]``: row ``r`` is ``w[r] * x[src[r]]`` (``WEIGHT``; else ``x[src[r]]``), zero
    where ``src[r] < 0``. ``x`` rows are ``s_x`` apart, ``F`` contiguous elements each."""
    i_r, i_f = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_f = i_f * BF + tl.arange(0, BF)
    m_r = o_r < M
    m_f = o_f < F
    b_src = tl.load(p_src + o_r, mask=m_r, other=-1)  # [BR] int64
    m_x = (b_src >= 0)[:, None] & m_f[None, :]
    b_x = tl.load(p_x + b_src[:, None] * s_x + o_f[None, :], mask=m_x, other=0.)
    if WEIGHT:
        b_x = b_x * tl.load(p_w + o_r, mask=m_r, other=0.)[:, None]
    p_o = p_out + o_r.to(tl.int64)[:, None] * F + o_f[None, :]
    tl.store(p_o, b_x.to(p_out.dtype.element_ty), mask=m_r[:, None] & m_f[None, :])


def gather_rows_triton(x: torch.Tensor, src: torch.Tensor,
                       weight: torch.Tensor | None = None) -> torch.Tensor:
    """``varlen.gather_rows`` (inputs as there) in one Triton kernel."""
    N, M, F = x.shape[0], src.shape[0], math.prod(x.shape[1:])
    x2 = x.reshape(N, F)  # a view where it can be (a row-strided slice of a fused projection)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(M, *x.shape[1:], dtype=x.dtype, device=x.device)
    if poisoned() and out.is_floating_point():
        out.fill_(float("nan"))
    if M == 0 or F == 0:
        return out
    BF = min(triton.next_power_of_2(F), 1024)
    BR = max(_ELEMS // BF, 1)
    _gather_rows_kernel[(triton.cdiv(M, BR), triton.cdiv(F, BF))](
        x2, src, weight if weight is not None else src, out, M, x2.stride(0), F=F, BR=BR, BF=BF,
        WEIGHT=weight is not None, num_warps=4)
    return out
