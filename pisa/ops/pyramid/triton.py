"""The key pyramid in one pass over ``k`` (Triton): layout of ``pisa.ops.pyramid``.

A program per (chunk of 16 leaves, KV head, batch) sums its keys into leaf sums and folds them
upward in registers for the levels the chunk spans (``g`` a power of two); a second launch, a
program per (KV head, batch), folds the few levels above from those sums. fp32 sums,
``means = sums / counts``, as ``build_pyramid_torch``. With ``bounds`` the same pass keeps the
per-channel min and max of every node's keys (``mins`` / ``maxs``, fp32, the layout of ``means``):
the leaves' from the keys the chunk loads anyway, every level above folded from its children's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.geometry import Pyramid, cdiv, level_offsets, pow2
from ..utils.op import device_offsets, empty
from ..utils.triton_utils import strides_of


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too
@triton.jit(do_not_specialize=["T"])
def _pyramid_chunk_kernel(
        p_k, p_means, p_counts, p_sums, p_mins, p_maxs, p_smin, p_smax, p_off, T,
        s_kb: tl.int64, s_k, s_mb: tl.int64, s_m, s_sb: tl.int64, s_s,
        C: tl.constexpr, CB: tl.constexpr, LEAVES: tl.constexpr, LEVELS: tl.constexpr,
        BRANCH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, WRITE_SUMS: tl.constexpr,
        BOUNDS: tl.constexpr):
    """Leaves ``[i_c * LEAVES, (i_c + 1) * LEAVES)`` and the ``LEVELS`` levels of nodes above them
    that lie inside this chunk; the sums of the topmost of those levels go to ``p_sums`` when the
    top kernel must continue from them. ``BOUNDS``: also the per-channel min / max of each node's
    keys into ``p_mins`` / ``p_maxs`` (the strides of ``p_means``), and those of the topmost level
    into ``p_smin`` / ``p_smax`` (the strides of ``p_sums``) for the top kernel. ``s_k``: the
    keys' (token, head) strides; ``s_m``, ``s_s``: (node, head) strides."""
    s_kt, s_kh = s_k
    s_mn, s_mh = s_m
    s_sn, s_sh = s_s
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    o_leaf = i_c * LEAVES + tl.arange(0, LEAVES)
    o_cb = tl.arange(0, CB)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    p_kh = p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh

    b_sum = tl.zeros([LEAVES, DP], dtype=tl.float32)
    b_min = tl.full([LEAVES, DP], float("inf"), dtype=tl.float32)
    b_max = tl.full([LEAVES, DP], float("-inf"), dtype=tl.float32)
    for c0 in range(0, C, CB):
        o_t = o_leaf[:, None] * C + c0 + o_cb[None, :]  # [LEAVES, CB] token positions
        p_kc = p_kh + o_t.to(tl.int64)[:, :, None] * s_kt + o_d[None, None, :]
        m_k = (o_t < T)[:, :, None] & m_d[None, None, :]
        b_k = tl.load(p_kc, mask=m_k, other=0.).to(tl.float32)
        b_sum += tl.sum(b_k, axis=1)
        if BOUNDS:  # a leaf's keys only: the ragged tail's missing keys never win
            b_min = tl.minimum(b_min, tl.min(tl.where(m_k, b_k, float("inf")), axis=1))
            b_max = tl.maximum(b_max, tl.max(tl.where(m_k, b_k, float("-inf")), axis=1))
    b_n = tl.minimum(tl.maximum(T - o_leaf * C, 0), C)  # real keys per leaf, 0 past the end

    o_node = o_leaf
    for lv in tl.static_range(LEVELS + 1):
        if lv > 0:
            # Fold BRANCH siblings (adjacent rows: chunks are aligned to BRANCH**LEVELS leaves).
            b_sum = tl.sum(tl.reshape(b_sum, [b_sum.shape[0] // BRANCH, BRANCH, DP]), axis=1)
            if BOUNDS:
                b_min = tl.min(tl.reshape(b_min, [b_min.shape[0] // BRANCH, BRANCH, DP]), axis=1)
                b_max = tl.max(tl.reshape(b_max, [b_max.shape[0] // BRANCH, BRANCH, DP]), axis=1)
            b_n = tl.sum(tl.reshape(b_n, [b_n.shape[0] // BRANCH, BRANCH]), axis=1)
            o_node = i_c * b_n.shape[0] + tl.arange(0, b_n.shape[0])
        lo = tl.load(p_off + lv)
        m_node = o_node < tl.load(p_off + lv + 1) - lo
        b_mean = b_sum / tl.maximum(b_n, 1).to(tl.float32)[:, None]
        o_m = i_b.to(tl.int64) * s_mb + i_h * s_mh \
            + (lo + o_node).to(tl.int64)[:, None] * s_mn + o_d[None, :]
        m_st = m_node[:, None] & m_d[None, :]
        tl.store(p_means + o_m, b_mean, mask=m_st)
        if BOUNDS:
            tl.store(p_mins + o_m, b_min, mask=m_st)
            tl.store(p_maxs + o_m, b_max, mask=m_st)
        if i_h + i_b == 0:
            tl.store(p_counts + lo + o_node, b_n, mask=m_node)
    if WRITE_SUMS:
        o_s = i_b.to(tl.int64) * s_sb + i_h * s_sh \
            + o_node.to(tl.int64)[:, None] * s_sn + o_d[None, :]
        m_st = m_node[:, None] & m_d[None, :]
        tl.store(p_sums + o_s, b_sum, mask=m_st)
        if BOUNDS:
            tl.store(p_smin + o_s, b_min, mask=m_st)
            tl.store(p_smax + o_s, b_max, mask=m_st)


@triton.jit(do_not_specialize=["T", "lvl0", "n_levels", "span0"])
def _pyramid_top_kernel(
        p_means, p_counts, p_sums, p_mins, p_maxs, p_smin, p_smax, p_off, T, lvl0, n_levels,
        span0, s_mb: tl.int64, s_m, s_sb: tl.int64, s_s,
        C: tl.constexpr, BRANCH: tl.constexpr, PB: tl.constexpr, D: tl.constexpr,
        DP: tl.constexpr, BOUNDS: tl.constexpr):
    """Levels ``lvl0 + 1 .. n_levels`` from the sums of level ``lvl0`` (rows of ``p_sums``, which
    this program extends level by level: row ``r`` holds pyramid row ``offsets[lvl0 - 1] + r``);
    ``BOUNDS``: the mins / maxs likewise from ``p_smin`` / ``p_smax``. ``s_m``, ``s_s``: (node,
    head) strides."""
    s_mn, s_mh = s_m
    s_sn, s_sh = s_s
    i_h, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    o_sh = i_b.to(tl.int64) * s_sb + i_h * s_sh
    o_mh = i_b.to(tl.int64) * s_mb + i_h * s_mh
    base = tl.load(p_off + lvl0 - 1)
    span = span0  # leaves under one node of the level being built
    for lvl in range(lvl0 + 1, n_levels + 1):
        lo_c = tl.load(p_off + lvl - 2)
        lo = tl.load(p_off + lvl - 1)
        n_par = tl.load(p_off + lvl) - lo
        for p0 in range(0, n_par, PB):
            o_p = p0 + tl.arange(0, PB)
            m_p = o_p < n_par
            b_sum = tl.zeros([PB, DP], dtype=tl.float32)
            b_min = tl.full([PB, DP], float("inf"), dtype=tl.float32)
            b_max = tl.full([PB, DP], float("-inf"), dtype=tl.float32)
            for r in range(0, BRANCH):
                o_c = o_p * BRANCH + r
                m_c = (m_p & (o_c < lo - lo_c))[:, None] & m_d[None, :]
                o = o_sh + (lo_c - base + o_c).to(tl.int64)[:, None] * s_sn + o_d[None, :]
                b_sum += tl.load(p_sums + o, mask=m_c, other=0.)
                if BOUNDS:
                    b_min = tl.minimum(b_min, tl.load(p_smin + o, mask=m_c, other=float("inf")))
                    b_max = tl.maximum(b_max, tl.load(p_smax + o, mask=m_c, other=float("-inf")))
            b_n = tl.minimum(tl.maximum(T - o_p * span * C, 0), span * C)
            m_st = m_p[:, None] & m_d[None, :]
            o = o_sh + (lo - base + o_p).to(tl.int64)[:, None] * s_sn + o_d[None, :]
            tl.store(p_sums + o, b_sum, mask=m_st)
            if BOUNDS:
                tl.store(p_smin + o, b_min, mask=m_st)
                tl.store(p_smax + o, b_max, mask=m_st)
            o = o_mh + (lo + o_p).to(tl.int64)[:, None] * s_mn + o_d[None, :]
            tl.store(p_means + o, b_sum / tl.maximum(b_n, 1).to(tl.float32)[:, None], mask=m_st)
            if BOUNDS:
                tl.store(p_mins + o, b_min, mask=m_st)
                tl.store(p_maxs + o, b_max, mask=m_st)
            if i_h + i_b == 0:
                tl.store(p_counts + lo + o_p, b_n, mask=m_p)
        # The next level reads the sums this level's threads just wrote.
        tl.debug_barrier()
        span = span * BRANCH


# ------------------------------------------------------------------------------------------------
# Launcher and public function
# ------------------------------------------------------------------------------------------------

def _launch_pyramid_build(k: torch.Tensor, block_size: int, branching: int,
                          offsets: tuple[int, ...], leaves_per_program: int = 16,
                          bounds: bool = False):
    """Means ``[B, offsets[-1], HKV, D]`` fp32 and counts ``[offsets[-1]]`` int32 of ``k``, and
    with ``bounds`` the mins and maxs (fp32, the layout of the means; else ``None``)."""
    B, T, H, D = k.shape
    C, g = block_size, branching
    n_levels = len(offsets) - 1
    means = empty(B, offsets[-1], H, D, dtype=torch.float32, device=k.device)
    counts = empty(offsets[-1], dtype=torch.int32, device=k.device)
    mins = maxs = None
    if bounds:
        mins, maxs = (empty(B, offsets[-1], H, D, dtype=torch.float32, device=k.device)
                      for _ in range(2))
    off = device_offsets(tuple(offsets), k.device)
    DP = max(16, pow2(D))
    leaves = pow2(leaves_per_program)
    # In-chunk levels need BRANCH siblings to be adjacent rows of a power-of-two register tile.
    levels = 0
    if g & (g - 1) == 0:
        while g ** (levels + 1) <= leaves and levels + 1 < n_levels:
            levels += 1
    write_sums = levels + 1 < n_levels
    sums = means
    smin = smax = means  # unused without bounds
    if write_sums:
        sums, *scratch = (torch.empty(B, offsets[-1] - offsets[levels], H, D, dtype=torch.float32,
                                      device=k.device) for _ in range(3 if bounds else 1))
        if bounds:
            smin, smax = scratch
    p_mins, p_maxs = (mins, maxs) if bounds else (means, means)
    # the same key chunks with or without bounds: the means are the same bits either way
    CB = max(1, min(C, 8192 // (leaves * DP)))
    grid = (cdiv(offsets[1], leaves), H, B)
    _pyramid_chunk_kernel[grid](
        k, means, counts, sums, p_mins, p_maxs, smin, smax, off, T,
        *strides_of(k), *strides_of(means), *strides_of(sums),
        C=C, CB=CB, LEAVES=leaves, LEVELS=levels, BRANCH=g, D=D, DP=DP, WRITE_SUMS=write_sums,
        BOUNDS=bounds, num_warps=4)
    if write_sums:
        _pyramid_top_kernel[(H, B)](
            means, counts, sums, p_mins, p_maxs, smin, smax, off, T, levels + 1, n_levels,
            g ** (levels + 1), *strides_of(means), *strides_of(sums),
            C=C, BRANCH=g, PB=32, D=D, DP=DP, BOUNDS=bounds, num_warps=4)
    return means, counts, mins, maxs


def build_pyramid_triton(k: torch.Tensor, block_size: int, branching: int,
                         bounds: bool = False) -> Pyramid:
    """The key pyramid of ``k [B, T, HKV, D]`` in one pass over
    ``k``: fp32 sums folded upward, ``means = sums / counts``; with ``bounds``, also every node's
    per-channel key ``mins`` / ``maxs`` (fp32)."""
    offsets = level_offsets(k.shape[1], block_size, branching)
    means, counts, mins, maxs = _launch_pyramid_build(k, block_size, branching, offsets,
                                                      bounds=bounds)
    return Pyramid(means, counts, offsets, mins, maxs)
