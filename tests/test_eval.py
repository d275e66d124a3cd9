import math

import torch

from pisa import pisa_select
from pisa.eval import captured_mass, dense_lse, recall_at_k, selection_report, structured_qkv


def test_recall_of_oracle_is_one_and_excludes_forced_blocks(rng):
    q, k, _ = structured_qkv(1, 512, 4, 2, 16, block_size=16, seed=1)
    oracle, _ = pisa_select(q, k, block_size=16, topk=6, selector="flat_lse")
    assert recall_at_k(oracle, oracle, 512, 16) == 1.0
    forced_only = torch.where(oracle > 0, -1, oracle)  # keep only block 0 (forced)
    assert recall_at_k(forced_only, oracle, 512, 16) == 0.0


def test_captured_mass_is_one_for_every_block_and_below_for_sparse(rng):
    q, k, _ = structured_qkv(1, 256, 4, 2, 16, block_size=16, seed=2)
    n = 16
    every = torch.arange(n, dtype=torch.int32).expand(1, 256, 2, n).contiguous()
    assert math.isclose(captured_mass(q, k, every, 16), 1.0, rel_tol=1e-5)
    idx, _ = pisa_select(q, k, block_size=16, topk=4)
    assert 0.0 < captured_mass(q, k, idx, 16) < 1.0


def test_dense_lse_matches_logsumexp(rng):
    q, k = torch.randn(1, 20, 2, 8), torch.randn(1, 30, 1, 8)
    got = dense_lse(q, k, 0.5)
    z = 0.5 * torch.einsum("thd,sd->hts", q[0], k[0, :, 0])
    mask = torch.arange(30)[None, :] > (10 + torch.arange(20))[:, None]
    torch.testing.assert_close(got[0], torch.logsumexp(z.masked_fill(mask, -math.inf), -1))


def test_selection_report_orders_selectors_sensibly(rng):
    q, k, _ = structured_qkv(1, 1024, 4, 2, 16, block_size=16, seed=3)
    rep = selection_report(q, k, block_size=16, topk=6)
    assert rep["flat_lse"]["recall"] == 1.0
    for name in ("pyramid", "flat_mean"):
        assert 0.0 <= rep[name]["recall"] <= 1.0 and 0.0 < rep[name]["mass"] <= 1.0
