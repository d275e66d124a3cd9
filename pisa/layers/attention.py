"""``PisaAttention``: a drop-in causal self-attention layer (projections, RoPE, GQA, PISA)."""
from __future__ import annotations

import torch
from torch import nn

from ..api import pisa_attn
from ..distributed import LAYOUTS, pisa_attn_cp, shard_layout
from ..ops.attn import dense_causal_attn
from ..ops.utils.config import (KNOBS, SelectConfig, check_knobs, check_nonnegative_int,
                                check_positive_int)

ATTN_MODES = ("pisa", "dense")
# The ``pisa_attn`` keyword arguments a layer forwards (``return_lse`` and ``block_idx`` depend on
# the call, not the layer).
PISA_KWARGS = KNOBS + ("deterministic", "dense_below", "backend")


def rotary_tables(seqlen: int, head_dim: int, theta: float, device, offset: int = 0,
                  positions: torch.Tensor | None = None):
    """cos/sin ``[seqlen, head_dim // 2]`` for positions ``offset .. offset + seqlen - 1``, or for
    the given ``positions [seqlen]`` (a context-parallel shard's global positions)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)
    if positions is None:
        positions = torch.arange(offset, offset + seqlen, device=device)
    ang = torch.outer(positions.to(device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [B, T, H, D]`` with tables ``[T, D/2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _check_pisa_kwargs(pisa_kwargs: dict) -> None:
    """The layer's ``pisa_attn`` knobs, checked at construction as ``pisa_attn`` would check
    them at the first long input."""
    if "return_lse" in pisa_kwargs:
        raise ValueError("return_lse is not a PisaAttention option: the layer returns hidden "
                         "states [B, T, hidden_size]; for the log-normaliser call "
                         "pisa_attn(*layer.qkv(x), return_lse=True)")
    unknown = sorted(set(pisa_kwargs) - set(PISA_KWARGS))
    if unknown:
        raise TypeError(f"PisaAttention got unexpected keyword arguments {unknown}; the pisa_attn "
                        f"options it takes are {PISA_KWARGS}")
    deterministic = pisa_kwargs.get("deterministic", False)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    check_nonnegative_int("dense_below", pisa_kwargs.get("dense_below", 0))
    knobs = {name: value for name, value in pisa_kwargs.items()
             if name not in ("deterministic", "dense_below")}
    check_knobs(**{"backend": "auto", **knobs})  # pisa_attn's default backend


class PisaAttention(nn.Module):
    """Causal multi-head self-attention with GQA and RoPE whose core is ``pisa_attn``.

    Args:
        hidden_size: model width.
        num_heads: query heads ``HQ``.
        num_kv_heads: key/value heads ``HKV`` (default ``num_heads``); must divide ``num_heads``.
        head_dim: default ``hidden_size // num_heads``.
        rope_theta: RoPE base (default 10000). Keys are pooled after RoPE, as attention sees them.
        attn: ``"pisa"`` (default) or ``"dense"`` (SDPA, the quality baseline with the same
            weights).
        cp_group: a ``torch.distributed`` process group to shard the sequence over (context
            parallelism, ``pisa.distributed``), or None (default). With one, ``x`` is this rank's
            shard ``[B, T_r, hidden_size]`` laid out by ``cp_layout`` (``pisa.distributed.shard``
            cuts it), RoPE takes the tokens' global positions and the core is ``pisa_attn_cp``
            (always sparse: no SDPA path; ``attn="dense"`` is refused).
        cp_layout: ``"zigzag"`` (default) or ``"contiguous"``, the shards' layout.
        **pisa_kwargs: forwarded to ``pisa_attn`` (block_size, topk, branching, beam,
            beam_leaf, beam_ref_len, scorer, selector, forced_in_budget, scale, query_tile,
            tile_reduce, deterministic, dense_below, backend), checked here at
            construction (``pisa.ops.utils.config.check_knobs``; with ``backend="auto"`` the
            block size is bounded by the widest range, the torch one). ``scale`` (default
            ``head_dim ** -0.5``) is the softmax scale on every path, SDPA included.
            ``return_lse`` is refused: the layer returns hidden states (call
            ``pisa_attn(*layer.qkv(x), return_lse=True)`` for the log-normaliser).

    While ``T <= topk * block_size`` every causal block fits in the budget, so PISA attends all of
    them: the layer computes that exact result with SDPA instead of selecting and gathering
    (without ``cp_group``).

    Input ``x [B, T, hidden_size]`` -> output of the same shape.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float = 10000.0, bias: bool = False,
                 attn: str = "pisa", cp_group=None, cp_layout: str = "zigzag",
                 **pisa_kwargs):
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if attn not in ATTN_MODES:
            raise ValueError(f"attn must be one of {ATTN_MODES}, got {attn!r}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if attn == "pisa" and self.head_dim > 256:
            raise ValueError(f"head_dim must be <= 256 for attn='pisa', got {self.head_dim}")
        _check_pisa_kwargs(pisa_kwargs)
        if cp_layout not in LAYOUTS:
            raise ValueError(f"cp_layout must be one of {LAYOUTS}, got {cp_layout!r}")
        if cp_group is not None and attn != "pisa":
            raise ValueError("cp_group needs attn='pisa' (context parallelism runs pisa_attn_cp)")
        self.cp_group, self.cp_layout = cp_group, cp_layout
        pisa_kwargs = dict(pisa_kwargs)
        dense_below = pisa_kwargs.pop("dense_below", 0)
        self.rope_theta, self.attn, self.pisa_kwargs = rope_theta, attn, pisa_kwargs
        scale = pisa_kwargs.get("scale")
        self.scale = None if scale is None else float(scale)  # SDPA's None is head_dim ** -0.5
        # Up to K * C keys the selection takes every block (PISA is dense attention there).
        self.dense_up_to = max(dense_below, pisa_kwargs.get("topk", SelectConfig.topk)
                               * pisa_kwargs.get("block_size", SelectConfig.block_size))
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, rotated ``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` of ``x``; RoPE at
        ``positions [T]`` (default ``0 .. T - 1``)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device,
                                 positions=positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.cp_group is not None:
            layout = shard_layout(T, group=self.cp_group, layout=self.cp_layout,
                                  block_size=self.pisa_kwargs.get("block_size",
                                                                  SelectConfig.block_size),
                                  device=x.device)
            q, k, v = self.qkv(x, layout.positions(x.device))
            o = pisa_attn_cp(q, k, v, group=self.cp_group, layout=layout, **self.pisa_kwargs)
            return self.o_proj(o.reshape(B, T, -1))
        q, k, v = self.qkv(x)
        if self.attn == "dense" or T <= self.dense_up_to:
            o = dense_causal_attn(q, k, v, self.scale)
        else:
            o = pisa_attn(q, k, v, **self.pisa_kwargs)
        return self.o_proj(o.reshape(B, T, -1))
