"""fla's NSA (Native Sparse Attention) as a peer arm of the trained-model suite (issue 26).

``NSAAttention`` is ``PisaAttention``'s projections and RoPE (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``; ``rotary_tables`` / ``apply_rotary`` reused) with NSA's core in place of
``pisa_attn``: fla's ``parallel_nsa`` (the ``fla-core`` wheel, flash-linear-attention) and its
per-head gates, as fla's own layer (``fla.layers.NativeSparseAttention``) wires them: one
``g_proj = Linear(width, 3 * HQ, bias=False)``, sigmoid, read per head as (compressed, selected,
sliding window), and

    o = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa

- compressed branch ``o_cmp``: attention over the keys and values mean-pooled per block of
  ``block_size`` (fla pools them itself: ``mean_pooling``; no learned compression MLP, stride =
  block size); a query sees only the blocks it has fully passed;
- selected branch ``o_slc``: attention over the ``block_counts`` blocks of ``block_size`` keys
  with the highest compressed-attention probability, summed over the query heads of a KV group
  (one selection per KV head, as PISA's); the first block and the query's own and previous
  blocks are always selected, inside the count;
- sliding window ``o_swa``: causal attention over the last ``window_size`` keys (the query's
  own included).

What fla's NSA needs (fla-core 0.5.2, read from ``fla/ops/nsa``):

- the GQA group ``G = HQ / HKV`` must be a power of two >= 16 (an ``assert`` in ``parallel_nsa``
  and ``naive_nsa``: the group is a Triton tile dimension of ``tl.dot``), so the suite's default
  4 query / 2 KV heads cannot run it (``quality_train.py``: the NSA-compatible shape);
- head dim: at most 256 (128 off Hopper-class shared memory), and at least 16 (the forward's key
  tile is ``next_pow2(D)``, a ``tl.dot`` operand);
- ``block_size`` a power of two >= 16 (a ``tl.arange`` / ``tl.dot`` extent) with
  ``block_size >= 2 * next_pow2(block_counts)`` (``parallel_nsa_topk``'s bitonic top-k);
- dtypes: any float (fp32 / bf16 / fp16; autocast-aware ``custom_fwd``); CUDA (Triton) only:
  ``parallel_nsa`` and also fla's "naive" ``naive_nsa`` pool the keys with a Triton kernel
  (``fla.ops.utils.pooling.mean_pooling``), and both hand the sliding window to
  ``flash_attn.flash_attn_func`` (the ``flash-attn`` package, a CUDA build, not a dependency of
  fla-core: without it a ``window_size > 0`` call fails on ``None``).

So on CPU ``naive_nsa`` itself cannot run. Its three branches are plain torch
(``naive_nsa_compression``, ``naive_nsa_topk``, ``naive_nsa_selection``): the CPU path
(``backend="naive"``) calls those, composed exactly as ``naive_nsa`` composes them, with torch
stand-ins for its two GPU-only pieces (``mean_pool``: fla's per-block mean, a partial last block
averaged over its own tokens; ``sliding_window_attn``: ``flash_attn_func(causal=True,
window_size=(window_size - 1, 0))``); ``tests/eval/test_nsa_arm.py`` checks the result equals
``naive_nsa`` called directly, with those two pieces patched in. On CUDA (``backend="fla"``)
``parallel_nsa`` runs the compressed and selected branches; the window goes to it too when
``flash_attn`` is importable (fla's own path), else ``parallel_nsa`` runs with
``window_size=0`` and ``sliding_window_attn`` adds the window branch (the same math; it computes
``T x 2 * window_size`` scores, not ``T x T``). ``NSAAttention.window_impl`` says which.

The same budget as PISA's ``K = 16``, ``C = 64`` (``NSA_DEFAULTS``): ``block_size = 64``
(selection block = compression block, fla's constraint) and ``block_counts = 16`` selected
blocks a token, forced sink / previous / current blocks inside the count as in PISA's
``forced_in_budget``: the selected branch attends the same 16 x 64 = 1024 keys a token PISA
does. ``window_size = 64``: the window lies inside the query's own and previous blocks, which
are always selected, so it adds no keys beyond the selection (the NSA paper's 512 would add up
to 448); the compressed branch adds ``t // 64`` pooled tokens (64 at 4K), the summaries PISA's
selection reads too. The paper's other ratios (compression block 32 at stride 16 with a learned
MLP) are not what fla implements.

fla is imported lazily (``load_fla``, at the first ``NSAAttention``): nothing else in pisa
depends on it; ``pip install 'pisa[nsa]'`` (or ``fla-core``) provides it.
"""
from __future__ import annotations

import importlib
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import apply_rotary, rotary_tables
from ..ops.attn import dense_causal_attn

# The same attention budget as pisa's K = 16, C = 64 (module docstring).
NSA_DEFAULTS = {"block_size": 64, "block_counts": 16, "window_size": 64}
ATTN_MODES = ("nsa", "dense")
# "auto": "fla" on CUDA, "naive" elsewhere; pisa's backend names map onto them (GPTConfig.backend)
BACKENDS = {"auto": "auto", "fla": "fla", "naive": "naive", "triton": "fla", "torch": "naive"}
NAIVE_PARTS = ("naive_nsa_compression", "naive_nsa_topk", "naive_nsa_selection")
INSTALL = "pip install 'pisa[nsa]' (or: pip install fla-core einops)"


def load_fla():
    """fla's NSA modules ``(fla.ops.nsa.parallel, fla.ops.nsa.naive)``; a clear ImportError when
    fla-core (or a part the arm calls) is missing."""
    try:
        with warnings.catch_warnings():  # fla warns at import without flash-attn or a GPU
            warnings.simplefilter("ignore")
            parallel = importlib.import_module("fla.ops.nsa.parallel")
            naive = importlib.import_module("fla.ops.nsa.naive")
    except ImportError as e:
        raise ImportError(f"the 'nsa' arm needs fla's NSA ops (fla.ops.nsa, from the fla-core "
                          f"wheel of flash-linear-attention, with einops and triton): {INSTALL}; "
                          f"import failed with: {e}") from e
    missing = [name for name in ("parallel_nsa",) if not hasattr(parallel, name)] + \
        [name for name in NAIVE_PARTS if not hasattr(naive, name)]
    if missing:
        import fla
        raise ImportError(f"fla-core {getattr(fla, '__version__', '?')} lacks "
                          f"{', '.join(missing)} (fla.ops.nsa), which the 'nsa' arm calls; "
                          f"install fla-core >= 0.5.2: {INSTALL}")
    return parallel, naive


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_nsa_shape(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    block_counts: int, window_size: int = 0) -> None:
    """Raise ``ValueError`` unless fla's NSA kernels take this shape (module docstring)."""
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size),
                        ("block_counts", block_counts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 0:
        raise ValueError(f"window_size must be an int >= 0, got {window_size!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    group = num_heads // num_kv_heads
    if group < 16 or group & (group - 1):
        raise ValueError(f"fla's NSA needs a GQA group HQ / HKV that is a power of two >= 16, got "
                         f"{num_heads} / {num_kv_heads} = {group} (e.g. 16 query heads on 1 KV "
                         "head: quality_train.py --heads 16 --kv-heads 1 --head-dim 16)")
    if not 16 <= head_dim <= 256 or head_dim % 2:
        raise ValueError(f"fla's NSA needs an even head dim in [16, 256], got {head_dim}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"fla's NSA needs block_size a power of two >= 16, got {block_size}")
    if block_size < 2 * _pow2(block_counts):
        raise ValueError(f"fla's NSA top-k needs block_size >= 2 * next_pow2(block_counts), got "
                         f"block_size {block_size} with block_counts {block_counts}")


def mean_pool(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x [B, T, H, D]`` -> ``[B, ceil(T / block_size), H, D]``: each block's mean, a partial
    last block averaged over its own tokens (fla's ``mean_pooling``, in torch; fp32 sums)."""
    B, T, H, D = x.shape
    n = -(-T // block_size)
    sums = F.pad(x.float(), (0, 0, 0, 0, 0, n * block_size - T)).view(
        B, n, block_size, H, D).sum(2)
    counts = torch.full((n,), float(block_size), device=x.device)
    counts[-1] = T - (n - 1) * block_size
    return (sums / counts[None, :, None, None]).to(x.dtype)


def sliding_window_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size: int,
                        scale: float | None = None) -> torch.Tensor:
    """Causal attention of each query over its last ``window_size`` keys (its own included):
    ``flash_attn_func(q, k, v, causal=True, window_size=(window_size - 1, 0))`` in torch (SDPA
    per tile of ``window_size`` queries over that tile and the one before). ``q [B, T, HQ, D]``,
    ``k, v [B, T, HKV, D]`` (GQA: query head ``h`` reads KV head ``h // (HQ / HKV)``)."""
    B, T, HQ, D = q.shape
    HKV, w = k.shape[2], window_size
    n = -(-T // w)
    qt = F.pad(q, (0, 0, 0, 0, 0, n * w - T)).view(B, n, w, HQ, D)
    kv = []
    for x in (k, v):  # a tile of padding before, then every tile with the one before it
        x = F.pad(x, (0, 0, 0, 0, w, n * w - T)).view(B, n + 1, w, HKV, D)
        x = torch.cat([x[:, :-1], x[:, 1:]], dim=2)  # [B, n, 2w, HKV, D]
        kv.append(x.repeat_interleave(HQ // HKV, dim=3).permute(0, 1, 3, 2, 4).flatten(0, 1))
    a = torch.arange(w, device=q.device)[:, None]  # query offset in its tile
    j = torch.arange(2 * w, device=q.device)[None, :]  # key offset from the tile before's start
    tile = torch.arange(n, device=q.device)[:, None, None]
    mask = (j > a) & (j <= a + w) & ((tile > 0) | (j >= w))  # [n, w, 2w]
    mask = mask[:, None].repeat(B, 1, 1, 1)  # [B * n, 1, w, 2w]: broadcast over heads
    o = F.scaled_dot_product_attention(qt.permute(0, 1, 3, 2, 4).flatten(0, 1), kv[0], kv[1],
                                       attn_mask=mask, scale=scale)
    return o.view(B, n, HQ, w, D).permute(0, 1, 3, 2, 4).reshape(B, n * w, HQ, D)[:, :T]


def nsa_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_cmp: torch.Tensor,
             g_slc: torch.Tensor, g_swa: torch.Tensor, *, block_size: int = 64,
             block_counts: int = 16, window_size: int = 64, scale: float | None = None,
             backend: str = "auto") -> torch.Tensor:
    """fla's NSA on ``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` and gates ``[B, T, HQ]``:
    ``parallel_nsa`` (``backend="fla"``, CUDA) or fla's naive branches (``"naive"``, any
    device); ``"auto"`` picks by ``q``'s device. Returns ``o [B, T, HQ, D]`` (module
    docstring)."""
    backend = BACKENDS.get(backend)
    if backend is None:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}")
    if backend == "auto":
        backend = "fla" if q.is_cuda else "naive"
    if backend == "fla" and not q.is_cuda:
        raise ValueError("backend 'fla' (fla's parallel_nsa: Triton) needs CUDA tensors; on "
                         f"{q.device} use backend 'naive' (fla's torch reference)")
    check_nsa_shape(q.shape[2], k.shape[2], q.shape[3], block_size, block_counts, window_size)
    parallel, naive = load_fla()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    module = parallel if backend == "fla" else naive
    fla_window = window_size > 0 and q.is_cuda and module.flash_attn_func is not None
    if backend == "fla":
        o = parallel.parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa,
                                  block_counts=block_counts, block_size=block_size,
                                  window_size=window_size if fla_window else 0, scale=scale)
    else:  # naive_nsa's composition, its mean_pooling (Triton) in torch
        k_cmp, v_cmp = mean_pool(k, block_size), mean_pool(v, block_size)
        o_cmp, _ = naive.naive_nsa_compression(q=q, k_cmp=k_cmp, v_cmp=v_cmp,
                                               block_size=block_size, scale=scale)
        block_indices = naive.naive_nsa_topk(q=q, k_cmp=k_cmp, block_counts=block_counts,
                                             block_size=block_size, scale=scale)
        o_slc = naive.naive_nsa_selection(q, k, v, block_indices, block_size, scale)
        o = torch.addcmul(o_slc * g_slc.unsqueeze(-1), o_cmp, g_cmp.unsqueeze(-1))
        if fla_window:
            o = torch.addcmul(o, module.flash_attn_func(
                q, k, v, causal=True, window_size=(window_size - 1, 0)), g_swa.unsqueeze(-1))
    if window_size > 0 and not fla_window:
        o = torch.addcmul(o, sliding_window_attn(q, k, v, window_size, scale),
                          g_swa.unsqueeze(-1))
    return o


class NSAAttention(nn.Module):
    """Causal self-attention with GQA and RoPE whose core is fla's NSA (module docstring).

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim, rope_theta, bias: as ``PisaAttention``
            (``head_dim`` default ``hidden_size // num_heads``).
        block_size, block_counts, window_size: NSA's selection / compression block, selected
            blocks per token and sliding window (``NSA_DEFAULTS``: pisa's budget at K = 16,
            C = 64).
        scale: softmax scale (default ``head_dim ** -0.5``).
        attn: ``"nsa"`` (default) or ``"dense"`` (SDPA on the same projections, gates unused:
            a dense warm-up).
        backend: ``"auto"`` (``"fla"`` on CUDA, ``"naive"`` elsewhere), ``"fla"``
            (``parallel_nsa``) or ``"naive"`` (fla's torch reference; slow: a Python loop per
            token); pisa's ``"triton"`` / ``"torch"`` mean ``"fla"`` / ``"naive"``.

    Input ``x [B, T, hidden_size]`` -> output of the same shape. Raises ``ImportError`` (with
    the install command) at construction when fla is missing.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float = 10000.0, bias: bool = False,
                 block_size: int = NSA_DEFAULTS["block_size"],
                 block_counts: int = NSA_DEFAULTS["block_counts"],
                 window_size: int = NSA_DEFAULTS["window_size"], scale: float | None = None,
                 attn: str = "nsa", backend: str = "auto"):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        check_nsa_shape(num_heads, num_kv_heads, head_dim, block_size, block_counts, window_size)
        if attn not in ATTN_MODES:
            raise ValueError(f"attn must be one of {ATTN_MODES}, got {attn!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {backend!r}")
        if scale is not None and not math.isfinite(scale):
            raise ValueError(f"scale must be finite or None, got {scale!r}")
        load_fla()  # fail here, not at the first forward
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.attn, self.backend, self.scale = rope_theta, attn, backend, scale
        self.block_size, self.block_counts, self.window_size = block_size, block_counts, \
            window_size
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.g_proj = nn.Linear(hidden_size, 3 * num_heads, bias=False)  # as fla's layer
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    @property
    def window_impl(self) -> str:
        """Who computes the sliding window on CUDA: "flash_attn" (fla's path) or "torch"
        (``sliding_window_attn``; always on CPU)."""
        parallel, _ = load_fla()
        return "flash_attn" if parallel.flash_attn_func is not None else "torch"

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, rotated ``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` (as
        ``PisaAttention.qkv``)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``g_cmp, g_slc, g_swa [B, T, HQ]``: sigmoid of ``g_proj``, 3 a head (fla's layer)."""
        B, T, _ = x.shape
        return self.g_proj(x).view(B, T, self.num_heads, 3).sigmoid().unbind(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if self.attn == "dense":
            o = dense_causal_attn(q, k, v, self.scale)
        else:
            o = nsa_attn(q, k, v, *self.gates(x), block_size=self.block_size,
                         block_counts=self.block_counts, window_size=self.window_size,
                         scale=self.scale, backend=self.backend)
        return self.o_proj(o.reshape(B, T, -1))
