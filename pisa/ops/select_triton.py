"""Triton kernels for PISA block selection: the pyramid build, the pyramid walk and the flat scans.

Semantics are those of ``naive.py`` (the oracle) and ``PISA_SPEC.md`` §2-§4, §7; on random
inputs the selections equal ``naive_select``'s exactly.

- ``build_pyramid_triton``: one pass over ``k``. A program per (chunk of 16 leaves, KV head, batch)
  sums its keys into leaf sums and folds them upward in registers for the levels the chunk spans
  (``g`` a power of two); a second launch, a program per (KV head, batch), folds the few levels
  above from those sums. fp32 sums, ``means = sums / counts``, as ``build_pyramid_torch``.
- ``select_triton(selector="pyramid")``: one kernel, a program per (query, KV head, batch). The beam
  lives in registers as the ``W`` kept non-forced nodes of the level above; a level's candidates
  are their children plus the non-forced, causal children of the forced nodes, whose indices
  follow from the query position (so forced nodes are never carried). A level with more than
  ``W`` candidates is scored: per child ``c``, one ``tl.dot`` of the group's ``G`` query rows
  against the candidates' ``c``-th child means, folded into an online log-sum-exp (or weighted
  Welford mean / variance); the sum over heads; the top ``W`` by ``tl.topk`` over packed keys.
  The leaf stage loads each kept parent's ``g * C`` keys once and scores all ``G`` heads with one
  ``tl.dot``; the token's best free blocks (``tl.topk`` again) are sorted by index and written
  around the forced ones. A beam as wide as the block count prunes nothing: the flat kernel runs.
- ``variant="fused_fast"``: the same program with a faster walk (``_walk``'s ``SKIP`` / ``QT``): the
  top levels whose causal nodes all fit the beam are not visited (their beam follows from the
  query position), and a level is scored with ``means @ q^T`` (the 64 candidate rows fill a Hopper
  warpgroup MMA, the 16 query rows do not) from 16-bit head + residual means precomputed per call.
- ``variant="csc"``: three launches and a sort. (1) ``_pyramid_walk_kernel``: the fast walk, one
  program per (query, KV head), writes each query's level-2 parents of its leaf candidates as
  sort keys (head, chunk of ``leaf_chunk`` queries, parent). (2) ``torch.sort`` groups the
  (query, parent) pairs by key, ``searchsorted`` finds the groups. (3) ``_leaf_groups_kernel``: a
  program per group loads the parent's ``g * C`` keys once and scores them against its queries
  ``leaf_pairs`` at a time, gathering their ``G`` query rows (``[PB * G, D] x [D, g * C]`` dots):
  per (query, parent) pair ~4 KB of queries move instead of 32 KB of keys. (4) ``_leaf_topk_kernel``
  picks each query's best free leaves. Same selections as ``"fused"``.
- ``select_triton(selector="flat_lse" | "flat_mean")``: a program per (tile of queries, KV head,
  batch) streams over the causal blocks with ``[tile * G, D] x [D, blocks]`` dots and keeps each
  query's top-K online in registers; no score matrix ever reaches memory.

Scores are packed into int64 keys (order-preserving float bits, then ``2**31 - 1 - index``), so
"higher score, then lower block index" (the oracle's tie rule) is one integer comparison.

Precision. Keys enter ``tl.dot`` in the input dtype (16-bit products are exact; fp32 accumulation).
Pooled means are fp32: against 16-bit queries they are split into a 16-bit head and a 16-bit
residual (two dots, ~16 mantissa bits), so near-equal candidates rank as in fp64; fp32 queries use
``input_precision="ieee"``.

Limits: ``W <= 512 / next_pow2(g)`` (or ``W >= #blocks``: the flat scan); ``block_size`` a power of
two; any ``g >= 2`` (non-powers of two pad to the next one); any ``D <= 256`` and ``G``.
Registers grow with ``next_pow2(g) * next_pow2(W) * D`` (the default g=2, W=16, D=128 fits).

Levers (off by default; both depart from the oracle):
- ``walk_tile=BT > 1``: ``BT`` consecutive queries share one walk (internal-level scores summed over
  the tile's tokens and heads; forced nodes the union of theirs); the leaf stage stays per token
  (each ranks the shared candidates by its own exact score), and every candidate leaf is loaded
  once per tile for all ``BT * G`` query rows: key and summary traffic drop ``BT``-fold.
- ``leaf_sub_blocks=S > 0``: a leaf is scored from ``S`` sub-block means of ``C / S`` keys (an extra
  pooled level built per call, log-sum with counts like the internal levels), not its ``C`` keys:
  leaf traffic drops ``C / S``-fold (fp32 means, so ``C / (2 S)`` in bytes against bf16 keys).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .pyramid import Pyramid, level_offsets
from .utils import SelectConfig, cdiv

_SCORER_ID = {"lse": 0, "mean": 1, "meanvar": 2}
# Implementations of the pyramid selector (select_triton's ``variant``), all with one result.
VARIANTS = ("fused", "fused_fast", "csc")
# Smallest int64: the key of an empty / invalid candidate, below every real score.
_KEY_NONE = tl.constexpr(-(2 ** 63))
# fp32 inputs are a testing path: keep their dots exact rather than fast (tf32 would reorder
# near-equal candidates against the fp64 oracle).
_F32_PRECISION = "ieee"


# ------------------------------------------------------------------------------------------------
# Kernels: pyramid build
# ------------------------------------------------------------------------------------------------

@triton.jit
def _pyramid_chunk_kernel(
        p_k, p_means, p_counts, p_sums, p_off, T,
        s_kb, s_kt, s_kh, s_mb, s_mn, s_mh, s_sb, s_sn, s_sh,
        C: tl.constexpr, CB: tl.constexpr, LEAVES: tl.constexpr, LEVELS: tl.constexpr,
        G_BR: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, WRITE_SUMS: tl.constexpr):
    """Leaves ``[i_c * LEAVES, (i_c + 1) * LEAVES)`` and the ``LEVELS`` levels of nodes above them
    that lie inside this chunk; the sums of the topmost of those levels go to ``p_sums`` when the
    top kernel must continue from them."""
    i_c, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_leaf = i_c * LEAVES + tl.arange(0, LEAVES)
    o_cb = tl.arange(0, CB)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    p_kh = p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh

    b_sum = tl.zeros([LEAVES, DP], dtype=tl.float32)
    for c0 in range(0, C, CB):
        o_t = o_leaf[:, None] * C + c0 + o_cb[None, :]  # [LEAVES, CB] token positions
        p_kc = p_kh + o_t.to(tl.int64)[:, :, None] * s_kt + o_d[None, None, :]
        b_k = tl.load(p_kc, mask=(o_t < T)[:, :, None] & m_d[None, None, :], other=0.)
        b_sum += tl.sum(b_k.to(tl.float32), axis=1)
    b_n = tl.minimum(tl.maximum(T - o_leaf * C, 0), C)  # real keys per leaf, 0 past the end

    o_node = o_leaf
    for lv in tl.static_range(LEVELS + 1):
        if lv > 0:
            # Fold G_BR siblings (adjacent rows: chunks are aligned to G_BR**LEVELS leaves).
            b_sum = tl.sum(tl.reshape(b_sum, [b_sum.shape[0] // G_BR, G_BR, DP]), axis=1)
            b_n = tl.sum(tl.reshape(b_n, [b_n.shape[0] // G_BR, G_BR]), axis=1)
            o_node = i_c * b_n.shape[0] + tl.arange(0, b_n.shape[0])
        lo = tl.load(p_off + lv)
        m_node = o_node < tl.load(p_off + lv + 1) - lo
        b_mean = b_sum / tl.maximum(b_n, 1).to(tl.float32)[:, None]
        p_m = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh \
            + (lo + o_node).to(tl.int64)[:, None] * s_mn + o_d[None, :]
        tl.store(p_m, b_mean, mask=m_node[:, None] & m_d[None, :])
        if i_h + i_b == 0:
            tl.store(p_counts + lo + o_node, b_n, mask=m_node)
    if WRITE_SUMS:
        p_s = p_sums + i_b.to(tl.int64) * s_sb + i_h * s_sh \
            + o_node.to(tl.int64)[:, None] * s_sn + o_d[None, :]
        tl.store(p_s, b_sum, mask=m_node[:, None] & m_d[None, :])


@triton.jit
def _pyramid_top_kernel(
        p_means, p_counts, p_sums, p_off, T, lvl0, n_levels, span0,
        s_mb, s_mn, s_mh, s_sb, s_sn, s_sh,
        C: tl.constexpr, G_BR: tl.constexpr, PB: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Levels ``lvl0 + 1 .. n_levels`` from the sums of level ``lvl0`` (rows of ``p_sums``, which
    this program extends level by level: row ``r`` holds pyramid row ``offsets[lvl0 - 1] + r``)."""
    i_h, i_b = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    p_sh = p_sums + i_b.to(tl.int64) * s_sb + i_h * s_sh
    p_mh = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh
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
            for r in range(0, G_BR):
                o_c = o_p * G_BR + r
                m_c = m_p & (o_c < lo - lo_c)
                p = p_sh + (lo_c - base + o_c).to(tl.int64)[:, None] * s_sn + o_d[None, :]
                b_sum += tl.load(p, mask=m_c[:, None] & m_d[None, :], other=0.)
            b_n = tl.minimum(tl.maximum(T - o_p * span * C, 0), span * C)
            m_st = m_p[:, None] & m_d[None, :]
            p = p_sh + (lo - base + o_p).to(tl.int64)[:, None] * s_sn + o_d[None, :]
            tl.store(p, b_sum, mask=m_st)
            p = p_mh + (lo + o_p).to(tl.int64)[:, None] * s_mn + o_d[None, :]
            tl.store(p, b_sum / tl.maximum(b_n, 1).to(tl.float32)[:, None], mask=m_st)
            if i_h + i_b == 0:
                tl.store(p_counts + lo + o_p, b_n, mask=m_p)
        # The next level reads the sums this level's threads just wrote.
        tl.debug_barrier()
        span = span * G_BR


# ------------------------------------------------------------------------------------------------
# Kernels: selection helpers
# ------------------------------------------------------------------------------------------------

@triton.jit
def _pack(b_score, o_idx):
    """int64 keys ordered by score, then by lower index (the oracle's tie rule)."""
    b_bits = b_score.to(tl.int32, bitcast=True)
    b_bits = tl.where(b_bits < 0, b_bits ^ 0x7FFFFFFF, b_bits)  # monotone in the float value
    return (b_bits.to(tl.int64) << 32) | (0x7FFFFFFF - o_idx).to(tl.int64)


@triton.jit
def _unpack_idx(b_key):
    return 0x7FFFFFFF - b_key.to(tl.int32)  # the low word


@triton.jit
def _dot_nt(b_q, b_x, F32_PREC: tl.constexpr):
    """``b_q [M, DP] @ b_x[N, DP]^T`` in fp32; ``b_x`` is in ``b_q``'s dtype (keys)."""
    if b_q.dtype == tl.float32:
        b_z = tl.dot(b_q, tl.trans(b_x), input_precision=F32_PREC)
    else:
        b_z = tl.dot(b_q, tl.trans(b_x))
    return b_z


@triton.jit
def _dot_nt_f32(b_q, b_x, F32_PREC: tl.constexpr):
    """``b_q [M, DP] @ b_x[N, DP]^T`` for fp32 ``b_x`` (pooled means) at ~fp32 accuracy: against
    16-bit queries ``b_x`` is split into a 16-bit head and a 16-bit residual (two exact-product
    dots) instead of being rounded once. ``b_x`` already in ``b_q``'s 16-bit dtype: one dot."""
    if b_q.dtype == tl.float32:
        b_z = tl.dot(b_q, tl.trans(b_x), input_precision=F32_PREC)
    elif b_x.dtype == b_q.dtype:  # means stored in the input dtype (walk_means="input")
        b_z = tl.dot(b_q, tl.trans(b_x))
    else:
        b_hi = b_x.to(b_q.dtype)
        b_z = _dot_nt_split(b_q, b_hi, (b_x - b_hi.to(tl.float32)).to(b_q.dtype))
    return b_z


@triton.jit
def _dot_nt_split(b_q, b_hi, b_lo):
    """``b_q @ (b_hi + b_lo)^T`` in fp32 for 16-bit ``b_q`` and an fp32 matrix split into 16-bit
    head and residual."""
    return tl.dot(b_q, tl.trans(b_hi)) + tl.dot(b_q, tl.trans(b_lo))


@triton.jit
def _load_queries(p_q, i_b, i_h, t0, Tq, s_qb, s_qt, s_qh,
                  G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr):
    """The tile's query rows ``[BT * GP, DP]`` (row ``i * GP + h``: head ``h`` of KV head ``i_h``'s
    group at token ``t0 + i``; padding heads / tokens / dims are zero) and which rows are real."""
    o_m = tl.arange(0, BT * GP)
    o_mt = o_m // GP
    o_mh = o_m % GP
    m_row = (o_mh < G) & (t0 + o_mt < Tq)
    o_d = tl.arange(0, DP)
    p = p_q + i_b.to(tl.int64) * s_qb + (t0 + o_mt).to(tl.int64)[:, None] * s_qt \
        + (i_h * G + o_mh)[:, None] * s_qh + o_d[None, :]
    return tl.load(p, mask=m_row[:, None] & (o_d < D)[None, :], other=0.), m_row


@triton.jit
def _token_sums(b_x, m_row, BT: tl.constexpr, GP: tl.constexpr):
    """``[BT * GP, N]`` per-(token, head) rows -> ``[BT, N]`` sums over each token's real heads."""
    N: tl.constexpr = b_x.shape[1]
    b_x = tl.where(m_row[:, None], b_x, 0.)
    return tl.sum(tl.reshape(b_x, [BT, GP, N]), axis=1)


@triton.jit
def _per_node(x, QT: tl.constexpr):
    """A per-node vector ``[N]`` shaped to broadcast against ``[M, N]`` scores (``[N, M]``: QT)."""
    if QT:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def _child_scores(b_q, o_node, m_node, p_child, s_cn, p_ccount, n_child, scale,
                  CHILDREN: tl.constexpr, SCORER: tl.constexpr, DP: tl.constexpr, D: tl.constexpr,
                  LO: tl.constexpr, QT: tl.constexpr, F32_PREC: tl.constexpr):
    """Per query row scores ``[M, N]`` of nodes ``o_node [N]`` from their ``CHILDREN`` children's
    means (rows ``o_node * CHILDREN + c`` of ``p_child``) weighted by the children's counts.
    ``LO > 0``: the rows hold the 16-bit heads of fp32 means, their residuals ``LO`` elements on.
    ``QT``: scores come transposed, ``[N, M]``, from ``means @ q^T`` (the ``N`` candidates as the
    dot's rows: 64 rows at W = 16, g = 2 fill a Hopper warpgroup MMA; the 16 query rows of
    ``q @ means^T`` do not). Means must then be fp32 with fp32 queries, else 16-bit (``LO``).

    lse: ``log sum_c n_c exp(z_c)`` (online, max-shift added back); mean / meanvar: count-weighted
    Welford mean and variance of ``z_c``. A child past ``n_child`` has count 0 and no weight.
    """
    o_d = tl.arange(0, DP)
    M: tl.constexpr = b_q.shape[0]
    N: tl.constexpr = o_node.shape[0]
    if QT:
        b_a = tl.full([N, M], float("-inf"), dtype=tl.float32)
    else:
        b_a = tl.full([M, N], float("-inf"), dtype=tl.float32)  # lse: running max; else: mean
    b_b = tl.zeros_like(b_a)  # lse: running sum; else: running M2
    b_w = tl.zeros([N], dtype=tl.float32)  # total count so far (mean / meanvar)
    if SCORER != 0:
        b_a = tl.zeros_like(b_a)
    for c in range(0, CHILDREN):  # a runtime loop: one child tile live at a time
        o_c = o_node * CHILDREN + c
        m_c = m_node & (o_c < n_child)
        p = p_child + o_c.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        b_m = tl.load(p, mask=m_c[:, None] & (o_d < D)[None, :], other=0.)
        b_n = tl.load(p_ccount + o_c, mask=m_c, other=0).to(tl.float32)
        if QT:
            b_z = _dot_nt(b_m, b_q, F32_PREC)
            if LO > 0:
                b_z += _dot_nt(tl.load(p + LO, mask=m_c[:, None] & (o_d < D)[None, :], other=0.),
                               b_q, F32_PREC)
            b_z = b_z * scale  # [N, M]
        elif LO > 0:
            b_lo = tl.load(p + LO, mask=m_c[:, None] & (o_d < D)[None, :], other=0.)
            b_z = _dot_nt_split(b_q, b_m, b_lo) * scale  # [M, N]
        else:
            b_z = _dot_nt_f32(b_q, b_m, F32_PREC) * scale
        if SCORER == 0:
            b_x = tl.where(_per_node(b_n, QT) > 0, b_z + _per_node(tl.log(tl.maximum(b_n, 1.)), QT),
                           float("-inf"))
            b_max = tl.maximum(b_a, b_x)
            b_shift = tl.where(b_max == float("-inf"), 0., b_max)
            b_b = b_b * tl.exp(b_a - b_shift) + tl.exp(b_x - b_shift)
            b_a = b_max
        else:
            b_wn = b_w + b_n
            b_f = tl.where(b_wn > 0, b_n / tl.maximum(b_wn, 1.), 0.)
            b_delta = b_z - b_a
            b_a = b_a + b_delta * _per_node(b_f, QT)
            b_b = b_b + _per_node(b_n, QT) * b_delta * (b_z - b_a)
            b_w = b_wn
    if SCORER == 0:
        b_s = b_a + tl.log(tl.maximum(b_b, 1.))  # >= 1 for a node with a child: exp(max - max)
    elif SCORER == 1:
        b_s = b_a
    else:
        b_s = b_a + 0.5 * b_b / _per_node(tl.maximum(b_w, 1.), QT)
    return b_s


@triton.jit
def _pair_lse_scores(b_q, o_node, m_node, p_child, s_cn, p_ccount, n_child, scale,
                     D: tl.constexpr, LO: tl.constexpr, F32_PREC: tl.constexpr):
    """``_child_scores(QT=True)`` for the lse scorer and two children, in closed form:
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
    b_z = _dot_nt(tl.load(p, mask=m_p, other=0.), b_q, F32_PREC)
    if LO > 0:
        b_z += _dot_nt(tl.load(p + LO, mask=m_p, other=0.), b_q, F32_PREC)
    b_n = tl.load(p_n, mask=m_c, other=0).to(tl.float32)
    return tl.where(b_n[:, None] > 0, b_z * scale + tl.log(tl.maximum(b_n, 1.))[:, None],
                    float("-inf"))


@triton.jit
def _key_scores(b_z, m_z, n, SCORER: tl.constexpr):
    """Per-row block scores ``[M, L]`` from key logits ``b_z [M, L, CP]`` (``m_z`` marks the ``n``
    real keys of a block): log-sum-exp, mean, or mean + 1/2 variance over the keys."""
    if SCORER == 0:
        b_z = tl.where(m_z, b_z, float("-inf"))
        b_max = tl.max(b_z, axis=2)
        b_s = b_max + tl.log(tl.sum(tl.exp(b_z - b_max[:, :, None]), axis=2))
    else:
        b_z = tl.where(m_z, b_z, 0.)
        b_s = tl.sum(b_z, axis=2) / n
        if SCORER == 2:
            b_dz = tl.where(m_z, b_z - b_s[:, :, None], 0.)
            b_s = b_s + 0.5 * tl.sum(b_dz * b_dz, axis=2) / n
    return b_s


@triton.jit
def _leaf_keys(p_kh, s_kt, o_leaf, m_leaf, C: tl.constexpr, CP: tl.constexpr, DP: tl.constexpr,
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
def _leaf_scores(b_q, m_row, b_k, scale, BT: tl.constexpr, GP: tl.constexpr, C: tl.constexpr,
                 CP: tl.constexpr, SCORER: tl.constexpr, F32_PREC: tl.constexpr):
    """Scores ``[BT, L]`` of the leaves whose keys ``_leaf_keys`` loaded into ``b_k [L * CP, DP]``,
    for the ``BT`` tokens of the query rows ``b_q [BT * GP, DP]``: one dot, then per block and
    row ``_key_scores``, summed over each token's heads."""
    M: tl.constexpr = b_q.shape[0]
    L: tl.constexpr = b_k.shape[0] // CP
    o_c = tl.arange(0, CP)
    b_z = tl.reshape(_dot_nt(b_q, b_k, F32_PREC) * scale, [M, L, CP])
    return _token_sums(_key_scores(b_z, (o_c < C)[None, None, :], C, SCORER), m_row, BT, GP)


@triton.jit
def _leaf_key_scores(b_q, m_row, p_kh, s_kt, o_leaf, m_leaf, scale,
                     BT: tl.constexpr, GP: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                     DP: tl.constexpr, D: tl.constexpr, SCORER: tl.constexpr,
                     F32_PREC: tl.constexpr):
    """Exact scores ``[BT, L]`` of the full leaf blocks ``o_leaf [L]`` (siblings) for every token of
    the tile, from their keys: one ``[L * C, D]`` load and one dot against all ``BT * G`` query
    rows. Leaves outside ``m_leaf`` are not loaded and score garbage."""
    b_k = _leaf_keys(p_kh, s_kt, o_leaf, m_leaf, C, CP, DP, D)
    return _leaf_scores(b_q, m_row, b_k, scale, BT, GP, C, CP, SCORER, F32_PREC)


@triton.jit
def _forced_parents(o_p, c0, c1, span):
    """Forced nodes ``[0, a(c0 - 1), a(c0), a(c1)]`` (``a(x) = x // span``) at slot ``o_p``, and
    whether the slot holds a node not already listed (the list is non-decreasing)."""
    a_prev = tl.maximum(c0 - 1, 0) // span
    a_cur = c0 // span
    a_last = c1 // span
    par = tl.where(o_p == 0, 0, tl.where(o_p == 1, a_prev, tl.where(o_p == 2, a_cur, a_last)))
    before = tl.where(o_p == 1, 0, tl.where(o_p == 2, a_prev, a_cur))
    return par, (o_p == 0) | (par != before)


@triton.jit
def _store_selection(p_idx, p_cnt, i_b, i_h, t0, cur, m_tok, b_top, s_ib, s_it, s_ih, s_cb, s_ct,
                     TOPK: tl.constexpr, IN_BUDGET: tl.constexpr, SLOTS: tl.constexpr,
                     SP: tl.constexpr):
    """Write each token's row: the sink at column 0, its ``nc`` chosen free blocks ascending in
    columns ``1..nc``, then blocks ``cur - 1, cur``, then ``-1``; and the count. ``b_top [BT, KS]``
    holds the token's best candidate keys sorted descending (free blocks lie in ``[1, cur - 2]``,
    so this is the ascending order of the whole row)."""
    BT: tl.constexpr = b_top.shape[0]
    KS: tl.constexpr = b_top.shape[1]
    o_k = tl.arange(0, KS)
    o_bt = tl.arange(0, BT)
    n_forced = 1 + (cur >= 1).to(tl.int32) + (cur >= 2).to(tl.int32)
    budget = tl.full(cur.shape, TOPK, tl.int32)
    if IN_BUDGET:
        budget = budget - n_forced
    m_ch = (o_k[None, :] < budget[:, None]) & (b_top != _KEY_NONE)
    b_sel = tl.sort(tl.where(m_ch, _unpack_idx(b_top), 0x7FFFFFFF), dim=1)  # chosen first
    nc = tl.sum(m_ch.to(tl.int32), axis=1)
    count = nc + n_forced

    p_row = p_idx + i_b.to(tl.int64) * s_ib + (t0 + o_bt).to(tl.int64) * s_it + i_h * s_ih
    tl.store(p_row[:, None] + 1 + o_k[None, :], b_sel,
             mask=(o_k[None, :] < nc[:, None]) & m_tok[:, None])
    o_s = tl.arange(0, SP)
    b_val = tl.where((o_s[None, :] == count[:, None] - 1) & (cur[:, None] >= 1), cur[:, None], -1)
    b_val = tl.where((o_s[None, :] == count[:, None] - 2) & (cur[:, None] >= 2), cur[:, None] - 1,
                     b_val)
    b_val = tl.where(o_s[None, :] == 0, 0, b_val)
    m_st = m_tok[:, None] & (o_s[None, :] < SLOTS) \
        & ((o_s[None, :] == 0) | (o_s[None, :] > nc[:, None]))
    tl.store(p_row[:, None] + o_s[None, :], b_val, mask=m_st)
    p_cnt_row = p_cnt + i_b.to(tl.int64) * s_cb + (t0 + o_bt).to(tl.int64) * s_ct + i_h
    tl.store(p_cnt_row, count, mask=m_tok)


# ------------------------------------------------------------------------------------------------
# Kernels: pyramid selection
# ------------------------------------------------------------------------------------------------

@triton.jit
def _candidates(b_rest, n_rest, c0, c1, span_up, G_BR: tl.constexpr, GBP: tl.constexpr,
                WP: tl.constexpr):
    """Candidate nodes ``[2 * GBP * WP]`` of a level and which slots hold one: the children of the
    kept nodes ``b_rest`` of the level above (``span_up`` leaves per node) interleaved with the
    children of that level's forced nodes (``_forced_parents``, ``GBP`` slots each)."""
    NA: tl.constexpr = GBP * WP
    o_w = tl.arange(0, WP)
    o_c = tl.arange(0, GBP)
    o_a = tl.reshape(b_rest[None, :] * G_BR + o_c[:, None], [NA])
    m_a = tl.reshape((o_w[None, :] < n_rest) & (o_c[:, None] < G_BR), [NA])
    o_f = tl.arange(0, NA)
    par, m_par = _forced_parents(o_f // GBP, c0, c1, span_up)
    o_b = par * G_BR + o_f % GBP
    m_b = m_par & (o_f < 4 * GBP) & (o_f % GBP < G_BR)
    return tl.reshape(tl.join(o_a, o_b), [2 * NA]), tl.reshape(tl.join(m_a, m_b), [2 * NA])


@triton.jit
def _walk(b_q, m_row, p_mh, s_mn, p_counts, p_off, n_levels, top_span, c0, c1, t_last, scale,
          C: tl.constexpr, G_BR: tl.constexpr, GBP: tl.constexpr, W: tl.constexpr,
          WP: tl.constexpr, SCORER: tl.constexpr, DP: tl.constexpr, D: tl.constexpr,
          LO: tl.constexpr, SKIP: tl.constexpr, QT: tl.constexpr, F32_PREC: tl.constexpr):
    """The internal levels of the walk, from the root's children down to level 2, for the query
    rows ``b_q`` (``m_row``: the real ones) of a tile whose tokens lie in leaves ``c0..c1``
    (``t_last`` its last position). Returns ``b_rest [WP]``, the kept non-forced level-2 nodes
    (``n_rest`` of them, best first).

    A level's candidates (``_candidates``, ``NX`` slots) are the children of the kept nodes above
    plus the non-forced causal children of the forced nodes above; forced nodes themselves are
    never carried, their indices follow from the tile's position. A level with at most ``W``
    candidates is not scored (all are kept).

    ``SKIP``: the top levels where that holds are not visited. Down to the first level with more
    than ``W`` candidates, every level's candidates are all its non-forced causal nodes: with
    ``a(x) = x // span`` (``span >= 2`` leaves a node), the forced nodes ``a(c0 - 1) .. a(c1)`` are
    the last causal ones and node 0, so the candidates are nodes ``1 .. a(c0 - 1) - 1``, in index
    order (the order an unscored level's top-W leaves them in)."""
    NX: tl.constexpr = 2 * GBP * WP
    b_rest = tl.zeros([WP], dtype=tl.int32)
    n_rest = 0
    span = top_span  # leaves under a node of the level being ranked
    i0 = 0
    if SKIP:
        n_next = tl.maximum(tl.maximum(c0 - 1, 0) // span - 1, 0)  # candidates of level i0
        while (i0 < n_levels - 2) & (n_next <= W):
            n_rest = n_next
            i0 += 1
            span = span // G_BR
            n_next = tl.maximum(tl.maximum(c0 - 1, 0) // span - 1, 0)
        b_rest = tl.arange(0, WP) + 1
    for i in range(i0, n_levels - 2):
        lvl = n_levels - 1 - i
        o_x, m_x = _candidates(b_rest, n_rest, c0, c1, span * G_BR, G_BR, GBP, WP)
        # Drop forced and future nodes (only children of forced nodes can be either).
        m_x = m_x & (o_x * span * C <= t_last) & (o_x != 0) \
            & (o_x != tl.maximum(c0 - 1, 0) // span) & (o_x != c0 // span) & (o_x != c1 // span)
        n_cand = tl.sum(m_x.to(tl.int32))
        # Unscored candidates rank by node index, which keeps all of them (n_cand <= W).
        b_s = tl.zeros([NX], dtype=tl.float32)
        if n_cand > W:
            lo = tl.load(p_off + lvl - 2)
            n_child = tl.load(p_off + lvl - 1) - lo
            if QT and SCORER == 0 and G_BR == 2:
                b_sm = _pair_lse_scores(b_q, o_x, m_x, p_mh + lo.to(tl.int64) * s_mn, s_mn,
                                        p_counts + lo, n_child, scale, D, LO, F32_PREC)
            else:
                b_sm = _child_scores(b_q, o_x, m_x, p_mh + lo.to(tl.int64) * s_mn, s_mn,
                                     p_counts + lo, n_child, scale, G_BR, SCORER, DP, D, LO, QT,
                                     F32_PREC)
            if QT:  # [NX, BT * GP]
                b_s = tl.sum(tl.where(m_row[None, :], b_sm, 0.), axis=1)
            else:  # [BT * GP, NX]
                b_s = tl.sum(tl.where(m_row[:, None], b_sm, 0.), axis=0)
        # The W best (slots >= n_rest are dropped by _candidates), best first.
        b_top = tl.topk(tl.where(m_x, _pack(b_s, o_x), _KEY_NONE), WP)
        b_rest = tl.where(b_top != _KEY_NONE, _unpack_idx(b_top), 0)
        n_rest = tl.minimum(n_cand, W)
        span = span // G_BR
    return b_rest, n_rest


@triton.jit
def _pyramid_select_kernel(
        p_q, p_k, p_means, p_counts, p_off, p_sub, p_sub_counts, p_idx, p_cnt,
        Tq, Tk, n_levels, top_span, scale,
        s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_mb, s_mn, s_mh, s_ub, s_un, s_uh,
        s_ib, s_it, s_ih, s_cb, s_ct,
        G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        C: tl.constexpr, CP: tl.constexpr, G_BR: tl.constexpr, GBP: tl.constexpr,
        W: tl.constexpr, WP: tl.constexpr, KS: tl.constexpr,
        TOPK: tl.constexpr, SLOTS: tl.constexpr, SP: tl.constexpr, IN_BUDGET: tl.constexpr,
        SCORER: tl.constexpr, SUB: tl.constexpr, LO: tl.constexpr, FAST: tl.constexpr,
        F32_PREC: tl.constexpr):
    """Walk (``_walk``) + leaf ranking for the ``BT`` queries of tile ``i_t`` (``BT == 1``: the
    oracle's walk), in one program: ``variant="fused"``; ``FAST``: ``"fused_fast"`` (the walk skips
    the unscored top levels and scores with transposed dots)."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NA: tl.constexpr = GBP * WP
    NX: tl.constexpr = 2 * NA
    t0 = i_t * BT
    b_q, m_row = _load_queries(p_q, i_b, i_h, t0, Tq, s_qb, s_qt, s_qh, G, GP, BT, D, DP)

    # Tile geometry: current blocks cur of its tokens; the tile's forced leaves are
    # {0, c0 - 1, c0, c1 - 1, c1} with c1 <= c0 + 1 (BT <= C).
    o_bt = tl.arange(0, BT)
    m_tok = t0 + o_bt < Tq
    cur = (Tk - Tq + t0 + o_bt) // C
    t_last = Tk - Tq + tl.minimum(t0 + BT, Tq) - 1
    c0 = (Tk - Tq + t0) // C
    c1 = t_last // C
    p_mh = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh

    o_w = tl.arange(0, WP)
    b_rest, n_rest = _walk(b_q, m_row, p_mh, s_mn, p_counts, p_off, n_levels, top_span, c0, c1,
                           t_last, scale, C, G_BR, GBP, W, WP, SCORER, DP, D, LO, FAST, FAST,
                           F32_PREC)

    # Leaf candidates, as above; each token keeps those in its own free range [1, cur - 2].
    o_x, m_x = _candidates(b_rest, n_rest, c0, c1, G_BR, G_BR, GBP, WP)
    m_free = m_x[None, :] & (o_x[None, :] >= 1) & (o_x[None, :] <= cur[:, None] - 2)  # [BT, NX]
    if SUB > 0:
        p_uh = p_sub + i_b.to(tl.int64) * s_ub + i_h * s_uh
        n_sub = (Tk + C // SUB - 1) // (C // SUB)
        m_any = tl.max(m_free.to(tl.int32), axis=0) > 0
        b_sm = _child_scores(b_q, o_x, m_any, p_uh, s_un, p_sub_counts, n_sub, scale,
                             SUB, SCORER, DP, D, 0, False, F32_PREC)
        b_s = _token_sums(b_sm, m_row, BT, GP)  # [BT, NX]
    else:
        # One load and one dot per parent (its G_BR children together). Scores land in the
        # slots of _candidates: b_sa [BT, GBP, WP] (child c of kept parent j), b_sb [BT, WP, GBP]
        # (child c of forced parent f < 4), interleaved by the final join.
        p_kh = p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh
        o_c = tl.arange(0, GBP)
        b_sa = tl.zeros([BT, GBP, WP], dtype=tl.float32)
        for j in range(0, n_rest):
            o_leaf = tl.sum(tl.where(o_w == j, b_rest, 0)) * G_BR + o_c
            b_sj = _leaf_key_scores(b_q, m_row, p_kh, s_kt, o_leaf, o_c < G_BR, scale,
                                    BT, GP, C, CP, DP, D, SCORER, F32_PREC)  # [BT, GBP]
            b_sa = tl.where((o_w == j)[None, None, :], b_sj[:, :, None], b_sa)
        o_f = tl.arange(0, WP)
        b_sb = tl.zeros([BT, WP, GBP], dtype=tl.float32)
        for f in range(0, 4):
            par_f, new_f = _forced_parents(f, c0, c1, G_BR)
            o_leaf = par_f * G_BR + o_c
            m_leaf = new_f & (o_c < G_BR) & (o_leaf >= 1) & (o_leaf <= c1 - 2)
            if tl.max(m_leaf.to(tl.int32)) > 0:
                b_sf = _leaf_key_scores(b_q, m_row, p_kh, s_kt, o_leaf, m_leaf, scale,
                                        BT, GP, C, CP, DP, D, SCORER, F32_PREC)
                b_sb = tl.where((o_f == f)[None, :, None], b_sf[:, None, :], b_sb)
        b_s = tl.reshape(tl.join(tl.reshape(b_sa, [BT, NA]), tl.reshape(b_sb, [BT, NA])),
                         [BT, NX])

    b_top = tl.topk(tl.where(m_free, _pack(b_s, o_x[None, :]), _KEY_NONE), KS)  # [BT, KS]
    _store_selection(p_idx, p_cnt, i_b, i_h, t0, cur, m_tok, b_top, s_ib, s_it, s_ih, s_cb, s_ct,
                     TOPK, IN_BUDGET, SLOTS, SP)


# ------------------------------------------------------------------------------------------------
# Kernels: pyramid selection in three launches and a sort (variant="csc")
# ------------------------------------------------------------------------------------------------

@triton.jit
def _pyramid_walk_kernel(
        p_q, p_means, p_counts, p_off, p_key,
        Tq, Tk, n_levels, top_span, scale, n_par, n_chunk, chunk,
        s_qb, s_qt, s_qh, s_mb, s_mn, s_mh,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, C: tl.constexpr,
        G_BR: tl.constexpr, GBP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
        S: tl.constexpr, SCORER: tl.constexpr, LO: tl.constexpr, KEY_NONE: tl.constexpr,
        F32_PREC: tl.constexpr):
    """The internal levels of query ``i_t``'s walk (``_walk``); writes the level-2 parents of its
    leaf candidates into its ``S = WP + 3`` slots of ``p_key [B, Tq, HKV, S]``: the ``n_rest`` kept
    nodes, then the (up to 3) forced level-2 nodes that have a free child. A slot holds the sort key
    ``((b * HKV + h) * n_chunk + i_t // chunk) * n_par + parent``, or ``KEY_NONE`` when empty."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HKV = tl.num_programs(1)
    b_q, m_row = _load_queries(p_q, i_b, i_h, i_t, Tq, s_qb, s_qt, s_qh, G, GP, 1, D, DP)
    t_abs = Tk - Tq + i_t
    cur = t_abs // C
    p_mh = p_means + i_b.to(tl.int64) * s_mb + i_h * s_mh
    b_rest, n_rest = _walk(b_q, m_row, p_mh, s_mn, p_counts, p_off, n_levels, top_span, cur, cur,
                           t_abs, scale, C, G_BR, GBP, W, WP, SCORER, DP, D, LO, True, True,
                           F32_PREC)

    base = ((i_b * HKV + i_h) * n_chunk + i_t // chunk).to(tl.int64) * n_par
    p_row = p_key + ((i_b * Tq + i_t) * HKV + i_h).to(tl.int64) * S
    o_w = tl.arange(0, WP)
    b_key = tl.where(o_w < n_rest, base + b_rest, KEY_NONE)
    tl.store(p_row + o_w, b_key.to(p_key.dtype.element_ty))
    o_f = tl.arange(0, 4)
    par, new = _forced_parents(o_f, cur, cur, G_BR)  # slot 3 repeats slot 2 (c1 == c0)
    b_key = tl.where(new & (par * G_BR <= cur - 2), base + par, KEY_NONE)
    tl.store(p_row + WP + o_f, b_key.to(p_key.dtype.element_ty), mask=o_f < 3)


@triton.jit
def _leaf_groups_kernel(
        p_q, p_k, p_start, p_pair, p_score, Tq, Tk, HKV, n_chunk, n_par, scale,
        s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
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
        i_h = i_bh % HKV
        o_c = tl.arange(0, GBP)
        o_leaf = i_par * G_BR + o_c
        # Leaves past the end (children of forced parents) are never free: skip their loads.
        m_leaf = (o_c < G_BR) & ((o_leaf + 1) * C <= Tk)
        b_k = _leaf_keys(p_k + i_b.to(tl.int64) * s_kb + i_h * s_kh, s_kt, o_leaf, m_leaf,
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
            b_s = _leaf_scores(tl.reshape(b_q, [PB * GP, DP]), m_row, b_k, scale, PB, GP, C, CP,
                               SCORER, F32_PREC)  # [PB, GBP]
            tl.store(p_score + b_pair[:, None] * GBP + o_c[None, :], b_s,
                     mask=m_r[:, None] & (o_c < G_BR)[None, :])


@triton.jit
def _leaf_topk_kernel(
        p_key, p_score, p_idx, p_cnt, Tq, Tk, n_par,
        s_ib, s_it, s_ih, s_cb, s_ct,
        BT: tl.constexpr, C: tl.constexpr, G_BR: tl.constexpr, GBP: tl.constexpr,
        S: tl.constexpr, SPP: tl.constexpr, KS: tl.constexpr, TOPK: tl.constexpr,
        SLOTS: tl.constexpr, SP: tl.constexpr, IN_BUDGET: tl.constexpr,
        KEY_NONE: tl.constexpr):
    """Each of the ``BT`` tokens of tile ``i_t`` keeps its best free leaves among the children of
    its ``S`` parent slots (scores from ``_leaf_groups_kernel``) and writes its row."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HKV = tl.num_programs(1)
    t0 = i_t * BT
    o_bt = tl.arange(0, BT)
    m_tok = t0 + o_bt < Tq
    cur = (Tk - Tq + t0 + o_bt) // C
    o_s = tl.arange(0, SPP)
    o_c = tl.arange(0, GBP)
    b_pair = ((i_b * Tq + t0 + o_bt) * HKV + i_h).to(tl.int64)[:, None] * S + o_s[None, :]
    b_key = tl.load(p_key + b_pair, mask=m_tok[:, None] & (o_s < S)[None, :], other=KEY_NONE)
    o_leaf = (b_key % n_par).to(tl.int32)[:, :, None] * G_BR + o_c[None, None, :]  # [BT, SPP, GBP]
    m_free = (b_key != KEY_NONE)[:, :, None] & (o_c < G_BR)[None, None, :] & (o_leaf >= 1) \
        & (o_leaf <= cur[:, None, None] - 2)
    b_s = tl.load(p_score + b_pair[:, :, None] * GBP + o_c[None, None, :], mask=m_free, other=0.)
    b_x = tl.where(m_free, _pack(b_s, o_leaf), _KEY_NONE)
    b_top = tl.topk(tl.reshape(b_x, [BT, SPP * GBP]), KS)  # [BT, KS]
    _store_selection(p_idx, p_cnt, i_b, i_h, t0, cur, m_tok, b_top, s_ib, s_it, s_ih, s_cb, s_ct,
                     TOPK, IN_BUDGET, SLOTS, SP)


# ------------------------------------------------------------------------------------------------
# Kernels: flat selection
# ------------------------------------------------------------------------------------------------

@triton.jit
def _flat_select_kernel(
        p_q, p_k, p_means, p_idx, p_cnt, Tq, Tk, scale,
        s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_mb, s_mn, s_mh, s_ib, s_it, s_ih, s_cb, s_ct,
        G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        C: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr, LB: tl.constexpr,
        TOPK: tl.constexpr, SLOTS: tl.constexpr, SP: tl.constexpr, IN_BUDGET: tl.constexpr,
        FROM_KEYS: tl.constexpr, SCORER: tl.constexpr, F32_PREC: tl.constexpr):
    """Flat top-K over every free block ``[1, cur - 2]`` of the ``BT`` queries of tile ``i_t``.

    Blocks stream in chunks of ``NB``: ``FROM_KEYS`` scores a chunk from its keys (``LB`` blocks per
    dot; ``SCORER`` as in ``_key_scores``: lse is flat_lse), otherwise by ``scale * q . mean`` of
    the leaf means (flat_mean, one dot per chunk). Each token keeps its best ``KP`` keys, sorted
    descending, in ``b_top [BT, KP]``; a chunk that beats some token's ``KP``-th best is merged by
    two ``tl.topk`` (its own best ``KP``, then the best ``KP`` of both lists).
    """
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = i_t * BT
    b_q, m_row = _load_queries(p_q, i_b, i_h, t0, Tq, s_qb, s_qt, s_qh, G, GP, BT, D, DP)
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
    b_top = tl.full([BT, KP], _KEY_NONE, dtype=tl.int64)
    for b0 in range(1, c1 - 1, NB):
        o_blk = b0 + o_nb
        if FROM_KEYS:
            b_s = tl.zeros([BT, NB], dtype=tl.float32)
            n_blk = tl.minimum(NB, c1 - 1 - b0)
            for j in range(0, (n_blk + LB - 1) // LB):
                o_key = (b0 + j * LB) * C + o_lb
                p_kj = p_kh + o_key.to(tl.int64)[:, None] * s_kt + o_d[None, :]
                b_k = tl.load(p_kj, mask=(o_key < (c1 - 1) * C)[:, None] & m_d[None, :], other=0.)
                b_z = tl.reshape(_dot_nt(b_q, b_k, F32_PREC) * scale, [BT * GP, LB, C])
                # Every key counts: free blocks are complete and in the past.
                b_sj = _token_sums(_key_scores(b_z, o_c[None, None, :] < C, C, SCORER), m_row,
                                   BT, GP)  # [BT, LB]
                b_s3 = tl.reshape(b_s, [BT, NB // LB, LB])
                b_s3 = tl.where((o_j == j)[None, :, None], b_sj[:, None, :], b_s3)
                b_s = tl.reshape(b_s3, [BT, NB])
        else:
            p_mj = p_mh + o_blk.to(tl.int64)[:, None] * s_mn + o_d[None, :]
            b_m = tl.load(p_mj, mask=(o_blk <= c1 - 2)[:, None] & m_d[None, :], other=0.)
            b_s = _token_sums(_dot_nt_f32(b_q, b_m, F32_PREC) * scale, m_row, BT, GP)
        m_free = (o_blk[None, :] <= cur[:, None] - 2) & m_tok[:, None]
        b_key = tl.where(m_free, _pack(b_s, o_blk[None, :]), _KEY_NONE)
        if tl.sum((tl.max(b_key, axis=1) > tl.min(b_top, axis=1)).to(tl.int32)) > 0:
            b_new = tl.topk(b_key, KP)
            b_top = tl.topk(tl.reshape(tl.join(b_top, b_new), [BT, 2 * KP]), KP)

    _store_selection(p_idx, p_cnt, i_b, i_h, t0, cur, m_tok, b_top, s_ib, s_it, s_ih, s_cb, s_ct,
                     TOPK, IN_BUDGET, SLOTS, SP)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=256)
def _device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The pyramid's level offsets as an int32 tensor on ``device``, made once per geometry: a
    fresh ``torch.tensor(..., device=cuda)`` per call is a blocking copy that syncs the host with
    the GPU at every layer. Kernels only read it."""
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _launch_pyramid_build(k: torch.Tensor, block_size: int, branching: int,
                          offsets: tuple[int, ...], leaves_per_program: int = 16):
    """Means ``[B, offsets[-1], HKV, D]`` fp32 and counts ``[offsets[-1]]`` int32 of ``k``."""
    B, T, H, D = k.shape
    C, g = block_size, branching
    n_levels = len(offsets) - 1
    means = torch.empty(B, offsets[-1], H, D, dtype=torch.float32, device=k.device)
    counts = torch.empty(offsets[-1], dtype=torch.int32, device=k.device)
    off = _device_offsets(tuple(offsets), k.device)
    DP = max(16, _pow2(D))
    leaves = _pow2(leaves_per_program)
    # In-chunk levels need G_BR siblings to be adjacent rows of a power-of-two register tile.
    levels = 0
    if g & (g - 1) == 0:
        while g ** (levels + 1) <= leaves and levels + 1 < n_levels:
            levels += 1
    write_sums = levels + 1 < n_levels
    sums = means
    if write_sums:
        sums = torch.empty(B, offsets[-1] - offsets[levels], H, D, dtype=torch.float32,
                           device=k.device)
    CB = max(1, min(C, 8192 // (leaves * DP)))
    grid = (cdiv(offsets[1], leaves), H, B)
    _pyramid_chunk_kernel[grid](
        k, means, counts, sums, off, T,
        k.stride(0), k.stride(1), k.stride(2), means.stride(0), means.stride(1), means.stride(2),
        sums.stride(0), sums.stride(1), sums.stride(2),
        C=C, CB=CB, LEAVES=leaves, LEVELS=levels, G_BR=g, D=D, DP=DP, WRITE_SUMS=write_sums,
        num_warps=4)
    if write_sums:
        _pyramid_top_kernel[(H, B)](
            means, counts, sums, off, T, levels + 1, n_levels, g ** (levels + 1),
            means.stride(0), means.stride(1), means.stride(2),
            sums.stride(0), sums.stride(1), sums.stride(2),
            C=C, G_BR=g, PB=32, D=D, DP=DP, num_warps=4)
    return means, counts


def _check_pyramid(pyramid: Pyramid, k: torch.Tensor, cfg: SelectConfig) -> None:
    B, Tk, H, D = k.shape
    want = level_offsets(Tk, cfg.block_size, cfg.branching)
    if tuple(pyramid.offsets) != want:
        raise ValueError(f"pyramid offsets {pyramid.offsets} do not match k (T={Tk}, "
                         f"block_size={cfg.block_size}, branching={cfg.branching}): {want}")
    if tuple(pyramid.means.shape) != (B, want[-1], H, D) or pyramid.means.dtype != torch.float32:
        raise ValueError(f"pyramid.means must be fp32 [{B}, {want[-1]}, {H}, {D}], got "
                         f"{pyramid.means.dtype} {tuple(pyramid.means.shape)}")
    if pyramid.means.stride(-1) != 1 or pyramid.counts.stride(-1) != 1:
        raise ValueError("pyramid tensors must be contiguous in their last dim")
    if pyramid.means.device != k.device or pyramid.counts.device != k.device:
        raise ValueError("pyramid must live on k's device")


def _beam_geometry(cfg: SelectConfig, Tk: int) -> tuple[int, int, int]:
    """``(W, GBP, WP)``: the beam (at most the leaf count: no level has more candidates), the
    padded branching and the padded beam of the walk's register tiles."""
    n_leaves = cdiv(Tk, cfg.block_size)
    W = min(cfg.beam, n_leaves)
    GBP = _pow2(cfg.branching)
    # GBP * WP slots hold the children of the 4 forced parents and >= 8 columns (x2) for tl.dot.
    WP = max(_pow2(W), 4, cdiv(8, GBP))
    if 2 * GBP * WP > 1024:  # [NX, D] candidate tiles: wider ones spill and crawl
        raise ValueError(f"beam={cfg.beam} is too wide for the Triton pyramid kernel at "
                         f"branching={cfg.branching}: use beam <= {512 // GBP}, or beam >= the "
                         f"number of leaf blocks ({n_leaves}), which is the exact flat scan")
    return W, GBP, WP


def _walk_means(pyramid: Pyramid, q: torch.Tensor, walk_means: str) -> tuple[torch.Tensor, int]:
    """The means the walk reads ``[B, N, HKV, D]`` and the kernels' ``LO``. Against 16-bit queries:
    ``"split"``: fp32 means as their 16-bit head with its 16-bit residual ``LO = D`` elements on
    (same products as the in-kernel split of ``"fp32"``, done once per call); ``"input"``: rounded
    once to the queries' dtype (half the bytes, one dot; not exact against the fp64 oracle)."""
    means = pyramid.means
    if walk_means == "fp32" or q.dtype == torch.float32:
        return means, 0
    hi = means.to(q.dtype)
    if walk_means == "input":
        return hi, 0
    lo = (means - hi.float()).to(q.dtype)
    return torch.stack([hi, lo], dim=3)[:, :, :, 0], means.shape[-1]  # [B, N, HKV, (2,) D]


def _launch_select_pyramid(q, k, cfg: SelectConfig, pyramid: Pyramid, block_idx, counts,
                           walk_tile: int, leaf_sub_blocks: int, walk_means: str, fast: bool,
                           num_warps: int | None, num_stages: int | None):
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C, g = HQ // HKV, cfg.block_size, cfg.branching
    BT = walk_tile
    W, GBP, WP = _beam_geometry(cfg, Tk)
    GP = max(_pow2(G), cdiv(16, BT))  # BT * GP >= 16 rows for tl.dot
    n_levels = pyramid.n_levels
    top_span = g ** (n_levels - 2) if n_levels >= 2 else 1
    off = _device_offsets(tuple(pyramid.offsets), q.device)
    means, LO = _walk_means(pyramid, q, walk_means)
    sub, sub_counts = pyramid.means, pyramid.counts
    if leaf_sub_blocks:
        sub, sub_counts = _launch_pyramid_build(k, C // leaf_sub_blocks, 2,
                                                level_offsets(Tk, C // leaf_sub_blocks, 2)[:2])
    if num_warps is None:  # H200, default config: 4 warps 1.5x faster at BT = 1, 8 at BT = 8
        num_warps = 4 if BT * GP <= 64 else 8
    if num_stages is None:
        # Pipelined copies of the [NX, D] fp32 child tile and the [g * C, D] leaf-key tile must fit
        # shared memory (H100/H200: 227 KB a block). Counting only the child tile asked for 270 KB
        # at g=3 with fp32 keys on the H200.
        stage_bytes = 2 * GBP * WP * D * 4 + GBP * C * D * k.element_size()
        num_stages = max(1, min(3, 200_000 // stage_bytes))
    grid = (cdiv(Tq, BT), HKV, B)
    _pyramid_select_kernel[grid](
        q, k, means, pyramid.counts, off, sub, sub_counts, block_idx, counts,
        Tq, Tk, n_levels, top_span, cfg.scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        means.stride(0), means.stride(1), means.stride(2),
        sub.stride(0), sub.stride(1), sub.stride(2),
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        counts.stride(0), counts.stride(1),
        G=G, GP=GP, BT=BT, D=D, DP=max(16, _pow2(D)), C=C, CP=max(C, cdiv(16, GBP)),
        G_BR=g, GBP=GBP,
        W=W, WP=WP, KS=min(2 * GBP * WP, _pow2(cfg.topk)), TOPK=cfg.topk, SLOTS=cfg.slots,
        SP=_pow2(cfg.slots),
        IN_BUDGET=cfg.forced_in_budget, SCORER=_SCORER_ID[cfg.scorer], SUB=leaf_sub_blocks,
        LO=LO, FAST=fast, F32_PREC=_F32_PRECISION, num_warps=num_warps, num_stages=num_stages)


def _launch_select_csc(q, k, cfg: SelectConfig, pyramid: Pyramid, block_idx, counts,
                       walk_means: str, walk_maxnreg: int | None, leaf_pairs: int | None,
                       leaf_chunk: int, leaf_warps: int | None, leaf_stages: int | None,
                       num_warps: int | None, num_stages: int | None):
    """``variant="csc"``: walk -> (query, level-2 parent) pair keys -> sort -> leaf scores per
    parent group -> per-token top-K. Extra memory: ~24 bytes per slot (keys, sorted keys, pair ids,
    scores), ``S = WP + 3`` slots per (token, KV head), plus 4 bytes per possible group."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C, g = HQ // HKV, cfg.block_size, cfg.branching
    W, GBP, WP = _beam_geometry(cfg, Tk)
    S = WP + 3
    n_levels = pyramid.n_levels
    n_par = pyramid.offsets[2] - pyramid.offsets[1]  # level-2 nodes
    # Sort keys (and group ids) must fit int32; the chunk count is a grid dimension (<= 65535).
    n_chunk = min(cdiv(Tq, leaf_chunk or Tq), 65535, (2 ** 31 - 2) // (B * HKV * n_par))
    if n_chunk < 1:
        raise ValueError(f"variant='csc' supports B * HKV * (level-2 nodes) < 2**31, got "
                         f"{B} * {HKV} * {n_par}")
    chunk = cdiv(Tq, n_chunk)
    n_chunk = cdiv(Tq, chunk)
    n_keys = B * HKV * n_chunk * n_par
    key_none = torch.iinfo(torch.int32).max
    DP = max(16, _pow2(D))
    means, LO = _walk_means(pyramid, q, walk_means)
    off = _device_offsets(tuple(pyramid.offsets), q.device)

    keys = torch.empty(B, Tq, HKV, S, dtype=torch.int32, device=q.device)
    _pyramid_walk_kernel[(Tq, HKV, B)](
        q, means, pyramid.counts, off, keys, Tq, Tk, n_levels, g ** (n_levels - 2), cfg.scale,
        n_par, n_chunk, chunk, q.stride(0), q.stride(1), q.stride(2),
        means.stride(0), means.stride(1), means.stride(2),
        G=G, GP=max(_pow2(G), 16), D=D, DP=DP, C=C, G_BR=g, GBP=GBP, W=W, WP=WP, S=S,
        SCORER=_SCORER_ID[cfg.scorer], LO=LO, KEY_NONE=key_none, F32_PREC=_F32_PRECISION,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
        **({"maxnreg": walk_maxnreg} if walk_maxnreg else {}))

    # Group the pairs by key; group i holds sorted entries [start[i], start[i + 1]).
    sorted_keys, pairs = torch.sort(keys.view(-1))
    start = torch.searchsorted(sorted_keys, torch.arange(n_keys + 1, dtype=torch.int32,
                                                         device=q.device))
    scores = torch.empty(keys.numel(), GBP, dtype=torch.float32, device=q.device)
    # Default: 128 query rows a dot, fewer when the [rows, g * C] fp32 accumulator would pass 16K
    # (128 registers a thread at 4 warps); 2 stages of gathered queries when they fit shared
    # memory beside the parent's keys (fp32 at g = 3 asked for 256 KB with 128 rows, 2 stages).
    CP = max(C, cdiv(16, GBP))
    PB = leaf_pairs or max(1, min(128, 16384 // (GBP * CP)) // _pow2(G))
    GP = max(_pow2(G), cdiv(16, PB))
    smem = (GBP * CP + 2 * PB * GP) * DP * k.element_size()
    _leaf_groups_kernel[(n_par, n_chunk, B * HKV)](
        q, k, start, pairs, scores, Tq, Tk, HKV, n_chunk, n_par, cfg.scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        PB=PB, G=G, GP=GP, D=D, DP=DP, C=C, CP=CP, G_BR=g, GBP=GBP, S=S,
        SCORER=_SCORER_ID[cfg.scorer], F32_PREC=_F32_PRECISION,
        num_warps=leaf_warps or 4, num_stages=leaf_stages or (2 if smem <= 160_000 else 1))

    BT = 16
    SPP = _pow2(S)
    _leaf_topk_kernel[(cdiv(Tq, BT), HKV, B)](
        keys, scores, block_idx, counts, Tq, Tk, n_par,
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        counts.stride(0), counts.stride(1),
        BT=BT, C=C, G_BR=g, GBP=GBP, S=S, SPP=SPP, KS=min(SPP * GBP, _pow2(cfg.topk)),
        TOPK=cfg.topk, SLOTS=cfg.slots, SP=_pow2(cfg.slots), IN_BUDGET=cfg.forced_in_budget,
        KEY_NONE=key_none, num_warps=4)


def _launch_select_flat(q, k, cfg: SelectConfig, pyramid: Pyramid | None, block_idx, counts,
                        scorer: str, flat_tile: int | None, num_warps: int,
                        num_stages: int | None):
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C = HQ // HKV, cfg.block_size
    GP = _pow2(G)
    # Default: 128 query rows (8 warps of 16-row MMA tiles sharing each key load), <= 16 tokens.
    BT = flat_tile or max(1, min(16, 128 // GP))
    GP = max(GP, cdiv(16, BT))  # BT * GP >= 16 rows for tl.dot
    KP = max(16, _pow2(cfg.topk))
    NB = max(KP, 64)  # blocks per chunk (per top-K merge)
    LB = min(NB, max(1, 128 // C))  # blocks per key load: LB * C rows
    means = pyramid.means if pyramid is not None else q.new_empty(1, 1, 1, 1, dtype=torch.float32)
    grid = (cdiv(Tq, BT), HKV, B)
    _flat_select_kernel[grid](
        q, k, means, block_idx, counts, Tq, Tk, cfg.scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        means.stride(0), means.stride(1), means.stride(2),
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2),
        counts.stride(0), counts.stride(1),
        G=G, GP=GP, BT=BT, D=D, DP=max(16, _pow2(D)), C=C, KP=KP, NB=NB, LB=LB,
        TOPK=cfg.topk, SLOTS=cfg.slots, SP=_pow2(cfg.slots), IN_BUDGET=cfg.forced_in_budget,
        FROM_KEYS=cfg.selector != "flat_mean", SCORER=_SCORER_ID[scorer],
        F32_PREC=_F32_PRECISION, num_warps=num_warps, num_stages=num_stages or 3)


# ------------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------------

def build_pyramid_triton(k: torch.Tensor, block_size: int, branching: int) -> Pyramid:
    """The key pyramid of ``k [B, T, HKV, D]`` (layout of ``pisa.ops.pyramid``) in one pass over
    ``k``: fp32 sums folded upward, ``means = sums / counts``."""
    offsets = level_offsets(k.shape[1], block_size, branching)
    means, counts = _launch_pyramid_build(k, block_size, branching, offsets)
    return Pyramid(means, counts, offsets)


def select_triton(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig,
                  pyramid: Pyramid | None = None, *, variant: str | None = None,
                  walk_means: str | None = None, walk_maxnreg: int | None = None,
                  walk_tile: int = 1, leaf_sub_blocks: int = 0,
                  leaf_pairs: int | None = None, leaf_chunk: int = 4096,
                  leaf_warps: int | None = None, leaf_stages: int | None = None,
                  flat_tile: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Block selection per query token and KV head with the Triton kernels (``naive_select``'s
    semantics for ``cfg.selector`` in pyramid / flat_lse / flat_mean).

    ``q [B, Tq, HQ, D]``, ``k [B, Tk, HKV, D]`` (queries are the last ``Tq`` positions). Returns
    ``block_idx [B, Tq, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, Tq, HKV] int32``; ``out`` may supply both buffers (every element is written).
    ``pyramid`` (from ``build_pyramid_*`` on the same ``k``) is built when needed and not given.
    ``variant`` (pyramid selector only; all give the same result up to fp32 summation order):
    ``None`` (default) is ``"csc"``, or ``"fused"`` with the approximate levers (fastest on the
    H200: 55 vs 156 ms at 128K, ``benchmarks/results/select_variants_h200.json``); ``"fused"``
    walks and scores the leaves in one program per query; ``"fused_fast"`` is that program with the
    faster walk of ``"csc"`` (unscored top levels skipped, candidate-major dots); ``"csc"`` walks
    (one program per query), sorts the (query, level-2 parent) pairs by parent and scores each
    parent's leaves once per group of queries, ``leaf_pairs`` queries a dot (default ``128 // G``),
    the queries grouped by chunks of ``leaf_chunk`` tokens (0: one chunk) for cache locality, then
    picks the top-K per query. ``walk_means`` (16-bit inputs): ``"fp32"`` (``"fused"``'s default)
    splits the fp32 means into 16-bit head and residual in the kernel, ``"split"`` (the other
    variants' default) reads that split precomputed (same products), ``"input"`` reads the means
    rounded once to the input dtype (half the bytes; not exact: rounding can reorder near-equal
    nodes against the fp64 oracle).
    ``walk_tile`` / ``leaf_sub_blocks``: the approximate levers of the module docstring
    (not with ``"csc"``). Tuning knobs that keep the result exact: ``flat_tile`` (queries
    per program of the flat selectors, a power of two; default ``128 // G``, at most 16),
    ``num_warps`` (default 8; 4 for pyramid programs of <= 64 query rows; for "csc": the walk's),
    ``num_stages`` (default 3, fewer for wide beams so the pipelined tiles fit shared memory; 2 for
    the "csc" walk), ``walk_maxnreg`` (register cap of the "csc" walk, which needs 128 at the
    default config: 96 fits 5 programs an SM), ``leaf_warps`` / ``leaf_stages`` ("csc" leaf
    kernel, default 4 / 2, 1 where 2 stages would crowd shared memory)."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    C = cfg.block_size
    if cfg.selector not in ("pyramid", "flat_lse", "flat_mean"):
        raise ValueError(f"select_triton: selector must be resolved, got {cfg.selector!r}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype:
        raise TypeError(f"select_triton needs fp16/bf16/fp32 q and k of one dtype, got {q.dtype} "
                        f"and {k.dtype}")
    if flat_tile is not None and (flat_tile < 1 or flat_tile & (flat_tile - 1)):
        raise ValueError(f"flat_tile must be a power of two, got {flat_tile}")
    if walk_tile < 1 or walk_tile & (walk_tile - 1) or walk_tile > C:
        raise ValueError(f"walk_tile must be a power of two in [1, block_size], got {walk_tile}")
    if leaf_sub_blocks and (leaf_sub_blocks & (leaf_sub_blocks - 1) or C % leaf_sub_blocks
                            or leaf_sub_blocks > C):
        raise ValueError(f"leaf_sub_blocks must be 0 or a power of two dividing block_size, "
                         f"got {leaf_sub_blocks}")
    if variant is None:
        variant = "fused" if walk_tile > 1 or leaf_sub_blocks else "csc"
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if walk_means not in (None, "fp32", "split", "input"):
        raise ValueError(f"walk_means must be 'fp32', 'split' or 'input', got {walk_means!r}")
    if variant == "csc" and (walk_tile > 1 or leaf_sub_blocks):
        raise ValueError("walk_tile / leaf_sub_blocks need variant='fused' or 'fused_fast'")
    if variant != "fused" and walk_means == "fp32":
        raise ValueError(f"variant={variant!r} walks 16-bit means: walk_means must be 'split' "
                         "(the exact default) or 'input'")
    if leaf_pairs is not None and (leaf_pairs < 1 or leaf_pairs & (leaf_pairs - 1)):
        raise ValueError(f"leaf_pairs must be a power of two, got {leaf_pairs}")
    if leaf_chunk < 0:
        raise ValueError(f"leaf_chunk must be >= 0 (0: no chunking), got {leaf_chunk}")
    if out is None:
        block_idx = torch.empty(B, Tq, HKV, cfg.slots, dtype=torch.int32, device=q.device)
        counts = torch.empty(B, Tq, HKV, dtype=torch.int32, device=q.device)
    else:
        block_idx, counts = out
        if tuple(block_idx.shape) != (B, Tq, HKV, cfg.slots) or block_idx.dtype != torch.int32 \
                or block_idx.stride(-1) != 1:
            raise ValueError(f"out[0] must be int32 [{B}, {Tq}, {HKV}, {cfg.slots}], contiguous "
                             "in its last dim")
        if tuple(counts.shape) != (B, Tq, HKV) or counts.dtype != torch.int32 \
                or counts.stride(-1) != 1:
            raise ValueError(f"out[1] must be int32 [{B}, {Tq}, {HKV}], contiguous in its last dim")
    if B * Tq * HKV == 0:
        return block_idx, counts
    if pyramid is not None:
        _check_pyramid(pyramid, k, cfg)
    # A beam as wide as the leaf count prunes nothing: the walk reduces to the flat scan of the
    # leaf scores (and candidate tiles that wide would not fit the pyramid kernel).
    walk = cfg.selector == "pyramid" and (cfg.beam < cdiv(Tk, C) or leaf_sub_blocks > 0)
    if pyramid is None and (walk or cfg.selector == "flat_mean"):
        pyramid = build_pyramid_triton(k, C, cfg.branching)
    if walk_means is None:  # the fast walks take 16-bit means (exact when split)
        walk_means = "fp32" if variant == "fused" else "split"
    if walk and variant != "csc":
        _launch_select_pyramid(q, k, cfg, pyramid, block_idx, counts, walk_tile, leaf_sub_blocks,
                               walk_means, variant == "fused_fast", num_warps, num_stages)
    elif walk:
        _launch_select_csc(q, k, cfg, pyramid, block_idx, counts, walk_means, walk_maxnreg,
                           leaf_pairs, leaf_chunk, leaf_warps, leaf_stages, num_warps,
                           num_stages)
    else:
        scorer = cfg.scorer if cfg.selector == "pyramid" else "lse"
        _launch_select_flat(q, k, cfg, pyramid, block_idx, counts, scorer, flat_tile,
                            num_warps or 8, num_stages)
    return block_idx, counts
