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


def _levels(x: torch.Tensor, T: int, block_size: int, branching: int, n_levels: int,
            reduce: str) -> torch.Tensor:
    """``reduce`` of ``x [B, T, ...]`` over every node of the pyramid: ``[B, N_total, ...]``."""
    out = [_pool(x, T, block_size, reduce)]
    for _ in range(n_levels - 1):
        out.append(_pool(out[-1], out[-1].shape[1], branching, reduce))
    return torch.cat(out, dim=1)


def build_pyramid_torch(k: torch.Tensor, block_size: int, branching: int,
                        bounds: bool = False) -> Pyramid:
    """The pyramid of ``k [B, T, HKV, D]`` (fp32 accumulation, fp64 for fp64 keys); with
    ``bounds``, also the per-channel ``mins`` / ``maxs`` of every node's keys (same dtype)."""
    T = k.shape[1]
    offsets = level_offsets(T, block_size, branching)
    n_levels = len(offsets) - 1
    kc = k.to(compute_dtype(k))
    sums = _levels(kc, T, block_size, branching, n_levels, "sum")
    counts = _levels(kc.new_ones(1, T), T, block_size, branching, n_levels, "sum")[0]
    mins = maxs = None
    if bounds:
        mins = _levels(kc, T, block_size, branching, n_levels, "amin")
        maxs = _levels(kc, T, block_size, branching, n_levels, "amax")
    return Pyramid(sums / counts[None, :, None, None], counts.to(torch.int32), offsets, mins,
                   maxs)
