"""Random inputs whose attention has structure, so selection quality means something.

Plain Gaussian q/k give near-uniform attention, where every selector looks alike. Here each key
block gets a random "topic" direction carried by a few of its keys (``carriers`` per block, so the
important blocks hold a handful of sharp keys, as measured in trained models), and each query points
at a few random earlier blocks' topics (plus noise): a few blocks per query carry most of the mass.
"""
from __future__ import annotations

import torch

from ..ops.utils.config import SelectConfig


def structured_qkv(B: int, T: int, HQ: int, HKV: int, D: int, *,
                   block_size: int = SelectConfig.block_size,
                   targets: int = 4, strength: float = 1.0, carriers: int = 8,
                   dtype=torch.float32,
                   device="cpu", seed: int | None = None):
    """``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` with planted query-to-block affinities."""
    gen = torch.Generator(device=device)
    gen.manual_seed(torch.seed() if seed is None else seed)
    n_blocks = -(-T // block_size)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    topics = rnd(B, n_blocks, HKV, D)
    block_of = torch.arange(T, device=device) // block_size
    carry = torch.rand(B, T, HKV, 1, generator=gen, device=device) < carriers / block_size
    k = rnd(B, T, HKV, D) + carry * topics[:, block_of] * (block_size / carriers) ** 0.5
    cur = block_of.float()[None, :, None, None]
    u = torch.rand(B, T, HQ, targets, generator=gen, device=device)
    picks = (u * (cur + 1)).long()  # a uniformly random causal block per target
    G = HQ // HKV
    head_kv = torch.arange(HQ, device=device) // G
    bidx = torch.arange(B, device=device)[:, None, None, None]
    chosen = topics[bidx, picks, head_kv[None, None, :, None]]  # [B, T, HQ, targets, D]
    q = rnd(B, T, HQ, D) + strength * chosen.sum(3) * D ** 0.25 / targets ** 0.5
    v = rnd(B, T, HKV, D)
    return q.to(dtype), k.to(dtype), v.to(dtype)
