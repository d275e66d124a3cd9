"""The attention oracle: fp64, Python loops, small N only (``docs/spec.md`` §5).

Query ``t`` of ``q [B, Tq, HQ, D]`` sits at absolute position ``Tk - Tq + t`` (bottom-right causal)
and attends the keys ``j <= Tk - Tq + t`` of its selected blocks, shared by its GQA group. A tile
selection (``query_tile > 1``: a row per aligned tile of ``query_tile`` absolute positions) is
expanded to per-token rows first (``utils.csr.token_rows``).
"""
from __future__ import annotations

import math

import torch

from ..utils.csr import token_rows


def naive_attn(q, k, v, block_idx: torch.Tensor, block_size: int, scale: float,
               query_tile: int = 1):
    """Exact softmax attention restricted to the selected blocks (and causality), in fp64.

    ``block_idx`` per token ``[B, Tq, HKV, S]``, or per query tile of ``query_tile`` tokens.
    Differentiable (autograd through the masked dense form). Returns ``o [B, Tq, HQ, D]`` fp64 and
    ``lse [B, HQ, Tq]`` fp64 (natural log; ``-inf`` and ``o = 0`` for a row with no key).
    """
    Tk = k.shape[1]
    block_idx = token_rows(block_idx, q.shape[1], Tk, query_tile)
    B, Tq, HKV, _ = block_idx.shape
    allowed = torch.zeros(B, Tq, HKV, Tk, dtype=torch.bool)
    for b in range(B):
        for t in range(Tq):
            for h in range(HKV):
                for c in block_idx[b, t, h].tolist():
                    if c >= 0:
                        allowed[b, t, h, c * block_size:(c + 1) * block_size] = True
    return _masked_attn(q, k, v, allowed, scale)


def naive_dense_attn(q, k, v, scale: float):
    """Dense causal attention (bottom-right aligned) in fp64: the all-blocks reference."""
    B, Tq, _, _ = q.shape
    _, Tk, HKV, _ = k.shape
    return _masked_attn(q, k, v, torch.ones(B, Tq, HKV, Tk, dtype=torch.bool), scale)


def _masked_attn(q, k, v, allowed: torch.Tensor, scale: float):
    """Softmax attention over ``allowed [B, Tq, HKV, Tk]`` keys, intersected with causality."""
    Tq, HQ = q.shape[1], q.shape[2]
    Tk, HKV = k.shape[1], k.shape[2]
    G = HQ // HKV
    causal = torch.arange(Tk)[None, :] <= (Tk - Tq + torch.arange(Tq))[:, None]
    allowed = allowed & causal[None, :, None, :]
    allowed = allowed.repeat_interleave(G, dim=2).permute(0, 2, 1, 3)  # [B, HQ, Tq, Tk]
    kk = k.double().repeat_interleave(G, dim=2)
    vv = v.double().repeat_interleave(G, dim=2)
    s = scale * torch.einsum("bthd,bshd->bhts", q.double(), kk)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp_min(-1e300))
    o = torch.einsum("bhts,bshd->bthd", p, vv)
    return o, lse
