"""Flat block selection (Triton): ``selector="flat_lse"`` (exact block LSE of every causal block,
the mass-optimal oracle PISA approximates) and ``"flat_mean"`` (mean-pooled keys, BSA/MoBA style).

A program per (tile of queries, KV head, batch) streams over the causal blocks with
``[tile * G, D] x [D, blocks]`` dots and keeps each query's top-K online in registers; no score
matrix ever reaches memory. Semantics are those of ``naive.naive_select``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pyramid import Pyramid
from ..utils.config import SelectConfig
from ..utils.geometry import cdiv, pow2
from ..utils.op import (F32_PRECISION, KEY_NONE, dot_nt, dot_nt_f32, empty, key_scores,
                        load_queries, pack, selection_row, store_selection, token_sums)
from .triton import SCORER_ID


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

# lengths are runtime values: specialising on their divisibility by 16 recompiled every kernel at
# each new sequence length (seconds, docs/design.md "Cold start"); batch strides are typed
# 64-bit, as their values pass 2**31 from 256K tokens and a new argument type recompiles too;
# the selection outputs' batch strides (Tq * HKV * slots) follow the length, so are not specialised
@triton.jit(do_not_specialize=["Tq", "Tk", "s_ib", "s_cb"])
def _flat_select_kernel(
        p_q, p_k, p_means, p_idx, p_cnt, Tq, Tk, scale,
        s_qb: tl.int64, s_qt, s_qh, s_kb: tl.int64, s_kt, s_kh, s_mb: tl.int64, s_mn, s_mh,
        s_ib: tl.int64, s_it, s_ih, s_cb: tl.int64, s_ct,
        G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        C: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr, LB: tl.constexpr,
        TOPK: tl.constexpr, SLOTS: tl.constexpr, SP: tl.constexpr, IN_BUDGET: tl.constexpr,
        FROM_KEYS: tl.constexpr, SCORER: tl.constexpr, F32_PREC: tl.constexpr):
    """Flat top-K over every free block ``[1, cur - 2]`` of the ``BT`` queries of tile ``i_t``.

    Blocks stream in chunks of ``NB``: ``FROM_KEYS`` scores a chunk from its keys (``LB`` blocks per
    dot; ``SCORER`` as in ``key_scores``: lse is flat_lse), otherwise by ``scale * q . mean`` of
    the leaf means (flat_mean, one dot per chunk). Each token keeps its best ``KP`` keys, sorted
    descending, in ``b_top [BT, KP]``; a chunk that beats some token's ``KP``-th best is merged by
    two ``tl.topk`` (its own best ``KP``, then the best ``KP`` of both lists).
    """
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    t0 = i_t * BT
    b_q, m_row = load_queries(p_q, i_b, i_h, t0, Tq, s_qb, s_qt, s_qh, G, GP, BT, D, DP)
    o_d = tl.arange(0, DP)
    m_d = o_d < D

    o_bt = tl.arange(0, BT)
    m_tok = t0 + o_bt < Tq
    cur = (Tk - Tq + t0 + o_bt) // C
    c1 = (Tk - Tq + tl.minimum(t0 + BT, Tq) - 1) // C
    p_kh = p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh
    p_mh = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh

    o_nb = tl.arange(0, NB)
    o_lb = tl.arange(0, LB * C)
    o_c = tl.arange(0, C)
    o_j = tl.arange(0, NB // LB)
    b_top = tl.full([BT, KP], KEY_NONE, dtype=tl.int64)
    for b0 in range(1, c1 - 1, NB):
        o_blk = b0 + o_nb
        if FROM_KEYS:
            b_s = tl.zeros([BT, NB], dtype=tl.float32)
            n_blk = tl.minimum(NB, c1 - 1 - b0)
            for j in range(0, (n_blk + LB - 1) // LB):
                o_key = (b0 + j * LB) * C + o_lb
                p_kj = p_kh + o_key.to(tl.int64)[:, None] * s_kt + o_d[None, :]
                b_k = tl.load(p_kj, mask=(o_key < (c1 - 1) * C)[:, None] & m_d[None, :], other=0.)
                b_z = tl.reshape(dot_nt(b_q, b_k, F32_PREC) * scale, [BT * GP, LB, C])
                # Every key counts: free blocks are complete and in the past.
                b_sj = token_sums(key_scores(b_z, o_c[None, None, :] < C, C, SCORER), m_row,
                                  BT, GP)  # [BT, LB]
                b_s3 = tl.reshape(b_s, [BT, NB // LB, LB])
                b_s3 = tl.where((o_j == j)[None, :, None], b_sj[:, None, :], b_s3)
                b_s = tl.reshape(b_s3, [BT, NB])
        else:
            p_mj = p_mh + o_blk.to(tl.int64)[:, None] * s_mn + o_d[None, :]
            b_m = tl.load(p_mj, mask=(o_blk <= c1 - 2)[:, None] & m_d[None, :], other=0.)
            b_s = token_sums(dot_nt_f32(b_q, b_m, F32_PREC) * scale, m_row, BT, GP)
        m_free = (o_blk[None, :] <= cur[:, None] - 2) & m_tok[:, None]
        b_key = tl.where(m_free, pack(b_s, o_blk[None, :]), KEY_NONE)
        if tl.sum((tl.max(b_key, axis=1) > tl.min(b_top, axis=1)).to(tl.int32)) > 0:
            b_new = tl.topk(b_key, KP)
            b_top = tl.topk(tl.reshape(tl.join(b_top, b_new), [BT, 2 * KP]), KP)

    b_row, count = selection_row(cur, b_top, TOPK, IN_BUDGET, SP)
    store_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, b_row, count, s_ib, s_it, s_ih, s_cb, s_ct,
                    SLOTS)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

def select_flat_triton(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig,
                       pyramid: Pyramid | None, scorer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat top-K selection: ``flat_mean`` (``cfg.selector``) scores each block by its leaf mean in
    ``pyramid``; otherwise blocks are scored from their keys by ``scorer`` (``"lse"``: flat_lse; a
    pyramid whose beam covers every block also lands here with its leaf scorer). Returns
    ``block_idx [B, Tq, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, Tq, HKV] int32``."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C = HQ // HKV, cfg.block_size
    GP = pow2(G)
    # Default: 128 query rows (8 warps of 16-row MMA tiles sharing each key load), <= 16 tokens.
    BT = max(1, min(16, 128 // GP))
    GP = max(GP, cdiv(16, BT))  # BT * GP >= 16 rows for tl.dot
    KP = max(16, pow2(cfg.topk))
    NB = max(KP, 64)  # blocks per chunk (per top-K merge)
    LB = min(NB, max(1, 128 // C))  # blocks per key load: LB * C rows
    means = pyramid.means if pyramid is not None else q.new_empty(1, 1, 1, 1, dtype=torch.float32)
    block_idx = empty(B, Tq, HKV, cfg.slots, dtype=torch.int32, device=q.device)
    counts = empty(B, Tq, HKV, dtype=torch.int32, device=q.device)
    if B * Tq * HKV == 0:
        return block_idx, counts
    grid = (cdiv(Tq, BT), HKV, B)
    _flat_select_kernel[grid](
        q, k, means, block_idx, counts, Tq, Tk, cfg.scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        means.stride(0), means.stride(1), means.stride(2),
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        counts.stride(0), counts.stride(1),
        G=G, GP=GP, BT=BT, D=D, DP=max(16, pow2(D)), C=C, KP=KP, NB=NB, LB=LB,
        TOPK=cfg.topk, SLOTS=cfg.slots, SP=pow2(cfg.slots), IN_BUDGET=cfg.forced_in_budget,
        FROM_KEYS=cfg.selector != "flat_mean", SCORER=SCORER_ID[scorer],
        F32_PREC=F32_PRECISION, num_warps=8, num_stages=3)
    return block_idx, counts
