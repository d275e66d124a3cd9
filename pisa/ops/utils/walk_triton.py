"""The pyramid walk's ``@triton.jit`` primitives that the prefill selection
(``select.triton``, ``select.flat``) and the fused decode step (``decode.triton``) share: a level's
candidate nodes (the children of the kept and of the forced nodes above) and the exact scores of
leaf blocks from their keys."""
from __future__ import annotations

import triton
import triton.language as tl

from .op import dot_nt, key_scores, token_sums
from .triton_utils import F32_PREC


@triton.jit
def key_logits(b_q, b_ql, b_k, Q_RESID: tl.constexpr):
    """``[M, N]`` fp32: rows ``b_q [M, DP]`` (plus their residuals ``b_ql`` when ``Q_RESID``)
    dotted with keys ``b_k [N, DP]`` of their dtype."""
    b_z = dot_nt(b_q, b_k, F32_PREC)
    if Q_RESID:
        b_z += dot_nt(b_ql, b_k, F32_PREC)
    return b_z


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
def leaf_tile_scores(b_q, b_ql, m_row, b_k, scale, BT: tl.constexpr, GP: tl.constexpr,
                     C: tl.constexpr, CP: tl.constexpr, SCORER: tl.constexpr,
                     Q_RESID: tl.constexpr):
    """Scores ``[BT, L]`` of the leaves whose keys ``leaf_keys`` loaded into ``b_k [L * CP, DP]``,
    for the ``BT`` tokens of the query rows ``b_q [BT * GP, DP]`` (with their residuals ``b_ql``
    when ``Q_RESID``): one dot (two), then per block and row ``key_scores``, summed over each
    token's heads."""
    M: tl.constexpr = b_q.shape[0]
    L: tl.constexpr = b_k.shape[0] // CP
    o_c = tl.arange(0, CP)
    b_z = tl.reshape(key_logits(b_q, b_ql, b_k, Q_RESID) * scale, [M, L, CP])
    return token_sums(key_scores(b_z, (o_c < C)[None, None, :], C, SCORER), m_row, BT, GP)


@triton.jit
def leaf_scores(b_q, m_row, b_k, scale, BT: tl.constexpr, GP: tl.constexpr, C: tl.constexpr,
                CP: tl.constexpr, SCORER: tl.constexpr):
    """``leaf_tile_scores`` of rows without residuals."""
    return leaf_tile_scores(b_q, b_q, m_row, b_k, scale, BT, GP, C, CP, SCORER, False)


@triton.jit
def forced_parents(o_p, c0, c1, span, s0):
    """Forced nodes ``[a(s0), a(max(c0 - 1, s0)), a(c0), a(c1)]`` (``a(x) = x // span``; ``s0``
    the sink, the first block of the sequence: 0, or a packed sequence's) at slot ``o_p``, and
    whether the slot holds a node not already listed (the list is non-decreasing)."""
    a_sink = s0 // span
    a_prev = tl.maximum(c0 - 1, s0) // span
    a_cur = c0 // span
    a_last = c1 // span
    par = tl.where(o_p == 0, a_sink, tl.where(o_p == 1, a_prev, tl.where(o_p == 2, a_cur, a_last)))
    before = tl.where(o_p == 1, a_sink, tl.where(o_p == 2, a_prev, a_cur))
    return par, (o_p == 0) | (par != before)


@triton.jit
def candidates(b_rest, n_rest, c0, c1, span_up, s0, BRANCH: tl.constexpr, BRANCH_P: tl.constexpr,
               WP: tl.constexpr):
    """Candidate nodes ``[2 * BRANCH_P * WP]`` of a level and which slots hold one: the children
    of the kept nodes ``b_rest [WP]`` of the level above (``span_up`` leaves per node)
    interleaved with the children of that level's forced nodes (``forced_parents`` of the sink
    ``s0``, ``BRANCH_P`` slots each)."""
    NA: tl.constexpr = BRANCH_P * WP
    o_w = tl.arange(0, WP)
    o_c = tl.arange(0, BRANCH_P)
    o_a = tl.reshape(b_rest[None, :] * BRANCH + o_c[:, None], [NA])
    m_a = tl.reshape((o_w[None, :] < n_rest) & (o_c[:, None] < BRANCH), [NA])
    o_f = tl.arange(0, NA)
    par, m_par = forced_parents(o_f // BRANCH_P, c0, c1, span_up, s0)
    o_b = par * BRANCH + o_f % BRANCH_P
    m_b = m_par & (o_f < 4 * BRANCH_P) & (o_f % BRANCH_P < BRANCH)
    return tl.reshape(tl.join(o_a, o_b), [2 * NA]), tl.reshape(tl.join(m_a, m_b), [2 * NA])
