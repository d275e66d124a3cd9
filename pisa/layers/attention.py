"""``PisaAttention``: a drop-in causal self-attention layer (projections, RoPE, GQA, PISA), with
optional gated training branches (a sliding window, a compressed branch over pooled blocks).

Why the window is a branch here and not a selection knob: the forced blocks (sink, previous,
current) are built in one place per backend, but not one place for all of them: the Triton walk
carries exactly three forced parents per level (``utils.walk_triton.forced_parents``, the
``PAR_SLOTS`` of ``select.triton``), ``utils.op.selection_row`` writes exactly those three, and
the decode walk kernel repeats that walk (decode must equal prefill). Forcing ``w`` recent blocks
would change each of those kernels. A window over the sparse attention kernels with a caller-made
selection (``ops.attn.window_block_idx``) needs none of them, and as its own softmax, gated (as
NSA's window branch), local attention cannot crowd the selected blocks out of one shared softmax.
"""
from __future__ import annotations

import torch
from torch import nn

from ..api import pisa_attn
from ..distributed import LAYOUTS, pisa_attn_cp, shard_layout
from ..ops.attn import dense_causal_attn, sparse_attn, window_block_idx
from ..ops.coarse import coarse_attn
from ..ops.utils.config import (KNOBS, SelectConfig, check_knobs, check_nonnegative_int,
                                check_positive_int, resolve_backend, resolve_config)

ATTN_MODES = ("pisa", "dense")
# The ``pisa_attn`` keyword arguments a layer forwards (``return_lse`` and ``block_idx`` depend on
# the call, not the layer).
PISA_KWARGS = KNOBS + ("deterministic", "dense_below", "backend")
# The gates' bias at initialisation: sigmoid(-3) = 0.047, so a new branch starts small and the
# layer starts close to the plain PISA layer (a converted dense or PISA checkpoint keeps its
# function); the gates' weights start at zero.
GATE_BIAS = -3.0


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

        window: int >= 0. Blocks of a sliding-window branch (training recipe, ``docs/training.md``):
            each query also attends exactly, in its own softmax, the last ``window`` key blocks
            up to its own (``(window - 1) * C + 1`` to ``window * C`` keys; the sparse attention
            kernels over ``pisa.ops.attn.window_block_idx``), added through a gate. Default 0:
            no branch. ``window=2`` repeats the forced previous and current blocks in their own
            softmax; larger windows add recent context that the selection need not spend
            ``topk`` on.
        compressed: bool. A compressed branch (NSA's, on PISA's leaf blocks: ``pisa.ops.coarse.
            coarse_attn``): each query attends the mean-pooled keys / values of every complete
            block before it, added through a gate. Its gradient reaches ``k`` and ``v`` through
            the pooling, so it trains the block summaries the selection ranks, and it carries a
            coarse view of the whole context that the top-K budget drops. Default False.

    While ``T <= topk * block_size`` every causal block fits in the budget, so PISA attends all of
    them: the layer computes that exact result with SDPA instead of selecting and gathering
    (without ``cp_group``).

    Branches (``window > 0`` or ``compressed``): the layer's core output ``o_sel`` (PISA, or SDPA
    with ``attn="dense"``: the branches run in both modes, so a dense warm-up trains them) becomes
    ``o = o_sel + sum_b sigmoid(gate_b(x)) * o_b`` per query head, where ``self.gate`` is one
    ``nn.Linear(hidden_size, num_heads * n_branches)`` (weights 0, bias ``GATE_BIAS`` = -3 at
    initialisation: the branches start at ~5% and the layer near the plain PISA layer). ``o_sel``
    itself is not gated (NSA gates all three branches): an ungated core keeps a converted dense
    or PISA checkpoint's function at initialisation, and ``o_proj`` can scale it. Not with
    ``cp_group`` (the branches are not context-parallel).

    Input ``x [B, T, hidden_size]`` -> output of the same shape.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float = 10000.0, bias: bool = False,
                 attn: str = "pisa", cp_group=None, cp_layout: str = "zigzag",
                 window: int = 0, compressed: bool = False, **pisa_kwargs):
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
        self.window, self.compressed = window, compressed
        self.branches = _branches(window, compressed, cp_group)
        self.gate = None
        if self.branches:
            self.gate = nn.Linear(hidden_size, num_heads * len(self.branches))
            nn.init.zeros_(self.gate.weight)
            nn.init.constant_(self.gate.bias, GATE_BIAS)

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
        if self.branches:
            o = o + self.gated_branches(x, q, k, v)
        return self.o_proj(o.reshape(B, T, -1))

    def gated_branches(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> torch.Tensor:
        """``sum_b sigmoid(gate_b(x)) * o_b`` ``[B, T, HQ, D]`` over the layer's branches
        (``self.branches``, in that order in the gate's outputs)."""
        B, T = x.shape[:2]
        gates = torch.sigmoid(self.gate(x).float()).view(B, T, self.num_heads, -1)
        outs = {"window": self.window_attn, "compressed": self.compressed_attn}
        total = 0
        for i, name in enumerate(self.branches):
            total = total + gates[..., i, None].to(q.dtype) * outs[name](q, k, v)
        return total

    def window_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The window branch ``o_win [B, T, HQ, D]``: exact causal attention of each query over
        the last ``self.window`` key blocks up to its own, by the sparse attention kernels (a
        library-made selection: no check, no host sync); differentiable in q, k, v."""
        knobs = {n: val for n, val in self.pisa_kwargs.items() if n in KNOBS}
        backend = resolve_backend(self.pisa_kwargs.get("backend", "auto"), q)
        cfg = resolve_config(q, k, backend, **knobs)
        idx = window_block_idx(q.shape[0], q.shape[1], k.shape[1], k.shape[2], self.window,
                               cfg.block_size, cfg.query_tile, q.device)
        o, _ = sparse_attn(q, k, v, idx, cfg=cfg, backend=backend,
                           deterministic=self.pisa_kwargs.get("deterministic", False))
        return o

    def compressed_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The compressed branch ``o_cmp [B, T, HQ, D]`` (``pisa.ops.coarse.coarse_attn`` over the
        layer's blocks at its scale); differentiable in q, k, v."""
        return coarse_attn(q, k, v, block_size=self.pisa_kwargs.get("block_size",
                                                                    SelectConfig.block_size),
                           scale=self.scale, backend=self.pisa_kwargs.get("backend", "auto"))


def _branches(window, compressed, cp_group) -> tuple[str, ...]:
    """The layer's gated branches, checked: ``"window"`` and / or ``"compressed"``."""
    check_nonnegative_int("window", window)
    if not isinstance(compressed, bool):
        raise TypeError(f"compressed must be a bool, got {compressed!r} "
                        f"({type(compressed).__name__})")
    branches = (("window",) if window else ()) + (("compressed",) if compressed else ())
    if branches and cp_group is not None:
        raise ValueError(f"window / compressed branches {branches} are not context-parallel: "
                         "pass cp_group=None, or window=0 and compressed=False")
    return branches
