"""The readable oracle for every PISA op: fp64, Python loops, small N only.

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

import math

import torch

from .utils import SelectConfig, cdiv, forced_leaves, level_sizes


def naive_pyramid(k: torch.Tensor, block_size: int, branching: int):
    """Per-level ``(means [B, N_l, HKV, D] fp64, counts [N_l] int64)``, leaves first."""
    B, T, H, D = k.shape
    n_leaves = cdiv(T, block_size)
    means = torch.zeros(B, n_leaves, H, D, dtype=torch.float64)
    counts = torch.zeros(n_leaves, dtype=torch.int64)
    for i in range(n_leaves):
        keys = k[:, i * block_size:(i + 1) * block_size].double()
        means[:, i] = keys.mean(dim=1)
        counts[i] = keys.shape[1]
    levels = [(means, counts)]
    for n_nodes in level_sizes(n_leaves, branching)[1:]:
        child_means, child_counts = levels[-1]
        means = torch.zeros(B, n_nodes, H, D, dtype=torch.float64)
        counts = torch.zeros(n_nodes, dtype=torch.int64)
        for i in range(n_nodes):
            kids = range(i * branching, min((i + 1) * branching, len(child_counts)))
            total = sum(child_means[:, r] * child_counts[r] for r in kids)
            counts[i] = sum(int(child_counts[r]) for r in kids)
            means[:, i] = total / counts[i]
        levels.append((means, counts))
    return levels


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


def naive_attn(q, k, v, block_idx: torch.Tensor, block_size: int, scale: float):
    """Exact softmax attention restricted to the selected blocks (and causality), in fp64.

    Differentiable (autograd through the masked dense form). Returns ``o [B, Tq, HQ, D]`` fp64 and
    ``lse [B, HQ, Tq]`` fp64 (natural log; ``-inf`` and ``o = 0`` for a row with no key).
    """
    B, Tq, HKV, _ = block_idx.shape
    Tk = k.shape[1]
    allowed = torch.zeros(B, Tq, HKV, Tk, dtype=torch.bool)
    for b in range(B):
        for t in range(Tq):
            for h in range(HKV):
                for c in block_idx[b, t, h].tolist():
                    if c >= 0:
                        allowed[b, t, h, c * block_size:(c + 1) * block_size] = True
    return _masked_attn(q, k, v, allowed, scale)


def naive_dense_attn(q, k, v, scale: float):
    """Dense causal attention (bottom-right aligned) in fp64: the all-blocks reference."""
    B, Tq, _, _ = q.shape
    _, Tk, HKV, _ = k.shape
    return _masked_attn(q, k, v, torch.ones(B, Tq, HKV, Tk, dtype=torch.bool), scale)


def _masked_attn(q, k, v, allowed: torch.Tensor, scale: float):
    """Softmax attention over ``allowed [B, Tq, HKV, Tk]`` keys, intersected with causality."""
    Tq, HQ = q.shape[1], q.shape[2]
    Tk, HKV = k.shape[1], k.shape[2]
    G = HQ // HKV
    causal = torch.arange(Tk)[None, :] <= (Tk - Tq + torch.arange(Tq))[:, None]
    allowed = allowed & causal[None, :, None, :]
    allowed = allowed.repeat_interleave(G, dim=2).permute(0, 2, 1, 3)  # [B, HQ, Tq, Tk]
    kk = k.double().repeat_interleave(G, dim=2)
    vv = v.double().repeat_interleave(G, dim=2)
    s = scale * torch.einsum("bthd,bshd->bhts", q.double(), kk)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp_min(-1e300))
    o = torch.einsum("bhts,bshd->bthd", p, vv)
    return o, lse
