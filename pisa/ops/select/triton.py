"""Pyramid block selection (Triton): the walk down the pyramid and the exact leaf stage.

Semantics are those of ``naive.naive_select`` (the oracle) and ``PISA_SPEC.md`` §3-§4; on random
inputs the selections equal the oracle's exactly. Three launches and a sort:

1. ``_pyramid_walk_kernel``, a program per (query, KV head): the internal levels (``walk``). The
   beam lives in registers as the ``W`` kept non-forced nodes of the level above; a level's
   candidates are their children plus the non-forced, causal children of the forced nodes, whose
   indices follow from the query position (forced nodes are never carried). The top levels whose
   candidates all fit the beam are not visited (their beam follows from the position). A level
   with more than ``W`` candidates is scored with ``means @ q^T`` (the 64 candidate rows fill a
   Hopper warpgroup MMA, the 16 query rows would not), 16-bit head + residual means precomputed
   per call, folded into a log-sum-exp (or weighted Welford mean / variance) over children,
   summed over heads; ``tl.topk`` over packed keys keeps ``W``. The kernel writes each query's
   level-2 parents of its leaf candidates as sort keys (head, chunk of ``LEAF_CHUNK`` queries,
   parent).
2. ``utils.csr.sort_by_key`` groups the (query, parent) pairs by key.
3. ``_leaf_groups_kernel``, a program per group: loads the parent's ``g * C`` keys once and scores
   them against its queries ``PB`` at a time (``[PB * G, D] x [D, g * C]`` dots): per (query,
   parent) pair ~4 KB of queries move instead of 32 KB of keys.
4. ``_leaf_topk_kernel`` picks each query's best free leaves and writes its row.

``walk``, ``candidates``, ``forced_parents`` and ``leaf_key_scores`` are the primitives the fused
decode kernel (``pisa.ops.decode.triton``) reuses.

Limits: ``W <= 512 / next_pow2(g)`` (a wider beam that covers every block is the flat scan,
``select.flat``); any ``g >= 2`` (non-powers of two pad to the next one); any ``D <= 256`` and
``G``. Registers grow with ``next_pow2(g) * next_pow2(W) * D`` (the default g=2, W=16, D=128 fits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pyramid import Pyramid
from ..utils.config import SelectConfig
from ..utils.csr import sort_by_key
from ..utils.geometry import cdiv, level_offsets, pow2
from ..utils.op import (F32_PRECISION, KEY_NONE, device_offsets, dot_nt, empty, key_scores,
                        load_queries, pack, selection_row, store_selection, token_sums,
                        unpack_idx)

SCORER_ID = {"lse": 0, "mean": 1, "meanvar": 2}
# Queries whose (query, parent) pairs share one leaf-stage grid row: chunks keep a group's
# queries close in memory (cache locality of their gathered rows).
LEAF_CHUNK = 4096


# ------------------------------------------------------------------------------------------------
# Walk primitives (shared with the decode kernel)
# ------------------------------------------------------------------------------------------------


@triton.jit
def leaf_keys(p_kh, s_kt, o_leaf, m_leaf, C: tl.constexpr, CP: tl.constexpr, DP: tl.constexpr,
              D: tl.constexpr):
    """The keys ``[L * CP, DP]`` of the full leaf blocks ``o_leaf [L]`` (``CP > C`` pads with zero
    rows, for 16-column dots). Leaves outside ``m_leaf`` are not loaded (zeros)."""
    L: tl.constexpr = o_leaf.shape[0]
    o_c = tl.arange(0, CP)
    o_d = tl.arange(0, DP)
    m_key = m_leaf[:, None] & (o_c < C)[None, :]  # [L, CP]
    o_key = tl.reshape(o_leaf[:, None] * C + o_c[None, :], [L * CP])
    p = p_kh + o_key.to(tl.int64)[:, None] * s_kt + o_d[None, :]
    return tl.load(p, mask=tl.reshape(m_key, [L * CP])[:, None] & (o_d < D)[None, :], other=0.)


@triton.jit
def leaf_scores(b_q, m_row, b_k, scale, BT: tl.constexpr, GP: tl.constexpr, C: tl.constexpr,
                CP: tl.constexpr, SCORER: tl.constexpr, F32_PREC: tl.constexpr):
    """Scores ``[BT, L]`` of the leaves whose keys ``leaf_keys`` loaded into ``b_k [L * CP, DP]``,
    for the ``BT`` tokens of the query rows ``b_q [BT * GP, DP]``: one dot, then per block and
    row ``key_scores``, summed over each token's heads."""
    M: tl.constexpr = b_q.shape[0]
    L: tl.constexpr = b_k.shape[0] // CP
    o_c = tl.arange(0, CP)
    b_z = tl.reshape(dot_nt(b_q, b_k, F32_PREC) * scale, [M, L, CP])
    return token_sums(key_scores(b_z, (o_c < C)[None, None, :], C, SCORER), m_row, BT, GP)


@triton.jit
def leaf_key_scores(b_q, m_row, p_kh, s_kt, o_leaf, m_leaf, scale,
                    BT: tl.constexpr, GP: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                    DP: tl.constexpr, D: tl.constexpr, SCORER: tl.constexpr,
                    F32_PREC: tl.constexpr):
    """Exact scores ``[BT, L]`` of the full leaf blocks ``o_leaf [L]`` (siblings) for every token of
    the tile, from their keys: one ``[L * C, D]`` load and one dot against all ``BT * G`` query
    rows. Leaves outside ``m_leaf`` are not loaded and score garbage."""
    b_k = leaf_keys(p_kh, s_kt, o_leaf, m_leaf, C, CP, DP, D)
    return leaf_scores(b_q, m_row, b_k, scale, BT, GP, C, CP, SCORER, F32_PREC)


@triton.jit
def forced_parents(o_p, c0, c1, span):
    """Forced nodes ``[0, a(c0 - 1), a(c0), a(c1)]`` (``a(x) = x // span``) at slot ``o_p``, and
    whether the slot holds a node not already listed (the list is non-decreasing)."""
    a_prev = tl.maximum(c0 - 1, 0) // span
    a_cur = c0 // span
    a_last = c1 // span
    par = tl.where(o_p == 0, 0, tl.where(o_p == 1, a_prev, tl.where(o_p == 2, a_cur, a_last)))
    before = tl.where(o_p == 1, 0, tl.where(o_p == 2, a_prev, a_cur))
    return par, (o_p == 0) | (par != before)


@triton.jit
def candidates(b_rest, n_rest, c0, c1, span_up, G_BR: tl.constexpr, GBP: tl.constexpr,
               WP: tl.constexpr):
    """Candidate nodes ``[2 * GBP * WP]`` of a level and which slots hold one: the children of the
    kept nodes ``b_rest`` of the level above (``span_up`` leaves per node) interleaved with the
    children of that level's forced nodes (``forced_parents``, ``GBP`` slots each)."""
    NA: tl.constexpr = GBP * WP
    o_w = tl.arange(0, WP)
    o_c = tl.arange(0, GBP)
    o_a = tl.reshape(b_rest[None, :] * G_BR + o_c[:, None], [NA])
    m_a = tl.reshape((o_w[None, :] < n_rest) & (o_c[:, None] < G_BR), [NA])
    o_f = tl.arange(0, NA)
    par, m_par = forced_parents(o_f // GBP, c0, c1, span_up)
    o_b = par * G_BR + o_f % GBP
    m_b = m_par & (o_f < 4 * GBP) & (o_f % GBP < G_BR)
    return tl.reshape(tl.join(o_a, o_b), [2 * NA]), tl.reshape(tl.join(m_a, m_b), [2 * NA])


@triton.jit
def _child_scores(b_q, o_node, m_node, p_child, s_cn, p_ccount, n_child, scale,
                  CHILDREN: tl.constexpr, SCORER: tl.constexpr, DP: tl.constexpr, D: tl.constexpr,
                  LO: tl.constexpr, F32_PREC: tl.constexpr):
    """Scores ``[N, M]`` of nodes ``o_node [N]`` for the query rows ``b_q [M, DP]`` from their
    ``CHILDREN`` children's means (rows ``o_node * CHILDREN + c`` of ``p_child``) weighted by the
    children's counts, from ``means @ q^T`` (the ``N`` candidates as the dot's rows). ``LO > 0``:
    the rows hold the 16-bit heads of fp32 means, their residuals ``LO`` elements on.

    lse: ``log sum_c n_c exp(z_c)`` (online, max-shift added back); mean / meanvar: count-weighted
    Welford mean and variance of ``z_c``. A child past ``n_child`` has count 0 and no weight.
    """
    o_d = tl.arange(0, DP)
    M: tl.constexpr = b_q.shape[0]
    N: tl.constexpr = o_node.shape[0]
    b_a = tl.full([N, M], float("-inf"), dtype=tl.float32)  # lse: running max; else: mean
    b_b = tl.zeros_like(b_a)  # lse: running sum; else: running M2
    b_w = tl.zeros([N], dtype=tl.float32)  # total count so far (mean / meanvar)
    if SCORER != 0:
        b_a = tl.zeros_like(b_a)
    for c in range(0, CHILDREN):  # a runtime loop: one child tile live at a time
        o_c = o_node * CHILDREN + c
        m_c = m_node & (o_c < n_child)
        p = p_child + o_c.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        m_p = m_c[:, None] & (o_d < D)[None, :]
        b_z = dot_nt(tl.load(p, mask=m_p, other=0.), b_q, F32_PREC)
        if LO > 0:
            b_z += dot_nt(tl.load(p + LO, mask=m_p, other=0.), b_q, F32_PREC)
        b_z = b_z * scale  # [N, M]
        b_n = tl.load(p_ccount + o_c, mask=m_c, other=0).to(tl.float32)
        if SCORER == 0:
            b_x = tl.where(b_n[:, None] > 0, b_z + tl.log(tl.maximum(b_n, 1.))[:, None],
                           float("-inf"))
            b_max = tl.maximum(b_a, b_x)
            b_shift = tl.where(b_max == float("-inf"), 0., b_max)
            b_b = b_b * tl.exp(b_a - b_shift) + tl.exp(b_x - b_shift)
            b_a = b_max
        else:
            b_wn = b_w + b_n
            b_f = tl.where(b_wn > 0, b_n / tl.maximum(b_wn, 1.), 0.)
            b_delta = b_z - b_a
            b_a = b_a + b_delta * b_f[:, None]
            b_b = b_b + b_n[:, None] * b_delta * (b_z - b_a)
            b_w = b_wn
    if SCORER == 0:
        b_s = b_a + tl.log(tl.maximum(b_b, 1.))  # >= 1 for a node with a child: exp(max - max)
    elif SCORER == 1:
        b_s = b_a
    else:
        b_s = b_a + 0.5 * b_b / tl.maximum(b_w, 1.)[:, None]
    return b_s


@triton.jit
def _pair_lse_scores(b_q, o_node, m_node, p_child, s_cn, p_ccount, n_child, scale,
                     D: tl.constexpr, LO: tl.constexpr, F32_PREC: tl.constexpr):
    """``_child_scores`` for the lse scorer and two children, in closed form:
    ``log(n_0 e^z_0 + n_1 e^z_1) = hi + log(1 + e^(lo - hi))`` with ``hi, lo`` the larger and
    smaller of ``z_c + log n_c`` (one exp2 and one log2 per score instead of the online update's
    four exps and a libdevice log). Returns ``[N, M]``."""
    DP: tl.constexpr = b_q.shape[1]
    o_d = tl.arange(0, DP)
    o_c = o_node * 2
    m_c0 = m_node & (o_c < n_child)
    m_c1 = m_node & (o_c + 1 < n_child)
    p = p_child + o_c.to(tl.int64)[:, None] * s_cn + o_d[None, :]
    b_x0 = _child_logits(b_q, p, m_c0, o_d < D, p_ccount + o_c, scale, LO, F32_PREC)
    b_x1 = _child_logits(b_q, p + s_cn, m_c1, o_d < D, p_ccount + o_c + 1, scale, LO, F32_PREC)
    b_hi = tl.maximum(b_x0, b_x1)
    b_d = tl.minimum(b_x0, b_x1) - tl.where(b_hi > float("-inf"), b_hi, 0.)  # no child: -inf
    return b_hi + tl.log2(1. + tl.exp2(b_d * 1.4426950408889634)) * 0.6931471805599453


@triton.jit
def _child_logits(b_q, p, m_c, m_d, p_n, scale, LO: tl.constexpr, F32_PREC: tl.constexpr):
    """``[N, M]``: ``scale * mean_c . q + log n_c`` of one child per node (means at ``p [N, DP]``
    for the nodes ``m_c`` and dims ``m_d``; 16-bit head and residual ``LO`` on when ``LO > 0``),
    ``-inf`` for a missing child."""
    m_p = m_c[:, None] & m_d[None, :]
    b_z = dot_nt(tl.load(p, mask=m_p, other=0.), b_q, F32_PREC)
    if LO > 0:
        b_z += dot_nt(tl.load(p + LO, mask=m_p, other=0.), b_q, F32_PREC)
    b_n = tl.load(p_n, mask=m_c, other=0).to(tl.float32)
    return tl.where(b_n[:, None] > 0, b_z * scale + tl.log(tl.maximum(b_n, 1.))[:, None],
                    float("-inf"))


@triton.jit
def walk(b_q, m_row, p_mh, s_mn, p_counts, p_off, n_levels, top_span, c0, c1, t_last, scale,
         C: tl.constexpr, G_BR: tl.constexpr, GBP: tl.constexpr, W: tl.constexpr,
         WP: tl.constexpr, SCORER: tl.constexpr, DP: tl.constexpr, D: tl.constexpr,
         LO: tl.constexpr, F32_PREC: tl.constexpr):
    """The internal levels of the walk, from the root's children down to level 2, for the query
    rows ``b_q`` (``m_row``: the real ones) of a tile whose tokens lie in leaves ``c0..c1``
    (``t_last`` its last position). Returns ``b_rest [WP]``, the kept non-forced level-2 nodes
    (``n_rest`` of them, best first).

    A level's candidates (``candidates``, ``NX`` slots) are the children of the kept nodes above
    plus the non-forced causal children of the forced nodes above; forced nodes themselves are
    never carried, their indices follow from the tile's position. A level with at most ``W``
    candidates is not scored (all are kept).

    The top levels where that holds are not visited. Down to the first level with more
    than ``W`` candidates, every level's candidates are all its non-forced causal nodes: with
    ``a(x) = x // span`` (``span >= 2`` leaves a node), the forced nodes ``a(c0 - 1) .. a(c1)`` are
    the last causal ones and node 0, so the candidates are nodes ``1 .. a(c0 - 1) - 1``, in index
    order (the order an unscored level's top-W leaves them in)."""
    NX: tl.constexpr = 2 * GBP * WP
    n_rest = 0
    span = top_span  # leaves under a node of the level being ranked
    i0 = 0
    n_next = tl.maximum(tl.maximum(c0 - 1, 0) // span - 1, 0)  # candidates of level i0
    while (i0 < n_levels - 2) & (n_next <= W):
        n_rest = n_next
        i0 += 1
        span = span // G_BR
        n_next = tl.maximum(tl.maximum(c0 - 1, 0) // span - 1, 0)
    b_rest = tl.arange(0, WP) + 1
    for i in range(i0, n_levels - 2):
        lvl = n_levels - 1 - i
        o_x, m_x = candidates(b_rest, n_rest, c0, c1, span * G_BR, G_BR, GBP, WP)
        # Drop forced and future nodes (only children of forced nodes can be either).
        m_x = m_x & (o_x * span * C <= t_last) & (o_x != 0) \
            & (o_x != tl.maximum(c0 - 1, 0) // span) & (o_x != c0 // span) & (o_x != c1 // span)
        n_cand = tl.sum(m_x.to(tl.int32))
        # Unscored candidates rank by node index, which keeps all of them (n_cand <= W).
        b_s = tl.zeros([NX], dtype=tl.float32)
        if n_cand > W:
            lo = tl.load(p_off + lvl - 2)
            n_child = tl.load(p_off + lvl - 1) - lo
            if SCORER == 0 and G_BR == 2:
                b_sm = _pair_lse_scores(b_q, o_x, m_x, p_mh + lo.to(tl.int64) * s_mn, s_mn,
                                        p_counts + lo, n_child, scale, D, LO, F32_PREC)
            else:
                b_sm = _child_scores(b_q, o_x, m_x, p_mh + lo.to(tl.int64) * s_mn, s_mn,
                                     p_counts + lo, n_child, scale, G_BR, SCORER, DP, D, LO,
                                     F32_PREC)
            b_s = tl.sum(tl.where(m_row[None, :], b_sm, 0.), axis=1)  # [NX]
        # The W best (slots >= n_rest are dropped by candidates), best first.
        b_top = tl.topk(tl.where(m_x, pack(b_s, o_x), KEY_NONE), WP)
        b_rest = tl.where(b_top != KEY_NONE, unpack_idx(b_top), 0)
        n_rest = tl.minimum(n_cand, W)
        span = span // G_BR
    return b_rest, n_rest


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too
@triton.jit(do_not_specialize=["Tq", "Tk", "n_levels", "top_span", "n_par", "n_chunk",
                               "chunk"])
def _pyramid_walk_kernel(
        p_q, p_means, p_counts, p_off, p_key,
        Tq, Tk, n_levels, top_span, scale, n_par, n_chunk, chunk,
        s_qb: tl.int64, s_qt, s_qh, s_mb: tl.int64, s_mn, s_mh,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, C: tl.constexpr,
        G_BR: tl.constexpr, GBP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
        S: tl.constexpr, SCORER: tl.constexpr, LO: tl.constexpr, SLOT_NONE: tl.constexpr,
        F32_PREC: tl.constexpr):
    """The internal levels of query ``i_t``'s walk (``walk``); writes the level-2 parents of its
    leaf candidates into its ``S = WP + 3`` slots of ``p_key [B, Tq, HKV, S]``: the ``n_rest`` kept
    nodes, then the (up to 3) forced level-2 nodes that have a free child. A slot holds the sort key
    ``((b * HKV + h) * n_chunk + i_t // chunk) * n_par + parent``, or ``SLOT_NONE`` when empty."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    HKV = tl.num_programs(1)
    b_q, m_row = load_queries(p_q, i_b, i_h, i_t, Tq, s_qb, s_qt, s_qh, G, GP, 1, D, DP)
    t_abs = Tk - Tq + i_t
    cur = t_abs // C
    p_mh = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh
    b_rest, n_rest = walk(b_q, m_row, p_mh, s_mn, p_counts, p_off, n_levels, top_span, cur, cur,
                          t_abs, scale, C, G_BR, GBP, W, WP, SCORER, DP, D, LO, F32_PREC)

    base = ((i_b * HKV + i_h) * n_chunk + i_t // chunk).to(tl.int64) * n_par
    p_row = p_key + ((i_b * Tq + i_t) * HKV + i_h).to(tl.int64) * S
    o_w = tl.arange(0, WP)
    b_key = tl.where(o_w < n_rest, base + b_rest, SLOT_NONE)
    tl.store(p_row + o_w, b_key.to(p_key.dtype.element_ty))
    o_f = tl.arange(0, 4)
    par, new = forced_parents(o_f, cur, cur, G_BR)  # slot 3 repeats slot 2 (c1 == c0)
    b_key = tl.where(new & (par * G_BR <= cur - 2), base + par, SLOT_NONE)
    tl.store(p_row + WP + o_f, b_key.to(p_key.dtype.element_ty), mask=o_f < 3)


@triton.jit(do_not_specialize=["Tq", "Tk", "n_chunk", "n_par"])
def _leaf_groups_kernel(
        p_q, p_k, p_start, p_pair, p_score, Tq, Tk, HKV, n_chunk, n_par, scale,
        s_qb: tl.int64, s_qt, s_qh, s_kb: tl.int64, s_kt, s_kh,
        PB: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        C: tl.constexpr, CP: tl.constexpr, G_BR: tl.constexpr, GBP: tl.constexpr, S: tl.constexpr,
        SCORER: tl.constexpr, F32_PREC: tl.constexpr):
    """Exact scores of the leaves of level-2 node ``i_par`` of (batch, KV head) ``i_bh`` for the
    queries of chunk ``i_c`` that reached it: the pairs with sort key
    ``(i_bh * n_chunk + i_c) * n_par + i_par``, entries ``[start, end)`` of the sorted pair ids
    ``p_pair`` (``u * S + slot``, ``u = (b * Tq + t) * HKV + h``). Pair id ``x`` gets
    ``p_score[x, c]``, the group score of child ``c``.

    The node's ``G_BR * C`` keys are loaded once; its queries come ``PB`` at a time (``PB * G``
    gathered rows, 4 KB a query at G=16, D=128, 16-bit) against them in one dot."""
    i_par, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_key = (i_bh * n_chunk + i_c) * n_par + i_par
    start = tl.load(p_start + i_key)
    end = tl.load(p_start + i_key + 1)
    if start < end:
        i_b = i_bh // HKV
        i_h = (i_bh % HKV).to(tl.int64)
        o_c = tl.arange(0, GBP)
        o_leaf = i_par * G_BR + o_c
        # Leaves past the end (children of forced parents) are never free: skip their loads.
        m_leaf = (o_c < G_BR) & ((o_leaf + 1) * C <= Tk)
        b_k = leaf_keys(p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh, s_kt, o_leaf, m_leaf,
                        C, CP, DP, D)  # [GBP * CP, DP]
        o_g = tl.arange(0, GP)
        o_d = tl.arange(0, DP)
        p_qh = p_q + i_b.to(tl.int64) * s_qb + (i_h * G + o_g)[:, None] * s_qh + o_d[None, :]
        m_qh = (o_g < G)[:, None] & (o_d < D)[None, :]  # [GP, DP]
        for r0 in range(start, end, PB):
            o_r = r0 + tl.arange(0, PB)
            m_r = o_r < end
            b_pair = tl.load(p_pair + o_r, mask=m_r, other=0)
            b_t = (b_pair // S // HKV % Tq).to(tl.int64)
            b_q = tl.load(p_qh[None, :, :] + b_t[:, None, None] * s_qt,
                          mask=m_r[:, None, None] & m_qh[None, :, :], other=0.)  # [PB, GP, DP]
            m_row = tl.reshape(m_r[:, None] & (o_g < G)[None, :], [PB * GP])
            b_s = leaf_scores(tl.reshape(b_q, [PB * GP, DP]), m_row, b_k, scale, PB, GP, C, CP,
                              SCORER, F32_PREC)  # [PB, GBP]
            tl.store(p_score + b_pair[:, None] * GBP + o_c[None, :], b_s,
                     mask=m_r[:, None] & (o_c < G_BR)[None, :])


# the selection outputs' batch strides (Tq * HKV * slots) follow the length: not specialised
@triton.jit(do_not_specialize=["Tq", "Tk", "n_par", "s_ib", "s_cb"])
def _leaf_topk_kernel(
        p_key, p_score, p_idx, p_cnt, Tq, Tk, n_par,
        s_ib: tl.int64, s_it, s_ih, s_cb: tl.int64, s_ct,
        BT: tl.constexpr, C: tl.constexpr, G_BR: tl.constexpr, GBP: tl.constexpr,
        S: tl.constexpr, SPP: tl.constexpr, KS: tl.constexpr, TOPK: tl.constexpr,
        SLOTS: tl.constexpr, SP: tl.constexpr, IN_BUDGET: tl.constexpr,
        SLOT_NONE: tl.constexpr):
    """Each of the ``BT`` tokens of tile ``i_t`` keeps its best free leaves among the children of
    its ``S`` parent slots (scores from ``_leaf_groups_kernel``) and writes its row."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    HKV = tl.num_programs(1)
    t0 = i_t * BT
    o_bt = tl.arange(0, BT)
    m_tok = t0 + o_bt < Tq
    cur = (Tk - Tq + t0 + o_bt) // C
    o_s = tl.arange(0, SPP)
    o_c = tl.arange(0, GBP)
    b_pair = ((i_b * Tq + t0 + o_bt) * HKV + i_h).to(tl.int64)[:, None] * S + o_s[None, :]
    b_key = tl.load(p_key + b_pair, mask=m_tok[:, None] & (o_s < S)[None, :], other=SLOT_NONE)
    o_leaf = (b_key % n_par).to(tl.int32)[:, :, None] * G_BR + o_c[None, None, :]  # [BT, SPP, GBP]
    m_free = (b_key != SLOT_NONE)[:, :, None] & (o_c < G_BR)[None, None, :] & (o_leaf >= 1) \
        & (o_leaf <= cur[:, None, None] - 2)
    b_s = tl.load(p_score + b_pair[:, :, None] * GBP + o_c[None, None, :], mask=m_free, other=0.)
    b_x = tl.where(m_free, pack(b_s, o_leaf), KEY_NONE)
    b_top = tl.topk(tl.reshape(b_x, [BT, SPP * GBP]), KS)  # [BT, KS]
    b_row, count = selection_row(cur, b_top, TOPK, IN_BUDGET, SP)
    store_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, b_row, count, s_ib, s_it, s_ih, s_cb, s_ct,
                    SLOTS)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------

def check_pyramid(pyramid: Pyramid, k: torch.Tensor, cfg: SelectConfig) -> None:
    """A caller's prebuilt pyramid must be the fp32 pyramid of ``k`` in this geometry."""
    B, Tk, H, D = k.shape
    want = level_offsets(Tk, cfg.block_size, cfg.branching)
    if tuple(pyramid.offsets) != want:
        raise ValueError(f"pyramid offsets {pyramid.offsets} do not match k (T={Tk}, "
                         f"block_size={cfg.block_size}, branching={cfg.branching}): {want}")
    if tuple(pyramid.means.shape) != (B, want[-1], H, D) or pyramid.means.dtype != torch.float32:
        raise ValueError(f"pyramid.means must be fp32 [{B}, {want[-1]}, {H}, {D}] (the pyramid "
                         f"of k: T={Tk}, block_size={cfg.block_size}, branching={cfg.branching}), "
                         f"got {pyramid.means.dtype} {tuple(pyramid.means.shape)}")
    if pyramid.means.stride(-1) != 1 or pyramid.counts.stride(-1) != 1:
        raise ValueError("pyramid tensors must be contiguous in their last dim")
    if pyramid.means.device != k.device or pyramid.counts.device != k.device:
        raise ValueError("pyramid must live on k's device")


def _beam_geometry(cfg: SelectConfig, Tk: int) -> tuple[int, int, int]:
    """``(W, GBP, WP)``: the beam (at most the leaf count: no level has more candidates), the
    padded branching and the padded beam of the walk's register tiles."""
    n_leaves = cdiv(Tk, cfg.block_size)
    W = min(cfg.beam, n_leaves)
    GBP = pow2(cfg.branching)
    # GBP * WP slots hold the children of the 4 forced parents and >= 8 columns (x2) for tl.dot.
    WP = max(pow2(W), 4, cdiv(8, GBP))
    if 2 * GBP * WP > 1024:  # [NX, D] candidate tiles: wider ones spill and crawl
        raise ValueError(f"beam={cfg.beam} is too wide for the Triton pyramid kernel at "
                         f"branching={cfg.branching}: use beam <= {512 // GBP}, or beam >= the "
                         f"number of leaf blocks ({n_leaves}), which is the exact flat scan")
    return W, GBP, WP


def _split_means(pyramid: Pyramid, q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The means the walk reads ``[B, N, HKV, D]`` and the kernels' ``LO``: against 16-bit queries
    the fp32 means as their 16-bit head with its 16-bit residual ``LO = D`` elements on (two
    exact-product dots, ~16 mantissa bits, so near-equal nodes rank as in fp64), split once per
    call; fp32 queries read the fp32 means."""
    means = pyramid.means
    if q.dtype == torch.float32:
        return means, 0
    hi = means.to(q.dtype)
    lo = (means - hi.float()).to(q.dtype)
    return torch.stack([hi, lo], dim=3)[:, :, :, 0], means.shape[-1]  # [B, N, HKV, (2,) D]


def _launch_select(q, k, cfg: SelectConfig, pyramid: Pyramid, block_idx, counts):
    """Walk -> (query, level-2 parent) pair keys -> sort -> leaf scores per parent group ->
    per-token top-K. Extra memory: ~24 bytes per slot (keys, sorted keys, pair ids,
    scores), ``S = WP + 3`` slots per (token, KV head), plus 4 bytes per possible group."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C, g = HQ // HKV, cfg.block_size, cfg.branching
    W, GBP, WP = _beam_geometry(cfg, Tk)
    S = WP + 3
    n_levels = pyramid.n_levels
    n_par = pyramid.offsets[2] - pyramid.offsets[1]  # level-2 nodes
    # Sort keys (and group ids) must fit int32; the chunk count is a grid dimension (<= 65535).
    n_chunk = min(cdiv(Tq, LEAF_CHUNK), 65535, (2 ** 31 - 2) // (B * HKV * n_par))
    if n_chunk < 1:
        raise ValueError(f"Triton pyramid selection supports B * HKV * (level-2 nodes) < 2**31, "
                         f"got {B} * {HKV} * {n_par}")
    chunk = cdiv(Tq, n_chunk)
    n_chunk = cdiv(Tq, chunk)
    n_keys = B * HKV * n_chunk * n_par
    slot_none = torch.iinfo(torch.int32).max
    DP = max(16, pow2(D))
    means, LO = _split_means(pyramid, q)
    off = device_offsets(tuple(pyramid.offsets), q.device)

    keys = torch.empty(B, Tq, HKV, S, dtype=torch.int32, device=q.device)
    _pyramid_walk_kernel[(Tq, HKV, B)](
        q, means, pyramid.counts, off, keys, Tq, Tk, n_levels, g ** (n_levels - 2), cfg.scale,
        n_par, n_chunk, chunk, q.stride(0), q.stride(1), q.stride(2),
        means.stride(0), means.stride(1), means.stride(2),
        G=G, GP=max(pow2(G), 16), D=D, DP=DP, C=C, G_BR=g, GBP=GBP, W=W, WP=WP, S=S,
        SCORER=SCORER_ID[cfg.scorer], LO=LO, SLOT_NONE=slot_none, F32_PREC=F32_PRECISION,
        num_warps=4, num_stages=2)

    pairs, start = sort_by_key(keys.view(-1), n_keys)  # group i: pairs[start[i]:start[i + 1]]
    scores = torch.empty(keys.numel(), GBP, dtype=torch.float32, device=q.device)
    # Default: 128 query rows a dot, fewer when the [rows, g * C] fp32 accumulator would pass 16K
    # (128 registers a thread at 4 warps); 2 stages of gathered queries when they fit shared
    # memory beside the parent's keys (fp32 at g = 3 asked for 256 KB with 128 rows, 2 stages).
    CP = max(C, cdiv(16, GBP))
    PB = max(1, min(128, 16384 // (GBP * CP)) // pow2(G))
    GP = max(pow2(G), cdiv(16, PB))
    smem = (GBP * CP + 2 * PB * GP) * DP * k.element_size()
    _leaf_groups_kernel[(n_par, n_chunk, B * HKV)](
        q, k, start, pairs, scores, Tq, Tk, HKV, n_chunk, n_par, cfg.scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        PB=PB, G=G, GP=GP, D=D, DP=DP, C=C, CP=CP, G_BR=g, GBP=GBP, S=S,
        SCORER=SCORER_ID[cfg.scorer], F32_PREC=F32_PRECISION,
        num_warps=4, num_stages=2 if smem <= 160_000 else 1)

    BT = 16
    SPP = pow2(S)
    _leaf_topk_kernel[(cdiv(Tq, BT), HKV, B)](
        keys, scores, block_idx, counts, Tq, Tk, n_par,
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        counts.stride(0), counts.stride(1),
        BT=BT, C=C, G_BR=g, GBP=GBP, S=S, SPP=SPP, KS=min(SPP * GBP, pow2(cfg.topk)),
        TOPK=cfg.topk, SLOTS=cfg.slots, SP=pow2(cfg.slots), IN_BUDGET=cfg.forced_in_budget,
        SLOT_NONE=slot_none, num_warps=4)


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------

def select_pyramid_triton(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig,
                          pyramid: Pyramid) -> tuple[torch.Tensor, torch.Tensor]:
    """Pyramid selection per query token and KV head (``cfg.selector == "pyramid"``, a beam
    narrower than the leaf count).

    ``q [B, Tq, HQ, D]``, ``k [B, Tk, HKV, D]`` fp16/bf16/fp32 (queries are the last ``Tq``
    positions), ``pyramid`` the fp32 pyramid of ``k`` (``pisa.ops.pyramid``). Returns
    ``block_idx [B, Tq, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, Tq, HKV] int32``."""
    B, Tq, HQ, D = q.shape
    HKV = k.shape[2]
    block_idx = empty(B, Tq, HKV, cfg.slots, dtype=torch.int32, device=q.device)
    counts = empty(B, Tq, HKV, dtype=torch.int32, device=q.device)
    if B * Tq * HKV:
        _launch_select(q, k, cfg, pyramid, block_idx, counts)
    return block_idx, counts
