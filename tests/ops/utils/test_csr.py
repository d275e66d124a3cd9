"""``pisa.ops.utils.csr``: selections transposed by block (one implementation for every op)."""
import pytest
import torch

from pisa.ops.utils.config import n_query_tiles
from pisa.ops.utils.csr import block_work_items, group_pairs, sort_by_key, token_tile_rows
from pisa.ops.utils.geometry import cdiv
from tests.ops.attn.common import random_selection


def test_sort_by_key_groups_stably_and_drops_out_of_range_keys(rng):
    key = torch.randint(0, 8, (200,))  # 7 is past n_keys: no group
    order, start = sort_by_key(key, 7)
    assert start.shape == (8,) and int(start[0]) == 0 and int(start[-1]) == int((key < 7).sum())
    for i in range(7):
        members = order[start[i]:start[i + 1]].tolist()
        assert members == sorted(members), "stable: ids ascend inside a group"
        assert members == (key == i).nonzero().flatten().tolist()


def test_group_pairs_covers_every_pair_once_in_groups_of_at_most_size(rng):
    n_blocks, size = 9, 4
    pair_block = torch.randint(0, n_blocks, (103,))
    pg = group_pairs(pair_block, n_blocks, size)
    assert sorted(pg.order.tolist()) == list(range(103))
    assert bool((pg.slot < size).all()) and pg.size == size
    seen = set()
    for p, grp, slot in zip(pg.order.tolist(), pg.group.tolist(), pg.slot.tolist()):
        assert int(pg.block[grp]) == int(pair_block[p]), "a group reads its pairs' block"
        assert (grp, slot) not in seen
        seen.add((grp, slot))
    counts = torch.bincount(pair_block, minlength=n_blocks)
    assert pg.n_groups == int(((counts + size - 1) // size).sum()), "as few groups as possible"
    laid = pg.layout(torch.arange(103), -1)
    assert laid.shape == (pg.n_groups * size,)
    assert sorted(x for x in laid.tolist() if x >= 0) == list(range(103))


@pytest.mark.parametrize("query_tile,chunk", [(1, 7), (4, 3)])
def test_block_work_items_lists(query_tile, chunk, rng):
    """Every (block, row) pick appears once — rows are tokens, or tiles — lists ascend, chunks
    respect the limit, split chunks get the scratch slots 0 .. n_parts - 1."""
    B, Tq, Tk, H, C, S = 2, 50, 80, 3, 16, 4
    idx = random_selection(B, Tq, Tk, H, C, S, min_blocks=1, seed=rng, device="cpu",
                           query_tile=query_tile)
    nb = cdiv(Tk, C)
    rows, items, n_parts = block_work_items(idx, nb, chunk)
    got = set()
    for key, start, end, slot, n in items.tolist():
        assert 0 < end - start <= chunk
        listed = rows[start:end].tolist()
        assert listed == sorted(listed) and max(listed) < idx.shape[1]
        bh, c = divmod(key, nb)
        got |= {(bh // H, r, bh % H, c) for r in listed}
    want = {(b, r, h, int(idx[b, r, h, s]))
            for b, r, h, s in zip(*(x.tolist() for x in torch.nonzero(idx >= 0, as_tuple=True)))}
    assert got == want
    slots = items[:, 3]
    assert sorted(slots[slots >= 0].tolist()) == list(range(n_parts))


def test_block_work_items_sorted_in_pieces(rng, monkeypatch):
    """Sorting whole (batch, KV head) rows in pieces gives the one stable sort's lists; items are
    64-bit (their token offsets pass 2**31 at 1M tokens with 64 KV heads)."""
    from pisa.ops.utils import csr
    B, Tq, Tk, H, C, S, chunk = 2, 40, 96, 3, 16, 5, 6
    idx = random_selection(B, Tq, Tk, H, C, S, min_blocks=1, seed=rng, device="cpu")
    nb = cdiv(Tk, C)
    whole = block_work_items(idx, nb, chunk)
    monkeypatch.setattr(csr, "SORT_PIECE", Tq * S * 2)  # two rows a piece: three pieces
    pieces = block_work_items(idx, nb, chunk)
    assert pieces[1].dtype == torch.int64
    assert torch.equal(whole[0], pieces[0]) and torch.equal(whole[1], pieces[1])
    assert whole[2] == pieces[2]


def test_token_tile_rows_maps_each_query_to_its_aligned_tile():
    """Query t (absolute position Tk - Tq + t) reads row p // Qt - (Tk - Tq) // Qt; the rows run
    over all n_query_tiles and ascend; Qt = 1 is the identity."""
    for Tq, Tk, Qt in [(1, 1, 1), (7, 7, 1), (37, 100, 16), (50, 50, 4), (5, 64, 64), (33, 90, 8)]:
        rows = token_tile_rows(Tq, Tk, Qt)
        pos = torch.arange(Tk - Tq, Tk)
        assert torch.equal(rows, pos // Qt - (Tk - Tq) // Qt)
        assert int(rows[0]) == 0 and int(rows[-1]) == n_query_tiles(Tq, Tk, Qt) - 1
        assert bool((rows.diff() >= 0).all())
    assert torch.equal(token_tile_rows(9, 20, 1), torch.arange(9))
