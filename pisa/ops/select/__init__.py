"""Block selection: the custom op ``pisa::select`` and its dispatch to the implementations.

``naive.naive_select`` (fp64 loops, the oracle), ``torch_backend.select_torch`` (vectorised
PyTorch), ``triton.select_pyramid_triton`` (the pyramid walk) and ``flat.select_flat_triton`` (flat
scans, and walks whose beam covers every block). A caller that already holds the pyramid of ``k``
(the decode cache's, in chunked prefill) passes it in; otherwise it is built here when needed.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..pyramid import Pyramid, build_pyramid
from ..utils.config import SelectConfig
from ..utils.geometry import cdiv, level_offsets


def _select_triton(q: Tensor, k: Tensor, cfg: SelectConfig, pyramid: Pyramid | None):
    from .flat import select_flat_triton
    from .triton import check_pyramid, select_pyramid_triton
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"backend='triton' needs fp16/bf16/fp32 q and k, got {q.dtype}")
    # A beam as wide as the leaf count prunes nothing: the walk reduces to the flat scan of the
    # leaf scores (and candidate tiles that wide would not fit the walk kernel).
    walk = cfg.selector == "pyramid" and cfg.beam < cdiv(k.shape[1], cfg.block_size)
    if pyramid is not None:
        check_pyramid(pyramid, k, cfg)
    elif walk or cfg.selector == "flat_mean":
        pyramid = build_pyramid(k, cfg.block_size, cfg.branching, "triton")
    if walk:
        return select_pyramid_triton(q, k, cfg, pyramid)
    return select_flat_triton(q, k, cfg, pyramid, cfg.scorer if cfg.selector == "pyramid"
                              else "lse")


@torch.library.custom_op("pisa::select", mutates_args=())
def _select_op(q: Tensor, k: Tensor, means: Optional[Tensor], counts: Optional[Tensor],
               block_size: int, topk: int, branching: int, beam: int, scorer: str,
               selector: str, forced_in_budget: bool, scale: float,
               backend: str) -> tuple[Tensor, Tensor]:
    cfg = SelectConfig(block_size, topk, branching, beam, scorer, selector, forced_in_budget,
                       scale)
    pyramid = None if means is None else Pyramid(
        means, counts, level_offsets(k.shape[1], block_size, branching))
    if backend == "triton":
        return _select_triton(q, k, cfg, pyramid)
    if backend == "naive":  # builds its own fp64 pyramid from the keys
        from .naive import naive_select
        idx, cnt = naive_select(q.cpu(), k.cpu(), cfg)
        return idx.to(q.device), cnt.to(q.device)
    from .torch_backend import select_torch
    return select_torch(q, k, cfg, pyramid)


@_select_op.register_fake
def _(q, k, means, counts, block_size, topk, branching, beam, scorer, selector,
      forced_in_budget, scale, backend):
    cfg = SelectConfig(block_size, topk, branching, beam, scorer, selector, forced_in_budget,
                       scale)
    B, Tq, HKV = q.shape[0], q.shape[1], k.shape[2]
    return (q.new_empty((B, Tq, HKV, cfg.slots), dtype=torch.int32),
            q.new_empty((B, Tq, HKV), dtype=torch.int32))


def select(q: Tensor, k: Tensor, cfg: SelectConfig, backend: str,
           pyramid: Pyramid | None = None) -> tuple[Tensor, Tensor]:
    """Selection through the custom op ``torch.ops.pisa.select`` (opaque to torch.compile).

    ``q [B, Tq, HQ, D]``, ``k [B, Tk, HKV, D]`` (checked), ``cfg`` resolved, ``backend`` one of
    ``"torch"``, ``"triton"``, ``"naive"``; ``pyramid``: the pyramid of ``k`` if the caller holds
    it. Returns ``block_idx [B, Tq, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, Tq, HKV] int32``. No gradient."""
    means, counts = (None, None) if pyramid is None else (pyramid.means, pyramid.counts)
    return _select_op(q, k, means, counts, *cfg.astuple(), backend)
