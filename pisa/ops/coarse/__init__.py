"""The coarse (compressed) branch: attention of each query over the mean-pooled keys and values of
the complete key blocks that end at or before it, NSA's compressed attention on PISA's leaf
blocks (the pyramid's level-1 means of ``pisa.ops.pyramid``, for complete blocks).

Unlike the selection, this branch is differentiable in the keys: its gradient reaches ``k`` and
``v`` through the pooling, so training shapes the very block summaries that PISA's selection
ranks. ``pisa.layers.PisaAttention(coarse=True)`` mixes it into the layer's output through a
learned per-head gate.

Implementations: ``naive.naive_coarse_attn`` (fp64 loops, the oracle), ``torch_backend``
(vectorised, by query chunks, recomputing backward: O(N) saved memory), ``triton`` (forward and
backward kernels). ``coarse_attn`` checks its inputs and dispatches.
"""
from __future__ import annotations

import math

import torch

from ..utils.config import check_positive_int, check_qk, default_scale, resolve_backend

__all__ = ["coarse_attn"]


def _check(q, k, v, block_size, scale, return_lse) -> float:
    """Check ``coarse_attn``'s arguments; the resolved scale."""
    check_qk(q, k, v)
    check_positive_int("block_size", block_size)
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"scale must be a real number or None, got {scale!r} "
                        f"({type(scale).__name__})")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be finite or None, got {scale!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    return default_scale(q.shape[-1]) if scale is None else float(scale)


def coarse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int = 64,
                scale: float | None = None, return_lse: bool = False, backend: str = "auto"):
    """Causal attention over block summaries (NSA's compressed branch on PISA's leaf blocks).

    Each KV head's keys and values are mean-pooled over every complete block of ``block_size``
    consecutive positions (node ``j``: positions ``[j * C, (j + 1) * C)``); query ``t`` attends,
    with one softmax, the nodes of the blocks that end at or before it: node ``j`` is visible iff
    ``(j + 1) * C - 1 <= t_abs``. The incomplete last block (``Tk`` not a multiple of ``C``) has
    no node; a query that sees no node (``t_abs < C - 1``) gets ``o = 0`` (``lse = -inf``).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32 (fp64 on torch and naive).
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device; ``nheads %
            nheads_k == 0`` (GQA: a group's query heads share its KV head's nodes). Queries are
            the last ``seqlen_q`` positions of the keys (bottom-right causal:
            ``t_abs = seqlen_k - seqlen_q + t``).
        block_size: int >= 1. Keys pooled per node ``C``. Default 64 (PISA's leaf blocks).
        scale: float or None. Softmax scale; default ``headdim ** -0.5``.
        return_lse: bool. Also return the log-normaliser. Default False.
        backend: "auto" (default: "triton" on CUDA when installed, else "torch") | "torch" |
            "triton" | "naive" (the fp64 loop oracle; tiny inputs only).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype; differentiable in q, k and v (through
            the pooling: a key of a complete block gets ``1 / C`` of its node's gradient). Saved
            memory is O(seqlen) on torch and triton: no ``[seqlen_q, seqlen_k / C]`` tensor is
            kept for the backward (the probabilities are recomputed from the LSE).
        lse (only if return_lse): (batch, nheads, seqlen_q) fp32 (fp64 for fp64 inputs on torch
            and naive), natural log, ``-inf`` on rows without a node; not differentiable.

    A bad argument is a ``TypeError`` (wrong type) or ``ValueError`` (out of range) naming it.
    """
    scale = _check(q, k, v, block_size, scale, return_lse)
    backend = resolve_backend(backend, q)
    if backend == "naive":
        from .naive import naive_coarse_attn
        o, lse = naive_coarse_attn(q, k, v, block_size, scale)
        o = o.to(q.dtype)
    elif backend == "triton":
        from .triton import coarse_attn_triton
        o, lse = coarse_attn_triton(q, k, v, block_size, scale)
    else:
        from .torch_backend import coarse_attn_torch
        o, lse = coarse_attn_torch(q, k, v, block_size, scale)
    if q.dtype != torch.float64:
        lse = lse.float()
    return (o, lse) if return_lse else o
