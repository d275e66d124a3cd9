"""Block selection, vectorised PyTorch backend (CPU and CUDA): pyramid walk, flat_lse, flat_mean.

Semantics are those of ``naive.naive_select``. Queries are processed in chunks so that memory stays
O(chunk · (W + forced) · g · D) for the walk; the pyramid's exact leaf stage groups (query, leaf)
pairs by leaf so that each leaf's keys are read once per group of up to ``PAIRS_PER_GROUP`` queries
rather than once per query (IO per pair drops from ``C·D`` to about ``(G + C/PAIRS_PER_GROUP)·D``).
"""
from __future__ import annotations

import math

import torch

from ..pyramid import Pyramid
from ..pyramid.torch_backend import build_pyramid_torch
from ..utils.config import CHUNK_ELEMS, MAX_FORCED, PAIRS_PER_GROUP, SelectConfig
from ..utils.csr import group_pairs
from ..utils.geometry import cdiv, compute_dtype, forced_leaves_tensor


def is_in(x: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """``x [B, Tc, H, A]`` elementwise membership in ``members [Tc, F]`` or ``[B, Tc, F]``
    (-1 never matches)."""
    hit = x[..., :, None] == members[..., None, None, :]
    return hit.any(-1) & (x >= 0)


def _logsumexp(z: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, in place on ``z`` (faster than torch.logsumexp on CPU).

    Rows that are all -inf give -inf."""
    m = z.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    return z.sub_(m).exp_().sum(-1).log_().add_(m[..., 0])


def group_score(z: torch.Tensor, weight: torch.Tensor, scorer: str,
                unit_weight: bool = False) -> torch.Tensor:
    """Reduce child logits ``z [..., G, R]`` with child counts ``weight [..., 1, R]`` (0 = absent)
    to the GQA group score ``[...]`` (sum over the G heads of the per-head score). Consumes ``z``.
    ``unit_weight`` says every weight is 1 (a leaf's keys)."""
    if scorer == "lse":
        per_head = _logsumexp(z if unit_weight else z + weight.log())
    else:
        wsum = weight.sum(-1)
        zw = torch.where(weight > 0, z, 0.0)
        mu = (zw * weight).sum(-1) / wsum
        per_head = mu
        if scorer == "meanvar":
            per_head = mu + 0.5 * (((zw - mu[..., None]) ** 2) * weight).sum(-1) / wsum
    return per_head.sum(-1)


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [B, N, H, D]`` gathered at ``idx [B, Tc, H, M]`` (clamped) -> ``[B, Tc, H, M, D]``."""
    B, N, H, D = x.shape
    _, Tc, _, M = idx.shape
    flat = x.permute(0, 2, 1, 3).reshape(B * H * N, D)
    base = (torch.arange(B, device=x.device)[:, None] * H
            + torch.arange(H, device=x.device)[None, :]) * N  # [B, H]
    gidx = idx.clamp(0, N - 1) + base[:, None, :, None]
    return flat[gidx.reshape(-1)].view(B, Tc, H, M, D)


def _exact_leaf_scores(qs, k_blocks, cand, scorer):
    """Exact per-leaf scores over every key of each candidate leaf.

    ``qs [B, Tc, H, G, D]`` scaled queries, ``k_blocks [B*H*N, C, D]``, ``cand [B, Tc, H, M]``
    (leaf ids, -1 = none). Returns ``[B, Tc, H, M]`` with -inf where ``cand < 0``. Pairs are
    grouped by leaf so each group of queries shares one read of the leaf's keys.
    """
    B, Tc, H, G, D = qs.shape
    N = k_blocks.shape[0] // (B * H)
    out = torch.full(cand.shape, -math.inf, dtype=qs.dtype, device=qs.device)
    b, t, h, m = torch.nonzero(cand >= 0, as_tuple=True)
    if b.numel() == 0:
        return out
    pg = group_pairs((b * H + h) * N + cand[b, t, h, m].long(), B * H * N, PAIRS_PER_GROUP)
    q_rows = torch.cat([qs.reshape(-1, G, D), qs.new_zeros(1, G, D)])  # last row: empty slot
    qbuf = q_rows[pg.layout((b * Tc + t) * H + h, q_rows.shape[0] - 1)]
    z = torch.bmm(qbuf.view(pg.n_groups, PAIRS_PER_GROUP * G, D),
                  k_blocks[pg.block].transpose(1, 2))
    z = z.view(pg.n_groups, PAIRS_PER_GROUP, G, -1)
    score = group_score(z, torch.ones_like(z[..., :1, :]), scorer, unit_weight=True)
    o = pg.order
    out[b[o], t[o], h[o], m[o]] = score[pg.group, pg.slot]
    return out


def _top(score: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` best scores along the last dim and their positions, exact ties to the earlier
    position: candidates are laid out in ascending block order, so ties go to the lower block
    (the oracle's rule; ``torch.topk`` orders ties arbitrarily)."""
    best, pos = torch.sort(score, dim=-1, descending=True, stable=True)
    return best[..., :width], pos[..., :width]


def finish_selection(cand, score, forced, cfg: SelectConfig):
    """Merge forced leaves with the best free candidates; sort ascending; pad with -1.

    ``cand [B, Tc, H, M]`` (-1 = none; the others ascending), ``score`` the same shape (-inf = not
    rankable), ``forced [Tc, 3]`` or ``[B, Tc, 3]`` (``forced_leaves_tensor``).
    """
    B, Tc, H, M = cand.shape
    n_forced = (forced >= 0).sum(-1)  # [Tc]
    budget = torch.tensor([cfg.free_budget(int(f)) for f in range(MAX_FORCED + 1)],
                          device=cand.device)[n_forced]
    width = min(M, max(cfg.free_budget(1), 0))
    best, pos = _top(score, width)
    in_budget = torch.arange(width, device=cand.device) < budget[..., None, None]
    take = torch.isfinite(best) & in_budget
    chosen = torch.where(take, torch.gather(cand, -1, pos), -1)
    forced_b = forced[..., None, :].expand(B, Tc, H, MAX_FORCED)
    merged = torch.cat([forced_b, chosen], dim=-1)
    big = torch.iinfo(torch.int64).max
    merged = torch.sort(torch.where(merged >= 0, merged.long(), big), dim=-1).values
    merged = merged[..., :cfg.slots]
    counts = (merged != big).sum(-1)
    if merged.shape[-1] < cfg.slots:
        pad = merged.new_full((B, Tc, H, cfg.slots - merged.shape[-1]), big)
        merged = torch.cat([merged, pad], dim=-1)
    idx = torch.where(merged == big, -1, merged).to(torch.int32)
    return idx, counts.to(torch.int32)


def walk(qs, pyr: Pyramid, t_abs, forced, cfg: SelectConfig):
    """Beam search from the root to level 2; returns candidate leaves ``[B, Tc, H, M]`` (valid ones
    ascending: each level's nodes are the children of the kept nodes, sorted).

    ``t_abs [Tc]`` or ``[B, Tc]`` (positions per sequence, as in decode), ``forced`` its forced
    leaves (``forced_leaves_tensor``)."""
    B, Tc, H, G, D = qs.shape
    g, C = cfg.branching, cfg.block_size
    dev = qs.device
    active = torch.zeros(B, Tc, H, 1, dtype=torch.long, device=dev)
    kids = torch.arange(g, device=dev)
    for lvl in range(pyr.n_levels, 1, -1):
        span = g ** (lvl - 1)
        child_means, child_counts = pyr.level(lvl - 1)
        n_child = child_counts.shape[0]
        valid = (active >= 0) & (active * span * C <= t_abs[..., None, None])
        forced_here = torch.where(forced >= 0, forced // span, -1)
        is_forced = is_in(active, forced_here) & valid
        rest = valid & ~is_forced
        if active.shape[-1] > cfg.beam:
            child = active[..., None] * g + kids  # [B, Tc, H, A, g]
            child_ok = rest[..., None] & (child < n_child)
            cm = _gather_rows(child_means, child.flatten(-2)).view(*child.shape, D)
            z = torch.einsum("bthgd,bthard->bthagr", qs, cm)
            w = torch.where(child_ok, child_counts[child.clamp(0, n_child - 1)].to(qs.dtype), 0.0)
            score = group_score(z, w[..., None, :], cfg.scorer)
            score = torch.where(rest, score, -math.inf)
            width = min(cfg.beam, score.shape[-1])
            best, pos = _top(score, width)
            top = torch.zeros_like(rest).scatter_(-1, pos, torch.isfinite(best))
            rest = rest & top
        keep = is_forced | rest
        big = torch.iinfo(torch.long).max
        kept = torch.sort(torch.where(keep, active, big), dim=-1).values
        kept = kept[..., :cfg.beam + MAX_FORCED]
        child = kept[..., None] * g + kids
        child = torch.where((kept[..., None] != big) & (child < n_child), child, -1)
        active = child.flatten(-2)
    return active


def select_torch(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig,
                 pyramid: Pyramid | None = None):
    """Vectorised selection; returns ``(block_idx [B, Tq, HKV, slots] int32, counts [B, Tq, HKV])``.

    Runs under ``torch.no_grad``: selection is not differentiable.
    """
    with torch.no_grad():
        return _select(q, k, cfg, pyramid)


def _select(q, k, cfg, pyramid):
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G, C = HQ // H, cfg.block_size
    N = cdiv(Tk, C)
    dev = q.device
    ct = compute_dtype(q)
    if pyramid is None:
        pyramid = build_pyramid_torch(k, C, cfg.branching)
    leaf_means = pyramid.level(1)[0]
    k_blocks = None
    if cfg.selector == "pyramid" and cfg.scorer != "mean":
        kp = torch.nn.functional.pad(k.to(ct), (0, 0, 0, 0, 0, N * C - Tk))
        k_blocks = kp.view(B, N, C, H, D).permute(0, 3, 1, 2, 4).reshape(B * H * N, C, D)
    if cfg.selector == "pyramid":
        width = cfg.branching * (cfg.beam + MAX_FORCED)
        per_token = B * H * width * max(G * D, cfg.branching * D)
    elif cfg.selector == "flat_lse":
        per_token = B * HQ * (Tk + C)
    else:
        per_token = B * H * (N + D)
    chunk = max(16, min(Tq, CHUNK_ELEMS // max(per_token, 1)))
    idx_out = torch.empty(B, Tq, H, cfg.slots, dtype=torch.int32, device=dev)
    cnt_out = torch.empty(B, Tq, H, dtype=torch.int32, device=dev)
    for s in range(0, Tq, chunk):
        e = min(Tq, s + chunk)
        t_abs = torch.arange(Tk - Tq + s, Tk - Tq + e, device=dev)
        forced = forced_leaves_tensor(t_abs, C)
        qs = q[:, s:e].to(ct).view(B, e - s, H, G, D) * cfg.scale
        if cfg.selector == "pyramid":
            cand = walk(qs, pyramid, t_abs, forced, cfg)
            free = (cand >= 0) & (cand * C <= t_abs[None, :, None, None]) & ~is_in(cand, forced)
            cand = torch.where(free, cand, -1)
            if cfg.scorer == "mean":
                score = flat_mean_scores(qs, leaf_means, cand)
            else:
                score = _exact_leaf_scores(qs, k_blocks, cand, cfg.scorer)
        else:
            n_end = int(t_abs[-1]) // C + 1
            cand = torch.arange(n_end, device=dev).expand(B, e - s, H, n_end)
            free = (cand * C <= t_abs[None, :, None, None]) & ~is_in(cand, forced)
            if cfg.selector == "flat_lse":
                score = _flat_lse_scores(qs, k, n_end * C, C)
            else:
                score = torch.einsum("bthd,bnhd->bthn", qs.sum(3), leaf_means[:, :n_end])
            score = torch.where(free, score, -math.inf)
            cand = torch.where(free, cand, -1)
        idx_out[:, s:e], cnt_out[:, s:e] = finish_selection(cand, score, forced, cfg)
    return idx_out, cnt_out


def flat_mean_scores(qs, leaf_means, cand):
    """``sum_h scale q_h . mean_leaf`` for candidate leaves (-inf where ``cand < 0``)."""
    rows = _gather_rows(leaf_means, cand)  # [B, Tc, H, M, D]
    score = torch.einsum("bthd,bthmd->bthm", qs.sum(3), rows)
    return torch.where(cand >= 0, score, -math.inf)


def _flat_lse_scores(qs, k, n_keys, block_size):
    """Exact block LSE of every block in ``[0, n_keys)``, summed over the group's heads."""
    B, Tc, H, G, D = qs.shape
    Tk = k.shape[1]
    kk = k[:, :min(n_keys, Tk)].to(qs.dtype)
    z = torch.einsum("bthgd,bshd->bthgs", qs, kk)
    if z.shape[-1] < n_keys:
        z = torch.nn.functional.pad(z, (0, n_keys - z.shape[-1]), value=-math.inf)
    z = z.view(B, Tc, H, G, n_keys // block_size, block_size)
    return _logsumexp(z).sum(3)
