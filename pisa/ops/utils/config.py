"""The one home of every selection default and bound, and of the input checks.

``pisa.api`` resolves a ``SelectConfig`` once per call (``resolve_config``) and hands it to every
op by keyword (``cfg=``); the ops below take it resolved and never check or default a knob again.
The custom ops take its fields by name (``SelectConfig.op_kwargs``, ``op_schema``).
"""
from __future__ import annotations

import importlib.util
import math
import numbers
import os
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

import torch

from .geometry import cdiv, level_sizes

SCORERS = ("lse", "mean", "meanvar", "bound")
SELECTORS = ("pyramid", "flat_lse", "flat_mean", "auto")
BACKENDS = ("auto", "torch", "triton", "naive")
# How a query tile's tokens score a candidate together (``query_tile``): the sum or the
# log-sum-exp of their per-token group scores, or ("qmean") the group score of the tile's per-head
# mean query over its real tokens (one row per head instead of ``query_tile``: that many times
# fewer products; equal to "sum" for the mean scorer, up to the factor of the token count).
# "mass" (selection v3, docs/selection_v3.md): the walk ranks by the mean query as "qmean"
# does; the leaf stage sums, over up to ``MASS_ROWS`` query rows of the tile's own tokens
# (``mass_tokens``), each row's softmax share of a candidate among the tile's free candidates:
# a shared pick that weighs every token's sharp blocks, not their mean's.
TILE_REDUCES = ("sum", "lse", "qmean", "mass")
# Query rows a "mass" tile scores its candidates with: tokens x heads (G padded to a power of two)
# fill one 64-row tensor-core product (G = 16: 4 tokens of a 16-token tile; G = 7: 8; G <= 4: all).
MASS_ROWS = 64
# Forced leaves per query: the sink (first block), the previous block and the current block.
MAX_FORCED = 3
# Below this key length `selector="auto"` uses the flat exact-LSE scan; from it up, the pyramid.
# Measured on the H200 (bf16, HQ=64, HKV=4, D=128, K=W=16): with the `csc` selection kernel the
# pyramid takes 11.3 ms at 32K (benchmarks/results/select_variants_h200.json) against 34.2 ms for
# flat_lse (levers_h200.json, an earlier run); 16K was not re-measured.
AUTO_CROSSOVER_T = 32768
# Leaf block sizes (powers of two) each backend supports, in every op it runs (selection,
# attention, decode): the Triton decode kernel's tiles bound the Triton range.
BLOCK_SIZES = {"torch": (4, 256), "naive": (4, 256), "triton": (16, 128)}
# Elements (fp32) one query chunk of the torch backends may hold in its largest temporary.
CHUNK_ELEMS = 1 << 24
# Queries per group sharing one read of a block in the torch backends (``utils.csr.group_pairs``).
PAIRS_PER_GROUP = 32

# The defaults that selection v2 changed (docs/selection_v2.md: chosen from the H200 timings and
# SmolLM2 quality), named for the entry points' signatures; ``SelectConfig``'s fields default to
# them. ``query_tile=None`` resolves to ``min(QUERY_TILE, block_size)``.
QUERY_TILE = 16
SCORER = "bound"
TILE_REDUCE = "qmean"
BEAM_LEAF = 32  # 2 x the default topk; None: beam

# Decode's override of those defaults (``pisa_attn_with_kvcache``'s signature): the per-token
# walk, decode's measured bar (docs/results_decode.md). A decode step is per token whatever the
# knobs say; ``query_tile`` and ``tile_reduce`` apply to chunked prefill through the cache.
DECODE_DEFAULTS = MappingProxyType({"scorer": "lse", "query_tile": 1, "tile_reduce": "sum",
                                    "beam_leaf": None})

# The selection knobs every entry point takes and hands to ``resolve_config`` by name: the fields
# of ``SelectConfig`` and ``beam_ref_len`` (resolved into ``beam`` / ``beam_leaf``). A new knob is
# added here, to ``SelectConfig`` and ``check_knobs``, and to the signatures.
KNOBS = ("block_size", "topk", "branching", "beam", "beam_leaf", "beam_ref_len", "scorer",
         "selector", "forced_in_budget", "scale", "query_tile", "tile_reduce")


def query_tile_of(query_tile: int | None, block_size: int) -> int:
    """The tile a ``query_tile`` argument means: ``None`` is ``min(QUERY_TILE, block_size)``."""
    return min(QUERY_TILE, block_size) if query_tile is None else query_tile


# resolved once at import: torch.compile cannot trace importlib inside pisa_attn
HAS_TRITON = importlib.util.find_spec("triton") is not None

# torch.library schema types of SelectConfig's field annotations (``SelectConfig.op_schema``)
_SCHEMA_TYPES = {"int": "int", "int | None": "int?", "float": "float", "bool": "bool",
                 "str": "str"}


@dataclass(frozen=True)
class SelectConfig:
    """The selection knobs, resolved (see ``pisa.pisa_select`` for their meaning). The field
    defaults are the public defaults of every training / prefill entry point (``pisa_select``,
    ``pisa_attn``, their varlen and context-parallel forms, ``PisaAttention``, the HF
    integration); decode overrides some of them (``DECODE_DEFAULTS``). ``beam=None`` and
    ``query_tile=None`` mean what they mean there (``topk``; ``min(QUERY_TILE, block_size)``) and
    are filled in on construction. ``resolve_config`` makes one from a call's knobs (checked, with
    ``scale`` from the head dim: the default 0.125 is head dim 64's)."""

    block_size: int = 64
    topk: int = 16
    branching: int = 2
    beam: int | None = None
    scorer: str = SCORER
    selector: str = "pyramid"
    forced_in_budget: bool = True
    scale: float = 0.125
    # Selection v2 (docs/spec.md §11), after the v1 fields that tests pass by position.
    # Tokens at absolute positions [i * query_tile, (i + 1) * query_tile) share one selection.
    query_tile: int | None = None
    # Beam at the lowest internal level (level 2); None: ``beam``. Read it through ``beam_at``.
    beam_leaf: int | None = BEAM_LEAF
    # How a tile's tokens score a candidate together: one of TILE_REDUCES.
    tile_reduce: str = TILE_REDUCE

    def __post_init__(self):
        if self.beam is None:
            object.__setattr__(self, "beam", self.topk)
        if self.query_tile is None:
            object.__setattr__(self, "query_tile", query_tile_of(None, self.block_size))

    def beam_at(self, level: int) -> int:
        """Beam kept at 1-based pyramid ``level`` (>= 2): ``beam_leaf`` at level 2, whose children
        are the leaves, ``beam`` above (``beam_leaf=None`` keeps ``beam`` everywhere)."""
        return self.beam if level != 2 or self.beam_leaf is None else self.beam_leaf

    @property
    def uses_bounds(self) -> bool:
        """Whether the selection ranks by the pyramid's per-node key bounds (``scorer="bound"``
        on the pyramid walk; the flat selectors never read them)."""
        return self.selector == "pyramid" and self.scorer == "bound"

    @property
    def leaf_scorer(self) -> str:
        """How a candidate leaf is scored from its keys: the exact LSE for ``flat_lse`` and for
        the bound scorer (the bound only ranks internal nodes), the mean logit for
        ``flat_mean``, the pyramid's ``scorer`` otherwise."""
        if self.selector == "flat_mean":
            return "mean"
        if self.selector == "flat_lse" or self.scorer == "bound":
            return "lse"
        return self.scorer

    @property
    def slots(self) -> int:
        """Width of the ``block_idx`` output: the budget, plus room for forced blocks on top."""
        return self.topk if self.forced_in_budget else self.topk + MAX_FORCED

    def free_budget(self, n_forced: int) -> int:
        """How many non-forced blocks a query may take."""
        return self.topk - n_forced if self.forced_in_budget else self.topk

    def op_kwargs(self) -> dict:
        """The fields by name: how a config crosses a custom op's boundary (the op's schema
        declares them, ``op_schema``; ``SelectConfig(**kwargs)`` rebuilds it on the other
        side)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def op_schema(cls) -> str:
        """The fields as keyword-only arguments of a ``torch.library`` schema, in field order
        (``"int block_size, int topk, ..."``), for the custom ops that take ``op_kwargs``."""
        return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in fields(cls))


def n_query_tiles(n_queries: int, n_keys: int, query_tile: int) -> int:
    """Rows of a selection by query tiles: the aligned tiles ``[i * Qt, (i + 1) * Qt)`` of absolute
    positions that the queries ``[n_keys - n_queries, n_keys)`` touch (the first and the last may
    be partial). ``n_queries`` for ``query_tile = 1``; 0 without queries."""
    if n_queries == 0:
        return 0
    return (n_keys - 1) // query_tile - (n_keys - n_queries) // query_tile + 1


def default_scale(head_dim: int) -> float:
    """The softmax scale when none is given: ``head_dim ** -0.5``."""
    return head_dim ** -0.5


def _check_int(name: str, value) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is a Python int (``bool`` is not one)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def check_nonnegative_int(name: str, value) -> None:
    """``TypeError`` unless ``value`` is an int, ``ValueError`` unless it is >= 0; both name it."""
    _check_int(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_positive_int(name: str, value) -> None:
    """``TypeError`` unless ``value`` is an int, ``ValueError`` unless it is >= 1; both name it."""
    _check_int(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_geometry(block_size: int, branching: int, backend: str = "torch") -> None:
    """Check the pyramid geometry (leaf block size ``C``, branching factor ``g``) for a resolved
    ``backend`` (``"torch"``: the widest range, for objects made before a backend is known)."""
    lo, hi = BLOCK_SIZES[backend]
    _check_int("block_size", block_size)
    if block_size < lo or block_size > hi or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [{lo}, {hi}] for backend "
                         f"{backend!r}, got {block_size!r}")
    _check_int("branching", branching)
    if branching < 2:
        raise ValueError(f"branching must be an int >= 2, got {branching!r}")


def check_knobs(*, block_size: int = SelectConfig.block_size, topk: int = SelectConfig.topk,
                branching: int = SelectConfig.branching, beam: int | None = SelectConfig.beam,
                scorer: str = SelectConfig.scorer, selector: str = SelectConfig.selector,
                forced_in_budget: bool = SelectConfig.forced_in_budget,
                scale: float | None = None, backend: str = "torch",
                query_tile: int | None = SelectConfig.query_tile,
                beam_leaf: int | None = SelectConfig.beam_leaf,
                tile_reduce: str = SelectConfig.tile_reduce,
                beam_ref_len: int | None = None) -> None:
    """Check the selection knobs without tensors, the one check of each (``resolve_config`` runs
    it first; objects made before their inputs exist, such as ``PisaAttention``, run it at
    construction): a ``TypeError`` naming a knob of the wrong type, a ``ValueError`` naming one
    out of range.
    ``backend`` is checked to be one of ``BACKENDS``; ``"auto"`` bounds ``block_size`` by the
    widest (torch) range, as the device that decides is not known yet."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_geometry(block_size, branching, "torch" if backend == "auto" else backend)
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")
    if not isinstance(forced_in_budget, bool):
        raise TypeError(f"forced_in_budget must be a bool, got {forced_in_budget!r} "
                        f"({type(forced_in_budget).__name__})")
    _check_int("topk", topk)
    min_topk = MAX_FORCED if forced_in_budget else 1
    if topk < min_topk:
        raise ValueError(
            f"topk must be an int >= {min_topk} (the {MAX_FORCED} forced blocks count inside the "
            f"budget when forced_in_budget=True), got {topk!r}")
    for name, width in (("beam", beam), ("beam_leaf", beam_leaf), ("beam_ref_len", beam_ref_len)):
        if width is not None:
            _check_int(name, width)
            if width < 1:
                raise ValueError(f"{name} must be a positive int or None, got {width!r}")
    if query_tile is not None:  # None: min(QUERY_TILE, block_size), always valid
        _check_int("query_tile", query_tile)
        if query_tile < 1 or query_tile > block_size or query_tile & (query_tile - 1):
            raise ValueError(f"query_tile must be a power of two in [1, block_size={block_size}] "
                             f"(a tile lies inside one leaf block) or None, got {query_tile!r}")
    if tile_reduce not in TILE_REDUCES:
        raise ValueError(f"tile_reduce must be one of {TILE_REDUCES}, got {tile_reduce!r}")
    if tile_reduce == "mass" and (selector not in ("pyramid", "auto")
                                  or scorer not in ("lse", "bound")):
        raise ValueError("tile_reduce='mass' ranks the pyramid walk's candidate leaves by their "
                         "exact LSE: it needs selector='pyramid' (or 'auto') and scorer='lse' or "
                         f"'bound', got selector={selector!r}, scorer={scorer!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise TypeError(f"scale must be a real number or None, got {scale!r} "
                        f"({type(scale).__name__})")
    if scale is not None and not math.isfinite(scale):  # NaN / Inf would hide in zeroed rows
        raise ValueError(f"scale must be finite or None, got {scale!r}")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA when Triton is installed, else ``"torch"``.
    ``"triton"`` needs Triton installed, and CUDA tensors unless ``TRITON_INTERPRET=1`` (Triton's
    CPU interpreter, for tests: it must be set before the first Triton call)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if q.is_cuda and HAS_TRITON else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise ValueError("backend='triton' needs Triton (pip install triton); use "
                             "backend='torch' or 'auto'")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got q on {q.device}; use backend='torch' "
                "or 'auto' on the CPU, or set TRITON_INTERPRET=1 (before the first Triton call) "
                "to run the Triton kernels in Triton's CPU interpreter (slow, for tests)")
    return backend


def pruned_levels(n_keys: int, block_size: int, branching: int, beam: int) -> int:
    """The internal levels of the pyramid of ``n_keys`` keys that hold more than ``beam`` nodes:
    those a walk of that beam ranks and prunes (one more each time the context grows
    ``branching``-fold)."""
    return sum(n > beam for n in level_sizes(cdiv(n_keys, block_size), branching)[1:])


def grown_beams(beam: int, beam_leaf: int | None, n_keys: int, ref_len: int, block_size: int,
                branching: int) -> tuple[int, int | None]:
    """``(beam, beam_leaf)`` grown for a context of ``n_keys`` keys from their widths at
    ``ref_len`` keys: both times ``pruned_levels(n_keys) / pruned_levels(ref_len)`` (the
    reference's count at least 1), rounded up, when ``n_keys > ref_len``; unchanged otherwise.
    A needle must survive every pruned level, so the beam grows with their number: the
    selection's work grows by the same factor, O(N log^2 N) in all instead of O(N log N)
    (``docs/quality.md``). ``beam_leaf=None`` (the beam) stays None."""
    if n_keys <= ref_len:
        return beam, beam_leaf
    ref = max(pruned_levels(ref_len, block_size, branching, beam), 1)
    factor = pruned_levels(n_keys, block_size, branching, beam) / ref
    if factor <= 1:
        return beam, beam_leaf
    return (math.ceil(beam * factor),
            None if beam_leaf is None else math.ceil(beam_leaf * factor))


def resolve_config(q: torch.Tensor, k: torch.Tensor | None, backend: str, *,
                   seqlen_k: int | None = None, **knobs) -> SelectConfig:
    """The ``SelectConfig`` of a call's ``knobs`` (``check_knobs``' keywords, by name; the
    defaults are ``SelectConfig``'s) for the resolved ``backend``: ``check_knobs``, then
    ``config_of`` with ``q``'s head dim and the key length ``seqlen_k``, default ``k``'s (``k``
    may be None when it is given: a packed batch's longest sequence, a cache's capacity). Raises
    ``ValueError`` (or ``TypeError``, for a knob of the wrong type) naming the bad one."""
    check_knobs(backend=backend, **knobs)
    return config_of(q.shape[-1], k.shape[1] if seqlen_k is None else seqlen_k, **knobs)


def config_of(head_dim: int, n_keys: int, *, scale: float | None = None,
              beam_ref_len: int | None = None, **knobs) -> SelectConfig:
    """The ``SelectConfig`` of knobs that ``check_knobs`` passed (``resolve_config``; a caller that
    must check them earlier, such as ``pisa.distributed`` before its collective, calls the two
    apart): the other ``knobs`` are ``SelectConfig``'s fields by name (it fills ``beam`` and
    ``query_tile``); ``scale`` None is ``head_dim ** -0.5``; ``selector="auto"`` is decided by
    ``n_keys``; with ``beam_ref_len``, ``beam`` and ``beam_leaf`` grow for ``n_keys`` keys
    (``grown_beams``). ``beam_leaf=None`` stays None (it means ``beam``: ``beam_at``)."""
    scale = default_scale(head_dim) if scale is None else scale
    cfg = SelectConfig(**knobs, scale=float(scale))
    if beam_ref_len is not None:
        beam, beam_leaf = grown_beams(cfg.beam, cfg.beam_leaf, n_keys, beam_ref_len,
                                      cfg.block_size, cfg.branching)
        cfg = replace(cfg, beam=beam, beam_leaf=beam_leaf)
    if cfg.selector == "auto":  # "mass" ranks the walk's candidates: the pyramid at any length
        flat = n_keys < AUTO_CROSSOVER_T and cfg.tile_reduce != "mass"
        cfg = replace(cfg, selector="flat_lse" if flat else "pyramid")
    return cfg


def check_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """Validate the FlashAttention layout ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, HKV, D]``. Zero-size
    batches (``B = 0`` or ``Tq = 0``) pass (the ops return empty results); zero heads or a zero
    head dim do not."""
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
    if HQ < 1:
        raise ValueError(f"q must have at least one head (HQ >= 1), got shape {tuple(q.shape)}")
    if HKV < 1:
        raise ValueError(f"k must have at least one head (HKV >= 1), got shape {tuple(k.shape)}")
    if HQ % HKV:
        raise ValueError(f"q heads ({HQ}) must be a multiple of k heads ({HKV}) for GQA")
    if D < 1 or D > 256:
        raise ValueError(f"q head dim D must be in [1, 256], got {D} (q shape {tuple(q.shape)})")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")


def check_block_idx(block_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    block_size: int, query_tile: int = 1) -> None:
    """Validate a user-given selection: ``[B, Tq, HKV, S]`` int32 per token, or with
    ``query_tile > 1`` ``[B, n_query_tiles(Tq, Tk, query_tile), HKV, S]`` per query tile — its
    dtype, shape and device, then its values (``check_block_idx_values``). Selections the library
    makes are trusted and never pass through here."""
    if not isinstance(block_idx, torch.Tensor):
        raise TypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    if block_idx.dtype != torch.int32:
        raise TypeError(f"block_idx must be int32, got {block_idx.dtype}")
    Tq, Tk = q.shape[1], k.shape[1]
    want = (q.shape[0], n_query_tiles(Tq, Tk, query_tile), k.shape[2])
    if block_idx.dim() != 4 or tuple(block_idx.shape[:3]) != want:
        rows = "Tq" if query_tile == 1 else f"n_query_tiles(Tq, Tk, query_tile={query_tile})"
        raise ValueError(f"block_idx must have shape [B, {rows}, HKV, S] = [{want[0]}, "
                         f"{want[1]}, {want[2]}, S], got {tuple(block_idx.shape)}")
    if block_idx.device != q.device:
        raise ValueError(f"block_idx is on {block_idx.device} but q is on {q.device}")
    check_block_idx_values(block_idx, Tk, block_size, query_tile, Tq)


def check_block_idx_values(block_idx: torch.Tensor, n_keys: int, block_size: int,
                           query_tile: int = 1, n_queries: int | None = None,
                           first: torch.Tensor | None = None) -> None:
    """Check the values of a selection ``block_idx [B, rows, HKV, S]`` of the last ``n_queries``
    (default: ``rows``, one per token) of ``n_keys`` positions, in blocks of ``block_size``; with
    ``query_tile > 1`` a row per query tile (row ``j``: the tile starting at absolute position
    ``((n_keys - n_queries) // query_tile + j) * query_tile``, inside one block). Each row lists
    valid block ids first, strictly ascending (no duplicates), each in
    ``[0, cdiv(n_keys, block_size))`` and causal (no block after the one holding the row's
    queries), then ``-1`` padding only (a row of ``-1`` alone attends to no key: ``o = 0``,
    ``lse = -inf``). ``first [rows]`` int64, when given, is each row's first position instead
    (packed sequences: a token's position in its own sequence). Raise ``ValueError`` naming the
    first bad row ``(b, row, h)``.

    Cost: one elementwise pass and one reduction over the ``B * rows * HKV * S`` entries (no
    ``[T, T]`` or ``[T, N/C]`` temporaries), and one host sync: ``bool()`` of the result waits for
    the device. Only user-given selections pay it (``pisa_attn(..., block_idx=...)``). Under
    ``torch.compile`` the check is an asynchronous assert instead (no graph break; a violation
    raises a RuntimeError without naming the row, or a device-side assert on CUDA).
    """
    B, rows, H, S = block_idx.shape
    if block_idx.numel() == 0:
        return
    n_queries = rows if n_queries is None else n_queries
    # a row's first position (a query's own for query_tile = 1); its block is the causal limit
    if first is None:
        first = (torch.arange(rows, device=block_idx.device)
                 + (n_keys - n_queries) // query_tile) * query_tile
    last = (first // block_size).to(torch.int32)[None, :, None, None]
    bad = (block_idx < -1) | (block_idx > last)
    if S > 1:  # a valid id must follow a valid, smaller id
        prev, nxt = block_idx[..., :-1], block_idx[..., 1:]
        bad[..., 1:] |= (nxt >= 0) & ((prev < 0) | (nxt <= prev))
    if torch.compiler.is_compiling():  # traced: an async assert, no data-dependent branch
        torch._assert_async(~bad.any(), "block_idx is not a valid selection (ascending block "
                            "ids without duplicates, in range and causal, then -1 padding)")
        return
    if not bool(bad.any()):
        return
    b, t, h = (int(i) for i in bad.any(-1).nonzero()[0])
    row = block_idx[b, t, h].tolist()
    pos, n_blocks = int(first[t]), cdiv(n_keys, block_size)
    who = f"query {t} sits" if query_tile == 1 else f"tile {t} of {query_tile} queries starts"
    raise ValueError(
        f"block_idx[{b}, {t}, {h}] = {row} is not a valid selection: expected ascending block ids "
        f"without duplicates, each in [0, {n_blocks}) and causal ({who} at key position "
        f"{pos}, so ids <= {pos // block_size} with block_size={block_size}), then -1 padding "
        f"only at the end")


def mass_tokens(n_real: int, query_tile: int, group: int) -> list[int]:
    """The offsets, among a tile's ``n_real`` real tokens, whose rows a ``tile_reduce="mass"``
    tile scores its candidates with: ``n = min(n_real, mass_row_tokens(query_tile, group))``
    tokens spread evenly from the first (``j * n_real // n``)."""
    n = min(n_real, mass_row_tokens(query_tile, group))
    return [j * n_real // n for j in range(n)]


def mass_row_tokens(query_tile: int, group: int) -> int:
    """Tokens a full ``tile_reduce="mass"`` tile scores with: ``MASS_ROWS`` rows of
    ``next_pow2(group)`` heads, at most the tile."""
    return min(query_tile, max(1, MASS_ROWS // (1 << (group - 1).bit_length())))
