"""``PisaAttention``: a drop-in causal self-attention layer (projections, RoPE, GQA, PISA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..api import pisa_attn
from ..ops.utils.config import SelectConfig

ATTN_MODES = ("pisa", "dense")


def rotary_tables(seqlen: int, head_dim: int, theta: float, device, offset: int = 0):
    """cos/sin ``[seqlen, head_dim // 2]`` for positions ``offset .. offset + seqlen - 1``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)
    ang = torch.outer(torch.arange(offset, offset + seqlen, device=device,
                                   dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [B, T, H, D]`` with tables ``[T, D/2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


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
        **pisa_kwargs: forwarded to ``pisa_attn`` (block_size, topk, branching, beam, scorer,
            selector, forced_in_budget, backend).

    While ``T <= topk * block_size`` every causal block fits in the budget, so PISA attends all of
    them: the layer computes that exact result with SDPA instead of selecting and gathering.

    Input ``x [B, T, hidden_size]`` -> output of the same shape.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float = 10000.0, bias: bool = False,
                 attn: str = "pisa", **pisa_kwargs):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if attn not in ATTN_MODES:
            raise ValueError(f"attn must be one of {ATTN_MODES}, got {attn!r}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self.rope_theta, self.attn, self.pisa_kwargs = rope_theta, attn, pisa_kwargs
        self.dense_up_to = (pisa_kwargs.get("topk", SelectConfig.topk)
                            * pisa_kwargs.get("block_size", SelectConfig.block_size))
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, rotated ``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` of ``x``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if self.attn == "dense" or T <= self.dense_up_to:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=self.num_heads != self.num_kv_heads).transpose(1, 2)
        else:
            o = pisa_attn(q, k, v, **self.pisa_kwargs)
        return self.o_proj(o.reshape(B, T, -1))
