"""The selection oracle: fp64, Python loops, small N only.

Every faster implementation is tested against this file, so it follows the spec
(``docs/spec.md`` §2–§5, §11) line by line and favours clarity over speed.

Conventions shared with every backend
-------------------------------------
- ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, HKV, D]``; queries are the last ``Tq`` positions of the keys
  (bottom-right causal alignment), so query ``t`` sits at absolute position ``Tk - Tq + t``.
- Node ``i`` at level ``l`` (leaves are level 1) covers leaves ``[i * g**(l-1), (i+1) * g**(l-1))``.
- Query tiles (``query_tile = Qt``): the queries at absolute positions ``[j * Qt, (j+1) * Qt)``
  form tile ``j`` and share one selection per KV head; the first and last tile of the query range
  may be partial (only their positions that are queries take part). Tiles are aligned and
  ``Qt <= C``, so a tile lies inside one leaf block, "the current block" of all its tokens: the
  forced blocks (sink, previous, current) are those of any of its tokens, and every other
  candidate node — internal or leaf — that starts at or before the current block and is not an
  ancestor of it ends before it, so it is scored over full, causal children for every token of
  the tile. ``Qt = 1`` is per-token selection.
- Scores of a node from its children ``r`` (leaf: from its keys, each of weight 1), per query head
  and token, with ``z_r = scale * q . mean_r`` and ``n_r`` the token count under ``r``:
    ``lse``     log sum_r n_r exp(z_r)   (unnormalised: ragged children weigh what they hold)
    ``mean``    sum_r n_r z_r / sum_r n_r           (= the logit of the node's own mean key)
    ``meanvar`` mean + 1/2 * count-weighted variance of z_r
    ``bound``   ``lse`` with ``z_r = sum_d max(s q_d min_{r,d}, s q_d max_{r,d})`` (``s`` the
                scale): ``z_r`` bounds ``s q . k`` over the keys of ``r``, so the score bounds
                the exact LSE of the node's keys from above; leaves take their exact LSE
  The GQA group's score is the sum of its heads' scores; a tile's score is the sum
  (``tile_reduce="sum"``) or the log-sum-exp (``"lse"``) of its tokens' group scores, or
  (``"qmean"``) the group score of one virtual token: the tile's per-head mean query over its
  real tokens. ``"mass"`` walks as ``"qmean"``; its leaves are ranked by the sum, over the rows
  (heads) of the tokens ``config.mass_tokens`` picks, of each row's softmax share of the leaf
  among the tile's free candidates: ``sum_r exp(lse_r(c) - logsumexp_c' lse_r(c'))``.
- Ties between scores go to the lower block index.
"""
from __future__ import annotations

import torch

from ..pyramid.naive import naive_pyramid
from ..utils.config import SelectConfig, mass_tokens, n_query_tiles
from ..utils.geometry import forced_leaves


def naive_score(z: torch.Tensor, n: torch.Tensor, scorer: str) -> torch.Tensor:
    """Group scores ``[...]`` (one per token) from child logits ``z [..., G, R]`` and child token
    counts ``n [R]``: the sum over the G heads of each head's score."""
    n = n.double()
    if scorer == "lse":
        per_head = torch.logsumexp(z + n.log(), dim=-1)
    else:
        mu = (z * n).sum(-1) / n.sum()
        per_head = mu
        if scorer == "meanvar":
            per_head = mu + 0.5 * (((z - mu[..., None]) ** 2) * n).sum(-1) / n.sum()
    return per_head.sum(-1)


def reduce_tokens(per_token: torch.Tensor, tile_reduce: str) -> float:
    """A tile's score from its tokens' group scores ``per_token [n_tok]`` fp64 (``"qmean"``: the
    one score of the mean query)."""
    return float(torch.logsumexp(per_token, 0) if tile_reduce == "lse" else per_token.sum())


def naive_tile_score(z: torch.Tensor, n: torch.Tensor, scorer: str, tile_reduce: str) -> float:
    """Tile score from the child logits ``z [n_tok, G, R]`` of its tokens: ``naive_score`` per
    token, then ``reduce_tokens``."""
    return reduce_tokens(naive_score(z, n, scorer), tile_reduce)


def _top(nodes: list[int], scores: list[float], n: int) -> list[int]:
    order = sorted(range(len(nodes)), key=lambda i: (-scores[i], nodes[i]))
    return [nodes[i] for i in order[:n]]


def child_logits(qt, level, kids, cfg: SelectConfig) -> torch.Tensor:
    """Logits ``[n_tok, G, R]`` of the tile's queries ``qt [n_tok, G, D]`` against the children
    ``kids`` of one node, from ``level = (means, counts[, mins, maxs])`` (one batch and head)."""
    if cfg.scorer == "bound":
        mins, maxs = level[2][kids], level[3][kids]  # [R, D]
        qd = cfg.scale * qt[:, :, None, :]  # [n_tok, G, 1, D]
        return torch.maximum(qd * mins, qd * maxs).sum(-1)
    return cfg.scale * qt @ level[0][kids].T


def _walk(qt, levels, t_ref, forced, cfg: SelectConfig) -> list[int]:
    """Coarse-to-fine beam search for one tile (one batch and KV head: ``levels`` sliced);
    returns the candidate leaves reached (forced ones included)."""
    g = cfg.branching
    scorer = "lse" if cfg.scorer == "bound" else cfg.scorer
    active = [0]
    for lvl in range(len(levels), 1, -1):  # 1-based level numbers, root down to level 2
        span = g ** (lvl - 1)  # leaves under one node of this level
        active = [i for i in active if i * span * cfg.block_size <= t_ref]
        forced_here = {f // span for f in forced}
        keep = [i for i in active if i in forced_here]
        rest = [i for i in active if i not in forced_here]
        beam = cfg.beam_at(lvl)
        if len(rest) > beam:
            child_counts = levels[lvl - 2][1]
            scores = []
            for i in rest:
                kids = list(range(i * g, min((i + 1) * g, len(child_counts))))
                assert (i + 1) * span <= t_ref // cfg.block_size, "ends before the tile's block"
                z = child_logits(qt, levels[lvl - 2], kids, cfg)
                scores.append(naive_tile_score(z, child_counts[kids], scorer, cfg.tile_reduce))
            rest = _top(rest, scores, beam)
        n_children = len(levels[lvl - 2][1])
        active = [r for i in keep + rest for r in range(i * g, min((i + 1) * g, n_children))]
    return active


def _leaf_score(qt, keys, leaf_means, c: int, cfg: SelectConfig) -> float:
    """Tile score of leaf ``c`` for the queries ``qt [n_tok, G, D]`` (the block's mean key for
    ``flat_mean``, its keys ``keys [Tk, D]`` otherwise)."""
    C = cfg.block_size
    if cfg.selector == "flat_mean":
        return reduce_tokens((cfg.scale * qt @ leaf_means[c]).sum(-1), cfg.tile_reduce)
    z = cfg.scale * qt @ keys[c * C:(c + 1) * C].T
    return naive_tile_score(z, torch.ones(z.shape[-1]), cfg.leaf_scorer, cfg.tile_reduce)


def _mass_scores(rows, keys, free: list[int], cfg: SelectConfig) -> list[float]:
    """``tile_reduce="mass"``: per free leaf, the sum over the query rows ``rows [n_rows, G, D]``
    of each row's softmax share of the leaf's exact LSE among the ``free`` leaves."""
    if not free:
        return []
    C = cfg.block_size
    lse = torch.stack([torch.logsumexp(cfg.scale * rows @ keys[c * C:(c + 1) * C].T, -1)
                       for c in free])  # [n_free, n_rows, G]
    return torch.exp(lse - torch.logsumexp(lse, 0)).sum((1, 2)).tolist()


def naive_select(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig):
    """Block selection per query tile (``cfg.query_tile`` tokens; one token by default) and KV
    head.

    Returns ``block_idx [B, n_tiles, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, n_tiles, HKV] int32``, ``n_tiles = n_query_tiles(Tq, Tk, cfg.query_tile)``
    (``Tq`` for per-token selection).
    """
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C, Qt = HQ // HKV, cfg.block_size, cfg.query_tile
    t0 = Tk - Tq  # absolute position of the first query
    n_tiles = n_query_tiles(Tq, Tk, Qt)
    levels = naive_pyramid(k, C, cfg.branching, bounds=cfg.uses_bounds)
    block_idx = torch.full((B, n_tiles, HKV, cfg.slots), -1, dtype=torch.int32)
    counts = torch.zeros(B, n_tiles, HKV, dtype=torch.int32)
    for b in range(B):
        for h in range(HKV):
            leaf_means = levels[0][0][b, :, h]
            keys = k[b, :, h].double()
            # this batch and head of every level's tensors (counts [N_l] are shared)
            tree = [tuple(x[b, :, h] if x.dim() > 1 else x for x in lv) for lv in levels]
            for j in range(n_tiles):
                tile = t0 // Qt + j
                lo, hi = max(tile * Qt, t0), min((tile + 1) * Qt, Tk)  # its query positions
                q_tok = q[b, lo - t0:hi - t0, h * G:(h + 1) * G].double()  # [n_tok, G, D]
                qt = q_tok
                if cfg.tile_reduce in ("qmean", "mass"):  # the walk's virtual token: the mean
                    qt = qt.mean(0, keepdim=True)
                t_ref = hi - 1  # any position of the tile's block gives the same causality
                forced = forced_leaves(t_ref, C)
                if cfg.selector == "pyramid":
                    cands = _walk(qt, tree, t_ref, forced, cfg)
                else:
                    cands = list(range(t_ref // C + 1))
                free = [c for c in cands if c * C <= t_ref and c not in forced]
                assert all((c + 1) * C <= lo for c in free), "free blocks end before the tile"
                if cfg.tile_reduce == "mass":
                    scores = _mass_scores(q_tok[mass_tokens(hi - lo, Qt, G)], keys, free, cfg)
                else:
                    scores = [_leaf_score(qt, keys, leaf_means, c, cfg) for c in free]
                chosen = sorted(forced + _top(free, scores, cfg.free_budget(len(forced))))
                block_idx[b, j, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
                counts[b, j, h] = len(chosen)
    return block_idx, counts
