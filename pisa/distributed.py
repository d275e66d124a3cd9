"""Context parallelism: PISA attention over a sequence sharded across the ranks of a
``torch.distributed`` process group (NCCL on GPU, gloo on CPU). Design and costs:
``docs/context_parallel.md``.

Each rank holds its shard of the sequence, ``q [B, T_r, HQ, D]``, ``k, v [B, T_r, HKV, D]``, laid
out by ``layout``:

- ``"zigzag"`` (default): the ``N = cdiv(T, C)`` leaf blocks are cut into ``2 * world`` chunks of
  ``N // (2 * world)`` or one more blocks; rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``,
  in that order (as ring attention and ``torch.distributed.tensor.experimental.context_parallel``
  do): every rank gets about the same causal work.
- ``"contiguous"``: rank ``r`` holds the ``r``-th run of tokens; shard lengths may differ
  (ragged), but every shard except the last rank's must be a whole number of blocks of ``C``
  tokens (a leaf block never straddles two ranks).

``shard`` cuts a full ``[B, T, ...]`` tensor into this rank's shard and ``unshard`` gathers the
shards back; ``shard_positions`` gives the global positions of a rank's tokens (RoPE).

One call of ``pisa_attn_cp`` on every rank of ``group``, with the same knobs:

1. Lengths: an all-gather of the shard lengths gives every rank the global layout.
2. Pyramid: each rank sums the leaf blocks of its shard (``leaf_summaries``: key sums, and with
   ``scorer="bound"`` per-channel minima and maxima); an all-gather of those leaves (``N``
   vectors per KV head and batch, padded to the longest shard) and a local fold
   (``pyramid_from_leaves``) give every rank the global pyramid, equal to the single-process one.
3. Selection: each shard range ``[s, e)`` selects its queries as the tail of the keys
   ``[0, e)`` with the library's selection op (any backend, the Triton kernels on CUDA) over that
   pyramid. The exact leaf stage reads the keys of candidate leaves, which the kernels address by
   global block id, so the keys (not the values) of the sequence are all-gathered for it and freed
   before attention: ``T * HKV * D`` elements a rank at the peak. The selection equals
   ``pisa_select`` on the gathered sequence.
4. Attention: each rank requests the (batch, KV head, block) triples its queries selected that it
   does not hold, without duplicates, from their owners (an all-to-all of counts, of requests, then
   of the K and V rows); per range it builds compact ``k, v`` of the fetched blocks (ascending,
   per batch and head) followed by the range's own tokens, remaps the selection onto them (the
   order and the causal position of every block are kept, so the kernels' summation order is
   that of the single-process call) and runs ``pisa.ops.attn.sparse_attn``. The backward sends
   the fetched blocks' dK / dV back to their owners (the reverse all-to-all), which add them to
   their own.

``comm_bytes`` counts the bytes each rank sends per phase (``reset_comm_bytes`` clears it).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ops.attn import sparse_attn
from .ops.pyramid.torch_backend import leaf_summaries, pyramid_from_leaves
from .ops.select import select
from .ops.utils.config import (BEAM_LEAF, SCORER, TILE_REDUCE, SelectConfig, check_knobs,
                               check_qk, config_of, resolve_backend)
from .ops.utils.geometry import cdiv

LAYOUTS = ("zigzag", "contiguous")

_C, _K, _G = SelectConfig.block_size, SelectConfig.topk, SelectConfig.branching
_BYTES: Counter = Counter()


def comm_bytes() -> dict[str, int]:
    """Bytes this rank has sent to other ranks since the last ``reset_comm_bytes``, per phase:
    ``"lengths"`` (shard lengths), ``"summaries"`` (the pyramid's leaves), ``"select_keys"`` (the
    keys the selection's leaf stage reads), ``"requests"`` (counts and ids of requested blocks),
    ``"kv"`` (K and V rows of requested blocks), ``"grad_kv"`` (their dK / dV, backward) and
    ``"total"``."""
    out = dict(_BYTES)
    out["total"] = sum(_BYTES.values())
    return out


def reset_comm_bytes() -> None:
    """Zero the counters of ``comm_bytes``."""
    _BYTES.clear()


@dataclass(frozen=True)
class ShardLayout:
    """Where the tokens of a sharded sequence live: ``ranges[p]`` lists the global token ranges
    ``(start, end)`` rank ``p`` holds, in the order of its local tensor; ``seqlen`` is ``T``,
    ``rank`` this process's rank in the group."""

    seqlen: int
    block_size: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    rank: int

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def local_ranges(self) -> tuple[tuple[int, int], ...]:
        return self.ranges[self.rank]

    def local_len(self, rank: int | None = None) -> int:
        """Tokens rank ``rank`` (default: this one) holds."""
        return sum(e - s for s, e in self.ranges[self.rank if rank is None else rank])

    def positions(self, device=None) -> torch.Tensor:
        """Global positions ``[T_r]`` int64 of this rank's tokens, in local order."""
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.local_ranges])


def zigzag_ranges(seqlen: int, world: int, block_size: int) -> list[tuple[tuple[int, int], ...]]:
    """The zigzag layout of ``seqlen`` tokens over ``world`` ranks: ``2 * world`` chunks of whole
    blocks (the first ones one block longer when they do not divide evenly; the last chunk holds
    the ragged tail); rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``."""
    n_blocks, n_chunks = cdiv(seqlen, block_size), 2 * world
    cut = [min(seqlen, block_size * (i * n_blocks // n_chunks)) for i in range(n_chunks + 1)]
    cut[-1] = seqlen
    chunk = [(cut[i], cut[i + 1]) for i in range(n_chunks)]
    return [(chunk[r], chunk[n_chunks - 1 - r]) for r in range(world)]


def contiguous_ranges(lengths: list[int]) -> list[tuple[tuple[int, int], ...]]:
    """Rank ``r`` holds tokens ``[sum(lengths[:r]), sum(lengths[:r + 1]))``."""
    starts = [sum(lengths[:r]) for r in range(len(lengths) + 1)]
    return [((starts[r], starts[r + 1]),) for r in range(len(lengths))]


def _group_rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pisa.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_layout(local_len: int, *, group=None, layout: str = "zigzag",
                 block_size: int = _C, device=None) -> ShardLayout:
    """The ``ShardLayout`` of shards of ``local_len`` tokens on each rank of ``group`` (a
    collective: one all-gather of the lengths). ``layout="zigzag"`` needs the lengths
    ``zigzag_ranges`` gives for their sum; ``"contiguous"`` needs every rank's length but the
    last one's to be a multiple of ``block_size``. ``device``: where the lengths travel (the
    group's device: CUDA for NCCL)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rank, world = _group_rank_world(group)
    mine = torch.tensor([local_len], dtype=torch.int64, device=device)
    lens = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather(lens, mine, group)
    _BYTES["lengths"] += 8 * (world - 1)
    lengths = lens.tolist()
    T = sum(lengths)
    if layout == "zigzag":
        ranges = zigzag_ranges(T, world, block_size)
        want = [sum(e - s for s, e in r) for r in ranges]
        if lengths != want:
            raise ValueError(f"layout='zigzag' with {T} tokens over {world} ranks in blocks of "
                             f"{block_size} needs shard lengths {want} (pisa.distributed.shard), "
                             f"got {lengths}")
    else:
        bad = [r for r, n in enumerate(lengths[:-1]) if n % block_size]
        if bad:
            raise ValueError(f"layout='contiguous' needs every shard but the last rank's to be a "
                             f"multiple of block_size={block_size} tokens (a block never straddles "
                             f"two ranks), got lengths {lengths}")
        ranges = contiguous_ranges(lengths)
    return _checked(ShardLayout(T, block_size, tuple(tuple(r) for r in ranges), rank))


def _checked(lay: ShardLayout) -> ShardLayout:
    """``lay`` if no rank's range is empty (every rank must hold tokens of every range of its
    layout: a rank without queries would skip the backward's collective)."""
    if any(e <= s for ranges in lay.ranges for s, e in ranges):
        raise ValueError(f"every shard range must hold tokens: {lay.seqlen} tokens in blocks of "
                         f"{lay.block_size} over {lay.world} ranks give ranges {lay.ranges} (a "
                         "zigzag layout needs at least 2 * world blocks)")
    return lay


def make_layout(seqlen: int, *, world: int, rank: int, layout: str = "zigzag",
                block_size: int = _C, lengths: list[int] | None = None) -> ShardLayout:
    """The ``ShardLayout`` of ``seqlen`` tokens over ``world`` ranks as seen by ``rank``, without
    communication (what ``shard`` cuts; ``shard_layout`` finds it from the shards instead).
    ``lengths``: the contiguous layout's shard lengths (default: whole blocks, as even as they
    come, the last rank taking the ragged tail)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag":
        if lengths is not None:
            raise ValueError("lengths is for layout='contiguous' (zigzag shards are fixed)")
        ranges = zigzag_ranges(seqlen, world, block_size)
    else:
        if lengths is None:
            n = cdiv(seqlen, block_size)
            cut = [min(seqlen, block_size * (r * n // world)) for r in range(world)] + [seqlen]
            lengths = [cut[r + 1] - cut[r] for r in range(world)]
        if len(lengths) != world or sum(lengths) != seqlen or min(lengths) < 0 \
                or any(n % block_size for n in lengths[:-1]):
            raise ValueError(f"lengths must be {world} non-negative shard lengths summing to "
                             f"{seqlen}, all but the last multiples of block_size={block_size}, "
                             f"got {lengths}")
        ranges = contiguous_ranges(lengths)
    return _checked(ShardLayout(seqlen, block_size, tuple(tuple(r) for r in ranges), rank))


def shard(x: torch.Tensor, *, group=None, rank: int | None = None, world: int | None = None,
          layout: str = "zigzag", block_size: int = _C, lengths: list[int] | None = None,
          dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full ``x`` (the sequence along ``dim``, default 1 as in
    ``[B, T, H, D]`` or ``[B, T]`` token ids): the ranges of ``layout`` concatenated (a copy).
    ``rank`` / ``world`` default to ``group``'s (no communication). ``lengths``: the contiguous
    layout's shard lengths (default: whole blocks, as even as they come)."""
    if rank is None or world is None:
        rank, world = _group_rank_world(group)
    lay = make_layout(x.shape[dim], world=world, rank=rank, layout=layout,
                      block_size=block_size, lengths=lengths)
    return torch.cat([x.narrow(dim, s, e - s) for s, e in lay.local_ranges], dim=dim)


def unshard(x: torch.Tensor, *, group=None, layout: str = "zigzag", block_size: int = _C,
            dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard ``x`` (a collective: the inverse of ``shard``; the
    contiguous layout may be ragged). Not differentiable."""
    x = x.movedim(dim, 0).contiguous()
    lay = shard_layout(x.shape[0], group=group, layout=layout, block_size=block_size,
                       device=x.device)
    longest = max(lay.local_len(p) for p in range(lay.world))
    buf = x.new_zeros(longest, *x.shape[1:])
    buf[:x.shape[0]] = x
    out = x.new_empty(lay.world * longest, *x.shape[1:])
    _all_gather(out, buf, group)
    full = x.new_empty(lay.seqlen, *x.shape[1:])
    for p, ranges in enumerate(lay.ranges):
        o = p * longest
        for s, e in ranges:
            full[s:e] = out[o:o + e - s]
            o += e - s
    return full.movedim(0, dim)


def shard_positions(seqlen: int, *, group=None, layout: str = "zigzag", block_size: int = _C,
                    lengths: list[int] | None = None, device=None) -> torch.Tensor:
    """Global positions ``[T_r]`` int64 of this rank's tokens under ``shard``'s layout."""
    rank, world = _group_rank_world(group)
    return make_layout(seqlen, world=world, rank=rank, layout=layout, block_size=block_size,
                       lengths=lengths).positions(device)


# ------------------------------------------------------------------------------------------------
# Gathering what every rank needs
# ------------------------------------------------------------------------------------------------

def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``all_gather_single`` (torch >= 2.13), ``all_gather_into_tensor`` before it."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _gather_rows(x: torch.Tensor, lay: ShardLayout, rows_of, group) -> tuple[torch.Tensor, int]:
    """All-gather ``x [B, n_r, ...]`` (rank ``p`` holds ``rows_of(p)`` rows: one per block or per
    token of its ranges, in local order), padded to the longest; returns the gathered
    ``[world, B, n_max, ...]`` and the bytes this rank sent."""
    n_max = max(rows_of(p) for p in range(lay.world))
    buf = x.new_zeros(x.shape[0], n_max, *x.shape[2:])
    buf[:, :x.shape[1]] = x
    out = x.new_empty(lay.world * x.shape[0], n_max, *x.shape[2:])
    _all_gather(out, buf, group)
    return out.view(lay.world, *buf.shape), buf.numel() * buf.element_size() * (lay.world - 1)


def _leaf_rows(lay: ShardLayout, p: int) -> int:
    """Leaf blocks rank ``p`` holds (its ranges are block aligned)."""
    return sum(cdiv(e, lay.block_size) - s // lay.block_size for s, e in lay.ranges[p])


def _global_leaves(k: torch.Tensor, lay: ShardLayout, cfg: SelectConfig, group):
    """The leaf summaries of the whole sequence, ``(sums, mins, maxs)`` ``[B, cdiv(T, C), HKV,
    D]`` (bounds only for ``scorer="bound"``, else None), from every rank's (one all-gather)."""
    C = lay.block_size
    n_cat = 3 if cfg.uses_bounds else 1
    leaves = torch.cat([torch.cat(leaf_summaries(k[:, o:o + e - s], C, cfg.uses_bounds)[:n_cat],
                                  dim=-1)
                        for (s, e), o in zip(lay.local_ranges, _offsets(lay.local_ranges))],
                       dim=1)
    gathered, sent = _gather_rows(leaves, lay, lambda p: _leaf_rows(lay, p), group)
    _BYTES["summaries"] += sent
    full = leaves.new_empty(k.shape[0], cdiv(lay.seqlen, C), k.shape[2], leaves.shape[-1])
    for p, ranges in enumerate(lay.ranges):
        o = 0
        for s, e in ranges:
            n = cdiv(e, C) - s // C
            full[:, s // C:s // C + n] = gathered[p, :, o:o + n]
            o += n
    sums, *bounds = full.chunk(n_cat, dim=-1)
    return (sums, *bounds) if bounds else (sums, None, None)


def _offsets(ranges) -> list[int]:
    """Local offset of each range in the concatenation of ``ranges``."""
    out, o = [], 0
    for s, e in ranges:
        out.append(o)
        o += e - s
    return out


def _gather_keys(k: torch.Tensor, lay: ShardLayout, group) -> torch.Tensor:
    """The keys of the whole sequence ``[B, T, HKV, D]`` from every rank's shard."""
    gathered, sent = _gather_rows(k, lay, lay.local_len, group)
    _BYTES["select_keys"] += sent
    full = k.new_empty(k.shape[0], lay.seqlen, *k.shape[2:])
    for p, ranges in enumerate(lay.ranges):
        for (s, e), o in zip(ranges, _offsets(ranges)):
            full[:, s:e] = gathered[p, :, o:o + e - s]
    return full


def _select_cp(q, k, lay: ShardLayout, cfg: SelectConfig, backend: str, group):
    """Per local range: the selection of its queries (``pisa_select``'s rows, global block ids)."""
    C, g = lay.block_size, cfg.branching
    leaves = _global_leaves(k, lay, cfg, group)
    keys = _gather_keys(k, lay, group)
    out = []
    for (s, e), o in zip(lay.local_ranges, _offsets(lay.local_ranges)):
        n = cdiv(e, C)
        sums, mins, maxs = (None if x is None else x[:, :n] for x in leaves)
        pyr = pyramid_from_leaves(sums, e, C, g, mins, maxs)
        out.append(select(q[:, o:o + e - s], keys[:, :e], cfg=cfg, backend=backend,
                          pyramid=pyr)[0])
    return out


# ------------------------------------------------------------------------------------------------
# Fetching the K / V of selected remote blocks
# ------------------------------------------------------------------------------------------------

@dataclass
class _RangePlan:
    """How one local range's compact ``k, v`` are built: ``n_slots`` fetched blocks per (batch,
    KV head), then the range's own tokens ``[lo, lo + n_tok)`` of the local tensor. Slot
    ``(b, slot, h)`` takes local block ``(b, src, h)`` (``loc_*``) or fetched row ``row``
    (``rem_*``)."""

    lo: int
    n_tok: int
    n_slots: int
    loc_b: torch.Tensor
    loc_slot: torch.Tensor
    loc_h: torch.Tensor
    loc_src: torch.Tensor
    rem_b: torch.Tensor
    rem_slot: torch.Tensor
    rem_h: torch.Tensor
    rem_row: torch.Tensor


@dataclass
class _FetchPlan:
    """The exchange of one call: this rank receives ``recv_counts[p]`` rows from rank ``p`` (its
    requests, sorted by owner) and sends ``send_counts[p]`` rows of its local blocks
    ``(send_b, send_blk, send_h)`` to rank ``p``."""

    ranges: list[_RangePlan]
    recv_counts: list[int]
    send_counts: list[int]
    send_b: torch.Tensor
    send_blk: torch.Tensor
    send_h: torch.Tensor
    group: object


def _block_owners(lay: ShardLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``owner [N]`` (rank holding each block) and ``local [N]`` (its block index in the owner's
    local tensor)."""
    N, C = cdiv(lay.seqlen, lay.block_size), lay.block_size
    owner = torch.empty(N, dtype=torch.int64)
    local = torch.empty(N, dtype=torch.int64)
    for p, ranges in enumerate(lay.ranges):
        for (s, e), o in zip(ranges, _offsets(ranges)):
            blocks = torch.arange(s // C, cdiv(e, C))
            owner[blocks] = p
            local[blocks] = o // C + blocks - s // C
    return owner.to(device), local.to(device)


def _exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
              phase: str) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x`` (``send_counts[p]`` rows to rank ``p``, in
    order); returns the ``sum(recv_counts)`` rows received, counting the bytes sent."""
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    row = math.prod(x.shape[1:]) * x.element_size()
    me = dist.get_rank(group)
    _BYTES[phase] += row * (sum(send_counts) - send_counts[me])
    return out


def _plan(block_idx: list, lay: ShardLayout, B: int, H: int, device, group):
    """The fetch plan of the selections ``block_idx`` (one per local range, global ids) and the
    selections remapped onto each range's compact ``k, v``."""
    C, N, me = lay.block_size, cdiv(lay.seqlen, lay.block_size), lay.rank
    owner, local = _block_owners(lay, device)
    per_range, remote = [], []
    for idx, (s, e), o in zip(block_idx, lay.local_ranges, _offsets(lay.local_ranges)):
        first = s // C
        before = (idx >= 0) & (idx < first)
        b, _, h, _ = torch.nonzero(before, as_tuple=True)
        key = (b * H + h) * N + idx[before].long()  # (batch, head, block), ordered that way
        uniq = torch.unique(key)
        grp = uniq // N
        start = torch.searchsorted(uniq, grp * N)
        slot = torch.arange(uniq.numel(), device=device) - start
        n_slots = int(slot.max()) + 1 if uniq.numel() else 0
        remap = torch.where(idx >= first, idx - first + n_slots, idx)
        pos = torch.searchsorted(uniq, key)
        remap[before] = slot[pos].to(remap.dtype)
        blk = uniq % N
        mine = owner[blk] == me
        per_range.append((o, e - s, n_slots, remap, uniq, slot, mine))
        remote.append(uniq[~mine])
    # this rank's requests: unique (batch, head, block) triples, grouped by owner
    req = torch.unique(torch.cat(remote))
    req_owner = owner[req % N]
    order = torch.sort(req_owner * (B * H * N) + req).indices
    req, req_owner = req[order], req_owner[order]
    recv_counts = torch.bincount(req_owner, minlength=lay.world)
    send_counts = _exchange(recv_counts, [1] * lay.world, [1] * lay.world, group, "requests")
    recv_counts, send_counts = recv_counts.tolist(), send_counts.tolist()
    served = _exchange(req, recv_counts, send_counts, group, "requests")
    ranges, remapped = [], []
    for item in per_range:
        o, n_tok, n_slots, remap, uniq, slot, mine = item
        grp, blk = uniq // N, uniq % N
        # a range's remote triples sit in req at a position found by their (owner, key) order
        comp = owner[blk] * (B * H * N) + uniq
        req_comp = req_owner * (B * H * N) + req
        row = torch.searchsorted(req_comp, comp[~mine])
        ranges.append(_RangePlan(o, n_tok, n_slots, grp[mine] // H, slot[mine], grp[mine] % H,
                                 local[blk[mine]], grp[~mine] // H, slot[~mine], grp[~mine] % H,
                                 row))
        remapped.append(remap)
    sgrp, sblk = served // N, served % N
    plan = _FetchPlan(ranges, recv_counts, send_counts, sgrp // H, local[sblk], sgrp % H, group)
    return plan, remapped


def _blocks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``x [B, T, H, D]`` zero-padded to whole blocks, as the view ``[B, n_blocks, H, C, D]``."""
    B, T, H, D = x.shape
    pad = cdiv(T, C) * C - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, D)], dim=1)
    return x.view(B, -1, C, H, D).transpose(2, 3)


class _FetchKV(torch.autograd.Function):
    """``(k, v)`` local shards -> the compact ``k, v`` of every local range (a flat tuple); the
    backward returns the fetched blocks' gradients to their owners."""

    @staticmethod
    def forward(ctx, k, v, plan: _FetchPlan, C: int):
        ctx.plan, ctx.C, ctx.shape = plan, C, k.shape
        kb, vb = _blocks(k, C), _blocks(v, C)
        D = k.shape[-1]
        served = torch.cat([kb[plan.send_b, plan.send_blk, plan.send_h],
                            vb[plan.send_b, plan.send_blk, plan.send_h]], dim=-1)
        fetched = _exchange(served, plan.send_counts, plan.recv_counts, plan.group, "kv")
        out = []
        B, _, H, _ = k.shape
        for rp in plan.ranges:
            for x, xb, part in ((k, kb, fetched[..., :D]), (v, vb, fetched[..., D:])):
                y = x.new_zeros(B, rp.n_slots * C + rp.n_tok, H, D)
                yb = _blocks(y[:, :rp.n_slots * C], C)
                yb[rp.loc_b, rp.loc_slot, rp.loc_h] = xb[rp.loc_b, rp.loc_src, rp.loc_h]
                yb[rp.rem_b, rp.rem_slot, rp.rem_h] = part[rp.rem_row]
                y[:, rp.n_slots * C:] = x[:, rp.lo:rp.lo + rp.n_tok]
                out.append(y)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        plan, C = ctx.plan, ctx.C
        B, T, H, D = ctx.shape
        dk, dv = (grads[0].new_zeros(B, cdiv(T, C) * C, H, D) for _ in range(2))
        dkb, dvb = _blocks(dk, C), _blocks(dv, C)
        d_fetched = grads[0].new_zeros(sum(plan.recv_counts), C, 2 * D)
        for i, rp in enumerate(plan.ranges):
            for j, (d, db) in enumerate(((dk, dkb), (dv, dvb))):
                g = grads[2 * i + j]
                if g is None:
                    continue
                d[:, rp.lo:rp.lo + rp.n_tok] += g[:, rp.n_slots * C:]
                gb = _blocks(g[:, :rp.n_slots * C], C)
                db.index_put_((rp.loc_b, rp.loc_src, rp.loc_h),
                              gb[rp.loc_b, rp.loc_slot, rp.loc_h], accumulate=True)
                d_fetched[..., j * D:(j + 1) * D].index_add_(
                    0, rp.rem_row, gb[rp.rem_b, rp.rem_slot, rp.rem_h])
        back = _exchange(d_fetched, plan.recv_counts, plan.send_counts, plan.group, "grad_kv")
        for j, db in enumerate((dkb, dvb)):
            db.index_put_((plan.send_b, plan.send_blk, plan.send_h),
                          back[..., j * D:(j + 1) * D], accumulate=True)
        return dk[:, :T], dv[:, :T], None, None


# ------------------------------------------------------------------------------------------------
# The public function
# ------------------------------------------------------------------------------------------------

def _setup(q, k, group, layout, backend, knobs: dict):
    """The resolved backend, ``ShardLayout`` and ``SelectConfig`` of a call (``pisa_select_cp`` /
    ``pisa_attn_cp``) and its selection ``knobs`` (by name)."""
    check_qk(q, k)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} tokens but k {k.shape[1]}: context parallelism is "
                         "self-attention over the same sharded tokens")
    if q.shape[0] == 0:
        raise ValueError("context parallelism needs batch >= 1")
    backend = resolve_backend(backend, q)
    check_knobs(backend=backend, **knobs)  # before the layout's collective reads block_size
    C = knobs["block_size"]
    lay = layout if isinstance(layout, ShardLayout) else shard_layout(
        q.shape[1], group=group, layout=layout, block_size=C, device=q.device)
    if lay.block_size != C or lay.local_len() != q.shape[1]:
        raise ValueError(f"layout holds {lay.local_len()} tokens in blocks of {lay.block_size} "
                         f"on this rank, but q has {q.shape[1]} and block_size={C}")
    # selector="auto" and beam_ref_len go by the global length
    return backend, lay, config_of(q.shape[-1], lay.seqlen, **knobs)


def pisa_select_cp(q: torch.Tensor, k: torch.Tensor, *, group=None,
                   layout: str | ShardLayout = "zigzag", block_size: int = _C, topk: int = _K,
                   branching: int = _G, beam: int | None = None, beam_leaf: int | None = BEAM_LEAF,
                   beam_ref_len: int | None = None, scorer: str = SCORER, selector: str = "pyramid",
                   forced_in_budget: bool = True,
                   scale: float | None = None, query_tile: int | None = None,
                   tile_reduce: str = TILE_REDUCE,
                   backend: str = "auto") -> torch.Tensor:
    """``pisa_select`` of a sequence sharded over ``group`` (a collective; arguments as in
    ``pisa_attn_cp``): this rank's rows of the global selection, ``block_idx (batch, rows_r,
    nheads_k, slots)`` int32 of global block ids, the rows of its ranges concatenated (one per
    token, or per query tile of each range with ``query_tile > 1``): ``shard`` of the
    single-process ``block_idx`` (along its rows, with ``block_size // query_tile`` rows a
    block). No gradient."""
    knobs = dict(block_size=block_size, topk=topk, branching=branching, beam=beam,
                 beam_leaf=beam_leaf, beam_ref_len=beam_ref_len, scorer=scorer, selector=selector,
                 forced_in_budget=forced_in_budget, scale=scale, query_tile=query_tile,
                 tile_reduce=tile_reduce)
    backend, lay, cfg = _setup(q, k, group, layout, backend, knobs)
    return torch.cat(_select_cp(q.detach(), k.detach(), lay, cfg, backend, group), dim=1)


def pisa_attn_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                 layout: str | ShardLayout = "zigzag", block_size: int = _C, topk: int = _K,
                 branching: int = _G, beam: int | None = None, beam_leaf: int | None = BEAM_LEAF,
                 beam_ref_len: int | None = None, scorer: str = SCORER, selector: str = "pyramid",
                 forced_in_budget: bool = True,
                 scale: float | None = None, query_tile: int | None = None,
                 tile_reduce: str = TILE_REDUCE,
                 return_lse: bool = False, deterministic: bool = False, backend: str = "auto"):
    """``pisa_attn`` of a sequence sharded over the ranks of ``group``: a collective, called by
    every rank with its shard and the same knobs. Equals ``pisa_attn`` of the whole sequence
    (``unshard`` of the outputs), its selection and gradients included.

    Arguments:
        q: (batch, seqlen_r, nheads, headdim), this rank's queries, fp16/bf16/fp32 (fp64 for
            the torch / naive backends).
        k, v: (batch, seqlen_r, nheads_k, headdim): the keys and values of the same tokens
            (self-attention; causal over global positions). ``batch >= 1``.
        group: the ``torch.distributed`` process group the sequence is sharded over (default:
            the world). Its backend must carry all-gathers and ``all_to_all_single``
            (NCCL, gloo).
        layout: "zigzag" (default) | "contiguous" | a ``ShardLayout``: where each rank's tokens
            sit in the sequence (module docstring; ``shard`` cuts a full tensor accordingly).
            "contiguous" shards may have different lengths, multiples of ``block_size`` except
            the last rank's. A ``ShardLayout`` (``shard_layout``) skips the all-gather of lengths.
        block_size, topk, branching, beam, beam_leaf, beam_ref_len, scorer, selector,
            forced_in_budget, scale, query_tile, tile_reduce, deterministic, backend: as in
            ``pisa_attn`` (``selector="auto"`` and ``beam_ref_len`` go by the global length).
        return_lse: bool. Also return the log-normaliser of this rank's queries. Default False.

    Returns:
        out: (batch, seqlen_r, nheads, headdim), q's dtype, this rank's rows of the global output.
            Differentiable in q, k, v (the backward is a collective too: every rank runs it).
        lse (only if return_lse): (batch, nheads, seqlen_r) fp32.

    Memory per rank beyond its shard: the global pyramid (about ``2 * cdiv(T, C)`` vectors per
    batch and KV head at ``g = 2``), the keys of the whole sequence during selection (freed before
    attention), and the K / V of the remote blocks its queries selected, without duplicates (at
    most those of the causal prefix). ``comm_bytes`` counts what it sends.
    """
    check_qk(q, k, v)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    knobs = dict(block_size=block_size, topk=topk, branching=branching, beam=beam,
                 beam_leaf=beam_leaf, beam_ref_len=beam_ref_len, scorer=scorer, selector=selector,
                 forced_in_budget=forced_in_budget, scale=scale, query_tile=query_tile,
                 tile_reduce=tile_reduce)
    backend, lay, cfg = _setup(q, k, group, layout, backend, knobs)
    B, H = k.shape[0], k.shape[2]
    block_idx = _select_cp(q.detach(), k.detach(), lay, cfg, backend, group)
    with torch.no_grad():
        plan, remapped = _plan(block_idx, lay, B, H, q.device, group)
    kv = iter(_FetchKV.apply(k, v, plan, block_size))
    outs, lses = [], []
    for idx, (s, e), o in zip(remapped, lay.local_ranges, _offsets(lay.local_ranges)):
        out, lse = sparse_attn(q[:, o:o + e - s], next(kv), next(kv), idx, cfg=cfg,
                               backend=backend, deterministic=deterministic)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=2)
    return (out, lse) if return_lse else out
