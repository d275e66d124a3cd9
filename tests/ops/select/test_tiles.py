"""Selection v2 (``docs/spec.md`` §11): query tiles (``query_tile``), the level-wise beam
(``beam_leaf``) and the bound scorer, in the fp64 oracle and the vectorised torch backend."""
import pytest
import torch

from pisa.ops.select import select, tiles_to_tokens
from pisa.ops.select.naive import naive_select
from pisa.ops.select.torch_backend import select_torch
from pisa.ops.utils.config import check_block_idx_values, n_query_tiles
from pisa.ops.utils.geometry import cdiv
from tests.ops.conftest import per_token_config
from tests.ops.select.common import assert_same


def _qk(B, Tq, Tk, HKV, G, D, dtype=torch.float64):
    return torch.randn(B, Tq, HKV * G, D, dtype=dtype), torch.randn(B, Tk, HKV, D, dtype=dtype)


def _cfg(C, K, g, W, scorer="lse", selector="pyramid", fib=True, D=16, Qt=1, W2=None,
         reduce="sum"):
    return per_token_config(C, K, g, W, scorer, selector, fib, D ** -0.5, Qt, W2, reduce)


CASES = [  # Qt, Tq, Tk, G, D, C, g, W, W2, K, scorer, selector, fib, reduce, dtype
    (1, 77, 77, 4, 16, 4, 2, 3, 6, 5, "lse", "pyramid", True, "sum", "fp64"),
    (2, 63, 63, 1, 16, 4, 2, 2, None, 5, "bound", "pyramid", True, "lse", "fp64"),
    (2, 101, 300, 4, 64, 8, 2, 4, 2, 6, "meanvar", "pyramid", False, "sum", "fp64"),
    (4, 127, 127, 4, 16, 8, 3, 2, 5, 5, "bound", "pyramid", True, "sum", "fp32"),
    (4, 101, 299, 16, 16, 8, 2, 3, 3, 6, "lse", "pyramid", True, "lse", "fp64"),
    (4, 90, 203, 4, 16, 8, 4, 2, 1, 5, "mean", "pyramid", True, "lse", "fp64"),
    (16, 333, 333, 4, 64, 16, 2, 2, 4, 5, "bound", "pyramid", True, "lse", "fp64"),
    (16, 250, 517, 1, 16, 16, 2, 3, 1, 6, "lse", "pyramid", False, "sum", "fp32"),
    (64, 700, 777, 4, 16, 64, 2, 1, 3, 5, "lse", "pyramid", True, "sum", "fp64"),
    (64, 300, 1000, 16, 16, 64, 2, 2, None, 5, "bound", "pyramid", True, "lse", "fp32"),
    (4, 101, 299, 16, 16, 8, 2, 3, 5, 6, "lse", "pyramid", True, "qmean", "fp64"),
    (16, 333, 333, 4, 64, 16, 2, 2, 4, 5, "bound", "pyramid", False, "qmean", "fp32"),
    (2, 63, 63, 1, 16, 4, 2, 2, None, 5, "meanvar", "pyramid", True, "qmean", "fp64"),
    (4, 150, 150, 4, 16, 8, 2, 3, None, 6, "lse", "flat_lse", True, "lse", "fp64"),
    (8, 150, 211, 4, 16, 8, 2, 3, None, 6, "lse", "flat_mean", False, "sum", "fp64"),
    (4, 150, 150, 4, 16, 8, 2, 3, None, 6, "lse", "flat_lse", True, "qmean", "fp64"),
    (8, 150, 211, 4, 16, 8, 2, 3, None, 6, "lse", "flat_mean", False, "qmean", "fp64"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_tiled_torch_selection_equals_naive(case, rng):
    """Random normal inputs (no near-ties): the torch backend's tile selections are the
    oracle's exactly, for partial first / last tiles, ``Tq < Tk`` and every scorer."""
    Qt, Tq, Tk, G, D, C, g, W, W2, K, scorer, selector, fib, reduce, dt = case
    dtype = torch.float64 if dt == "fp64" else torch.float32
    q, k = _qk(1, Tq, Tk, 2, G, D, dtype)
    cfg = _cfg(C, K, g, W, scorer, selector, fib, D, Qt, W2, reduce)
    want = naive_select(q, k, cfg)
    assert want[0].shape == (1, n_query_tiles(Tq, Tk, Qt), 2, cfg.slots)
    assert_same(select_torch(q, k, cfg), want, f"seed {rng}")


def test_one_token_tiles_are_per_token_selection(rng):
    """``query_tile=1`` with ``beam_leaf=beam`` (or None) is per-token PISA: either token
    reduction, and each row equals the oracle run on that token alone (its keys up to itself)."""
    Tq, Tk, C = 60, 150, 8
    q, k = _qk(1, Tq, Tk, 2, 4, 16)
    base = _cfg(C, 6, 2, 3)
    want = naive_select(q, k, base)
    for cfg in (base, _cfg(C, 6, 2, 3, W2=3), _cfg(C, 6, 2, 3, reduce="lse")):
        assert_same(select_torch(q, k, cfg), want, str(cfg))
    for t in range(0, Tq, 7):
        t_abs = Tk - Tq + t
        alone = naive_select(q[:, t:t + 1], k[:, :t_abs + 1], base)
        assert_same(alone, (want[0][:, t:t + 1], want[1][:, t:t + 1]), f"token {t}")


@pytest.mark.parametrize("Qt,reduce,scorer", [(4, "sum", "lse"), (8, "lse", "bound")])
def test_a_tile_is_selected_from_its_own_queries(Qt, reduce, scorer, rng):
    """The selection of a tile is that of its query tokens alone over the keys up to its last
    query: nothing after the tile, nor any other tile, takes part (tiles are aligned to absolute
    positions, the first one partial here)."""
    Tq, Tk, C = 45, 130, 8
    q, k = _qk(1, Tq, Tk, 2, 2, 16)
    cfg = _cfg(C, 5, 2, 2, scorer, Qt=Qt, W2=3, reduce=reduce)
    want = select_torch(q, k, cfg)
    t0 = Tk - Tq
    for j in range(n_query_tiles(Tq, Tk, Qt)):
        lo, hi = max((t0 // Qt + j) * Qt, t0), min((t0 // Qt + j + 1) * Qt, Tk)
        alone = naive_select(q[:, lo - t0:hi - t0], k[:, :hi], cfg)
        assert_same(alone, (want[0][:, j:j + 1], want[1][:, j:j + 1]), f"tile {j}")


@pytest.mark.parametrize("Qt", [2, 16])
@pytest.mark.parametrize("scorer", ["lse", "bound"])
@pytest.mark.parametrize("fib", [True, False])
def test_tile_selection_invariants(Qt, scorer, fib, rng):
    """Every tile row is ascending, ``-1`` padded, within budget, holds the sink, the tile's block
    and the previous one, and is causal for every token of the tile."""
    Tq, Tk, C, K = 203, 517, 16, 7
    q, k = _qk(2, Tq, Tk, 2, 4, 16, torch.float32)
    cfg = _cfg(C, K, 2, 3, scorer, fib=fib, Qt=Qt, W2=5)
    idx, cnt = select_torch(q, k, cfg)
    n_tiles = n_query_tiles(Tq, Tk, Qt)
    assert idx.shape == (2, n_tiles, 2, cfg.slots) and cnt.shape == (2, n_tiles, 2)
    valid = idx >= 0
    assert torch.equal(valid, torch.arange(cfg.slots) < cnt[..., None]), "-1 only at the end"
    assert bool(((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]).all()), "strictly ascending"
    last = torch.minimum((torch.arange(n_tiles) + (Tk - Tq) // Qt + 1) * Qt, torch.tensor(Tk)) - 1
    cur = (last // C)[None, :, None]
    for f in (torch.zeros_like(cur), cur, (cur - 1).clamp_min(0)):
        assert bool((idx == f[..., None]).any(-1).all()), "forced block missing"
    assert bool((torch.where(valid, idx, 0) <= cur[..., None]).all()), "block after the tile's"
    if fib:
        assert torch.equal(cnt.long(), torch.minimum(cur + 1, torch.tensor(K)).expand_as(cnt))
    per_token = tiles_to_tokens(idx, cnt, Tq, Tk, Qt)
    check_block_idx_values(per_token[0], Tk, C)  # causal for each token of every tile


@pytest.mark.parametrize("scorer", ["lse", "mean", "meanvar", "bound"])
def test_early_tiles_select_every_causal_block(scorer, rng):
    """Keys within the first ``K`` blocks: every tile selects every causal block (so attention is
    dense causal), whatever the tile, the beams and the scorer."""
    C, K = 8, 6
    Tk = K * C - 3
    q, k = _qk(1, Tk, Tk, 2, 4, 16, torch.float32)
    for Qt, W, W2 in ((1, 1, None), (2, 1, 4), (8, 2, 1)):
        cfg = _cfg(C, K, 2, W, scorer, Qt=Qt, W2=W2)
        idx, cnt = select_torch(q, k, cfg)
        cur = torch.arange(n_query_tiles(Tk, Tk, Qt)) * Qt // C
        every = torch.arange(K).expand(len(cur), K)
        want = torch.where(every <= cur[:, None], every, -1).to(torch.int32)
        assert torch.equal(idx[0], want[:, None].expand_as(idx[0])), (Qt, W, W2)
        assert torch.equal(cnt[0].long(), (cur + 1)[:, None].expand_as(cnt[0]))


def test_beam_leaf_widens_only_the_lowest_level(rng):
    """A leaf beam covering every level-2 node makes the walk an exact scan of the leaves under
    the nodes kept above; a beam covering every node everywhere is the flat exact scan."""
    Tk, C = 400, 8
    q, k = _qk(1, Tk, Tk, 2, 4, 16)
    n_blocks = cdiv(Tk, C)
    flat = select_torch(q, k, _cfg(C, 6, 2, 2, selector="flat_lse", Qt=4))
    assert_same(select_torch(q, k, _cfg(C, 6, 2, n_blocks, Qt=4, W2=n_blocks)), flat, "wide")
    narrow = select_torch(q, k, _cfg(C, 6, 2, 1, Qt=4))
    wide_leaf = select_torch(q, k, _cfg(C, 6, 2, 1, Qt=4, W2=n_blocks))
    assert not torch.equal(narrow[0], wide_leaf[0]), "beam_leaf changes the walk"
    assert_same(select_torch(q, k, _cfg(C, 6, 2, 1, Qt=4, W2=1)), narrow, "beam_leaf = beam")


def test_tiles_to_tokens(rng):
    """Each token takes its tile's row; one-token tiles are already per token."""
    Tq, Tk, C, Qt = 21, 50, 8, 4
    q, k = _qk(2, Tq, Tk, 2, 2, 16, torch.float32)
    idx, cnt = select_torch(q, k, _cfg(C, 5, 2, 2, Qt=Qt))
    tok_idx, tok_cnt = tiles_to_tokens(idx, cnt, Tq, Tk, Qt)
    assert tok_idx.shape == (2, Tq, 2, 5) and tok_cnt.shape == (2, Tq, 2)
    for t in range(Tq):
        j = (Tk - Tq + t) // Qt - (Tk - Tq) // Qt
        assert torch.equal(tok_idx[:, t], idx[:, j]) and torch.equal(tok_cnt[:, t], cnt[:, j])
    one = select_torch(q, k, _cfg(C, 5, 2, 2))
    assert_same(tiles_to_tokens(*one, Tq, Tk, 1), one, "Qt = 1")


def test_tiles_through_the_op(rng):
    """The custom op carries the new knobs (torch and naive backends; the fake kernel's shape)."""
    q, k = _qk(1, 30, 90, 2, 2, 16)
    cfg = per_token_config(block_size=8, topk=5, beam=2, scorer="bound", scale=0.25, query_tile=4,
                           beam_leaf=3, tile_reduce="lse")
    want = naive_select(q, k, cfg)
    assert_same(select(q, k, cfg=cfg, backend="naive"), want, "naive")
    assert_same(select(q, k, cfg=cfg, backend="torch"), want, "torch")
    qm, km = torch.empty(2, 7, 4, 16, device="meta"), torch.empty(2, 30, 2, 16, device="meta")
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        idx, cnt = select(qm, km, cfg=cfg, backend="torch")
    assert idx.shape == (2, 3, 2, 5) and cnt.shape == (2, 3, 2)  # positions 23..29: tiles 5..7


def test_qmean_scores_a_tile_by_its_mean_query(rng):
    """``tile_reduce="qmean"``: a tile selects as one token whose query is the per-head mean of
    the tile's real queries (the oracle run on that virtual token at the tile's last position),
    partial first and last tiles included; with the flat mean scorer (linear in the query) it
    ranks as ``"sum"`` does."""
    Tq, Tk, C, Qt = 45, 130, 8, 4
    q, k = _qk(1, Tq, Tk, 2, 2, 16)
    cfg = _cfg(C, 5, 2, 2, "lse", Qt=Qt, W2=3, reduce="qmean")
    want = select_torch(q, k, cfg)
    assert_same(want, naive_select(q, k, cfg), "qmean: torch vs the oracle")
    t0 = Tk - Tq
    per_token = _cfg(C, 5, 2, 2, "lse", W2=3)
    for j in range(n_query_tiles(Tq, Tk, Qt)):
        lo, hi = max((t0 // Qt + j) * Qt, t0), min((t0 // Qt + j + 1) * Qt, Tk)
        q_mean = q[:, lo - t0:hi - t0].mean(1, keepdim=True)
        alone = naive_select(q_mean, k[:, :hi], per_token)
        assert_same(alone, (want[0][:, j:j + 1], want[1][:, j:j + 1]), f"tile {j}")
    flat = [select_torch(q, k, _cfg(C, 5, 2, 2, selector="flat_mean", Qt=Qt, reduce=r))
            for r in ("sum", "qmean")]
    assert_same(flat[1], flat[0], "flat_mean: qmean ranks as sum")
