"""The coarse-branch oracle: fp64, Python loops, small N only.

Query ``t`` of ``q [B, Tq, HQ, D]`` sits at absolute position ``t_abs = Tk - Tq + t`` (bottom-right
causal) and attends, by a softmax, the mean-pooled key / value of every *complete* block of ``C``
keys that ends at or before it: block ``j`` is visible iff ``(j + 1) * C - 1 <= t_abs``. A row with
no visible block gets ``o = 0`` and ``lse = -inf``. Differentiable by autograd (the reference of
the gradient tests).
"""
from __future__ import annotations

import math

import torch


def naive_pool(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x [B, T, H, D]`` -> ``[B, T // C, H, D]`` fp64: the mean of each complete block (an
    incomplete last block has no node)."""
    n = x.shape[1] // block_size
    nodes = [x[:, j * block_size:(j + 1) * block_size].double().mean(dim=1) for j in range(n)]
    if not nodes:
        return x.new_zeros((x.shape[0], 0, *x.shape[2:]), dtype=torch.float64)
    return torch.stack(nodes, dim=1)


def naive_coarse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                      scale: float):
    """``o [B, Tq, HQ, D]`` fp64 and ``lse [B, HQ, Tq]`` fp64 of the coarse branch, one
    (batch, query, head) at a time."""
    B, Tq, HQ, _ = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G = HQ // HKV
    kc, vc = naive_pool(k, block_size), naive_pool(v, block_size)
    rows_o, rows_lse = [], []
    for b in range(B):
        for t in range(Tq):
            n_vis = (Tk - Tq + t + 1) // block_size
            for h in range(HQ):
                if n_vis == 0:
                    # zeros that still depend on q: the gradient tests get zero gradients
                    rows_o.append(q[b, t, h].double() * 0)
                    rows_lse.append(torch.tensor(-math.inf, dtype=torch.float64))
                    continue
                z = scale * (kc[b, :n_vis, h // G] @ q[b, t, h].double())
                lse = torch.logsumexp(z, dim=0)
                rows_o.append(torch.exp(z - lse) @ vc[b, :n_vis, h // G])
                rows_lse.append(lse)
    o = torch.stack(rows_o).view(B, Tq, HQ, -1)
    lse = torch.stack(rows_lse).view(B, Tq, HQ).transpose(1, 2)
    return o, lse
