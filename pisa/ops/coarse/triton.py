"""The coarse branch in Triton: forward, dQ and dK/dV (of the nodes) kernels.

Semantics are those of ``naive.naive_coarse_attn``. The nodes (mean-pooled complete blocks,
``torch_backend.pool_blocks``) are made by torch in q's dtype before the kernels, so the pooling's
own backward (each key gets ``1 / C`` of its node's gradient) is torch's, and the kernels see a
plain attention over ``N = Tk // C`` nodes whose visibility is causal at node granularity: query
``t_abs`` sees node ``j`` iff ``j < (t_abs + 1) // C``.

Forward and dQ: one program per (``BM`` consecutive queries, batch x query head) loops over the
node tiles up to the last one its last query sees (online softmax in base 2; the backward
recomputes the probabilities from the saved LSE, FlashAttention style). dK/dV: one program per
(``BN`` nodes, batch x query head) loops over the queries from the first that sees its first
node; the group's shares are summed by torch. Saved memory is O(N): inputs, output and LSE.

``PISA_TRITON_POISON=1`` allocates outputs filled with NaN (``utils.op.empty``; tests prove every
element is written).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..utils.geometry import cdiv, pow2
from ..utils.op import (LOG2E, LOG2E_K, dot_nt, dot_pv, empty, online_softmax_step,
                        softmax_output)
from ..utils.triton_utils import F32_PREC
from .torch_backend import CoarseAttn, pool_blocks


class CoarseShape(NamedTuple):
    """The compile-time shape of a coarse program (one ``tl.constexpr``)."""

    G: int    # query heads per KV head
    BM: int   # queries a forward / dQ program, and a dK/dV step
    BN: int   # nodes a step (forward / dQ) or a program (dK/dV)
    D: int    # head dim
    DP: int   # D padded to a power of two


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rows(p, o_row, m_row, s_t, D: tl.constexpr, DP: tl.constexpr):
    """``[len(o_row), DP]`` rows at token offsets ``o_row`` (token stride ``s_t``), zero-padded."""
    o_d = tl.arange(0, DP)
    m = m_row[:, None] & (o_d < D)[None, :]
    return tl.load(p + o_row.to(tl.int64)[:, None] * s_t + o_d[None, :], mask=m, other=0.0)


@triton.jit
def _store(p, o_row, m_row, s_t, x, D: tl.constexpr, DP: tl.constexpr):
    o_d = tl.arange(0, DP)
    m = m_row[:, None] & (o_d < D)[None, :]
    tl.store(p + o_row.to(tl.int64)[:, None] * s_t + o_d[None, :], x.to(p.dtype.element_ty),
             mask=m)


@triton.jit
def _visible(o_tok, o_node, t_first, C):
    """``[rows, nodes]``: which nodes each query sees (its complete blocks so far)."""
    n_vis = (t_first + o_tok + 1) // C
    return o_node[None, :] < n_vis[:, None]


@triton.jit
def _query_program(p_kc, p_vc, s_kb, s_kh, Tq, HQ, G: tl.constexpr, BM: tl.constexpr):
    """A query-tile program's place: its tile, batch row, query head, tokens ``[BM]`` with their
    mask, and its KV head's node pointers."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hq = i_bh // HQ, i_bh % HQ
    o_tok = i_m * BM + tl.arange(0, BM)
    o_kh = i_b.to(tl.int64) * s_kb + (i_hq // G) * s_kh
    return i_m, i_bh, i_b, i_hq, o_tok, o_tok < Tq, p_kc + o_kh, p_vc + o_kh


@triton.jit
def _nodes_seen(i_m, Tq, N, t_first, C, BM: tl.constexpr):
    """The nodes a query tile's last query sees: later node tiles would be masked out entirely."""
    return tl.minimum(N, (t_first + tl.minimum((i_m + 1) * BM, Tq)) // C)


@triton.jit
def _node_tile(p_kh, p_vh, b_q, n0, N, s_kt, o_tok, t_first, C, scale_log2,
               BN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Nodes ``n0 .. n0 + BN`` of a KV head: keys and values ``[BN, DP]`` and the query tile's
    log2-scaled logits ``[BM, BN]`` (-inf where a query does not see the node)."""
    o_node = n0 + tl.arange(0, BN)
    m_node = o_node < N
    b_k = _rows(p_kh, o_node, m_node, s_kt, D, DP)
    b_v = _rows(p_vh, o_node, m_node, s_kt, D, DP)
    b_s = dot_nt(b_q, b_k, F32_PREC) * scale_log2
    return b_k, b_v, tl.where(_visible(o_tok, o_node, t_first, C), b_s, float("-inf"))


@triton.jit
def _coarse_fwd_kernel(p_q, p_kc, p_vc, p_o, p_lse, s_qb, s_q, s_kb, s_k, s_ob, s_o,
                       Tq, N, t_first, C, scale_log2, HQ, SHAPE: tl.constexpr):
    BM: tl.constexpr = SHAPE.BM
    BN: tl.constexpr = SHAPE.BN
    D: tl.constexpr = SHAPE.D
    DP: tl.constexpr = SHAPE.DP
    s_qt, s_qh = s_q
    s_kt, s_kh = s_k
    s_ot, s_oh = s_o
    i_m, i_bh, i_b, i_hq, o_tok, m_tok, p_kh, p_vh = _query_program(p_kc, p_vc, s_kb, s_kh, Tq,
                                                                     HQ, SHAPE.G, BM)
    p_qh = p_q + i_b.to(tl.int64) * s_qb + i_hq * s_qh
    b_q = _rows(p_qh, o_tok, m_tok, s_qt, D, DP)
    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_acc = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, _nodes_seen(i_m, Tq, N, t_first, C, BM), BN):
        _, b_v, b_s = _node_tile(p_kh, p_vh, b_q, n0, N, s_kt, o_tok, t_first, C, scale_log2,
                                 BN, D, DP)
        b_m, b_l, b_acc = online_softmax_step(b_s, b_v, b_m, b_l, b_acc, F32_PREC)
    b_o, b_lse = softmax_output(b_m, b_l, b_acc)
    _store(p_o + i_b.to(tl.int64) * s_ob + i_hq * s_oh, o_tok, m_tok, s_ot, b_o, D, DP)
    tl.store(p_lse + i_bh.to(tl.int64) * Tq + o_tok, b_lse, mask=m_tok)


@triton.jit
def _lse_log2(p_lse, p_delta, i_bh, o_tok, m_tok, Tq):
    """A query tile's LSE in log2 units (0 on rows without a node: their logits are all -inf, so
    their probabilities stay 0) and its ``delta = rowsum(dO * O)``."""
    b_lse = tl.load(p_lse + i_bh.to(tl.int64) * Tq + o_tok, mask=m_tok, other=0.0)
    b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E_K)
    return b_lse, tl.load(p_delta + i_bh.to(tl.int64) * Tq + o_tok, mask=m_tok, other=0.0)


@triton.jit
def _coarse_dq_kernel(p_q, p_kc, p_vc, p_do, p_lse, p_delta, p_dq, s_qb, s_q, s_kb, s_k,
                      Tq, N, t_first, C, scale, HQ, SHAPE: tl.constexpr):
    BM: tl.constexpr = SHAPE.BM
    BN: tl.constexpr = SHAPE.BN
    D: tl.constexpr = SHAPE.D
    DP: tl.constexpr = SHAPE.DP
    s_qt, s_qh = s_q
    s_kt, s_kh = s_k
    i_m, i_bh, i_b, i_hq, o_tok, m_tok, p_kh, p_vh = _query_program(p_kc, p_vc, s_kb, s_kh, Tq,
                                                                     HQ, SHAPE.G, BM)
    o_qh = i_b.to(tl.int64) * s_qb + i_hq * s_qh  # q, dO and dQ share q's layout
    b_q = _rows(p_q + o_qh, o_tok, m_tok, s_qt, D, DP)
    b_do = _rows(p_do + o_qh, o_tok, m_tok, s_qt, D, DP)
    b_lse, b_delta = _lse_log2(p_lse, p_delta, i_bh, o_tok, m_tok, Tq)
    b_dq = tl.zeros([BM, DP], tl.float32)
    for n0 in range(0, _nodes_seen(i_m, Tq, N, t_first, C, BM), BN):
        b_k, b_v, b_s = _node_tile(p_kh, p_vh, b_q, n0, N, s_kt, o_tok, t_first, C,
                                   scale * LOG2E_K, BN, D, DP)
        b_p = tl.exp2(b_s - b_lse[:, None])
        b_ds = b_p * (dot_nt(b_do, b_v, F32_PREC) - b_delta[:, None])
        b_dq += dot_pv(b_ds, b_k, F32_PREC)
    _store(p_dq + o_qh, o_tok, m_tok, s_qt, b_dq * scale, D, DP)


@triton.jit
def _coarse_dkv_kernel(p_q, p_kc, p_vc, p_do, p_lse, p_delta, p_dkc, p_dvc, s_qb, s_q, s_kb,
                       s_k, s_gb, s_g, Tq, N, t_first, C, scale, HQ, SHAPE: tl.constexpr):
    """dK/dV of nodes ``i_n * BN ..`` from query head ``i_hq`` alone: its share, written to the
    head's rows of ``p_dkc, p_dvc [B, N, HQ, D]`` fp32 (strides ``s_gb``, ``s_g``), which the
    launcher sums over each KV head's group. A program per (node tile, query head): one per
    (node tile, KV head) looping over the group left most SMs idle (32 programs at 32K tokens
    with HKV = 4) and took 14x the forward's time on the H200 (16.4 against 1.2 ms,
    ``benchmarks/training/train_h200.py``'s ``compressed`` arm)."""
    BM: tl.constexpr = SHAPE.BM
    BN: tl.constexpr = SHAPE.BN
    D: tl.constexpr = SHAPE.D
    DP: tl.constexpr = SHAPE.DP
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hq = i_bh // HQ, i_bh % HQ
    s_qt, s_qh = s_q
    s_kt, s_kh = s_k
    s_gt, s_gh = s_g
    o_node = i_n * BN + tl.arange(0, BN)
    m_node = o_node < N
    o_kh = i_b.to(tl.int64) * s_kb + (i_hq // SHAPE.G) * s_kh  # kc and vc share kc's layout
    b_k = _rows(p_kc + o_kh, o_node, m_node, s_kt, D, DP)
    b_v = _rows(p_vc + o_kh, o_node, m_node, s_kt, D, DP)
    b_dk = tl.zeros([BN, DP], tl.float32)
    b_dv = tl.zeros([BN, DP], tl.float32)
    o_qh = i_b.to(tl.int64) * s_qb + i_hq * s_qh
    # the first query that sees the tile's first node: (i_n * BN + 1) * C - 1 <= t_first + t
    t_lo = tl.maximum((i_n * BN + 1) * C - 1 - t_first, 0)
    for t0 in range(t_lo // BM * BM, Tq, BM):
        o_tok = t0 + tl.arange(0, BM)
        m_tok = o_tok < Tq
        b_q = _rows(p_q + o_qh, o_tok, m_tok, s_qt, D, DP)
        b_do = _rows(p_do + o_qh, o_tok, m_tok, s_qt, D, DP)
        b_lse, b_delta = _lse_log2(p_lse, p_delta, i_bh, o_tok, m_tok, Tq)
        b_s = dot_nt(b_q, b_k, F32_PREC) * (scale * LOG2E_K)
        m_s = _visible(o_tok, o_node, t_first, C) & m_tok[:, None]
        b_p = tl.where(m_s, tl.exp2(b_s - b_lse[:, None]), 0.0)
        b_dv += dot_pv(tl.trans(b_p), b_do, F32_PREC)
        b_ds = b_p * (dot_nt(b_do, b_v, F32_PREC) - b_delta[:, None])
        b_dk += dot_pv(tl.trans(b_ds), b_q, F32_PREC)
    o_gh = i_b.to(tl.int64) * s_gb + i_hq * s_gh
    _store(p_dkc + o_gh, o_node, m_node, s_gt, b_dk * scale, D, DP)
    _store(p_dvc + o_gh, o_node, m_node, s_gt, b_dv, D, DP)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
# Queries and nodes a program tile: 64 x 64 (tl.dot needs >= 16 on the GPU; tests shrink them).
_BM, _BN = 64, 64


def _shape(q: torch.Tensor, HKV: int) -> CoarseShape:
    D = q.shape[-1]
    return CoarseShape(q.shape[2] // HKV, _BM, _BN, D, max(16, pow2(D)))


def _strides(x: torch.Tensor):
    """``x [B, T, H, D]`` (contiguous in D): its batch stride and ``(token, head)`` strides."""
    return x.stride(0), (x.stride(1), x.stride(2))


def coarse_fwd_triton(q, kc, vc, t_first: int, block_size: int, scale: float):
    """``o [B, Tq, HQ, D]`` (q's dtype) and ``lse [B, HQ, Tq]`` fp32 of ``q`` (absolute positions
    ``t_first ..``) over the nodes ``kc, vc [B, N, HKV, D]`` (q's dtype, contiguous)."""
    B, Tq, HQ, D = q.shape
    N, HKV = kc.shape[1], kc.shape[2]
    shape = _shape(q, HKV)
    o = empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    lse = empty(B, HQ, Tq, dtype=torch.float32, device=q.device)
    grid = (cdiv(Tq, shape.BM), B * HQ)
    _coarse_fwd_kernel[grid](q, kc, vc, o, lse, *_strides(q), *_strides(kc), *_strides(o),
                             Tq, N, t_first, block_size, scale * LOG2E, HQ, shape)
    return o, lse


def coarse_bwd_triton(do, q, kc, vc, o, lse, t_first: int, block_size: int, scale: float):
    """``dq`` (q's dtype) and ``dkc, dvc`` (the nodes' dtype) of ``coarse_fwd_triton``."""
    B, Tq, HQ, D = q.shape
    N, HKV = kc.shape[1], kc.shape[2]
    shape = _shape(q, HKV)
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()  # [B, HQ, Tq]
    dq = empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    # each query head's share of its KV head's node gradients, summed over the group below:
    # [B, N, HQ, D] fp32, O(N) (nodes, not queries x nodes)
    dkc = empty(B, N, HQ, D, dtype=torch.float32, device=q.device)
    dvc = empty(B, N, HQ, D, dtype=torch.float32, device=q.device)
    args = (*_strides(q), *_strides(kc))
    sizes = (Tq, N, t_first, block_size, scale, HQ, shape)
    _coarse_dq_kernel[(cdiv(Tq, shape.BM), B * HQ)](q, kc, vc, do, lse, delta, dq, *args,
                                                    *sizes)
    if N:
        _coarse_dkv_kernel[(cdiv(N, shape.BN), B * HQ)](q, kc, vc, do, lse, delta, dkc, dvc,
                                                        *args, *_strides(dkc), *sizes)
    group = (B, N, HKV, HQ // HKV, D)
    return dq, dkc.view(group).sum(3).to(kc.dtype), dvc.view(group).sum(3).to(vc.dtype)


def coarse_attn_triton(q, k, v, block_size: int, scale: float):
    """The coarse branch of ``q [B, Tq, HQ, D]`` over ``k, v [B, Tk, HKV, D]`` by the Triton
    kernels: ``o`` (q's dtype; differentiable in q, k, v) and ``lse [B, HQ, Tq]`` fp32. The nodes
    are pooled in fp32 and rounded to q's dtype (the kernels' dot operands)."""
    kc = pool_blocks(k, block_size, torch.float32).to(q.dtype).contiguous()
    vc = pool_blocks(v, block_size, torch.float32).to(q.dtype).contiguous()
    return CoarseAttn.apply(q.contiguous(), kc, vc, k.shape[1] - q.shape[1], block_size, scale,
                            coarse_fwd_triton, coarse_bwd_triton)
