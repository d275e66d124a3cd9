"""Packed sequences (FlashAttention's varlen convention) on the kernels of one sequence: the
layout row (``docs/varlen.md``).

``q [total_q, HQ, D]``, ``k, v [total_k, HKV, D]`` hold ``n_seq`` sequences back to back,
sequence ``i`` at rows ``cu_seqlens[i]:cu_seqlens[i + 1]``; its queries are the last
``len_q_i`` of its ``len_k_i`` positions. They are copied into one row (``B = 1``) of
``n_blocks * C`` positions where sequence ``i`` starts at block ``start_i`` and owns
``size_i`` blocks: ``size_i`` is the smallest power of the branching factor ``g`` that holds
its ``n_i = cdiv(len_k_i, C)`` leaves, and sequences are laid out by decreasing size, so that
``start_i`` is a multiple of ``size_i`` (buddy allocation). Every node of the row's pyramid at or
below the sequence's own root level then covers keys of that sequence only (plus zero padding
past its end, which only nodes holding the query itself, forced and never scored, contain), so
the one pyramid of the row is the pyramid of every sequence; the selection kernels only need to
know each row's sink, the first block of its sequence (``blk0``), and keep to nodes that do not
end before it. Attention over the row needs nothing: a query's selected blocks are blocks of
its own sequence, at the same offsets from its position as in the sequence alone.

No host sync: ``n_blocks`` is a bound from shapes and ``max_seqlen_k``
(``min(n_seq * g**e, g * (cdiv(total_k, C) + n_seq))``, ``g**e`` the size of the longest
sequence), every table is computed on the device. Memory: the row holds at most ``g`` times the
keys' blocks (the sizes round up to powers of ``g``; none for lengths that are ``C`` times a
power of ``g``), O(total) in all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import cdiv


def gather_rows(x: torch.Tensor, src: torch.Tensor, weight: torch.Tensor | None = None,
                backend: str = "torch") -> torch.Tensor:
    """Rows ``src [M]`` int64 of ``x [N, ...]`` as ``[M, ...]`` (x's dtype): row ``r`` is
    ``x[src[r]]`` times ``weight[r]`` when given (``[M]``, fp32, or fp64 for fp64 ``x``; the
    product in that precision), zeros where ``src[r] < 0``. ``backend="triton"``: one kernel
    (``rows_triton``); ``"torch"``: ``index_select`` and a mask. Not differentiable
    (``RowGather`` is)."""
    if backend == "triton":
        from .rows_triton import gather_rows_triton
        return gather_rows_triton(x, src, weight)
    keep = (src >= 0).to(weight.dtype if weight is not None else x.dtype)
    w = keep if weight is None else keep * weight
    out = x.index_select(0, src.clamp_min(0))
    return (out * w.view(-1, *[1] * (x.dim() - 1))).to(x.dtype)


class RowGather(torch.autograd.Function):
    """``gather_rows(x, src)`` differentiable in ``x``, given ``inv [N]``, the inverse map (row
    ``p`` of ``x`` is row ``inv[p]`` of the output, ``-1`` if no output row reads it; ``src``
    reads each row at most once): the backward is the gather of the output's gradient by
    ``inv``, no scatter."""

    @staticmethod
    def forward(ctx, x, src, inv, backend):
        ctx.save_for_backward(inv)
        ctx.backend = backend
        return gather_rows(x, src, None, backend)

    @staticmethod
    def backward(ctx, grad):
        inv, = ctx.saved_tensors
        return gather_rows(grad, inv, None, ctx.backend), None, None, None


@dataclass(frozen=True)
class VarlenLayout:
    """Where each packed token sits in the layout row, and each block's sink."""

    block_size: int
    n_blocks: int          # blocks of the row (a bound: the tail past the last sequence is unused)
    pos_q: torch.Tensor    # [total_q] int64: row position of each packed query
    pos_k: torch.Tensor    # [total_k] int64: row position of each packed key
    src_q: torch.Tensor    # [length] int64: the packed query at each row position, -1 for none
    src_k: torch.Tensor    # [length] int64: the packed key at each row position, -1 for none
    sink_q: torch.Tensor   # [total_q] int64: first block of each query's sequence in the row
    blk0: torch.Tensor     # [n_blocks] int32: first block of the sequence of each block that
    #                        holds queries, -1 for the others (their rows are not selected)

    @property
    def length(self) -> int:
        return self.n_blocks * self.block_size

    def rows(self, x: torch.Tensor, keys: bool, backend: str) -> torch.Tensor:
        """Packed queries (or with ``keys`` keys / values) ``x [total, H, D]`` as the layout row
        ``[1, length, H, D]`` (zeros where no token sits); differentiable, one gather each way
        (``RowGather``)."""
        src, pos = (self.src_k, self.pos_k) if keys else (self.src_q, self.pos_q)
        return RowGather.apply(x, src, pos, backend).unsqueeze(0)

    def unrows(self, o_row: torch.Tensor, backend: str) -> torch.Tensor:
        """The packed queries' rows ``[total_q, H, D]`` of a row output ``o_row [length, H, D]``;
        differentiable (``RowGather``)."""
        return RowGather.apply(o_row, self.pos_q, self.src_q, backend)

    def mean_tile_rows(self, q: torch.Tensor, query_tile: int, backend: str) -> torch.Tensor:
        """The layout row ``[1, length, HQ, D]`` of packed queries ``q [total_q, HQ, D]``
        (``rows``, not differentiable) as the selection of ``tile_reduce="qmean"`` tiles of
        ``query_tile`` tokens must see it: each query scaled by ``query_tile / n``, ``n`` the
        queries of its tile. The selection averages a tile of the row over all its
        ``query_tile`` positions, and the row's positions that hold no query (before a
        sequence's first query, past its end) are zeros, so a tile a sequence fills in part
        would otherwise score ``n / query_tile`` times its mean query, where the sequence alone
        scores the mean of its ``n`` queries. One gather (``gather_rows``, the product in fp32,
        fp64 for fp64 ``q``; exact for full tiles and ``n`` a power of two); device ops only."""
        tile = self.pos_q // query_tile
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        n = torch.zeros(cdiv(self.length, query_tile), dtype=ct, device=q.device)
        n = n.index_add_(0, tile, torch.ones_like(tile, dtype=ct))
        w = (query_tile / n.clamp_min(1)).repeat_interleave(query_tile)[:self.length]
        return gather_rows(q, self.src_q, w, backend).unsqueeze(0)


def seq_of(cu: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence of each of ``total`` packed tokens ``[total]`` int64 (empty sequences hold
    none)."""
    return torch.searchsorted(cu[1:], torch.arange(total, device=cu.device), right=True)


def varlen_layout(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                  max_seqlen_k: int, block_size: int, branching: int) -> VarlenLayout:
    """The layout row of the packed sequences ``cu_q``, ``cu_k`` (checked, ``check_varlen``);
    device ops only."""
    C, g = block_size, branching
    cu_q, cu_k = cu_q.long(), cu_k.long()
    n_seq = cu_k.shape[0] - 1
    len_q, len_k = cu_q.diff(), cu_k.diff()
    leaves = (len_k + C - 1) // C
    top = 1  # g ** e: the size of the longest sequence
    size = torch.ones_like(leaves)
    while top < cdiv(max_seqlen_k, C):
        top *= g
        size = torch.where(size < leaves, size * g, size)
    size = torch.where(leaves > 0, size, 0)
    order = torch.sort(size, descending=True, stable=True).indices
    start = torch.empty_like(size).scatter_(0, order, size[order].cumsum(0) - size[order])
    n_blocks = max(1, min(n_seq * top, g * (cdiv(total_k, C) + n_seq)))

    seq_k = seq_of(cu_k, total_k)
    pos_k = start[seq_k] * C + torch.arange(total_k, device=cu_k.device) - cu_k[seq_k]
    seq_q = seq_of(cu_q, total_q)
    pos_q = start[seq_q] * C + (len_k - len_q)[seq_q] \
        + torch.arange(total_q, device=cu_q.device) - cu_q[seq_q]
    sink_q = start[seq_q]
    blk0 = torch.full((n_blocks,), -1, dtype=torch.int32, device=cu_k.device)
    blk0[pos_q // C] = sink_q.to(torch.int32)  # every query of a block writes the same value
    return VarlenLayout(C, n_blocks, pos_q, pos_k, inverse_rows(pos_q, n_blocks * C),
                        inverse_rows(pos_k, n_blocks * C), sink_q, blk0)


def inverse_rows(pos: torch.Tensor, length: int) -> torch.Tensor:
    """``[length]`` int64: the index ``i`` with ``pos[i] == r`` at each ``r``, else ``-1``
    (``pos`` distinct)."""
    inv = torch.full((length,), -1, dtype=torch.int64, device=pos.device)
    return inv.scatter_(0, pos, torch.arange(pos.shape[0], device=pos.device))


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int,
                     device: torch.device) -> None:
    """``cu`` (argument ``name``): 1-D int32 on ``device`` with at least 2 entries, and (when on
    the CPU, or under no compile trace on any device: see ``check_varlen``) starting at 0,
    non-decreasing, ending at ``total``, with no sequence longer than ``max_seqlen``."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (FlashAttention's convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must have shape [n_seq + 1] with n_seq >= 1, got "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    name_max = "max_seqlen_" + name[-1]
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(f"{name_max} must be an int >= 0, got {max_seqlen!r}")
    lens = cu.diff()
    checks = ((cu[0] == 0, f"{name}[0] must be 0"),
              ((lens >= 0).all(), f"{name} must be non-decreasing (sequence lengths >= 0)"),
              (cu[-1] == total, f"{name}[-1] must equal the packed length {total}"),
              ((lens <= max_seqlen).all(), f"{name_max}={max_seqlen} is below the longest "
               f"sequence of {name}"))
    _check_values(cu, checks, lambda: f" ({name} = {cu.tolist()})")


def _check_values(x: torch.Tensor, checks, detail) -> None:
    """Raise ``ValueError`` for the first failing ``(condition, message)`` of ``checks`` when
    ``x`` lives on the CPU; on a GPU an asynchronous device assert (no host sync: a violation
    surfaces at a later CUDA call, without the message)."""
    for ok, message in checks:
        if x.is_cuda or torch.compiler.is_compiling():
            torch._assert_async(ok, message)
        elif not bool(ok):
            raise ValueError(message + detail())


def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 cu_q: torch.Tensor, cu_k: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int) -> None:
    """Validate packed ``q [total_q, HQ, D]``, ``k, v [total_k, HKV, D]`` and their
    ``cu_seqlens_q / _k [n_seq + 1]`` int32 (checked as ``pisa_attn``'s inputs after them).
    Values of CPU ``cu_seqlens`` are checked exactly (``ValueError`` naming the argument); those
    of CUDA ones by asynchronous device asserts (no host sync, as the forward has none)."""
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must have shape [total, H, D] (3 dims: packed sequences), "
                             f"got {tuple(x.shape)}")
    check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], max_seqlen_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], max_seqlen_k, q.device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, "
                         f"got shapes {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    _check_values(cu_q, [((cu_q.diff() <= cu_k.diff()).all(),
                          "every sequence needs len_q <= len_k (cu_seqlens_q, cu_seqlens_k): "
                          "queries are the tail of their sequence's keys")],
                  lambda: f" (cu_seqlens_q = {cu_q.tolist()}, cu_seqlens_k = {cu_k.tolist()})")
