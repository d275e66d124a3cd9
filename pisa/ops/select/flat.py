"""Flat block selection (Triton): ``selector="flat_lse"`` (exact block LSE of every causal block,
the mass-optimal oracle PISA approximates) and ``"flat_mean"`` (mean-pooled keys, BSA/MoBA style),
per query token or per query tile (``query_tile``).

A program per (group of query tiles, KV head, batch) streams over the causal blocks with
``[rows, D] x [D, blocks]`` dots and keeps each tile's top-K online in registers; no score
matrix ever reaches memory. A tile's rows are its tokens' ``Qt * G`` query rows, their per-token
scores folded by ``tile_reduce``, or (``"qmean"``) its ``G`` mean queries, computed in the
prologue. Semantics are those of ``naive.naive_select``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..pyramid import Pyramid
from ..utils.config import SelectConfig, n_query_tiles
from ..utils.geometry import cdiv, pow2
from ..utils.launch import FlatSelectLaunch
from ..utils.op import (KEY_NONE, dot_nt_f32, empty, key_scores, pack, token_sums,
                        write_selection)
from ..utils.triton_utils import F32_PREC, pick_of, strides_of
from ..utils.walk_triton import key_logits
from .triton import (REDUCE_ID, SCORER_ID, mean_rows, rows_at, sequence_start, split_rows,
                     tile_token_scores)


class Scan(NamedTuple):
    """A flat-scan program (one ``tl.constexpr``): ``BT`` selection rows (tiles of ``QT``
    positions) of ``QR`` row tokens x ``GP`` heads each, against the causal blocks in chunks."""

    G: int      # query heads per KV head
    GP: int     # rows a token: G padded (so that the program has >= 16 rows)
    BT: int     # selection rows (tiles) a program
    QT: int     # query positions a tile (1: per-token selection)
    QR: int     # row tokens a tile: QT, or 1 for qmean tiles (their mean query)
    D: int      # head dim
    DP: int     # D padded to a power of two >= 16
    C: int      # keys a block
    TOP_P: int  # best keys a tile keeps while scanning (>= TOPK, a power of two >= 16)
    NB: int     # blocks a chunk (a top-K merge)
    LB: int     # blocks a key load (LB * C rows)


class FlatScoring(NamedTuple):
    """How the scan scores a block for a tile."""

    FROM_KEYS: bool  # from the block's keys (flat_lse); else by its leaf mean (flat_mean)
    SCORER: int      # FROM_KEYS: 0 lse, 1 mean, 2 meanvar over the keys (SCORER_ID)
    REDUCE: int      # how a tile's row tokens fold: 0 sum, 1 log-sum-exp (REDUCE_ID)
    MEAN: bool       # qmean tiles: the rows are the tile's per-head mean queries
    Q_RESID: bool    # the mean rows carry 16-bit residuals (MEAN against 16-bit keys)




# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too;
# the selection outputs' batch strides (n_tiles * HKV * slots) follow the length, so are not
# specialised
@triton.jit(do_not_specialize=["Tq", "Tk", "n_tiles", "tile0", "s_ib", "s_cb"])
def _flat_select_kernel(
        p_q, p_k, p_means, p_idx, p_cnt, p_blk0, Tq, Tk, n_tiles, tile0, scale,
        s_qb: tl.int64, s_q, s_kb: tl.int64, s_k, s_mb: tl.int64, s_m,
        s_ib: tl.int64, s_i, s_cb: tl.int64, s_ct,
        SCAN: tl.constexpr, SCORE: tl.constexpr, PICK: tl.constexpr, VARLEN: tl.constexpr):
    """Flat top-K over every free block ``[s0 + 1, cur - 2]`` (``s0`` the sink: 0, or with
    ``VARLEN`` its sequence's first block in a packed layout, ``sequence_start``) of the ``BT``
    tiles (selection rows) of program ``i_t``: absolute tiles ``tile0 + i_t * BT ..`` of ``QT``
    positions (``QT = 1``: query tokens). A tile's rows: ``QR = QT`` tokens of ``GP`` heads
    (positions that are no query are zero rows), or with ``MEAN`` (``QR = 1``) its per-head mean
    queries (16-bit head and residual rows when ``Q_RESID``). ``p_means [B, N_total, HKV, D]``:
    the pyramid's (flat_mean; its leaves are the first rows).

    Blocks stream in chunks of ``NB``: ``FROM_KEYS`` scores a chunk from its keys (``LB`` blocks per
    dot; ``SCORER`` as in ``key_scores``: lse is flat_lse), otherwise by ``scale * q . mean`` of
    the leaf means (flat_mean, one dot per chunk); per-token scores fold into the tile's
    (``tile_token_scores``). Each tile keeps its best ``TOP_P`` keys, sorted descending, in
    ``b_top [BT, TOP_P]``; a chunk that beats some tile's ``TOP_P``-th best is merged by two
    ``tl.topk`` (its own best ``TOP_P``, then the best ``TOP_P`` of both lists), and the row is
    filled as ``PICK`` says.
    """
    G: tl.constexpr = SCAN.G
    GP: tl.constexpr = SCAN.GP
    BT: tl.constexpr = SCAN.BT
    QT: tl.constexpr = SCAN.QT
    QR: tl.constexpr = SCAN.QR
    C: tl.constexpr = SCAN.C
    NB: tl.constexpr = SCAN.NB
    LB: tl.constexpr = SCAN.LB
    TOP_P: tl.constexpr = SCAN.TOP_P
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    t0 = i_t * BT
    BQ: tl.constexpr = BT * QR  # row tokens
    # rows: (tile, token, head); a row's query index (QT = 1: t0 + its tile)
    o_m = tl.arange(0, BQ * GP)
    o_mi = o_m // (QR * GP)
    o_mh = o_m % GP
    o_tok = (tile0 + t0 + o_mi) * QT + (o_m // GP) % QR - (Tk - Tq)
    m_row = (o_mh < G) & (t0 + o_mi < n_tiles)
    s_qt, s_qh = s_q
    p_qh = p_q + i_b.to(tl.int64) * s_qb + (i_h * G) * s_qh
    if SCORE.MEAN:
        b_q, b_ql = split_rows(mean_rows(p_qh, s_q, o_tok, o_mh, m_row, Tq, QT, SCAN.D, SCAN.DP,
                                            p_qh, False),
                               p_q.dtype.element_ty)
    else:
        m_row = m_row & (o_tok >= 0) & (o_tok < Tq)
        b_q, b_ql = rows_at(p_qh, s_q, o_tok, o_mh, m_row, SCAN.D, SCAN.DP, 0)
    o_d = tl.arange(0, SCAN.DP)
    m_d = o_d < SCAN.D

    o_bt = tl.arange(0, BT)
    m_tok = t0 + o_bt < n_tiles
    cur = ((tile0 + t0 + o_bt) * QT) // C
    s0, m_q = sequence_start(p_blk0, cur, m_tok, VARLEN)
    c1 = ((tile0 + tl.minimum(t0 + BT, n_tiles) - 1) * QT) // C
    b_first = tl.min(tl.where(m_q, s0, c1), axis=0) + 1  # the first free block of any tile
    s_kt, s_kh = s_k
    s_mn, s_mh = s_m
    p_kh = p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh
    p_mh = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh

    o_nb = tl.arange(0, NB)
    o_lb = tl.arange(0, LB * C)
    o_c = tl.arange(0, C)
    o_j = tl.arange(0, NB // LB)
    b_top = tl.full([BT, TOP_P], KEY_NONE, dtype=tl.int64)
    for b0 in range(b_first, c1 - 1, NB):
        o_blk = b0 + o_nb
        if SCORE.FROM_KEYS:
            b_s = tl.zeros([BQ, NB], dtype=tl.float32)
            n_blk = tl.minimum(NB, c1 - 1 - b0)
            for j in range(0, (n_blk + LB - 1) // LB):
                o_key = (b0 + j * LB) * C + o_lb
                p_kj = p_kh + o_key.to(tl.int64)[:, None] * s_kt + o_d[None, :]
                b_k = tl.load(p_kj, mask=(o_key < (c1 - 1) * C)[:, None] & m_d[None, :], other=0.)
                b_z = tl.reshape(key_logits(b_q, b_ql, b_k, SCORE.Q_RESID) * scale,
                                 [BQ * GP, LB, C])
                # Every key counts: free blocks are complete and in the past.
                b_sj = token_sums(key_scores(b_z, o_c[None, None, :] < C, C, SCORE.SCORER), m_row,
                                  BQ, GP)  # [BQ, LB]
                b_s3 = tl.reshape(b_s, [BQ, NB // LB, LB])
                b_s3 = tl.where((o_j == j)[None, :, None], b_sj[:, None, :], b_s3)
                b_s = tl.reshape(b_s3, [BQ, NB])
        else:
            p_mj = p_mh + o_blk.to(tl.int64)[:, None] * s_mn + o_d[None, :]
            b_m = tl.load(p_mj, mask=(o_blk <= c1 - 2)[:, None] & m_d[None, :], other=0.)
            b_z = dot_nt_f32(b_q, b_m, F32_PREC)
            if SCORE.Q_RESID:
                b_z += dot_nt_f32(b_ql, b_m, F32_PREC)
            b_s = token_sums(b_z * scale, m_row, BQ, GP)
        if QR > 1:
            b_s = tile_token_scores(b_s, m_row, BT, QR, GP, SCORE.REDUCE)  # [BT, NB]
        m_free = (o_blk[None, :] <= cur[:, None] - 2) & (o_blk[None, :] > s0[:, None]) \
            & m_tok[:, None]
        b_key = tl.where(m_free, pack(b_s, o_blk[None, :]), KEY_NONE)
        if tl.sum((tl.max(b_key, axis=1) > tl.min(b_top, axis=1)).to(tl.int32)) > 0:
            b_new = tl.topk(b_key, TOP_P)
            b_top = tl.topk(tl.reshape(tl.join(b_top, b_new), [BT, 2 * TOP_P]), TOP_P)

    write_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, m_q, cur, s0, b_top, s_ib, s_i, s_cb, s_ct,
                    PICK)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

_LAUNCH = FlatSelectLaunch()  # the defaults (``launch=None``)


def select_flat_triton(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig,
                       pyramid: Pyramid | None, scorer: str,
                       blk0: torch.Tensor | None = None, *,
                       launch: FlatSelectLaunch | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat top-K selection per query tile (``cfg.query_tile`` tokens, one by default):
    ``flat_mean`` (``cfg.selector``) scores each block by its leaf mean in ``pyramid``; otherwise
    blocks are scored from their keys by ``scorer`` (``"lse"``: flat_lse; a pyramid whose beams
    cover every block also lands here with its leaf scorer). Returns ``block_idx [B, n_tiles,
    HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and ``counts [B, n_tiles, HKV] int32``
    (``n_tiles = n_query_tiles(Tq, Tk, cfg.query_tile)``, ``Tq`` for per-token selection).
    ``blk0``: a packed layout's sinks per block (``select_pyramid_triton``). ``launch``: the
    scan's launch knobs (``utils.launch.FlatSelectLaunch``; default: the tuned ones)."""
    launch = launch or _LAUNCH
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C, Qt = HQ // HKV, cfg.block_size, cfg.query_tile
    n_tiles = n_query_tiles(Tq, Tk, Qt)
    mean = Qt > 1 and cfg.tile_reduce == "qmean"
    QR = 1 if mean else Qt  # row tokens a tile
    GP = pow2(G)
    # Default: 128 query rows (8 warps of 16-row MMA tiles sharing each key load), <= 16 tiles.
    BT = max(1, min(launch.max_tiles, launch.rows // (QR * GP)))
    GP = max(GP, cdiv(16, BT * QR))  # BT * QR * GP >= 16 rows for tl.dot
    TOP_P = max(16, pow2(cfg.topk))
    NB = max(TOP_P, 64)  # blocks per chunk (per top-K merge)
    # blocks per key load: LB * C rows, fewer when the [rows, LB * C] fp32 logits would pass 16K
    rows = BT * QR * GP
    LB = min(NB, max(1, 128 // C), 1 << max(0, (16384 // (rows * C)).bit_length() - 1))
    means = pyramid.means if pyramid is not None else q.new_empty(1, 1, 1, 1, dtype=torch.float32)
    block_idx = empty(B, n_tiles, HKV, cfg.slots, dtype=torch.int32, device=q.device)
    counts = empty(B, n_tiles, HKV, dtype=torch.int32, device=q.device)
    if B * n_tiles * HKV == 0:
        return block_idx, counts
    grid = (cdiv(n_tiles, BT), HKV, B)
    _flat_select_kernel[grid](
        q, k, means, block_idx, counts, counts if blk0 is None else blk0, Tq, Tk, n_tiles,
        (Tk - Tq) // Qt, cfg.scale, *strides_of(q), *strides_of(k), *strides_of(means),
        *strides_of(block_idx), counts.stride(0), counts.stride(1),
        Scan(G, GP, BT, Qt, QR, D, max(16, pow2(D)), C, TOP_P, NB, LB),
        FlatScoring(cfg.selector != "flat_mean", SCORER_ID[scorer],
                    REDUCE_ID[cfg.tile_reduce] if QR > 1 else 0, mean,
                    mean and q.dtype != torch.float32),
        pick_of(cfg), blk0 is not None, num_warps=launch.warps, num_stages=launch.stages)
    return block_idx, counts
