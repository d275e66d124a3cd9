"""Attention of new queries against a KV cache (layout of ``kvcache``): one decode step
(``decode_step``: the Triton kernels of ``triton.decode_triton`` or
``torch_backend.decode_torch``) and chunked prefill (``prefill_with_cache``: the training selection,
on the pyramid taken from the cache's sums, and the sparse attention kernels).

The key bounds ``mins, maxs`` (``kvcache``: per node and channel, kept by a cache made with
``bounds=True``) are optional arguments of every op here; ``scorer="bound"`` ranks by them.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..attn import sparse_attn
from ..select import select
from ..utils.config import SelectConfig, check_qk
from ..utils.dispatch import use_op
from .kvcache import gather_pages, pyramid_from_sums


def decode_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                sums: torch.Tensor, cache_seqlens: torch.Tensor,
                mins: torch.Tensor | None = None, maxs: torch.Tensor | None = None, *,
                cfg: SelectConfig, backend: str, block_table: torch.Tensor | None = None,
                cache_batch_idx: torch.Tensor | None = None):
    """One decode step for inputs the caller checked (``pisa.PisaCache.prepare``: the cache's
    tensors by ``kvcache.check_cache``, ``q [B, 1, HQ, D]`` against them; ``cfg`` resolved; the
    key bounds ``mins, maxs`` present for ``cfg.uses_bounds``): the Triton kernels walk the
    pyramid (LSE scores, or with the key bounds for ``scorer="bound"``; any ``beam_leaf``) on
    ``backend="triton"``; flat scans and the mean / meanvar ablations decode through the torch
    path. Either reads a paged cache through ``block_table`` and the slots of
    ``cache_batch_idx`` (``kvcache`` layout). Returns ``o [B, 1, HQ, D]``, ``lse [B, HQ, 1]``
    fp32.

    A decode step is always per token: ``cfg.query_tile`` and ``cfg.tile_reduce`` are ignored by
    design (``docs/spec.md`` §11), so with ``query_tile > 1`` the step equals prefill's row of
    a per-token selection (``query_tile=1``), not of the tile-shared one.

    Under ``torch.compile`` the step is the custom op ``torch.ops.pisa.decode_step`` (the config
    by field name): a compiled, CUDA-graphed decode step launches the kernel as it is."""
    tensors = (q, k_cache, v_cache, sums, cache_seqlens, mins, maxs, block_table,
               cache_batch_idx)
    if use_op(q):  # opaque to the compiler, as write_kv
        return _decode_op(*tensors, backend, **cfg.op_kwargs())
    return _decode(*tensors, backend, cfg)


def _decode(q, k_cache, v_cache, sums, cache_seqlens, mins, maxs, block_table, cache_batch_idx,
            backend: str, cfg: SelectConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_step``'s work (its tensors by position)."""
    if cfg.query_tile != 1 or cfg.tile_reduce != "sum":  # one token: any reduction
        cfg = _per_token(cfg)
    where = dict(mins=mins, maxs=maxs, block_table=block_table, cache_batch_idx=cache_batch_idx)
    if backend == "triton" and cfg.selector == "pyramid" and cfg.scorer in ("lse", "bound"):
        return _triton().decode_triton(q, k_cache, v_cache, sums, cache_seqlens, cfg, **where)
    from .torch_backend import decode_torch
    return decode_torch(q, k_cache, v_cache, sums, cache_seqlens, cfg, **where)


# The config crosses the op's boundary by field name, as in ``torch.ops.pisa.select``.
@torch.library.custom_op("pisa::decode_step", mutates_args=(), schema=(
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor sums, Tensor cache_seqlens, Tensor? mins, "
    "Tensor? maxs, Tensor? block_table, Tensor? cache_batch_idx, str backend, *, "
    f"{SelectConfig.op_schema()}) -> (Tensor, Tensor)"))
def _decode_op(q, k_cache, v_cache, sums, cache_seqlens, mins, maxs, block_table,
               cache_batch_idx, backend, **fields):
    return _decode(q, k_cache, v_cache, sums, cache_seqlens, mins, maxs, block_table,
                   cache_batch_idx, backend, SelectConfig(**fields))


@_decode_op.register_fake
def _(q, *args, **fields):
    B, _, HQ, D = q.shape
    return q.new_empty(B, 1, HQ, D), q.new_empty(B, HQ, 1, dtype=torch.float32)


@functools.cache
def _triton():
    """The Triton module, imported on first use (not with the package: Triton may be absent);
    an import statement in the step would cost it a microsecond every call."""
    from . import triton
    return triton


@functools.lru_cache(maxsize=256)
def _per_token(cfg: SelectConfig) -> SelectConfig:
    """``cfg`` with ``query_tile=1, tile_reduce="sum"``, made once per config (a decode step is
    host-bound, and the HF integration's configs ask for tiles)."""
    return dataclasses.replace(cfg, query_tile=1, tile_reduce="sum")


def prefill_with_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       sums: torch.Tensor, seqlens: list[int],
                       mins: torch.Tensor | None = None, maxs: torch.Tensor | None = None, *,
                       cfg: SelectConfig, backend: str, block_table: torch.Tensor | None = None,
                       slots: list[int] | None = None):
    """Chunked prefill: queries ``q [B, L, HQ, D]`` at the last ``L`` positions of each
    sequence's first ``seqlens[b]`` keys (bottom-right causal), whose keys are already appended.

    Selection runs on the pyramid taken from the cache's sums (``pyramid_from_sums``; with the
    cache's key bounds ``mins, maxs`` when given, which ``scorer="bound"`` ranks by; without them
    the selection builds the bounds from the keys, O(seqlen)) for the ``torch`` and ``triton``
    backends (``naive`` builds its own from the keys), then ``sparse_attn``. With
    ``cfg.query_tile > 1`` the selection has a row per query tile, which the tile attention
    kernels take as it is. Sequences of equal length go through together; otherwise one at a
    time (always, with ``slots``). ``seqlens`` are host ints (prefill may sync), as are ``slots``
    (row ``b`` reads slot ``slots[b]`` of the cache; default ``b``). A paged cache
    (``block_table``) is read through its table: the sequence's pages are gathered into one
    contiguous K and V (``kvcache.gather_pages``, an O(seqlen) copy per call) for the training
    kernels. Returns ``o`` (q's dtype), ``lse [B, HQ, L]`` fp32.
    """
    B = q.shape[0]
    together = slots is None and len(set(seqlens)) == 1
    groups = [slice(None)] if together else [slice(b, b + 1) for b in range(B)]
    bound = cfg.uses_bounds and mins is not None
    outs, lses = [], []
    for rows in groups:
        s = seqlens[rows][0]
        at = rows if slots is None else slice(slots[rows.start], slots[rows.start] + 1)
        qb = q[rows]
        if block_table is None:
            k, v = k_cache[at, :s], v_cache[at, :s]
        else:
            k, v = (gather_pages(x, block_table[rows], s) for x in (k_cache, v_cache))
        check_qk(qb, k, v)
        pyramid = None
        if backend != "naive":
            bounds = (mins[at], maxs[at]) if bound else (None, None)
            pyramid = pyramid_from_sums(sums[at], s, cfg.block_size, cfg.branching, *bounds)
        block_idx, _ = select(qb.detach(), k, cfg=cfg, backend=backend, pyramid=pyramid)
        o, lse = sparse_attn(qb, k, v, block_idx, cfg=cfg, backend=backend)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
