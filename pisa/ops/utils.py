"""Geometry, configuration and input checks shared by every implementation of every op.

Everything here works on plain Python values or plain tensors so that the naive oracle, the
vectorised ``torch`` backend and the Triton launchers agree on one definition of the pyramid, the
forced blocks and the selection budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORERS = ("lse", "mean", "meanvar")
SELECTORS = ("pyramid", "flat_lse", "flat_mean", "auto")
BACKENDS = ("auto", "torch", "triton", "naive")
# Forced leaves per query: the sink (first block), the previous block and the current block.
MAX_FORCED = 3
# Below this key length `selector="auto"` uses the flat exact-LSE scan; from it up, the pyramid.
# Measured on the H200 (bf16, HQ=64, HKV=4, D=128, K=W=16): with the `csc` selection kernel the
# pyramid takes 11.3 ms at 32K (benchmarks/results/select_variants_h200.json) against 34.2 ms for
# flat_lse (levers_h200.json, an earlier run); 16K was not re-measured.
AUTO_CROSSOVER_T = 32768


@dataclass(frozen=True)
class SelectConfig:
    """Resolved selection knobs (see ``pisa.pisa_select`` for their meaning)."""

    block_size: int = 64
    topk: int = 16
    branching: int = 2
    beam: int = 16
    scorer: str = "lse"
    selector: str = "pyramid"
    forced_in_budget: bool = True
    scale: float = 0.125

    @property
    def slots(self) -> int:
        """Width of the ``block_idx`` output: the budget, plus room for forced blocks on top."""
        return self.topk if self.forced_in_budget else self.topk + MAX_FORCED

    def free_budget(self, n_forced: int) -> int:
        """How many non-forced blocks a query may take."""
        return self.topk - n_forced if self.forced_in_budget else self.topk


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the torch backends: fp64 for fp64 inputs (the oracle tests), else
    fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def level_sizes(n_leaves: int, branching: int) -> list[int]:
    """Node counts per pyramid level, leaves first, ending at a single root."""
    sizes = [max(n_leaves, 1)]
    while sizes[-1] > 1:
        sizes.append(cdiv(sizes[-1], branching))
    return sizes


def forced_leaves(t_abs: int, block_size: int) -> list[int]:
    """Forced leaf blocks of the query at absolute position ``t_abs``: sink, previous, current."""
    cur = t_abs // block_size
    return sorted({0, max(cur - 1, 0), cur})


def check_geometry(block_size: int, branching: int) -> None:
    """Check the pyramid geometry (leaf block size ``C``, branching factor ``g``)."""
    if not isinstance(block_size, int) or block_size < 4 or block_size > 256 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [4, 256], got {block_size!r}")
    if not isinstance(branching, int) or branching < 2:
        raise ValueError(f"branching must be an int >= 2, got {branching!r}")


def resolve_config(q: torch.Tensor, k: torch.Tensor, *, block_size: int, topk: int,
                   branching: int, beam: int | None, scorer: str, selector: str,
                   forced_in_budget: bool, scale: float | None) -> SelectConfig:
    """Check the selection knobs and fill in defaults; raise ``ValueError`` naming the bad one."""
    check_geometry(block_size, branching)
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")
    min_topk = MAX_FORCED if forced_in_budget else 1
    if not isinstance(topk, int) or topk < min_topk:
        raise ValueError(
            f"topk must be an int >= {min_topk} (the {MAX_FORCED} forced blocks count inside the "
            f"budget when forced_in_budget=True), got {topk!r}")
    if beam is None:
        beam = topk
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be a positive int or None, got {beam!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if selector == "auto":
        selector = "flat_lse" if k.shape[1] < AUTO_CROSSOVER_T else "pyramid"
    return SelectConfig(block_size, topk, branching, beam, scorer, selector,
                        bool(forced_in_budget), float(scale))


def check_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """Validate the FlashAttention layout ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, HKV, D]``."""
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape [B, T, H, D] (4 dims), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype {x.dtype} differs from q.dtype {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dim, "
                             f"got strides {x.stride()}")
    B, Tq, HQ, D = q.shape
    _, Tk, HKV, Dk = k.shape
    if k.shape[0] != B:
        raise ValueError(f"k batch {k.shape[0]} differs from q batch {B}")
    if Dk != D:
        raise ValueError(f"k head dim {Dk} differs from q head dim {D}")
    if Tq > Tk:
        raise ValueError(f"q has {Tq} tokens but k only {Tk}: queries are the tail of the keys "
                         "(bottom-right causal alignment), so Tq <= Tk is required")
    if HKV < 1 or HQ % HKV:
        raise ValueError(f"q heads ({HQ}) must be a multiple of k heads ({HKV}) for GQA")
    if D < 1 or D > 256:
        raise ValueError(f"head dim must be in [1, 256], got {D}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")


def check_block_idx(block_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """Validate user-given block indices ``[B, Tq, HKV, S]`` int32."""
    if not isinstance(block_idx, torch.Tensor):
        raise TypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    if block_idx.dtype != torch.int32:
        raise TypeError(f"block_idx must be int32, got {block_idx.dtype}")
    want = (q.shape[0], q.shape[1], k.shape[2])
    if block_idx.dim() != 4 or tuple(block_idx.shape[:3]) != want:
        raise ValueError(f"block_idx must have shape [B, Tq, HKV, S] = [{want[0]}, {want[1]}, "
                         f"{want[2]}, S], got {tuple(block_idx.shape)}")
    if block_idx.device != q.device:
        raise ValueError(f"block_idx is on {block_idx.device} but q is on {q.device}")


@dataclass(frozen=True)
class PairGroups:
    """(query, block) pairs regrouped by block into fixed-size groups.

    Used wherever many queries each read a few blocks of keys (the leaf stage of the selection, the
    torch attention): grouping the pairs by block lets each group of up to ``size`` queries share
    one read of the block, so the bytes moved per pair drop from ``C*D`` to about ``G*D``.
    """

    order: torch.Tensor   # [P] pair ids sorted by block
    group: torch.Tensor   # [P] group of each sorted pair
    slot: torch.Tensor    # [P] its row inside the group
    block: torch.Tensor   # [n_groups] block each group reads
    size: int

    @property
    def n_groups(self) -> int:
        return self.block.shape[0]

    def layout(self, per_pair: torch.Tensor, empty: int) -> torch.Tensor:
        """``per_pair [P]`` values laid out as ``[n_groups * size]`` (``empty`` in unused slots)."""
        out = torch.full((self.n_groups * self.size,), empty, dtype=per_pair.dtype,
                         device=per_pair.device)
        out[self.group * self.size + self.slot] = per_pair[self.order]
        return out


def group_pairs(pair_block: torch.Tensor, n_blocks: int, size: int = 32) -> PairGroups:
    """Group pairs (``pair_block [P]`` = the block each pair reads, < ``n_blocks``) by block."""
    block, order = torch.sort(pair_block, stable=True)
    per_block = torch.bincount(block, minlength=n_blocks)
    groups_per_block = (per_block + size - 1) // size
    first_group = torch.cumsum(groups_per_block, 0) - groups_per_block
    first_pair = torch.cumsum(per_block, 0) - per_block
    rank = torch.arange(block.numel(), device=block.device) - first_pair[block]
    group_block = torch.repeat_interleave(torch.arange(n_blocks, device=block.device),
                                          groups_per_block)
    return PairGroups(order, first_group[block] + rank // size, rank % size, group_block, size)
