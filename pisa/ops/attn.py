"""Sparse attention over selected key blocks: the vectorised PyTorch backend and the dispatcher.

The torch backend gathers each query's selected keys and values chunk by chunk, so memory stays
O(chunk · S · C · D); its backward recomputes the chunk's probabilities from the saved LSE (as
FlashAttention does) and scatters dK/dV with ``index_add_``. No ``[T, T]`` or ``[T, N/C]`` tensor.
"""
from __future__ import annotations

import math

import torch

from .select import CHUNK_ELEMS
from .utils import BACKENDS


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gather_kv(k, v, idx, t_abs, block_size, dtype):
    """Keys/values of the selected blocks: ``[B, Tc, H, S*C, D]`` each, plus the validity mask
    ``[B, Tc, H, S*C]`` (selected, causal, inside the sequence) and the flat row index."""
    B, Tk, H, D = k.shape
    _, Tc, _, S = idx.shape
    pos = idx.long()[..., None] * block_size + torch.arange(block_size, device=k.device)
    pos = pos.flatten(-2)  # [B, Tc, H, S*C]
    ok = (idx.long().repeat_interleave(block_size, -1) >= 0) & (pos < Tk) \
        & (pos <= t_abs[None, :, None, None])
    rows = ((torch.arange(B, device=k.device)[:, None, None, None] * Tk + pos.clamp(0, Tk - 1)) * H
            + torch.arange(H, device=k.device)[None, None, :, None])
    kk = k.reshape(B * Tk * H, D)[rows].to(dtype)
    vv = v.reshape(B * Tk * H, D)[rows].to(dtype)
    return kk, vv, ok, rows


def _chunk_probs(qc, kk, ok, lse, scale):
    """Logits ``[B, Tc, H, G, J]`` masked to -inf and, if ``lse`` is given, probabilities."""
    s = torch.einsum("bthgd,bthjd->bthgj", qc, kk) * scale
    s = s.masked_fill(~ok[:, :, :, None, :], -math.inf)
    if lse is None:
        return s
    return torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])


def _chunks(q, k, block_idx, block_size):
    """Yield ``(start, end, t_abs)`` chunks of queries sized to bound the gathered tensors."""
    B, Tq, HQ, D = q.shape
    per_token = B * (2 * k.shape[2] * D + HQ) * block_idx.shape[-1] * block_size
    step = max(1, min(Tq, CHUNK_ELEMS // max(per_token, 1)))
    Tk = k.shape[1]
    for s in range(0, Tq, step):
        e = min(Tq, s + step)
        yield s, e, torch.arange(Tk - Tq + s, Tk - Tq + e, device=q.device)


def _fwd_torch(q, k, v, block_idx, block_size, scale):
    B, Tq, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    ct = _compute_dtype(q)
    o = torch.full_like(q, math.nan)
    lse = torch.full((B, Tq, H, G), math.nan, dtype=ct, device=q.device)
    for s, e, t_abs in _chunks(q, k, block_idx, block_size):
        kk, vv, ok, _ = _gather_kv(k, v, block_idx[:, s:e], t_abs, block_size, ct)
        qc = q[:, s:e].to(ct).view(B, e - s, H, G, D)
        logits = _chunk_probs(qc, kk, ok, None, scale)
        lse_c = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - torch.where(torch.isfinite(lse_c), lse_c, 0.0)[..., None])
        o[:, s:e] = torch.einsum("bthgj,bthjd->bthgd", p, vv).reshape(B, e - s, HQ, D).to(q.dtype)
        lse[:, s:e] = lse_c
    return o, lse.reshape(B, Tq, HQ).transpose(1, 2).contiguous()


def _bwd_torch(do, q, k, v, o, lse, block_idx, block_size, scale):
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G = HQ // H
    ct = _compute_dtype(q)
    dq = torch.empty_like(q)
    dk = torch.zeros(B * Tk * H, D, dtype=ct, device=k.device)
    dv = torch.zeros_like(dk)
    lse = lse.transpose(1, 2).reshape(B, Tq, H, G).to(ct)
    for s, e, t_abs in _chunks(q, k, block_idx, block_size):
        kk, vv, ok, rows = _gather_kv(k, v, block_idx[:, s:e], t_abs, block_size, ct)
        qc = q[:, s:e].to(ct).view(B, e - s, H, G, D)
        doc = do[:, s:e].to(ct).view(B, e - s, H, G, D)
        delta = (doc * o[:, s:e].to(ct).view(B, e - s, H, G, D)).sum(-1)
        p = _chunk_probs(qc, kk, ok, lse[:, s:e], scale)
        dp = torch.einsum("bthgd,bthjd->bthgj", doc, vv)
        ds = p * (dp - delta[..., None]) * scale
        dq[:, s:e] = torch.einsum("bthgj,bthjd->bthgd", ds, kk).reshape(B, e - s, HQ, D)
        dk.index_add_(0, rows.reshape(-1),
                      torch.einsum("bthgj,bthgd->bthjd", ds, qc).reshape(-1, D))
        dv.index_add_(0, rows.reshape(-1),
                      torch.einsum("bthgj,bthgd->bthjd", p, doc).reshape(-1, D))
    return dq, dk.view_as(k).to(k.dtype), dv.view_as(v).to(v.dtype)


class SparseAttnTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale):
        o, lse = _fwd_torch(q, k, v, block_idx, block_size, scale)
        ctx.save_for_backward(q, k, v, o, lse, block_idx)  # lse at compute precision
        ctx.block_size, ctx.scale = block_size, scale
        lse = lse.float()
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, block_idx = ctx.saved_tensors
        dq, dk, dv = _bwd_torch(do, q, k, v, o, lse, block_idx, ctx.block_size, ctx.scale)
        return dq, dk, dv, None, None, None


def sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                block_size: int, scale: float, backend: str = "torch"):
    """Exact attention of each query over the keys of its selected blocks (causal).

    ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, HKV, D]``, ``block_idx [B, Tq, HKV, S]`` int32 (ascending,
    -1 padded). Returns ``o [B, Tq, HQ, D]`` (q's dtype) and ``lse [B, HQ, Tq]`` fp32.
    ``backend`` is one of ``"torch"``, ``"triton"``, ``"naive"`` (already resolved from "auto").
    """
    if backend == "torch":
        return SparseAttnTorch.apply(q, k, v, block_idx, block_size, scale)
    if backend == "triton":
        from .attn_triton import sparse_attn_triton
        return sparse_attn_triton(q, k, v, block_idx, block_size, scale)
    if backend == "naive":
        from .naive import naive_attn
        o, lse = naive_attn(q, k, v, block_idx.cpu(), block_size, scale)
        return o.to(q.dtype), lse.float()
    raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")
