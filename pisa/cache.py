"""``PisaCache``: one layer's KV cache with its incrementally maintained key pyramid.

Contiguous form (``pisa.ops.decode.kvcache`` describes the layout):
``k_cache, v_cache [B, T_max, HKV, D]`` preallocated, ``sums [B, N_total, HKV, D]`` the pyramid's
key sums, ``cache_seqlens [B]`` int32, and for ``scorer="bound"`` (only when asked for) the
per-node key ``mins, maxs [B, N_total, HKV, D]``. The paged form servers use is described in
``docs/design.md`` ("Inference cache").
"""
from __future__ import annotations

import torch

from .ops.decode.kvcache import (bounds_from_keys, check_cache, check_new_kv, empty_bounds,
                                 pyramid_from_sums, write_kv)
from .ops.pyramid import Pyramid
from .ops.utils.config import SelectConfig, check_geometry
from .ops.utils.geometry import compute_dtype, level_offsets


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

    def __init__(self, batch_size: int, max_seqlen: int, num_kv_heads: int, head_dim: int, *,
                 block_size: int = SelectConfig.block_size,
                 branching: int = SelectConfig.branching, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, bounds: bool = False):
        for name, x in (("batch_size", batch_size), ("max_seqlen", max_seqlen),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(x, int) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        check_geometry(block_size, branching)
        if not isinstance(bounds, bool):
            raise TypeError(f"bounds must be a bool, got {bounds!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.block_size, self.branching = block_size, branching
        self.offsets = level_offsets(max_seqlen, block_size, branching)
        shape = (batch_size, max_seqlen, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.sums = torch.zeros(batch_size, self.offsets[-1], num_kv_heads, head_dim,
                                dtype=compute_dtype(self.k_cache), device=device)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
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
        return self.k_cache.shape[0]

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
        self.mins, self.maxs = bounds_from_keys(self.k_cache, lens, self.block_size,
                                                self.branching)

    def check(self) -> None:
        """Validate the tensors' shapes, dtypes and devices (after they were swapped by hand)."""
        check_cache(self.k_cache, self.v_cache, self.sums, self.cache_seqlens, self.block_size,
                    self.branching, self.mins, self.maxs)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Append ``k_new, v_new [B, L, HKV, D]`` to every sequence and advance
        ``cache_seqlens`` by ``L``, in place (O(L log N), the key bounds too when kept; no host
        sync on CUDA). The cache's own tensors are trusted (``check`` validates them after they
        were swapped by hand)."""
        check_new_kv(self.k_cache, k_new, v_new)
        write_kv(self.k_cache, self.v_cache, self.sums, k_new, v_new, self.cache_seqlens,
                 self.block_size, self.branching, self.mins, self.maxs)
        self.cache_seqlens.add_(k_new.shape[1])

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
