"""The key pyramid, vectorised PyTorch: one reshape-and-reduce per level."""
from __future__ import annotations

import math

import torch

from ..utils.geometry import Pyramid, cdiv, compute_dtype, level_offsets

# The value a ragged tail is padded with, per reduction: one that never wins it.
_PAD = {"sum": 0.0, "amin": math.inf, "amax": -math.inf}


def _pool(x: torch.Tensor, n_in: int, group: int, reduce: str = "sum") -> torch.Tensor:
    """Reduce (``"sum"``, ``"amin"`` or ``"amax"``) groups of ``group`` consecutive rows along
    dim 1, padding the ragged tail with the reduction's neutral value."""
    n_out = cdiv(n_in, group)
    pad = n_out * group - n_in
    if pad:
        x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), _PAD[reduce])], dim=1)
    return getattr(x.view(x.shape[0], n_out, group, *x.shape[2:]), reduce)(2)


def _upper(leaves: torch.Tensor, branching: int, n_levels: int, reduce: str) -> torch.Tensor:
    """``leaves [B, N, ...]`` and ``reduce`` of them over every level above: ``[B, N_total, ...]``
    (leaves first)."""
    out = [leaves]
    for _ in range(n_levels - 1):
        out.append(_pool(out[-1], out[-1].shape[1], branching, reduce))
    return torch.cat(out, dim=1)


def leaf_summaries(k: torch.Tensor, block_size: int, bounds: bool = False):
    """Per leaf block of ``k [B, T, HKV, D]``: key ``sums`` and, with ``bounds``, per-channel
    ``mins`` / ``maxs`` (``[B, cdiv(T, C), HKV, D]`` each, fp32 accumulation, fp64 for fp64 keys;
    ``None`` without bounds). ``pyramid_from_leaves`` folds them into a pyramid; context
    parallelism (``pisa.distributed``) gathers the leaves of every rank's shard first."""
    kc = k.to(compute_dtype(k))
    T = k.shape[1]
    sums = _pool(kc, T, block_size, "sum")
    if not bounds:
        return sums, None, None
    return sums, _pool(kc, T, block_size, "amin"), _pool(kc, T, block_size, "amax")


def pyramid_from_leaves(sums: torch.Tensor, n_tokens: int, block_size: int, branching: int,
                        mins: torch.Tensor | None = None,
                        maxs: torch.Tensor | None = None) -> Pyramid:
    """The pyramid of ``n_tokens`` keys from their leaf ``sums [B, cdiv(n_tokens, C), HKV, D]``
    (and optional per-channel ``mins`` / ``maxs``, the same shape; ``leaf_summaries``): every
    level above by one reshape-and-reduce of the level below, the leaf counts from the geometry
    (``C`` each, the ragged last one ``n_tokens - (N - 1) * C``)."""
    offsets = level_offsets(n_tokens, block_size, branching)
    n_levels = len(offsets) - 1
    n_leaves = sums.shape[1]
    leaf_counts = (n_tokens - torch.arange(n_leaves, device=sums.device) * block_size).clamp(
        max=block_size).to(sums.dtype)
    counts = _upper(leaf_counts[None], branching, n_levels, "sum")[0]
    means = _upper(sums, branching, n_levels, "sum") / counts[None, :, None, None]
    if mins is not None:
        mins = _upper(mins, branching, n_levels, "amin")
        maxs = _upper(maxs, branching, n_levels, "amax")
    return Pyramid(means, counts.to(torch.int32), offsets, mins, maxs)


def build_pyramid_torch(k: torch.Tensor, block_size: int, branching: int,
                        bounds: bool = False) -> Pyramid:
    """The pyramid of ``k [B, T, HKV, D]`` (fp32 accumulation, fp64 for fp64 keys); with
    ``bounds``, also the per-channel ``mins`` / ``maxs`` of every node's keys (same dtype)."""
    sums, mins, maxs = leaf_summaries(k, block_size, bounds)
    return pyramid_from_leaves(sums, k.shape[1], block_size, branching, mins, maxs)
