"""Caches and oracles shared by the decode tests.

The oracle of a decode step is the last row of prefill: ``naive_select`` + ``naive_attn`` over each
sequence's first ``cache_seqlens[b]`` keys, with the query as the last token.
"""
import math

import torch
import torch.nn.functional as F

from pisa.ops.attn.naive import naive_attn
from pisa.ops.decode.kvcache import append_kv
from pisa.ops.select.naive import naive_select
from pisa.ops.utils.config import SelectConfig
from pisa.ops.utils.geometry import cdiv, compute_dtype, level_offsets


def filled_cache(k, v, seqlens, T, C, g):
    """A cache of capacity ``T`` holding ``k, v [B, >= max(seqlens), H, D]`` up to each sequence's
    length (through ``append_kv``); slots past the lengths hold NaN (never read)."""
    B, _, H, D = k.shape
    k_cache = torch.full((B, T, H, D), math.nan, dtype=k.dtype, device=k.device)
    v_cache = k_cache.clone()
    sums = torch.zeros(B, level_offsets(T, C, g)[-1], H, D, dtype=compute_dtype(k), device=k.device)
    lens = torch.zeros(B, dtype=torch.int32, device=k.device)
    for b, n in enumerate(seqlens):
        rows = slice(b, b + 1)
        append_kv(k_cache[rows], v_cache[rows], sums[rows], k[rows, :n], v[rows, :n], lens[rows],
                  C, g)
    lens.copy_(torch.tensor(seqlens))
    return k_cache, v_cache, sums, lens


def oracle_rows(q, k, v, seqlens, cfg):
    """Naive selection + attention of the last ``q.shape[1]`` positions of each sequence."""
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]
        idx, _ = naive_select(qb, kb, cfg)
        o, lse = naive_attn(qb, kb, vb, idx, cfg.block_size, cfg.scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def pyramid_sums(k: torch.Tensor, seqlens: list[int], C: int, g: int) -> torch.Tensor:
    """The cache's pyramid sums (geometry of ``T_max = k.shape[1]``) of each sequence's first
    ``seqlens[b]`` keys, summed in fp64 (fp32 result): leaves, then each level from the one
    below."""
    B, T, H, D = k.shape
    real = torch.arange(T)[None, :] < torch.tensor(seqlens)[:, None]
    x = torch.where(real[:, :, None, None], k.double(), 0.0)
    n = cdiv(T, C)
    x = F.pad(x, (0, 0, 0, 0, 0, n * C - T)).view(B, n, C, H, D).sum(2)
    levels = [x]
    while x.shape[1] > 1:
        n = cdiv(x.shape[1], g)
        x = F.pad(x, (0, 0, 0, 0, 0, n * g - x.shape[1])).view(B, n, g, H, D).sum(2)
        levels.append(x)
    sums = torch.cat(levels, 1).float()
    assert sums.shape[1] == level_offsets(T, C, g)[-1]
    return sums


def make_cache(B, T_max, HKV, G, D, seqlens, C, g, dtype=torch.float32, seed=0):
    """Random ``q [B, 1, HQ, D]`` and a full random cache (keys past a sequence's length are
    garbage the kernel must ignore), with the sums of each sequence's real keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, HKV * G, D, generator=gen).to(dtype)
    k = torch.randn(B, T_max, HKV, D, generator=gen).to(dtype)
    v = torch.randn(B, T_max, HKV, D, generator=gen).to(dtype)
    return q, k, v, pyramid_sums(k, seqlens, C, g), torch.tensor(seqlens, dtype=torch.int32)


def oracle(q, k, v, seqlens, cfg: SelectConfig):
    """fp64 ``o [B, 1, HQ, D]``, ``lse [B, HQ, 1]`` and ``block_idx [B, 1, HKV, slots]`` of
    prefill's last row over each sequence's keys (an empty sequence: ``o = 0``, ``lse = -inf``,
    sink only)."""
    B, _, HQ, D = q.shape
    HKV = k.shape[2]
    o = torch.zeros(B, 1, HQ, D, dtype=torch.float64)
    lse = torch.full((B, HQ, 1), -math.inf, dtype=torch.float64)
    idx = torch.full((B, 1, HKV, cfg.slots), -1, dtype=torch.int32)
    idx[..., 0] = 0
    for b, s in enumerate(seqlens):
        if s == 0:
            continue
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :s], v[b:b + 1, :s]
        idx[b:b + 1], _ = naive_select(qb, kb, cfg)
        o[b:b + 1], lse[b:b + 1] = naive_attn(qb, kb, vb, idx[b:b + 1], cfg.block_size, cfg.scale)
    return o, lse, idx


def assert_matches(got, want, rtol):
    """``(o, lse, block_idx)`` of a decode step against ``oracle``'s."""
    (o, lse, idx), (wo, wlse, widx) = got, want
    bad = [tuple(x) for x in (idx != widx).any(-1).nonzero().tolist()]
    assert not bad, f"selection differs at (b, 0, h) {bad[0]}: got {idx[bad[0]].tolist()}, " \
                    f"want {widx[bad[0]].tolist()}"
    torch.testing.assert_close(o.double(), wo, rtol=rtol, atol=rtol)
    finite = torch.isfinite(wlse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], wlse[finite], rtol=rtol, atol=rtol)


def to_pages(k, v, block_size, seed=0, spare=3):
    """The contiguous cache ``k, v [B, T, H, D]`` (``T`` a multiple of ``block_size``) as a page
    pool of ``B * T / block_size + spare`` pages in shuffled order (spare pages hold NaN) and its
    ``block_table [B, T / block_size]`` int32: ``(k_pool, v_pool, block_table)``."""
    B, T, H, D = k.shape
    n = T // block_size
    perm = torch.randperm(B * n + spare, generator=torch.Generator().manual_seed(seed))
    table = perm[:B * n].view(B, n).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.full((B * n + spare, block_size, H, D), math.nan, dtype=x.dtype)
        pool[table.flatten().long()] = x.reshape(B * n, block_size, H, D)
        pools.append(pool)
    return pools[0], pools[1], table
