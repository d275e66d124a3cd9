"""The key pyramid, vectorised PyTorch: one reshape-and-sum per level."""
from __future__ import annotations

import torch

from ..utils.geometry import Pyramid, cdiv, compute_dtype, level_offsets


def _pool(x: torch.Tensor, n_in: int, group: int) -> torch.Tensor:
    """Sum groups of ``group`` consecutive rows along dim 1, zero-padding the ragged tail."""
    n_out = cdiv(n_in, group)
    pad = n_out * group - n_in
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    return x.view(x.shape[0], n_out, group, *x.shape[2:]).sum(2)


def build_pyramid_torch(k: torch.Tensor, block_size: int, branching: int) -> Pyramid:
    """The pyramid of ``k [B, T, HKV, D]`` (fp32 accumulation, fp64 for fp64 keys)."""
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
