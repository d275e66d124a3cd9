"""Pyramid geometry shared by every backend: level sizes and row offsets, forced blocks.

Node ``i`` at level ``l`` (leaves are level 1) covers leaves ``[i * g**(l-1), (i+1) * g**(l-1))``;
all levels live in one buffer, leaves first, level ``l`` at rows ``offsets[l-1]:offsets[l]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the torch backends and the pyramid sums: fp64 for fp64 inputs (the
    oracle tests), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def level_sizes(n_leaves: int, branching: int) -> list[int]:
    """Node counts per pyramid level, leaves first, ending at a single root."""
    sizes = [max(n_leaves, 1)]
    while sizes[-1] > 1:
        sizes.append(cdiv(sizes[-1], branching))
    return sizes


@functools.lru_cache(maxsize=256)  # a decode step asks twice (checks, launch): host time
def level_offsets(n_tokens: int, block_size: int, branching: int) -> tuple[int, ...]:
    """Row offsets of each level in the one-buffer layout: ``len = n_levels + 1``."""
    offsets = [0]
    for n in level_sizes(cdiv(n_tokens, block_size), branching):
        offsets.append(offsets[-1] + n)
    return tuple(offsets)


def forced_leaves_tensor(t_abs: torch.Tensor, block_size: int,
                         sink: torch.Tensor | None = None) -> torch.Tensor:
    """Forced leaf blocks of the queries at absolute positions ``t_abs [...]``: ``[..., 3]``
    (sink, previous, current: ascending), duplicates as -1. ``sink`` (broadcastable to
    ``t_abs``): the first block of each query's sequence, 0 by default (a packed layout's
    otherwise)."""
    cur = t_abs // block_size
    sink = torch.zeros_like(cur) if sink is None else torch.broadcast_to(sink, cur.shape)
    prev = torch.maximum(cur - 1, sink)
    prev = torch.where(prev == sink, -1, prev)
    cur_u = torch.where((cur == sink) | (cur == prev), -1, cur)
    return torch.stack([sink, prev, cur_u], dim=-1)


def forced_leaves(t_abs: int, block_size: int) -> list[int]:
    """``forced_leaves_tensor`` of one position, as an ascending list without duplicates."""
    return [f for f in forced_leaves_tensor(torch.tensor(t_abs), block_size).tolist() if f >= 0]


@dataclass(frozen=True)
class Pyramid:
    """The key pyramid of ``pisa.ops.pyramid``: every node's mean key and key count, and, when
    built with ``bounds=True`` (for ``scorer="bound"``), the per-channel min and max of its keys."""

    means: torch.Tensor   # [B, N_total, HKV, D] fp32 (fp64 from fp64 keys in the torch build)
    counts: torch.Tensor  # [N_total] int32
    offsets: tuple[int, ...]  # len = n_levels + 1; level l (1-based) is [offsets[l-1], offsets[l])
    mins: torch.Tensor | None = None  # [B, N_total, HKV, D], the dtype and layout of ``means``
    maxs: torch.Tensor | None = None  # [B, N_total, HKV, D], the dtype and layout of ``means``

    @property
    def n_levels(self) -> int:
        return len(self.offsets) - 1

    def level(self, lvl: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(means [B, N_l, HKV, D], counts [N_l])`` of 1-based level ``lvl``."""
        lo, hi = self.offsets[lvl - 1], self.offsets[lvl]
        return self.means[:, lo:hi], self.counts[lo:hi]
