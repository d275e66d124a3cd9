"""The key pyramid: exact means of every node's keys, all levels in one buffer.

Layout (shared by every backend): ``means [B, N_total, HKV, D]`` fp32 holds level 1 (leaves) first,
then level 2, ... up to the single root; level ``l`` occupies rows ``offsets[l-1]:offsets[l]``.
``counts [N_total]`` int32 is the number of real keys under each node (the ragged tail makes the
last node of each level smaller). Sums are ``means * counts``; the decode cache keeps sums instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .utils import cdiv, compute_dtype, level_sizes


@dataclass(frozen=True)
class Pyramid:
    means: torch.Tensor   # [B, N_total, HKV, D] fp32 (fp64 from fp64 keys in the torch build)
    counts: torch.Tensor  # [N_total] int32
    offsets: tuple[int, ...]  # len = n_levels + 1; level l (1-based) is [offsets[l-1], offsets[l])

    @property
    def n_levels(self) -> int:
        return len(self.offsets) - 1

    def level(self, lvl: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(means [B, N_l, HKV, D], counts [N_l])`` of 1-based level ``lvl``."""
        lo, hi = self.offsets[lvl - 1], self.offsets[lvl]
        return self.means[:, lo:hi], self.counts[lo:hi]


def level_offsets(n_tokens: int, block_size: int, branching: int) -> tuple[int, ...]:
    sizes = level_sizes(cdiv(n_tokens, block_size), branching)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return tuple(offsets)


def _pool(x: torch.Tensor, n_in: int, group: int) -> torch.Tensor:
    """Sum groups of ``group`` consecutive rows along dim 1, zero-padding the ragged tail."""
    n_out = cdiv(n_in, group)
    pad = n_out * group - n_in
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    return x.view(x.shape[0], n_out, group, *x.shape[2:]).sum(2)


def build_pyramid_torch(k: torch.Tensor, block_size: int, branching: int) -> Pyramid:
    """Vectorised PyTorch pyramid build: one reshape-and-sum per level (fp32 accumulation, fp64
    for fp64 keys)."""
    B, T, H, D = k.shape
    offsets = level_offsets(T, block_size, branching)
    dt = compute_dtype(k)
    sums = [_pool(k.to(dt), T, block_size)]
    counts = [_pool(torch.ones(1, T, dtype=dt, device=k.device), T, block_size)[0]]
    for _ in range(len(offsets) - 2):
        sums.append(_pool(sums[-1], sums[-1].shape[1], branching))
        counts.append(_pool(counts[-1][None], counts[-1].shape[0], branching)[0])
    sums, counts = torch.cat(sums, dim=1), torch.cat(counts)
    return Pyramid(sums / counts[None, :, None, None], counts.to(torch.int32), offsets)
