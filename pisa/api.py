"""Public functions: ``pisa_select`` (block selection) and ``pisa_attn`` (selection + attention)."""
from __future__ import annotations

import importlib.util

import torch

from .ops.attn import sparse_attn
from .ops.select import select
from .ops.utils import BACKENDS, check_block_idx, check_qk, resolve_config

_SELECT_DOC = """
    block_size: int. Keys per leaf block ``C`` (power of two in [4, 256]; Triton needs >= 16).
        Default 64.
    topk: int. Blocks attended per query ``K`` (the budget). Default 16. With
        ``forced_in_budget=True`` it includes the forced blocks (sink, previous, current) and must
        be >= 3.
    branching: int. Pyramid branching factor ``g``. Default 2 (4 is cheaper and coarser).
    beam: int or None. Beam width ``W`` kept at internal levels. Default ``topk``. Wider beams
        cost time and raise recall against the exact flat scan.
    scorer: "lse" (default) | "mean" | "meanvar". How an internal node is scored from its
        children (and a leaf from its keys): count-weighted LogSumExp, mean logit (first order,
        equals flat mean-pooled scoring) or mean + variance/2 (second order). Pyramid only.
    selector: "pyramid" (default) | "flat_lse" | "flat_mean" | "auto". ``flat_lse`` scores every
        causal block by its exact LSE (the mass-optimal oracle, O(N^2)); ``flat_mean`` by the
        logit of its mean key (BSA/MoBA style); ``auto`` takes ``flat_lse`` below
        ``pisa.ops.utils.AUTO_CROSSOVER_T`` keys and the pyramid above.
    forced_in_budget: bool. Count the forced blocks inside ``topk`` (default) or add them on top
        (then ``block_idx`` has ``topk + 3`` slots).
    scale: float or None. Softmax scale; default ``D ** -0.5``.
    backend: "auto" (default: Triton on CUDA when installed, else torch) | "torch" | "triton"
        | "naive" (the fp64 loop oracle; tiny inputs only).
"""


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        has_triton = importlib.util.find_spec("triton") is not None
        return "triton" if q.is_cuda and has_triton else "torch"
    return backend


def pisa_select(q: torch.Tensor, k: torch.Tensor, *, block_size: int = 64, topk: int = 16,
                branching: int = 2, beam: int | None = None, scorer: str = "lse",
                selector: str = "pyramid", forced_in_budget: bool = True,
                scale: float | None = None, backend: str = "auto"):
    """Select, per query token and KV head, the key blocks it attends (no gradient).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32 (fp64 for the torch/naive backends).
        k: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads % nheads_k == 0.
            Queries are the last ``seqlen_q`` positions of the keys (bottom-right causal).
    """ + _SELECT_DOC + """
    Returns:
        block_idx: (batch, seqlen_q, nheads_k, slots) int32, ascending, -1 padded; ``slots`` is
            ``topk`` (or ``topk + 3`` when ``forced_in_budget=False``).
        counts: (batch, seqlen_q, nheads_k) int32, the number of valid entries per row.
    """
    check_qk(q, k)
    cfg = resolve_config(q, k, block_size=block_size, topk=topk, branching=branching, beam=beam,
                         scorer=scorer, selector=selector, forced_in_budget=forced_in_budget,
                         scale=scale)
    return select(q, k, cfg, _resolve_backend(backend, q))


def pisa_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int = 64,
              topk: int = 16, branching: int = 2, beam: int | None = None, scorer: str = "lse",
              selector: str = "pyramid", forced_in_budget: bool = True,
              scale: float | None = None, return_lse: bool = False,
              block_idx: torch.Tensor | None = None, backend: str = "auto"):
    """PISA attention: pyramid block selection, then exact causal attention over those blocks.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), fp16/bf16/fp32.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype/device; GQA when nheads_k < nheads.
            Queries are the last ``seqlen_q`` positions of the keys (bottom-right causal).
    """ + _SELECT_DOC + """
    return_lse: bool. Also return the softmax log-normaliser, to merge with other partial
        attention results. Default False.
    block_idx: optional (batch, seqlen_q, nheads_k, S) int32 precomputed selection (ascending,
        -1 padded); skips the selection step.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype. Differentiable in q, k, v; the
            selection is fixed (no gradient flows through it).
        lse (only if return_lse): (batch, nheads, seqlen_q) fp32, natural log.
    """
    check_qk(q, k, v)
    cfg = resolve_config(q, k, block_size=block_size, topk=topk, branching=branching, beam=beam,
                         scorer=scorer, selector=selector, forced_in_budget=forced_in_budget,
                         scale=scale)
    backend = _resolve_backend(backend, q)
    if block_idx is None:
        block_idx, _ = pisa_select(q.detach(), k.detach(), block_size=block_size, topk=topk,
                                   branching=branching, beam=beam, scorer=scorer,
                                   selector=selector, forced_in_budget=forced_in_budget,
                                   scale=cfg.scale, backend=backend)
    else:
        check_block_idx(block_idx, q, k)
    o, lse = sparse_attn(q, k, v, block_idx, cfg.block_size, cfg.scale, backend)
    return (o, lse) if return_lse else o
