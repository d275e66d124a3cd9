"""Fused Triton append of a few tokens to a KV cache (``kvcache``'s layout): the keys and values
written at their positions and every pyramid level's sums (and key bounds) updated, in one launch.

A decode step appends one token; ``kvcache._write_kv`` in torch ops does it in ~15 small
launches (index arithmetic, two ``index_put_``, an ``index_add_`` and two ``scatter_reduce_``
over all levels at once), as long on the GPU as the decode kernel itself and a large part of a
step's host time. Here one program per (new token, KV head) writes its K and V rows and walks
its ``n_levels`` ancestors, adding the key into each node's fp32 sum with ``tl.atomic_add`` (and
``tl.atomic_min`` / ``tl.atomic_max`` into its bounds): tokens of one call that share a node
meet only in those atomics, so any number of new tokens is right, but a long run (a prefill)
would serialise on the top levels' rows: ``_write_kv`` folds those densely instead
(``_add_runs``).

Positions, slots and pages are read on the device (no host sync: capturable in a CUDA graph).
A token whose position lies outside ``[0, T_max)``, whose slot lies outside the cache or whose
page lies outside the pool is not written (the torch path's device-side asserts have no
counterpart here); a decode step of such a sequence gives NaN rows, as for any length, slot or
page out of range (``triton``'s kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.relaunch import Relaunch


@triton.jit
def _append_kernel(p_kn, p_vn, p_k, p_v, p_sums, p_mins, p_maxs, p_lens, p_slot, p_table,
                   s_knb, s_knl, s_knh, s_vnb, s_vnl, s_vnh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                   s_tb, s_sb, s_sn, s_sh, L, T_max, n_slots, n_pages, n_leaves, n_levels, C,
                   D: tl.constexpr, DP: tl.constexpr, BRANCH: tl.constexpr,
                   BOUND: tl.constexpr, PAGED: tl.constexpr, SLOT_IDX: tl.constexpr):
    i_bl, i_h = tl.program_id(0), tl.program_id(1)
    i_b, i_l = i_bl // L, i_bl % L
    pos = tl.load(p_lens + i_b).to(tl.int64) + i_l
    i_c = i_b.to(tl.int64)
    if SLOT_IDX:
        i_c = tl.load(p_slot + i_b).to(tl.int64)
    ok = (pos >= 0) & (pos < T_max) & (i_c >= 0) & (i_c < n_slots)
    row = i_c * s_kb + pos * s_kt  # contiguous: slot row, position
    row_v = i_c * s_vb + pos * s_vt
    if PAGED:  # the page of the position, its row in the page; a page pool is contiguous
        page = tl.load(p_table + i_b.to(tl.int64) * s_tb + tl.where(ok, pos // C, 0),
                       mask=ok, other=-1).to(tl.int64)
        ok &= (page >= 0) & (page < n_pages)
        row = (page * C + pos % C) * s_kt
        row_v = (page * C + pos % C) * s_vt
    o_d = tl.arange(0, DP)
    m_d = (o_d < D) & ok
    o_new = i_b.to(tl.int64) * s_knb + i_l * s_knl + i_h * s_knh + o_d
    b_k = tl.load(p_kn + o_new, mask=m_d, other=0.)
    b_v = tl.load(p_vn + i_b.to(tl.int64) * s_vnb + i_l * s_vnl + i_h * s_vnh + o_d, mask=m_d,
                  other=0.)
    tl.store(p_k + row + i_h * s_kh + o_d, b_k, mask=m_d)
    tl.store(p_v + row_v + i_h * s_vh + o_d, b_v, mask=m_d)
    # the ancestors, leaves first: level i's node of the token is pos // (C * BRANCH ** i), at
    # the rows after the levels below it (cdiv(n_leaves, BRANCH ** j) nodes at level j)
    b_x = b_k.to(tl.float32)
    node = tl.where(ok, pos // C, 0)
    first = i_c * s_sb + i_h * s_sh
    n = n_leaves
    for _ in range(n_levels):
        o_s = first + node * s_sn + o_d
        tl.atomic_add(p_sums + o_s, b_x, mask=m_d, sem="relaxed")
        if BOUND:
            tl.atomic_min(p_mins + o_s, b_x, mask=m_d, sem="relaxed")
            tl.atomic_max(p_maxs + o_s, b_x, mask=m_d, sem="relaxed")
        first += n * s_sn
        n = (n + BRANCH - 1) // BRANCH
        node = node // BRANCH


def append_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, sums: torch.Tensor,
                  k_new: torch.Tensor, v_new: torch.Tensor, cache_seqlens: torch.Tensor,
                  block_size: int, branching: int, n_levels: int,
                  mins: torch.Tensor | None = None, maxs: torch.Tensor | None = None,
                  block_table: torch.Tensor | None = None,
                  cache_batch_idx: torch.Tensor | None = None) -> None:
    """``kvcache.write_kv`` in one launch (its arguments, checked by the caller; ``sums`` and the
    bounds fp32 and contiguous, ``n_levels`` the pyramid's levels for ``T_max``; the new rows'
    head dim contiguous). Grid ``(B * L, HKV)``."""
    B, L, H, D = k_new.shape
    if B * L == 0:
        return
    paged = block_table is not None
    bound = mins is not None
    # unused pointers: the table when contiguous, the slots without cache_batch_idx, the bounds
    table = block_table if paged else cache_seqlens
    slots = cache_batch_idx if cache_batch_idx is not None else cache_seqlens
    if not bound:
        mins = maxs = sums
    # everything but the tensors follows from this key: a decode step's append is host-bound
    key = (k_new.shape, k_new.stride(), k_new.dtype, v_new.stride(), v_new.dtype, k_cache.shape,
           k_cache.stride(), k_cache.dtype, v_cache.stride(), v_cache.dtype, sums.shape,
           sums.stride(), sums.dtype, mins.dtype, maxs.dtype, cache_seqlens.dtype, table.shape,
           table.stride(), table.dtype, slots.dtype, block_size, branching, n_levels, bound,
           paged, cache_batch_idx is not None)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= 256:  # shapes that come and go (tests): no unbounded growth
            _LAUNCHES.clear()
        launch = _LAUNCHES[key] = _launch(k_cache, v_cache, sums, k_new, v_new, table,
                                          block_size, branching, n_levels, bound, paged,
                                          cache_batch_idx is not None)
    launch(k_new, v_new, k_cache, v_cache, sums, mins, maxs, cache_seqlens, slots, table)


_LAUNCHES: dict[tuple, Relaunch] = {}


def _launch(k_cache, v_cache, sums, k_new, v_new, table, block_size: int, branching: int,
            n_levels: int, bound: bool, paged: bool, slot_idx: bool) -> Relaunch:
    """``_append_kernel``'s launch for inputs of this metadata (``append_triton``'s key)."""
    B, L, H, D = k_new.shape
    T_max = table.shape[1] * block_size if paged else k_cache.shape[1]
    args = (*k_new.stride()[:3], *v_new.stride()[:3],
            0 if paged else k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            0 if paged else v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            table.stride(0), sums.stride(0), sums.stride(1), sums.stride(2), L, T_max,
            sums.shape[0], k_cache.shape[0], triton.cdiv(T_max, block_size), n_levels,
            block_size, D, triton.next_power_of_2(D), branching, bound, paged, slot_idx)
    return Relaunch(_append_kernel, (B * L, H, 1), args, num_warps=1)
