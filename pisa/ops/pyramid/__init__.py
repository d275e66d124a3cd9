"""The key pyramid: exact means of every node's keys, all levels in one buffer.

Layout (shared by every backend): ``means [B, N_total, HKV, D]`` fp32 holds level 1 (leaves) first,
then level 2, ... up to the single root; level ``l`` occupies rows ``offsets[l-1]:offsets[l]``
(``utils.geometry.level_offsets``). ``counts [N_total]`` int32 is the number of real keys under
each node (the ragged tail makes the last node of each level smaller). Sums are
``means * counts``; the decode cache keeps sums instead (``decode.kvcache``). Built with
``bounds=True`` (for ``scorer="bound"``), ``mins`` / ``maxs`` in the layout of ``means`` hold the
per-channel min and max of every node's keys.

Implementations: ``naive.naive_pyramid`` (fp64 loops, the oracle),
``torch_backend.build_pyramid_torch``, ``triton.build_pyramid_triton``;
``build_pyramid`` dispatches on a resolved backend.
"""
from __future__ import annotations

import torch

from ..utils.geometry import Pyramid

__all__ = ["Pyramid", "build_pyramid"]


def build_pyramid(k: torch.Tensor, block_size: int, branching: int, backend: str,
                  bounds: bool = False) -> Pyramid:
    """The pyramid of ``k [B, T, HKV, D]`` with the ``"triton"`` kernels or in ``"torch"``; with
    ``bounds``, also every node's per-channel key ``mins`` / ``maxs``."""
    if backend == "triton":
        from .triton import build_pyramid_triton
        return build_pyramid_triton(k, block_size, branching, bounds)
    from .torch_backend import build_pyramid_torch
    return build_pyramid_torch(k, block_size, branching, bounds)
