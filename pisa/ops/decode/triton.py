"""Triton decode step: pyramid walk on the cache's key sums, exact leaf ranking and sparse
attention over the selected blocks, for a batch of sequences of different lengths.

Semantics are those of ``torch_backend.decode_torch``: the query of sequence ``b`` sits at position
``t = cache_seqlens[b] - 1`` (its own key already appended) and the result equals row ``t`` of
prefill (``pisa_select`` + sparse attention) over the sequence's first ``t + 1`` keys.

Design
------
Two launches per step (three with several splits), each over the grid ``(B, HKV, SPLITS)``:
``_walk_kernel`` walks and ranks leaves, ``_attend_kernel`` merges the leaf ranking, forms the
selection and attends over its split's share, ``_combine_kernel`` merges the splits. Each program
loads the ``G`` query heads of its GQA group as the rows of its tiles (padded to ``GP``) and, from
``cache_seqlens[b]`` read on the device, walks the pyramid of the cache (the geometry of
``T_max``: its level count and row offsets are fixed by the cache shape; above the sequence's own
root only node 0 is active, forced, so the walk equals prefill's):

- internal levels, root to level 2: a level's free nodes (causal and not forced) never get fewer
  going down, and while they number at most the level's beam all are kept unscored. So the kernel
  computes from ``t``, ``C`` and ``g`` how many top levels are like that, skips them, and starts
  at the first level with more free nodes, taking all free nodes of the level above as kept. From
  there the candidates are the children of the kept nodes of the level above and of its forced
  nodes (``utils.walk_triton.candidates``), free ones only: always more than ``W``, so each is
  scored per head by the LSE over its children's means (``_child_lse``: the cache's sums over the
  children's key count, which is the full span, as every ranked node lies before the query),
  summed over heads, and ``tl.topk`` over packed (score, index) keys keeps ``W``. Per ranked level
  that is ``g`` loads of the candidates' child sums (in flight together, ``num_stages``
  permitting), their dots and the top-k.
- ``beam_leaf`` (``W2``, ``docs/spec.md`` §11): level 2, whose children are the leaves, keeps
  ``W2`` instead of ``W``. With ``W2 == W`` (``beam_leaf`` None or ``beam``) the kernel is the
  single-beam one: one loop over every ranked level, the leaf stage over ``[WP]``. Otherwise the
  loop ranks the levels above 2 and level 2 is ranked after it into a register tile of its own
  width ``W2P`` (skipped, when all levels above were and it has at most ``W2`` free nodes; all
  its candidates kept when they are at most ``W2``), and the leaf stage takes its ``[W2P]``.
- ``scorer="bound"``: the cache's per-node key ``mins`` / ``maxs`` replace the means at the
  internal levels: per candidate child ``z = scale * (q_a . max + q_b . min)`` with ``q_a`` the
  query elements where ``scale * q > 0`` and ``q_b`` the others (``sum_d max(s q_d min_d,
  s q_d max_d)``, the oracle's bound logit: two loads and two dots a child instead of one), then
  the same LSE over the children, sum over heads and top-k. Leaves are still ranked by their
  exact LSE. Only ranked nodes' children are read, which lie wholly before the query, so the
  ``+inf`` / ``-inf`` bounds of nodes past a sequence are never loaded.
- leaf level: each kept or forced parent's ``g`` children are scored by the exact LSE over their
  keys (``utils.walk_triton.leaf_keys`` and ``leaf_scores``: one ``[g * C, D]`` load and one dot
  per parent, the next parents' keys loading meanwhile). The parents are the longest chain of a
  step, so the ``SPLITS`` walk programs of a (sequence, KV head) share them (program ``s`` every
  ``SPLITS``-th): each repeats the walk (parallel, on idle SMs; its reads of the same rows mostly
  hit L2) and writes the best ``TOP_W`` leaves it scored (all of them: ``TOP_W`` covers its
  share) with its count of page misses (``tops [B, HKV, SPLITS, TOP_W + 1]`` int64,
  ``_tops_row``).
- selection: the best ``TOP_P`` of the programs' rows are the best of all leaves (each leaf is
  scored by one program); the best ``K - #forced`` free blocks (``K`` with
  ``forced_in_budget=False``) join the sink, previous and current blocks.
- attention (flash-decoding): split ``s`` takes entries ``[s * KPS, (s + 1) * KPS)`` of that
  list of selected blocks and runs an online softmax over their keys ``j <= t``. One split
  writes the final ``o, lse``; several write fp32 partials that ``_combine_kernel`` merges by
  their LSE.

Paged cache (``block_table``, ``PAGED``) and slots (``cache_batch_idx``, ``SLOT_IDX``; both
constexprs): the walk reads only the sums, per slot; the leaf stage loads each scored parent's
``g`` table entries with its leaves' keys, and the attention the entries of the whole selected
list once before its loop, then every block is one page (``C`` tokens), addressed as rows
``page * C + row`` of the pool like a contiguous block. An entry the step reads outside the
pool, or a slot outside the cache, gives NaN rows (no host check: ``kvcache.check_block_table``
is for allocation time).

A step is a chain of dependent memory round trips (each ranked level's child sums depend on the
level above); ``num_stages`` lets each loop load its next tiles while it scores the current one.
The walk's result crosses to the attention through ``tops`` in global memory, a launch boundary
instead of a grid-wide barrier (which would need every program resident at once).

Nothing depends on tensor values on the host (no ``.item()``, allocation sizes from shapes only),
so a step is capturable in a CUDA graph. A ``cache_seqlens`` value outside ``[0, T_max]`` gives NaN
rows (``o`` and ``lse``); ``0`` gives ``o = 0`` and ``lse = -inf``.

Precision. As in ``select.triton``: keys and queries enter ``tl.dot`` in their dtype (fp32
accumulation), the fp32 child means against 16-bit queries as a 16-bit head plus residual, fp32
inputs with ``input_precision="ieee"``. Means are ``sums / counts`` in fp32 (a product with the
exact reciprocal of the count, a power of two), as the prefill build computes them from its own
sums; those only differ in summation order, so decode and prefill can differ only on near-tied
candidates.

Limits: ``scorer`` "lse" or "bound", ``selector="pyramid"``; ``branching`` 2 or 4; ``block_size``
a power of two in [16, 128]; head dim 16, 32, 64 or 128; ``1 <= W <= 512 / g`` (wider beams are
capped at the leaf count of ``T_max``, which prunes nothing either); ``W2 >= 1`` whose level-2
tile ``min(next_pow2(W2), 2 g WP)`` is at most ``512 / g`` (``beam_widths`` raises otherwise).
``query_tile`` / ``tile_reduce`` do not apply: a decode step is one token.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..utils.config import SelectConfig
from ..utils.geometry import cdiv, level_offsets, pow2
from ..utils.op import (KEY_NONE, LOG2E, dot_nt, dot_nt_f32, empty, load_queries, load_rows,
                        online_softmax_step, pack, poisoned, selection_row, softmax_output,
                        store_rows, unpack_idx)
from ..utils.relaunch import Relaunch
from ..utils.triton_utils import DECODE_STAGE_SMEM, F32_PREC, pick_of
from ..utils.walk_triton import candidates, forced_parents, leaf_keys, leaf_scores

_HEAD_DIMS = (16, 32, 64, 128)
_BRANCHINGS = (2, 4)
_MAX_GROUP = 64  # query heads per KV head: the rows of every tile
# Query rows per tile (the GQA group, zero-padded). 16-row tiles whose product feeds a second dot
# gave wrong results on the H200 with triton 3.6 in the attention kernel (docs/design.md,
# "Triton tile minimum"); 32 rows were right there, and a decode step is bound by latency, not by
# these tiny products.
_MIN_ROWS = 32
# Every split repeats the walk, ranks its share of the leaves and attends to K / SPLITS blocks.
# On the H200 (config A, B=1, 1M context, before the level skip, the pipelining and the shared
# leaf stage) 16 splits (one block each) measured 0.132 ms, 8 splits 0.137 ms, 4 splits 0.141 ms:
# the walks run in parallel on idle SMs.
_MAX_SPLITS = 16
# Compiled for sm_90 with the launcher's arguments (config A: G=16, D=128, C=64, g=2, W=16, bf16,
# 8 splits), ptxas gives 185 registers a thread at 8 warps and 248 at 4, neither spilling (at 16
# splits 248 and 255); on the H200 8 warps measured faster (0.137 vs 0.144 ms, 1M, 8 splits,
# before the level skip and the pipelining).
_NUM_WARPS = 8
# Pipelining. With 2 stages triton 3.6 gives a loop one buffer and starts loading the next tile
# only after the current one is scored (seen in the TTGIR), so every iteration waits a full memory
# round trip; 3 keeps a tile in flight while one is scored (both children of a g=2 level, the
# next parent's leaf keys, both blocks of a split at K / SPLITS = 2).
_NUM_STAGES = 3


class DecodeShape(NamedTuple):
    """A decode program's compile-time shape (one ``tl.constexpr``; names as in
    ``utils.triton_utils``)."""

    G: int           # query heads per KV head
    GP: int          # query rows: G zero-padded to a power of two >= _MIN_ROWS
    D: int           # head dim
    C: int           # keys a block (a page)
    LOG_C: int
    BRANCH: int      # children a node (2 or 4)
    LOG_BRANCH: int
    W: int           # beam above level 2
    WP: int          # its register width
    W2: int          # beam at level 2 (``beam_leaf``)
    W2P: int         # its register width (== WP with a single beam)
    TOP_P: int       # best leaf keys the selection takes (a power of two)
    TOP_W: int       # leaf keys a walk program passes on: its share's leaves, at most TOP_P
    KPS: int         # selected blocks a split attends
    SPLITS_P: int    # programs a (sequence, KV head), padded to a power of two


class DecodeModes(NamedTuple):
    BOUND: bool      # rank internal nodes by key bounds (``scorer="bound"``)
    PAGED: bool      # a paged cache: blocks through the page table
    SLOT_IDX: bool   # sequences name their cache slots (``cache_batch_idx``)
    WRITE_IDX: bool  # also write the selection


class DecodeStages(NamedTuple):
    """Software pipelining of the kernel's loops (``_stages``)."""

    CHILD: int  # over a level's children
    LEAF: int   # over the kept parents' leaf keys
    ATTN: int   # over a split's attended blocks


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _exp2i(e):
    """``2.0 ** e`` in fp32 for an integer ``e`` in [-126, 127], exact (from its exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _free_end(cur, shift):
    """The free (causal, not forced) nodes of a level whose nodes span ``2 ** shift`` leaves, for a
    query in leaf ``cur``, are ``1 .. p - 1``: ``p``, returned, holds leaf ``cur - 1``; the forced
    nodes are 0, ``p`` and the node holding leaf ``cur``, which is ``p`` or ``p + 1``, the last
    causal one (elementwise over tensors of shifts)."""
    return tl.maximum(cur - 1, 0) >> shift


@triton.jit
def _child_lse(b_q, b_qb, o_x, m_x, p_child, p_lo, s_cn, inv_n, scale,
               BRANCH: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr, BOUND: tl.constexpr):
    """Per query row scores ``[GP, NX]`` of candidates ``o_x [NX]``: ``log sum_c exp(z_c)``
    over their ``BRANCH`` children (rows ``o_x * BRANCH + c`` of ``p_child``), online over ``c``;
    ``-inf`` outside ``m_x``. ``STAGES - 1`` child tiles load ahead: with ``STAGES > BRANCH``, one
    memory round trip per level instead of ``BRANCH``.

    ``z_c = scale * q . s_c * inv_n`` from the children's sums ``s_c``; with ``BOUND``
    (``scorer="bound"``) ``z_c = scale * (q_a . max_c + q_b . min_c)`` from the children's key
    maxs (at ``p_child``) and mins (at ``p_lo``), ``b_q`` holding the rows' elements where
    ``scale * q > 0`` and ``b_qb`` the others: ``sum_d max(s q_d min_d, s q_d max_d)``, the
    oracle's bound logit.

    A ranked node lies wholly before the query (nodes holding it are forced, later ones dropped),
    so each of its children is full: ``n`` keys, a power of two, and ``inv_n = 1 / n`` exactly,
    so ``s_c * inv_n`` is the mean ``s_c / n`` (and its bounds hold real keys only). The spec's
    count weights ``n_c`` are one constant factor per level, which no ranking sees."""
    o_d = tl.arange(0, D)
    M: tl.constexpr = b_q.shape[0]
    N: tl.constexpr = o_x.shape[0]
    b_max = tl.full([M, N], float("-inf"), dtype=tl.float32)
    b_acc = tl.zeros([M, N], dtype=tl.float32)
    for c in tl.range(0, BRANCH, num_stages=STAGES):
        o_p = (o_x * BRANCH + c).to(tl.int64)[:, None] * s_cn + o_d[None, :]
        if BOUND:  # finite: masked rows read zeros (nodes past a sequence hold infinities)
            b_hi = tl.load(p_child + o_p, mask=m_x[:, None], other=0.)
            b_lo = tl.load(p_lo + o_p, mask=m_x[:, None], other=0.)
            b_x = (dot_nt_f32(b_q, b_hi, F32_PREC) + dot_nt_f32(b_qb, b_lo, F32_PREC)) * scale
        else:
            b_mean = tl.load(p_child + o_p, mask=m_x[:, None], other=0.) * inv_n
            b_x = dot_nt_f32(b_q, b_mean, F32_PREC) * scale  # finite: masked rows read zeros
        b_new = tl.maximum(b_max, b_x)
        b_acc = b_acc * tl.exp(b_max - b_new) + tl.exp(b_x - b_new)
        b_max = b_new
    return tl.where(m_x[None, :], b_max + tl.log(b_acc), float("-inf"))


@triton.jit
def _level_scores(b_q, b_qb, m_row, b_rest, n_rest, cur, shift, p_child, p_lo, s_sn, scale,
                  SHAPE: tl.constexpr, BOUND: tl.constexpr, STAGES: tl.constexpr):
    """The candidates ``o_x [2 * BRANCH * WP]`` of the level whose nodes span ``2 ** shift``
    leaves (the children of the ``n_rest`` kept nodes ``b_rest [WP]`` of the level above and of
    its forced nodes, ``utils.walk_triton.candidates``), which are free (``m_x``: causal, not
    forced), and their group scores (``_child_lse`` per head, summed over the real heads
    ``m_row``); the children's rows start at ``p_child`` (and ``p_lo``, the mins, for
    ``BOUND``)."""
    BRANCH: tl.constexpr = SHAPE.BRANCH
    LOG_BRANCH: tl.constexpr = SHAPE.LOG_BRANCH
    sc = shift - LOG_BRANCH  # the children's shift
    o_x, m_x = candidates(b_rest, n_rest, cur, cur, 1 << (shift + LOG_BRANCH), 0, BRANCH, BRANCH,
                          SHAPE.WP)
    m_x = m_x & (o_x >= 1) & (o_x < _free_end(cur, shift))  # free nodes only
    b_sm = _child_lse(b_q, b_qb, o_x, m_x, p_child, p_lo, s_sn, _exp2i(-(sc + SHAPE.LOG_C)),
                      scale, BRANCH, SHAPE.D, STAGES, BOUND)
    return o_x, m_x, tl.sum(tl.where(m_row[:, None], b_sm, 0.), axis=0)


@triton.jit
def _pages(p_btb, blk, m_blk, n_pages):
    """The pages of the sequence's blocks ``blk`` (row ``p_btb`` of the page table), and which
    of those in ``m_blk`` have no page in the pool ``[0, n_pages)`` (read as page 0)."""
    page = tl.load(p_btb + blk, mask=m_blk, other=0)
    m_out = m_blk & ((page < 0) | (page >= n_pages))
    return tl.where(m_out, 0, page), m_out


@triton.jit
def _leaf_top(b_q, m_row, b_rest, n_rest, cur, p_kh, p_btb, n_pages, s_kt, scale,
              WP: tl.constexpr, SHAPE: tl.constexpr, PAGED: tl.constexpr, STAGES: tl.constexpr):
    """The leaf stage of walk program ``i_s`` of ``tl.num_programs(2)``: exact LSE of the free
    children (``[1, cur - 2]``) of its share of the parents (every ``num_programs``-th of the
    ``n_rest`` kept level-2 nodes ``b_rest [WP]`` followed by the new forced parents: sink,
    previous, current); scores land in the candidate slots by index. ``STAGES - 1`` parents' keys
    are loaded ahead of the one being scored (their pages, ``PAGED``, through ``p_btb``). Returns
    the best ``TOP_W`` packed keys of the leaves it scored, best first, and how many leaves read
    had no page in the pool.

    The parents are spread over the programs because they are the longest chain of a step: one
    program scoring all ``W + 3`` of them took most of a step's time at 1M
    (``docs/results_decode.md``)."""
    C: tl.constexpr = SHAPE.C
    BRANCH: tl.constexpr = SHAPE.BRANCH
    NX: tl.constexpr = 2 * BRANCH * WP
    o_w = tl.arange(0, WP)
    o_x, m_x = candidates(b_rest, n_rest, cur, cur, BRANCH, 0, BRANCH, BRANCH, WP)
    m_free = m_x & (o_x >= 1) & (o_x <= cur - 2)
    o_c = tl.arange(0, BRANCH)
    b_s = tl.zeros([NX], dtype=tl.float32)
    m_done = tl.zeros([NX], dtype=tl.int1)  # the candidates this program scored
    n_out = tl.full([], 0, tl.int32)
    for j in tl.range(tl.program_id(2), n_rest + 3, tl.num_programs(2), num_stages=STAGES):
        par_f, new_f = forced_parents(j - n_rest, cur, cur, BRANCH, 0)
        kept = j < n_rest
        par = tl.where(kept, tl.sum(tl.where(o_w == j, b_rest, 0)), par_f)
        o_leaf = par * BRANCH + o_c
        m_leaf = (kept | new_f) & (o_leaf >= 1) & (o_leaf <= cur - 2)
        o_id = o_leaf  # where the leaves' rows start: block (contiguous) or page index
        m_load = m_leaf
        if PAGED:
            o_id, m_out = _pages(p_btb, o_leaf, m_leaf, n_pages)
            n_out += tl.sum(m_out.to(tl.int32))
            m_load = m_leaf & ~m_out
        b_k = leaf_keys(p_kh, s_kt, o_id, m_load, C, C, SHAPE.D, SHAPE.D)
        b_sj = tl.sum(leaf_scores(b_q, m_row, b_k, scale, 1, SHAPE.GP, C, C, 0),
                      axis=0)  # [BRANCH]
        m_hit = (o_x[:, None] == o_leaf[None, :]) & m_leaf[None, :]  # [NX, BRANCH]
        m_new = tl.max(m_hit.to(tl.int32), axis=1) > 0
        b_s = tl.where(m_new, tl.sum(tl.where(m_hit, b_sj[None, :], 0.), axis=1), b_s)
        m_done |= m_new
    b_key = tl.where(m_free & m_done, pack(b_s, o_x), KEY_NONE)
    return tl.topk(b_key, SHAPE.TOP_W), n_out  # best first


@triton.jit
def _sequence(p_seqlens, p_slot, i_b, T_max, n_slots, C: tl.constexpr, SLOT_IDX: tl.constexpr):
    """The query's position ``t`` (``-1`` for an empty sequence), its leaf ``cur``, the cache row
    ``i_c`` (int64) of sequence ``i_b`` and whether its rows are NaN: a length outside
    ``[0, T_max]`` (caller-owned lengths are not checked on the host: that would sync) or a slot
    outside the cache (read as slot 0)."""
    seqlen_in = tl.load(p_seqlens + i_b)
    m_bad = (seqlen_in < 0) | (seqlen_in > T_max)
    i_c = i_b
    if SLOT_IDX:
        i_c = tl.load(p_slot + i_b)
        m_bad |= (i_c < 0) | (i_c >= n_slots)
        i_c = tl.where(m_bad, 0, i_c)
    t = tl.minimum(seqlen_in, T_max) - 1
    return t, tl.maximum(t, 0) // C, i_c.to(tl.int64), m_bad


@triton.jit
def _tops_row(p_tops, i_b, i_h, i_s, TOP_W: tl.constexpr):
    """Row ``i_s`` of ``tops [B, HKV, programs, TOP_W + 1]`` int64 (contiguous): a walk program's
    best ``TOP_W`` packed leaf keys, then how many leaves it read had no page."""
    row = (i_b * tl.num_programs(1) + i_h) * tl.num_programs(2) + i_s
    return p_tops + row.to(tl.int64) * (TOP_W + 1)


# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too
@triton.jit(do_not_specialize=["T_max", "n_leaves", "n_walk", "n_pages", "n_slots"])
def _walk_kernel(
        p_q, p_k, p_summary, p_seqlens, p_table, p_slot, p_tops,
        T_max, n_leaves, n_walk, n_pages, n_slots, scale,
        s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_tb: tl.int64, s_sb: tl.int64, s_s,
        SHAPE: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr):
    """The walk of sequence ``i_b``, KV head ``i_h``, and the leaf ranking of program ``i_s``'s
    share of the kept level-2 nodes: its best ``TOP_W`` leaves into ``p_tops`` (``_tops_row``).

    ``p_summary = (p_sums, p_mins, p_maxs)``: the cache's pyramid ``[slots, N_total, HKV, D]``
    fp32, one layout (strides ``s_sb``, ``s_s = (node, head)``); the bounds are read with
    ``BOUND`` only. ``s_q``, ``s_k``: (token, head) strides.

    Levels are named by ``shift``: a node spans ``2 ** shift`` leaves (``LOG_BRANCH`` per level).
    The walk ranks the ``n_walk`` levels between the root and the leaves of the ``T_max``
    geometry, from the highest whose free (causal, non-forced) nodes outnumber its beam: ``W``
    above level 2, ``W2`` (``beam_leaf``) at level 2, whose children are the leaves. Register
    state between levels: ``b_rest [WP]``, the kept free nodes (``n_rest`` of them) of the level
    above, and for the leaf stage the kept level-2 nodes in ``[W2P]``; forced nodes are never
    carried, they follow from ``cur``. ``W2 == W`` (and ``W2P == WP``: ``beam_leaf`` None or
    ``beam``) is one loop over every ranked level; otherwise level 2 is ranked after the loop,
    into ``[W2P]``. ``BOUND`` (``scorer="bound"``) scores internal nodes by their children's key
    bounds ``p_maxs`` / ``p_mins`` instead of their means.
    The sequence's pyramid is row ``i_c`` of the summaries (``_sequence``). Its block ``i`` is
    key rows ``i * C ..`` of row ``i_c`` of the contiguous cache, or with ``PAGED`` rows
    ``p_table[i_b, i] * C ..`` of the pool (``s_kb = 0``; 32-bit row arithmetic: 64-bit block
    offsets made the step a quarter slower at 1M, ``docs/results_decode.md``).
    """
    D: tl.constexpr = SHAPE.D
    LOG_BRANCH: tl.constexpr = SHAPE.LOG_BRANCH
    W: tl.constexpr = SHAPE.W
    WP: tl.constexpr = SHAPE.WP
    W2P: tl.constexpr = SHAPE.W2P
    TOP_W: tl.constexpr = SHAPE.TOP_W
    SPLIT_LEAF: tl.constexpr = (SHAPE.W2 != W) or (W2P != WP)
    p_sums, p_mins, p_maxs = p_summary
    s_qt, s_qh = s_q
    s_kt, s_kh = s_k
    s_sn, s_sh = s_s
    i_b, i_h, i_s = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    b_q, m_row = load_queries(p_q, i_b, i_h, 0, 1, s_qb, s_qt, s_qh, SHAPE.G, SHAPE.GP, 1, D, D)
    _, cur, i_c, _ = _sequence(p_seqlens, p_slot, i_b, T_max, n_slots, SHAPE.C, MODE.SLOT_IDX)
    p_kh = p_k + i_c * s_kb + i_h * s_kh
    p_tb = p_table + i_b.to(tl.int64) * s_tb
    if MODE.BOUND:  # the children's key maxs and mins, with the query rows split by sign
        p_sh = p_maxs + i_c * s_sb + i_h * s_sh
        p_lh = p_mins + i_c * s_sb + i_h * s_sh
        m_pos = b_q.to(tl.float32) * scale > 0
        b_qa = tl.where(m_pos, b_q, tl.zeros_like(b_q))
        b_qb = tl.where(m_pos, tl.zeros_like(b_q), b_q)
    else:
        p_sh = p_sums + i_c * s_sb + i_h * s_sh
        p_lh = p_sh
        b_qa = b_q
        b_qb = b_q

    # Top levels with at most their beam of free nodes keep all of them unscored, and the free
    # nodes' count (_free_end - 1) never shrinks going down. So skip those levels: the walk starts
    # at the first level with more, from all free nodes of the level above (none above the
    # highest walk level, whose parent is the root).
    o_lv = tl.arange(0, 32)  # walk level i ranks shift LOG_BRANCH * (n_walk - i); n_walk < 32
    n_free = tl.maximum(_free_end(cur, LOG_BRANCH * tl.maximum(n_walk - o_lv, 0)) - 1, 0)
    if SPLIT_LEAF:  # level 2 (walk level n_walk - 1) is skipped only after every level above
        n_skip = tl.sum(((o_lv < n_walk - 1) & (n_free <= W)).to(tl.int32))
        n_free2 = tl.sum(tl.where(o_lv == n_walk - 1, n_free, 0))
        n_skip += ((n_skip == n_walk - 1) & (n_free2 <= SHAPE.W2)).to(tl.int32)
        n_hi = n_walk - 1  # the loop ranks the levels above level 2
    else:
        n_skip = tl.sum(((o_lv < n_walk) & (n_free <= W)).to(tl.int32))
        n_hi = n_walk
    shift = LOG_BRANCH * (n_walk - n_skip)  # of the first ranked level (0: none, leaves next)
    n_rest = tl.maximum(_free_end(cur, shift + LOG_BRANCH) - 1, 0)
    o_w = tl.arange(0, WP)
    b_rest = 1 + o_w
    # First sums row of the ranked level's children: the T_max geometry stores the levels
    # leaves first, cdiv(n_leaves, 2 ** s) nodes at shift s.
    o_sh = LOG_BRANCH * tl.minimum(o_lv, 30 // LOG_BRANCH)
    n_nodes = (n_leaves + (1 << o_sh) - 1) >> o_sh
    lo_c = tl.sum(tl.where(o_lv < shift // LOG_BRANCH - 1, n_nodes, 0))

    # Ranked levels: each has more than W candidates (the first by the skip, the next ones
    # BRANCH * W children of the W kept nodes at least), so W are kept. The candidates are the
    # children of the kept and of the forced nodes above (walk_triton.candidates), scored per
    # head by the LSE over their children's means (or bounds), summed over heads.
    for _ in range(n_skip, n_hi):
        sc = shift - LOG_BRANCH  # the children's shift
        o_x, m_x = candidates(b_rest, n_rest, cur, cur, 1 << (shift + LOG_BRANCH), 0,
                              SHAPE.BRANCH, SHAPE.BRANCH, WP)
        m_x = m_x & (o_x >= 1) & (o_x < _free_end(cur, shift))  # free nodes only
        b_sm = _child_lse(b_qa, b_qb, o_x, m_x, p_sh + lo_c.to(tl.int64) * s_sn,
                          p_lh + lo_c.to(tl.int64) * s_sn, s_sn, _exp2i(-(sc + SHAPE.LOG_C)),
                          scale, SHAPE.BRANCH, D, STAGES.CHILD, MODE.BOUND)
        b_s = tl.sum(tl.where(m_row[:, None], b_sm, 0.), axis=0)
        b_top = tl.topk(tl.where(m_x, pack(b_s, o_x), KEY_NONE), WP)
        b_rest = tl.where(b_top != KEY_NONE, unpack_idx(b_top), 0)
        n_rest = W
        shift = sc
        sg = tl.maximum(sc - LOG_BRANCH, 0)  # the grandchildren's (unused after the last level)
        lo_c = lo_c - ((n_leaves + (1 << sg) - 1) >> sg)

    if SPLIT_LEAF:
        # Level 2 with its own beam W2, kept in [W2P]: skipped, all its free nodes 1 .. n_rest;
        # ranked (shift == LOG_BRANCH, children the leaves: lo_c == 0), the best W2 of its free
        # candidates, all of them (n_leaf of them, best first) when they are at most W2.
        b_leaf = 1 + tl.arange(0, W2P)
        n_leaf = n_rest
        if n_skip < n_walk:
            o_x, m_x, b_s = _level_scores(b_qa, b_qb, m_row, b_rest, n_rest, cur, shift,
                                          p_sh + lo_c.to(tl.int64) * s_sn,
                                          p_lh + lo_c.to(tl.int64) * s_sn, s_sn, scale, SHAPE,
                                          MODE.BOUND, STAGES.CHILD)
            b_top = tl.topk(tl.where(m_x, pack(b_s, o_x), KEY_NONE), W2P)
            b_leaf = tl.where(b_top != KEY_NONE, unpack_idx(b_top), 0)
            n_leaf = tl.minimum(tl.sum(m_x.to(tl.int32)), SHAPE.W2)
        b_top, n_out = _leaf_top(b_q, m_row, b_leaf, n_leaf, cur, p_kh, p_tb, n_pages, s_kt,
                                 scale, W2P, SHAPE, MODE.PAGED, STAGES.LEAF)
    else:
        b_top, n_out = _leaf_top(b_q, m_row, b_rest, n_rest, cur, p_kh, p_tb, n_pages, s_kt,
                                 scale, WP, SHAPE, MODE.PAGED, STAGES.LEAF)
    p_row = _tops_row(p_tops, i_b, i_h, i_s, TOP_W)
    tl.store(p_row + tl.arange(0, TOP_W), b_top)
    tl.store(p_row + TOP_W, n_out.to(tl.int64))


@triton.jit(do_not_specialize=["T_max", "n_pages", "n_slots"])
def _attend_kernel(
        p_q, p_k, p_v, p_seqlens, p_table, p_slot, p_tops, p_o, p_lse, p_idx,
        T_max, n_pages, n_slots, scale_log2,
        s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_vb: tl.int64, s_v, s_tb: tl.int64,
        s_ob: tl.int64, s_o, s_lb: tl.int64, s_l, s_ib: tl.int64, s_ih,
        SHAPE: tl.constexpr, MODE: tl.constexpr, PICK: tl.constexpr, STAGES: tl.constexpr):
    """The selection of sequence ``i_b``, KV head ``i_h`` (the best leaves of every walk
    program's ``p_tops`` row, with the forced blocks) and the attention of split ``i_s`` over its
    share of it. Writes ``o`` rows (``p_o`` at split ``i_s``: the final output, or an fp32
    partial) and their natural-log LSE, and, with ``WRITE_IDX``, the selected blocks ascending
    (``-1`` padded, as ``PICK`` fills a row). NaN rows for a bad length or slot (``_sequence``)
    and where a leaf the walk read or a selected block has no page in ``[0, n_pages)``.
    ``s_q``, ``s_k``, ``s_v``: (token, head) strides; ``s_o``, ``s_l``: (head, split) strides of
    the outputs."""
    G: tl.constexpr = SHAPE.G
    GP: tl.constexpr = SHAPE.GP
    D: tl.constexpr = SHAPE.D
    C: tl.constexpr = SHAPE.C
    TOP_P: tl.constexpr = SHAPE.TOP_P
    TOP_W: tl.constexpr = SHAPE.TOP_W
    SPLITS_P: tl.constexpr = SHAPE.SPLITS_P
    KPS: tl.constexpr = SHAPE.KPS
    SLOTS_P: tl.constexpr = PICK.SLOTS_P
    s_qt, s_qh = s_q
    s_kt, s_kh = s_k
    s_vt, s_vh = s_v
    i_b, i_h, i_s = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    b_q, m_row = load_queries(p_q, i_b, i_h, 0, 1, s_qb, s_qt, s_qh, G, GP, 1, D, D)
    t, cur, i_c, m_bad = _sequence(p_seqlens, p_slot, i_b, T_max, n_slots, C, MODE.SLOT_IDX)
    p_kh = p_k + i_c * s_kb + i_h * s_kh
    p_tb = p_table + i_b.to(tl.int64) * s_tb

    # The walk programs' best leaves, merged: every program's keys are its own leaves' (each
    # leaf scored by one program), so the best TOP_P of all are the best of their union.
    o_p = tl.arange(0, SPLITS_P)
    m_p = o_p < tl.num_programs(2)
    p_row = _tops_row(p_tops, i_b, i_h, 0, TOP_W) + o_p[:, None] * (TOP_W + 1)
    b_keys = tl.load(p_row + tl.arange(0, TOP_W)[None, :], mask=m_p[:, None], other=KEY_NONE)
    b_top = tl.topk(tl.reshape(b_keys, [SPLITS_P * TOP_W]), TOP_P)
    n_out = tl.sum(tl.load(p_row + TOP_W, mask=m_p[:, None], other=0))

    # The selected blocks, ascending; at most SLOTS entries are used.
    b_row, _ = selection_row(tl.full([1], 0, tl.int32) + cur, b_top[None, :],
                             tl.zeros([1], tl.int32), PICK.TOPK, PICK.IN_BUDGET, SLOTS_P)
    b_sel = tl.reshape(b_row, [SLOTS_P])
    o_s = tl.arange(0, SLOTS_P)
    if MODE.WRITE_IDX:
        if i_s == 0:
            tl.store(p_idx + i_b * s_ib + i_h * s_ih + o_s, b_sel, mask=o_s < PICK.SLOTS)

    # Attention over this split's share of the list (online softmax in base 2). Every split
    # looks up the pages of the whole list (one load), so all agree on a page outside the pool.
    b_att = b_sel
    if MODE.PAGED:
        b_id, m_out = _pages(p_tb, b_sel, (b_sel >= 0) & (b_sel * C <= t), n_pages)
        m_bad |= (n_out + tl.sum(m_out.to(tl.int32))) > 0
        b_att = tl.where(m_out, -1, b_sel)  # a block without a page is not read (NaN row)
    p_vh = p_v + i_c * s_vb + i_h * s_vh
    o_t = tl.arange(0, C)
    b_m = tl.full([GP], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([GP], dtype=tl.float32)
    b_acc = tl.zeros([GP, D], dtype=tl.float32)
    for j in tl.range(0, KPS, num_stages=STAGES.ATTN):
        m_j = o_s == i_s * KPS + j
        blk = tl.sum(tl.where(m_j, b_att + 1, 0)) - 1
        m_key = (blk >= 0) & (blk * C + o_t <= t)
        i_id = blk  # where the block's rows start: block (contiguous) or page index
        if MODE.PAGED:
            i_id = tl.sum(tl.where(m_j, b_id, 0))
        o_key = (i_id * C + o_t).to(tl.int64)
        b_k = load_rows(p_kh, o_key * s_kt, m_key, D)
        b_v = load_rows(p_vh, o_key * s_vt, m_key, D)
        b_z = tl.where(m_key[None, :], dot_nt(b_q, b_k, F32_PREC) * scale_log2, float("-inf"))
        b_m, b_l, b_acc = online_softmax_step(b_z, b_v, b_m, b_l, b_acc, F32_PREC)

    o_head = i_h * G + tl.arange(0, GP)
    b_o, b_lse = softmax_output(b_m, b_l, b_acc)
    b_o = tl.where(m_bad, float("nan"), b_o)
    b_lse = tl.where(m_bad, float("nan"), b_lse)
    s_oh, s_os = s_o
    s_lh, s_ls = s_l
    store_rows(p_o + i_b.to(tl.int64) * s_ob + i_s * s_os, o_head * s_oh, m_row, b_o, D)
    tl.store(p_lse + i_b * s_lb + o_head * s_lh + i_s * s_ls, b_lse, mask=m_row)


@triton.jit
def _combine_kernel(p_po, p_plse, p_o, p_lse, HQ, s_ob: tl.int64, s_oh,
                    SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, D: tl.constexpr):
    """Merge the ``SPLITS`` partials ``[B, HQ, SPLITS, D]`` of head ``i_q`` of sequence ``i_b`` by
    their LSE (splits without a key have ``lse = -inf`` and weigh 0; a NaN split makes the sum,
    hence ``o`` and ``lse``, NaN)."""
    i_b, i_q = tl.program_id(0), tl.program_id(1)
    o_sp = tl.arange(0, SPLITS_P)
    m_sp = o_sp < SPLITS
    row = (i_b * HQ + i_q) * SPLITS
    b_lse = tl.load(p_plse + row + o_sp, mask=m_sp, other=float("-inf"))
    b_max = tl.max(b_lse, axis=0)
    b_shift = tl.where(b_max == float("-inf"), 0., b_max)
    b_w = tl.exp(b_lse - b_shift)
    b_sum = tl.sum(b_w, axis=0)
    b_po = load_rows(p_po, (row + o_sp).to(tl.int64) * D, m_sp & (b_w > 0), D)
    b_sum_safe = tl.where(b_sum == 0, 1., b_sum)  # 0: no split saw a key; NaN stays NaN
    b_o = tl.sum(b_w[:, None] * b_po, axis=0) / b_sum_safe
    o_d = tl.arange(0, D)
    tl.store(p_o + i_b.to(tl.int64) * s_ob + i_q * s_oh + o_d, b_o.to(p_o.dtype.element_ty))
    b_lse_o = b_shift + tl.log(b_sum_safe)
    tl.store(p_lse + i_b * HQ + i_q, tl.where(b_sum == 0, float("-inf"), b_lse_o))


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the H200's; only shapes the interpreter's default split count


def default_num_splits(batch: int, kv_heads: int, slots: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to cover the GPU's SMs once, at most
    ``_MAX_SPLITS`` and at most one per selected block (HKV=4, K=16 on an H200: 16 at B=1 and 2,
    8 at B=4, 2 at B=16)."""
    return max(1, min(slots, _MAX_SPLITS, _sm_count(device) // max(batch * kv_heads, 1)))


def _stages(num_stages: int, tile_bytes: int, trips: int) -> int:
    """``num_stages`` of a loop loading one ``tile_bytes`` tile an iteration: up to
    ``num_stages - 1`` tiles in flight, no more than the loop has iterations or than fit
    ``triton_utils.DECODE_STAGE_SMEM`` bytes of shared memory (1: no pipelining)."""
    return 1 + max(0, min(num_stages - 1, trips, DECODE_STAGE_SMEM // tile_bytes))


def _check_supported(q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                     cfg: SelectConfig, num_splits, num_warps, num_stages) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"decode_triton needs fp16/bf16/fp32 q and cache, got {q.dtype}")
    if q.shape[2] // k_cache.shape[2] > _MAX_GROUP:
        raise ValueError(f"decode_triton supports up to {_MAX_GROUP} query heads per KV head, "
                         f"got {q.shape[2] // k_cache.shape[2]}")
    if q.shape[-1] not in _HEAD_DIMS:
        raise ValueError(f"decode_triton supports head dims {_HEAD_DIMS}, got {q.shape[-1]}")
    if cfg.scorer not in ("lse", "bound"):
        raise ValueError(f"decode_triton supports scorer='lse' and 'bound' only, got "
                         f"{cfg.scorer!r} (use backend='torch' for the ablation scorers)")
    if cfg.selector != "pyramid":
        raise ValueError(f"decode_triton supports selector='pyramid' only, got {cfg.selector!r} "
                         "(use backend='torch' for the flat selectors)")
    if cfg.branching not in _BRANCHINGS:
        raise ValueError(f"decode_triton supports branching in {_BRANCHINGS}, got "
                         f"{cfg.branching}")
    if not 16 <= cfg.block_size <= 128:
        raise ValueError(f"decode_triton supports block_size in [16, 128], got {cfg.block_size}")
    if not cache_seqlens.is_contiguous():
        raise ValueError("cache_seqlens must be contiguous")
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last (head) dim, got strides {q.stride()}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if num_warps not in (None, 1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be None or a power of two in [1, 16], got "
                         f"{num_warps!r}")
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be a positive int or None, got {num_stages!r}")
    if cfg.beam < 1 or cfg.beam_at(2) < 1:
        raise ValueError(f"decode_triton needs beam >= 1 and beam_leaf >= 1, got beam="
                         f"{cfg.beam}, beam_leaf={cfg.beam_leaf}")


def beam_widths(cfg: SelectConfig, n_leaves: int) -> tuple[int, int, int, int]:
    """``(W, WP, W2, W2P)``: the beam above level 2 and at level 2 (``beam_leaf``), each capped
    at the leaf count (no level has more candidates, so the cap changes no selection), and their
    register widths: ``WP`` for the levels above (>= 4: the candidates' 4 forced-parent slots, and
    >= 16 candidate columns), ``W2P`` for level 2, at most the ``2 * g * WP`` candidates a level
    holds (every level-2 node the leaf stage may take fits it: ``docs/spec.md`` §11 and
    ``select.triton.beam_geometry``). ``W2P == WP`` when ``W2 == W`` (``beam_leaf`` None or
    ``beam``): the kernel of a single beam. ``ValueError`` for widths whose register tiles
    (``2 * g * WP`` candidates of a level, ``2 * g * W2P`` of the leaf stage) pass 1024."""
    g = cfg.branching
    W = min(cfg.beam, n_leaves)
    WP = max(pow2(W), 4)  # candidates' 4 forced-parent slots (and >= 16 candidate columns)
    if 2 * g * WP > 1024:
        raise ValueError(f"beam={cfg.beam} is too wide for the Triton decode kernel at "
                         f"branching={g}: use beam <= {512 // g}")
    W2 = min(cfg.beam_at(2), n_leaves)
    if W2 == W:
        return W, WP, W, WP
    W2P = max(4, min(pow2(W2), 2 * g * WP))
    if 2 * g * W2P > 1024:
        raise ValueError(f"beam_leaf={cfg.beam_leaf} is too wide for the Triton decode kernel "
                         f"at branching={g}: use beam_leaf <= {512 // g}")
    return W, WP, W2, W2P


class _Plan(NamedTuple):
    """A step's launch: what follows from its inputs' metadata and ``cfg`` alone."""

    B: int
    HQ: int
    D: int
    HKV: int
    splits: int
    tops: int           # the walk's row per program: TOP_W leaf keys and a page-miss count
    walk: Relaunch      # ``_walk_kernel`` given its seven pointers
    attend: Relaunch    # ``_attend_kernel`` given its ten
    combine: Relaunch | None  # ``_combine_kernel`` given its four (several splits)


# A decode step is host-bound (B=1 at 1M: kernels of ~0.07 ms), so its launch constants and its
# launches (``Relaunch``: after the first step, the compiled kernels called directly) are made once
# per (shapes, strides, cfg, knobs) and reused; a server sees a handful of keys. A plan holds the
# kernels it was made with: a tool standing in for them does so before the first step.
_PLANS: dict[tuple, _Plan] = {}


def _plan(q, k_cache, v_cache, sums, table, cfg: SelectConfig, paged: bool, slot_idx: bool,
          write_idx: bool, num_splits, num_warps, num_stages) -> _Plan:
    B, _, HQ, D = q.shape
    HKV, C, branching = k_cache.shape[2], cfg.block_size, cfg.branching
    T_max = table.shape[1] * C if paged else k_cache.shape[1]
    G = HQ // HKV
    offsets = level_offsets(T_max, C, branching)
    n_levels, n_leaves = len(offsets) - 1, offsets[1]
    W, WP, W2, W2P = beam_widths(cfg, n_leaves)
    bound = cfg.scorer == "bound"
    slots = cfg.slots
    splits = min(num_splits or default_num_splits(B, HKV, slots, q.device), slots)
    kps = cdiv(slots, splits)
    splits = cdiv(slots, kps)  # no split without a list entry
    if splits == 1:  # o [B, 1, HQ, D], lse [B, HQ, 1]: q's layout, contiguous
        o_strides = (HQ * D, D, 0)
        l_strides = (HQ, 1, 0)
    else:  # the partials [B, HQ, splits, D] and [B, HQ, splits], contiguous
        o_strides = (HQ * splits * D, splits * D, D)
        l_strides = (HQ * splits, splits, 1)
    i_strides = (HKV * slots, slots) if write_idx else (HQ, 1)  # block_idx, or lse unused
    es = k_cache.element_size()
    stages = num_stages or _NUM_STAGES
    # a block's rows start at block (contiguous) or page (paged) index x C: a page pool is
    # contiguous across its pages (check_cache), so its rows are s_kt apart too
    k_strides = (0 if paged else k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    v_strides = (0 if paged else v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    top_p = min(2 * branching * W2P, pow2(cfg.topk))
    # a walk program scores at most cdiv(W2P + 3, splits) parents' leaves: it passes on no more
    # keys (the merge sorts splits x TOP_W of them), and the splits pass at least TOP_P
    top_w = min(top_p, max(pow2(cdiv(W2P + 3, splits) * branching), top_p // pow2(splits)))
    shape = DecodeShape(G, max(pow2(G), _MIN_ROWS), D, C, C.bit_length() - 1, branching,
                        branching.bit_length() - 1, W, WP, W2, W2P, top_p, top_w, kps,
                        pow2(splits))
    modes = DecodeModes(bound, paged, slot_idx, write_idx)
    # tiles: a level's candidates' fp32 child sums (maxs and mins: two), a parent's leaf keys (a
    # program scores every splits-th of the W2P + 3 parents), a block's K and V
    pipes = DecodeStages(
        _stages(stages, 2 * branching * WP * D * 4 * (2 if bound else 1), branching),
        _stages(stages, branching * C * D * es, cdiv(W2P + 3, splits)),
        _stages(stages, 2 * C * D * es, kps))
    q_strides = (q.stride(0), q.stride()[1:3])
    walk_args = (T_max, n_leaves, max(n_levels - 2, 0), k_cache.shape[0], sums.shape[0],
                 cfg.scale, *q_strides, k_strides[0], k_strides[1:], table.stride(0),
                 sums.stride(0), sums.stride()[1:3], shape, modes, pipes)
    attend_args = (T_max, k_cache.shape[0], sums.shape[0], cfg.scale * LOG2E, *q_strides,
                   k_strides[0], k_strides[1:], v_strides[0], v_strides[1:], table.stride(0),
                   o_strides[0], o_strides[1:], l_strides[0], l_strides[1:], i_strides[0],
                   i_strides[1], shape, modes, pick_of(cfg), pipes)
    grid, warps = (B, HKV, splits), num_warps or _NUM_WARPS
    combine = None
    if splits > 1:  # o [B, 1, HQ, D] and lse [B, HQ, 1] of q's layout
        combine = Relaunch(_combine_kernel, (B, HQ, 1), (HQ, HQ * D, D, splits, pow2(splits), D),
                           num_warps=4)
    return _Plan(B, HQ, D, HKV, splits, top_w + 1,
                 Relaunch(_walk_kernel, grid, walk_args, num_warps=warps, num_stages=stages),
                 Relaunch(_attend_kernel, grid, attend_args, num_warps=warps, num_stages=stages),
                 combine)


def decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  sums: torch.Tensor, cache_seqlens: torch.Tensor, cfg: SelectConfig, *,
                  mins: torch.Tensor | None = None, maxs: torch.Tensor | None = None,
                  block_table: torch.Tensor | None = None,
                  cache_batch_idx: torch.Tensor | None = None,
                  num_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, return_block_idx: bool = False):
    """One decode step (selection and attention) with Triton kernels (inputs checked by
    the caller: ``pisa.PisaCache.prepare``; the kernel's own limits are checked here).

    Arguments:
        q: (batch, 1, nheads, headdim), fp16/bf16/fp32, the cache's dtype and device. The query
            of sequence ``b`` sits at position ``cache_seqlens[b] - 1``.
        k_cache, v_cache: (slots, max_seqlen, nheads_k, headdim), or with ``block_table`` the
            page pool (num_pages, block_size, nheads_k, headdim); last dim contiguous.
        sums: (slots, N_total, nheads_k, headdim) fp32, the pyramid key sums of the cache
            (``pisa.ops.decode.kvcache`` layout, geometry of ``max_seqlen``).
        cache_seqlens: (batch,) int32, valid keys per sequence including the current token.
        cfg: resolved ``SelectConfig`` (``selector="pyramid"``, ``scorer`` "lse" or "bound",
            ``branching`` 2 or 4, ``block_size`` 16..128, ``beam >= 1``, any ``beam_leaf`` up to
            ``512 / g``). ``query_tile`` and ``tile_reduce`` play no part: one token.
        mins, maxs: (slots, N_total, nheads_k, headdim) fp32, the cache's key bounds in the layout
            of ``sums`` (``+inf`` / ``-inf`` past each sequence); ``scorer="bound"`` needs them,
            the other scorers ignore them.
        block_table: optional (batch, max_pages) int32, a paged cache: leaf ``i`` of sequence
            ``b`` is page ``block_table[b, i]`` (``max_seqlen = max_pages * block_size``). The
            kernel reads the entries of the blocks it loads (one load per scored parent's
            leaves, one for the selected list); one outside ``[0, num_pages)`` gives NaN rows
            (the table's values are checked on the host only where pages are allocated:
            ``kvcache.check_block_table``).
        cache_batch_idx: optional (batch,) int32: sequence ``b`` is slot ``cache_batch_idx[b]``
            of ``sums`` and the bounds (and, contiguous, of ``k_cache, v_cache``); one outside
            ``[0, slots)`` gives NaN rows. Default slot ``b``.
        num_splits: programs per (sequence, KV head) sharing the attention over the selected
            blocks (flash-decoding). Default: ``default_num_splits`` (fill the SMs once).
        num_warps: warps per program of the main kernel (a tuning knob; default 8).
        num_stages: software pipelining of the kernel's loops over a level's children, over the
            kept parents' leaf keys and over the attended blocks: up to ``num_stages - 1`` tiles
            loaded ahead, fewer where the loop is shorter or shared memory is short (a tuning
            knob; default 3; 1 loads each tile when it is used).
        return_block_idx: also return the selection, for tests and inspection.

    Returns:
        out: (batch, 1, nheads, headdim), q's dtype.
        lse: (batch, nheads, 1) fp32, natural log (``-inf`` and ``out = 0`` for an empty sequence).
        block_idx (only if return_block_idx): (batch, 1, nheads_k, cfg.slots) int32, ascending,
            ``-1`` padded (the layout of ``pisa_select``).

    No host synchronisation: a step (with ``kvcache.append_kv`` before it) can be captured in a
    CUDA graph.
    """
    bound = cfg.scorer == "bound"
    if bound and (mins is None or maxs is None):
        raise ValueError("scorer='bound' needs the cache's key bounds mins and maxs")
    if not bound:
        mins = maxs = sums  # unused pointers
    paged = block_table is not None
    table = block_table if paged else cache_seqlens  # an unused pointer when contiguous
    # everything but the tensors is a function of this key: computed once, reused every step
    # (the dtypes included: a plan's compiled kernels are launched directly, ``Relaunch``)
    slot_dtype = None if cache_batch_idx is None else cache_batch_idx.dtype
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.dtype, k_cache.stride(),
           v_cache.dtype, v_cache.stride(), sums.shape, sums.dtype, sums.stride(), mins.shape,
           mins.dtype, mins.stride(), maxs.shape, maxs.dtype, maxs.stride(),
           cache_seqlens.dtype, cache_seqlens.is_contiguous(), table.shape, table.dtype,
           table.stride(), cfg, paged, slot_dtype, return_block_idx, num_splits, num_warps,
           num_stages)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable knob: _check_supported names it
        plan, key = None, None
    if plan is None:
        _check_supported(q, k_cache, cache_seqlens, cfg, num_splits, num_warps, num_stages)
        if bound and any(x.shape != sums.shape or x.dtype != sums.dtype
                         or x.stride() != sums.stride() for x in (mins, maxs)):
            raise ValueError("mins and maxs must have the shape, dtype and strides of sums")
        if len(_PLANS) >= 256:  # shapes that come and go (tests): no unbounded growth
            _PLANS.clear()
        plan = _plan(q, k_cache, v_cache, sums, table, cfg, paged, cache_batch_idx is not None,
                     return_block_idx, num_splits, num_warps, num_stages)
        if key is not None:
            _PLANS[key] = plan
    B, HQ, D, HKV, splits = plan.B, plan.HQ, plan.D, plan.HKV, plan.splits
    dev, f32, poison = q.device, torch.float32, poisoned()
    o = empty(B, 1, HQ, D, dtype=q.dtype, device=dev, poison=poison)
    lse = empty(B, HQ, 1, dtype=f32, device=dev, poison=poison)
    block_idx = lse  # an unused pointer unless the selection is asked for
    if return_block_idx:
        block_idx = empty(B, 1, HKV, cfg.slots, dtype=torch.int32, device=dev, poison=poison)
    if splits == 1:
        out, out_lse = o, lse
    else:
        out = empty(B, HQ, splits, D, dtype=f32, device=dev, poison=poison)
        out_lse = empty(B, HQ, splits, dtype=f32, device=dev, poison=poison)
    if B == 0:
        return (o, lse, block_idx) if return_block_idx else (o, lse)
    slot_idx = cache_batch_idx if cache_batch_idx is not None else cache_seqlens  # unused
    # every entry is written by the walk (its programs' best leaves, then their page misses)
    tops = torch.empty(B, HKV, splits, plan.tops, dtype=torch.int64, device=dev)
    plan.walk(q, k_cache, (sums, mins, maxs), cache_seqlens, table, slot_idx, tops)
    plan.attend(q, k_cache, v_cache, cache_seqlens, table, slot_idx, tops, out, out_lse,
                block_idx)
    if splits > 1:
        plan.combine(out, out_lse, o, lse)
    return (o, lse, block_idx) if return_block_idx else (o, lse)
