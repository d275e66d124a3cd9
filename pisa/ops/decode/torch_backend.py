"""One decode step in PyTorch (CPU and CUDA): the vectorised reference of the fused Triton kernel.

The pyramid walk of ``select.torch_backend`` runs on the cache's pyramid (geometry of ``T_max``)
with a position per sequence, exact leaf scores are read from the cache, then softmax attention over
the selected blocks. Why the ``T_max`` geometry walks like a prefill pyramid over ``seqlen`` keys:
nodes that start after the query are dropped and the nodes holding it are forced (never ranked), so
above the prefill root only node 0 is active. Every ranked node lies wholly before the query's
block, so its children are full: their means ``sums / full count`` are exact, and the count weights
of the scores equal those of the ``T_max`` geometry. Nodes holding the query or later keys are never
scored, so their (partial) sums never matter. The same holds for the key bounds of
``scorer="bound"`` (the cache's ``mins, maxs``, ``+inf`` / ``-inf`` past each sequence): every
ranked node's children are full and real, and the scores of the other nodes, which may be NaN
from those infinities, are discarded by the walk before ranking.
"""
from __future__ import annotations

import math

import torch

from ..select.torch_backend import finish_selection, flat_mean_scores, group_score, is_in, walk
from ..utils.config import SelectConfig
from ..utils.geometry import cdiv, compute_dtype, forced_leaves_tensor
from .kvcache import pyramid_from_sums


def decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sums: torch.Tensor, cache_seqlens: torch.Tensor, cfg: SelectConfig,
                 mins: torch.Tensor | None = None, maxs: torch.Tensor | None = None, *,
                 block_table: torch.Tensor | None = None,
                 cache_batch_idx: torch.Tensor | None = None):
    """One decode step: selection and attention for one query per sequence (inputs checked by
    the caller: ``pisa.PisaCache.prepare``).

    Arguments:
        q: (batch, 1, nheads, headdim), the cache's dtype. The query of sequence ``b`` sits at
            position ``cache_seqlens[b] - 1``: its own key is already in the cache.
        k_cache, v_cache: (slots, max_seqlen, nheads_k, headdim), or with ``block_table`` the
            page pool (num_pages, block_size, nheads_k, headdim).
        sums: (slots, N_total, nheads_k, headdim) fp32 (fp64 for fp64 caches), the pyramid sums.
        cache_seqlens: (batch,) int32, valid keys per sequence (0 gives ``o = 0``, ``lse = -inf``).
        cfg: resolved ``SelectConfig`` (block size and branching of the cache). Per token:
            ``query_tile`` and ``tile_reduce`` play no part (one token's rows).
        mins, maxs: optional (slots, N_total, nheads_k, headdim), the cache's key bounds, in the
            layout of ``sums``; ``scorer="bound"`` needs them.
        block_table: optional (batch, max_pages) int32: a paged cache, leaf ``i`` of sequence
            ``b`` in page ``block_table[b, i]`` (``max_seqlen = max_pages * block_size``).
        cache_batch_idx: optional (batch,) int32: sequence ``b`` is slot ``cache_batch_idx[b]``
            of ``sums`` (and bounds; contiguous: of ``k_cache, v_cache``). Default slot ``b``.

    Returns:
        out: (batch, 1, nheads, headdim), q's dtype. Equals row ``cache_seqlens[b] - 1`` of
            ``pisa_attn`` over the sequence's first ``cache_seqlens[b]`` keys. Not differentiable.
            NaN rows (and lse) for a length outside ``[0, max_seqlen]``, a slot outside the
            cache, or a ``block_table`` entry outside the pool among the pages the step reads.
        lse: (batch, nheads, 1) fp32, natural log.

    Work per step is O(N/C) in this reference (it forms the means of the whole pyramid); the
    walk and the attention read O(log N) summaries and ``K`` blocks per KV head.
    """
    with torch.no_grad():
        return _decode(q, k_cache, v_cache, sums, cache_seqlens, cfg, mins, maxs, block_table,
                       cache_batch_idx)


def _decode(q, k_cache, v_cache, sums, cache_seqlens, cfg: SelectConfig, mins, maxs,
            block_table, cache_batch_idx):
    B, _, HQ, D = q.shape
    H, C = k_cache.shape[2], cfg.block_size
    T = k_cache.shape[1] if block_table is None else block_table.shape[1] * C
    n_leaves = cdiv(T, C)
    bad = (cache_seqlens < 0) | (cache_seqlens > T)
    if cache_batch_idx is None:
        slot = torch.arange(B, device=q.device)
    else:  # an out-of-range slot gives NaN rows (as the Triton kernel), read as slot 0
        slot = cache_batch_idx.long()
        bad = bad | (slot < 0) | (slot >= sums.shape[0])
        slot = torch.where(bad, 0, slot)
        sums = sums[slot]
        mins, maxs = (None, None) if mins is None else (mins[slot], maxs[slot])
    keys = _Blocks(k_cache, v_cache, slot, block_table, C)
    t_abs = cache_seqlens.long().clamp_max(T)[:, None] - 1  # [B, 1] its position
    pos = t_abs.clamp_min(0)  # an empty sequence selects as if at 0, then attends to nothing
    forced = forced_leaves_tensor(pos, C)  # [B, 1, 3]
    qs = q.to(compute_dtype(q)).reshape(B, 1, H, HQ // H, D) * cfg.scale
    bound = cfg.uses_bounds
    if bound and mins is None:
        raise ValueError("scorer='bound' needs the cache's key bounds (mins, maxs)")
    bounds = (mins, maxs) if bound else (None, None)
    pyramid = pyramid_from_sums(sums, n_leaves * C, C, cfg.branching, *bounds)
    if cfg.selector == "pyramid":
        cand = walk(qs, pyramid, pos, forced, cfg)
    else:
        cand = torch.arange(n_leaves, device=q.device).expand(B, 1, H, n_leaves)
    free = (cand >= 0) & (cand * C <= pos[..., None, None]) & ~is_in(cand, forced)
    cand = torch.where(free, cand, -1)
    if cfg.leaf_scorer == "mean":  # flat_mean, or the pyramid's mean scorer
        score = flat_mean_scores(qs, pyramid.level(1)[0], cand)
    else:  # the exact LSE (flat_lse, lse, bound) or meanvar over the leaf's keys
        score = _leaf_scores(qs, keys, cand, pos, cfg.leaf_scorer)
    block_idx, _ = finish_selection(cand, score, forced, cfg)
    o, lse = _attend(qs, keys, block_idx, t_abs, q.dtype)
    # a length outside [0, T_max] (a slot or a page outside the cache) gives NaN rows, as the
    # Triton kernel, not a clamped answer
    bad = bad | keys.bad
    return (torch.where(bad[:, None, None, None], math.nan, o),
            torch.where(bad[:, None, None], math.nan, lse))


class _Blocks:
    """Reads key and value blocks of a decode batch from either cache form: contiguous rows
    ``slot[b]`` of ``[S, T, H, D]``, or pages ``block_table[b, i]`` of a ``[P, C, H, D]`` pool.
    ``bad [B]`` records the sequences that read a page outside the pool (read as page 0)."""

    def __init__(self, k_cache, v_cache, slot, block_table, block_size):
        self.k, self.v, self.slot, self.table, self.C = k_cache, v_cache, slot, block_table, \
            block_size
        self.bad = torch.zeros_like(slot, dtype=torch.bool)

    def rows(self, x: torch.Tensor, blocks: torch.Tensor, last: torch.Tensor):
        """Rows of ``x`` (``self.k`` or ``self.v``) of ``blocks [B, H, M]`` (-1 = none):
        ``([B, H, M, C, D], mask [B, H, M, C])``; the mask keeps real positions ``<= last [B]``."""
        B, H, M = blocks.shape
        C, dev = self.C, x.device
        p = blocks[..., None].long() * C + torch.arange(C, device=dev)
        mask = (blocks[..., None] >= 0) & (p <= last[:, None, None, None])
        h = torch.arange(H, device=dev)[None, :, None, None]
        if self.table is None:
            return x[self.slot[:, None, None, None], p.clamp(0, x.shape[1] - 1), h], mask
        read = mask.any(-1)  # [B, H, M]: blocks with a key to read
        b = torch.arange(B, device=dev)[:, None, None]
        page = self.table.long()[b, blocks.clamp(0, self.table.shape[1] - 1)]  # [B, H, M]
        ok = (page >= 0) & (page < x.shape[0])
        self.bad = self.bad | (read & ~ok).flatten(1).any(1)
        page = torch.where(ok, page, 0)[..., None]
        return x[page, torch.arange(C, device=dev), h], mask


def _leaf_scores(qs, keys: _Blocks, cand, pos, scorer):
    """Exact scores of candidate leaves ``cand [B, 1, H, M]`` from their keys up to ``pos``:
    ``[B, 1, H, M]``, -inf where ``cand < 0``."""
    k, mask = keys.rows(keys.k, cand[:, 0], pos[:, 0])
    mask = mask[..., None, :]  # [B, H, M, 1, C]
    z = torch.einsum("bhgd,bhmcd->bhmgc", qs[:, 0], k.to(qs.dtype))
    z = z.masked_fill_(~mask, -math.inf)  # slots past the sequence may hold anything, even NaN
    score = group_score(z, mask.to(z.dtype), scorer)
    return torch.where(cand[:, 0] >= 0, score, -math.inf)[:, None]


def _attend(qs, keys: _Blocks, block_idx, t_abs, out_dtype):
    """Softmax attention of scaled queries ``qs [B, 1, H, G, D]`` over the keys ``<= t_abs`` of
    ``block_idx [B, 1, H, S]``: ``o [B, 1, H*G, D]`` and ``lse [B, H*G, 1]`` fp32."""
    B, _, H, G, D = qs.shape
    k, mask = keys.rows(keys.k, block_idx[:, 0], t_abs[:, 0])
    vals, _ = keys.rows(keys.v, block_idx[:, 0], t_abs[:, 0])
    mask = mask.flatten(2)  # [B, H, S*C]: slots past the sequence may hold anything, even NaN
    vals = vals.flatten(2, 3).to(qs.dtype).masked_fill_(~mask[..., None], 0.0)
    z = torch.einsum("bhgd,bhnd->bhgn", qs[:, 0], k.flatten(2, 3).to(qs.dtype))
    z = z.masked_fill_(~mask[:, :, None, :], -math.inf)
    lse = torch.logsumexp(z, dim=-1)  # [B, H, G]; -inf for a sequence with no key
    # shift only empty rows by 0: a NaN or +inf lse (NaN / Inf input) makes o NaN, as in dense
    # attention
    p = torch.exp(z - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    o = torch.einsum("bhgn,bhnd->bhgd", p, vals)
    return o.reshape(B, 1, H * G, D).to(out_dtype), lse.reshape(B, H * G, 1).float()
