"""Sparse attention over selected key blocks: the custom op ``pisa::sparse_attn``, its autograd
and its dispatch to ``torch_backend.attn_fwd_torch`` / ``triton.attn_fwd_triton`` (and their
backwards); ``naive.naive_attn`` is the fp64 oracle.

A selection has a row per query token (``query_tile = 1``, ``[B, Tq, HKV, S]``) or per query tile
(``query_tile = Qt > 1``, ``[B, n_query_tiles(Tq, Tk, Qt), HKV, S]``: the queries at absolute
positions ``[i * Qt, (i + 1) * Qt)`` share row ``i - (Tk - Tq) // Qt``);
``utils.config.check_block_idx`` validates a caller's.

Both custom ops are opaque to torch.compile (data-dependent indexing, host syncs inside); an
eager call runs the same functions through ``_SparseAttn`` instead of the op's dispatch
(``utils.dispatch.use_op``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..utils.config import SelectConfig, n_query_tiles
from ..utils.dispatch import use_op


def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, block_size: int, scale: float,
              backend: str, deterministic: bool, query_tile: int) -> tuple[Tensor, Tensor]:
    """``o`` (q's dtype) and ``lse [B, HQ, Tq]`` (fp64 for fp64 torch inputs, else fp32)."""
    if backend == "triton":
        from .triton import attn_fwd_triton
        return attn_fwd_triton(q, k, v, block_idx, block_size, scale, query_tile)
    from .torch_backend import attn_fwd_torch
    return attn_fwd_torch(q, k, v, block_idx, block_size, scale, query_tile)


_attn_op = torch.library.custom_op("pisa::sparse_attn", _attn_fwd, mutates_args=())


@_attn_op.register_fake
def _(q, k, v, block_idx, block_size, scale, backend, deterministic, query_tile):
    lse_dtype = torch.float64 if q.dtype == torch.float64 and backend == "torch" \
        else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                            dtype=lse_dtype)


def _attn_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor,
              lse: Tensor, block_idx: Tensor, block_size: int, scale: float,
              backend: str, deterministic: bool,
              query_tile: int) -> tuple[Tensor, Tensor, Tensor]:
    if backend == "triton":
        from .triton import attn_bwd_triton
        return attn_bwd_triton(do, dlse, q, k, v, o, lse, block_idx, block_size, scale,
                               deterministic, query_tile)
    from .torch_backend import attn_bwd_torch
    return attn_bwd_torch(do, dlse, q, k, v, o, lse, block_idx, block_size, scale, query_tile)


_attn_bwd_op = torch.library.custom_op("pisa::sparse_attn_bwd", _attn_bwd, mutates_args=())


@_attn_bwd_op.register_fake
def _(do, dlse, q, k, v, o, lse, block_idx, block_size, scale, backend, deterministic,
      query_tile):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attn_setup(ctx, inputs, output):
    q, k, v, block_idx = inputs[:4]
    ctx.save_for_backward(q, k, v, output[0], output[1], block_idx)
    ctx.args = inputs[4:]


def _attn_backward(ctx, do, dlse):
    q, k, v, o, lse, block_idx = ctx.saved_tensors
    bwd = _attn_bwd_op if use_op(q) else _attn_bwd
    dq, dk, dv = bwd(do.contiguous(), dlse, q, k, v, o, lse, block_idx, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_attn_op.register_autograd(_attn_backward, setup_context=_attn_setup)


class _SparseAttn(torch.autograd.Function):
    """The eager twin of the custom op's autograd (the same setup and backward), for calls
    that need no op (``utils.dispatch.use_op``)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _attn_fwd(*inputs)
        _attn_setup(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, do, dlse):
        return _attn_backward(ctx, do, dlse)


def sparse_attn(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, *, cfg: SelectConfig,
                backend: str, deterministic: bool = False, query_tile: int | None = None):
    """Exact attention of each query over the keys of its selected blocks (causal).

    ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, HKV, D]``, ``block_idx`` int32 (ascending, -1 padded) a
    row per query tile ``[B, n_query_tiles(Tq, Tk, query_tile), HKV, S]``, all checked by the
    caller (``utils.config.check_block_idx``; only the row count is checked here); ``cfg``
    resolved: its ``block_size`` and ``scale`` are read; ``query_tile``: the selection's rows,
    default ``cfg.query_tile`` (``1``: a row per token, as a caller's ``block_idx`` may have);
    ``backend`` ``"torch"``, ``"triton"`` or ``"naive"``. Returns ``o [B, Tq, HQ, D]`` (q's
    dtype) and ``lse [B, HQ, Tq]`` fp32, both differentiable in q, k, v.
    ``deterministic=True`` makes the Triton backward bitwise reproducible (no atomics; the torch
    backward always is).
    """
    tile = cfg.query_tile if query_tile is None else query_tile
    rows = n_query_tiles(q.shape[1], k.shape[1], tile)
    if block_idx.dim() != 4 or block_idx.shape[1] != rows:
        raise ValueError(f"block_idx must have {rows} rows (n_query_tiles(Tq={q.shape[1]}, "
                         f"Tk={k.shape[1]}, query_tile={tile})) in dim 1, got shape "
                         f"{tuple(block_idx.shape)}")
    if backend == "naive":
        from .naive import naive_attn
        o, lse = naive_attn(q, k, v, block_idx.cpu(), cfg.block_size, cfg.scale, tile)
        return o.to(q.dtype), lse.float()
    attn = _attn_op if use_op(q) else _SparseAttn.apply
    o, lse = attn(q, k, v, block_idx, cfg.block_size, cfg.scale, backend, bool(deterministic),
                  tile)
    return o, lse.float()


def dense_causal_attn(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Exact causal self-attention by torch SDPA (cuDNN / FlashAttention on CUDA, where they
    take the inputs): ``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` (GQA when ``HKV < HQ``);
    ``scale`` None is ``D ** -0.5``.
    Returns ``o [B, T, HQ, D]``, differentiable in q, k, v."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def window_block_idx(batch: int, n_queries: int, n_keys: int, n_kv_heads: int, window: int,
                     block_size: int, query_tile: int, device=None) -> Tensor:
    """A sliding-window selection: each row of queries (a tile of ``query_tile`` absolute
    positions, or a token for ``1``) gets the last ``window`` blocks up to its own, ``max(cur -
    window + 1, 0) .. cur`` ascending, ``-1`` padded at the end (early rows): ``[batch,
    n_query_tiles(n_queries, n_keys, query_tile), n_kv_heads, window]`` int32, a valid
    ``block_idx`` of ``sparse_attn`` / ``pisa_attn`` (the kernels mask causally inside the
    current block). A query thus sees between ``(window - 1) * C + 1`` and ``window * C`` keys."""
    rows = n_query_tiles(n_queries, n_keys, query_tile)
    first = (torch.arange(rows, device=device) + (n_keys - n_queries) // query_tile) * query_tile
    cur = (first // block_size)[:, None]  # a tile lies inside one block
    ids = (cur - window + 1).clamp_min(0) + torch.arange(window, device=device)
    ids = torch.where(ids <= cur, ids, -1).to(torch.int32)
    return ids[None, :, None, :].expand(batch, rows, n_kv_heads, window).contiguous()
