"""The coarse branch, vectorised PyTorch (CPU and CUDA): attention of each query over the pooled
nodes of the complete blocks before it, by chunks of queries.

Memory is O(N): ``CoarseAttn`` saves its inputs, the output and the LSE, never the
``[chunk, N / C]`` probabilities; the backward recomputes them chunk by chunk from the LSE (as
FlashAttention recomputes its tiles). A chunk only reads the nodes its last query may see.
"""
from __future__ import annotations

import math

import torch

from ..utils.config import CHUNK_ELEMS
from ..utils.geometry import compute_dtype


def pool_blocks(x: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, T, H, D]`` -> the mean of each complete block of ``block_size`` rows ``[B, T // C,
    H, D]`` in ``dtype`` (differentiable: each key gets ``1 / C`` of its node's gradient; the keys
    of an incomplete last block get none)."""
    B, T, H, D = x.shape
    n = T // block_size
    return x[:, :n * block_size].to(dtype).view(B, n, block_size, H, D).mean(dim=2)


def _chunks(q: torch.Tensor, n_nodes: int) -> list[tuple[int, int]]:
    """Query ranges whose ``[B, HQ, chunk, n_nodes]`` logits fit ``CHUNK_ELEMS``."""
    B, Tq, HQ, _ = q.shape
    step = max(1, min(Tq, CHUNK_ELEMS // max(B * HQ * n_nodes, 1)))
    return [(s, min(Tq, s + step)) for s in range(0, Tq, step)]


def _logits(qc: torch.Tensor, kc: torch.Tensor, t0: int, block_size: int, scale: float):
    """Masked logits ``[B, HKV, G, Tc, n]`` of the queries ``qc [B, Tc, HQ, D]`` at absolute
    positions ``t0 ..`` against the nodes they may see (``n``: those of the chunk's last query);
    ``-inf`` at the nodes a query may not see yet."""
    B, Tc, HQ, D = qc.shape
    HKV = kc.shape[2]
    n = min(kc.shape[1], (t0 + Tc) // block_size)
    qg = qc.view(B, Tc, HKV, HQ // HKV, D)
    z = torch.einsum("bthgd,bnhd->bhgtn", qg, kc[:, :n]) * scale
    n_vis = (t0 + torch.arange(Tc, device=qc.device) + 1) // block_size  # [Tc]
    hidden = torch.arange(n, device=qc.device)[None, :] >= n_vis[:, None]  # [Tc, n]
    return z.masked_fill(hidden, -math.inf), n


def _probs(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(z - lse)``, 0 on rows without a visible node (``lse = -inf``)."""
    return torch.exp(z - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])


def _forward(q, kc, vc, t_first: int, block_size: int, scale: float):
    B, Tq, HQ, D = q.shape
    HKV, G = kc.shape[2], HQ // kc.shape[2]
    ct = kc.dtype
    o = torch.empty(B, Tq, HQ, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, HKV, G, Tq, dtype=ct, device=q.device)
    for s, e in _chunks(q, kc.shape[1]):
        z, n = _logits(q[:, s:e].to(ct), kc, t_first + s, block_size, scale)
        lse_c = torch.logsumexp(z, dim=-1)  # -inf on rows without a node
        p = _probs(z, lse_c)
        oc = torch.einsum("bhgtn,bnhd->bthgd", p, vc[:, :n])
        o[:, s:e] = oc.reshape(B, e - s, HQ, D).to(q.dtype)
        lse[..., s:e] = lse_c
    return o, lse.view(B, HQ, Tq)


def _backward(do, q, kc, vc, o, lse, t_first: int, block_size: int, scale: float):
    B, Tq, HQ, D = q.shape
    HKV, G = kc.shape[2], HQ // kc.shape[2]
    ct = kc.dtype
    dq = torch.empty(B, Tq, HQ, D, dtype=ct, device=q.device)
    dkc, dvc = torch.zeros_like(kc), torch.zeros_like(vc)
    lse = lse.view(B, HKV, G, Tq)
    delta = (do.to(ct) * o.to(ct)).sum(-1).view(B, Tq, HKV, G).permute(0, 2, 3, 1)  # [B,HKV,G,Tq]
    for s, e in _chunks(q, kc.shape[1]):
        qc = q[:, s:e].to(ct)
        z, n = _logits(qc, kc, t_first + s, block_size, scale)
        p = _probs(z, lse[..., s:e])
        dog = do[:, s:e].to(ct).view(B, e - s, HKV, G, D)
        dp = torch.einsum("bthgd,bnhd->bhgtn", dog, vc[:, :n])
        ds = p * (dp - delta[..., s:e, None]) * scale
        dq[:, s:e] = torch.einsum("bhgtn,bnhd->bthgd", ds, kc[:, :n]).reshape(B, e - s, HQ, D)
        dkc[:, :n] += torch.einsum("bhgtn,bthgd->bnhd", ds, qc.view(B, e - s, HKV, G, D))
        dvc[:, :n] += torch.einsum("bhgtn,bthgd->bnhd", p, dog)
    return dq.to(q.dtype), dkc, dvc


class CoarseAttn(torch.autograd.Function):
    """``(q, kc, vc) -> (o, lse)`` by a backend's ``forward(q, kc, vc, t_first, block_size,
    scale)`` and ``backward(do, q, kc, vc, o, lse, t_first, block_size, scale)``: ``q [B, Tq, HQ,
    D]`` at absolute positions ``t_first ..``, nodes ``kc, vc [B, N, HKV, D]``. Saves O(N) tensors
    (inputs, ``o``, ``lse``): the backward recomputes the probabilities. ``lse`` gets no
    gradient (the layer does not use it)."""

    @staticmethod
    def forward(ctx, q, kc, vc, t_first: int, block_size: int, scale: float, fwd, bwd):
        o, lse = fwd(q, kc, vc, t_first, block_size, scale)
        ctx.save_for_backward(q, kc, vc, o, lse)
        ctx.args, ctx.bwd = (t_first, block_size, scale), bwd
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kc, vc, o, lse = ctx.saved_tensors
        dq, dkc, dvc = ctx.bwd(do.contiguous(), q, kc, vc, o, lse, *ctx.args)
        return dq, dkc, dvc, None, None, None, None, None


def coarse_attn_torch(q, k, v, block_size: int, scale: float):
    """The coarse branch of ``q [B, Tq, HQ, D]`` over ``k, v [B, Tk, HKV, D]``: ``o`` (q's dtype,
    differentiable in q, k, v through the pooling) and ``lse [B, HQ, Tq]`` (no gradient)."""
    ct = compute_dtype(q)
    kc, vc = pool_blocks(k, block_size, ct), pool_blocks(v, block_size, ct)
    return CoarseAttn.apply(q, kc, vc, k.shape[1] - q.shape[1], block_size, scale, _forward,
                           _backward)
