"""Sparse attention over selected key blocks, vectorised PyTorch (CPU and CUDA).

The torch backend regroups the (query, selected block) pairs of a chunk of queries by block
(``utils.csr.group_pairs``): each group of up to ``PAIRS_PER_GROUP`` queries reads its block's keys
and values once and computes a partial softmax (max, sum, unnormalised output) with batched matmuls;
the partials of a query's blocks are then merged (as flash-decoding merges splits). The backward
recomputes probabilities from the saved LSE (as FlashAttention does) in the same grouped layout, so
dK/dV accumulate per block. Memory is O(chunk · S · G · (C + D)); no ``[T, T]`` or ``[T, N/C]``.
A tile selection (``query_tile > 1``) is expanded to per-token rows first (``utils.csr.token_rows``,
``[B, Tq, HKV, S]`` int32: O(N · S) memory) and runs the same path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..utils.config import CHUNK_ELEMS, PAIRS_PER_GROUP
from ..utils.csr import PairGroups, group_pairs, token_rows
from ..utils.geometry import cdiv, compute_dtype


def _blocked(x: torch.Tensor, block_size: int, dtype) -> torch.Tensor:
    """``x [B, T, H, D]`` as ``[B*H*N, C, D]`` blocks (zero-padded tail) in the compute dtype."""
    B, T, H, D = x.shape
    N = cdiv(T, block_size)
    x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, N * block_size - T))
    return x.view(B, N, block_size, H, D).permute(0, 3, 1, 2, 4).reshape(B * H * N, block_size, D)


def _unblocked(xb: torch.Tensor, shape) -> torch.Tensor:
    B, T, H, D = shape
    N = xb.shape[0] // (B * H)
    return xb.view(B, H, N * xb.shape[1], D)[:, :, :T].permute(0, 2, 1, 3)


@dataclass
class _Chunk:
    """The grouped pairs of one chunk of queries ``[s, e)``."""

    pg: PairGroups
    row: torch.Tensor     # [n_groups * size] query row (b, t, h) of each slot; the last row = empty
    n_rows: int           # B * Tc * H
    mask: torch.Tensor    # [n_groups, size, 1, C] key is causal and inside the sequence


def _chunk(block_idx, s, e, Tq, Tk, n_blocks, block_size) -> _Chunk:
    B, _, H, _ = block_idx.shape
    Tc = e - s
    idx = block_idx[:, s:e]
    b, t, h, j = torch.nonzero(idx >= 0, as_tuple=True)
    blk = idx[b, t, h, j].long()
    pg = group_pairs((b * H + h) * n_blocks + blk, B * H * n_blocks, PAIRS_PER_GROUP)
    n_rows = B * Tc * H
    row = pg.layout((b * Tc + t) * H + h, n_rows)
    t_abs = pg.layout(Tk - Tq + s + t, -1).view(pg.n_groups, PAIRS_PER_GROUP, 1, 1)
    key = (pg.block % n_blocks)[:, None] * block_size + torch.arange(block_size,
                                                                     device=idx.device)
    mask = (key[:, None, None, :] <= t_abs) & (key[:, None, None, :] < Tk)
    return _Chunk(pg, row, n_rows, mask)


def _rows(x: torch.Tensor, ch: _Chunk, s: int, e: int, fill: float = 0.0) -> torch.Tensor:
    """Per-slot copy of ``x [B, Tq, H*G, ...]`` rows of the chunk: ``[n_groups, size, G, ...]``,
    reading ``fill`` in empty slots."""
    H = ch.n_rows // (x.shape[0] * (e - s))
    xr = x[:, s:e].reshape(ch.n_rows, x.shape[2] // H, *x.shape[3:])
    xr = torch.cat([xr, xr.new_full((1, *xr.shape[1:]), fill)])
    return xr[ch.row].view(ch.pg.n_groups, PAIRS_PER_GROUP, *xr.shape[1:])


def _logits(qg, kb, ch, scale):
    """Masked logits ``[n_groups, size, G, C]`` of each slot's query heads against its block."""
    ng, P, G, D = qg.shape
    z = torch.bmm(qg.view(ng, P * G, D), kb[ch.pg.block].transpose(1, 2)) * scale
    return z.view(ng, P, G, kb.shape[1]).masked_fill_(~ch.mask, -math.inf)


def _chunks(q, k, block_idx):
    B, Tq, HQ, D = q.shape
    C_D = D + 16  # logits, partial outputs and gathered rows per (query head, block)
    per_token = B * HQ * block_idx.shape[-1] * 4 * C_D
    step = max(1, min(Tq, CHUNK_ELEMS // max(per_token, 1)))
    return [(s, min(Tq, s + step)) for s in range(0, Tq, step)]


def attn_fwd_torch(q, k, v, block_idx, block_size, scale, query_tile: int = 1):
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    block_idx = token_rows(block_idx, Tq, Tk, query_tile)
    G, N = HQ // H, cdiv(Tk, block_size)
    ct = compute_dtype(q)
    kb, vb = _blocked(k, block_size, ct), _blocked(v, block_size, ct)
    o = torch.full_like(q, math.nan)
    lse = torch.full((B, Tq, HQ), math.nan, dtype=ct, device=q.device)
    for s, e in _chunks(q, k, block_idx):
        ch = _chunk(block_idx, s, e, Tq, Tk, N, block_size)
        z = _logits(_rows(q.to(ct), ch, s, e), kb, ch, scale)  # [ng, P, G, C]
        # a group that sees no key has m = -inf: shift it by 0 (p = 0). A NaN or +inf logit
        # (NaN / Inf input, overflow) keeps its NaN through the shift, as dense attention does.
        m = z.amax(-1)
        p = torch.exp(z - torch.where(m == -math.inf, 0.0, m)[..., None])
        ng = ch.pg.n_groups  # explicit view sizes: a chunk without any pair has ng = 0
        part = torch.bmm(p.view(ng, PAIRS_PER_GROUP * G, block_size), vb[ch.pg.block])
        # merge the partial softmaxes of each query row's blocks
        top = torch.full((ch.n_rows + 1, G), -math.inf, dtype=ct, device=q.device)
        top.scatter_reduce_(0, ch.row[:, None].expand(-1, G), m.view(-1, G), "amax")
        w = torch.exp(m.view(-1, G) - torch.where(top == -math.inf, 0.0, top)[ch.row])
        den = torch.zeros_like(top).index_add_(0, ch.row, w * p.sum(-1).view(-1, G))
        num = torch.zeros(ch.n_rows + 1, G, D, dtype=ct, device=q.device)
        num.index_add_(0, ch.row, w[..., None] * part.view(-1, G, D))
        # den = 0: the row saw no key (o = 0, lse = -inf); a NaN den stays NaN in o and lse
        no_key = den[:-1] == 0
        out = num[:-1] / torch.where(no_key, 1.0, den[:-1])[..., None]
        o[:, s:e] = out.view(B, e - s, HQ, D).to(q.dtype)
        lse[:, s:e] = torch.where(no_key, -math.inf, top[:-1] + den[:-1].log()).view(B, e - s, HQ)
    return o, lse.transpose(1, 2).contiguous()


def attn_bwd_torch(do, dlse, q, k, v, o, lse, block_idx, block_size, scale, query_tile: int = 1):
    B, Tq, HQ, D = q.shape
    Tk, G = k.shape[1], HQ // k.shape[2]
    block_idx = token_rows(block_idx, Tq, Tk, query_tile)
    N = cdiv(Tk, block_size)
    ct = compute_dtype(q)
    kb, vb = _blocked(k, block_size, ct), _blocked(v, block_size, ct)
    dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
    dq = torch.zeros(B, Tq, HQ, D, dtype=ct, device=q.device)
    lse = lse.transpose(1, 2)[..., None].to(ct)  # [B, Tq, HQ, 1]
    delta = (do.to(ct) * o.to(ct)).sum(-1, keepdim=True)  # [B, Tq, HQ, 1]
    if dlse is not None:  # d lse / d logits = p: folds into the softmax-backward shift
        delta = delta - dlse.transpose(1, 2)[..., None].to(ct)
    for s, e in _chunks(q, k, block_idx):
        ch = _chunk(block_idx, s, e, Tq, Tk, N, block_size)
        ng, P = ch.pg.n_groups, PAIRS_PER_GROUP
        qg, dog = _rows(q.to(ct), ch, s, e), _rows(do.to(ct), ch, s, e)
        lse_g = _rows(torch.where(torch.isfinite(lse), lse, 0.0), ch, s, e)
        p = torch.exp(_logits(qg, kb, ch, scale) - lse_g)  # [ng, P, G, C]
        dp = torch.bmm(dog.view(ng, P * G, D), vb[ch.pg.block].transpose(1, 2)).view_as(p)
        ds = p * (dp - _rows(delta, ch, s, e)) * scale
        dqg = torch.bmm(ds.view(ng, P * G, block_size), kb[ch.pg.block]).view_as(qg)
        dq_rows = torch.zeros(ch.n_rows + 1, *qg.shape[2:], dtype=ct, device=q.device)
        dq_rows.index_add_(0, ch.row, dqg.view(ng * P, *qg.shape[2:]))
        dq[:, s:e] = dq_rows[:-1].view(B, e - s, HQ, D)
        dkb.index_add_(0, ch.pg.block, torch.bmm(ds.view(ng, P * G, block_size).transpose(1, 2),
                                                 qg.view(ng, P * G, D)))
        dvb.index_add_(0, ch.pg.block, torch.bmm(p.view(ng, P * G, block_size).transpose(1, 2),
                                                 dog.view(ng, P * G, D)))
    return (dq.to(q.dtype), _unblocked(dkb, k.shape).to(k.dtype).contiguous(),
            _unblocked(dvb, v.shape).to(v.dtype).contiguous())
