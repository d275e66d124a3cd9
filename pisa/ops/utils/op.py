"""``@triton.jit`` primitives and launch helpers shared by the Triton kernels of every op.

Scores are packed into int64 keys (order-preserving float bits, then ``2**31 - 1 - index``), so
"higher score, then lower block index" (the oracle's tie rule) is one integer comparison.

Precision: keys and queries enter ``tl.dot`` in their dtype (16-bit products are exact; fp32
accumulation). fp32 inputs are the testing path and use ``input_precision="ieee"`` (tf32 would
reorder near-equal candidates against the fp64 oracle). Pooled means are fp32: against 16-bit
queries they enter as a 16-bit head plus a 16-bit residual (two dots, ~16 mantissa bits).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .interpreter import patch_interpreter

patch_interpreter()  # TRITON_INTERPRET=1 on NumPy >= 2.4, before any kernel of this package runs

LOG2E = math.log2(math.e)
# kernels work in base 2 (exp2 is the native instruction); lse is stored in natural log
LN2_K: tl.constexpr = tl.constexpr(math.log(2.0))
LOG2E_K: tl.constexpr = tl.constexpr(LOG2E)
# Smallest int64: the key of an empty / invalid candidate, below every real score.
KEY_NONE: tl.constexpr = tl.constexpr(-(2 ** 63))
F32_PRECISION = "ieee"


# ------------------------------------------------------------------------------------------------
# Rows, dots and packed keys
# ------------------------------------------------------------------------------------------------

@triton.jit
def load_rows(p, o_row, m_row, D: tl.constexpr):
    """[len(o_row), D]: rows of ``D`` contiguous elements at offsets ``o_row`` from ``p``."""
    o_d = tl.arange(0, D)
    return tl.load(p + o_row[:, None] + o_d[None, :], mask=m_row[:, None], other=0.0)


@triton.jit
def store_rows(p, o_row, m_row, x, D: tl.constexpr):
    o_d = tl.arange(0, D)
    tl.store(p + o_row[:, None] + o_d[None, :], x.to(p.dtype.element_ty), mask=m_row[:, None])


@triton.jit
def pack(b_score, o_idx):
    """int64 keys ordered by score, then by lower index (the oracle's tie rule)."""
    b_bits = b_score.to(tl.int32, bitcast=True)
    b_bits = tl.where(b_bits < 0, b_bits ^ 0x7FFFFFFF, b_bits)  # monotone in the float value
    return (b_bits.to(tl.int64) << 32) | (0x7FFFFFFF - o_idx).to(tl.int64)


@triton.jit
def unpack_idx(b_key):
    return 0x7FFFFFFF - b_key.to(tl.int32)  # the low word


@triton.jit
def dot_nt(b_q, b_x, F32_PREC: tl.constexpr):
    """``b_q [M, DP] @ b_x[N, DP]^T`` in fp32; ``b_x`` is in ``b_q``'s dtype (keys)."""
    if b_q.dtype == tl.float32:
        b_z = tl.dot(b_q, tl.trans(b_x), input_precision=F32_PREC)
    else:
        b_z = tl.dot(b_q, tl.trans(b_x))
    return b_z


@triton.jit
def dot_nt_f32(b_q, b_x, F32_PREC: tl.constexpr):
    """``b_q [M, DP] @ b_x[N, DP]^T`` for fp32 ``b_x`` (pooled means) at ~fp32 accuracy: against
    16-bit queries ``b_x`` is split into a 16-bit head and a 16-bit residual (two exact-product
    dots) instead of being rounded once."""
    if b_q.dtype == tl.float32:
        b_z = tl.dot(b_q, tl.trans(b_x), input_precision=F32_PREC)
    else:
        b_hi = b_x.to(b_q.dtype)
        b_lo = (b_x - b_hi.to(tl.float32)).to(b_q.dtype)
        b_z = tl.dot(b_q, tl.trans(b_hi)) + tl.dot(b_q, tl.trans(b_lo))
    return b_z


@triton.jit
def dot_pv(b_p, b_v, F32_PREC: tl.constexpr):
    """``b_p [M, C] @ b_v [C, D]`` in fp32, ``b_p`` rounded to the values' dtype."""
    if b_v.dtype == tl.float32:
        b_o = tl.dot(b_p, b_v, input_precision=F32_PREC)
    else:
        b_o = tl.dot(b_p.to(b_v.dtype), b_v)
    return b_o


# ------------------------------------------------------------------------------------------------
# Online softmax (base 2)
# ------------------------------------------------------------------------------------------------

@triton.jit
def online_softmax_step(b_s, b_v, b_m, b_l, b_acc, F32_PREC: tl.constexpr):
    """Fold one key tile into the running ``(max, sum, output)`` of each row: ``b_s [M, N]`` the
    tile's masked logits in log2 units (-inf where a key is not seen), ``b_v [N, D]`` its values.
    """
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # rows that have seen no key yet keep -inf; shift them by 0 so exp2 gives 0, not nan (a NaN
    # or +inf logit still makes b_p, hence b_l, NaN: ``softmax_output`` keeps it)
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s - b_shift[:, None])
    b_alpha = tl.exp2(b_m - b_shift)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + dot_pv(b_p, b_v, F32_PREC)
    return b_m_new, b_l, b_acc


@triton.jit
def softmax_output(b_m, b_l, b_acc):
    """The normalised output ``[M, D]`` and natural-log LSE ``[M]`` of an online softmax
    (``o = 0``, ``lse = -inf`` for a row that saw no key: ``b_l == 0``). A NaN or +inf logit
    (NaN / Inf input, overflow) leaves ``b_l`` NaN, which stays NaN in ``o`` and ``lse``, as in
    dense attention (``b_l > 0`` would read it as "no key" and return zeros)."""
    b_l_safe = tl.where(b_l == 0, 1.0, b_l)
    b_lse = tl.where(b_l == 0, float("-inf"), (b_m + tl.log2(b_l_safe)) * LN2_K)
    return b_acc / b_l_safe[:, None], b_lse


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------

def poisoned() -> bool:
    """``PISA_TRITON_POISON=1``: outputs are allocated filled with NaN (tests prove every element
    is written)."""
    return os.environ.get("PISA_TRITON_POISON", "") not in ("", "0")


def empty(*shape, dtype, device, poison: bool | None = None) -> torch.Tensor:
    """``torch.empty``, or NaN-filled with ``poison`` (default ``poisoned()``: a caller
    allocating several outputs reads the environment once)."""
    if poisoned() if poison is None else poison:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype,
                          device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The pyramid's level offsets as an int32 tensor on ``device``, made once per geometry: a
    fresh ``torch.tensor(..., device=cuda)`` per call is a blocking copy that syncs the host with
    the GPU at every layer. Kernels only read it."""
    return torch.tensor(offsets, dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------------------------
# Selection: query tiles, key scores, the selection row
# ------------------------------------------------------------------------------------------------

@triton.jit
def load_queries(p_q, i_b, i_h, t0, Tq, s_qb, s_qt, s_qh,
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
        + (i_h * G + o_mh).to(tl.int64)[:, None] * s_qh + o_d[None, :]
    return tl.load(p, mask=m_row[:, None] & (o_d < D)[None, :], other=0.), m_row


@triton.jit
def token_sums(b_x, m_row, BT: tl.constexpr, GP: tl.constexpr):
    """``[BT * GP, N]`` per-(token, head) rows -> ``[BT, N]`` sums over each token's real heads."""
    N: tl.constexpr = b_x.shape[1]
    b_x = tl.where(m_row[:, None], b_x, 0.)
    return tl.sum(tl.reshape(b_x, [BT, GP, N]), axis=1)


@triton.jit
def key_scores(b_z, m_z, n, SCORER: tl.constexpr):
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
def n_forced(cur):
    """How many distinct forced blocks (sink, previous, current) a query in block ``cur`` (counted
    from its sequence's first block) has."""
    return 1 + (cur >= 1).to(tl.int32) + (cur >= 2).to(tl.int32)


@triton.jit
def selection_row(cur, b_top, s0, TOPK: tl.constexpr, IN_BUDGET: tl.constexpr,
                  SP: tl.constexpr):
    """Each token's selected blocks ascending, ``[BT, SP]`` int32 ``-1`` padded, and their count
    ``[BT]``: the sink ``s0`` (its sequence's first block: 0, or per token in a packed layout),
    the best ``TOPK - #forced`` (``TOPK``: ``IN_BUDGET=False``) free blocks of ``b_top [BT, KS]``
    (packed keys, best first; free blocks lie in ``[s0 + 1, cur - 2]``), then blocks
    ``cur - 1, cur``."""
    KS: tl.constexpr = b_top.shape[1]
    o_k = tl.arange(0, KS)
    nf = n_forced(cur - s0)
    budget = tl.full(cur.shape, TOPK, tl.int32)
    if IN_BUDGET:
        budget = budget - nf
    m_ch = (o_k[None, :] < budget[:, None]) & (b_top != KEY_NONE)
    b_sel = tl.sort(tl.where(m_ch, unpack_idx(b_top), 0x7FFFFFFF), dim=1)  # chosen first
    nc = tl.sum(m_ch.to(tl.int32), axis=1)
    count = nc + nf
    o_s = tl.arange(0, SP)
    m_at = o_k[None, None, :] == o_s[None, :, None] - 1  # column s holds chosen block s - 1
    b_row = tl.sum(tl.where(m_at, b_sel[:, None, :], 0), axis=2)  # [BT, SP]
    b_row = tl.where(o_s[None, :] <= nc[:, None], b_row, -1)
    rel = (cur - s0)[:, None]
    b_row = tl.where((o_s[None, :] == count[:, None] - 2) & (rel >= 2), cur[:, None] - 1, b_row)
    b_row = tl.where((o_s[None, :] == count[:, None] - 1) & (rel >= 1), cur[:, None], b_row)
    return tl.where(o_s[None, :] == 0, s0[:, None], b_row), count


@triton.jit
def write_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, m_q, cur, s0, b_top, s_ib, s_i, s_cb,
                    s_ct, PICK: tl.constexpr):
    """Rows ``t0 ..`` (``m_tok`` the real ones, ``m_q`` those with queries; the others are
    written empty) take their forced blocks and the best free ones of ``b_top [BT, KS]``
    (``selection_row``) and are stored (``store_selection``)."""
    b_row, count = selection_row(cur, b_top, s0, PICK.TOPK, PICK.IN_BUDGET, PICK.SLOTS_P)
    b_row = tl.where(m_q[:, None], b_row, -1)
    count = tl.where(m_q, count, 0)
    s_it, s_ih = s_i
    store_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, b_row, count, s_ib, s_it, s_ih, s_cb, s_ct,
                    PICK.SLOTS)


@triton.jit
def store_selection(p_idx, p_cnt, i_b, i_h, t0, m_tok, b_row, count, s_ib, s_it, s_ih, s_cb,
                    s_ct, SLOTS: tl.constexpr):
    """Write the rows ``b_row [BT, SP]`` (``selection_row``) of tokens ``t0 ..`` (``m_tok``: the
    real ones) into ``block_idx`` and their counts into ``counts``."""
    BT: tl.constexpr = b_row.shape[0]
    SP: tl.constexpr = b_row.shape[1]
    o_bt = tl.arange(0, BT)
    o_s = tl.arange(0, SP)
    p_row = p_idx + i_b.to(tl.int64) * s_ib + (t0 + o_bt).to(tl.int64) * s_it + i_h * s_ih
    tl.store(p_row[:, None] + o_s[None, :], b_row, mask=m_tok[:, None] & (o_s < SLOTS)[None, :])
    p_cnt_row = p_cnt + i_b.to(tl.int64) * s_cb + (t0 + o_bt).to(tl.int64) * s_ct + i_h
    tl.store(p_cnt_row, count, mask=m_tok)
