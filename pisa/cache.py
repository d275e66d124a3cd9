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

import torch

from .ops.decode.kvcache import (bounds_from_keys, check_block_table, check_cache, check_new_kv,
                                 empty_bounds, gather_pages, pyramid_from_sums, write_kv)
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
               cache_batch_idx: torch.Tensor | None = None) -> None:
        """Append ``k_new, v_new [B, L, HKV, D]`` to every sequence (or to the slots
        ``cache_batch_idx [B]`` int32, distinct) and advance their ``cache_seqlens`` by ``L``,
        in place (O(L log N), the key bounds too when kept; no host sync on CUDA). A paged cache
        must hold the pages (``PagedPisaCache.reserve``). The cache's own tensors are trusted
        (``check`` validates them after they were swapped by hand)."""
        table, lens = self.block_table, self.cache_seqlens
        if cache_batch_idx is not None:
            if not isinstance(cache_batch_idx, torch.Tensor):
                raise TypeError(f"cache_batch_idx must be a torch.Tensor, got "
                                f"{type(cache_batch_idx).__name__}")
            lens = lens[cache_batch_idx]
            table = None if table is None else table[cache_batch_idx]
            check_cache(self.k_cache, self.v_cache, self.sums, lens, self.block_size,
                        self.branching, self.mins, self.maxs, block_table=table,
                        cache_batch_idx=cache_batch_idx)
        check_new_kv(self.k_cache, k_new, v_new, lens.shape[0])
        write_kv(self.k_cache, self.v_cache, self.sums, k_new, v_new, lens, self.block_size,
                 self.branching, self.mins, self.maxs, block_table=table,
                 cache_batch_idx=cache_batch_idx)
        if cache_batch_idx is None:
            self.cache_seqlens.add_(k_new.shape[1])
        else:
            self.cache_seqlens.scatter_(0, cache_batch_idx.long(), lens + k_new.shape[1])

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
