"""Attention of new queries against a KV cache (layout of ``kvcache``): one decode step
(``decode_step``: the fused Triton kernel ``triton.decode_triton`` or
``torch_backend.decode_torch``) and chunked prefill (``prefill_with_cache``: the training selection,
on the pyramid taken from the cache's sums, and the sparse attention kernels).
"""
from __future__ import annotations

import torch

from ..attn import sparse_attn
from ..select import select
from ..utils.config import SelectConfig, check_qk
from .kvcache import check_cache, pyramid_from_sums


def check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sums: torch.Tensor, cache_seqlens: torch.Tensor, cfg: SelectConfig) -> None:
    """Validate decode inputs (metadata only: no host sync)."""
    check_cache(k_cache, v_cache, sums, cache_seqlens, cfg.block_size, cfg.branching)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    B, _, H, D = k_cache.shape
    if q.dim() != 4 or q.shape[0] != B or q.shape[1] != 1 or q.shape[3] != D \
            or q.shape[2] % H:
        raise ValueError(f"q must have shape [B={B}, 1, HQ, D={D}] with HQ a multiple of "
                         f"HKV={H}, got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype or q.device != k_cache.device:
        raise TypeError(f"q must be {k_cache.dtype} on {k_cache.device} like the cache, got "
                        f"{q.dtype} on {q.device}")
    if cfg.selector not in ("pyramid", "flat_lse", "flat_mean"):
        raise ValueError(f"cfg.selector must be resolved (pyramid, flat_lse or flat_mean), got "
                         f"{cfg.selector!r}")


def decode_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                sums: torch.Tensor, cache_seqlens: torch.Tensor, cfg: SelectConfig, backend: str):
    """One decode step for inputs the caller checked (``check_decode``): the fused kernel walks
    the pyramid with LSE scores on ``backend="triton"``; flat scans and the scorer ablations
    decode through the torch path. Returns ``o [B, 1, HQ, D]``, ``lse [B, HQ, 1]`` fp32."""
    if backend == "triton" and cfg.selector == "pyramid" and cfg.scorer == "lse":
        from .triton import decode_triton
        return decode_triton(q, k_cache, v_cache, sums, cache_seqlens, cfg)
    from .torch_backend import decode_torch
    return decode_torch(q, k_cache, v_cache, sums, cache_seqlens, cfg)


def prefill_with_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       sums: torch.Tensor, seqlens: list[int], cfg: SelectConfig, backend: str):
    """Chunked prefill: queries ``q [B, L, HQ, D]`` at the last ``L`` positions of each
    sequence's first ``seqlens[b]`` keys (bottom-right causal), whose keys are already appended.

    Selection runs on the pyramid taken from the cache's sums (``pyramid_from_sums``) for the
    ``torch`` and ``triton`` backends (``naive`` builds its own from the keys), then
    ``sparse_attn``. Sequences of equal length go through together; otherwise one at a time.
    ``seqlens`` are host ints (prefill may sync). Returns ``o`` (q's dtype), ``lse [B, HQ, L]``
    fp32.
    """
    groups = [slice(None)] if len(set(seqlens)) == 1 else [slice(b, b + 1)
                                                           for b in range(q.shape[0])]
    outs, lses = [], []
    for rows in groups:
        s = seqlens[rows][0]
        qb, k, v = q[rows], k_cache[rows, :s], v_cache[rows, :s]
        check_qk(qb, k, v)
        pyramid = None if backend == "naive" else pyramid_from_sums(sums[rows], s, cfg.block_size,
                                                                    cfg.branching)
        block_idx, _ = select(qb.detach(), k, cfg, backend, pyramid)
        o, lse = sparse_attn(qb, k, v, block_idx, cfg.block_size, cfg.scale, backend)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
