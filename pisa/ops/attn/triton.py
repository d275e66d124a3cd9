"""Triton block-sparse attention over block selections, per query token or per query tile:
forward and backward.

Semantics are those of ``naive.naive_attn``: query ``t`` (absolute position ``Tk - Tq + t``)
attends the keys ``j <= Tk - Tq + t`` of the blocks of its selection row (ascending, ``-1``
padded), shared by the ``G`` query heads of KV head ``h``. A per-token selection
``block_idx [B, Tq, HKV, S]`` has a row per token; a tile selection (``query_tile = Qt > 1``,
``[B, n_query_tiles(Tq, Tk, Qt), HKV, S]``) a row per query tile: tile ``j`` holds the queries at
absolute positions ``[(t0 // Qt + j) * Qt, + Qt)`` (``t0 = Tk - Tq``; the first and last tiles may
be partial), all sharing row ``j``.

Design
------
Per-token forward and dQ (``query_tile = 1``; decode and chunked prefill use it): one program per
(tile of ``BT`` consecutive query tokens, batch x KV head). The tile's rows are the (token, head)
pairs of one GQA group, token-major, heads padded to a power of two. The program walks the *union*
of its tokens' selections, built ahead by ``_tile_union`` (ascending, with a bitmask per entry
naming the tokens that chose it); rows whose token did not choose a block are masked out.

Tile forward and dQ (``query_tile > 1``): one program per (part of a query tile, batch x KV head)
owns ``BT`` consecutive tokens x ``GP`` heads of one tile (``_tile_part``: a whole tile when
``Qt * GP`` fits the row budget, else the tile split over ``Qt / BT`` programs that read the same
block list; small tiles are padded up to a minimum row count rather than merged, so no union
comes back) and loops over exactly the tile's blocks. Blocks that end at or before the part's
first position (every block but the tile's own for library selections) run mask-free; only the
rest (a suffix of the ascending list) take the causal mask.

dK/dV: one program per (key block, KV head, chunk of the selection rows that chose it), the same
kernel for both selection kinds (``QT`` switches how a step gathers its rows: ``NT`` list entries
x ``BT`` consecutive tokens x ``GP`` heads; a per-token entry is one token, a tile entry ``Qt``
contiguous tokens, several tiles per step when they are small, a tile over several steps when it
is large). The transpose of the selection (per key block, the ascending rows that chose it) comes
from a stable sort of the selection entries (``utils.csr.block_work_items``), O(entries) memory,
never a dense row x block mask. Lists are cut into chunks of at most ``dkv_chunk`` query tokens so
the sink block, which every row chooses, does not make one program straggle; the chunks of one
block are summed with fp32 atomics, or with ``deterministic=True`` through a scratch buffer reduced
in a fixed order.

``PISA_TRITON_POISON=1`` allocates outputs filled with NaN (``utils.op.empty``; tests prove every
element is written).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..utils.csr import block_work_items
from ..utils.geometry import cdiv, pow2
from ..utils.launch import AttnLaunch
from ..utils.op import (LOG2E, LOG2E_K, empty, load_rows, online_softmax_step, softmax_output,
                        store_rows)
from ..utils.triton_utils import strides_of

_HEAD_DIMS = (16, 32, 64, 128, 256)
# keys per K/V tile: larger blocks run as several tiles, so the dK/dV accumulators fit in registers
_KEY_TILE = 64
# token bitmasks of a tile's union are int64
_MAX_TILE_TOKENS = 64


class AttnShape(NamedTuple):
    """The compile-time shape of an attention program (one ``tl.constexpr``; names as in
    ``utils.triton_utils``). Its rows are ``BT`` query tokens x ``GP`` heads of one GQA group,
    token-major."""

    G: int          # query heads per KV head
    GP: int         # rows a token: G padded to a power of two
    BT: int         # query tokens a program (per-token, tile part) or a dK/dV list entry
    C: int          # keys a block (the kernels' key tile)
    D: int          # head dim
    DOT_PREC: str   # tl.dot input precision: "ieee" for fp32 inputs, else "tf32"
    QT: int = 1     # query positions a selection row (``query_tile``; 1: per token)
    NSPLIT: int = 1  # programs (parts of BT tokens) a query tile (tile forward / dQ)
    SLOTS_P: int = 1  # selection slots a row, padded (tile forward / dQ)
    NT: int = 1     # list entries a dK/dV step gathers


# ----------------------------------------------------------------------------------------------
# kernels: shared pieces
# ----------------------------------------------------------------------------------------------
@triton.jit
def _group_rows(i_t, Tq, BT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """Token, head within the group, and validity of the ``BT * GP`` rows of token tile ``i_t``."""
    o_m = tl.arange(0, BT * GP)
    o_tok = i_t * BT + o_m // GP
    o_hh = o_m % GP
    return o_tok, o_hh, (o_tok < Tq) & (o_hh < G)


@triton.jit
def _load_block(p_k, p_v, s_kt, s_vt, i_blk, Tk, C: tl.constexpr, D: tl.constexpr):
    """K, V ``[C, D]`` of key block ``i_blk`` (zero past ``Tk``) and its key positions ``[C]``."""
    o_key = i_blk * C + tl.arange(0, C)
    m_key = o_key < Tk
    b_k = load_rows(p_k, o_key.to(tl.int64) * s_kt, m_key, D)
    return b_k, load_rows(p_v, o_key.to(tl.int64) * s_vt, m_key, D), o_key


@triton.jit
def _scores(b_q, b_k, scale_log2, DOT_PREC: tl.constexpr):
    """Logits ``[rows, C]`` in log2 units."""
    return tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale_log2


@triton.jit
def _dq_update(b_p, b_do, b_k, b_v, b_delta, b_dq, DOT_PREC: tl.constexpr):
    """``b_dq [rows, D]`` plus one block's ``dS @ K`` (unscaled) from its probabilities ``b_p``."""
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
    b_ds = b_p * (b_dp - b_delta[:, None])
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PREC)


@triton.jit
def _kv_heads(p_k, p_v, i_b, i_h, s_kb, s_k, s_vb, s_v):
    """The K and V pointers of batch ``i_b``, KV head ``i_h``, and their token strides."""
    s_kt, s_kh = s_k
    s_vt, s_vh = s_v
    return p_k + i_b * s_kb + i_h * s_kh, p_v + i_b * s_vb + i_h * s_vh, s_kt, s_vt


@triton.jit
def _row_offsets(o_tok, o_head, s_x):
    """Element offsets ``[rows]`` of rows (token ``o_tok``, head ``o_head``) of a ``[T, H, D]``
    tensor of token and head strides ``s_x``."""
    s_xt, s_xh = s_x
    return o_tok.to(tl.int64) * s_xt + o_head * s_xh


# ----------------------------------------------------------------------------------------------
# kernels: per-token selections (forward, dQ)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _union_block(p_union, p_bits, o_bit, t_abs, p_k, p_v, s_kt, s_vt, Tk,
                 C: tl.constexpr, D: tl.constexpr):
    """K, V [C, D] of the union block at ``p_union``, and the [rows, C] mask of the keys each row
    sees."""
    b_k, b_v, o_key = _load_block(p_k, p_v, s_kt, s_vt, tl.load(p_union), Tk, C, D)
    # a row sees the block only if its token chose it; t_abs < Tk also masks the ragged tail
    hit = ((tl.load(p_bits) >> o_bit) & 1) != 0
    return b_k, b_v, hit[:, None] & (o_key[None, :] <= t_abs[:, None])


@triton.jit
def _token_setup(p_q, p_k, p_v, s_qb, s_q, s_kb, s_k, s_vb, s_v, Tq, Tk, HKV, n_tiles, U,
                 SHAPE: tl.constexpr):
    """What the forward and dQ programs of one (token tile, batch x KV head) share: the tile's
    rows, its queries ``[BT * GP, D]``, the K/V base pointers and token strides and its
    union-list pointers."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    # 64-bit: head strides of a head-major view times the head index pass 2**31 at 1M tokens
    i_b, i_h = (i_bh // HKV).to(tl.int64), (i_bh % HKV).to(tl.int64)
    o_tok, o_hh, m_row = _group_rows(i_t, Tq, SHAPE.BT, SHAPE.G, SHAPE.GP)
    o_head = i_h * SHAPE.G + o_hh
    b_q = load_rows(p_q + i_b * s_qb, _row_offsets(o_tok, o_head, s_q), m_row, SHAPE.D)
    p_kh, p_vh, s_kt, s_vt = _kv_heads(p_k, p_v, i_b, i_h, s_kb, s_k, s_vb, s_v)
    i_list = i_bh * n_tiles + i_t
    return (i_b, o_tok, o_head, m_row, b_q, p_kh, p_vh, s_kt, s_vt, Tk - Tq + o_tok, i_list,
            i_list.to(tl.int64) * U)


# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too
@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles"])
def _fwd_kernel(p_q, p_k, p_v, p_o, p_lse, p_union, p_bits, p_n_union,
                s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_vb: tl.int64, s_v, s_ob: tl.int64, s_o,
                Tq, Tk, HKV, n_tiles, U, scale_log2,
                SHAPE: tl.constexpr):
    """Per-token forward: ``o [B, Tq, HQ, D]``, ``lse [B, HQ, Tq]`` of one token tile's rows
    (``p_union / p_bits [B * HKV, n_tiles, U]``, ``p_n_union [B * HKV, n_tiles]``: the tile's
    union of blocks, ``_tile_union``)."""
    DOT_PREC: tl.constexpr = SHAPE.DOT_PREC
    ROWS: tl.constexpr = SHAPE.BT * SHAPE.GP
    D: tl.constexpr = SHAPE.D
    i_b, o_tok, o_head, m_row, b_q, p_kh, p_vh, s_kt, s_vt, t_abs, i_list, o_list = _token_setup(
        p_q, p_k, p_v, s_qb, s_q, s_kb, s_k, s_vb, s_v, Tq, Tk, HKV, n_tiles, U, SHAPE)
    o_bit = tl.arange(0, ROWS) // SHAPE.GP
    p_ub, p_bb = p_union + o_list, p_bits + o_list

    b_m = tl.full([ROWS], float("-inf"), tl.float32)  # running max, log2 domain
    b_l = tl.zeros([ROWS], tl.float32)
    b_acc = tl.zeros([ROWS, D], tl.float32)
    for i in tl.range(tl.load(p_n_union + i_list)):
        b_k, b_v, m_s = _union_block(p_ub + i, p_bb + i, o_bit, t_abs, p_kh, p_vh, s_kt, s_vt,
                                     Tk, SHAPE.C, D)
        b_s = tl.where(m_s, _scores(b_q, b_k, scale_log2, DOT_PREC), float("-inf"))
        b_m, b_l, b_acc = online_softmax_step(b_s, b_v, b_m, b_l, b_acc, DOT_PREC)

    b_o, b_lse = softmax_output(b_m, b_l, b_acc)
    store_rows(p_o + i_b * s_ob, _row_offsets(o_tok, o_head, s_o), m_row, b_o, D)
    tl.store(p_lse + (i_b * HKV * SHAPE.G + o_head) * Tq + o_tok, b_lse, mask=m_row)


@triton.jit(do_not_specialize=["Tq"])
def _delta_kernel(p_o, p_do, p_delta, s_ob: tl.int64, s_o, s_dob: tl.int64, s_do, Tq,
                  H: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr):
    """delta[b, h, t] = rowsum(dO * O) for all heads of ``BT`` tokens."""
    i_t, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_tok, o_head, m_row = _group_rows(i_t, Tq, BT, H, HP)
    o_head = o_head.to(tl.int64)
    b_o = load_rows(p_o + i_b * s_ob, _row_offsets(o_tok, o_head, s_o), m_row, D).to(tl.float32)
    b_do = load_rows(p_do + i_b * s_dob, _row_offsets(o_tok, o_head, s_do), m_row,
                     D).to(tl.float32)
    tl.store(p_delta + (i_b * H + o_head) * Tq + o_tok, tl.sum(b_o * b_do, 1), mask=m_row)


@triton.jit
def _row_stats(p_lse, p_delta, i_b, o_tok, o_head, m_row, Tq, HKV, G: tl.constexpr):
    """The rows' forward LSE in log2 units and ``delta`` (``[B, HQ, Tq]`` fp32 each)."""
    o_stat = (i_b * HKV * G + o_head) * Tq + o_tok
    b_lse2 = tl.load(p_lse + o_stat, mask=m_row, other=0.0) * LOG2E_K
    return b_lse2, tl.load(p_delta + o_stat, mask=m_row, other=0.0)


@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles"])
def _dq_kernel(p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_union, p_bits, p_n_union,
               s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_vb: tl.int64, s_v, s_dob: tl.int64, s_do,
               s_dqb: tl.int64, s_dq,
               Tq, Tk, HKV, n_tiles, U, scale_log2, scale,
               SHAPE: tl.constexpr):
    """Per-token dQ ``[B, Tq, HQ, D]`` of one token tile's rows."""
    DOT_PREC: tl.constexpr = SHAPE.DOT_PREC
    ROWS: tl.constexpr = SHAPE.BT * SHAPE.GP
    D: tl.constexpr = SHAPE.D
    i_b, o_tok, o_head, m_row, b_q, p_kh, p_vh, s_kt, s_vt, t_abs, i_list, o_list = _token_setup(
        p_q, p_k, p_v, s_qb, s_q, s_kb, s_k, s_vb, s_v, Tq, Tk, HKV, n_tiles, U, SHAPE)
    b_do = load_rows(p_do + i_b * s_dob, _row_offsets(o_tok, o_head, s_do), m_row, D)
    b_lse2, b_delta = _row_stats(p_lse, p_delta, i_b, o_tok, o_head, m_row, Tq, HKV, SHAPE.G)
    o_bit = tl.arange(0, ROWS) // SHAPE.GP
    p_ub, p_bb = p_union + o_list, p_bits + o_list

    b_dq = tl.zeros([ROWS, D], tl.float32)
    for i in tl.range(tl.load(p_n_union + i_list)):
        b_k, b_v, m_s = _union_block(p_ub + i, p_bb + i, o_bit, t_abs, p_kh, p_vh, s_kt, s_vt,
                                     Tk, SHAPE.C, D)
        # where, not a -inf score: a row with no key at all has lse = -inf
        b_p = tl.where(m_s, tl.exp2(_scores(b_q, b_k, scale_log2, DOT_PREC)
                                    - b_lse2[:, None]), 0.0)
        b_dq = _dq_update(b_p, b_do, b_k, b_v, b_delta, b_dq, DOT_PREC)
    o_dq = _row_offsets(o_tok, o_head, s_dq)
    store_rows(p_dq + i_b * s_dqb, o_dq, m_row, b_dq * scale, D)


# ----------------------------------------------------------------------------------------------
# kernels: tile selections (forward, dQ)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile_rows(i_p, Tq, Tk, SHAPE: tl.constexpr):
    """The ``BT * GP`` rows of tile program ``i_p``: part ``i_p % NSPLIT`` (``BT`` consecutive
    tokens) of query tile ``i_p // NSPLIT``, token-major, heads padded to ``GP``. Returns the
    tile, each row's query token, absolute position, head within the group and validity (a real
    head of a real query of the tile), and the part's first real position."""
    i_j = i_p // SHAPE.NSPLIT
    t0 = Tk - Tq  # absolute position of query 0
    p_first = (t0 // SHAPE.QT + i_j) * SHAPE.QT + (i_p % SHAPE.NSPLIT) * SHAPE.BT
    o_m = tl.arange(0, SHAPE.BT * SHAPE.GP)
    o_in = o_m // SHAPE.GP  # token within the part (BT > QT pads a small tile)
    o_pos = p_first + o_in
    o_tok = o_pos - t0
    o_hh = o_m % SHAPE.GP
    m_row = (o_in < SHAPE.QT) & (o_tok >= 0) & (o_tok < Tq) & (o_hh < SHAPE.G)
    return i_j, o_tok, o_pos, o_hh, m_row, tl.maximum(p_first, t0)


@triton.jit
def _tile_setup(p_q, p_k, p_v, p_idx, s_qb, s_q, s_kb, s_k, s_vb, s_v, s_ib, s_i, Tq, Tk, HKV,
                S, SHAPE: tl.constexpr):
    """What the forward and dQ programs of one tile part share: its rows and queries
    ``[BT * GP, D]``, the K/V base pointers and token strides, the pointer to the tile's block
    list and how many of its blocks lie entirely before the part (``n_free``, a prefix of the
    ascending list: no causal mask) and in all (``n_sel``)."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // HKV).to(tl.int64), (i_bh % HKV).to(tl.int64)
    i_j, o_tok, o_pos, o_hh, m_row, p_min = _tile_rows(i_p, Tq, Tk, SHAPE)
    o_head = i_h * SHAPE.G + o_hh
    b_q = load_rows(p_q + i_b * s_qb, _row_offsets(o_tok, o_head, s_q), m_row, SHAPE.D)
    s_it, s_ih = s_i
    p_sel = p_idx + i_b * s_ib + i_j.to(tl.int64) * s_it + i_h * s_ih
    o_s = tl.arange(0, SHAPE.SLOTS_P)
    b_sel = tl.load(p_sel + o_s, mask=o_s < S, other=-1)
    m_sel = b_sel >= 0
    # block c ends at or before the first position p_min: (c + 1) * C <= p_min + 1
    n_free = tl.sum((m_sel & (b_sel < (p_min + 1) // SHAPE.C)).to(tl.int32))
    n_sel = tl.sum(m_sel.to(tl.int32))
    p_kh, p_vh, s_kt, s_vt = _kv_heads(p_k, p_v, i_b, i_h, s_kb, s_k, s_vb, s_v)
    return i_b, o_tok, o_pos, o_head, m_row, b_q, p_kh, p_vh, s_kt, s_vt, p_sel, n_free, n_sel


@triton.jit(do_not_specialize=["Tq", "Tk", "S"])
def _tile_fwd_kernel(p_q, p_k, p_v, p_o, p_lse, p_idx,
                     s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_vb: tl.int64, s_v,
                     s_ob: tl.int64, s_o, s_ib: tl.int64, s_i,
                     Tq, Tk, HKV, S, scale_log2,
                     SHAPE: tl.constexpr):
    """Tile forward: ``o [B, Tq, HQ, D]``, ``lse [B, HQ, Tq]`` of one tile part's rows, over the
    blocks of ``block_idx [B, n_tiles, HKV, S]`` (``p_idx``) row ``(b, tile, h)``."""
    DOT_PREC: tl.constexpr = SHAPE.DOT_PREC
    ROWS: tl.constexpr = SHAPE.BT * SHAPE.GP
    D: tl.constexpr = SHAPE.D
    i_b, o_tok, o_pos, o_head, m_row, b_q, p_kh, p_vh, s_kt, s_vt, p_sel, n_free, n_sel = \
        _tile_setup(p_q, p_k, p_v, p_idx, s_qb, s_q, s_kb, s_k, s_vb, s_v, s_ib, s_i, Tq, Tk,
                    HKV, S, SHAPE)

    b_m = tl.full([ROWS], float("-inf"), tl.float32)  # running max, log2 domain
    b_l = tl.zeros([ROWS], tl.float32)
    b_acc = tl.zeros([ROWS, D], tl.float32)
    for i in tl.range(n_free):  # blocks entirely before the part: every key is seen
        b_k, b_v, _ = _load_block(p_kh, p_vh, s_kt, s_vt, tl.load(p_sel + i), Tk, SHAPE.C,
                                  D)
        b_m, b_l, b_acc = online_softmax_step(_scores(b_q, b_k, scale_log2, DOT_PREC),
                                              b_v, b_m, b_l, b_acc, DOT_PREC)
    for i in tl.range(n_free, n_sel):  # the tile's own block (and any later one): causal
        b_k, b_v, o_key = _load_block(p_kh, p_vh, s_kt, s_vt, tl.load(p_sel + i), Tk, SHAPE.C,
                                      D)
        b_s = tl.where(o_key[None, :] <= o_pos[:, None],
                       _scores(b_q, b_k, scale_log2, DOT_PREC), float("-inf"))
        b_m, b_l, b_acc = online_softmax_step(b_s, b_v, b_m, b_l, b_acc, DOT_PREC)

    b_o, b_lse = softmax_output(b_m, b_l, b_acc)
    store_rows(p_o + i_b * s_ob, _row_offsets(o_tok, o_head, s_o), m_row, b_o, D)
    tl.store(p_lse + (i_b * HKV * SHAPE.G + o_head) * Tq + o_tok, b_lse, mask=m_row)


@triton.jit(do_not_specialize=["Tq", "Tk", "S"])
def _tile_dq_kernel(p_q, p_k, p_v, p_do, p_lse, p_delta, p_dq, p_idx,
                    s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_vb: tl.int64, s_v,
                    s_dob: tl.int64, s_do, s_dqb: tl.int64, s_dq, s_ib: tl.int64, s_i,
                    Tq, Tk, HKV, S, scale_log2, scale,
                    SHAPE: tl.constexpr):
    """Tile dQ ``[B, Tq, HQ, D]`` of one tile part's rows."""
    DOT_PREC: tl.constexpr = SHAPE.DOT_PREC
    ROWS: tl.constexpr = SHAPE.BT * SHAPE.GP
    D: tl.constexpr = SHAPE.D
    i_b, o_tok, o_pos, o_head, m_row, b_q, p_kh, p_vh, s_kt, s_vt, p_sel, n_free, n_sel = \
        _tile_setup(p_q, p_k, p_v, p_idx, s_qb, s_q, s_kb, s_k, s_vb, s_v, s_ib, s_i, Tq, Tk,
                    HKV, S, SHAPE)
    b_do = load_rows(p_do + i_b * s_dob, _row_offsets(o_tok, o_head, s_do), m_row, D)
    b_lse2, b_delta = _row_stats(p_lse, p_delta, i_b, o_tok, o_head, m_row, Tq, HKV, SHAPE.G)

    b_dq = tl.zeros([ROWS, D], tl.float32)
    for i in tl.range(n_free):
        b_k, b_v, _ = _load_block(p_kh, p_vh, s_kt, s_vt, tl.load(p_sel + i), Tk, SHAPE.C,
                                  D)
        b_p = tl.exp2(_scores(b_q, b_k, scale_log2, DOT_PREC) - b_lse2[:, None])
        b_dq = _dq_update(b_p, b_do, b_k, b_v, b_delta, b_dq, DOT_PREC)
    for i in tl.range(n_free, n_sel):
        b_k, b_v, o_key = _load_block(p_kh, p_vh, s_kt, s_vt, tl.load(p_sel + i), Tk, SHAPE.C,
                                      D)
        # where, not a -inf score: a row that sees no key at all has lse = -inf
        b_p = tl.where(o_key[None, :] <= o_pos[:, None],
                       tl.exp2(_scores(b_q, b_k, scale_log2, DOT_PREC) - b_lse2[:, None]),
                       0.0)
        b_dq = _dq_update(b_p, b_do, b_k, b_v, b_delta, b_dq, DOT_PREC)
    o_dq = _row_offsets(o_tok, o_head, s_dq)
    store_rows(p_dq + i_b * s_dqb, o_dq, m_row, b_dq * scale, D)


# ----------------------------------------------------------------------------------------------
# kernels: dK/dV (both selection kinds)
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["Tq", "Tk", "n_blocks"])
def _dkv_kernel(p_q, p_k, p_v, p_do, p_lse, p_delta, p_dk, p_dv, p_part_k, p_part_v, p_rows,
                p_items,
                s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_vb: tl.int64, s_v, s_dob: tl.int64,
                s_do,
                Tq, Tk, HKV, n_blocks, scale_log2, scale,
                SHAPE: tl.constexpr, ATOMIC: tl.constexpr):
    """One work item: key block x KV head x chunk of the selection rows that chose the block
    (``p_rows[start:end]``: query tokens for ``QT = 1``, query tiles of ``QT`` tokens else).
    A step gathers ``NT`` list entries x ``BT`` consecutive tokens x ``GP`` heads (``NT > 1``
    only with ``BT = QT``; a tile larger than a step takes ``QT / BT`` steps). Writes the block's
    ``dk, dv`` rows (fp32 ``[B, Tk, HKV, D]``), or adds to them (``ATOMIC``), or writes its
    chunk's partial sums to scratch row ``slot`` of ``p_part_k, p_part_v [n_parts, C, D]``."""
    DOT_PREC: tl.constexpr = SHAPE.DOT_PREC
    C: tl.constexpr = SHAPE.C
    D: tl.constexpr = SHAPE.D
    GP: tl.constexpr = SHAPE.GP
    BT: tl.constexpr = SHAPE.BT
    QT: tl.constexpr = SHAPE.QT
    NSUB: tl.constexpr = QT // BT
    s_qt, s_qh = s_q
    s_kt, s_kh = s_k
    s_vt, s_vh = s_v
    s_dot, s_doh = s_do
    p_item = p_items + tl.program_id(0) * 5
    key, start, end = tl.load(p_item), tl.load(p_item + 1), tl.load(p_item + 2)
    slot = tl.load(p_item + 3)
    # 32-bit block index: the key positions and causal masks of every step derive from it, and
    # 64-bit ones cost 3 ms of 53 at 128K (items are int64 for their token offsets)
    i_bh, i_c = key // n_blocks, (key % n_blocks).to(tl.int32)
    i_b, i_h = (i_bh // HKV).to(tl.int64), (i_bh % HKV).to(tl.int64)
    b_k, b_v, o_key = _load_block(p_k + i_b * s_kb + i_h * s_kh, p_v + i_b * s_vb + i_h * s_vh,
                                  s_kt, s_vt, i_c, Tk, C, D)
    m_key = o_key < Tk
    o_m = tl.arange(0, SHAPE.NT * BT * GP)
    o_e = o_m // (BT * GP)  # list entry within the step
    o_in = (o_m // GP) % BT  # token within the entry's part
    o_hh = o_m % GP
    o_head = i_h * SHAPE.G + o_hh
    t0 = Tk - Tq
    shift = t0 % QT  # query 0's place in its tile: tile r starts at query r * QT - shift

    b_dk = tl.zeros([C, D], tl.float32)
    b_dv = tl.zeros([C, D], tl.float32)
    for i in tl.range(start * NSUB, end * NSUB, SHAPE.NT):
        o_pos = i // NSUB + o_e
        m_ent = o_pos < end
        o_row = tl.load(p_rows + o_pos, mask=m_ent, other=0)
        o_tok = o_row * QT - shift + (i % NSUB) * BT + o_in
        m_row = m_ent & (o_hh < SHAPE.G) & (o_tok >= 0) & (o_tok < Tq)
        o_tok64 = o_tok.to(tl.int64)
        b_q = load_rows(p_q + i_b * s_qb, o_tok64 * s_qt + o_head * s_qh, m_row, D)
        b_do = load_rows(p_do + i_b * s_dob, o_tok64 * s_dot + o_head * s_doh, m_row, D)
        o_stat = (i_b * HKV * SHAPE.G + o_head) * Tq + o_tok
        b_lse2 = tl.load(p_lse + o_stat, mask=m_row, other=0.0) * LOG2E_K
        b_delta = tl.load(p_delta + o_stat, mask=m_row, other=0.0)
        # transposed scores [C, rows]: the block's keys are the long side of every product
        b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC) * scale_log2
        m_st = m_row[None, :] & (o_key[:, None] <= (t0 + o_tok)[None, :])
        b_pt = tl.where(m_st, tl.exp2(b_st - b_lse2[None, :]), 0.0)
        b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=DOT_PREC)
        b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk += tl.dot(b_dst.to(b_q.dtype), b_q, input_precision=DOT_PREC)
    b_dk *= scale

    o_out = (i_b * Tk + o_key) * HKV * D + i_h * D  # dk, dv: contiguous fp32 [B, Tk, HKV, D]
    if slot < 0:  # the block's only chunk owns its rows
        store_rows(p_dk, o_out, m_key, b_dk, D)
        store_rows(p_dv, o_out, m_key, b_dv, D)
    elif ATOMIC:
        o_d = tl.arange(0, D)
        tl.atomic_add(p_dk + o_out[:, None] + o_d[None, :], b_dk, mask=m_key[:, None],
                      sem="relaxed")
        tl.atomic_add(p_dv + o_out[:, None] + o_d[None, :], b_dv, mask=m_key[:, None],
                      sem="relaxed")
    else:
        o_part = slot.to(tl.int64) * C * D + tl.arange(0, C) * D
        store_rows(p_part_k, o_part, m_key, b_dk, D)
        store_rows(p_part_v, o_part, m_key, b_dv, D)


@triton.jit(do_not_specialize=["Tk", "n_blocks"])
def _reduce_parts_kernel(p_dk, p_dv, p_part_k, p_part_v, p_items, Tk, HKV, n_blocks,
                         C: tl.constexpr, D: tl.constexpr):
    """Sum a split block's chunk partials in slot order (deterministic) into dk, dv."""
    p_item = p_items + tl.program_id(0) * 5
    n_parts = tl.load(p_item + 4)  # > 0 only on the first chunk of a split block
    if n_parts > 0:
        key, slot = tl.load(p_item), tl.load(p_item + 3)
        i_bh, i_c = key // n_blocks, (key % n_blocks).to(tl.int32)
        i_b, i_h = (i_bh // HKV).to(tl.int64), i_bh % HKV
        o_key = i_c * C + tl.arange(0, C)
        m_key = o_key < Tk
        o_part = slot.to(tl.int64) * C * D + tl.arange(0, C) * D
        b_dk = tl.zeros([C, D], tl.float32)
        b_dv = tl.zeros([C, D], tl.float32)
        for j in range(n_parts):
            b_dk += load_rows(p_part_k + j * C * D, o_part, m_key, D)
            b_dv += load_rows(p_part_v + j * C * D, o_part, m_key, D)
        o_out = (i_b * Tk + o_key) * HKV * D + i_h * D
        store_rows(p_dk, o_out, m_key, b_dk, D)
        store_rows(p_dv, o_out, m_key, b_dv, D)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
_LAUNCH = AttnLaunch()  # the defaults (``launch=None``); tests swap it for one test


def _strides(*tensors: torch.Tensor) -> list:
    """``strides_of`` each ``[B, T, H, D]`` tensor, in order, flat."""
    return [s for x in tensors for s in strides_of(x)]


def _tile_tokens(rows: int, gp: int) -> int:
    """Query tokens per tile for about ``rows`` rows: a power of two, with at least the 16 rows
    tl.dot needs, and at least 2 tokens: compiled single-token tiles gave wrong outputs (rel. err
    0.9 at G=16, bf16) and an illegal address at 64K tokens on the H200 with triton 3.6, under
    every warps/stages setting tried, while 2-token tiles were right and as fast
    (``docs/design.md``, "Triton tile minimum")."""
    return min(pow2(max(rows // gp, cdiv(16, gp), 2)), _MAX_TILE_TOKENS)


def _tile_part(query_tile: int, gp: int, rows: int, min_rows: int, head_dim: int):
    """Tokens per program ``BT`` and programs per query tile ``NSPLIT`` for the tile forward / dQ:
    the whole tile when ``query_tile * gp`` rows lie in ``[min_rows, rows]``; split into parts of
    ``rows // gp`` tokens (at least 2) when larger; padded up to ``min_rows`` rows (at least 16)
    when smaller. ``head_dim > 128`` halves ``rows`` (the fp32 accumulator ``[rows, D]`` lives in
    registers)."""
    rows = pow2(rows if head_dim <= 128 else rows // 2)
    bt = max(min(query_tile, max(rows // gp, 2)), cdiv(max(min_rows, 16), gp))
    bt = pow2(bt)
    return bt, cdiv(query_tile, bt)


def _dkv_plan(query_tile: int, gp: int, cfg: AttnLaunch):
    """``(BT, NT, chunk)`` of the dK/dV kernel: a step gathers ``NT`` list entries of ``BT``
    tokens each; a program takes at most ``chunk`` list entries (about ``dkv_chunk`` tokens)."""
    if query_tile == 1:
        return 1, _tile_tokens(cfg.dkv_rows, gp), cfg.dkv_chunk
    rows = max(pow2(cfg.tile_dkv_rows), 2 * gp, 16)  # at least 2 tokens, and tl.dot's 16 rows
    bt = min(query_tile, rows // gp)
    return bt, max(rows // (query_tile * gp), 1), max(cfg.dkv_chunk // query_tile, 1)


def _dot_precision(x: torch.Tensor) -> str:
    # fp32 inputs are the accuracy path: keep full-precision products instead of tf32
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _check_supported(head_dim: int, n_groups: int) -> None:
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"triton sparse attention supports head dims {_HEAD_DIMS}, got {head_dim}")
    if n_groups > 64:
        raise ValueError(f"triton sparse attention supports up to 64 query heads per KV head, "
                         f"got {n_groups}")


def _split_blocks(block_idx: torch.Tensor, block_size: int):
    """Re-express blocks larger than the kernels' key tile as runs of tile-sized sub-blocks."""
    r = max(block_size // _KEY_TILE, 1)
    if r == 1:
        return block_idx, block_size
    sub = block_idx[..., None] * r + torch.arange(r, device=block_idx.device, dtype=torch.int32)
    sub = torch.where(block_idx[..., None] < 0, -1, sub)
    return sub.flatten(-2).to(torch.int32), _KEY_TILE


def _tile_union(block_idx: torch.Tensor, tokens: int):
    """Per (batch x KV head, tile of ``tokens`` query tokens): the ascending union of the tokens'
    blocks ``[B*HKV, n_tiles, tokens*S]`` int32, a bitmask per entry of the tokens that chose it
    (bit j = token j of the tile), and the union sizes ``[B*HKV, n_tiles]`` int32."""
    B, Tq, H, S = block_idx.shape
    n_tiles = cdiv(Tq, tokens)
    idx = F.pad(block_idx, (0, 0, 0, 0, 0, n_tiles * tokens - Tq), value=-1)
    idx = idx.reshape(B, n_tiles, tokens, H, S).permute(0, 3, 1, 2, 4).reshape(B * H, n_tiles, -1)
    big = torch.iinfo(torch.int32).max
    vals, order = torch.where(idx < 0, big, idx).sort(dim=-1)
    first = torch.ones_like(vals, dtype=torch.bool)
    first[..., 1:] = vals[..., 1:] != vals[..., :-1]
    run = first.cumsum(-1) - 1  # position of each entry's block in the union
    union = torch.full_like(vals, big).scatter_(-1, run, vals)
    # a token holds a block once, so the sum of its tokens' bits is their OR
    bits = torch.zeros_like(order).scatter_add_(-1, run, 1 << (order // S))
    bits = bits.to(torch.int32 if tokens <= 32 else torch.int64)  # int32 wraps bit 31: still a bit
    count = (first & (vals != big)).sum(-1, dtype=torch.int32)
    return union, bits, count


def _groups(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """GQA group size and its power-of-two padding (the rows of one token in a tile)."""
    G = q.shape[2] // k.shape[2]
    return G, pow2(G)


def _token_tiles(q, k, block_idx, rows: int):
    """The query-tile plan of the per-token forward and dQ kernels for tiles of about ``rows``
    rows: ``(G, GP, BT, union, bits, count)`` (``_tile_union`` of ``BT``-token tiles)."""
    G, GP = _groups(q, k)
    BT = _tile_tokens(rows, GP)
    return (G, GP, BT) + _tile_union(block_idx, BT)


def _attn_fwd(q, k, v, block_idx, block_size, scale, cfg: AttnLaunch):
    """Per-token selections ``block_idx [B, Tq, HKV, S]``."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, GP, BT, union, bits, count = _token_tiles(q, k, block_idx, cfg.fwd_rows)
    o = empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    lse = empty(B, HQ, Tq, dtype=torch.float32, device=q.device)
    n_tiles = count.shape[1]
    # token tiles vary fastest: the programs resident together read one KV head's keys (L2 reuse)
    _fwd_kernel[(n_tiles, B * HKV)](
        q, k, v, o, lse, union, bits, count, *_strides(q, k, v, o),
        Tq, Tk, HKV, n_tiles, union.shape[-1], scale * LOG2E,
        AttnShape(G, GP, BT, block_size, D, _dot_precision(q)),
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, lse


def _tile_fwd(q, k, v, block_idx, block_size, scale, query_tile, cfg: AttnLaunch):
    """Tile selections ``block_idx [B, n_tiles, HKV, S]``."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, GP = _groups(q, k)
    BT, NSPLIT = _tile_part(query_tile, GP, cfg.tile_fwd_rows, cfg.tile_min_rows, D)
    o = empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    lse = empty(B, HQ, Tq, dtype=torch.float32, device=q.device)
    n_tiles, S = block_idx.shape[1], block_idx.shape[3]
    # tile parts vary fastest: the programs resident together read one KV head's keys (L2 reuse)
    _tile_fwd_kernel[(n_tiles * NSPLIT, B * HKV)](
        q, k, v, o, lse, block_idx, *_strides(q, k, v, o, block_idx),
        Tq, Tk, HKV, S, scale * LOG2E,
        AttnShape(G, GP, BT, block_size, D, _dot_precision(q), QT=query_tile, NSPLIT=NSPLIT,
                  SLOTS_P=pow2(S)),
        num_warps=cfg.tile_fwd_warps, num_stages=cfg.tile_fwd_stages)
    return o, lse


def _delta(o, do, dlse):
    B, Tq, HQ, D = o.shape
    HP = pow2(HQ)
    BT = max(1, 64 // HP)
    delta = empty(B, HQ, Tq, dtype=torch.float32, device=o.device)
    _delta_kernel[(cdiv(Tq, BT), B)](o, do, delta, *_strides(o, do), Tq,
                                     H=HQ, HP=HP, BT=BT, D=D, num_warps=8)
    # d lse / d s = p, so an lse gradient only shifts delta
    return delta if dlse is None else (delta - dlse).contiguous()


def _attn_dq(q, k, v, do, lse, delta, block_idx, block_size, scale, cfg: AttnLaunch):
    """Per-token selections."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, GP, BT, union, bits, count = _token_tiles(q, k, block_idx, cfg.dq_rows)
    dq = empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    n_tiles = count.shape[1]
    _dq_kernel[(n_tiles, B * HKV)](
        q, k, v, do, lse, delta, dq, union, bits, count, *_strides(q, k, v, do, dq),
        Tq, Tk, HKV, n_tiles, union.shape[-1], scale * LOG2E, scale,
        AttnShape(G, GP, BT, block_size, D, _dot_precision(q)),
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)
    return dq


def _tile_dq(q, k, v, do, lse, delta, block_idx, block_size, scale, query_tile,
             cfg: AttnLaunch):
    """Tile selections."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, GP = _groups(q, k)
    BT, NSPLIT = _tile_part(query_tile, GP, cfg.tile_dq_rows, cfg.tile_min_rows, D)
    dq = empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    n_tiles, S = block_idx.shape[1], block_idx.shape[3]
    _tile_dq_kernel[(n_tiles * NSPLIT, B * HKV)](
        q, k, v, do, lse, delta, dq, block_idx, *_strides(q, k, v, do, dq, block_idx),
        Tq, Tk, HKV, S, scale * LOG2E, scale,
        AttnShape(G, GP, BT, block_size, D, _dot_precision(q), QT=query_tile, NSPLIT=NSPLIT,
                  SLOTS_P=pow2(S)),
        num_warps=cfg.tile_dq_warps, num_stages=cfg.tile_dq_stages)
    return dq


def _attn_dkv(q, k, v, do, lse, delta, block_idx, block_size, scale, deterministic,
              query_tile, cfg: AttnLaunch):
    """Both selection kinds: ``block_idx`` rows are tokens (``query_tile = 1``) or tiles."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, GP = _groups(q, k)
    BT, NT, chunk = _dkv_plan(query_tile, GP, cfg)
    n_blocks = cdiv(Tk, block_size)
    rows, items, n_parts = block_work_items(block_idx, n_blocks, chunk)
    # blocks nobody chose get no program: their gradient is the zero they start from
    dk = torch.zeros(B, Tk, HKV, D, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    reduce = deterministic and n_parts > 0
    parts = [empty(n_parts, block_size, D, dtype=torch.float32, device=k.device)
             for _ in range(2)] if reduce else [dk, dv]  # unused unless reduce
    tiled = query_tile > 1
    if items.shape[0]:
        _dkv_kernel[(items.shape[0],)](
            q, k, v, do, lse, delta, dk, dv, *parts, rows, items, *_strides(q, k, v, do),
            Tq, Tk, HKV, n_blocks, scale * LOG2E, scale,
            AttnShape(G, GP, BT, block_size, D, _dot_precision(q), QT=query_tile, NT=NT),
            ATOMIC=not deterministic,
            num_warps=cfg.tile_dkv_warps if tiled else cfg.dkv_warps,
            num_stages=cfg.tile_dkv_stages if tiled else cfg.dkv_stages)
    if reduce:
        _reduce_parts_kernel[(items.shape[0],)](dk, dv, *parts, items, Tk, HKV, n_blocks,
                                                C=block_size, D=D, num_warps=8)
    return dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------
# entry points (autograd: the ``pisa::sparse_attn`` custom op in ``__init__``)
# ----------------------------------------------------------------------------------------------
def _prepare(q: torch.Tensor, k: torch.Tensor, block_idx: torch.Tensor, block_size: int):
    """Check kernel support and re-express the selection in kernel-sized blocks (unit slot
    stride: the tile kernels read a row's slots as one vector)."""
    _check_supported(q.shape[-1], q.shape[2] // k.shape[2])
    block_idx, block_size = _split_blocks(block_idx, block_size)
    return (block_idx if block_idx.stride(-1) == 1 else block_idx.contiguous()), block_size


def attn_fwd_triton(q, k, v, block_idx, block_size, scale, query_tile: int = 1, *,
                    launch: AttnLaunch | None = None):
    """Forward: ``o [B, Tq, HQ, D]`` (q's dtype) and ``lse [B, HQ, Tq]`` fp32 (natural log, ``-inf``
    and ``o = 0`` for a query with no key). ``block_idx`` is per token (``query_tile = 1``,
    ``[B, Tq, HKV, S]``) or per query tile (``[B, n_query_tiles(Tq, Tk, query_tile), HKV, S]``).
    ``launch``: the kernels' launch knobs (``utils.launch.AttnLaunch``; default: the tuned
    ones)."""
    block_idx, block_size = _prepare(q, k, block_idx, block_size)
    launch = launch or _LAUNCH
    if query_tile == 1:
        return _attn_fwd(q, k, v, block_idx, block_size, scale, launch)
    return _tile_fwd(q, k, v, block_idx, block_size, scale, query_tile, launch)


def attn_bwd_triton(do, dlse, q, k, v, o, lse, block_idx, block_size, scale, deterministic,
                    query_tile: int = 1, *, launch: AttnLaunch | None = None):
    """Backward: ``dq, dk, dv``; ``deterministic=True`` sums split blocks in a fixed order.
    ``launch`` as in ``attn_fwd_triton``."""
    block_idx, block_size = _prepare(q, k, block_idx, block_size)
    launch = launch or _LAUNCH
    do = torch.zeros_like(o) if do is None else do
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = _delta(o, do, dlse)
    if query_tile == 1:
        dq = _attn_dq(q, k, v, do, lse, delta, block_idx, block_size, scale, launch)
    else:
        dq = _tile_dq(q, k, v, do, lse, delta, block_idx, block_size, scale, query_tile, launch)
    dk, dv = _attn_dkv(q, k, v, do, lse, delta, block_idx, block_size, scale, deterministic,
                       query_tile, launch)
    return dq, dk, dv
