"""Block selection, vectorised PyTorch backend (CPU and CUDA): pyramid walk, flat_lse, flat_mean.

Semantics are those of ``naive.naive_select``, per query tile (``cfg.query_tile`` tokens; one by
default). Tiles are processed in chunks so that memory stays O(chunk · (W + forced) · g · Qt·G ·
max(C, D)) for the walk and the leaf stage; the pyramid's exact leaf stage scores a tile's
``Qt·G`` query rows against a candidate leaf's ``C`` keys in one product, and groups (tile, leaf)
pairs by leaf so that each leaf's keys are read once per group of up to ``PAIRS_PER_GROUP``
query tokens rather than once per tile (IO per token drops from ``C·D`` to about
``(G + C/PAIRS_PER_GROUP)·D``).

Layout of the scaled queries: ``qs [B, Tc, H, Qt, G, D]`` (a tile's tokens, then the heads of the
group); the decode step's per-token ``[B, Tc, H, G, D]`` is accepted as ``Qt = 1``. Per-token
group scores ``[..., Qt]`` reduce to a tile's score by ``reduce_tokens``; ``tile_reduce="qmean"``
tiles hold one token, their per-head mean query (``_tile_queries``).
"""
from __future__ import annotations

import math

import torch

from ..pyramid import Pyramid
from ..pyramid.torch_backend import build_pyramid_torch
from ..utils.config import (CHUNK_ELEMS, MAX_FORCED, PAIRS_PER_GROUP, SelectConfig,
                            mass_row_tokens, n_query_tiles)
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


def reduce_tokens(score: torch.Tensor, ok: torch.Tensor | None, tile_reduce: str) -> torch.Tensor:
    """A tile's score from its tokens' group scores ``score [..., Qt]``: their sum or log-sum-exp
    (``tile_reduce``) over the tokens where ``ok`` (broadcastable bool; ``None``: all) holds
    (``"qmean"`` tiles hold one token, the mean query: its score). Consumes ``score``."""
    if tile_reduce != "lse":
        return (score if ok is None else torch.where(ok, score, 0.0)).sum(-1)
    return _logsumexp(score if ok is None else torch.where(ok, score, -math.inf))


def _as_tiles(qs: torch.Tensor) -> torch.Tensor:
    """Per-token queries ``[B, Tc, H, G, D]`` as tiles of one token ``[B, Tc, H, 1, G, D]``."""
    return qs if qs.dim() == 6 else qs.unsqueeze(3)


def _tile_ok(tok_ok: torch.Tensor | None) -> torch.Tensor | None:
    """``tok_ok [Tc, Qt]`` broadcast against scores ``[B, Tc, H, X, Qt]``."""
    return None if tok_ok is None else tok_ok[:, None, None, :]


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [B, N, H, D]`` gathered at ``idx [B, Tc, H, M]`` (clamped) -> ``[B, Tc, H, M, D]``."""
    B, N, H, D = x.shape
    _, Tc, _, M = idx.shape
    flat = x.permute(0, 2, 1, 3).reshape(B * H * N, D)
    base = (torch.arange(B, device=x.device)[:, None] * H
            + torch.arange(H, device=x.device)[None, :]) * N  # [B, H]
    gidx = idx.clamp(0, N - 1) + base[:, None, :, None]
    return flat[gidx.reshape(-1)].view(B, Tc, H, M, D)


def _exact_leaf_scores(qs, k_blocks, cand, scorer, tok_ok, tile_reduce):
    """Exact per-leaf scores over every key of each candidate leaf.

    ``qs [B, Tc, H, Qt, G, D]`` scaled queries, ``k_blocks [B*H*N, C, D]``, ``cand [B, Tc, H, M]``
    (leaf ids, -1 = none; every one ends before its tile's block, so no key needs a causal mask),
    ``tok_ok [Tc, Qt]`` (which tokens are queries). Returns ``[B, Tc, H, M]`` with -inf where
    ``cand < 0``. Pairs are grouped by leaf so each group of tiles shares one read of the leaf's
    keys: one product of the group's ``tiles · Qt · G`` query rows with its ``C`` keys.
    ``tile_reduce="mass"``: ``qs`` holds the tile's mass rows (``_mass_rows``) and a leaf scores
    the sum of their softmax shares among the tile's candidates (``mass_fold``).
    """
    B, Tc, H, Qt, G, D = qs.shape
    N = k_blocks.shape[0] // (B * H)
    mass = tile_reduce == "mass"
    out = torch.full(cand.shape + ((Qt, G) if mass else ()), -math.inf, dtype=qs.dtype,
                     device=qs.device)
    b, t, h, m = torch.nonzero(cand >= 0, as_tuple=True)
    if b.numel():
        size = max(1, PAIRS_PER_GROUP // Qt)  # tiles per group: about PAIRS_PER_GROUP tokens
        pg = group_pairs((b * H + h) * N + cand[b, t, h, m].long(), B * H * N, size)
        rows = Qt * G
        q_rows = torch.cat([qs.reshape(-1, rows, D), qs.new_zeros(1, rows, D)])  # last: empty
        qbuf = q_rows[pg.layout((b * Tc + t) * H + h, q_rows.shape[0] - 1)]
        z = torch.bmm(qbuf.view(pg.n_groups, size * rows, D), k_blocks[pg.block].transpose(1, 2))
        z = z.view(pg.n_groups, size, Qt, G, -1)
        o = pg.order
        if mass:
            out[b[o], t[o], h[o], m[o]] = _logsumexp(z)[pg.group, pg.slot]
        else:
            score = group_score(z, torch.ones_like(z[..., :1, :]), scorer, unit_weight=True)
            out[b[o], t[o], h[o], m[o]] = reduce_tokens(score[pg.group, pg.slot], tok_ok[t[o]],
                                                        tile_reduce)
    return mass_fold(out, tok_ok) if mass else out


def mass_fold(lse: torch.Tensor, row_ok: torch.Tensor) -> torch.Tensor:
    """``tile_reduce="mass"`` scores ``[B, Tc, H, M]`` from the per-row LSE of each candidate
    ``lse [B, Tc, H, M, R, G]`` (-inf: no candidate): per row (``row_ok [Tc, R]`` the real ones)
    its softmax share of each candidate among the tile's, summed over the rows; -inf where there
    is no candidate."""
    share = torch.exp(lse - torch.logsumexp(lse, 3, keepdim=True)).nan_to_num_(0.0)
    score = (share * row_ok[:, None, None, :, None]).sum((-1, -2))
    return torch.where(torch.isfinite(lse[..., 0, 0]), score, -math.inf)


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


def _level_bounds(pyr: Pyramid, lvl: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mins, maxs) [B, N_l, HKV, D]`` of 1-based level ``lvl`` (a pyramid built with bounds)."""
    lo, hi = pyr.offsets[lvl - 1], pyr.offsets[lvl]
    return pyr.mins[:, lo:hi], pyr.maxs[:, lo:hi]


def bound_logits(rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``sum_d max(q_d lo_d, q_d hi_d)``, the largest ``q . k`` over keys ``k`` in the box
    ``[lo, hi]`` (a node's per-channel key min and max): scaled query rows ``rows [B, Tc, H, M, D]``
    against boxes ``lo, hi [B, Tc, H, A, R, D]`` -> ``[B, Tc, H, A, M, R]``. Computed as
    ``q+ . hi + q- . lo`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``): two products, no temporary of
    ``D`` values per logit."""
    return (torch.einsum("bthmd,bthard->bthamr", rows.clamp_min(0), hi)
            + torch.einsum("bthmd,bthard->bthamr", rows.clamp_max(0), lo))


def walk(qs, pyr: Pyramid, t_abs, forced, cfg: SelectConfig, tok_ok=None, sink=None):
    """Beam search from the root to level 2; returns candidate leaves ``[B, Tc, H, M]`` (valid ones
    ascending: each level's nodes are the children of the kept nodes, sorted).

    ``qs`` scaled queries ``[B, Tc, H, Qt, G, D]`` (tiles) or ``[B, Tc, H, G, D]`` (tokens);
    ``t_abs [Tc]`` or ``[B, Tc]`` (positions per sequence, as in decode): a position inside the
    row's block (the token's, or the tile's last query), ``forced`` its forced leaves
    (``forced_leaves_tensor``), ``tok_ok [Tc, Qt]`` which tile tokens are queries (``None``: all).
    Nodes are ranked by the tile score (``reduce_tokens``) of their group scores; ``scorer="bound"``
    needs ``pyr`` built with bounds. ``sink [Tc]`` (a packed layout): the first leaf of each row's
    sequence; nodes that end before it are never candidates (default: 0)."""
    qs = _as_tiles(qs)
    B, Tc, H, Qt, G, D = qs.shape
    g, C = cfg.branching, cfg.block_size
    dev = qs.device
    rows = qs.flatten(3, 4)  # [B, Tc, H, Qt*G, D]: a tile's query rows, token-major
    bound = cfg.scorer == "bound"
    if bound and pyr.mins is None:
        raise ValueError("scorer='bound' needs a pyramid built with bounds=True (per-node key "
                         "mins and maxs)")
    scorer = "lse" if bound else cfg.scorer
    ok = _tile_ok(tok_ok)
    active = torch.zeros(B, Tc, H, 1, dtype=torch.long, device=dev)
    kids = torch.arange(g, device=dev)
    for lvl in range(pyr.n_levels, 1, -1):
        span = g ** (lvl - 1)
        beam = cfg.beam_at(lvl)
        child_means, child_counts = pyr.level(lvl - 1)
        n_child = child_counts.shape[0]
        valid = (active >= 0) & (active * span * C <= t_abs[..., None, None])
        if sink is not None:
            valid &= (active + 1) * span > sink[:, None, None]
        forced_here = torch.where(forced >= 0, forced // span, -1)
        is_forced = is_in(active, forced_here) & valid
        rest = valid & ~is_forced
        if active.shape[-1] > beam:
            child = active[..., None] * g + kids  # [B, Tc, H, A, g]
            child_ok = rest[..., None] & (child < n_child)
            A = child.shape[3]
            if bound:
                lo, hi = (_gather_rows(x, child.flatten(-2)).view(*child.shape, D)
                          for x in _level_bounds(pyr, lvl - 1))
                z = bound_logits(rows, lo, hi)
            else:
                cm = _gather_rows(child_means, child.flatten(-2)).view(*child.shape, D)
                z = torch.einsum("bthmd,bthard->bthamr", rows, cm)
            z = z.view(B, Tc, H, A, Qt, G, g)
            w = torch.where(child_ok, child_counts[child.clamp(0, n_child - 1)].to(qs.dtype), 0.0)
            score = reduce_tokens(group_score(z, w[..., None, None, :], scorer), ok,
                                  cfg.tile_reduce)
            score = torch.where(rest, score, -math.inf)
            width = min(beam, score.shape[-1])
            best, pos = _top(score, width)
            top = torch.zeros_like(rest).scatter_(-1, pos, torch.isfinite(best))
            rest = rest & top
        keep = is_forced | rest
        big = torch.iinfo(torch.long).max
        kept = torch.sort(torch.where(keep, active, big), dim=-1).values
        kept = kept[..., :beam + MAX_FORCED]
        child = kept[..., None] * g + kids
        child = torch.where((kept[..., None] != big) & (child < n_child), child, -1)
        active = child.flatten(-2)
    return active


def select_torch(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig,
                 pyramid: Pyramid | None = None, blk0: torch.Tensor | None = None,
                 q_ok: torch.Tensor | None = None):
    """Vectorised selection per query tile; returns ``(block_idx [B, n_tiles, HKV, slots] int32,
    counts [B, n_tiles, HKV])``, ``n_tiles = n_query_tiles(Tq, Tk, cfg.query_tile)`` (``Tq`` for
    per-token selection). ``pyramid``: that of ``k``, built here when not given (or when
    ``scorer="bound"`` needs bounds it lacks). ``blk0 [cdiv(Tk, C)]`` int32, a packed layout's
    (``B = 1``, ``pisa.ops.utils.varlen``): the first block of each block's sequence, the sink of its
    rows, ``-1`` for a block without queries (its rows come back empty). ``q_ok [Tq]`` bool
    (``tile_reduce="mass"`` in a packed layout): the positions that hold queries, the only ones
    a tile scores and averages.

    Runs under ``torch.no_grad``: selection is not differentiable.
    """
    with torch.no_grad():
        return _select(q, k, cfg, pyramid, blk0, q_ok)


def _tile_queries(q: torch.Tensor, n_keys: int, H: int, cfg: SelectConfig, first: int,
                  last: int):
    """The scaled queries of the absolute tiles ``[first, last)`` with ``H`` KV heads:
    ``qs [B, Tc, H, Qt, G, D]`` (zero rows where a tile position is no query), ``tok_ok [Tc, Qt]``
    (which are queries) and ``t_ref [Tc]`` (each tile's last query position). With
    ``tile_reduce="qmean"`` a tile holds one token, its mean query: ``qs [B, Tc, H, 1, G, D]``,
    ``tok_ok [Tc, 1]``."""
    B, Tq, HQ, D = q.shape
    Qt, t0 = cfg.query_tile, n_keys - Tq
    pos = torch.arange(first * Qt, last * Qt, device=q.device)  # absolute tile positions
    lo, hi = max(first * Qt, t0), min(last * Qt, n_keys)  # the queries among them
    rows = torch.nn.functional.pad(q[:, lo - t0:hi - t0].to(compute_dtype(q)),
                                   (0, 0, 0, 0, lo - first * Qt, last * Qt - hi))
    qs = rows.view(B, last - first, Qt, H, HQ // H, D).permute(0, 1, 3, 2, 4, 5) * cfg.scale
    tok_ok = ((pos >= t0) & (pos < n_keys)).view(last - first, Qt)
    t_ref = pos.clamp_max(n_keys - 1).view(last - first, Qt)[:, -1]
    return qs, tok_ok, t_ref


def _mean_tiles(qs: torch.Tensor, tok_ok: torch.Tensor):
    """Tiles ``qs [B, Tc, H, Qt, G, D]`` (zero rows where ``tok_ok [Tc, Qt]`` is False) as one
    virtual token each, the per-head mean of their real queries: ``[B, Tc, H, 1, G, D]``,
    ``[Tc, 1]``."""
    n_tok = tok_ok.sum(-1).clamp_min(1).to(qs.dtype)[None, :, None, None, None, None]
    return qs.sum(3, keepdim=True) / n_tok, tok_ok.any(-1, keepdim=True)


def _mass_rows(qs: torch.Tensor, tok_ok: torch.Tensor):
    """The tokens of tiles ``qs [B, Tc, H, Qt, G, D]`` whose rows a ``tile_reduce="mass"`` tile
    scores with (``config.mass_tokens`` of its real tokens, which ``tok_ok [Tc, Qt]`` marks and
    which are contiguous): ``[B, Tc, H, R, G, D]`` and which of the ``R`` are real ``[Tc, R]``."""
    Qt = qs.shape[3]
    R = mass_row_tokens(Qt, qs.shape[4])
    n_real = tok_ok.sum(-1, keepdim=True)                                   # [Tc, 1]
    first = tok_ok.int().argmax(-1, keepdim=True)                            # [Tc, 1]
    n = n_real.clamp_max(R)
    j = torch.arange(R, device=qs.device)
    off = (first + j * n_real // n.clamp_min(1)).clamp_max(Qt - 1)          # [Tc, R]
    idx = off[None, :, None, :, None, None].expand(*qs.shape[:3], R, *qs.shape[4:])
    return qs.gather(3, idx), j < n


def _select(q, k, cfg, pyramid, blk0, q_ok):
    B, Tq, HQ, D = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G, C, Qt, g = HQ // H, cfg.block_size, cfg.query_tile, cfg.branching
    N = cdiv(Tk, C)
    dev = q.device
    ct = compute_dtype(q)
    if pyramid is None:
        pyramid = build_pyramid_torch(k, C, g, bounds=cfg.uses_bounds)
    leaf_means = pyramid.level(1)[0]
    k_blocks = None
    if cfg.selector == "pyramid" and cfg.leaf_scorer != "mean":
        kp = torch.nn.functional.pad(k.to(ct), (0, 0, 0, 0, 0, N * C - Tk))
        k_blocks = kp.view(B, N, C, H, D).permute(0, 3, 1, 2, 4).reshape(B * H * N, C, D)
    rows = 1 if cfg.tile_reduce == "qmean" else Qt  # query tokens a tile scores with
    if cfg.selector == "pyramid":  # largest: the leaf products, the gathered summaries
        width = g * (max(cfg.beam, cfg.beam_at(2)) + MAX_FORCED)
        per_tile = B * H * width * max(rows * G * max(C, D), 2 * g * D)
    elif cfg.selector == "flat_lse":
        per_tile = B * HQ * rows * (Tk + C)
    else:
        per_tile = B * H * rows * (N + D)
    first, n_tiles = (Tk - Tq) // Qt, n_query_tiles(Tq, Tk, Qt)
    chunk = max(max(1, 16 // Qt), min(n_tiles, CHUNK_ELEMS // max(per_tile, 1)))
    idx_out = torch.empty(B, n_tiles, H, cfg.slots, dtype=torch.int32, device=dev)
    cnt_out = torch.empty(B, n_tiles, H, dtype=torch.int32, device=dev)
    for s in range(0, n_tiles, chunk):
        e = min(n_tiles, s + chunk)
        qs, tok_ok, t_ref = _tile_queries(q, Tk, H, cfg, first + s, first + e)
        if q_ok is not None and cfg.tile_reduce == "mass":  # Tq == Tk: positions are queries
            tok_ok = tok_ok & q_ok[(first + s) * Qt:(first + e) * Qt].view(e - s, Qt)
        leaf_qs, leaf_ok = qs, tok_ok
        if cfg.tile_reduce in ("qmean", "mass"):  # the walk's virtual token: the mean query
            qs, tok_ok = _mean_tiles(qs, tok_ok)
            leaf_qs, leaf_ok = _mass_rows(leaf_qs, leaf_ok) if cfg.tile_reduce == "mass" \
                else (qs, tok_ok)
        sink = has_q = None
        if blk0 is not None:  # a block without queries reads as its sequence's first
            sink = blk0[t_ref // C].long()
            has_q = sink >= 0
            sink = torch.where(has_q, sink, t_ref // C)
        forced = forced_leaves_tensor(t_ref, C, sink)
        after = 0 if sink is None else sink[None, :, None, None]  # free blocks: after the sink
        if cfg.selector == "pyramid":
            cand = walk(qs, pyramid, t_ref, forced, cfg, tok_ok, sink)
            free = (cand > after) & (cand * C <= t_ref[None, :, None, None]) \
                & ~is_in(cand, forced)
            cand = torch.where(free, cand, -1)
            if cfg.leaf_scorer == "mean":
                score = flat_mean_scores(qs, leaf_means, cand, tok_ok, cfg.tile_reduce)
            else:
                score = _exact_leaf_scores(leaf_qs, k_blocks, cand, cfg.leaf_scorer, leaf_ok,
                                           cfg.tile_reduce)
        else:
            n_end = (min((first + e) * Qt, Tk) - 1) // C + 1  # t_ref[-1]'s block, no sync
            cand = torch.arange(n_end, device=dev).expand(B, e - s, H, n_end)
            free = (cand > after) & (cand * C <= t_ref[None, :, None, None]) \
                & ~is_in(cand, forced)
            if cfg.selector == "flat_lse":
                score = _flat_lse_scores(qs, k, n_end * C, C)
            else:
                score = torch.einsum("bthqd,bnhd->bthnq", qs.sum(4), leaf_means[:, :n_end])
            score = reduce_tokens(score, _tile_ok(tok_ok), cfg.tile_reduce)
            score = torch.where(free, score, -math.inf)
            cand = torch.where(free, cand, -1)
        idx, cnt = finish_selection(cand, score, forced, cfg)
        if has_q is not None:
            idx = torch.where(has_q[None, :, None, None], idx, -1)
            cnt = torch.where(has_q[None, :, None], cnt, 0)
        idx_out[:, s:e], cnt_out[:, s:e] = idx, cnt
    return idx_out, cnt_out


def flat_mean_scores(qs, leaf_means, cand, tok_ok=None, tile_reduce="sum"):
    """``sum_h scale q_h . mean_leaf`` for candidate leaves ``cand [B, Tc, H, M]``, reduced over a
    tile's tokens (``reduce_tokens``; ``qs`` tiles or tokens, as ``walk``'s): ``[B, Tc, H, M]``,
    -inf where ``cand < 0``."""
    rows = _gather_rows(leaf_means, cand)  # [B, Tc, H, M, D]
    score = torch.einsum("bthqd,bthmd->bthmq", _as_tiles(qs).sum(4), rows)
    score = reduce_tokens(score, _tile_ok(tok_ok), tile_reduce)
    return torch.where(cand >= 0, score, -math.inf)


def _flat_lse_scores(qs, k, n_keys, block_size):
    """Exact block LSE of every block in ``[0, n_keys)``, summed over the group's heads, per token
    of the tiles ``qs [B, Tc, H, Qt, G, D]``: ``[B, Tc, H, n_keys / block_size, Qt]``."""
    B, Tc, H, Qt, G, D = qs.shape
    Tk = k.shape[1]
    kk = k[:, :min(n_keys, Tk)].to(qs.dtype)
    z = torch.einsum("bthmd,bshd->bthms", qs.flatten(3, 4), kk)
    if z.shape[-1] < n_keys:
        z = torch.nn.functional.pad(z, (0, n_keys - z.shape[-1]), value=-math.inf)
    z = z.view(B, Tc, H, Qt, G, n_keys // block_size, block_size)
    return _logsumexp(z).sum(4).transpose(-1, -2)
