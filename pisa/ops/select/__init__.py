"""Block selection: the custom op ``pisa::select`` and its dispatch to the implementations.

``naive.naive_select`` (fp64 loops, the oracle), ``torch_backend.select_torch`` (vectorised
PyTorch), ``triton.select_pyramid_triton`` (the pyramid walk) and ``flat.select_flat_triton`` (flat
scans, and walks whose beam covers every block). A caller that already holds the pyramid of ``k``
(the decode cache's, in chunked prefill) passes it in; otherwise it is built here when needed.

With ``query_tile = Qt > 1`` a selection has a row per query tile (``n_query_tiles``) instead of
per token; ``tiles_to_tokens`` expands it to per-token rows.

Packed sequences (``pisa.ops.utils.varlen``) run on one layout row (``B = 1``) with ``blk0``, the first
block of each block's sequence (``-1``: a block without queries): every selector then keeps to
the row's own sequence, whose first block is its sink.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..pyramid import Pyramid, build_pyramid
from ..utils.config import SelectConfig, n_query_tiles
from ..utils.csr import token_rows
from ..utils.dispatch import use_op
from ..utils.geometry import cdiv, level_offsets


def _select_triton(q: Tensor, k: Tensor, cfg: SelectConfig, pyramid: Pyramid | None,
                   blk0: Tensor | None, q_ok: Tensor | None):
    from .flat import select_flat_triton
    from .triton import beam_geometry, check_pyramid, select_pyramid_triton
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"backend='triton' needs fp16/bf16/fp32 q and k, got {q.dtype}")
    # Beams as wide as the leaf count prune nothing: the walk reduces to the flat scan of the
    # leaf scores (and candidate tiles that wide would not fit the walk kernel).
    n_leaves = cdiv(k.shape[1], cfg.block_size)
    walk = cfg.selector == "pyramid" and min(cfg.beam, cfg.beam_at(2)) < n_leaves
    if walk:
        beam_geometry(cfg, k.shape[1])  # a beam too wide for the kernel, before any work
    if pyramid is not None:
        check_pyramid(pyramid, k, cfg)
    if pyramid is None and (walk or cfg.selector == "flat_mean"):
        pyramid = build_pyramid(k, cfg.block_size, cfg.branching, "triton",
                                bounds=walk and cfg.uses_bounds)
    if walk:
        return select_pyramid_triton(q, k, cfg, pyramid, blk0, q_ok)
    if cfg.tile_reduce == "mass":  # a context of at most a beam of leaves: the torch ranking
        from .torch_backend import select_torch
        return select_torch(q, k, cfg, pyramid, blk0, q_ok)
    return select_flat_triton(q, k, cfg, pyramid, cfg.leaf_scorer, blk0)


# The config crosses the custom op's boundary by field name: its fields are the op's keyword-only
# arguments (``SelectConfig.op_schema``), passed as ``**cfg.op_kwargs()``.
def _select_impl(q: Tensor, k: Tensor, means: Optional[Tensor], counts: Optional[Tensor],
                 mins: Optional[Tensor], maxs: Optional[Tensor], backend: str,
                 blk0: Optional[Tensor], q_ok: Optional[Tensor],
                 **fields) -> tuple[Tensor, Tensor]:
    cfg = SelectConfig(**fields)
    pyramid = None if means is None else Pyramid(
        means, counts, level_offsets(k.shape[1], cfg.block_size, cfg.branching), mins, maxs)
    if pyramid is not None and cfg.uses_bounds and pyramid.mins is None:
        pyramid = None  # a caller's pyramid without bounds (a decode cache's): the backend
        # builds one with them from the keys
    if backend == "triton":
        return _select_triton(q, k, cfg, pyramid, blk0, q_ok)
    if backend == "naive":  # builds its own fp64 pyramid from the keys
        if blk0 is not None:
            raise ValueError("backend='naive' has no packed-sequence selection: use 'torch'")
        from .naive import naive_select
        idx, cnt = naive_select(q.cpu(), k.cpu(), cfg)
        return idx.to(q.device), cnt.to(q.device)
    from .torch_backend import select_torch
    return select_torch(q, k, cfg, pyramid, blk0, q_ok)


_select_op = torch.library.custom_op("pisa::select", _select_impl, mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor? means, Tensor? counts, Tensor? mins, Tensor? maxs, "
    f"str backend, Tensor? blk0, Tensor? q_ok, *, {SelectConfig.op_schema()}) "
    "-> (Tensor, Tensor)"))


@_select_op.register_fake
def _(q, k, means, counts, mins, maxs, backend, blk0, q_ok, **fields):
    cfg = SelectConfig(**fields)
    B, HKV = q.shape[0], k.shape[2]
    rows = n_query_tiles(q.shape[1], k.shape[1], cfg.query_tile)
    return (q.new_empty((B, rows, HKV, cfg.slots), dtype=torch.int32),
            q.new_empty((B, rows, HKV), dtype=torch.int32))


def select(q: Tensor, k: Tensor, *, cfg: SelectConfig, backend: str,
           pyramid: Pyramid | None = None, blk0: Tensor | None = None,
           q_ok: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Selection through the custom op ``torch.ops.pisa.select`` (opaque to torch.compile; an
    eager call runs the op's function directly: ``utils.dispatch.use_op``).

    ``q [B, Tq, HQ, D]``, ``k [B, Tk, HKV, D]`` (checked), ``cfg`` resolved, ``backend`` one of
    ``"torch"``, ``"triton"``, ``"naive"``; ``pyramid``: the pyramid of ``k`` if the caller holds
    it; ``blk0 [cdiv(Tk, C)]`` int32 for a packed layout (``B = 1``): the first block of each
    block's sequence, ``-1`` for a block without queries (its rows come back empty), and for
    ``tile_reduce="mass"`` ``q_ok [Tq]`` bool, which row positions hold queries (the layout
    row's others are zeros: a tile scores and averages its own tokens only). Returns
    ``block_idx [B, n_tiles, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, n_tiles, HKV] int32``, a row per query tile: ``n_tiles =
    n_query_tiles(Tq, Tk, cfg.query_tile)``, ``Tq`` rows (one per token) for ``query_tile=1``.
    No gradient."""
    tensors = (None,) * 4 if pyramid is None else (pyramid.means, pyramid.counts, pyramid.mins,
                                                   pyramid.maxs)
    op = _select_op if use_op(q) else _select_impl
    return op(q, k, *tensors, backend, blk0, q_ok, **cfg.op_kwargs())


def tiles_to_tokens(block_idx: Tensor, counts: Tensor, n_queries: int, n_keys: int,
                    query_tile: int) -> tuple[Tensor, Tensor]:
    """A selection per query tile (``block_idx [B, n_tiles, HKV, S]``, ``counts [B, n_tiles,
    HKV]``, of the last ``n_queries`` of ``n_keys`` positions) as the per-token selection
    ``[B, n_queries, HKV, S]``, ``[B, n_queries, HKV]``: each token takes its tile's row (the
    reference layout of the attention kernels; ``query_tile = 1``: the selection itself)."""
    return tuple(token_rows(x, n_queries, n_keys, query_tile) for x in (block_idx, counts))
