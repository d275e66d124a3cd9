"""The decode cache's storage ops: append keys/values and keep the key pyramid's sums current.

Layout (contiguous form, per layer; shared with ``decode.torch`` and ``decode.triton``):

- ``k_cache, v_cache [B, T_max, HKV, D]`` (FlashAttention's ``flash_attn_with_kvcache`` layout).
- ``sums [B, N_total, HKV, D]``: the pyramid's key SUMS in the layout of ``pisa.ops.pyramid``
  (leaves first, up to the single root) for the geometry of ``T_max`` keys:
  ``offsets = level_offsets(T_max, C, g)``. fp32 (fp64 for an fp64 cache, so the fp64 oracle tests
  compare like with like). Node ``i`` of level ``l`` covers keys ``[i·C·g^(l-1), (i+1)·C·g^(l-1))``
  and holds the sum of those of its keys that lie before ``cache_seqlens[b]``; rows past the
  sequence are zero.
- ``cache_seqlens [B]`` int32: valid keys per sequence.
- Optional, for ``scorer="bound"`` (``docs/spec.md`` §11): ``mins, maxs [B, N_total, HKV, D]`` in
  the layout and dtype of ``sums``: every node's per-channel min and max over its keys that lie
  before ``cache_seqlens[b]``. A node without such keys (past the sequence) holds ``+inf`` in
  ``mins`` and ``-inf`` in ``maxs``, the neutral values of the updates, so a partially filled
  node bounds only its real keys. A cache made without them (the default) allocates nothing;
  ``bounds_from_keys`` builds them from the keys when asked for later.

Paged form (``block_table`` given; vLLM / ``flash_attn_with_kvcache(block_table=...)``):

- ``k_cache, v_cache [num_pages, C, HKV, D]``: a pool of pages of ``C`` tokens, one leaf block a
  page, shared by every sequence.
- ``block_table [B, max_pages]`` int32: leaf ``i`` of batch row ``b`` (its keys ``[i·C, (i+1)·C)``)
  is page ``block_table[b, i]``. Entries past a sequence's pages are never read (any value; ``-1``
  by convention). ``T_max = max_pages·C`` is the geometry of ``sums``.
- The pyramid stays per sequence, in the per-slot ``sums`` (and bounds) above.

Slots (``cache_batch_idx [B]`` int32, as ``flash_attn_with_kvcache``'s): batch row ``b`` uses slot
``cache_batch_idx[b]`` of every per-sequence tensor of the cache: the rows of ``sums`` (and
bounds), and in the contiguous form those of ``k_cache, v_cache``. ``None``: row ``b`` is slot
``b``. ``cache_seqlens`` and ``block_table`` are per batch row. A running batch of a serving loop
is the slots of its live sequences, in any order; adding or removing a sequence moves nothing.

Counts are not stored: node ``i`` of level ``l`` holds ``clamp(seqlen - i·C·g^(l-1), 0,
C·g^(l-1))`` keys. Keeping sums (not means) makes an append a plain add into the new key's leaf and
each of its ancestors: O(log N) work per token, O(N/C) memory on top of K/V. The bounds update the
same way, with an elementwise min / max (``scatter_reduce_``) along the same ancestor path.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..pyramid import Pyramid
from ..utils.config import check_geometry, resolve_backend
from ..utils.dispatch import use_op
from ..utils.geometry import cdiv, compute_dtype, level_offsets, level_sizes


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, sums: torch.Tensor,
                cache_seqlens: torch.Tensor, block_size: int, branching: int,
                mins: torch.Tensor | None = None, maxs: torch.Tensor | None = None, *,
                block_table: torch.Tensor | None = None,
                cache_batch_idx: torch.Tensor | None = None) -> tuple[int, ...]:
    """Validate a cache's tensors (metadata only: no host sync), the optional key bounds
    ``mins, maxs`` (both or neither, each like ``sums``), page table and slots too; return the
    pyramid offsets (geometry of ``T_max``).

    Contiguous: ``k_cache [S, T_max, HKV, D]``. Paged (``block_table [B, max_pages]`` int32):
    ``k_cache [num_pages, block_size, HKV, D]``, ``T_max = max_pages * block_size``. ``sums`` has
    a row per slot ``S``; ``cache_seqlens``, ``block_table`` and ``cache_batch_idx`` one per batch
    row ``B`` (``B = S`` without ``cache_batch_idx``). The values of the table and the slots are
    not read here (``check_block_table``, ``check_batch_idx``)."""
    check_geometry(block_size, branching)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("sums", sums),
                    ("cache_seqlens", cache_seqlens)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    paged = block_table is not None
    form = "[num_pages, block_size, HKV, D] page pool" if paged else "[B, T_max, HKV, D]"
    if k_cache.dim() != 4 or not k_cache.is_floating_point():
        raise ValueError(f"k_cache must be a floating-point {form} tensor, got "
                         f"{k_cache.dtype} {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype \
            or v_cache.device != k_cache.device:
        raise ValueError(f"v_cache ({v_cache.dtype} {tuple(v_cache.shape)} on {v_cache.device}) "
                         f"must match k_cache ({k_cache.dtype} {tuple(k_cache.shape)} on "
                         f"{k_cache.device})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in their last (head) dim")
    H, D = k_cache.shape[2:]
    if paged:
        _check_index("block_table", block_table, 2, k_cache.device)
        if block_table.shape[1] < 1:
            raise ValueError(f"block_table must have at least one page a row, got "
                             f"{tuple(block_table.shape)}")
        if k_cache.shape[1] != block_size:
            raise ValueError(f"k_cache must be a {form} with pages of block_size={block_size} "
                             f"tokens (one leaf block a page), got {tuple(k_cache.shape)}")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.shape[0] > 1 and x.stride(0) != block_size * x.stride(1):
                raise ValueError(f"{name}, a page pool, must be contiguous across its pages "
                                 f"(stride(0) == block_size * stride(1): token rows of every "
                                 f"page one stride apart), got strides {x.stride()}")
        S, T = sums.shape[0] if sums.dim() == 4 else -1, block_table.shape[1] * block_size
    else:
        S, T = k_cache.shape[:2]
    offsets = level_offsets(T, block_size, branching)
    if sums.dim() != 4 or S < 1 or tuple(sums.shape[1:]) != (offsets[-1], H, D) \
            or sums.dtype != compute_dtype(k_cache):
        rows, tmax = ("S >= 1", " = block_table's max_pages x block_size") if paged else (S, "")
        raise ValueError(f"sums must be {compute_dtype(k_cache)} [{rows}, {offsets[-1]}, {H}, "
                         f"{D}] (pyramid of T_max={T}{tmax}, block_size={block_size}, "
                         f"branching={branching}), got {sums.dtype} {tuple(sums.shape)}")
    if sums.device != k_cache.device or not sums.is_contiguous():
        raise ValueError(f"sums must be contiguous on k_cache's device {k_cache.device}")
    check_bounds(sums, mins, maxs)
    B = S
    if cache_batch_idx is not None:
        _check_index("cache_batch_idx", cache_batch_idx, 1, k_cache.device)
        B = cache_batch_idx.shape[0]
    if paged and block_table.shape[0] != B:
        what = "cache_batch_idx's" if cache_batch_idx is not None else "the cache's slots"
        raise ValueError(f"block_table must have a row per sequence ({what} {B}), got "
                         f"{tuple(block_table.shape)}")
    if tuple(cache_seqlens.shape) != (B,) or cache_seqlens.dtype != torch.int32 \
            or cache_seqlens.device != k_cache.device:
        raise ValueError(f"cache_seqlens must be int32 [{B}] on {k_cache.device}, got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)} on "
                         f"{cache_seqlens.device}")
    return offsets


def _check_index(name: str, x, dim: int, device: torch.device) -> None:
    """An int32 index tensor of ``dim`` dims on ``device``, contiguous in its last dim."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim or x.dtype != torch.int32 or x.device != device \
            or (x.numel() and x.stride(-1) != 1):
        shape = "[B, max_pages]" if dim == 2 else "[B]"
        raise ValueError(f"{name} must be an int32 {shape} tensor on {device}, contiguous in its "
                         f"last dim, got {x.dtype} {tuple(x.shape)} on {x.device}")


def check_block_table(block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_pages: int,
                      block_size: int, n_new: int = 0) -> None:
    """Check the values of a page table (host sync: run at cache-management time, where pages
    are allocated, or where the lengths are read on the host anyway; never in a decode step):
    the pages holding each row's first ``cache_seqlens[b] + n_new`` tokens must be in
    ``[0, num_pages)``, fit ``max_pages``, and differ between rows (a page shared by two live
    sequences would mix their keys). ``ValueError`` naming the first bad entry."""
    max_pages = block_table.shape[1]
    n = (cache_seqlens.long().clamp_min(0) + n_new + block_size - 1) // block_size  # pages used
    if bool((n > max_pages).any()):
        b = int((n > max_pages).nonzero()[0, 0])
        raise ValueError(f"block_table has {max_pages} pages a row, but row {b} needs {int(n[b])} "
                         f"for {int(cache_seqlens[b]) + n_new} tokens")
    used = torch.arange(max_pages, device=block_table.device)[None, :] < n[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {i}] = {int(block_table[b, i])} is not a page of the "
                         f"pool [0, {num_pages}) (row {b} holds {int(n[b])} pages)")
    pages, counts = block_table[used].unique(return_counts=True)
    if bool((counts > 1).any()):
        page = int(pages[counts > 1][0])
        rows = sorted({int(b) for b in ((block_table == page) & used).nonzero()[:, 0]})
        raise ValueError(f"block_table: page {page} is used by rows {rows} (or twice by one): "
                         f"the pages of live sequences must differ")


def check_batch_idx(cache_batch_idx: torch.Tensor, num_slots: int) -> None:
    """Check the values of ``cache_batch_idx`` (host sync, as ``check_block_table``): distinct
    slots in ``[0, num_slots)``. ``ValueError`` naming the first bad entry."""
    bad = (cache_batch_idx < 0) | (cache_batch_idx >= num_slots)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"cache_batch_idx[{b}] = {int(cache_batch_idx[b])} is not a slot of the "
                         f"cache [0, {num_slots})")
    if cache_batch_idx.unique().numel() != cache_batch_idx.numel():
        raise ValueError(f"cache_batch_idx must hold distinct slots, got "
                         f"{cache_batch_idx.tolist()}")


def check_bounds(sums: torch.Tensor, mins: torch.Tensor | None,
                 maxs: torch.Tensor | None) -> None:
    """The optional key bounds: both or neither; each a contiguous tensor of ``sums``' shape,
    dtype and device (metadata only)."""
    if (mins is None) != (maxs is None):
        raise ValueError("mins and maxs (the pyramid's key bounds) must be given together")
    for name, x in (("mins", mins), ("maxs", maxs)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != sums.shape or x.dtype != sums.dtype or x.device != sums.device \
                or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {sums.dtype} {list(sums.shape)} tensor "
                             f"on {sums.device} (the layout of sums), got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")


def check_seqlens(cache_seqlens: torch.Tensor | int, max_seqlen: int, n_new: int = 0,
                  sync: bool = False) -> None:
    """Check caller-owned lengths (``cache_seqlens`` given to ``pisa_attn_with_kvcache``), as
    they stand before an append of ``n_new`` keys: each must lie in ``[0, max_seqlen - n_new]``.

    An int, a CPU tensor, or any tensor with ``sync=True`` (chunked prefill, which reads the
    lengths on the host anyway): ``ValueError`` naming the first bad length. A CUDA tensor in a
    decode step is not read here, so the step adds no host sync and no launch and stays
    capturable in a CUDA graph: the decode kernels give NaN rows for a length outside
    ``[0, max_seqlen]`` (an append past the end is caught by the write's device-side bounds
    assert). An async device assert here cost too much per step (``docs/design.md``, "Inference
    cache"), so the check is the kernels'.
    """
    hi = max_seqlen - n_new
    what = f"in [0, max_seqlen - seqlen_new] = [0, {max_seqlen} - {n_new}]"
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= hi:
            raise ValueError(f"cache_seqlens must be {what}, got {cache_seqlens}")
        return
    if cache_seqlens.device.type != "cpu" and not sync:
        return
    ok = (cache_seqlens >= 0) & (cache_seqlens <= hi)
    if not bool(ok.all()):
        b = int((~ok).nonzero()[0, 0])
        raise ValueError(f"cache_seqlens must be {what}, got cache_seqlens[{b}] = "
                         f"{int(cache_seqlens[b])}")


def check_new_kv(k_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 batch_size: int) -> None:
    """Validate keys and values to append for ``batch_size`` sequences to a cache whose
    ``k_cache`` (either form) has ``HKV, D`` in its last two dims (metadata only)."""
    B, (H, D) = batch_size, k_cache.shape[2:]
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[0] != B or tuple(x.shape[2:]) != (H, D):
            raise ValueError(f"{name} must have shape [B={B}, L, HKV={H}, D={D}], got "
                             f"{tuple(x.shape)}")
        if x.dtype != k_cache.dtype or x.device != k_cache.device:
            raise TypeError(f"{name} must be {k_cache.dtype} on {k_cache.device} like the cache, "
                            f"got {x.dtype} on {x.device}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new shape {tuple(v_new.shape)} differs from k_new shape "
                         f"{tuple(k_new.shape)}")


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, sums: torch.Tensor,
              k_new: torch.Tensor, v_new: torch.Tensor, cache_seqlens: torch.Tensor,
              block_size: int, branching: int, mins: torch.Tensor | None = None,
              maxs: torch.Tensor | None = None, *, block_table: torch.Tensor | None = None,
              cache_batch_idx: torch.Tensor | None = None) -> None:
    """``write_kv`` after checking the cache (``check_cache``) and the new rows."""
    check_cache(k_cache, v_cache, sums, cache_seqlens, block_size, branching, mins, maxs,
                block_table=block_table, cache_batch_idx=cache_batch_idx)
    check_new_kv(k_cache, k_new, v_new, cache_seqlens.shape[0])
    write_kv(k_cache, v_cache, sums, k_new, v_new, cache_seqlens, block_size, branching, mins,
             maxs, block_table=block_table, cache_batch_idx=cache_batch_idx)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, sums: torch.Tensor,
             k_new: torch.Tensor, v_new: torch.Tensor, cache_seqlens: torch.Tensor,
             block_size: int, branching: int, mins: torch.Tensor | None = None,
             maxs: torch.Tensor | None = None, *, block_table: torch.Tensor | None = None,
             cache_batch_idx: torch.Tensor | None = None) -> None:
    """Write ``k_new, v_new [B, L, HKV, D]`` at positions ``[seqlens_b, seqlens_b + L)`` of each
    sequence and add the new keys into their leaf's and every ancestor's sum, in place (inputs
    checked by the caller). With the key bounds ``mins, maxs`` (the cache's, or ``None``), the
    same nodes' bounds take the elementwise min / max with the new keys: O(log N) per token too.
    Paged (``block_table``): position ``p`` of row ``b`` goes to page ``block_table[b, p // C]``,
    row ``p % C``; ``cache_batch_idx``: row ``b`` updates slot ``cache_batch_idx[b]``'s sums
    (and, contiguous, its K/V rows).

    Does not advance ``cache_seqlens`` (the caller does). All indices are computed on the device
    from ``cache_seqlens``: no host sync and no branching on tensor values, so a decode step that
    appends can be captured in a CUDA graph. On CUDA a few new tokens (a decode step, a short
    chunk) take one fused Triton launch (``kvcache_triton.append_triton``), a long run the torch
    folds below. On CPU it also checks that no sequence overflows ``T_max``, that every page
    written is in the pool and every slot in the cache; on CUDA those checks would cost a host
    sync: the fused append drops such a token (the sequence's next decode step gives NaN rows),
    the torch ops leave it to their device-side bounds asserts (an unallocated page is sent out
    of range, never to the pool's last page).

    Under ``torch.compile`` it is the custom op ``torch.ops.pisa.write_kv`` (mutating the cache's
    tensors): the compiler traces none of its Python and no value is read, not even on CPU.
    """
    write = _write_kv_op if use_op(k_new) else _write_kv  # the op: opaque to the compiler
    write(k_cache, v_cache, sums, k_new, v_new, cache_seqlens, block_size, branching, mins, maxs,
          block_table, cache_batch_idx)


def _write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, sums: torch.Tensor,
              k_new: torch.Tensor, v_new: torch.Tensor, cache_seqlens: torch.Tensor,
              block_size: int, branching: int, mins: Optional[torch.Tensor],
              maxs: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
              cache_batch_idx: Optional[torch.Tensor]) -> None:
    """``write_kv``'s work (its arguments by position; the body of ``pisa::write_kv``)."""
    B, L = k_new.shape[:2]
    S, N, H, D = sums.shape
    C, dev = block_size, k_cache.device
    T = k_cache.shape[1] if block_table is None else block_table.shape[1] * C
    offsets = level_offsets(T, C, branching)
    if L == 0:
        return
    n_levels = len(offsets) - 1
    one_pass = n_levels * B * L * H * D <= _ONE_PASS_ELEMS
    if one_pass and _fused(k_new, v_new, sums):  # a decode step's few keys: one launch
        _append_triton()(k_cache, v_cache, sums, k_new, v_new, cache_seqlens, C, branching,
                         n_levels, mins, maxs, block_table, cache_batch_idx)
        return
    pos = cache_seqlens.long()[:, None]  # [B, L]
    if L > 1:
        pos = pos + torch.arange(L, device=dev)
    slot = torch.arange(B, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
    if dev.type == "cpu":
        bad = (cache_seqlens < 0) | (cache_seqlens > T - L)
        if bool(bad.any()):
            raise ValueError(f"cache_seqlens {cache_seqlens.tolist()} + {L} new tokens exceed "
                             f"the cache's max_seqlen {T} (or are negative)")
        if bool(((slot < 0) | (slot >= S)).any()):
            raise ValueError(f"cache_batch_idx {slot.tolist()} holds slots outside [0, {S})")
    slot = slot[:, None].expand(B, L)
    if block_table is None:
        k_cache[slot, pos] = k_new
        v_cache[slot, pos] = v_new
    else:
        n_pages = k_cache.shape[0]
        page = block_table.long().gather(1, pos // C)
        ok = (page >= 0) & (page < n_pages)
        if dev.type == "cpu" and not bool(ok.all()):
            b, j = (int(x) for x in (~ok).nonzero()[0])
            raise ValueError(f"block_table[{b}, {int(pos[b, j]) // C}] = {int(page[b, j])} is "
                             f"not a page of the pool [0, {n_pages}) (position {int(pos[b, j])})")
        page = torch.where(ok, page, n_pages)  # out of range: the write's device-side assert
        k_cache[page, pos % C] = k_new
        v_cache[page, pos % C] = v_new
    flat = sums.view(S * N, H, D)
    base = slot * N
    bounds = [] if mins is None else [(mins.view(S * N, H, D), "amin"),
                                      (maxs.view(S * N, H, D), "amax")]
    tables = _level_tables(offsets, C, branching, dev) if one_pass else None
    if tables is None:
        # in pieces: each folds into ~3 padded copies of itself (a 1M-token prompt at once would
        # take gigabytes); the pieces' partials add up in the cache like one run's
        step = max(1, _RUN_ELEMS // (B * H * D))
        for i in range(0, L, step):
            _add_runs(flat, bounds, k_new[:, i:i + step].to(sums.dtype), pos[:, 0] + i,
                      base[:, 0], offsets, C, branching)
        return
    # every level at once: a decode step is host-bound, and a loop over the levels costs ~6
    # launches a level (index_add_, two scatter_reduce_, the rows' arithmetic). The rows of
    # different levels are disjoint and each level's keys keep their order
    start, span = tables
    rows = (base + start + pos // span).reshape(-1)  # [n_levels * B * L], level-major
    keys = k_new.reshape(B * L, H, D).to(sums.dtype).expand(n_levels, B * L, H, D)
    keys = keys.reshape(-1, H, D)
    flat.index_add_(0, rows, keys)
    for x, reduce in bounds:
        x.scatter_reduce_(0, rows[:, None, None].expand(keys.shape), keys, reduce)


_write_kv_op = torch.library.custom_op(
    "pisa::write_kv", _write_kv, mutates_args=("k_cache", "v_cache", "sums", "mins", "maxs"))


@_write_kv_op.register_fake
def _(*args) -> None:
    return None


# A run's per-node reductions (``_add_runs``; ``Tensor`` methods and ``scatter_reduce_`` modes)
# with their neutral values: the sums', then the bounds'.
_FOLDS = (("sum", 0.0), ("amin", float("inf")), ("amax", float("-inf")))


def _add_runs(flat: torch.Tensor, bounds: list, keys: torch.Tensor, first: torch.Tensor,
              base: torch.Tensor, offsets: tuple[int, ...], C: int, branching: int) -> None:
    """Add runs of new keys ``keys [B, L, H, D]`` (``sums``' dtype; row ``b`` at positions
    ``first[b] + [0, L)``) into every level of the flat sums (and bounds) at rows ``base [B]``.

    A prefill's run puts thousands of keys into each node: scattered straight into the levels
    (``index_add_``, ``scatter_reduce_``), every key of the top levels would hit the same rows, and
    the float atomics of the bounds' min / max serialise (CAS loops; the sums' adds too). Instead
    each level's share of the run is reduced densely: the run, padded to whole nodes with the
    neutral value, is viewed ``[B, nodes, C, H, D]`` and reduced over the node's keys, and each
    level folds the one below ``branching`` children at a time; only those per-node partials
    (distinct rows, O(L / C) in all) are added into the cache. No host sync; O(L) work."""
    B, L, H, D = keys.shape
    dev = keys.device
    folds = _FOLDS[:1 + 2 * bool(bounds)]
    node = first // C  # [B] the first node of the run at this level
    parts = [_pad_fold(keys, first % C, C, *fold) for fold in folds]
    for lvl in range(1, len(offsets)):
        n = parts[0].shape[1]
        size = offsets[lvl] - offsets[lvl - 1]
        # nodes past the level (past the run) hold the neutral value: any row of the level will do
        at = node[:, None] + torch.arange(n, device=dev)
        rows = (base[:, None] + offsets[lvl - 1] + at.clamp_max(size - 1)).reshape(-1)
        for x, part, (reduce, _) in zip([flat] + [x for x, _ in bounds], parts, folds):
            part = part.reshape(B * n, H, D)
            if reduce == "sum":
                x.index_add_(0, rows, part)
            else:
                x.scatter_reduce_(0, rows[:, None, None].expand(part.shape), part, reduce)
        if lvl + 1 < len(offsets):
            parts = [_pad_fold(part, node % branching, branching, *fold)
                     for part, fold in zip(parts, folds)]
            node = node // branching


def _fused(k_new: torch.Tensor, v_new: torch.Tensor, sums: torch.Tensor) -> bool:
    """Whether ``write_kv`` appends with the fused Triton kernel (``kvcache_triton``): where the
    library's ``"auto"`` backend is Triton (CUDA tensors, Triton installed), for fp32 sums (the
    bounds' atomics) and new rows with a contiguous head dim."""
    return (resolve_backend("auto", sums) == "triton" and sums.dtype == torch.float32
            and k_new.stride(-1) == 1 and v_new.stride(-1) == 1)


@functools.cache
def _append_triton():
    """``kvcache_triton.append_triton``, imported on first use (Triton may be absent); an import
    statement in every decode step's append would cost it a lookup each call."""
    from .kvcache_triton import append_triton
    return append_triton


def _pad_fold(x: torch.Tensor, shift: torch.Tensor, group: int, fold: str,
              fill: float) -> torch.Tensor:
    """``x [B, n, H, D]`` placed at ``shift[b] + [0, n)`` in rows of ``fill``, cut into groups of
    ``group`` and each group reduced by ``fold``: ``[B, m, H, D]``, ``m`` the most groups an
    ``n``-run can touch."""
    B, n, H, D = x.shape
    m = (n + group - 2) // group + 1
    at = (shift[:, None] + torch.arange(n, device=x.device))[..., None, None].expand(x.shape)
    padded = x.new_full((B, m * group, H, D), fill).scatter_(1, at, x)
    padded = padded.view(B, m, group, H, D)
    return getattr(padded, fold)(2)


# ``_add_runs`` folds at most this many new key elements at once (128 MB of fp32 a buffer).
_RUN_ELEMS = 1 << 25

# ``write_kv`` updates every level in one pass while the new keys, repeated once a level, hold at
# most this many elements (16 MB of fp32: a decode step's few keys, not a prefill's).
_ONE_PASS_ELEMS = 1 << 22
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _level_tables(offsets: tuple[int, ...], block_size: int, branching: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each level's first row and key span ``[n_levels, 1, 1]`` int64 on ``device``, made once per
    geometry and only read (a fresh host-to-device copy a step would sync). None while a CUDA
    graph is being captured and they are not made yet: the copy cannot be captured (the caller
    then loops over the levels)."""
    key = (offsets, block_size, branching, device)
    tables = _TABLES.get(key)
    if tables is not None:
        return tables
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    n = len(offsets) - 1
    start = torch.tensor(offsets[:-1], dtype=torch.long, device=device).view(n, 1, 1)
    span = torch.tensor([block_size * branching ** i for i in range(n)], dtype=torch.long,
                        device=device).view(n, 1, 1)
    if len(_TABLES) >= 256:  # geometries that come and go (tests): no unbounded growth
        _TABLES.clear()
    _TABLES[key] = (start, span)
    return start, span


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows ``[B, n, HKV, D]`` of each sequence of a page pool
    ``pool [num_pages, C, HKV, D]`` through ``block_table [B, max_pages]``: a copy (the paged
    form of ``k_cache[:, :n]``). Entries outside the pool read page 0 (rows past a sequence's
    pages may hold anything; their keys are never used)."""
    P, C = pool.shape[:2]
    pages = block_table[:, :cdiv(n, C)].long()
    pages = torch.where((pages >= 0) & (pages < P), pages, 0)
    return pool[pages].flatten(1, 2)[:, :n]


def empty_bounds(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key bounds ``(mins, maxs)`` of an empty cache, in the layout of ``sums``: ``+inf`` and
    ``-inf`` (no key yet)."""
    return torch.full_like(sums, math.inf), torch.full_like(sums, -math.inf)


def bounds_from_keys(k_cache: torch.Tensor, cache_seqlens: torch.Tensor, block_size: int,
                     branching: int,
                     chunk_elems: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor]:
    """The key bounds ``(mins, maxs) [B, N_total, HKV, D]`` (the layout of the cache's sums,
    ``compute_dtype``) of each sequence's first ``cache_seqlens[b]`` keys of ``k_cache``:
    one O(T_max) pass (leaves from the keys, in chunks of about ``chunk_elems`` key elements,
    then each level from the one below). Keys past a length are never read into a bound (they
    may hold anything, NaN included); nodes without a real key hold ``+inf`` / ``-inf``."""
    B, T, H, D = k_cache.shape
    C, g = block_size, branching
    offsets = level_offsets(T, C, g)
    dt, dev = compute_dtype(k_cache), k_cache.device
    mins = torch.empty(B, offsets[-1], H, D, dtype=dt, device=dev)
    maxs = torch.empty_like(mins)
    lens = cache_seqlens.to(device=dev, dtype=torch.long)[:, None]
    n_leaves = offsets[1]
    step = max(1, chunk_elems // max(B * C * H * D, 1))  # leaves a chunk
    for s in range(0, n_leaves, step):
        e = min(n_leaves, s + step)
        x = k_cache[:, s * C:min(e * C, T)].to(dt)
        x = F.pad(x, (0, 0, 0, 0, 0, (e - s) * C - x.shape[1])).view(B, e - s, C, H, D)
        real = (torch.arange(s * C, e * C, device=dev)[None, :] < lens).view(B, e - s, C, 1, 1)
        mins[:, s:e] = torch.where(real, x, math.inf).amin(2)
        maxs[:, s:e] = torch.where(real, x, -math.inf).amax(2)
    for lvl in range(2, len(offsets)):
        lo, mid, hi = offsets[lvl - 2], offsets[lvl - 1], offsets[lvl]
        for x, fill, reduce in ((mins, math.inf, "amin"), (maxs, -math.inf, "amax")):
            child = F.pad(x[:, lo:mid], (0, 0, 0, 0, 0, (hi - mid) * g - (mid - lo)), value=fill)
            x[:, mid:hi] = getattr(child.view(B, hi - mid, g, H, D), reduce)(2)
    return mins, maxs


def _leaves_of(n_total: int, branching: int) -> int:
    """The leaf count whose pyramid has ``n_total`` nodes (the total grows strictly with it)."""
    lo, hi = 1, max(n_total, 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(level_sizes(mid, branching)) < n_total:
            lo = mid + 1
        else:
            hi = mid
    if sum(level_sizes(lo, branching)) != n_total:
        raise ValueError(f"sums has {n_total} pyramid rows, which no pyramid of branching "
                         f"{branching} has")
    return lo


def node_counts(n_tokens: int, offsets: tuple[int, ...], block_size: int, branching: int,
                device=None) -> torch.Tensor:
    """Keys under each node ``[offsets[-1]]`` int32 when the first ``n_tokens`` keys are present."""
    counts = []
    for lvl in range(1, len(offsets)):
        span = block_size * branching ** (lvl - 1)
        start = torch.arange(offsets[lvl] - offsets[lvl - 1], device=device) * span
        counts.append((n_tokens - start).clamp(0, span))
    return torch.cat(counts).to(torch.int32)


def pyramid_from_sums(sums: torch.Tensor, seqlen: int, block_size: int, branching: int,
                      mins: torch.Tensor | None = None,
                      maxs: torch.Tensor | None = None) -> Pyramid:
    """The ``Pyramid`` (means, counts, offsets; with the cache's key bounds ``mins, maxs``, those
    too) of the first ``seqlen`` keys of a cache.

    ``sums [B, N_total, HKV, D]`` in the cache layout (geometry of the cache's ``T_max``), holding
    the first ``seqlen`` keys of every sequence of the batch. Returns the pyramid in the geometry
    of ``seqlen`` keys (``level_offsets(seqlen, C, g)``), as ``build_pyramid_torch`` builds it from
    those keys (up to summation order; the bounds exactly): the training selection kernels take
    it as ``pyramid=``.
    """
    check_geometry(block_size, branching)
    if not isinstance(sums, torch.Tensor) or sums.dim() != 4 or not sums.is_floating_point():
        raise ValueError("sums must be a floating-point [B, N_total, HKV, D] tensor")
    capacity = _leaves_of(sums.shape[1], branching) * block_size
    if not isinstance(seqlen, int) or not 1 <= seqlen <= capacity:
        raise ValueError(f"seqlen must be an int in [1, {capacity}] (the cache's capacity), got "
                         f"{seqlen!r}")
    full = level_offsets(capacity, block_size, branching)
    offsets = level_offsets(seqlen, block_size, branching)
    rows = torch.cat([torch.arange(full[i], full[i] + offsets[i + 1] - offsets[i],
                                   device=sums.device) for i in range(len(offsets) - 1)])
    counts = node_counts(seqlen, offsets, block_size, branching, sums.device)
    means = sums.index_select(1, rows) / counts[None, :, None, None].to(sums.dtype)
    if mins is None:
        return Pyramid(means, counts, offsets)
    if mins.shape != sums.shape or maxs is None or maxs.shape != sums.shape:
        raise ValueError(f"mins and maxs must both have sums' shape {tuple(sums.shape)}")
    return Pyramid(means, counts, offsets, mins.index_select(1, rows), maxs.index_select(1, rows))
