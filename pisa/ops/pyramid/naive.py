"""The pyramid oracle: fp64, Python loops, small N only (``docs/spec.md`` §2, §11)."""
from __future__ import annotations

import torch

from ..utils.geometry import cdiv, level_sizes


def naive_pyramid(k: torch.Tensor, block_size: int, branching: int, bounds: bool = False):
    """Per-level ``(means [B, N_l, HKV, D] fp64, counts [N_l] int64)``, leaves first; with
    ``bounds``, ``(means, counts, mins, maxs)``: ``mins``, ``maxs`` ``[B, N_l, HKV, D]`` fp64 are
    the per-channel min and max over each node's keys (taken from the keys themselves, not from
    the children, so that they check the hierarchical builds)."""
    B, T, H, D = k.shape
    n_leaves = cdiv(T, block_size)
    means = torch.zeros(B, n_leaves, H, D, dtype=torch.float64)
    counts = torch.zeros(n_leaves, dtype=torch.int64)
    for i in range(n_leaves):
        keys = k[:, i * block_size:(i + 1) * block_size].double()
        means[:, i] = keys.mean(dim=1)
        counts[i] = keys.shape[1]
    levels = [(means, counts)]
    for n_nodes in level_sizes(n_leaves, branching)[1:]:
        child_means, child_counts = levels[-1][:2]
        means = torch.zeros(B, n_nodes, H, D, dtype=torch.float64)
        counts = torch.zeros(n_nodes, dtype=torch.int64)
        for i in range(n_nodes):
            kids = range(i * branching, min((i + 1) * branching, len(child_counts)))
            total = sum(child_means[:, r] * child_counts[r] for r in kids)
            counts[i] = sum(int(child_counts[r]) for r in kids)
            means[:, i] = total / counts[i]
        levels.append((means, counts))
    if not bounds:
        return levels
    with_bounds = []
    for lvl, (means, counts) in enumerate(levels):
        span = block_size * branching ** lvl  # keys under one node of this level
        mins, maxs = torch.zeros_like(means), torch.zeros_like(means)
        for i in range(len(counts)):
            keys = k[:, i * span:(i + 1) * span].double()
            mins[:, i], maxs[:, i] = keys.amin(dim=1), keys.amax(dim=1)
        with_bounds.append((means, counts, mins, maxs))
    return with_bounds
