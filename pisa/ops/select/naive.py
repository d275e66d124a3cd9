"""The selection oracle: fp64, Python loops, small N only.

Every faster implementation is tested against this file, so it follows the spec
(``PISA_SPEC.md`` §2–§5) line by line and favours clarity over speed.

Conventions shared with every backend
-------------------------------------
- ``q [B, Tq, HQ, D]``, ``k, v [B, Tk, HKV, D]``; queries are the last ``Tq`` positions of the keys
  (bottom-right causal alignment), so query ``t`` sits at absolute position ``Tk - Tq + t``.
- Node ``i`` at level ``l`` (leaves are level 1) covers leaves ``[i * g**(l-1), (i+1) * g**(l-1))``.
- Scores of a node from its children ``r`` (leaf: from its keys, each of weight 1), per query head,
  with ``z_r = scale * q . mean_r`` and ``n_r`` the token count under ``r``:
    ``lse``     log sum_r n_r exp(z_r)   (unnormalised: ragged children weigh what they hold)
    ``mean``    sum_r n_r z_r / sum_r n_r           (= the logit of the node's own mean key)
    ``meanvar`` mean + 1/2 * count-weighted variance of z_r
  The GQA group's score is the sum of its heads' scores.
- Ties between scores go to the lower block index.
"""
from __future__ import annotations

import torch

from ..pyramid.naive import naive_pyramid
from ..utils.config import SelectConfig
from ..utils.geometry import forced_leaves


def naive_score(z: torch.Tensor, n: torch.Tensor, scorer: str) -> float:
    """Group score from child logits ``z [G, R]`` and child token counts ``n [R]``."""
    n = n.double()
    if scorer == "lse":
        per_head = torch.logsumexp(z + n.log(), dim=1)
    else:
        mu = (z * n).sum(1) / n.sum()
        per_head = mu
        if scorer == "meanvar":
            per_head = mu + 0.5 * (((z - mu[:, None]) ** 2) * n).sum(1) / n.sum()
    return float(per_head.sum())


def _top(nodes: list[int], scores: list[float], n: int) -> list[int]:
    order = sorted(range(len(nodes)), key=lambda i: (-scores[i], nodes[i]))
    return [nodes[i] for i in order[:n]]


def _walk(qg, levels, t_abs, forced, cfg: SelectConfig) -> list[int]:
    """Coarse-to-fine beam search; returns the candidate leaves reached (forced ones included)."""
    g = cfg.branching
    active = [0]
    for lvl in range(len(levels), 1, -1):  # 1-based level numbers, root down to level 2
        span = g ** (lvl - 1)  # leaves under one node of this level
        active = [i for i in active if i * span * cfg.block_size <= t_abs]
        forced_here = {f // span for f in forced}
        keep = [i for i in active if i in forced_here]
        rest = [i for i in active if i not in forced_here]
        if len(rest) > cfg.beam:
            child_means, child_counts = levels[lvl - 2]
            scores = []
            for i in rest:
                kids = list(range(i * g, min((i + 1) * g, len(child_counts))))
                z = cfg.scale * qg @ child_means[kids].T
                scores.append(naive_score(z, child_counts[kids], cfg.scorer))
            rest = _top(rest, scores, cfg.beam)
        n_children = len(levels[lvl - 2][1])
        active = [r for i in keep + rest for r in range(i * g, min((i + 1) * g, n_children))]
    return active


def naive_select(q: torch.Tensor, k: torch.Tensor, cfg: SelectConfig):
    """Block selection per query token and KV head.

    Returns ``block_idx [B, Tq, HKV, cfg.slots] int32`` (ascending, ``-1`` padded) and
    ``counts [B, Tq, HKV] int32``.
    """
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, C = HQ // HKV, cfg.block_size
    levels = naive_pyramid(k, C, cfg.branching)
    block_idx = torch.full((B, Tq, HKV, cfg.slots), -1, dtype=torch.int32)
    counts = torch.zeros(B, Tq, HKV, dtype=torch.int32)
    for b in range(B):
        for h in range(HKV):
            leaf_means = levels[0][0][b, :, h]
            keys = k[b, :, h].double()
            for t in range(Tq):
                t_abs = Tk - Tq + t
                qg = q[b, t, h * G:(h + 1) * G].double()
                forced = forced_leaves(t_abs, C)
                if cfg.selector == "pyramid":
                    tree = [(m[b, :, h], n) for m, n in levels]
                    cands = _walk(qg, tree, t_abs, forced, cfg)
                else:
                    cands = list(range(t_abs // C + 1))
                free = [c for c in cands if c * C <= t_abs and c not in forced]
                scores = []
                for c in free:
                    if cfg.selector == "flat_mean":
                        scores.append(float((cfg.scale * qg @ leaf_means[c]).sum()))
                        continue
                    z = cfg.scale * qg @ keys[c * C:min((c + 1) * C, t_abs + 1)].T
                    scorer = "lse" if cfg.selector == "flat_lse" else cfg.scorer
                    scores.append(naive_score(z, torch.ones(z.shape[1]), scorer))
                chosen = sorted(forced + _top(free, scores, cfg.free_budget(len(forced))))
                block_idx[b, t, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
                counts[b, t, h] = len(chosen)
    return block_idx, counts
