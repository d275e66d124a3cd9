"""``pisa.eval.metrics``: recall@K, captured mass, dense LSE and the selection report."""
import math

import pytest
import torch

from pisa import pisa_select
from pisa.eval import (SelectionScorer, captured_mass, dense_lse, recall_at_k, selection_report,
                       structured_qkv)
from pisa.eval.recall import PER_TOKEN, random_select


def test_recall_of_oracle_is_one_and_excludes_forced_blocks(rng):
    q, k, _ = structured_qkv(1, 512, 4, 2, 16, block_size=16, seed=1)
    oracle, _ = pisa_select(q, k, block_size=16, topk=6, selector="flat_lse")
    assert recall_at_k(oracle, oracle, 512, 16) == 1.0
    forced_only = torch.where(oracle > 0, -1, oracle)  # keep only block 0 (forced)
    assert recall_at_k(forced_only, oracle, 512, 16) == 0.0


def test_captured_mass_is_one_for_every_block_and_below_for_sparse(rng):
    q, k, _ = structured_qkv(1, 256, 4, 2, 16, block_size=16, seed=2)
    n = 16
    blocks = torch.arange(n, dtype=torch.int32)
    causal = blocks <= (torch.arange(256) // 16)[:, None]  # pisa_attn rejects future blocks
    every = torch.where(causal, blocks, -1)[None, :, None].expand(1, 256, 2, n).contiguous()
    assert math.isclose(captured_mass(q, k, every, 16), 1.0, rel_tol=1e-5)
    idx, _ = pisa_select(q, k, block_size=16, topk=4)  # 16-token tiles (the default)
    assert 0.0 < captured_mass(q, k, idx, 16) < 1.0
    tok, _ = pisa_select(q, k, block_size=16, topk=4, query_tile=1)
    assert 0.0 < captured_mass(q, k, tok, 16) < 1.0


def test_dense_lse_matches_logsumexp(rng):
    q, k = torch.randn(1, 20, 2, 8), torch.randn(1, 30, 1, 8)
    got = dense_lse(q, k, 0.5)
    z = 0.5 * torch.einsum("thd,sd->hts", q[0], k[0, :, 0])
    mask = torch.arange(30)[None, :] > (10 + torch.arange(20))[:, None]
    torch.testing.assert_close(got[0], torch.logsumexp(z.masked_fill(mask, -math.inf), -1))


def test_selection_report_orders_selectors_sensibly(rng):
    """On attention with structure, recall and captured mass fall in the order of how much of
    each block a selector looks at: the exact scan (the mass-optimal top-K), then the pyramid
    (exact leaves under a beam), then mean pooling, then random blocks. Per-token selection
    (``structured_qkv`` gives each token its own target blocks: the default 16-token tiles
    recall about a third of the per-token oracle's blocks here, even with their exact scan)."""
    q, k, _ = structured_qkv(1, 1024, 4, 2, 16, block_size=16, seed=3)
    rep = selection_report(q, k, block_size=16, topk=6, **PER_TOKEN)
    assert set(rep) == {"flat_lse", "pyramid", "flat_mean"}
    rep["random"] = SelectionScorer(q, k, block_size=16, topk=6, **PER_TOKEN)(
        random_select(1, 1024, 1024, 2, 16, 6))
    order = ["flat_lse", "pyramid", "flat_mean", "random"]
    recall = [rep[n]["recall"] for n in order]
    mass = [rep[n]["mass"] for n in order]
    assert recall[0] == 1.0 and rep["flat_lse"]["mass_ratio"] == 1.0
    assert recall[0] > recall[1] > recall[2] > recall[3] >= 0.0, dict(zip(order, recall))
    assert mass[0] >= mass[1] > mass[2] > mass[3] > 0.0, dict(zip(order, mass))
    for n in order:
        assert rep[n]["mass_ratio"] == pytest.approx(rep[n]["mass"] / mass[0], rel=1e-6)
    # the gaps are not rounding: the pyramid keeps most of the exact scan's blocks and mass,
    # mean pooling misses about a quarter of the blocks, random most of them
    assert recall[1] > 0.85 and recall[1] - recall[2] > 0.1 and recall[2] - recall[3] > 0.3
    assert mass[1] / mass[0] > 0.95 and mass[2] / mass[0] < mass[1] / mass[0] - 0.03
