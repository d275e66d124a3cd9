"""The paged form of the decode cache (``pisa.ops.decode.kvcache``: a page pool addressed by
``block_table``, pyramids per slot addressed by ``cache_batch_idx``) against the contiguous form:
the same keys in pages of shuffled order must give bitwise the same decode steps, appends and
chunked prefill, on the torch backend and the fused Triton kernel (the interpreter without CUDA);
pages or slots outside the cache give NaN rows in the step and ``ValueError`` in the host checks.
"""
from __future__ import annotations

import math

import pytest
import torch

from pisa.ops.decode import prefill_with_cache
from pisa.ops.decode.kvcache import (append_kv, bounds_from_keys, check_batch_idx,
                                     check_block_table, check_cache, gather_pages, write_kv)
from pisa.ops.decode.torch_backend import decode_torch
from pisa.ops.utils.geometry import level_offsets
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.decode.common import make_cache, pyramid_sums, to_pages

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1 without CUDA

from pisa.ops.decode.triton import decode_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def _run(backend, q, k, v, sums, lens, cfg, **kw):
    """``(o, lse[, block_idx])`` of one decode step on ``DEVICE`` (Triton) or CPU (torch)."""
    if backend == "torch":
        return decode_torch(q, k, v, sums, lens, cfg, **kw)
    dev = {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    out = decode_triton(*(x.to(DEVICE) for x in (q, k, v, sums, lens)), cfg,
                        return_block_idx=True, **dev)
    return tuple(x.cpu() for x in out)


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# (B, HKV, G, D, C, g, W, beam_leaf, scorer, T_max, seqlens, num_splits)
CASES = [
    (3, 2, 2, 16, 16, 2, 2, None, "lse", 512, [512, 300, 37], 2),
    (2, 1, 4, 16, 16, 4, 2, None, "lse", 512, [0, 481], 4),
    (3, 1, 2, 16, 16, 2, 2, 4, "bound", 384, [383, 200, 17], 1),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_paged_decode_equals_contiguous_with_shuffled_pages_and_slots(backend, case):
    """Row for row, bitwise: the contiguous cache, the same pages in shuffled order, and the
    paged cache read through ``cache_batch_idx`` for a running batch that holds the slots in
    another order (and leaves one out)."""
    B, HKV, G, D, C, g, W, W2, scorer, T, seqlens, splits = case
    cfg = per_token_config(block_size=C, topk=6, branching=g, beam=W, beam_leaf=W2, scorer=scorer,
                           scale=D ** -0.5)
    q, k, v, sums, lens = make_cache(B, T, HKV, G, D, seqlens, C, g, seed=T + B)
    kw = {"num_splits": splits} if backend == "triton" else {}
    if scorer == "bound":
        kw["mins"], kw["maxs"] = bounds_from_keys(k, lens, C, g)
    want = _run(backend, q, k, v, sums, lens, cfg, **kw)
    k_pool, v_pool, table = to_pages(k, v, C, seed=B)
    _same(_run(backend, q, k_pool, v_pool, sums, lens, cfg, block_table=table, **kw), want)
    order = [B - 1, 0]  # a running batch of two of the slots, the last first
    idx = torch.tensor(order, dtype=torch.int32)
    got = _run(backend, q[order], k_pool, v_pool, sums, lens[order], cfg, block_table=table[order],
               cache_batch_idx=idx, **kw)
    _same(got, [x[order] for x in want])
    got = _run(backend, q[order], k, v, sums, lens[order], cfg, cache_batch_idx=idx, **kw)
    _same(got, [x[order] for x in want])  # slots of a contiguous cache too


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pages_or_slots_outside_the_cache_give_nan_rows(backend):
    """No host check in a decode step: a page the step reads outside the pool (the current
    block's, always attended; ``-1``, an unallocated entry) or a slot outside the cache gives
    that sequence NaN rows and leaves the others exact. Entries past a sequence's pages (or of
    an empty sequence) are never read."""
    C, g = 16, 2
    cfg = per_token_config(block_size=C, topk=4, branching=g, beam=2, scale=0.25)
    seqlens = [200, 130, 0]
    q, k, v, sums, lens = make_cache(3, 256, 1, 2, 16, seqlens, C, g, seed=5)
    k_pool, v_pool, table = to_pages(k, v, C)
    want = _run(backend, q, k_pool, v_pool, sums, lens, cfg, block_table=table)
    bad = table.clone()
    bad[0, 199 // C] = -1
    bad[1, 129 // C + 1:] = 10 ** 6  # past sequence 1's pages
    bad[2] = -1  # an empty sequence reads no page
    got = _run(backend, q, k_pool, v_pool, sums, lens, cfg, block_table=bad)
    assert got[0][0].isnan().all() and got[1][0].isnan().all()
    _same([x[1:] for x in got[:2]], [x[1:] for x in want[:2]])
    assert (got[0][2] == 0).all() and (got[1][2] == -math.inf).all()
    idx = torch.tensor([1, 3], dtype=torch.int32)  # 3: not a slot
    got = _run(backend, q[[1, 1]], k_pool, v_pool, sums, lens[[1, 1]], cfg,
               block_table=table[[1, 1]],
               cache_batch_idx=idx)
    assert got[0][1].isnan().all() and got[1][1].isnan().all()
    _same([x[:1] for x in got[:2]], [x[1:2] for x in want[:2]])


def test_paged_appends_keep_the_pyramid_of_a_contiguous_cache():
    """Appends in random chunk sizes to a mixed-length batch (whose pages are shuffled and whose
    rows go to shuffled slots): the pool gathered through the table holds the keys, the sums and
    bounds equal a pyramid rebuilt from those keys, and a contiguous cache fed the same appends
    has bitwise the same sums."""
    B, T, H, D, C, g = 3, 192, 2, 8, 16, 2
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(B, T, H, D, generator=gen)
    pool, _, table = to_pages(torch.zeros_like(k), torch.zeros_like(k), C, seed=1)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    n_rows = level_offsets(T, C, g)[-1]
    sums = torch.zeros(B, n_rows, H, D)
    mins, maxs = torch.full_like(sums, math.inf), torch.full_like(sums, -math.inf)
    flat = torch.zeros(B, T, H, D)
    flat_sums = torch.zeros_like(sums)
    lens = torch.zeros(B, dtype=torch.int32)
    for L in (5, 1, 16, 40, 1, 33):
        new = k[torch.arange(B)[:, None], lens.long()[:, None] + torch.arange(L)]
        append_kv(pool, pool.clone(), sums, new, new, lens, C, g, mins, maxs, block_table=table,
                  cache_batch_idx=slots)
        write_kv(flat, flat.clone(), flat_sums, new, new, lens, C, g, cache_batch_idx=slots)
        lens += L
    n = int(lens[0])
    torch.testing.assert_close(gather_pages(pool, table, n), k[:, :n], rtol=0, atol=0)
    order = slots.long()
    assert torch.equal(sums, flat_sums)
    torch.testing.assert_close(sums[order], pyramid_sums(k, lens.tolist(), C, g))
    want_mins, want_maxs = bounds_from_keys(k, lens, C, g)
    assert torch.equal(mins[order], want_mins) and torch.equal(maxs[order], want_maxs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_through_pages_equals_contiguous(backend):
    """``prefill_with_cache`` reading a shuffled page pool (and slots) equals the contiguous
    cache's, bitwise."""
    B, T, HKV, G, D, C, g, L = 2, 256, 1, 2, 16, 16, 2, 20
    cfg = per_token_config(block_size=C, topk=4, branching=g, beam=2, scale=0.25, query_tile=4)
    seqlens = [256, 150]
    _, k, v, sums, _ = make_cache(B, T, HKV, G, D, seqlens, C, g, seed=3)
    q = torch.randn(B, L, HKV * G, D, generator=torch.Generator().manual_seed(4))
    dev = DEVICE if backend == "triton" else "cpu"
    k_pool, v_pool, table = to_pages(k, v, C)
    args = [x.to(dev) for x in (q, k, v, sums)]
    want = prefill_with_cache(*args, seqlens, cfg=cfg, backend=backend)
    got = prefill_with_cache(args[0], k_pool.to(dev), v_pool.to(dev), args[3], seqlens, cfg=cfg,
                             backend=backend, block_table=table.to(dev))
    _same(got, want)
    got = prefill_with_cache(args[0][[1]], k_pool.to(dev), v_pool.to(dev), args[3], [150],
                             cfg=cfg, backend=backend, block_table=table[[1]].to(dev), slots=[1])
    _same(got, [x[[1]] for x in want])


def _paged(seqlens=(40, 17), T=64, C=16, g=2):
    q, k, v, sums, lens = make_cache(len(seqlens), T, 1, 2, 16, list(seqlens), C, g)
    return (q,) + tuple(to_pages(k, v, C)) + (sums, lens)


@pytest.mark.parametrize("change,exc,msg", [
    (dict(block_table=lambda t: t.long()), ValueError, "block_table must be an int32"),
    (dict(block_table=lambda t: t[0]), ValueError, "block_table must be an int32"),
    (dict(block_table=lambda t: t.t().contiguous().t()), ValueError, "contiguous in its last"),
    (dict(block_table=lambda t: t[:1]), ValueError, "block_table must have a row per"),
    (dict(block_table=lambda t: t[:, :2]), ValueError, "sums must be"),
    (dict(block_table=lambda t: [[0]]), TypeError, "block_table must be a torch.Tensor"),
    (dict(k_pool=lambda k: k[:, :8]), ValueError, "pages of block_size=16"),
    (dict(k_pool=lambda k: torch.cat([k, k], 1)[:, :16]), ValueError,
     "k_cache, a page pool, must be contiguous across its pages"),
    (dict(cache_batch_idx=lambda _: torch.tensor([0, 1])), ValueError, "cache_batch_idx must"),
    (dict(cache_batch_idx=lambda _: torch.tensor([0], dtype=torch.int32)), ValueError,
     "block_table must have a row per sequence"),
])
def test_check_cache_names_the_bad_paged_argument(change, exc, msg):
    """Metadata of the paged form (``check_cache``, no host sync): dtype, dims, contiguity and
    rows of ``block_table``, pages of one leaf block and one stride apart, ``cache_batch_idx``."""
    _, k_pool, v_pool, table, sums, lens = _paged()
    kw = dict(block_table=table, cache_batch_idx=None)
    for name, f in change.items():
        if name == "k_pool":
            k_pool = v_pool = f(k_pool)
        else:
            kw[name] = f(table)
    with pytest.raises(exc, match=msg):
        check_cache(k_pool, v_pool, sums, lens, 16, 2, **kw)


def test_host_checks_of_the_table_and_slots_name_the_bad_entry():
    """``check_block_table`` / ``check_batch_idx`` (cache-management time: they sync)."""
    _, k_pool, _, table, _, lens = _paged()  # 40 and 17 tokens: 3 and 2 pages
    P = k_pool.shape[0]
    check_block_table(table, lens, P, 16)
    check_block_table(table, lens, P, 16, n_new=8)  # 48 and 25 tokens: the same pages
    t = table.clone()
    t[1, 1] = P
    with pytest.raises(ValueError, match=rf"block_table\[1, 1\] = {P} is not a page"):
        check_block_table(t, lens, P, 16)
    t = table.clone()
    t[1, 2:] = -1  # past sequence 1's pages: never read, any value
    check_block_table(t, lens, P, 16)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -1"):
        check_block_table(t, lens, P, 16, n_new=16)  # 33 tokens need a third page
    t[1, 0] = table[0, 2]
    with pytest.raises(ValueError, match=rf"page {int(table[0, 2])} is used by rows \[0, 1\]"):
        check_block_table(t, lens, P, 16)
    with pytest.raises(ValueError, match="has 4 pages a row, but row 0 needs 5"):
        check_block_table(table, lens, P, 16, n_new=30)
    check_batch_idx(torch.tensor([1, 0], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 2 is not a slot"):
        check_batch_idx(torch.tensor([0, 2], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="distinct slots"):
        check_batch_idx(torch.tensor([1, 1], dtype=torch.int32), 2)


def test_paged_writes_on_cpu_refuse_unallocated_pages_and_slots():
    """On CPU ``write_kv`` reports a write to a ``-1`` page or a slot outside the cache (on CUDA:
    the index kernels' device-side asserts; an unallocated page is sent out of range, never to
    the pool's last page)."""
    _, k_pool, v_pool, table, sums, lens = _paged()
    new = torch.zeros(2, 1, 1, 16)
    t = table.clone()
    t[1, 1] = -1  # sequence 1's token 17 goes to its page 1
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1 is not a page"):
        write_kv(k_pool, v_pool, sums, new, new, lens, 16, 2, block_table=t)
    with pytest.raises(ValueError, match="slots outside"):
        write_kv(k_pool, v_pool, sums, new, new, lens, 16, 2, block_table=table,
                 cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    assert check_cache(k_pool, v_pool, sums, lens, 16, 2, block_table=table) \
        == level_offsets(64, 16, 2)


# ------------------------------------------------------------------------------------------------
# GPU: bf16 at real sizes
# ------------------------------------------------------------------------------------------------

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(INTERPRET, reason="needs CUDA")(test))


def _gpu_paged(B, T, HKV, D, seqlens, cfg, seed):
    """A contiguous bf16 cache filled through ``append_kv`` and the same cache as a pool of
    shuffled pages (with 64 spare pages) and its table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    sums = torch.zeros(B, level_offsets(T, cfg.block_size, cfg.branching)[-1], HKV, D,
                       device="cuda")
    zero = torch.zeros(1, device="cuda", dtype=torch.int32)
    for b, s in enumerate(seqlens):
        append_kv(k_cache[b:b + 1], v_cache[b:b + 1], sums[b:b + 1], k[b:b + 1, :s],
                  v[b:b + 1, :s], zero, cfg.block_size, cfg.branching)
    C, n = cfg.block_size, T // cfg.block_size
    perm = torch.randperm(B * n + 64, device="cuda", generator=gen)
    table = perm[:B * n].view(B, n).to(torch.int32)
    pools = []
    for x in (k_cache, v_cache):
        pool = torch.zeros(B * n + 64, C, HKV, D, device="cuda", dtype=x.dtype)
        pool[table.flatten().long()] = x.view(B * n, C, HKV, D)
        pools.append(pool)
    lens = torch.tensor(seqlens, device="cuda", dtype=torch.int32)
    return k_cache, v_cache, sums, lens, pools[0], pools[1], table


@gpu
@pytest.mark.parametrize("scorer,beam_leaf,splits", [("lse", None, None), ("lse", None, 1),
                                                     ("bound", 32, None)])
def test_gpu_paged_decode_equals_contiguous_bf16(scorer, beam_leaf, splits):
    """bf16, config A's heads, 32K, batch 3 of mixed lengths: the fused kernel through shuffled
    pages (and, for a running batch, slots in another order) gives the contiguous cache's
    selection and output (the same arithmetic: bitwise expected)."""
    B, T, HKV, G, D = 3, 32768, 4, 16, 128
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scorer=scorer,
                           beam_leaf=beam_leaf, scale=D ** -0.5)
    k_cache, v_cache, sums, lens, k_pool, v_pool, table = _gpu_paged(
        B, T, HKV, D, [T, 20000, 777], cfg, seed=1)
    q = torch.randn(B, 1, HKV * G, D, device="cuda", dtype=torch.bfloat16)
    kw = dict(num_splits=splits, return_block_idx=True)
    if scorer == "bound":
        kw["mins"], kw["maxs"] = bounds_from_keys(k_cache, lens, cfg.block_size, cfg.branching)
    want = decode_triton(q, k_cache, v_cache, sums, lens, cfg, **kw)
    got = decode_triton(q, k_pool, v_pool, sums, lens, cfg, block_table=table, **kw)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-3)
    order = [2, 0]
    idx = torch.tensor(order, device="cuda", dtype=torch.int32)
    got = decode_triton(q[order], k_pool, v_pool, sums, lens[order], cfg,
                        block_table=table[order], cache_batch_idx=idx, **kw)
    assert torch.equal(got[2], want[2][order])
    torch.testing.assert_close(got[0], want[0][order], rtol=1e-2, atol=1e-2)


@gpu
def test_gpu_paged_append_and_decode_replay_in_a_cuda_graph():
    """A paged step (append through the table, advance the lengths, decode through the table),
    captured once: replays equal the eager steps, and the contiguous cache's."""
    from tests.ops.decode.test_triton import replay_matches_eager
    B, T, HKV, G, D = 4, 8192, 2, 8, 128
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    k_cache, v_cache, sums, lens, k_pool, v_pool, table = _gpu_paged(
        B, T, HKV, D, [5000, 100, 8000, 64], cfg, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = [[torch.randn(B, 1, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (HKV * G, HKV, HKV)] for _ in range(2)]

    def step(state, q, k_new, v_new, paged=True):
        kc, vc, s, n = state
        where = dict(block_table=table) if paged else {}
        append_kv(kc, vc, s, k_new, v_new, n, cfg.block_size, cfg.branching, **where)
        n.add_(1)
        return decode_triton(q, kc, vc, s, n, cfg, **where)

    state0 = [k_pool, v_pool, sums, lens]
    replay_matches_eager(step, state0, inputs)  # leaves state0 as it was
    paged = [x.clone() for x in state0]
    flat = [k_cache, v_cache, sums.clone(), lens.clone()]
    for x in inputs:
        o_paged, lse_paged = step(paged, *x)
        o_flat, lse_flat = step(flat, *x, paged=False)
        torch.testing.assert_close(o_paged, o_flat, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse_paged, lse_flat, rtol=1e-3, atol=1e-3)
    assert torch.equal(paged[2], flat[2]) and torch.equal(paged[3], flat[3])
