"""The key pyramid: exact means of every node's keys, all levels in one buffer.

Layout (shared by every backend): ``means [B, N_total, HKV, D]`` fp32 holds level 1 (leaves) first,
then level 2, ... up to the single root; level ``l`` occupies rows ``offsets[l-1]:offsets[l]``
(``utils.geometry.level_offsets``). ``counts [N_total]`` int32 is the number of real keys under
each node (the ragged tail makes the last node of each level smaller). Sums are
``means * counts``; the decode cache keeps sums instead (``decode.kvcache``).

Implementations: ``naive.naive_pyramid`` (fp64 loops, the oracle), ``torch_backend.build_pyramid_torch``,
``triton.build_pyramid_triton``; ``build_pyramid`` dispatches on a resolved backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def build_pyramid(k: torch.Tensor, block_size: int, branching: int, backend: str) -> Pyramid:
    """The pyramid of ``k [B, T, HKV, D]`` with the ``"triton"`` kernels or in ``"torch"``."""
    if backend == "triton":
        from .triton import build_pyramid_triton
        return build_pyramid_triton(k, block_size, branching)
    from .torch_backend import build_pyramid_torch
    return build_pyramid_torch(k, block_size, branching)
