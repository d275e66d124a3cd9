"""Public functions: ``pisa_select`` (block selection), ``pisa_attn`` (selection + attention),
their packed-sequence forms ``pisa_select_varlen`` / ``pisa_attn_varlen`` and
``pisa_attn_with_kvcache`` (decode and chunked prefill against a ``PisaCache``)."""
from __future__ import annotations

import torch

from .cache import PisaCache
from .ops.attn import dense_causal_attn, sparse_attn
from .ops.select import select
from .ops.utils.kernel_cache import precompile
from .ops.utils.config import (BEAM_LEAF, DECODE_DEFAULTS, SCORER, TILE_REDUCE, SelectConfig,
                               check_block_idx, check_block_idx_values, check_nonnegative_int,
                               check_qk, n_query_tiles,
                               resolve_backend, resolve_config)
from .ops.utils.varlen import VarlenLayout, check_varlen, varlen_layout

_C, _K, _G = SelectConfig.block_size, SelectConfig.topk, SelectConfig.branching

_SELECT_DOC = """
    block_size: int. Keys per leaf block ``C``, a power of two in
        ``pisa.ops.utils.config.BLOCK_SIZES[backend]`` ([4, 256] in torch, [16, 128] in Triton).
        Default 64.
    topk: int. Blocks attended per query ``K`` (the budget). Default 16. With
        ``forced_in_budget=True`` it includes the forced blocks (sink, previous, current) and must
        be >= 3.
    branching: int. Pyramid branching factor ``g``. Default 2 (4 is cheaper and coarser).
    beam: int or None. Beam width ``W`` kept at internal levels. Default ``topk``. Wider beams
        cost time and raise recall against the exact flat scan.
    beam_leaf: int or None. Beam kept at the lowest internal level (whose children are the
        leaves), where a wider beam recovers most of the pyramid's misses (``docs/spec.md`` §11).
        Default 32 (twice the default ``topk``); None: ``beam``.
    beam_ref_len: int or None. Grow ``beam`` and ``beam_leaf`` with the context: at ``seqlen_k``
        keys past ``beam_ref_len`` both are multiplied by the ratio of the pyramid levels the walk
        prunes there to those it prunes at ``beam_ref_len`` keys (``pisa.ops.utils.config.
        grown_beams``; e.g. 16 / 32 at 8K become 48 / 96 at 128K for C = 64, g = 2), so a sharp
        key meets a beam as wide relative to the levels it must survive. Default None: fixed
        widths (``docs/quality.md``).
    scorer: "bound" (default) | "lse" | "mean" | "meanvar". How an internal node is scored from
        its children (and a leaf from its keys): the LogSumExp of each child's upper bound
        ``sum_d max(q_d min_d, q_d max_d)`` over per-channel key minima and maxima (a sharp key
        is not averaged away; leaves by their exact LSE), count-weighted LogSumExp of the means,
        mean logit (first order, equals flat mean-pooled scoring), or mean + variance/2 (second
        order). Pyramid only.
    query_tile: int or None. Tokens per query tile ``Qt``, a power of two in ``[1, block_size]``:
        the tokens at absolute positions ``[i * Qt, (i + 1) * Qt)`` share one selection per KV
        head. Default None: ``min(16, block_size)``. ``1`` is per-token selection (the most
        precise, several times slower: ``docs/selection_v2.md``).
    tile_reduce: "qmean" (default) | "sum" | "lse" | "mass". How a tile's tokens score a
        candidate together: the score of their per-head mean query (one row per head: the cheap
        one), the sum or the log-sum-exp of their per-token scores (every query row scored), or
        (``"mass"``, selection v3, ``docs/selection_v3.md``) a walk by the mean query whose
        candidate leaves are ranked by the summed softmax share of up to 64 rows of the tile's
        own tokens (pyramid selector, ``scorer`` "lse" or "bound").
    selector: "pyramid" (default) | "flat_lse" | "flat_mean" | "auto". ``flat_lse`` scores every
        causal block by its exact LSE (the mass-optimal oracle, O(N^2)); ``flat_mean`` by the
        logit of its mean key (BSA/MoBA style); ``auto`` takes ``flat_lse`` below
        ``pisa.ops.utils.config.AUTO_CROSSOVER_T`` keys and the pyramid above.
    forced_in_budget: bool. Count the forced blocks inside ``topk`` (default) or add them on top
        (then ``block_idx`` has ``topk + 3`` slots).
    scale: float or None. Softmax scale; default ``D ** -0.5``.
    backend: "auto" (default: Triton on CUDA when installed, else torch) | "torch" | "triton"
        | "naive" (the fp64 loop oracle; tiny inputs only). "triton" needs CUDA tensors, or
        ``TRITON_INTERPRET=1`` in the environment (Triton's CPU interpreter; slow, for tests).

    A knob of the wrong type (``scale="0.1"``, ``topk=16.0``, ``forced_in_budget="no"``) is a
    ``TypeError``, one out of range a ``ValueError``, each naming the knob.
"""


_VARLEN_DOC = """
    Arguments:
        q: (total_q, nheads, headdim), fp16/bf16/fp32: the queries of ``n_seq`` sequences packed
            back to back (FlashAttention's ``flash_attn_varlen_func`` layout).
        k, v: (total_k, nheads_k, headdim), same dtype/device; GQA when nheads_k < nheads.
        cu_seqlens_q, cu_seqlens_k: (n_seq + 1,) int32, the cumulative sequence lengths:
            sequence ``i`` is rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` (0 first, the total last,
            non-decreasing; empty sequences are allowed). Its queries are the last ``len_q_i``
            of its ``len_k_i`` positions (``len_q_i <= len_k_i``: bottom-right causal).
        max_seqlen_q, max_seqlen_k: int, at least the longest sequence of each. The launch is
            sized from them and the shapes, so the call has no host sync; values of CUDA
            ``cu_seqlens`` are checked by asynchronous device asserts, of CPU ones exactly
            (``ValueError`` naming the argument).

    Every sequence is selected and attended alone: one pyramid per sequence, its first block
    the sink, blocks and query tiles aligned to its start; no key of another sequence is ever
    scored or attended. Knobs as in ``pisa_attn`` (``docs/varlen.md``), except that
    ``selector="auto"`` and ``beam_ref_len`` decide by ``max_seqlen_k`` for all sequences.
""" + _SELECT_DOC


def _knob_docs(fn):
    """Put the shared argument texts into ``fn``'s docstring at its ``{_SELECT_DOC}`` /
    ``{_VARLEN_DOC}`` line (a docstring must be a literal to be one)."""
    for name, text in (("_SELECT_DOC", _SELECT_DOC), ("_VARLEN_DOC", _VARLEN_DOC)):
        fn.__doc__ = fn.__doc__.replace("    {" + name + "}\n", "    " + text + "\n")
    return fn


def _precompile(entry: str, backend: str, cfg: SelectConfig, q: torch.Tensor, num_kv_heads: int,
                *grads) -> None:
    """The first Triton call of a kind compiles its recorded kernels at once (``kernel_cache``);
    ``grads``: the tensors whose ``requires_grad`` means a backward follows."""
    if backend == "triton" and q.is_cuda and not torch.compiler.is_compiling():
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in grads)
        precompile(entry, q, num_kv_heads, grad, cfg)


def _empty_batch(q: torch.Tensor) -> bool:
    """A zero-size batch (``B = 0`` or ``Tq = 0``; zero heads or head dims fail ``check_qk``):
    the public functions return empty results of the right shapes without running an op."""
    return q.shape[0] == 0 or q.shape[1] == 0


def _empty_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``o [B, Tq, HQ, D]`` (q's dtype) and ``lse [B, HQ, Tq]`` fp32 of a zero-size batch, built
    from ``q, k, v`` so that backward runs and gives zero gradients of their shapes."""
    o = q + (k.sum() + v.sum()).to(q.dtype) * 0
    return o, o.float().sum(-1).transpose(1, 2).contiguous()


@_knob_docs
def pisa_select(q: torch.Tensor, k: torch.Tensor, *, block_size: int = _C, topk: int = _K,
                branching: int = _G, beam: int | None = None, beam_leaf: int | None = BEAM_LEAF,
                beam_ref_len: int | None = None, scorer: str = SCORER, selector: str = "pyramid",
                forced_in_budget: bool = True,
                scale: float | None = None, query_tile: int | None = None,
                tile_reduce: str = TILE_REDUCE, backend: str = "auto"):
    """Select, per query tile (16 tokens by default) and KV head, the key blocks it attends (no
    gradient).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32 (fp64 for the torch/naive backends).
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads % nheads_k == 0.
            Queries are the last ``seqlen_q`` positions of the keys (bottom-right causal).
            ``batch == 0`` or ``seqlen_q == 0`` gives empty outputs; no heads or ``headdim == 0``
            is a ``ValueError``.
    {_SELECT_DOC}
    Returns:
        block_idx: (batch, n_tiles, nheads_k, slots) int32, ascending, -1 padded; ``slots`` is
            ``topk`` (or ``topk + 3`` when ``forced_in_budget=False``). A row per query tile:
            ``n_tiles = pisa.ops.utils.config.n_query_tiles(seqlen_q, seqlen_k, query_tile)``,
            ``seqlen_q`` with ``query_tile=1``; row ``j`` holds the tile of absolute positions
            ``[(seqlen_k - seqlen_q) // query_tile + j) * query_tile, ... + query_tile)``.
            ``pisa.ops.select.tiles_to_tokens`` expands it to one row per token.
        counts: (batch, n_tiles, nheads_k) int32, the number of valid entries per row.
    """
    check_qk(q, k)
    backend = resolve_backend(backend, q)
    cfg = resolve_config(q, k, backend, block_size=block_size, topk=topk, branching=branching,
                         beam=beam, beam_leaf=beam_leaf, beam_ref_len=beam_ref_len, scorer=scorer,
                         selector=selector, forced_in_budget=forced_in_budget, scale=scale,
                         query_tile=query_tile, tile_reduce=tile_reduce)
    _precompile("pisa_select", backend, cfg, q, k.shape[-2])
    if _empty_batch(q):
        B, HKV = q.shape[0], k.shape[2]
        rows = n_query_tiles(q.shape[1], k.shape[1], cfg.query_tile)
        return (q.new_full((B, rows, HKV, cfg.slots), -1, dtype=torch.int32),
                q.new_zeros((B, rows, HKV), dtype=torch.int32))
    return select(q, k, cfg=cfg, backend=backend)


def _given_tile(block_idx: torch.Tensor, q: torch.Tensor, query_tile: int) -> int:
    """The query tile of a caller's selection: a row per token (``Tq`` rows) is always accepted
    and read per token; otherwise ``query_tile`` (``check_block_idx`` then checks its rows)."""
    per_token = isinstance(block_idx, torch.Tensor) and block_idx.dim() == 4 \
        and block_idx.shape[1] == q.shape[1]
    return 1 if per_token else query_tile


def _runs_dense(dense_below, q, k, block_idx, return_lse: bool) -> bool:
    """Whether ``pisa_attn``'s ``dense_below`` sends this call to dense attention."""
    check_nonnegative_int("dense_below", dense_below)
    if not dense_below or k.shape[1] > dense_below or q.shape[1] != k.shape[1] \
            or block_idx is not None:
        return False
    if return_lse:
        raise ValueError(f"dense_below={dense_below} would run dense attention on this "
                         f"{k.shape[1]}-key call, which cannot return the lse: pass "
                         "dense_below=0 with return_lse=True")
    return True


@_knob_docs
def pisa_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int = _C,
              topk: int = _K, branching: int = _G, beam: int | None = None,
              beam_leaf: int | None = BEAM_LEAF, beam_ref_len: int | None = None,
              scorer: str = SCORER,
              selector: str = "pyramid", forced_in_budget: bool = True,
              scale: float | None = None, query_tile: int | None = None,
              tile_reduce: str = TILE_REDUCE, return_lse: bool = False,
              block_idx: torch.Tensor | None = None, deterministic: bool = False,
              dense_below: int = 0, backend: str = "auto"):
    """PISA attention: pyramid block selection, then exact causal attention over those blocks.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype/device; GQA when nheads_k < nheads.
            Queries are the last ``seqlen_q`` positions of the keys (bottom-right causal).
            ``batch == 0`` or ``seqlen_q == 0`` gives empty outputs (and zero gradients).
    {_SELECT_DOC}
    return_lse: bool. Also return the softmax log-normaliser, to merge with other partial
        attention results. Default False.
    block_idx: optional (batch, seqlen_q, nheads_k, S) int32 precomputed selection (ascending,
        -1 padded) per token (whatever ``query_tile``), or (batch, n_tiles, nheads_k, S) per
        query tile of ``query_tile`` tokens (``pisa_select``'s layout at the same knobs); skips
        the selection step. Its values are checked
        (ids in range, strictly ascending, causal, -1 only at the end; ``ValueError`` naming the
        first bad row): one reduction over it and one host sync per call.
    deterministic: bool. Make the backward bitwise reproducible (the Triton dK/dV pass then
        sums a block's split query chunks in a fixed order instead of with atomics; slightly
        slower). The torch backend always is. Default False.
    dense_below: int. Run exact dense causal attention (torch SDPA: cuDNN / FlashAttention on
        CUDA) instead of PISA when a self-attention call (``seqlen_q == seqlen_k``, no
        ``block_idx``) has at most this many keys: below a crossover that depends on the model
        shape, selection and block overheads make PISA slower than dense (``docs/selection_v3.md``
        measures it on the H200: about 8K for the Llama-3-8B shape). Not with ``return_lse``
        (SDPA does not return it; ``ValueError``). Default 0: always PISA, so that a quality
        measurement at short context measures the sparse attention.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype. Differentiable in q, k, v; the
            selection is fixed (no gradient flows through it).
        lse (only if return_lse): (batch, nheads, seqlen_q) fp32, natural log.
    """
    check_qk(q, k, v)
    backend = resolve_backend(backend, q)
    cfg = resolve_config(q, k, backend, block_size=block_size, topk=topk, branching=branching,
                         beam=beam, beam_leaf=beam_leaf, beam_ref_len=beam_ref_len, scorer=scorer,
                         selector=selector, forced_in_budget=forced_in_budget, scale=scale,
                         query_tile=query_tile, tile_reduce=tile_reduce)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if _runs_dense(dense_below, q, k, block_idx, return_lse):
        return dense_causal_attn(q, k, v, cfg.scale)
    _precompile("pisa_attn", backend, cfg, q, k.shape[-2], q, k, v)
    tile = cfg.query_tile
    if block_idx is not None:
        tile = _given_tile(block_idx, q, tile)
        check_block_idx(block_idx, q, k, cfg.block_size, tile)
    if _empty_batch(q):
        o, lse = _empty_attn(q, k, v)
    else:
        if block_idx is None:
            block_idx, _ = select(q.detach(), k.detach(), cfg=cfg, backend=backend)
        o, lse = sparse_attn(q, k, v, block_idx, cfg=cfg, backend=backend,
                             deterministic=deterministic, query_tile=tile)
    return (o, lse) if return_lse else o


def _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  backend: str, **knobs) -> tuple[str, SelectConfig]:
    """Check packed inputs; the resolved backend and config of the selection ``knobs``."""
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_qk(q[None], k[None], None if v is None else v[None])
    backend = resolve_backend(backend, q)
    if backend == "naive":
        raise ValueError("backend='naive' has no packed-sequence form: use 'torch' or 'triton' "
                         "(or the naive pisa_attn on each sequence)")
    # selector="auto" and beam_ref_len: one choice for every sequence, by the longest
    cfg = resolve_config(q[None], k[None], backend, seqlen_k=max_seqlen_k, **knobs)
    _precompile("varlen", backend, cfg, q, k.shape[-2], *(() if v is None else (q, k, v)))
    return backend, cfg


def _layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, cfg) -> VarlenLayout:
    return varlen_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_k,
                         cfg.block_size, cfg.branching)


def _varlen_select(q, k_row, lay: VarlenLayout, cfg: SelectConfig, backend: str, q_row=None):
    """The selection ``[1, rows, HKV, S]`` (global block ids) of packed queries ``q`` against
    the layout row of keys ``k_row`` (``lay.rows``; that of ``q`` too when the caller has it)."""
    q = q.detach()
    if cfg.tile_reduce == "mass":  # a tile's rows are its own queries: the row marks them
        q_row = lay.rows(q, False, backend) if q_row is None else q_row
        return select(q_row.detach(), k_row.detach(), cfg=cfg, backend=backend, blk0=lay.blk0,
                      q_ok=lay.src_q >= 0)
    if cfg.query_tile > 1 and cfg.tile_reduce == "qmean":  # partial tiles: their own mean
        q_row = lay.mean_tile_rows(q, cfg.query_tile, backend)
    elif q_row is None:
        q_row = lay.rows(q, False, backend)
    return select(q_row.detach(), k_row.detach(), cfg=cfg, backend=backend, blk0=lay.blk0)


@_knob_docs
def pisa_select_varlen(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                       block_size: int = _C, topk: int = _K, branching: int = _G,
                       beam: int | None = None, beam_leaf: int | None = BEAM_LEAF,
                       beam_ref_len: int | None = None,
                       scorer: str = SCORER, selector: str = "pyramid",
                       forced_in_budget: bool = True, scale: float | None = None,
                       query_tile: int | None = None, tile_reduce: str = TILE_REDUCE,
                       backend: str = "auto"):
    """``pisa_select`` of packed sequences (no gradient): per query token and KV head, the blocks
    of its own sequence it attends.
    {_VARLEN_DOC}
    Returns:
        block_idx: (total_q, nheads_k, slots) int32, ascending, -1 padded: block ids counted from
            the first block of the token's sequence (row ``j`` equals row ``j - cu_seqlens_q[i]``
            of ``pisa_select`` on sequence ``i`` alone). One row per token for every
            ``query_tile`` (the tokens of a tile repeat its row); a valid ``block_idx`` of
            ``pisa_attn_varlen``.
        counts: (total_q, nheads_k) int32, the number of valid entries per row.
    """
    backend, cfg = _varlen_setup(
        q, k, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend,
        block_size=block_size, topk=topk, branching=branching, beam=beam, beam_leaf=beam_leaf,
        beam_ref_len=beam_ref_len, scorer=scorer, selector=selector, scale=scale,
        forced_in_budget=forced_in_budget, query_tile=query_tile, tile_reduce=tile_reduce)
    if q.shape[0] == 0:
        return (q.new_full((0, k.shape[1], cfg.slots), -1, dtype=torch.int32),
                q.new_zeros((0, k.shape[1]), dtype=torch.int32))
    lay = _layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, cfg)
    idx, cnt = _varlen_select(q, lay.rows(k.detach(), True, backend), lay, cfg, backend)
    rows = lay.pos_q // cfg.query_tile
    idx = idx[0].index_select(0, rows)
    idx = torch.where(idx >= 0, idx - lay.sink_q.to(torch.int32)[:, None, None], -1)
    return idx, cnt[0].index_select(0, rows)


@_knob_docs
def pisa_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, block_size: int = _C, topk: int = _K,
                     branching: int = _G, beam: int | None = None,
                     beam_leaf: int | None = BEAM_LEAF, beam_ref_len: int | None = None,
                     scorer: str = SCORER, selector: str = "pyramid",
                     forced_in_budget: bool = True, scale: float | None = None,
                     query_tile: int | None = None, tile_reduce: str = TILE_REDUCE,
                     return_lse: bool = False,
                     block_idx: torch.Tensor | None = None, deterministic: bool = False,
                     backend: str = "auto"):
    """``pisa_attn`` of packed sequences, modeled on ``flash_attn_varlen_func``: each sequence's
    output equals ``pisa_attn`` on it alone.
    {_VARLEN_DOC}
    return_lse: bool. Also return the log-normaliser. Default False.
    block_idx: optional (total_q, nheads_k, S) int32 selection per query token, block ids
        counted from its sequence's first block (``pisa_select_varlen``'s layout; checked as in
        ``pisa_attn``, with one host sync); skips the selection step (``query_tile`` is then
        unused).
    deterministic: bool. A bitwise reproducible backward (as in ``pisa_attn``). Default False.

    Returns:
        out: (total_q, nheads, headdim), q's dtype. Differentiable in q, k, v.
        lse (only if return_lse): (nheads, total_q) fp32, natural log (FlashAttention's varlen
            layout).
    """
    backend, cfg = _varlen_setup(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend,
        block_size=block_size, topk=topk, branching=branching, beam=beam, beam_leaf=beam_leaf,
        beam_ref_len=beam_ref_len, scorer=scorer, selector=selector, scale=scale,
        forced_in_budget=forced_in_budget, query_tile=query_tile, tile_reduce=tile_reduce)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if q.shape[0] == 0:
        o, lse = _empty_attn(q[None], k[None], v[None])
        return (o[0], lse[0]) if return_lse else o[0]
    lay = _layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, cfg)
    tile = cfg.query_tile
    # one copy of each into the row, differentiable, shared by the selection and the attention
    q_row = lay.rows(q, False, backend)
    k_row, v_row = lay.rows(k, True, backend), lay.rows(v, True, backend)
    if block_idx is None:
        idx, _ = _varlen_select(q, k_row, lay, cfg, backend, q_row)
    else:
        idx, tile = _varlen_block_idx(block_idx, q, k, lay, max_seqlen_k), 1
    o, lse = sparse_attn(q_row, k_row, v_row, idx, cfg=cfg, backend=backend,
                         deterministic=deterministic, query_tile=tile)
    # squeeze, not o[0]: a select's backward zero-fills and copies the whole row (2 GiB at 128K)
    o, lse = lay.unrows(o.squeeze(0), backend), lse.squeeze(0).index_select(1, lay.pos_q)
    return (o, lse) if return_lse else o


def _varlen_block_idx(block_idx, q, k, lay: VarlenLayout, max_seqlen_k: int) -> torch.Tensor:
    """A caller's per-token selection ``[total_q, HKV, S]`` (ids from each sequence's first
    block), checked, as the layout row's ``[1, length, HKV, S]`` (global ids, ``-1`` rows where
    no query sits)."""
    if not isinstance(block_idx, torch.Tensor):
        raise TypeError(f"block_idx must be a torch.Tensor, got {type(block_idx).__name__}")
    if block_idx.dtype != torch.int32:
        raise TypeError(f"block_idx must be int32, got {block_idx.dtype}")
    want = (q.shape[0], k.shape[1])
    if block_idx.dim() != 3 or tuple(block_idx.shape[:2]) != want:
        raise ValueError(f"block_idx must have shape [total_q, HKV, S] = [{want[0]}, {want[1]}, "
                         f"S], got {tuple(block_idx.shape)}")
    if block_idx.device != q.device:
        raise ValueError(f"block_idx is on {block_idx.device} but q is on {q.device}")
    C = lay.block_size
    check_block_idx_values(block_idx[None], max_seqlen_k, C, first=lay.pos_q - lay.sink_q * C)
    ids = torch.where(block_idx >= 0, block_idx + lay.sink_q.to(torch.int32)[:, None, None], -1)
    out = block_idx.new_full((lay.length, *block_idx.shape[1:]), -1)
    return out.index_copy(0, lay.pos_q, ids).unsqueeze(0)


def pisa_attn_with_kvcache(q: torch.Tensor, cache: PisaCache, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None, *,
                           cache_seqlens: torch.Tensor | int | None = None,
                           block_table: torch.Tensor | None = None,
                           cache_batch_idx: torch.Tensor | list[int] | None = None,
                           topk: int = _K, beam: int | None = None,
                           beam_leaf: int | None = DECODE_DEFAULTS["beam_leaf"],
                           beam_ref_len: int | None = None,
                           scorer: str = DECODE_DEFAULTS["scorer"], selector: str = "pyramid",
                           forced_in_budget: bool = True, scale: float | None = None,
                           query_tile: int | None = DECODE_DEFAULTS["query_tile"],
                           tile_reduce: str = DECODE_DEFAULTS["tile_reduce"],
                           return_lse: bool = False, backend: str = "auto"):
    """PISA attention of new queries against a ``PisaCache`` or ``PagedPisaCache`` (decode and
    chunked prefill), modeled on ``flash_attn_with_kvcache``: appends ``k_new, v_new`` (keys and
    pyramid), then attends.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), the cache's dtype and device. The queries are the
            last ``seqlen_q`` positions of each sequence after the append (bottom-right causal).
            ``seqlen_q == 1`` is a decode step: ``decode_triton`` (one fused kernel, no host sync,
            CUDA-graph capturable) or ``decode_torch``. ``seqlen_q > 1`` is chunked prefill
            through the training selection (on the cache's pyramid) and attention kernels; it
            syncs with the host and runs sequences of different lengths one at a time (a paged
            cache's pages gathered into one contiguous K and V per sequence and call).
            ``batch`` is the cache's ``batch_size`` (its slots), or ``len(cache_batch_idx)``.
        cache: PisaCache or PagedPisaCache. Its ``block_size`` and ``branching`` are the
            selection's ``C`` and ``g``.
        k_new, v_new: optional (batch, seqlen_new, nheads_k, headdim), appended at the end of
            every sequence before attending (a paged cache must hold their pages:
            ``PagedPisaCache.reserve``, or the caller's ``block_table``).
        cache_seqlens: None (default) or an int or (batch,) int32 tensor. None: the lengths are
            ``cache.cache_seqlens`` (of the slots ``cache_batch_idx``), and appending advances
            them by ``seqlen_new`` in place (the cache owns its lengths, and its pyramid sums
            already include the new keys, so leaving the lengths behind would count those keys
            twice at the next append). Given: the lengths before the append, owned by the
            caller as in ``flash_attn_with_kvcache`` — this call then neither reads nor
            advances ``cache.cache_seqlens``, and the caller advances its own lengths by
            ``seqlen_new``. Either way the cache's sums must hold exactly the first
            ``cache_seqlens`` keys of each sequence. Given lengths must lie in
            ``[0, max_seqlen - seqlen_new]``: an int or a CPU tensor out of range (or any, in
            chunked prefill) raises ``ValueError``; a CUDA tensor in a decode step is not read on
            the host (no sync, CUDA-graph capture still works): a length outside
            ``[0, max_seqlen]`` gives NaN rows.
        block_table: optional (batch, max_pages) int32 on the cache's device, a
            ``PagedPisaCache`` only: the caller's page table (a server's allocator, as
            ``flash_attn_with_kvcache(block_table=)``): token ``p`` of sequence ``b`` lives in
            page ``block_table[b, p // block_size]`` of the pool, row ``p % block_size``;
            ``max_pages`` must be the cache's (its pyramid geometry). Default: the cache's own
            ``block_table`` (rows ``cache_batch_idx``). Its values are checked on the host
            (pages of each sequence's first ``cache_seqlens + seqlen_new`` tokens in
            ``[0, num_pages)`` and distinct across sequences: ``ValueError`` naming the entry)
            on CPU and in chunked prefill; a CUDA decode step reads it on the device only: a
            page outside the pool among those it reads gives NaN rows, a shared page is not
            detected (check at allocation: ``pisa.ops.decode.kvcache.check_block_table``).
        cache_batch_idx: optional (batch,) int32 tensor (or list of ints) of distinct slots:
            sequence ``b`` of this call is slot ``cache_batch_idx[b]`` of the cache (its
            pyramid, its length when the cache owns them, its K/V rows when contiguous, its
            ``block_table`` row when the cache owns the table). A running batch passes its live
            slots, in any order (``PagedPisaCache.live_slots``). Default: every slot, in order.
            Checked like ``block_table`` (host: on CPU and in chunked prefill; a CUDA decode
            step gives NaN rows for a slot outside the cache).
        topk, beam, beam_leaf, beam_ref_len, scorer, selector, forced_in_budget, scale,
            query_tile, tile_reduce: as in ``pisa_attn``, but the defaults are the per-token walk
            (``pisa.ops.utils.config.DECODE_DEFAULTS``: ``scorer="lse"``, ``query_tile=1``,
            ``tile_reduce="sum"``, ``beam_leaf=None``; decode's measured bar,
            ``docs/results_decode.md``); ``selector="auto"`` and ``beam_ref_len`` go by the
            cache's ``max_seqlen``. A decode step is always per token (``query_tile`` applies to
            chunked prefill only). ``scorer="bound"`` reads the cache's per-node key bounds,
            built on first use (one O(max_seqlen) pass and an allocation: not inside a
            CUDA-graph capture; not with ``cache_batch_idx`` or a caller's ``block_table``)
            unless the cache was made with ``bounds=True``; a cache with bounds keeps them
            current at every append.
        return_lse: bool. Also return the log-normaliser. Default False.
        backend: "auto" (default: Triton on CUDA when installed, else torch) | "torch" | "triton"
            | "naive" (the fp64 oracle, one sequence at a time; tiny inputs only).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype. Row ``t`` of sequence ``b`` equals row
            ``s_b - seqlen_q + t`` of ``pisa_attn`` over the sequence's ``s_b`` keys.
        lse (only if return_lse): (batch, nheads, seqlen_q) fp32, natural log.
    """
    if not isinstance(cache, PisaCache):
        raise TypeError(f"cache must be a pisa.PisaCache, got {type(cache).__name__}")
    rows = cache.prepare(q, k_new, v_new, cache_seqlens=cache_seqlens, block_table=block_table,
                         cache_batch_idx=cache_batch_idx)
    backend = resolve_backend(backend, q)
    # C and g are the cache's; selector="auto" and beam_ref_len go by its capacity
    cfg = _step_config(q, backend, seqlen_k=cache.max_seqlen, block_size=cache.block_size,
                       branching=cache.branching, topk=topk, beam=beam, beam_leaf=beam_leaf,
                       beam_ref_len=beam_ref_len, scorer=scorer, selector=selector,
                       forced_in_budget=forced_in_budget, scale=scale, query_tile=query_tile,
                       tile_reduce=tile_reduce)
    _precompile("kvcache", backend, cfg, q, cache.k_cache.shape[-2])
    o, lse = cache.attend(q, rows, k_new, v_new, cfg=cfg, backend=backend)
    return (o, lse) if return_lse else o


# A decode step is host-bound: the config of a step's knobs is resolved once and reused.
_STEP_CONFIGS: dict[tuple, SelectConfig] = {}


def _step_config(q: torch.Tensor, backend: str, **knobs) -> SelectConfig:
    """``resolve_config(q, None, backend, **knobs)``, memoised on the knobs with their types (a
    bad knob still raises every call: only resolved configs are kept)."""
    key = (backend, q.shape[-1], tuple(knobs.items()), tuple(map(type, knobs.values())))
    try:
        cfg = _STEP_CONFIGS.get(key)
    except TypeError:  # an unhashable knob: resolve_config names it
        return resolve_config(q, None, backend, **knobs)
    if cfg is None:
        cfg = resolve_config(q, None, backend, **knobs)
        if len(_STEP_CONFIGS) >= 256:
            _STEP_CONFIGS.clear()
        _STEP_CONFIGS[key] = cfg
    return cfg
