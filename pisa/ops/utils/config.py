"""The one home of every selection default and bound, and of the input checks.

``pisa.api`` resolves a ``SelectConfig`` once per call (``resolve_config``) and hands it down; the
ops below take it resolved and never check or default a knob again.
"""
from __future__ import annotations

import importlib.util
from dataclasses import astuple, dataclass

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
# Leaf block sizes (powers of two) each backend supports, in every op it runs (selection,
# attention, decode): the Triton decode kernel's tiles bound the Triton range.
BLOCK_SIZES = {"torch": (4, 256), "naive": (4, 256), "triton": (16, 128)}
# Elements (fp32) one query chunk of the torch backends may hold in its largest temporary.
CHUNK_ELEMS = 1 << 24
# Queries per group sharing one read of a block in the torch backends (``utils.csr.group_pairs``).
PAIRS_PER_GROUP = 32

# resolved once at import: torch.compile cannot trace importlib inside pisa_attn
HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class SelectConfig:
    """Resolved selection knobs (see ``pisa.pisa_select`` for their meaning). The field defaults
    are the library's defaults: public signatures read them from here."""

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

    def astuple(self) -> tuple:
        """The fields in order: the scalar arguments of the custom ops (``SelectConfig(*t)``
        rebuilds it)."""
        return astuple(self)


def default_scale(head_dim: int) -> float:
    """The softmax scale when none is given: ``head_dim ** -0.5``."""
    return head_dim ** -0.5


def check_geometry(block_size: int, branching: int, backend: str = "torch") -> None:
    """Check the pyramid geometry (leaf block size ``C``, branching factor ``g``) for a resolved
    ``backend`` (``"torch"``: the widest range, for objects made before a backend is known)."""
    lo, hi = BLOCK_SIZES[backend]
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < lo \
            or block_size > hi or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [{lo}, {hi}] for backend "
                         f"{backend!r}, got {block_size!r}")
    if not isinstance(branching, int) or isinstance(branching, bool) or branching < 2:
        raise ValueError(f"branching must be an int >= 2, got {branching!r}")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA when Triton is installed, else ``"torch"``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if q.is_cuda and HAS_TRITON else "torch"
    return backend


def resolve_config(q: torch.Tensor, k: torch.Tensor, backend: str, *,
                   block_size: int = SelectConfig.block_size, topk: int = SelectConfig.topk,
                   branching: int = SelectConfig.branching, beam: int | None = None,
                   scorer: str = SelectConfig.scorer, selector: str = SelectConfig.selector,
                   forced_in_budget: bool = SelectConfig.forced_in_budget,
                   scale: float | None = None) -> SelectConfig:
    """Check the selection knobs for the resolved ``backend`` and fill in defaults (``beam``:
    ``topk``; ``scale``: ``D ** -0.5``; ``selector="auto"`` by ``k``'s length); raise
    ``ValueError`` naming the bad one."""
    check_geometry(block_size, branching, backend)
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
        scale = default_scale(q.shape[-1])
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
