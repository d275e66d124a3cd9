"""Pyramid block selection (Triton): the walk down the pyramid and the exact leaf stage, per query
token or per query tile (``query_tile``, ``docs/spec.md`` §11).

Semantics are those of ``naive.naive_select`` (the oracle) and ``docs/spec.md`` §3-§4, §11; on
random inputs the selections equal the oracle's exactly. Three launches and a sort, whatever the
tile (``Qt = 1`` is per-token selection):

1. ``_pyramid_walk_kernel``, a program per (tile, KV head): the internal levels (``walk``). The
   beam lives in registers as the kept non-forced nodes of the level above; a level's candidates
   are their children plus the non-forced, causal children of the forced nodes, whose indices
   follow from the tile's block (forced nodes are never carried). The top levels whose
   candidates all fit the beam are not visited (their beam follows from the position). A level
   with more than its beam (``beam`` above level 2, ``beam_leaf`` at level 2) of candidates is
   scored with ``summaries @ rows^T`` (the 64 candidate rows fill a Hopper warpgroup MMA),
   16-bit head + residual summaries precomputed per call: the children's means, or for
   ``scorer="bound"`` their per-channel maxs and mins against the rows split by sign
   (``(s q)+ . max + (s q)- . min``, two products). Per (candidate, row) the children fold into
   a log-sum-exp (or weighted Welford mean / variance), the rows into per-token group scores
   (sum over heads), the tokens into the tile's score (``tile_reduce``: sum or log-sum-exp over
   its real tokens); ``tl.topk`` over packed keys keeps the beam. A tile's rows are its
   ``Qt * G`` query rows (token-major, heads padded to >= 16 rows a product), scored in chunks
   of ``WALK_ROWS`` rows when there are more; with ``tile_reduce="qmean"`` they are the ``G``
   per-head mean queries over the tile's real tokens, computed here in fp32 and written (16-bit
   head + residual rows against 16-bit keys) for the leaf stage. The kernel writes each tile's
   level-2 parents of its leaf candidates as sort keys (head, chunk of tiles, parent).
2. ``utils.csr.sort_by_key`` groups the (tile, parent) pairs by key.
3. ``_leaf_groups_kernel``, a program per group: loads the parent's ``g * C`` keys once and scores
   them against its tiles' rows, ``PB`` tiles (``PB * rows`` <= 128 rows) a dot or, for tiles of
   more rows, in chunks of tokens folded by ``tile_reduce``. No causal mask: every free leaf ends
   before the tile's block.
4. ``_leaf_topk_kernel`` picks each tile's best free leaves and writes its row.

Why two phases rather than one program walking and scoring its tile's leaves: a leaf-stage group
reads a parent's keys once for all the tiles of a chunk that reached it (about 150 tiles a parent
at 128K tokens, ``Qt = 16``), where a fused program would read ``(W2 + 3) * g * C`` keys per
tile from L2 (~0.6 MB a tile and KV head at ``W2 = 16``): with ``qmean`` rows (``G`` a tile) the
queries a pair moves (8 KB at G=16, D=128, head + residual) are a quarter of the keys it would
read. With ``sum`` / ``lse`` rows (``Qt * G`` a tile) a pair moves ``Qt * G * D`` query elements,
more than the parent's keys; those reductions are FLOP-bound anyway (the leaf products cost as
much as the attention).

The walk's primitives that the fused decode kernel (``pisa.ops.decode.triton``) shares live in
``utils.walk_triton`` (``candidates``, ``forced_parents``, ``leaf_keys``, ``leaf_scores``);
``rows_at``, ``mean_rows``, ``split_rows`` and ``tile_token_scores`` serve the flat scan
(``select.flat``) too.

Limits: ``W <= 512 / next_pow2(g)`` (``W`` the beam above level 2, capped at the leaf count, or
at the level-3 node count where it would not fit: ``beam_geometry``; beams that cover every
block are the flat scan, ``select.flat``); any ``beam_leaf``; any ``g >= 2`` (non-powers of two
pad to the next one); any ``D <= 256`` and ``G``. Registers grow with
``next_pow2(g) * next_pow2(W) * D`` (the default g=2, W=16, D=128 fits; compiled for sm_90a at the
default ``qmean`` tiles the walk takes 255 registers a thread and spills 168 bytes at G = 16, 70 at
G = 4 and 7; the leaf stage 208, the ``mass`` leaf kernel 168-225, neither spills:
``benchmarks/checks/kernel_regs.py``, ``docs/selection_v3.md``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..pyramid import Pyramid
from ..utils.config import SelectConfig, mass_row_tokens, n_query_tiles
from ..utils.csr import sort_by_key
from ..utils.geometry import cdiv, level_offsets, pow2
from ..utils.launch import SelectLaunch
from ..utils.op import (KEY_NONE, LN2_K, LOG2E_K, device_offsets, dot_nt, empty, key_scores,
                        pack, unpack_idx, write_selection)
from ..utils.triton_utils import (F32_PREC, SELECT_STAGE_SMEM, SLOT_NONE,
                                  pick_of, strides_of)
from ..utils.walk_triton import (candidates, forced_parents, key_logits, leaf_keys,
                                 leaf_tile_scores)

SCORER_ID = {"lse": 0, "mean": 1, "meanvar": 2}
# Tile reductions in the kernels: a sum or a log-sum-exp over the tile's tokens ("qmean" tiles
# hold one virtual token, so their reduction is the sum of one).
REDUCE_ID = {"sum": 0, "lse": 1, "qmean": 0, "mass": 0}
# Query rows the walk scores in one product: a tile with more (Qt * G > 64, sum / lse) is scored
# in chunks of whole tokens, each level's [candidates, rows] fp32 tiles staying ~32 registers a
# thread at 4 warps.
WALK_ROWS = 64


class Rows(NamedTuple):
    """A tile's query rows in the walk and the leaf stage (one ``tl.constexpr``). Row
    ``i * GP + h`` of a chunk is head ``h`` of its ``i``-th token; a tile's rows come ``TB``
    tokens a product, in ``NCH`` chunks."""

    QT: int      # query positions a tile (1: per-token selection)
    G: int       # query heads per KV head
    GP: int      # rows a token: G padded (so that a product has >= 16 rows)
    TB: int      # tokens a product
    NCH: int     # products a tile (chunks of TB tokens)
    D: int       # head dim
    DP: int      # D padded to a power of two >= 16
    RESID: int   # element offset of the rows' 16-bit residuals (0: none)
    MEAN: bool   # qmean tiles: the rows are the tile's G per-head mean queries
    REDUCE: int  # how a tile's tokens fold: 0 sum, 1 log-sum-exp (REDUCE_ID)


class Tree(NamedTuple):
    """The walk's geometry: block size, branching and beams, and their register widths."""

    C: int          # keys a leaf block
    BRANCH: int     # children a node (the pyramid's ``g``)
    BRANCH_P: int   # BRANCH padded to a power of two
    W: int          # beam above level 2
    W2: int         # beam at level 2 (``beam_leaf``)
    WP: int         # register width of a level's kept nodes above level 2 (>= W)
    W2P: int        # register width of level 2's kept nodes (>= W2)
    PAR_SLOTS: int  # level-2 parent slots a tile writes: W2P kept + 3 forced
    PAR_SLOTS_P: int  # PAR_SLOTS padded to a power of two


class Scoring(NamedTuple):
    """How the walk scores a candidate from its children's summaries."""

    SCORER: int      # 0 lse, 1 mean, 2 meanvar (SCORER_ID; the bound scorer ranks by lse)
    BOUND: bool      # the summaries are per-node key maxs then mins (``scorer="bound"``)
    MIN_OFFSET: int  # BOUND: element offset of a node's mins from its maxs
    SUM_RESID: int   # element offset of the summaries' 16-bit residuals (0: none)


# ------------------------------------------------------------------------------------------------
# Query rows (shared with the flat scan)
# ------------------------------------------------------------------------------------------------

@triton.jit
def rows_at(p_rh, s_r, o_tok, o_head, m_row, D: tl.constexpr, DP: tl.constexpr,
            RESID: tl.constexpr):
    """Query rows ``[R, DP]``: row ``r`` is token ``o_tok[r]``, head ``o_head[r]`` (from ``p_rh``,
    a group's first head, token and head strides ``s_r``; 64-bit offsets), zeros outside
    ``m_row`` and past ``D``; and the rows' 16-bit residuals ``RESID`` elements on when
    ``RESID > 0`` (else the rows again)."""
    s_rt, s_rh = s_r
    o_d = tl.arange(0, DP)
    p = p_rh + o_tok.to(tl.int64)[:, None] * s_rt + o_head.to(tl.int64)[:, None] * s_rh \
        + o_d[None, :]
    m = m_row[:, None] & (o_d < D)[None, :]
    b_q = tl.load(p, mask=m, other=0.)
    b_ql = b_q
    if RESID > 0:
        b_ql = tl.load(p + RESID, mask=m, other=0.)
    return b_q, b_ql


@triton.jit
def tile_rows(p_rh, s_r, r_lo, r_hi, ROWS: tl.constexpr):
    """The rows ``[TB * GP, DP]`` of tokens ``r_lo .. r_lo + TB`` (row ``i * GP + h``: head ``h`` of
    token ``r_lo + i``; tokens from ``r_hi`` on and heads from ``G`` on are zero), their residuals
    (``rows_at``) and which rows are real."""
    o_m = tl.arange(0, ROWS.TB * ROWS.GP)
    o_t = r_lo + o_m // ROWS.GP
    o_h = o_m % ROWS.GP
    m_row = (o_h < ROWS.G) & (o_t < r_hi)
    b_q, b_ql = rows_at(p_rh, s_r, o_t, o_h, m_row, ROWS.D, ROWS.DP, ROWS.RESID)
    return b_q, b_ql, m_row


@triton.jit
def mean_rows(p_rh, s_r, o_tok0, o_head, m_row, Tq, QT: tl.constexpr, D: tl.constexpr,
              DP: tl.constexpr, p_ok, MASKED: tl.constexpr):
    """``[R, DP]`` fp32: per row ``r`` the mean of head ``o_head[r]`` over the real query tokens
    (``[0, Tq)``; with ``MASKED`` those where ``p_ok [Tq]`` is set) among ``o_tok0[r] ..
    o_tok0[r] + QT`` (a tile's positions; zero rows outside ``m_row``)."""
    R: tl.constexpr = o_tok0.shape[0]
    b_acc = tl.zeros([R, DP], dtype=tl.float32)
    b_n = tl.zeros([R], dtype=tl.float32)
    for t in range(0, QT):
        o_t = o_tok0 + t
        m_t = m_row & (o_t >= 0) & (o_t < Tq)
        if MASKED:
            m_t = m_t & (tl.load(p_ok + o_t, mask=m_t, other=0) != 0)
        b_x, _ = rows_at(p_rh, s_r, o_t, o_head, m_t, D, DP, 0)
        b_acc += b_x.to(tl.float32)
        b_n += m_t.to(tl.float32)
    return b_acc / tl.maximum(b_n, 1.)[:, None]


@triton.jit
def split_rows(b_x, DTYPE: tl.constexpr):
    """fp32 rows as ``DTYPE`` rows and their ``DTYPE`` residuals: against 16-bit keys two
    exact-product dots (~16 mantissa bits of the rows) instead of one rounding (fp32: the rows
    and zeros, the residuals unused)."""
    b_hi = b_x.to(DTYPE)
    b_lo = (b_x - b_hi.to(tl.float32)).to(DTYPE)
    return b_hi, b_lo


@triton.jit
def logaddexp(b_a, b_b):
    """``log(exp(a) + exp(b))`` elementwise, ``-inf`` when both are."""
    b_m = tl.maximum(b_a, b_b)
    b_sh = tl.where(b_m == float("-inf"), 0., b_m)
    return b_sh + tl.log(tl.exp(b_a - b_sh) + tl.exp(b_b - b_sh))


@triton.jit
def fold_tokens(b_x, m_tok, AXIS: tl.constexpr, REDUCE: tl.constexpr):
    """A tile's score from its tokens' group scores ``b_x`` along ``AXIS``: their sum
    (``REDUCE == 0``) or log-sum-exp (1) over the real tokens ``m_tok`` (broadcast against
    ``b_x``; -inf when there are none, for log-sum-exp)."""
    if REDUCE == 0:
        b_s = tl.sum(tl.where(m_tok, b_x, 0.), axis=AXIS)
    else:
        b_x = tl.where(m_tok, b_x, float("-inf"))
        b_m = tl.max(b_x, axis=AXIS)
        b_sh = tl.where(b_m == float("-inf"), 0., b_m)
        b_s = b_sh + tl.log(tl.sum(tl.exp(b_x - tl.expand_dims(b_sh, AXIS)), axis=AXIS))
    return b_s


@triton.jit
def fold_chunks(b_acc, b_x, REDUCE: tl.constexpr):
    """Two partial tile scores (``fold_tokens`` of disjoint token chunks) as one."""
    if REDUCE == 0:
        b_s = b_acc + b_x
    else:
        b_s = logaddexp(b_acc, b_x)
    return b_s


@triton.jit
def token_mask(m_row, NT: tl.constexpr, GP: tl.constexpr):
    """``[NT]``: which of the ``NT`` tokens of rows ``m_row [NT * GP]`` (token-major) has a real
    row."""
    return tl.max(tl.reshape(m_row.to(tl.int32), [NT, GP]), axis=1) > 0


@triton.jit
def tile_token_scores(b_tok, m_row, NT: tl.constexpr, QR: tl.constexpr, GP: tl.constexpr,
                      REDUCE: tl.constexpr):
    """Per-token group scores ``b_tok [NT * QR, N]`` (``NT`` tiles of ``QR`` row tokens, rows
    ``m_row [NT * QR * GP]``) as ``[NT, N]`` tile scores (``fold_tokens``). ``QR == 1``: the scores
    themselves, -inf for a token without rows under log-sum-exp."""
    N: tl.constexpr = b_tok.shape[1]
    m_tok = token_mask(m_row, NT * QR, GP)
    if QR == 1:
        b_s = b_tok
        if REDUCE == 1:
            b_s = tl.where(m_tok[:, None], b_s, float("-inf"))
    else:
        b_s = fold_tokens(tl.reshape(b_tok, [NT, QR, N]),
                          tl.reshape(m_tok, [NT, QR])[:, :, None], 1, REDUCE)
    return b_s


# ------------------------------------------------------------------------------------------------
# Node scores and the walk
# ------------------------------------------------------------------------------------------------


@triton.jit
def _summary_dot(p, m_p, b_q, b_ql, SUM_RESID: tl.constexpr, Q_RESID: tl.constexpr):
    """``[N, M]``: the node summaries at ``p [N, DP]`` (16-bit heads, their residuals
    ``SUM_RESID`` elements on when ``SUM_RESID > 0``) dotted with the rows ``b_q [M, DP]`` (and
    their residuals ``b_ql`` when ``Q_RESID``; the product of two residuals, ~2**-16 of either,
    is left out)."""
    b_x = tl.load(p, mask=m_p, other=0.)
    b_z = dot_nt(b_x, b_q, F32_PREC)
    if SUM_RESID > 0:
        b_z += dot_nt(tl.load(p + SUM_RESID, mask=m_p, other=0.), b_q, F32_PREC)
    if Q_RESID:
        b_z += dot_nt(b_x, b_ql, F32_PREC)
    return b_z


@triton.jit
def _child_z(b_sq, p, m_c, m_d, scale, SCORE: tl.constexpr, Q_RESID: tl.constexpr):
    """Scaled logits ``[N, M]`` of one child per node (summaries at ``p``, nodes ``m_c``, dims
    ``m_d``) for the signed rows ``b_sq`` (``_sign_rows``): ``scale * mean . q``; ``BOUND``:
    ``scale * (q_a . max + q_b . min)`` (maxs at ``p``, mins ``MIN_OFFSET`` elements on), the
    largest ``scale * q . k`` over the keys of the child's box."""
    b_qa, b_qal, b_qb, b_qbl = b_sq
    m_p = m_c[:, None] & m_d[None, :]
    b_z = _summary_dot(p, m_p, b_qa, b_qal, SCORE.SUM_RESID, Q_RESID)
    if SCORE.BOUND:
        b_z += _summary_dot(p + SCORE.MIN_OFFSET, m_p, b_qb, b_qbl, SCORE.SUM_RESID, Q_RESID)
    return b_z * scale


@triton.jit
def _sign_rows(b_q, b_ql, scale, BOUND: tl.constexpr):
    """The signed rows ``(q_a, q_a residual, q_b, q_b residual)``: for ``BOUND`` the rows'
    elements where ``scale * q > 0`` and the others (the sign of a head and residual pair is the
    head's: the residual is below half its last bit), so ``scale * (q_a . max + q_b . min)`` is
    ``sum_d max(s q_d min_d, s q_d max_d)``; otherwise the rows (and residuals) twice."""
    if BOUND:
        m_pos = b_q.to(tl.float32) * scale > 0
        b_0 = tl.zeros_like(b_q)
        b_qa = tl.where(m_pos, b_q, b_0)
        b_qal = tl.where(m_pos, b_ql, b_0)
        b_qb = tl.where(m_pos, b_0, b_q)
        b_qbl = tl.where(m_pos, b_0, b_ql)
    else:
        b_qa = b_q
        b_qal = b_ql
        b_qb = b_q
        b_qbl = b_ql
    return b_qa, b_qal, b_qb, b_qbl


@triton.jit
def _child_scores(b_sq, o_node, m_node, child, scale, CHILDREN: tl.constexpr, DP: tl.constexpr,
                  D: tl.constexpr, SCORE: tl.constexpr, Q_RESID: tl.constexpr):
    """Scores ``[N, M]`` of nodes ``o_node [N]`` for the signed query rows ``b_sq``
    (``_sign_rows``) from their ``CHILDREN`` children's logits (``_child_z``; ``child`` =
    ``(p_child, s_cn, p_ccount, n_child)``: summaries at rows ``o_node * CHILDREN + c`` of
    ``p_child``, ``s_cn`` apart, their key counts and how many children the level has) weighted
    by the children's counts, with the ``N`` candidates as the dots' rows.

    lse: ``log sum_c n_c exp(z_c)`` (online, max-shift added back); mean / meanvar: count-weighted
    Welford mean and variance of ``z_c``. A child past ``n_child`` has count 0 and no weight.
    """
    p_child, s_cn, p_ccount, n_child = child
    o_d = tl.arange(0, DP)
    M: tl.constexpr = b_sq[0].shape[0]
    N: tl.constexpr = o_node.shape[0]
    b_a = tl.full([N, M], float("-inf"), dtype=tl.float32)  # lse: running max; else: mean
    b_b = tl.zeros_like(b_a)  # lse: running sum; else: running M2
    b_w = tl.zeros([N], dtype=tl.float32)  # total count so far (mean / meanvar)
    if SCORE.SCORER != 0:
        b_a = tl.zeros_like(b_a)
    for c in range(0, CHILDREN):  # a runtime loop: one child tile live at a time
        o_c = o_node * CHILDREN + c
        m_c = m_node & (o_c < n_child)
        p = p_child + o_c.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        b_z = _child_z(b_sq, p, m_c, o_d < D, scale, SCORE, Q_RESID)  # [N, M]
        b_n = tl.load(p_ccount + o_c, mask=m_c, other=0).to(tl.float32)
        if SCORE.SCORER == 0:
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
    if SCORE.SCORER == 0:
        b_s = b_a + tl.log(tl.maximum(b_b, 1.))  # >= 1 for a node with a child: exp(max - max)
    elif SCORE.SCORER == 1:
        b_s = b_a
    else:
        b_s = b_a + 0.5 * b_b / tl.maximum(b_w, 1.)[:, None]
    return b_s


@triton.jit
def _pair_lse_scores(b_sq, o_node, m_node, child, scale, D: tl.constexpr, SCORE: tl.constexpr,
                     Q_RESID: tl.constexpr):
    """``_child_scores`` for the lse scorer and two children, in closed form:
    ``log(n_0 e^z_0 + n_1 e^z_1) = hi + log(1 + e^(lo - hi))`` with ``hi, lo`` the larger and
    smaller of ``z_c + log n_c`` (one exp2 and one log2 per score instead of the online update's
    four exps and a libdevice log). Returns ``[N, M]``."""
    p_child, s_cn, p_ccount, n_child = child
    DP: tl.constexpr = b_sq[0].shape[1]
    o_d = tl.arange(0, DP)
    o_c = o_node * 2
    m_c0 = m_node & (o_c < n_child)
    m_c1 = m_node & (o_c + 1 < n_child)
    p = p_child + o_c.to(tl.int64)[:, None] * s_cn + o_d[None, :]
    b_x0 = _child_logits(b_sq, p, m_c0, o_d < D, p_ccount + o_c, scale, SCORE, Q_RESID)
    b_x1 = _child_logits(b_sq, p + s_cn, m_c1, o_d < D, p_ccount + o_c + 1, scale, SCORE,
                         Q_RESID)
    b_hi = tl.maximum(b_x0, b_x1)
    b_d = tl.minimum(b_x0, b_x1) - tl.where(b_hi > float("-inf"), b_hi, 0.)  # no child: -inf
    return b_hi + tl.log2(1. + tl.exp2(b_d * LOG2E_K)) * LN2_K


@triton.jit
def _child_logits(b_sq, p, m_c, m_d, p_n, scale, SCORE: tl.constexpr, Q_RESID: tl.constexpr):
    """``[N, M]``: ``_child_z + log n_c`` of one child per node, ``-inf`` for a missing child."""
    b_z = _child_z(b_sq, p, m_c, m_d, scale, SCORE, Q_RESID)
    b_n = tl.load(p_n, mask=m_c, other=0).to(tl.float32)
    return tl.where(b_n[:, None] > 0, b_z + tl.log(tl.maximum(b_n, 1.))[:, None],
                    float("-inf"))


@triton.jit
def _chunk_node_scores(b_q, b_ql, m_row, o_x, m_x, child, scale, ROWS: tl.constexpr,
                       TREE: tl.constexpr, SCORE: tl.constexpr):
    """``[NX]``: the candidates' scores for one chunk of a tile's rows (``TB`` tokens of ``GP``
    rows): per (candidate, row) from the children (``child`` as in ``_child_scores``), summed
    over each token's real heads, folded over the chunk's real tokens (``fold_tokens``)."""
    TB: tl.constexpr = ROWS.TB
    GP: tl.constexpr = ROWS.GP
    b_sq = _sign_rows(b_q, b_ql, scale, SCORE.BOUND)
    if SCORE.SCORER == 0 and TREE.BRANCH == 2:
        b_sm = _pair_lse_scores(b_sq, o_x, m_x, child, scale, ROWS.D, SCORE, ROWS.RESID > 0)
    else:
        b_sm = _child_scores(b_sq, o_x, m_x, child, scale, TREE.BRANCH, ROWS.DP, ROWS.D, SCORE,
                             ROWS.RESID > 0)
    if TB == 1:  # one token: the sum over its heads (log-sum-exp: -inf without a real row)
        b_s = tl.sum(tl.where(m_row[None, :], b_sm, 0.), axis=1)  # [NX]
        if ROWS.REDUCE == 1:
            b_s = tl.where(tl.max(m_row.to(tl.int32), axis=0) > 0, b_s, float("-inf"))
    else:
        NX: tl.constexpr = b_sm.shape[0]
        b_tok = tl.sum(tl.reshape(tl.where(m_row[None, :], b_sm, 0.), [NX, TB, GP]), axis=2)
        b_s = fold_tokens(b_tok, token_mask(m_row, TB, GP)[None, :], 1, ROWS.REDUCE)
    return b_s


@triton.jit
def _level_scores(o_x, m_x, lvl, rows, pyr, scale, ROWS: tl.constexpr, TREE: tl.constexpr,
                  SCORE: tl.constexpr):
    """Tile scores ``[NX]`` of the candidates ``o_x`` of level ``lvl`` from their children's
    summaries (level ``lvl - 1``; ``pyr`` as in ``walk``): one chunk of rows (``NCH == 1``: the
    loaded ``b_q`` of ``rows``) or ``NCH`` chunks of ``TB`` tokens loaded in turn (``tile_rows``
    of ``r_lo .. r_hi``) and folded."""
    b_q, b_ql, m_row, p_rh, s_r, r_lo, r_hi = rows
    p_mh, s_mn, p_counts, p_off = pyr
    lo = tl.load(p_off + lvl - 2)
    n_child = tl.load(p_off + lvl - 1) - lo
    child = (p_mh + lo.to(tl.int64) * s_mn, s_mn, p_counts + lo, n_child)
    if ROWS.NCH == 1:
        b_s = _chunk_node_scores(b_q, b_ql, m_row, o_x, m_x, child, scale, ROWS, TREE, SCORE)
    else:
        b_s = tl.zeros(o_x.shape, dtype=tl.float32)
        if ROWS.REDUCE == 1:
            b_s = tl.full(o_x.shape, float("-inf"), dtype=tl.float32)
        for c in range(0, ROWS.NCH):
            b_qc, b_qlc, m_rc = tile_rows(p_rh, s_r, r_lo + c * ROWS.TB, r_hi, ROWS)
            b_sc = _chunk_node_scores(b_qc, b_qlc, m_rc, o_x, m_x, child, scale, ROWS, TREE,
                                      SCORE)
            b_s = fold_chunks(b_s, b_sc, ROWS.REDUCE)
    return b_s


@triton.jit
def _walk_level(b_rest, n_rest, lvl, span, beam, tile, rows, pyr, scale, WOUT: tl.constexpr,
                ROWS: tl.constexpr, TREE: tl.constexpr, SCORE: tl.constexpr):
    """One level ``lvl`` (``span`` leaves a node) of the walk: its candidates (``candidates`` of the
    ``n_rest`` kept nodes ``b_rest [WP]`` above), free ones only (causal, inside the sequence
    that starts at leaf ``s0``, not forced), and the ``beam`` best of them, best first, in
    ``[WOUT]`` (``WOUT >= min(beam, candidates)``); all of them, unscored and in index order, when
    they are at most ``beam``. Returns them and their count. ``tile``, ``rows``, ``pyr`` as in
    ``walk``."""
    c0, c1, t_last, s0 = tile
    C: tl.constexpr = TREE.C
    NX: tl.constexpr = 2 * TREE.BRANCH_P * TREE.WP
    o_x, m_x = candidates(b_rest, n_rest, c0, c1, span * TREE.BRANCH, s0, TREE.BRANCH,
                          TREE.BRANCH_P, TREE.WP)
    # Drop forced and future nodes, and those before the sequence (only children of forced nodes
    # can be any of them).
    m_x = m_x & (o_x * span * C <= t_last) & ((o_x + 1) * span > s0) & (o_x != s0 // span) \
        & (o_x != tl.maximum(c0 - 1, s0) // span) & (o_x != c0 // span) & (o_x != c1 // span)
    n_cand = tl.sum(m_x.to(tl.int32))
    # Unscored candidates rank by node index, which keeps all of them (n_cand <= beam).
    b_s = tl.zeros([NX], dtype=tl.float32)
    if n_cand > beam:
        b_s = _level_scores(o_x, m_x, lvl, rows, pyr, scale, ROWS, TREE, SCORE)
    # The best (slots >= the count are dropped by candidates at the next level), best first.
    b_top = tl.topk(tl.where(m_x, pack(b_s, o_x), KEY_NONE), WOUT)
    return tl.where(b_top != KEY_NONE, unpack_idx(b_top), 0), tl.minimum(n_cand, beam)


@triton.jit
def walk(rows, pyr, n_levels, top_span, tile, scale, ROWS: tl.constexpr, TREE: tl.constexpr,
         SCORE: tl.constexpr):
    """The internal levels of the walk, from the root's children down to level 2, for a tile whose
    tokens lie in leaves ``c0..c1`` (``tile = (c0, c1, t_last, s0)``: ``t_last`` its last
    position, ``s0`` the first leaf of its sequence: 0; in a packed layout its sequence's: nodes
    before it are never candidates, its ancestors are forced as the sink's). Its query rows
    ``rows = (b_q, b_ql, m_row, p_rh, s_r, r_lo, r_hi)``: ``b_q`` (residuals ``b_ql``, real rows
    ``m_row``) when they are one chunk (``NCH == 1``), else the ``NCH`` chunks of ``TB`` tokens of
    ``tile_rows(p_rh, s_r, r_lo + c * TB, r_hi)`` loaded at each scored level. The pyramid
    ``pyr = (p_mh, s_mn, p_counts, p_off)``: this (batch, KV head)'s summaries (``_child_z``),
    their node stride, the node key counts and the level offsets. Returns ``b_rest [W2P]``, the
    kept non-forced level-2 nodes (``n_rest`` of them, best first).

    A level's candidates (``_walk_level``) are the children of the kept nodes above plus the
    non-forced causal children of the forced nodes above; forced nodes themselves are never
    carried, their indices follow from the tile's position. Levels above 2 keep ``W``, level 2
    keeps ``W2`` (``beam_leaf``); a level with at most that many candidates is not scored.

    The top levels where that holds are not visited. Down to the first level with more
    than its beam of candidates, every level's candidates are all its non-forced causal nodes:
    with ``a(x) = x // span`` (``span >= 2`` leaves a node), the forced nodes ``a(c0 - 1) ..
    a(c1)`` are the last causal ones and ``a(s0)`` the first, so the candidates are nodes
    ``a(s0) + 1 .. a(c0 - 1) - 1``, in index order (the order an unscored level's top-W leaves
    them in)."""
    c0, c1, t_last, s0 = tile
    n_rest = tl.full([], 0, dtype=tl.int32)
    span = top_span  # leaves under a node of the level being ranked
    i0 = 0  # the level being looked at is n_levels - 1 - i0
    # candidates of level i0
    n_next = tl.maximum(tl.maximum(c0 - 1, s0) // span - s0 // span - 1, 0)
    while (i0 < n_levels - 2) & (n_next <= tl.where(n_levels - 1 - i0 == 2, TREE.W2, TREE.W)):
        n_rest = n_next
        i0 += 1
        span = span // TREE.BRANCH
        n_next = tl.maximum(tl.maximum(c0 - 1, s0) // span - s0 // span - 1, 0)
    first = s0 // (span * TREE.BRANCH) + 1  # the first free node of the level above
    b_rest = tl.arange(0, TREE.WP) + first
    for i in range(i0, n_levels - 3):  # the ranked levels above level 2
        b_rest, n_rest = _walk_level(b_rest, n_rest, n_levels - 1 - i, span, TREE.W, tile, rows,
                                     pyr, scale, TREE.WP, ROWS, TREE, SCORE)
        span = span // TREE.BRANCH
    if i0 < n_levels - 2:  # level 2 is visited
        b_out, n_out = _walk_level(b_rest, n_rest, 2, span, TREE.W2, tile, rows, pyr, scale,
                                   TREE.W2P, ROWS, TREE, SCORE)
    else:  # skipped: all its free nodes, first .. first + n_rest - 1
        b_out = tl.arange(0, TREE.W2P) + first
        n_out = n_rest
    return b_out, n_out


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def tile_span(i_t, tile0, Tq, Tk, QT: tl.constexpr, C: tl.constexpr):
    """Tile ``i_t`` of a selection (absolute tile ``tile0 + i_t``, ``QT`` positions): its first
    position (any one has the same block, hence the same causality and forced blocks), its block
    and its query tokens ``[q_lo, q_hi)`` (query indices: queries are the last ``Tq`` of ``Tk``
    positions). ``QT = 1``: the query token ``i_t`` itself."""
    pos = (tile0 + i_t) * QT
    q_lo = tl.maximum(pos - (Tk - Tq), 0)
    q_hi = tl.minimum(pos + QT - (Tk - Tq), Tq)
    return pos, pos // C, q_lo, q_hi


@triton.jit
def sequence_start(p_blk0, cur, m, VARLEN: tl.constexpr):
    """The sink (first block of the sequence) of rows in blocks ``cur`` (``m``: the real rows),
    and which rows hold queries: block 0 and all without ``VARLEN``; in a packed layout
    (``VARLEN``) ``p_blk0[cur]``, whose ``-1`` (a block without queries) reads as a sequence
    starting at ``cur`` (no free block: a trivial walk) and no queries."""
    s0 = cur * 0
    m_q = m
    if VARLEN:
        s0 = tl.load(p_blk0 + cur, mask=m, other=-1)
        m_q = m & (s0 >= 0)
        s0 = tl.where(s0 >= 0, s0, cur)
    return s0, m_q


# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too
@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles", "tile0", "n_levels", "top_span", "n_par",
                               "n_chunk", "chunk"])
def _pyramid_walk_kernel(
        p_q, p_rows, p_summary, p_counts, p_off, p_key, p_blk0, p_qok,
        Tq, Tk, n_tiles, tile0, n_levels, top_span, scale, n_par, n_chunk, chunk,
        s_qb: tl.int64, s_q, s_rb: tl.int64, s_r, s_mb: tl.int64, s_m,
        ROWS: tl.constexpr, TREE: tl.constexpr, SCORE: tl.constexpr, VARLEN: tl.constexpr,
        MASKED: tl.constexpr, KEEP_ROWS: tl.constexpr):
    """The internal levels of tile ``i_t``'s walk (``walk``); writes the level-2 parents of its
    leaf candidates into its ``PAR_SLOTS = W2P + 3`` slots of ``p_key [B, n_tiles, HKV,
    PAR_SLOTS]``: the ``n_rest`` kept nodes, then the (up to 3) forced level-2 nodes that have a
    free child. A slot holds the sort key ``((b * HKV + h) * n_chunk + i_t // chunk) * n_par +
    parent``, or ``SLOT_NONE`` when empty. ``p_summary [B, N_total, HKV, (1, 2 or 4), D]``: the
    node summaries the walk ranks by (``_walk_summaries``), node and head strides ``s_m``.

    The tile's rows: its query tokens' (``p_rows`` is ``p_q``) or, with ``MEAN``, its ``G`` mean
    queries, which this program computes from ``p_q`` and, with ``KEEP_ROWS``, writes to
    ``p_rows [B, n_tiles, HQ, (2,) D]`` (16-bit head, then the residual ``RESID`` elements on)
    for the leaf stage.
    ``VARLEN``: a packed layout, ``p_blk0`` the sink of each block (``sequence_start``);
    ``MASKED``: the mean is over the positions ``p_qok`` marks (``tile_reduce="mass"`` in a
    packed layout, whose row holds zeros between sequences' queries)."""
    G: tl.constexpr = ROWS.G
    GP: tl.constexpr = ROWS.GP
    BRANCH: tl.constexpr = TREE.BRANCH
    W2P: tl.constexpr = TREE.W2P
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    HKV = tl.num_programs(1)
    pos, cur, q_lo, q_hi = tile_span(i_t, tile0, Tq, Tk, ROWS.QT, TREE.C)
    s0, _ = sequence_start(p_blk0, cur, cur >= 0, VARLEN)
    s_rt, s_rh = s_r
    p_rh = p_rows + i_b.to(tl.int64) * s_rb + (i_h * G) * s_rh
    if ROWS.MEAN:
        o_h = tl.arange(0, GP)
        m_row = o_h < G
        s_qt, s_qh = s_q
        p_qh = p_q + i_b.to(tl.int64) * s_qb + (i_h * G) * s_qh
        b_mean = mean_rows(p_qh, s_q, tl.zeros([GP], dtype=tl.int32) + (pos - (Tk - Tq)), o_h,
                           m_row, Tq, ROWS.QT, ROWS.D, ROWS.DP, p_qok, MASKED)
        b_q, b_ql = split_rows(b_mean, p_rows.dtype.element_ty)
        if KEEP_ROWS:  # the qmean leaf stage reads them; the mass kernel reads tokens
            o_d = tl.arange(0, ROWS.DP)
            p_st = p_rh + i_t.to(tl.int64) * s_rt + o_h.to(tl.int64)[:, None] * s_rh \
                + o_d[None, :]
            m_st = m_row[:, None] & (o_d < ROWS.D)[None, :]
            tl.store(p_st, b_q, mask=m_st)
            if ROWS.RESID > 0:
                tl.store(p_st + ROWS.RESID, b_ql, mask=m_st)
        r_lo = i_t
        r_hi = i_t + 1
    else:
        r_lo = q_lo
        r_hi = q_hi
        b_q, b_ql, m_row = tile_rows(p_rh, s_r, r_lo, r_hi, ROWS)
    s_mn, s_mh = s_m
    p_mh = p_summary + i_b.to(tl.int64) * s_mb + i_h * s_mh
    b_rest, n_rest = walk((b_q, b_ql, m_row, p_rh, s_r, r_lo, r_hi), (p_mh, s_mn, p_counts, p_off),
                          n_levels, top_span, (cur, cur, pos, s0), scale, ROWS, TREE, SCORE)

    base = ((i_b * HKV + i_h) * n_chunk + i_t // chunk).to(tl.int64) * n_par
    p_row = p_key + ((i_b * n_tiles + i_t) * HKV + i_h).to(tl.int64) * TREE.PAR_SLOTS
    o_w = tl.arange(0, W2P)
    b_key = tl.where(o_w < n_rest, base + b_rest, SLOT_NONE)
    tl.store(p_row + o_w, b_key.to(p_key.dtype.element_ty))
    o_f = tl.arange(0, 4)
    par, new = forced_parents(o_f, cur, cur, BRANCH, s0)  # slot 3 repeats slot 2 (c1 == c0)
    # a parent with a free child: its children meet the free blocks [s0 + 1, cur - 2]
    m_free = (tl.maximum(par * BRANCH, s0 + 1) <= tl.minimum(par * BRANCH + BRANCH - 1, cur - 2))
    b_key = tl.where(new & m_free, base + par, SLOT_NONE)
    tl.store(p_row + W2P + o_f, b_key.to(p_key.dtype.element_ty), mask=o_f < 3)


@triton.jit
def _pair_chunk_scores(p_rh, s_r, b_lo, b_hi, m_head, o_mt, o_mh, c, b_k, scale,
                       PB: tl.constexpr, CP: tl.constexpr, SCORER: tl.constexpr,
                       ROWS: tl.constexpr, C: tl.constexpr):
    """``[PB, L]``: the leaf scores of chunk ``c`` (``TB`` tokens) of ``PB`` pairs' rows (per row
    its pair's tokens ``[b_lo, b_hi)``, head ``o_mh``, chunk token ``o_mt``), folded over the
    chunk's real tokens."""
    o_t = b_lo + c * ROWS.TB + o_mt
    m_row = m_head & (o_t < b_hi)
    b_q, b_ql = rows_at(p_rh, s_r, o_t, o_mh, m_row, ROWS.D, ROWS.DP, ROWS.RESID)
    b_tok = leaf_tile_scores(b_q, b_ql, m_row, b_k, scale, PB * ROWS.TB, ROWS.GP, C, CP, SCORER,
                             ROWS.RESID > 0)  # [PB * TB, L]
    return tile_token_scores(b_tok, m_row, PB, ROWS.TB, ROWS.GP, ROWS.REDUCE)


@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles", "tile0", "n_chunk", "n_par"])
def _leaf_groups_kernel(
        p_rows, p_k, p_start, p_pair, p_score, Tq, Tk, n_tiles, tile0, HKV, n_chunk, n_par, scale,
        s_rb: tl.int64, s_r, s_kb: tl.int64, s_k,
        PB: tl.constexpr, CP: tl.constexpr, SCORER: tl.constexpr, ROWS: tl.constexpr,
        TREE: tl.constexpr):
    """Exact scores of the leaves of level-2 node ``i_par`` of (batch, KV head) ``i_bh`` for the
    tiles of chunk ``i_c`` that reached it: the pairs with sort key
    ``(i_bh * n_chunk + i_c) * n_par + i_par``, entries ``[start, end)`` of the sorted pair ids
    ``p_pair`` (``u * PAR_SLOTS + slot``, ``u = (b * n_tiles + t) * HKV + h``). Pair id ``x`` gets
    ``p_score[x, c]``, the tile score of child ``c`` (``SCORER``).

    The node's ``BRANCH * C`` keys are loaded once (``CP`` rows a leaf); its tiles come ``PB`` at
    a time against them in one dot: a tile's query tokens (``TB`` a dot, ``NCH`` dots folded by
    ``REDUCE`` when it has more; ``p_rows`` is the queries) or, with ``MEAN``, its mean-query row
    of ``p_rows [B, n_tiles, HQ, (2,) D]`` (``G`` rows a tile, 16-bit head + residual: 8 KB at
    G=16, D=128)."""
    C: tl.constexpr = TREE.C
    BRANCH_P: tl.constexpr = TREE.BRANCH_P
    TB: tl.constexpr = ROWS.TB
    GP: tl.constexpr = ROWS.GP
    i_par, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_key = (i_bh * n_chunk + i_c) * n_par + i_par
    start = tl.load(p_start + i_key)
    end = tl.load(p_start + i_key + 1)
    if start < end:
        i_b = i_bh // HKV
        i_h = (i_bh % HKV).to(tl.int64)
        o_c = tl.arange(0, BRANCH_P)
        o_leaf = i_par * TREE.BRANCH + o_c
        # Leaves past the end (children of forced parents) are never free: skip their loads.
        m_leaf = (o_c < TREE.BRANCH) & ((o_leaf + 1) * C <= Tk)
        s_kt, s_kh = s_k
        b_k = leaf_keys(p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh, s_kt, o_leaf, m_leaf,
                        C, CP, ROWS.DP, ROWS.D)  # [BRANCH_P * CP, DP]
        s_rt, s_rh = s_r
        p_rh = p_rows + i_b.to(tl.int64) * s_rb + (i_h * ROWS.G) * s_rh
        o_m = tl.arange(0, PB * TB * GP)  # row: (pair, chunk token, head)
        o_mp = o_m // (TB * GP)
        o_mt = (o_m // GP) % TB
        o_mh = o_m % GP
        for r0 in range(start, end, PB):
            o_r = r0 + tl.arange(0, PB)
            m_r = o_r < end
            b_pair = tl.load(p_pair + o_r, mask=m_r, other=0)
            m_rp = r0 + o_mp < end  # per row: its pair's id and tile
            b_tile = (tl.load(p_pair + r0 + o_mp, mask=m_rp, other=0) // TREE.PAR_SLOTS // HKV
                      % n_tiles).to(tl.int32)
            if ROWS.MEAN:
                b_lo = b_tile
                b_hi = b_tile + 1
            else:
                _, _, b_lo, b_hi = tile_span(b_tile, tile0, Tq, Tk, ROWS.QT, C)
            m_head = m_rp & (o_mh < ROWS.G)
            if ROWS.NCH == 1:
                b_s = _pair_chunk_scores(p_rh, s_r, b_lo, b_hi, m_head, o_mt, o_mh, 0, b_k, scale,
                                         PB, CP, SCORER, ROWS, C)  # [PB, BRANCH_P]
            else:
                b_s = tl.zeros([PB, BRANCH_P], dtype=tl.float32)
                if ROWS.REDUCE == 1:
                    b_s = tl.full([PB, BRANCH_P], float("-inf"), dtype=tl.float32)
                for c in range(0, ROWS.NCH):
                    b_s = fold_chunks(b_s, _pair_chunk_scores(
                        p_rh, s_r, b_lo, b_hi, m_head, o_mt, o_mh, c, b_k, scale, PB, CP, SCORER,
                        ROWS, C), ROWS.REDUCE)
            tl.store(p_score + b_pair[:, None] * BRANCH_P + o_c[None, :], b_s,
                     mask=m_r[:, None] & (o_c < TREE.BRANCH)[None, :])


@triton.jit
def slot_leaves(b_key, n_par, s0, cur, BRANCH: tl.constexpr, BRANCH_P: tl.constexpr):
    """The leaves ``[BT, PAR_SLOTS_P, BRANCH_P]`` under the parent slots ``b_key [BT, PAR_SLOTS_P]``
    (the walk's sort keys) and which are free for rows in blocks ``cur [BT]`` of sequences from
    ``s0 [BT]``: real children in ``[s0 + 1, cur - 2]``."""
    o_c = tl.arange(0, BRANCH_P)
    o_leaf = (b_key % n_par).to(tl.int32)[:, :, None] * BRANCH + o_c[None, None, :]
    m_free = (b_key != SLOT_NONE)[:, :, None] & (o_c < BRANCH)[None, None, :] \
        & (o_leaf >= s0[:, None, None] + 1) & (o_leaf <= cur[:, None, None] - 2)
    return o_leaf, m_free


# the selection outputs' batch strides (n_tiles * HKV * slots) follow the length: not specialised
@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles", "tile0", "n_par", "s_ib", "s_cb"])
def _leaf_topk_kernel(
        p_key, p_score, p_idx, p_cnt, p_blk0, Tq, Tk, n_tiles, tile0, n_par,
        s_ib: tl.int64, s_i, s_cb: tl.int64, s_ct,
        BT: tl.constexpr, QT: tl.constexpr, TOP_P: tl.constexpr, TREE: tl.constexpr,
        PICK: tl.constexpr, VARLEN: tl.constexpr):
    """Each of the ``BT`` selection rows (tiles) ``i_t * BT ..`` keeps its best free leaves (the
    best ``TOP_P`` keys) among the children of its ``PAR_SLOTS`` parent slots (scores from
    ``_leaf_groups_kernel``) and writes its row (``PICK``; ``VARLEN``: rows in blocks without
    queries are empty: ``-1``, count 0)."""
    C: tl.constexpr = TREE.C
    BRANCH: tl.constexpr = TREE.BRANCH
    BRANCH_P: tl.constexpr = TREE.BRANCH_P
    PAR_SLOTS: tl.constexpr = TREE.PAR_SLOTS
    PAR_SLOTS_P: tl.constexpr = TREE.PAR_SLOTS_P
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    HKV = tl.num_programs(1)
    t0 = i_t * BT
    o_bt = tl.arange(0, BT)
    m_tok = t0 + o_bt < n_tiles
    cur = ((tile0 + t0 + o_bt) * QT) // C
    s0, m_q = sequence_start(p_blk0, cur, m_tok, VARLEN)
    o_s = tl.arange(0, PAR_SLOTS_P)
    o_c = tl.arange(0, BRANCH_P)
    b_pair = ((i_b * n_tiles + t0 + o_bt) * HKV + i_h).to(tl.int64)[:, None] * PAR_SLOTS \
        + o_s[None, :]
    b_key = tl.load(p_key + b_pair, mask=m_tok[:, None] & (o_s < PAR_SLOTS)[None, :],
                    other=SLOT_NONE)
    o_leaf, m_free = slot_leaves(b_key, n_par, s0, cur, BRANCH, BRANCH_P)
    b_s = tl.load(p_score + b_pair[:, :, None] * BRANCH_P + o_c[None, None, :], mask=m_free,
                  other=0.)
    b_x = tl.where(m_free, pack(b_s, o_leaf), KEY_NONE)
    b_top = tl.topk(tl.reshape(b_x, [BT, PAR_SLOTS_P * BRANCH_P]), TOP_P)  # [BT, TOP_P]
    write_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, m_q, cur, s0, b_top, s_ib, s_i, s_cb, s_ct,
                    PICK)


@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles", "tile0", "n_par", "s_ib", "s_cb"])
def _leaf_mass_kernel(
        p_q, p_k, p_key, p_idx, p_cnt, p_blk0, p_qok, Tq, Tk, n_tiles, tile0, n_par, scale,
        s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_ib: tl.int64, s_i, s_cb: tl.int64, s_ct,
        NT: tl.constexpr, CP: tl.constexpr, TOP_P: tl.constexpr, ROWS: tl.constexpr,
        TREE: tl.constexpr, PICK: tl.constexpr, VARLEN: tl.constexpr):
    """``tile_reduce="mass"``: tile ``i_t`` ranks the free children of its ``PAR_SLOTS`` parent
    slots (``p_key``, from the walk) by the sum over its rows of each row's softmax share of a leaf
    among them, and writes its row. The rows are ``NT`` tokens (``mass_tokens`` of its real ones)
    times ``GP`` heads: one ``[NT * GP, BRANCH_P * CP]`` product a parent, the rows' exact leaf
    LSEs kept in registers ``[NT * GP, PAR_SLOTS_P, BRANCH_P]`` until every parent is scored.

    A program reads its own parents' keys (``(W2 + 3) * g * C`` keys, from L2 for neighbouring
    tiles), not a group's: the shares need every candidate of the row before any sum.
    ``VARLEN``: a packed layout (``Tq == Tk``): the sink ``p_blk0`` of each block
    (``sequence_start``) and the positions holding queries ``p_qok``, contiguous in a tile."""
    C: tl.constexpr = TREE.C
    BRANCH: tl.constexpr = TREE.BRANCH
    BRANCH_P: tl.constexpr = TREE.BRANCH_P
    PAR_SLOTS: tl.constexpr = TREE.PAR_SLOTS
    PAR_SLOTS_P: tl.constexpr = TREE.PAR_SLOTS_P
    GP: tl.constexpr = ROWS.GP
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    HKV = tl.num_programs(1)
    pos, cur, q_lo, q_hi = tile_span(i_t, tile0, Tq, Tk, ROWS.QT, C)
    cur1 = tl.full([1], 0, tl.int32) + cur  # one selection row
    s01, m_q = sequence_start(p_blk0, cur1, cur1 >= 0, VARLEN)
    s0 = tl.max(s01, axis=0)
    n_real = q_hi - q_lo
    if VARLEN:  # the tile's queries: the run of positions p_qok marks
        o_p = pos + tl.arange(0, ROWS.QT)
        m_p = tl.load(p_qok + o_p) != 0
        n_real = tl.sum(m_p.to(tl.int32), axis=0)
        q_lo = tl.min(tl.where(m_p, o_p, pos + ROWS.QT), axis=0)
    # rows: token q_lo + j * n_real // n of the n <= NT spread over the tile's real ones
    n = tl.minimum(n_real, NT)
    o_m = tl.arange(0, NT * GP)
    o_j = o_m // GP
    o_mh = o_m % GP
    m_row = (o_j < n) & (o_mh < ROWS.G)
    s_qt, s_qh = s_q
    p_qh = p_q + i_b.to(tl.int64) * s_qb + (i_h * ROWS.G) * s_qh
    b_q, _ = rows_at(p_qh, s_q, q_lo + o_j * n_real // tl.maximum(n, 1), o_mh, m_row, ROWS.D,
                     ROWS.DP, 0)  # [NT * GP, DP]
    s_kt, s_kh = s_k
    p_kh = p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh
    p_row = p_key + ((i_b * n_tiles + i_t) * HKV + i_h).to(tl.int64) * PAR_SLOTS
    o_s = tl.arange(0, PAR_SLOTS_P)
    o_c = tl.arange(0, BRANCH_P)
    o_cp = tl.arange(0, CP)
    b_lse = tl.full([NT * GP, PAR_SLOTS_P, BRANCH_P], float("-inf"), dtype=tl.float32)
    # no branch on empty slots (their keys are masked out): the loop pipelines its key loads
    for i_s in range(0, PAR_SLOTS):
        key = tl.load(p_row + i_s)
        o_leaf = (key % n_par).to(tl.int32) * BRANCH + o_c
        m_leaf = (key != SLOT_NONE) & (o_c < BRANCH) & (o_leaf >= s0 + 1) & (o_leaf <= cur - 2)
        b_k = leaf_keys(p_kh, s_kt, o_leaf, m_leaf, C, CP, ROWS.DP, ROWS.D)
        b_z = tl.reshape(key_logits(b_q, b_q, b_k, False) * scale, [NT * GP, BRANCH_P, CP])
        b_s = key_scores(b_z, (o_cp < C)[None, None, :], C, 0)  # [rows, BRANCH_P] LSE
        b_s = tl.where(m_leaf[None, :], b_s, float("-inf"))
        b_lse = tl.where((o_s == i_s)[None, :, None], b_s[:, None, :], b_lse)
    # per row: its share of each candidate (exp(lse - logsumexp over the candidates)), summed
    b_max = tl.max(tl.max(b_lse, axis=2), axis=1)
    b_sh = tl.where(b_max == float("-inf"), 0., b_max)
    b_p = tl.exp(b_lse - b_sh[:, None, None])
    b_norm = tl.sum(tl.sum(b_p, axis=2), axis=1)
    b_p = tl.where(m_row[:, None, None], b_p / tl.maximum(b_norm, 1e-30)[:, None, None], 0.)
    b_score = tl.sum(b_p, axis=0)  # [PAR_SLOTS_P, BRANCH_P]
    b_key = tl.load(p_row + o_s[None, :], mask=(o_s < PAR_SLOTS)[None, :], other=SLOT_NONE)
    o_leaf, m_free = slot_leaves(b_key, n_par, s01, cur1, BRANCH, BRANCH_P)
    b_x = tl.where(m_free, pack(b_score[None, :, :], o_leaf), KEY_NONE)
    b_top = tl.topk(tl.reshape(b_x, [1, PAR_SLOTS_P * BRANCH_P]), TOP_P)  # [1, TOP_P]
    write_selection(p_idx, p_cnt, i_b, i_h, i_t, cur1 >= 0, m_q, cur1, s01, b_top,
                    s_ib, s_i, s_cb, s_ct, PICK)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------

def check_pyramid(pyramid: Pyramid, k: torch.Tensor, cfg: SelectConfig) -> None:
    """A caller's prebuilt pyramid must be the fp32 pyramid of ``k`` in this geometry (its bounds
    too, when it has them)."""
    B, Tk, H, D = k.shape
    want = level_offsets(Tk, cfg.block_size, cfg.branching)
    if tuple(pyramid.offsets) != want:
        raise ValueError(f"pyramid offsets {pyramid.offsets} do not match k (T={Tk}, "
                         f"block_size={cfg.block_size}, branching={cfg.branching}): {want}")
    for name in ("means", "mins", "maxs"):
        x = getattr(pyramid, name)
        if x is None and name != "means":
            continue
        if tuple(x.shape) != (B, want[-1], H, D) or x.dtype != torch.float32:
            raise ValueError(f"pyramid.{name} must be fp32 [{B}, {want[-1]}, {H}, {D}] (the "
                             f"pyramid of k: T={Tk}, block_size={cfg.block_size}, branching="
                             f"{cfg.branching}), got {x.dtype} {tuple(x.shape)}")
        if x.stride(-1) != 1:
            raise ValueError("pyramid tensors must be contiguous in their last dim")
        if x.device != k.device:
            raise ValueError("pyramid must live on k's device")
    if pyramid.counts.stride(-1) != 1:
        raise ValueError("pyramid tensors must be contiguous in their last dim")
    if pyramid.counts.device != k.device:
        raise ValueError("pyramid must live on k's device")


def beam_geometry(cfg: SelectConfig, n_keys: int):
    """``(W, W2, BRANCH_P, WP, W2P)``: the beams above level 2 and at level 2 (at most the leaf
    count, as ``W`` was before ``beam_leaf``: a length changes them only below ``beam`` leaves;
    and at most the level-3 node count where ``W`` would not fit the kernel: no level above 2 has
    more candidates, so neither cap changes a selection), the padded branching, the padded beam
    of the walk's register tiles and the width of the level-2 beam (at most the
    ``2 * BRANCH_P * WP`` candidates a level holds). A ``ValueError`` for a beam too wide for the
    kernel."""
    offsets = level_offsets(n_keys, cfg.block_size, cfg.branching)
    n_leaves = offsets[1]
    BRANCH_P = pow2(cfg.branching)
    W = min(cfg.beam, n_leaves)
    # BRANCH_P * WP slots hold the children of the 4 forced parents and >= 8 columns (x2) for
    # tl.dot.
    WP = max(pow2(W), 4, cdiv(8, BRANCH_P))
    if 2 * BRANCH_P * WP > 1024:  # [NX, D] candidate tiles: wider ones spill and crawl
        W = min(W, offsets[3] - offsets[2] if len(offsets) > 3 else 1)
        WP = max(pow2(W), 4, cdiv(8, BRANCH_P))
    if 2 * BRANCH_P * WP > 1024:
        raise ValueError(f"beam={cfg.beam} is too wide for the Triton pyramid kernel at "
                         f"branching={cfg.branching}: use beam <= {512 // BRANCH_P}, or beam and "
                         f"beam_leaf >= the number of leaf blocks ({n_leaves}), which is the "
                         f"exact flat scan")
    W2 = min(cfg.beam_at(2), n_leaves)
    W2P = max(4, min(pow2(W2), 2 * BRANCH_P * WP))
    return W, W2, BRANCH_P, WP, W2P


def _walk_summaries(pyramid: Pyramid, q: torch.Tensor, bound: bool, residuals: bool = True):
    """The node summaries the walk reads ``[B, N, HKV, (1, 2 or 4), D]`` and the kernels'
    ``Scoring.SUM_RESID`` and ``MIN_OFFSET`` (element offsets of the residuals and of the mins):
    the means, or for the bound scorer the maxs then the mins. Against 16-bit queries the fp32
    summaries as their 16-bit head with its 16-bit residual ``SUM_RESID = D`` elements on (two
    exact-product dots, ~16 mantissa bits, so near-equal nodes rank as in fp64), split once per
    call, or (``residuals=False``) the heads alone; fp32 queries read fp32 summaries."""
    D = pyramid.means.shape[-1]
    parts = [pyramid.maxs, pyramid.mins] if bound else [pyramid.means]
    if q.dtype == torch.float32 or not residuals:
        if not bound:
            return pyramid.means.to(q.dtype), 0, 0
        # [B, N, HKV, (max, min), D]
        return torch.stack([x.to(q.dtype) for x in parts], dim=3)[:, :, :, 0], 0, D
    split = []
    for x in parts:
        hi = x.to(q.dtype)
        split += [hi, (x - hi.float()).to(q.dtype)]
    # [B, N, HKV, (2 or 4), D]: (head, residual) of the means, or of the maxs then the mins
    return torch.stack(split, dim=3)[:, :, :, 0], D, 2 * D


_LAUNCH = SelectLaunch()  # the defaults (``launch=None``); tests swap it for one test


def _launch_select(q, k, cfg: SelectConfig, pyramid: Pyramid, block_idx, counts, blk0, q_ok,
                   launch: SelectLaunch):
    """Walk -> (tile, level-2 parent) pair keys -> sort -> leaf scores per parent group ->
    per-tile top-K, with the launch knobs ``launch``. Extra memory: ~24 bytes per slot (keys,
    sorted keys, pair ids, scores), ``PAR_SLOTS = W2P + 3`` slots per (tile, KV head), plus 4
    bytes per possible group, plus for ``qmean`` tiles their mean queries
    ``[B, n_tiles, HQ, (2,) D]``."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C, branching, Qt = HQ // HKV, cfg.block_size, cfg.branching, cfg.query_tile
    n_tiles, tile0 = block_idx.shape[1], (Tk - Tq) // Qt
    bound = cfg.scorer == "bound"
    mass = cfg.tile_reduce == "mass"
    mean = Qt > 1 and cfg.tile_reduce in ("qmean", "mass")  # mass walks by the mean query
    # query tokens a tile's rows hold: one for tokens and qmean tiles (their mean query)
    row_tokens = 1 if mean else Qt
    reduce_id = REDUCE_ID[cfg.tile_reduce] if row_tokens > 1 else 0
    W, W2, BRANCH_P, WP, W2P = beam_geometry(cfg, Tk)
    par_slots = W2P + 3
    tree = Tree(C, branching, BRANCH_P, W, W2, WP, W2P, par_slots, pow2(par_slots))
    n_levels = pyramid.n_levels
    n_par = pyramid.offsets[2] - pyramid.offsets[1]  # level-2 nodes
    # Sort keys (and group ids) must fit int32; the chunk count is a grid dimension (<= 65535).
    n_chunk = min(cdiv(n_tiles, max(1, launch.leaf_chunk // row_tokens)), 65535,
                  (2 ** 31 - 2) // (B * HKV * n_par))
    if n_chunk < 1:
        raise ValueError(f"Triton pyramid selection supports B * HKV * (level-2 nodes) < 2**31, "
                         f"got {B} * {HKV} * {n_par}")
    chunk = cdiv(n_tiles, n_chunk)
    n_chunk = cdiv(n_tiles, chunk)
    n_keys = B * HKV * n_chunk * n_par
    DP = max(16, pow2(D))
    summaries, sum_resid, min_offset = _walk_summaries(pyramid, q, bound, launch.residuals)
    score = Scoring(SCORER_ID["lse" if bound else cfg.scorer], bound, min_offset, sum_resid)
    off = device_offsets(tuple(pyramid.offsets), q.device)
    rows, row_resid = q, 0
    if mean:  # the walk's mean rows, 16-bit head + residual; written for the qmean leaf stage
        parts = 1 if q.dtype == torch.float32 or not launch.residuals else 2
        row_resid = D if parts == 2 else 0
        if not mass:  # (the mass kernel reads the tokens themselves: nothing written)
            rows = torch.empty(B, n_tiles, HQ, parts, D, dtype=q.dtype, device=q.device)

    # Walk rows: a tile's tokens in chunks of <= WALK_ROWS rows (heads padded to >= 16 rows).
    TB = max(1, min(row_tokens, WALK_ROWS // pow2(G)))
    walk_rows = Rows(Qt, G, max(pow2(G), cdiv(16, TB)), TB, cdiv(row_tokens, TB), D, DP,
                     row_resid, mean, reduce_id)
    # One child's summary tiles of a level (heads, residuals; maxs and mins): a pipelined loop
    # over children (g != 2 or mean / meanvar) holds 2 stages of them in shared memory, which the
    # bound's four [128, 128] tiles at g = 3, 4 would overflow (279 KB, compiled for sm_90).
    child_bytes = (2 * BRANCH_P * WP * DP * summaries.element_size() * (2 if sum_resid else 1)
                   * (2 if bound else 1))
    keys = torch.empty(B, n_tiles, HKV, par_slots, dtype=torch.int32, device=q.device)
    varlen = blk0 is not None
    blk0 = blk0 if varlen else counts  # unread without VARLEN
    stages = launch.walk_stages if launch.walk_stages * child_bytes <= SELECT_STAGE_SMEM else 1
    masked = mass and varlen  # a packed layout's mass tiles: their own queries (q_ok)
    if masked and q_ok is None:
        raise ValueError("tile_reduce='mass' in a packed layout needs q_ok, the positions that "
                         "hold queries")
    q_ok = q_ok.to(torch.int8) if masked else blk0  # unread without MASKED
    _pyramid_walk_kernel[(n_tiles, HKV, B)](
        q, rows, summaries, pyramid.counts, off, keys, blk0, q_ok, Tq, Tk, n_tiles, tile0,
        n_levels, branching ** (n_levels - 2), cfg.scale, n_par, n_chunk, chunk,
        *strides_of(q), *strides_of(rows), *strides_of(summaries), walk_rows, tree, score, varlen,
        masked, mean and not mass, num_warps=launch.walk_warps, num_stages=stages)

    top_p = min(tree.PAR_SLOTS_P * BRANCH_P, pow2(cfg.topk))
    if mass:
        GP = max(pow2(G), cdiv(16, mass_row_tokens(Qt, G)))
        rows_of = Rows(Qt, G, GP, 1, 1, D, DP, 0, False, 0)
        _leaf_mass_kernel[(n_tiles, HKV, B)](
            q, k, keys, block_idx, counts, blk0, q_ok, Tq, Tk, n_tiles, tile0, n_par, cfg.scale,
            *strides_of(q), *strides_of(k), *strides_of(block_idx), counts.stride(0),
            counts.stride(1), mass_row_tokens(Qt, G), max(C, cdiv(16, BRANCH_P)), top_p,
            rows_of, tree, pick_of(cfg), varlen, num_warps=launch.leaf_warps,
            num_stages=launch.leaf_stages)
        return
    pairs, start = sort_by_key(keys.view(-1), n_keys)  # group i: pairs[start[i]:start[i + 1]]
    scores = torch.empty(keys.numel(), BRANCH_P, dtype=torch.float32, device=q.device)
    # Default: 128 query rows a dot, fewer when the [rows, g * C] fp32 accumulator would pass 16K
    # (128 registers a thread at 4 warps): PB tiles of TB tokens, a tile of more tokens in NCH
    # dots; 2 stages of gathered queries when they fit shared memory beside the parent's keys
    # (fp32 at g = 3 asked for 256 KB with 128 rows, 2 stages).
    CP = max(C, cdiv(16, BRANCH_P))
    rows_max = min(launch.leaf_rows, 16384 // (BRANCH_P * CP))
    if row_tokens * pow2(G) <= rows_max:
        TB, PB = row_tokens, max(1, rows_max // (row_tokens * pow2(G)))
    else:
        TB, PB = max(1, rows_max // pow2(G)), 1
    GP = max(pow2(G), cdiv(16, PB * TB))
    leaf_rows = Rows(Qt, G, GP, TB, cdiv(row_tokens, TB), D, DP, row_resid, mean, reduce_id)
    smem = (BRANCH_P * CP + launch.leaf_stages * PB * TB * GP * (2 if row_resid else 1)) * DP \
        * k.element_size()
    _leaf_groups_kernel[(n_par, n_chunk, B * HKV)](
        rows, k, start, pairs, scores, Tq, Tk, n_tiles, tile0, HKV, n_chunk, n_par, cfg.scale,
        *strides_of(rows), *strides_of(k), PB, CP, SCORER_ID[cfg.leaf_scorer], leaf_rows, tree,
        num_warps=launch.leaf_warps,
        num_stages=launch.leaf_stages if smem <= SELECT_STAGE_SMEM else 1)

    BT = 16
    _leaf_topk_kernel[(cdiv(n_tiles, BT), HKV, B)](
        keys, scores, block_idx, counts, blk0, Tq, Tk, n_tiles, tile0, n_par,
        *strides_of(block_idx), counts.stride(0), counts.stride(1),
        BT, Qt, top_p, tree, pick_of(cfg), varlen,
        num_warps=launch.topk_warps)


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------

def select_pyramid_triton(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig, pyramid: Pyramid,
                          blk0: torch.Tensor | None = None, q_ok: torch.Tensor | None = None, *,
                          launch: SelectLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pyramid selection per query tile (``cfg.query_tile`` tokens, one by default) and KV head
    (``cfg.selector == "pyramid"``, beams narrower than the leaf count).

    ``q [B, Tq, HQ, D]``, ``k [B, Tk, HKV, D]`` fp16/bf16/fp32 (queries are the last ``Tq``
    positions), ``pyramid`` the fp32 pyramid of ``k`` (``pisa.ops.pyramid``; built with bounds
    for ``scorer="bound"``). Returns ``block_idx [B, n_tiles, HKV, cfg.slots] int32`` (ascending,
    ``-1`` padded) and ``counts [B, n_tiles, HKV] int32``, ``n_tiles = n_query_tiles(Tq, Tk,
    cfg.query_tile)`` (``Tq`` for per-token selection). ``blk0 [cdiv(Tk, C)]`` int32, for a packed
    layout of sequences (``B = 1``, ``pisa.ops.utils.varlen``): each block's sink, the first block of
    its sequence, ``-1`` for a block without queries (its rows are left empty), and ``q_ok
    [Tq]`` bool, which positions hold queries (``tile_reduce="mass"``: a tile averages and scores
    its own). ``launch``: the kernels' launch knobs (``utils.launch.SelectLaunch``; default: the
    tuned ones)."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    if cfg.scorer == "bound" and pyramid.mins is None:
        raise ValueError("scorer='bound' needs a pyramid built with bounds=True (per-node key "
                         "mins and maxs)")
    n_tiles = n_query_tiles(Tq, Tk, cfg.query_tile)
    block_idx = empty(B, n_tiles, HKV, cfg.slots, dtype=torch.int32, device=q.device)
    counts = empty(B, n_tiles, HKV, dtype=torch.int32, device=q.device)
    if B * n_tiles * HKV:
        _launch_select(q, k, cfg, pyramid, block_idx, counts, blk0, q_ok, launch or _LAUNCH)
    return block_idx, counts
