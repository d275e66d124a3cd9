"""The bound scorer (``scorer="bound"``, ``docs/spec.md`` §11): internal nodes ranked by
``log sum_r n_r exp(sum_d max(q_d min_rd, q_d max_rd))`` over their children ``r``."""
import math

import pytest
import torch

from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.select import select
from pisa.ops.select.naive import child_logits, naive_select
from pisa.ops.select.torch_backend import bound_logits, reduce_tokens, select_torch, walk
from pisa.ops.utils.geometry import forced_leaves_tensor
from tests.ops.conftest import per_token_config
from tests.ops.select.common import assert_same


@pytest.mark.parametrize("T,C,g,D", [(203, 4, 2, 16), (300, 8, 3, 64)])
def test_bound_score_bounds_the_exact_lse_of_every_node(T, C, g, D, rng):
    """For random queries, every internal node's bound score is >= the exact LSE of its keys, per
    head; the torch backend's ``q+ . max + q- . min`` equals the oracle's per-channel max."""
    k = torch.randn(1, T, 1, D, dtype=torch.float64)
    q = torch.randn(5, 3, D, dtype=torch.float64)  # 5 tokens x 3 heads
    cfg = per_token_config(block_size=C, branching=g, scorer="bound", scale=D ** -0.5)
    pyr = build_pyramid_torch(k, C, g, bounds=True)
    for lvl in range(2, pyr.n_levels + 1):
        lo, hi = pyr.offsets[lvl - 2], pyr.offsets[lvl - 1]  # the children's level
        means, mins, maxs = (x[0, lo:hi, 0] for x in (pyr.means, pyr.mins, pyr.maxs))
        level = (means, pyr.counts[lo:hi], mins, maxs)  # the oracle's per-level tuple
        span = C * g ** (lvl - 1)
        for i in range(pyr.offsets[lvl] - pyr.offsets[lvl - 1]):
            kids = list(range(i * g, min((i + 1) * g, hi - lo)))
            z = child_logits(q, level, kids, cfg)  # [5, 3, R]
            box_lo, box_hi = (x[kids][None, None, None, None] for x in (mins, maxs))
            rows = cfg.scale * q.view(1, 1, 1, 15, D)  # the 5 x 3 query rows
            z_torch = bound_logits(rows, box_lo, box_hi).view(5, 3, len(kids))
            torch.testing.assert_close(z_torch, z, rtol=1e-12, atol=1e-12)
            score = torch.logsumexp(z + pyr.counts[lo:hi][kids].double().log(), dim=-1)
            exact = torch.logsumexp(cfg.scale * q @ k[0, i * span:(i + 1) * span, 0].T, dim=-1)
            assert bool((score >= exact - 1e-12).all()), (lvl, i)


def _needle_case(n_blocks=32, C=16, D=16, needle_block=3):
    """Scale 1, queries ``e_0``: the logit of a key is its channel 0. One needle key (logit 12)
    among keys of logit -4 in ``needle_block``, small logits elsewhere. The needle's level-2 node
    has a low mean but a high bound."""
    T = n_blocks * C
    k = torch.randn(1, T, 1, D, dtype=torch.float64)
    k[0, :, 0, 0] = 0.05 * torch.randn(T, dtype=torch.float64)
    k[0, needle_block * C:(needle_block + 1) * C, 0, 0] = -4.0
    k[0, needle_block * C + 5, 0, 0] = 12.0
    q = torch.zeros(1, 4, 1, D, dtype=torch.float64)
    q[..., 0] = 1.0
    return q, k


@pytest.mark.parametrize("scorer,beam_leaf,found", [
    ("lse", None, False), ("lse", 16, True), ("bound", None, True)])
@pytest.mark.parametrize("Qt", [1, 4])
def test_needle_behind_a_low_mean(scorer, beam_leaf, found, Qt, rng):
    """The mean walk (beam 1) drops the needle's node at level 2, where its children's means blur
    the needle; a leaf beam over every level-2 node, or the bound, keeps it."""
    q, k = _needle_case()
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=1, scorer=scorer, scale=1.0,
                           query_tile=Qt, beam_leaf=beam_leaf)  # 1 free slot after 3 forced
    idx, cnt = select_torch(q, k, cfg)
    assert (3 in idx.flatten().tolist()) == found
    assert_same((idx, cnt), naive_select(q, k, cfg), "oracle")


def test_bound_pyramid_is_built_when_missing(rng):
    """A caller's pyramid without bounds (the decode cache's) is rebuilt with them by the select
    op (``pisa.ops.select.select``); the walk itself refuses one."""
    q, k = torch.randn(1, 40, 4, 16), torch.randn(1, 200, 2, 16)
    cfg = per_token_config(block_size=8, topk=5, beam=2, scorer="bound", scale=0.25, query_tile=2)
    plain = build_pyramid_torch(k, 8, 2)
    assert plain.mins is None and plain.maxs is None
    assert_same(select(q, k, cfg=cfg, backend="torch", pyramid=plain), select_torch(q, k, cfg),
                "rebuilt")
    t_abs = torch.tensor([199])
    with pytest.raises(ValueError, match="bounds=True"):
        walk(q[:, :1].view(1, 1, 2, 2, 16), plain, t_abs, forced_leaves_tensor(t_abs, 8), cfg)


def test_reduce_tokens_skips_positions_that_are_no_query():
    """Tile positions outside the query range take no part in either reduction."""
    score = torch.tensor([[1.0, 2.0, 30.0], [0.5, -1.0, 4.0]])
    ok = torch.tensor([[True, True, False], [True, True, True]])
    assert torch.equal(reduce_tokens(score.clone(), ok, "sum"), torch.tensor([3.0, 3.5]))
    want = torch.tensor([math.log(math.e + math.e ** 2), torch.logsumexp(score[1], 0).item()])
    torch.testing.assert_close(reduce_tokens(score.clone(), ok, "lse"), want)
    torch.testing.assert_close(reduce_tokens(score.clone(), None, "lse"),
                               torch.logsumexp(score, -1))
