"""Selections transposed by block: entries grouped by the block they read (CSR over blocks).

Whenever many queries (or query tiles) each read a few blocks (the torch leaf stage and attention,
the Triton "csc" leaf stage, the Triton dK/dV pass), grouping the (query, block) entries by block
lets a group of queries share one read of the block. One primitive, ``sort_by_key``, does the
grouping for all of them: a stable sort (queries stay ascending inside a block's list) and the
start of each block's run, found by ``searchsorted`` (no host sync). O(entries) memory: never a
dense token x block mask.

Selections by query tiles (a row per aligned tile of ``query_tile`` absolute positions) read as
per-token selections through ``token_tile_rows`` (the one home of that mapping).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def sort_by_key(key: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the entries of ``key [P]`` (values in ``[0, n_keys)``; larger values sort last and
    belong to no group): ``order [P]``, entry ids sorted by key, stable; ``start [n_keys + 1]``,
    group ``i`` is ``order[start[i]:start[i + 1]]``."""
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(n_keys + 1, dtype=key.dtype, device=key.device)
    return order, torch.searchsorted(sorted_key, bounds)


def token_tile_rows(n_queries: int, n_keys: int, query_tile: int,
                    device=None) -> torch.Tensor:
    """For each of the last ``n_queries`` of ``n_keys`` positions, the row of a selection by query
    tiles that holds it ``[n_queries]`` int64: query ``t`` at absolute position
    ``p = n_keys - n_queries + t`` is in tile ``p // query_tile``, row
    ``p // query_tile - (n_keys - n_queries) // query_tile`` (``n_query_tiles`` rows in all)."""
    t0 = n_keys - n_queries
    return torch.arange(t0, n_keys, device=device) // query_tile - t0 // query_tile


@dataclass(frozen=True)
class PairGroups:
    """(query, block) pairs regrouped by block into groups of at most ``size`` (torch backends):
    each group reads its block once for all its queries, so the bytes moved per pair drop from
    ``C*D`` to about ``G*D``."""

    order: torch.Tensor   # [P] pair ids sorted by block
    group: torch.Tensor   # [P] group of each sorted pair
    slot: torch.Tensor    # [P] its row inside the group
    block: torch.Tensor   # [n_groups] block each group reads
    size: int

    @property
    def n_groups(self) -> int:
        return self.block.shape[0]

    def layout(self, per_pair: torch.Tensor, empty: int) -> torch.Tensor:
        """``per_pair [P]`` values laid out as ``[n_groups * size]`` (``empty`` in unused slots)."""
        out = torch.full((self.n_groups * self.size,), empty, dtype=per_pair.dtype,
                         device=per_pair.device)
        out[self.group * self.size + self.slot] = per_pair[self.order]
        return out


def group_pairs(pair_block: torch.Tensor, n_blocks: int, size: int) -> PairGroups:
    """Group pairs (``pair_block [P]`` = the block each pair reads, < ``n_blocks``) by block."""
    order, start = sort_by_key(pair_block, n_blocks)
    block = pair_block[order]
    groups_per_block = (start.diff() + size - 1) // size
    first_group = torch.cumsum(groups_per_block, 0) - groups_per_block
    rank = torch.arange(block.numel(), device=block.device) - start[block]
    group_block = torch.repeat_interleave(torch.arange(n_blocks, device=block.device),
                                          groups_per_block)
    return PairGroups(order, first_group[block] + rank // size, rank % size, group_block, size)


# entries one sort handles: torch's sort indexes with 32-bit ints on some paths, and pieces keep
# its temporaries (keys, order, sorted keys: 24 bytes an entry) bounded
SORT_PIECE = 1 << 28


def _sort_by_key_pieces(key: torch.Tensor, n_keys: int,
                        rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sort_by_key`` of ``key [rows * E]`` whose ``rows`` consecutive runs of ``E`` entries hold
    increasing, disjoint key ranges (row ``r``'s keys precede row ``r + 1``'s), less the entries
    of no group: the runs are sorted in pieces of whole rows, the entries ``>= n_keys`` dropped
    from each, and the pieces concatenated, which is the one stable sort's grouped part."""
    per_row = key.numel() // max(rows, 1)
    step = max(1, SORT_PIECE // max(per_row, 1))
    orders = []
    for r0 in range(0, rows, step):
        lo, hi = r0 * per_row, min(rows, r0 + step) * per_row
        sorted_key, order = torch.sort(key[lo:hi], stable=True)
        n_valid = torch.searchsorted(sorted_key, n_keys)  # on device: no sync per piece
        orders.append(torch.where(torch.arange(hi - lo, device=key.device) < n_valid,
                                  order + lo, -1))
    order = torch.cat(orders)
    order = order[order >= 0]
    bounds = torch.arange(n_keys + 1, dtype=key.dtype, device=key.device)
    return order, torch.searchsorted(key[order], bounds)


def block_work_items(block_idx: torch.Tensor, n_blocks: int, chunk: int):
    """The transpose of a selection ``block_idx [B, R, HKV, S]`` cut into work items of at most
    ``chunk`` selection rows (the Triton dK/dV pass: the sink block, which every row chooses, must
    not make one program straggle). A row is a query token (per-token selections, ``R = Tq``) or a
    query tile (tile selections, ``R = n_query_tiles(Tq, Tk, Qt)``): the transpose is the same.

    Returns ``rows`` int32 (for every (batch, KV head, block) in turn, the ascending rows that
    chose it), ``items [n_items, 5]`` int64 rows ``(key, start, end, slot, n_parts)`` with
    ``key = (b * HKV + h) * n_blocks + block`` and ``rows[start:end]`` its chunk (64-bit: the
    ``B * HKV * R * S`` entries pass 2**31 at 1M tokens with 64 KV heads), ``slot`` the chunk's
    scratch row when the block is split (else -1) and ``n_parts`` the block's chunk count on its
    first chunk (else 0), and the number of scratch rows (a host int: one sync). O(entries)
    memory: never a dense row x block mask.
    """
    B, R, H, S = block_idx.shape
    n_keys = B * H * n_blocks
    idx = block_idx.permute(0, 2, 1, 3).long()  # [B, H, R, S]: entries in row order
    base = torch.arange(B * H, device=idx.device).view(B, H, 1, 1) * n_blocks
    key = torch.where((idx >= 0) & (idx < n_blocks), base + idx, n_keys).flatten()
    perm, start = _sort_by_key_pieces(key, n_keys, B * H)
    del key
    rows = ((perm // S) % R).to(torch.int32)
    del perm
    counts, ends = start.diff(), start[1:]
    n_chunks = (counts + chunk - 1) // chunk
    split = n_chunks > 1
    n_items, n_parts = torch.stack([n_chunks.sum(), (n_chunks * split).sum()]).tolist()
    item_key = torch.repeat_interleave(torch.arange(n_keys, device=idx.device), n_chunks,
                                       output_size=n_items)
    j = torch.arange(n_items, device=idx.device) - (n_chunks.cumsum(0) - n_chunks)[item_key]
    start_i = ends[item_key] - counts[item_key] + j * chunk
    end_i = torch.minimum(start_i + chunk, ends[item_key])
    item_split = split[item_key]
    slot = torch.where(item_split, item_split.cumsum(0) - 1, -1)
    n_parts_first = torch.where(item_split & (j == 0), n_chunks[item_key], 0)
    items = torch.stack([item_key, start_i, end_i, slot, n_parts_first], 1)
    return rows, items.contiguous(), n_parts


def token_rows(block_idx: torch.Tensor, n_queries: int, n_keys: int,
               query_tile: int) -> torch.Tensor:
    """The per-token selection ``[B, n_queries, HKV, S]`` of a selection by query tiles
    (``[B, n_query_tiles(n_queries, n_keys, query_tile), HKV, S]``): each token takes its tile's
    row (``token_tile_rows``). ``query_tile = 1``: ``block_idx`` itself."""
    if query_tile == 1:
        return block_idx
    return block_idx.index_select(1, token_tile_rows(n_queries, n_keys, query_tile,
                                                     block_idx.device))
