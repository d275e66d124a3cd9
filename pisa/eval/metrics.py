"""Selection diagnostics: recall@K against the exact flat scan, captured attention mass, error.

All of them stream over query chunks: memory O(chunk · Tk), never ``[T, T]`` at once.
"""
from __future__ import annotations

import math

import torch

from ..api import pisa_attn, pisa_select
from ..ops.select import tiles_to_tokens
from ..ops.utils.config import CHUNK_ELEMS, SelectConfig, default_scale, query_tile_of


def _forced_mask(block_idx: torch.Tensor, n_keys: int, block_size: int) -> torch.Tensor:
    """True where an entry of ``block_idx [B, Tq, H, S]`` is a forced block of its query."""
    Tq = block_idx.shape[1]
    cur = (torch.arange(n_keys - Tq, n_keys, device=block_idx.device) // block_size)
    cur = cur[None, :, None, None]
    b = block_idx.long()
    return (b == 0) | (b == cur) | (b == cur - 1)


def recall_at_k(block_idx: torch.Tensor, oracle_idx: torch.Tensor, n_keys: int,
                block_size: int) -> float:
    """Share of the oracle's free (non-forced) blocks that ``block_idx`` also selected.

    Forced blocks (sink, previous, current) are excluded from both sides; rows where the oracle has
    no free block are skipped. Both index tensors are ``[B, Tq, HKV, S]`` (-1 padded).
    """
    sel = torch.where(_forced_mask(block_idx, n_keys, block_size), -1, block_idx.long())
    ora = torch.where(_forced_mask(oracle_idx, n_keys, block_size), -1, oracle_idx.long())
    hit = ((ora[..., :, None] == sel[..., None, :]) & (ora[..., :, None] >= 0)).any(-1)
    n_ora = (ora >= 0).sum(-1)
    rows = n_ora > 0
    if not rows.any():
        return math.nan
    return float((hit.sum(-1)[rows] / n_ora[rows]).mean())


def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal (bottom-right) logsumexp of every query over all its keys: ``[B, HQ, Tq]`` fp32."""
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G = HQ // H
    out = torch.empty(B, HQ, Tq, device=q.device)
    step = max(1, CHUNK_ELEMS // (B * HQ * Tk))
    kf = k.float()
    for s in range(0, Tq, step):
        e = min(Tq, s + step)
        z = torch.einsum("bthgd,bshd->bhgts", q[:, s:e].float().view(B, e - s, H, G, D), kf)
        pos = torch.arange(Tk - Tq + s, Tk - Tq + e, device=q.device)
        z = z.masked_fill(torch.arange(Tk, device=q.device) > pos[:, None], -math.inf) * scale
        out[:, :, s:e] = torch.logsumexp(z, dim=-1).reshape(B, HQ, e - s)
    return out


def captured_mass(q: torch.Tensor, k: torch.Tensor, block_idx: torch.Tensor, block_size: int,
                  scale: float | None = None, full_lse: torch.Tensor | None = None,
                  backend: str = "auto") -> float:
    """Mean over (batch, head, token) of the share of the true causal softmax mass that falls in
    the selected blocks: ``exp(lse_selected - lse_all)``. Pass ``full_lse`` to reuse it."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if full_lse is None:
        full_lse = dense_lse(q, k, scale)
    _, lse = pisa_attn(q, k, k, block_size=block_size, scale=scale, block_idx=block_idx,
                       return_lse=True, backend=backend)
    return float(torch.exp(lse - full_lse).mean())


def output_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp32."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


class SelectionScorer:
    """Scores selections for one ``q [B, Tq, HQ, D]``, ``k [B, Tk, HKV, D]`` against the exact
    flat scan (``flat_lse``, the mass-optimal top-K): its selection and the dense LSE are computed
    once. ``knobs`` are ``pisa_select`` keyword arguments (block_size, topk, branching, ...;
    ``pisa_select``'s defaults select per 16-token tile). The oracle is per token
    (``query_tile=1``) whatever the knobs.

    ``scorer(block_idx)`` -> ``{"recall", "mass", "mass_ratio"}``: recall@K of the oracle's free
    blocks, the softmax mass the selection captures, and that mass over the oracle's; ``block_idx``
    per token ``[B, Tq, HKV, S]`` (``select`` gives tile selections in that form).
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, backend: str = "auto", **knobs):
        self.q, self.k, self.backend = q, k, backend
        self.block_size = knobs.get("block_size", SelectConfig.block_size)
        self.scale = knobs.pop("scale", None) or default_scale(q.shape[-1])
        self.knobs = knobs
        self.full = dense_lse(q, k, self.scale)
        # per token every tile reduction is the token's own group score ("mass" has no flat form)
        self.oracle = self.select("flat_lse", query_tile=1, tile_reduce="sum")
        self.oracle_mass = self.mass(self.oracle)

    def select(self, selector: str, **overrides) -> torch.Tensor:
        """``block_idx`` of ``selector`` with this scorer's knobs (``overrides`` on top), per
        token ``[B, Tq, HKV, S]``: a tile selection's rows repeated for each token of the tile."""
        knobs = self.knobs | overrides
        idx, cnt = pisa_select(self.q, self.k, selector=selector, scale=self.scale,
                               backend=self.backend, **knobs)
        qt = query_tile_of(knobs.get("query_tile"), self.block_size)
        return tiles_to_tokens(idx, cnt, self.q.shape[1], self.k.shape[1], qt)[0]

    def mass(self, block_idx: torch.Tensor) -> float:
        return captured_mass(self.q, self.k, block_idx, self.block_size, self.scale, self.full,
                             self.backend)

    def __call__(self, block_idx: torch.Tensor) -> dict[str, float]:
        mass = self.mass(block_idx)
        return {"recall": recall_at_k(block_idx, self.oracle, self.k.shape[1], self.block_size),
                "mass": mass, "mass_ratio": mass / self.oracle_mass}


def selection_report(q: torch.Tensor, k: torch.Tensor, selectors=("pyramid", "flat_mean"),
                     backend: str = "auto", **knobs) -> dict[str, dict[str, float]]:
    """Recall@K, captured mass and mass ratio of each selector against ``flat_lse``.

    ``knobs`` are ``pisa_select`` keyword arguments (block_size, topk, beam, ...). Returns
    ``{selector: {"recall", "mass", "mass_ratio"}}`` including ``flat_lse`` itself.
    """
    scorer = SelectionScorer(q, k, backend, **knobs)
    report = {"flat_lse": {"recall": 1.0, "mass": scorer.oracle_mass, "mass_ratio": 1.0}}
    for name in selectors:
        report[name] = scorer(scorer.select(name))
    return report
