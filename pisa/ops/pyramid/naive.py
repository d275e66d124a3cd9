"""The pyramid oracle: fp64, Python loops, small N only (``PISA_SPEC.md`` §2)."""
from __future__ import annotations

import torch

from ..utils.geometry import cdiv, level_sizes


def naive_pyramid(k: torch.Tensor, block_size: int, branching: int):
    """Per-level ``(means [B, N_l, HKV, D] fp64, counts [N_l] int64)``, leaves first."""
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
        child_means, child_counts = levels[-1]
        means = torch.zeros(B, n_nodes, H, D, dtype=torch.float64)
        counts = torch.zeros(n_nodes, dtype=torch.int64)
        for i in range(n_nodes):
            kids = range(i * branching, min((i + 1) * branching, len(child_counts)))
            total = sum(child_means[:, r] * child_counts[r] for r in kids)
            counts[i] = sum(int(child_counts[r]) for r in kids)
            means[:, i] = total / counts[i]
        levels.append((means, counts))
    return levels
