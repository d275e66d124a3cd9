"""``PisaCache``: one layer's KV cache with its incrementally maintained key pyramid;
``PagedPisaCache``: its paged form for continuous batching.

Contiguous form (``pisa.ops.decode.kvcache`` describes both layouts):
``k_cache, v_cache [B, T_max, HKV, D]`` preallocated, ``sums [B, N_total, HKV, D]`` the pyramid's
key sums, ``cache_seqlens [B]`` int32, and for ``scorer="bound"`` (only when asked for) the
per-node key ``mins, maxs [B, N_total, HKV, D]``. Paged form: K/V in a pool of pages of ``C``
tokens ``[num_pages, C, HKV, D]`` addressed by ``block_table [slots, max_pages]``, the pyramid per
slot as above (``docs/design.md``, "Inference cache"; ``docs/integrations.md`` maps it to vLLM
and SGLang).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .ops.decode import decode_step, prefill_with_cache
from .ops.decode.kvcache import (bounds_from_keys, check_batch_idx, check_block_table,
                                 check_cache, check_new_kv, check_seqlens, empty_bounds,
                                 gather_pages, pyramid_from_sums, write_kv)
from .ops.pyramid import Pyramid
from .ops.utils.config import SelectConfig, check_geometry
from .ops.utils.geometry import cdiv, compute_dtype, level_offsets


def _check_args(block_size: int, branching: int, bounds, dtype, **sizes) -> torch.dtype:
    """The constructor arguments both cache forms share; returns the resolved dtype."""
    for name, x in sizes.items():
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    check_geometry(block_size, branching)
    if not isinstance(bounds, bool):
        raise TypeError(f"bounds must be a bool, got {bounds!r}")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class CacheRows:
    """The sequences of one call against a cache (``PisaCache.prepare`` resolves and checks them;
    the ops take them as they are).

    seqlens: (B,) int32, each sequence's length before the call's append: the cache's own
        ``cache_seqlens`` (every slot, in order), its rows of ``slots``, or the caller's lengths.
    slots: (B,) int32, sequence ``b`` is slot ``slots[b]`` of the cache; None: slot ``b``.
    block_table: (B, max_pages) int32, the pages of each sequence (a paged cache: its own table's
        rows of ``slots``, or the caller's); None for a contiguous cache.
    owned: whether the lengths are the cache's, which an append advances.
    """

    seqlens: torch.Tensor
    slots: torch.Tensor | None
    block_table: torch.Tensor | None
    owned: bool


class PisaCache:
    """KV cache of one attention layer for a batch of sequences of different lengths.

    Arguments:
        batch_size: int. Sequences held.
        max_seqlen: int. Capacity per sequence ``T_max`` (keys; preallocated).
        num_kv_heads: int. ``HKV``.
        head_dim: int. ``D``.
        block_size: int. Leaf block size ``C`` of the pyramid (and of the attention). Default 64.
        branching: int. Pyramid branching factor ``g``. Default 2.
        dtype: K/V dtype. Default ``torch.get_default_dtype()``. The sums are fp32 (fp64 for an
            fp64 cache).
        device: default the current default device.
        bounds: bool. Also keep every pyramid node's per-channel key min and max (``mins``,
            ``maxs``), which ``scorer="bound"`` ranks by. Default False: the cache allocates no
            bounds (``enable_bounds`` adds them later, from the keys held).

    Attributes (plain tensors, updated in place, so a decode step can be captured in a CUDA graph):
        k_cache, v_cache: (batch_size, max_seqlen, num_kv_heads, head_dim).
        sums: (batch_size, N_total, num_kv_heads, head_dim), the key sums of every pyramid node
            (leaves first; ``offsets`` gives each level's rows).
        cache_seqlens: (batch_size,) int32, valid tokens per sequence. Keys and values past it are
            never read; sums past it are zero.
        mins, maxs: None, or with ``bounds`` tensors in the layout and dtype of ``sums``: the
            per-channel min and max of each node's keys before ``cache_seqlens`` (``+inf`` and
            ``-inf`` for a node without any), updated with the sums on every append
            (O(log N) per token: the new key's leaf and its ancestors).

    Memory on top of K/V: the sums have ``g/(g-1)/C`` of ``k_cache``'s elements, in fp32: 6% of
    a bf16 ``k_cache``'s bytes at C = 64, g = 2; the bounds, when kept, twice that again.

    The cache keeps its own decode bookkeeping: a call against it (``pisa_attn_with_kvcache``)
    is ``prepare`` (its sequences' slots, lengths and page table, resolved and checked once),
    then ``attend`` (append, advance the lengths, attend); ``append`` is the first half alone.
    """

    block_table = None  # the contiguous form; PagedPisaCache's page table

    def __init__(self, batch_size: int, max_seqlen: int, num_kv_heads: int, head_dim: int, *,
                 block_size: int = SelectConfig.block_size,
                 branching: int = SelectConfig.branching, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, bounds: bool = False):
        dtype = _check_args(block_size, branching, bounds, dtype, batch_size=batch_size,
                            max_seqlen=max_seqlen, num_kv_heads=num_kv_heads, head_dim=head_dim)
        shape = (batch_size, max_seqlen, num_kv_heads, head_dim)
        self._allocate(shape, batch_size, max_seqlen, block_size, branching, dtype, device,
                       bounds)

    def _allocate(self, kv_shape, slots, max_seqlen, block_size, branching, dtype, device,
                  bounds) -> None:
        """K/V of ``kv_shape``; sums, lengths (and bounds) of ``slots`` pyramids of
        ``max_seqlen`` keys."""
        self.block_size, self.branching = block_size, branching
        self.offsets = level_offsets(max_seqlen, block_size, branching)
        self.k_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.sums = torch.zeros(slots, self.offsets[-1], *kv_shape[2:],
                                dtype=compute_dtype(self.k_cache), device=device)
        self.cache_seqlens = torch.zeros(slots, dtype=torch.int32, device=device)
        self.mins = self.maxs = None
        if bounds:
            self.mins, self.maxs = empty_bounds(self.sums)

    @classmethod
    def from_prefill(cls, k: torch.Tensor, v: torch.Tensor, *, max_seqlen: int | None = None,
                     seqlens: torch.Tensor | list[int] | None = None,
                     block_size: int = SelectConfig.block_size,
                     branching: int = SelectConfig.branching,
                     bounds: bool = False) -> "PisaCache":
        """A cache holding the keys and values ``k, v [B, T, HKV, D]`` of a prefill.

        ``max_seqlen`` (default ``T``) is the capacity; ``seqlens`` (``[B]`` ints, default all
        ``T``) gives each sequence's real length when the prompts are right-padded to ``T``.
        ``bounds``: also keep the key bounds (built in one pass over the real keys; padding keys
        never enter them).
        """
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError("k must be a [B, T, HKV, D] tensor")
        B, T, H, D = k.shape
        cache = cls(B, T if max_seqlen is None else max_seqlen, H, D, block_size=block_size,
                    branching=branching, dtype=k.dtype, device=k.device)
        if seqlens is not None:
            seqlens = torch.as_tensor(seqlens, device=k.device)
            if seqlens.shape != (B,) or bool(((seqlens < 0) | (seqlens > T)).any()):
                raise ValueError(f"seqlens must be [{B}] lengths in [0, {T}], got "
                                 f"{seqlens.tolist()}")
            # padding keys become zeros: they add nothing to the sums and are never read
            real = torch.arange(T, device=k.device)[None, :] < seqlens[:, None]
            k = k * real[:, :, None, None]
        cache.append(k, v)
        if seqlens is not None:
            cache.cache_seqlens.copy_(seqlens)
        if bounds:
            cache.enable_bounds()
        return cache

    @property
    def batch_size(self) -> int:
        """Sequences (slots) the cache holds: the rows of ``sums`` and ``cache_seqlens``."""
        return self.sums.shape[0]

    @property
    def max_seqlen(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def n_levels(self) -> int:
        return len(self.offsets) - 1

    @property
    def has_bounds(self) -> bool:
        """Whether the cache keeps the key bounds ``mins`` / ``maxs`` (``scorer="bound"``)."""
        return self.mins is not None

    def enable_bounds(self, cache_seqlens: torch.Tensor | None = None) -> None:
        """Build the key bounds ``mins`` / ``maxs`` from the keys held (one O(max_seqlen) pass;
        allocates them: not inside a CUDA graph capture), unless the cache keeps them already.
        From then on every append keeps them current. ``cache_seqlens``: the lengths whose keys
        are real (default ``self.cache_seqlens``; a caller who owns the lengths passes its own)."""
        if self.mins is not None:
            return
        lens = self.cache_seqlens if cache_seqlens is None else cache_seqlens
        if self.block_table is None:
            self.mins, self.maxs = bounds_from_keys(self.k_cache, lens, self.block_size,
                                                    self.branching)
            return
        mins, maxs = empty_bounds(self.sums)
        for b in range(self.batch_size):  # a slot at a time: its pages gathered, T_max keys
            keys = gather_pages(self.k_cache, self.block_table[b:b + 1], self.max_seqlen)
            mins[b:b + 1], maxs[b:b + 1] = bounds_from_keys(keys, lens[b:b + 1],
                                                            self.block_size, self.branching)
        self.mins, self.maxs = mins, maxs

    def check(self) -> None:
        """Validate the tensors' shapes, dtypes and devices (after they were swapped by hand)."""
        check_cache(self.k_cache, self.v_cache, self.sums, self.cache_seqlens, self.block_size,
                    self.branching, self.mins, self.maxs, block_table=self.block_table)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor,
               cache_batch_idx: torch.Tensor | list[int] | None = None) -> None:
        """Append ``k_new, v_new [B, L, HKV, D]`` to every sequence (or to the slots
        ``cache_batch_idx [B]`` int32, distinct) and advance their ``cache_seqlens`` by ``L``,
        in place (O(L log N), the key bounds too when kept; no host sync on CUDA). A paged cache
        must hold the pages (``PagedPisaCache.reserve``). Checked by ``prepare``; the cache's
        own tensors are trusted here (``check`` validates them after a swap by hand)."""
        self._write(self.prepare(None, k_new, v_new, cache_batch_idx=cache_batch_idx),
                    k_new, v_new)

    def prepare(self, q: torch.Tensor | None, k_new: torch.Tensor | None = None,
                v_new: torch.Tensor | None = None, *,
                cache_seqlens: torch.Tensor | int | None = None,
                block_table: torch.Tensor | None = None,
                cache_batch_idx: torch.Tensor | list[int] | None = None) -> CacheRows:
        """The sequences a call reads and writes (``pisa_attn_with_kvcache``'s arguments, which
        document them; ``q`` None: an append alone), resolved and checked: the one validation of
        a call. Metadata (shapes, dtypes, devices of ``q``, ``k_new, v_new`` and the cache) is
        always checked, without a host sync; the values of a caller's lengths, page table and
        slots only where they are read on the host anyway: on CPU and in chunked prefill
        (``seqlen_q > 1``). A CUDA decode step thus syncs nowhere and stays capturable in a CUDA
        graph (the kernels give NaN rows for a length, page or slot out of range)."""
        if block_table is not None and self.block_table is None:
            raise ValueError("block_table needs a pisa.PagedPisaCache (its page pool); a "
                             "PisaCache is contiguous")
        slots = self._slots(cache_batch_idx)
        B = self.batch_size if slots is None else slots.shape[0]
        if q is not None:
            self._check_queries(q, B)
        if (k_new is None) != (v_new is None):
            raise ValueError("k_new and v_new must be given together")
        rows = CacheRows(self._lengths(cache_seqlens, slots, B), slots,
                         self._table(block_table, slots), cache_seqlens is None)
        # an append to every slot reads only the cache's own tensors, trusted (``check``)
        if q is not None or slots is not None:
            self._check_tensors(rows)
        if k_new is not None or q is None:  # an append alone needs its keys and values
            check_new_kv(self.k_cache, k_new, v_new, B)
        n_new = 0 if k_new is None else k_new.shape[1]
        self._check_values(rows, cache_seqlens, block_table, n_new,
                           sync=q is not None and q.shape[1] > 1)  # chunked prefill syncs
        return rows

    def _check_tensors(self, rows: CacheRows) -> None:
        """``kvcache.check_cache`` of the cache's tensors with a call's lengths, table and slots
        (metadata only), once per metadata: a decode step is host-bound, and a server's steps
        repeat the same few."""
        if torch.compiler.is_compiling():  # a compiled step is checked once, when traced
            return self._check_cache(rows)
        key = (_meta(rows.seqlens), _meta(rows.block_table), _meta(rows.slots),
               id(self.k_cache), id(self.v_cache), id(self.sums), id(self.mins), id(self.maxs))
        checked = self.__dict__.setdefault("_checked", set())
        if key in checked:
            return
        self._check_cache(rows)
        if len(checked) >= 64:
            checked.clear()
        checked.add(key)

    def _check_cache(self, rows: CacheRows) -> None:
        check_cache(self.k_cache, self.v_cache, self.sums, rows.seqlens, self.block_size,
                    self.branching, self.mins, self.maxs, block_table=rows.block_table,
                    cache_batch_idx=rows.slots)

    def _check_values(self, rows: CacheRows, cache_seqlens, block_table, n_new: int,
                      sync: bool) -> None:
        """The values of a caller's lengths, slots and page table, before an append of ``n_new``
        keys: on the host on CPU or with ``sync`` (chunked prefill); a CUDA decode step leaves
        them to the kernels (an int length is checked anyway), as does a step under
        ``torch.compile`` on any device (a read value would break the graph)."""
        compiling = torch.compiler.is_compiling()
        if cache_seqlens is not None and not (compiling and isinstance(cache_seqlens,
                                                                       torch.Tensor)):
            check_seqlens(cache_seqlens, self.max_seqlen, n_new, sync=sync)
        if (sync or self.device.type == "cpu") and not compiling:
            if rows.slots is not None:
                check_batch_idx(rows.slots, self.batch_size)
            if block_table is not None:  # the cache's own pages are always in the pool
                check_block_table(block_table, rows.seqlens, self.num_pages, self.block_size,
                                  n_new)

    def _slots(self, cache_batch_idx) -> torch.Tensor | None:
        """``cache_batch_idx`` as an int32 tensor on the cache's device (a list is copied
        there)."""
        idx = cache_batch_idx
        if isinstance(idx, (list, tuple)):
            idx = torch.tensor(idx, dtype=torch.int32, device=self.device)
        if idx is not None and (not isinstance(idx, torch.Tensor) or idx.dtype != torch.int32
                                or idx.dim() != 1 or idx.device != self.device):
            raise ValueError(f"cache_batch_idx must be an int32 [B] tensor on {self.device} or a "
                             f"list of ints, got {getattr(idx, 'dtype', type(idx).__name__)} "
                             f"{tuple(getattr(idx, 'shape', ()))}")
        return idx

    def _check_queries(self, q, batch_size: int) -> None:
        """``q [batch_size, seqlen_q >= 1, HQ, D]`` in the cache's dtype and device, ``HQ`` a
        multiple of its KV heads."""
        H, D = self.num_kv_heads, self.head_dim
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 4 or q.shape[0] != batch_size or q.shape[1] < 1 or q.shape[3] != D \
                or q.shape[2] % H:
            raise ValueError(f"q must have shape [B={batch_size}, seqlen_q >= 1, nheads (a "
                             f"multiple of HKV={H}), D={D}], got {tuple(q.shape)}")
        if q.dtype != self.dtype or q.device != self.device:
            raise TypeError(f"q must be {self.dtype} on {self.device} like the cache, got "
                            f"{q.dtype} on {q.device}")

    def _lengths(self, cache_seqlens, slots, batch_size: int) -> torch.Tensor:
        """The lengths before the append: the cache's own (of ``slots``) when none are given."""
        if cache_seqlens is None:
            return self.cache_seqlens if slots is None else _rows(self.cache_seqlens, slots)
        if isinstance(cache_seqlens, int):
            return torch.full((batch_size,), cache_seqlens, dtype=torch.int32,
                              device=self.device)
        return cache_seqlens

    def _table(self, block_table, slots) -> torch.Tensor | None:
        """The page table of a call: the caller's, else the cache's own (its rows of
        ``slots``); None for a contiguous cache."""
        if block_table is not None or self.block_table is None:
            return block_table
        return self.block_table if slots is None else _rows(self.block_table, slots)

    def _write(self, rows: CacheRows, k_new: torch.Tensor, v_new: torch.Tensor) -> CacheRows:
        """Append ``k_new, v_new`` to the sequences ``rows`` (checked) and advance their lengths:
        the cache's in place when it owns them (a caller's are the caller's to advance); returns
        the rows with their lengths after the append."""
        write_kv(self.k_cache, self.v_cache, self.sums, k_new, v_new, rows.seqlens,
                 self.block_size, self.branching, self.mins, self.maxs,
                 block_table=rows.block_table, cache_batch_idx=rows.slots)
        n_new = k_new.shape[1]
        if rows.owned and rows.slots is None:  # self.cache_seqlens itself
            rows.seqlens.add_(n_new)
            return rows
        lens = rows.seqlens + n_new
        if rows.owned:
            self.cache_seqlens.scatter_(0, rows.slots.long(), lens)
        return replace(rows, seqlens=lens)

    def attend(self, q: torch.Tensor, rows: CacheRows, k_new: torch.Tensor | None = None,
               v_new: torch.Tensor | None = None, *, cfg: SelectConfig,
               backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_new, v_new`` (when given) to the sequences ``rows`` (``prepare``'s, of the
        same arguments), then attend ``q`` over each one's keys with the resolved ``cfg`` (its
        ``block_size`` and ``branching`` the cache's) on a resolved ``backend``: a decode step
        (``seqlen_q == 1``, ``pisa.ops.decode.decode_step``) or chunked prefill
        (``prefill_with_cache``; it reads the lengths on the host). ``scorer="bound"`` builds
        the key bounds first if the cache keeps none (``enable_bounds``). Returns ``o`` (q's
        dtype) and ``lse [B, HQ, seqlen_q]`` fp32."""
        if cfg.uses_bounds and self.mins is None:
            if rows.slots is not None or rows.block_table is not self.block_table:
                raise ValueError("scorer='bound' with cache_batch_idx or a caller's block_table "
                                 "needs a cache made with bounds=True")
            self.enable_bounds(rows.seqlens)
        if k_new is not None:
            rows = self._write(rows, k_new, v_new)
        tensors = (q, self.k_cache, self.v_cache, self.sums)
        if q.shape[1] == 1 and backend in ("torch", "triton"):
            return decode_step(*tensors, rows.seqlens, self.mins, self.maxs, cfg=cfg,
                               backend=backend, block_table=rows.block_table,
                               cache_batch_idx=rows.slots)
        slots = None if rows.slots is None else rows.slots.tolist()
        return prefill_with_cache(*tensors, rows.seqlens.tolist(), self.mins, self.maxs, cfg=cfg,
                                  backend=backend, block_table=rows.block_table, slots=slots)

    def reset(self, index: torch.Tensor | list[int] | int | None = None) -> None:
        """Empty all sequences, or those at ``index`` (to reuse their slots), in place."""
        if index is None:
            index = slice(None)
        self.sums[index] = 0
        if self.mins is not None:
            self.mins[index] = float("inf")
            self.maxs[index] = float("-inf")
        self.cache_seqlens[index] = 0

    def pyramid(self, index: int) -> Pyramid:
        """The key pyramid of sequence ``index`` (``pisa.ops.pyramid.Pyramid`` over its valid
        keys, with the key bounds when the cache keeps them; for inspection; syncs with the
        host)."""
        n = int(self.cache_seqlens[index])
        if n == 0:
            raise ValueError(f"sequence {index} is empty")
        rows = slice(index, index + 1)
        bounds = (None, None) if self.mins is None else (self.mins[rows], self.maxs[rows])
        return pyramid_from_sums(self.sums[rows], n, self.block_size, self.branching, *bounds)

    def __repr__(self) -> str:
        return (f"PisaCache(batch_size={self.batch_size}, max_seqlen={self.max_seqlen}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"block_size={self.block_size}, branching={self.branching}, dtype={self.dtype}, "
                f"device={self.device}, bounds={self.has_bounds})")


class PagedPisaCache(PisaCache):
    """Paged KV cache of one attention layer for continuous batching: K/V in a pool of pages of
    ``block_size`` tokens (one leaf block a page) shared by all sequences, each sequence's pages
    listed in its row of ``block_table`` (FlashAttention's ``block_table`` / vLLM's layout),
    its key pyramid in a slot of its own. Sequences join and leave a running batch without
    moving anyone's pages or pyramid: a decode step takes the live slots in any order
    (``pisa_attn_with_kvcache(..., cache_batch_idx=slots)``).

    Arguments:
        num_pages: int. Pages in the pool.
        max_batch: int. Slots: sequences held at once.
        max_seqlen: int. Capacity per sequence (rounded up to whole pages: ``max_pages``).
        num_kv_heads, head_dim, block_size, branching, dtype, device, bounds: as ``PisaCache``.

    Attributes (plain tensors, updated in place; a decode step never syncs with the host):
        k_cache, v_cache: (num_pages, block_size, num_kv_heads, head_dim), the page pool.
        block_table: (max_batch, max_pages) int32, page ``i`` of each slot's sequence (the keys
            ``[i * block_size, (i + 1) * block_size)``), ``-1`` where none is allocated.
        sums, cache_seqlens, mins, maxs: per slot, as ``PisaCache`` (geometry of
            ``max_pages * block_size`` keys).

    Page management runs on the host, before a step, as in vLLM: ``add_sequence`` takes a free
    slot (and pages for a prompt), ``reserve`` gives a slot pages for its next tokens,
    ``remove_sequence`` returns its pages and slot. These keep the host's list of each slot's
    pages and copy new entries into ``block_table`` (a host-to-device copy: not inside a CUDA
    graph capture). Pages they hand out are always distinct and in the pool, so the cache's own
    table needs no check at decode time; a caller's table (a server's own allocator) is checked
    where lengths are read on the host (``kvcache.check_block_table``: on CPU and in chunked
    prefill), and in a CUDA decode step only by the kernel (a page outside the pool among those
    it reads gives NaN rows; a page shared by two sequences is not detected there).

    Memory: the pool is ``num_pages * block_size`` tokens of K and V; per slot the sums of a
    ``max_seqlen`` pyramid (``g/(g-1)/C`` of a full sequence's K elements, fp32).
    """

    def __init__(self, num_pages: int, max_batch: int, max_seqlen: int, num_kv_heads: int,
                 head_dim: int, *, block_size: int = SelectConfig.block_size,
                 branching: int = SelectConfig.branching, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, bounds: bool = False):
        dtype = _check_args(block_size, branching, bounds, dtype, num_pages=num_pages,
                            max_batch=max_batch, max_seqlen=max_seqlen,
                            num_kv_heads=num_kv_heads, head_dim=head_dim)
        max_pages = cdiv(max_seqlen, block_size)
        self._allocate((num_pages, block_size, num_kv_heads, head_dim), max_batch,
                       max_pages * block_size, block_size, branching, dtype, device, bounds)
        self.block_table = torch.full((max_batch, max_pages), -1, dtype=torch.int32,
                                      device=device)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: page 0 first
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}  # live slot -> its pages, in order

    @classmethod
    def from_prefill(cls, k: torch.Tensor, v: torch.Tensor, *, max_seqlen: int | None = None,
                     seqlens: list[int] | None = None, num_pages: int | None = None,
                     max_batch: int | None = None, block_size: int = SelectConfig.block_size,
                     branching: int = SelectConfig.branching,
                     bounds: bool = False) -> "PagedPisaCache":
        """A paged cache holding the keys and values ``k, v [B, T, HKV, D]`` of a prefill, one
        sequence a slot (slots ``0 .. B - 1``), ``seqlens[b]`` tokens each (host ints, default
        all ``T``; right padding is never written). ``max_seqlen`` (default ``T``), ``num_pages``
        (default: the pages of ``max_batch`` full sequences) and ``max_batch`` (default ``B``)
        size the cache."""
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError("k must be a [B, T, HKV, D] tensor")
        B, T, H, D = k.shape
        seqlens = [T] * B if seqlens is None else list(seqlens)
        if len(seqlens) != B or any(not isinstance(n, int) or not 0 <= n <= T for n in seqlens):
            raise ValueError(f"seqlens must be {B} ints in [0, {T}], got {seqlens}")
        max_seqlen = T if max_seqlen is None else max_seqlen
        max_batch = B if max_batch is None else max_batch
        if num_pages is None:
            num_pages = max_batch * cdiv(max_seqlen, block_size)
        cache = cls(num_pages, max_batch, max_seqlen, H, D, block_size=block_size,
                    branching=branching, dtype=k.dtype, device=k.device, bounds=bounds)
        for b, n in enumerate(seqlens):
            slot = cache.add_sequence(n)
            idx = torch.tensor([slot], dtype=torch.int32, device=k.device)
            cache.append(k[b:b + 1, :n], v[b:b + 1, :n], idx)
        return cache

    @property
    def max_seqlen(self) -> int:
        return self.block_table.shape[1] * self.block_size

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def free_pages(self) -> int:
        """Pages not held by any sequence."""
        return len(self._free_pages)

    @property
    def live_slots(self) -> list[int]:
        """The slots holding a sequence, ascending."""
        return sorted(self._pages)

    def pages(self, slot: int) -> list[int]:
        """The pages of the sequence in ``slot``, in order (a copy of the host's list)."""
        return list(self._pages[self._live(slot)])

    def _live(self, slot) -> int:
        if not isinstance(slot, int) or slot not in self._pages:
            raise ValueError(f"slot must be a live slot {self.live_slots}, got {slot!r}")
        return slot

    def add_sequence(self, n_tokens: int = 0) -> int:
        """Take a free slot for a new sequence, empty (its pyramid reset), with pages for its
        first ``n_tokens`` tokens (``reserve``); returns the slot. ``RuntimeError`` when every
        slot is live or the pool is short of pages (then nothing is taken)."""
        if not self._free_slots:
            raise RuntimeError(f"no free slot: all max_batch={self.batch_size} hold a sequence")
        slot = self._free_slots[-1]
        self._pages[slot] = []
        try:
            self.reserve(slot, n_tokens)
        except (ValueError, RuntimeError):
            del self._pages[slot]
            raise
        self._free_slots.pop()
        self.reset(slot)
        return slot

    def reserve(self, slot: int, n_tokens: int) -> None:
        """Make sure the sequence in ``slot`` has pages for its first ``n_tokens`` tokens
        (before appending them): takes ``cdiv(n_tokens, block_size)`` minus the pages it holds
        from the free list and writes them into ``block_table``. ``ValueError`` past
        ``max_seqlen``, ``RuntimeError`` when the pool is short (nothing is taken)."""
        self._live(slot)
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
        if n_tokens > self.max_seqlen:
            raise ValueError(f"n_tokens={n_tokens} exceeds the cache's max_seqlen "
                             f"{self.max_seqlen}")
        held = self._pages[slot]
        need = cdiv(n_tokens, self.block_size) - len(held)
        if need <= 0:
            return
        if need > len(self._free_pages):
            raise RuntimeError(f"out of pages: slot {slot} needs {need} more, "
                               f"{len(self._free_pages)} of {self.num_pages} are free")
        new = [self._free_pages.pop() for _ in range(need)]
        self.block_table[slot, len(held):len(held) + need] = torch.tensor(new, dtype=torch.int32)
        held.extend(new)

    def remove_sequence(self, slot: int) -> None:
        """Free the sequence in ``slot``: its pages go back to the pool (and its table row to
        ``-1``), its pyramid and length are reset, the slot is free. Other sequences' pages,
        pyramids and slots are untouched."""
        held = self._pages.pop(self._live(slot))
        self.block_table[slot, :len(held)] = -1
        self._free_pages.extend(reversed(held))
        self._free_slots.append(slot)
        self.reset(slot)

    def check(self) -> None:
        """Validate the tensors (``PisaCache.check``) and the page table's values against the
        lengths (every live page in the pool, none shared; syncs with the host)."""
        super().check()
        check_block_table(self.block_table, self.cache_seqlens, self.num_pages, self.block_size)

    def __repr__(self) -> str:
        return (f"PagedPisaCache(num_pages={self.num_pages}, max_batch={self.batch_size}, "
                f"max_seqlen={self.max_seqlen}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, "
                f"branching={self.branching}, dtype={self.dtype}, device={self.device}, "
                f"bounds={self.has_bounds}, live={len(self._pages)}, "
                f"free_pages={self.free_pages})")


def _meta(x) -> tuple | None:
    """What ``check_cache`` reads of an index or length tensor (a non-tensor: its type)."""
    if not isinstance(x, torch.Tensor):
        return None if x is None else (type(x),)
    return x.shape, x.dtype, x.device, x.stride()


def _rows(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a cache's per-slot tensor (a gather on the device). A slot outside the
    cache reads slot 0: ``check_batch_idx`` reports it on the host, or, in a CUDA decode step,
    the kernel gives that sequence NaN rows."""
    return x[torch.where((slots >= 0) & (slots < x.shape[0]), slots, 0)]
