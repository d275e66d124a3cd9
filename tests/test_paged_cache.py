"""``pisa.PagedPisaCache`` and ``pisa_attn_with_kvcache(block_table=, cache_batch_idx=)``:
continuous batching (sequences join and leave a running batch) gives, row for row, what a
contiguous ``PisaCache`` per sequence gives; the per-slot pyramid equals one rebuilt from the
sequence's keys; a caller's shuffled page table (FlashAttention's convention) equals the
contiguous cache; bad tables and slots are named errors."""
import pytest
import torch

from pisa import PagedPisaCache, PisaCache, pisa_attn_with_kvcache
from pisa.ops.decode.kvcache import gather_pages
from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from tests.ops.conftest import _interpreter_patched

H, G, D, C = 2, 2, 16, 8


@pytest.fixture(scope="module", autouse=True)
def fast_interpreter():
    """The op tests' faster Triton interpreter (``tests/ops/conftest.py``) for the Triton case."""
    yield from _interpreter_patched()


def _tokens(n, dtype, gen):
    """``q [1, n, H*G, D]``, ``k, v [1, n, H, D]``."""
    return (torch.randn(1, n, H * G, D, generator=gen).to(dtype),
            *(torch.randn(1, n, H, D, generator=gen).to(dtype) for _ in range(2)))


def test_page_and_slot_management():
    cache = PagedPisaCache(10, 3, 40, H, D, block_size=C)  # 5 pages a sequence at most
    assert cache.k_cache.shape == (10, C, H, D) and cache.block_table.shape == (3, 5)
    assert cache.sums.shape[0] == 3 and cache.max_seqlen == 40 and cache.batch_size == 3
    a = cache.add_sequence(17)  # 3 pages
    b = cache.add_sequence()
    cache.reserve(b, 8)
    cache.reserve(b, 9)  # a second page
    cache.reserve(b, 3)  # holds enough already
    assert (a, b) == (0, 1) and cache.pages(a) == [0, 1, 2] and cache.pages(b) == [3, 4]
    assert cache.block_table[:2].tolist() == [[0, 1, 2, -1, -1], [3, 4, -1, -1, -1]]
    assert cache.free_pages == 5 and cache.live_slots == [0, 1]
    cache.reserve(b, 40)  # 3 more: 5, 6, 7
    c = cache.add_sequence()
    with pytest.raises(RuntimeError, match="out of pages: slot 2 needs 4 more, 2 of 10 are free"):
        cache.reserve(c, 25)
    assert cache.pages(c) == [] and cache.free_pages == 2  # nothing taken
    with pytest.raises(RuntimeError, match="no free slot"):
        cache.add_sequence()
    with pytest.raises(ValueError, match="exceeds the cache's max_seqlen 40"):
        cache.reserve(a, 41)
    cache.remove_sequence(a)
    assert cache.block_table[0].tolist() == [-1] * 5 and cache.free_pages == 5
    assert cache.block_table[1].tolist() == [3, 4, 5, 6, 7]  # untouched
    assert cache.add_sequence(20) == 0 and cache.pages(0) == [0, 1, 2]  # the freed pages again
    cache.remove_sequence(c)
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.add_sequence(40)
    assert cache.live_slots == [0, 1] and cache.free_pages == 2  # no slot taken either
    with pytest.raises(ValueError, match=r"slot must be a live slot \[0, 1\], got 2"):
        cache.reserve(2, 1)
    with pytest.raises(ValueError, match="slot must be a live slot"):
        cache.remove_sequence("1")
    with pytest.raises(ValueError, match="n_tokens must be a non-negative int"):
        cache.reserve(0, -1)
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PagedPisaCache(0, 3, 40, H, D)
    cache.check()
    assert "PagedPisaCache(num_pages=10, max_batch=3" in repr(cache)


@pytest.mark.parametrize("backend,dtype,C", [("torch", torch.float64, 8),
                                             ("triton", torch.float32, 16)])
def test_continuous_batching_equals_a_contiguous_cache_per_sequence(backend, dtype, C):
    """Sequences join (prompt by chunked prefill, then decode) and leave a running batch of a
    paged cache; each step decodes the live slots in one call. Every row equals the same
    sequence run alone through a contiguous ``PisaCache`` (torch backend); removing a sequence
    moves no other sequence's pages, and a newcomer reuses the freed ones. At the end each
    slot's pyramid equals one rebuilt from its keys."""
    T = 12 * C  # 12 leaves, 5 levels
    kw = dict(topk=4, beam=2, backend=backend)
    # the references, and every prompt, through the torch backend (the Triton interpreter is slow;
    # paged Triton prefill: tests/ops/decode/test_paged.py)
    prefill, tol = {**kw, "backend": "torch"}, 1e-6 if backend == "torch" else 1e-4
    gen = torch.Generator().manual_seed(1)
    cache = PagedPisaCache(40, 3, T, H, D, block_size=C, dtype=dtype)
    # name: (step it joins, prompt length, step it leaves)
    plan = {"a": (0, 30, 6), "b": (2, 13, 99), "c": (3, 1, 99), "d": (7, 41, 99)}
    alone, keys, slot, rows = {}, {}, {}, 0
    freed = []
    for step in range(10):
        for name, (start, n, stop) in plan.items():
            if step == stop:
                others = {m: cache.pages(slot[m]) for m in slot if m != name}
                freed = cache.pages(slot[name])
                cache.remove_sequence(slot.pop(name))
                assert {m: cache.pages(slot[m]) for m in slot} == others
            if step == start:  # join: the prompt by chunked prefill into a new slot
                slot[name] = cache.add_sequence(n)
                q, k, v = _tokens(n, dtype, gen)
                alone[name] = PisaCache(1, T, H, D, block_size=C, dtype=dtype)
                keys[name] = k
                got = pisa_attn_with_kvcache(q, cache, k, v, cache_batch_idx=[slot[name]],
                                             **prefill)
                want = pisa_attn_with_kvcache(q, alone[name], k, v, **prefill)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                if name == "d":
                    assert set(cache.pages(slot["d"])) & set(freed)
        live = sorted(slot, key=lambda m: -slot[m])  # the batch in descending slot order
        for m in live:
            cache.reserve(slot[m], int(cache.cache_seqlens[slot[m]]) + 1)
        new = {m: _tokens(1, dtype, gen) for m in live}
        q, k, v = (torch.cat([new[m][i] for m in live]) for i in range(3))
        got = pisa_attn_with_kvcache(q, cache, k, v, cache_batch_idx=[slot[m] for m in live],
                                     **kw)
        for i, m in enumerate(live):
            keys[m] = torch.cat([keys[m], new[m][1]], 1)
            q1, k1, v1 = new[m]
            want = pisa_attn_with_kvcache(q1, alone[m], k1, v1, **prefill)
            torch.testing.assert_close(got[i:i + 1], want, rtol=tol, atol=tol)
            rows += 1
    assert rows == 1 + 1 + 2 + 3 + 3 + 3 + 2 + 3 + 3 + 3  # live sequences per step
    cache.check()
    for m, s in slot.items():
        n = int(cache.cache_seqlens[s])
        assert n == keys[m].shape[1] and n == int(alone[m].cache_seqlens[0])
        torch.testing.assert_close(gather_pages(cache.k_cache, cache.block_table[s:s + 1], n),
                                   keys[m], rtol=0, atol=0)
        got, want = cache.pyramid(s), build_pyramid_torch(keys[m].double(), C, 2)
        assert got.offsets == want.offsets and torch.equal(got.counts, want.counts)
        torch.testing.assert_close(got.means, want.means.to(got.means.dtype), rtol=1e-6,
                                   atol=1e-6)


def _shuffled_table(B, T, num_pages, seed):
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    return perm[:B * (T // C)].view(B, T // C).to(torch.int32)


def test_a_callers_shuffled_block_table_equals_the_contiguous_cache(rng):
    """FlashAttention's convention: the caller owns the page table (shuffled pages) and the
    lengths; chunked prefill of mixed-length prompts, then decode steps with appends, give the
    contiguous cache's rows."""
    B, T = 2, 80
    kw = dict(topk=4, beam=2, backend="torch")
    q, k, v = (torch.randn(B, T, h, D, dtype=torch.float64) for h in (H * G, H, H))
    paged = PagedPisaCache(30, B, T, H, D, block_size=C, dtype=torch.float64)
    flat = PisaCache(B, T, H, D, block_size=C, dtype=torch.float64)
    table = _shuffled_table(B, T, 30, rng)
    lens = torch.zeros(B, dtype=torch.int32)
    for s, e in ((0, 37), (37, 38), (38, 39), (39, 60), (60, 61)):
        got = pisa_attn_with_kvcache(q[:, s:e], paged, k[:, s:e], v[:, s:e], block_table=table,
                                     cache_seqlens=lens, **kw)
        want = pisa_attn_with_kvcache(q[:, s:e], flat, k[:, s:e], v[:, s:e], **kw)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed {rng}")
        lens += e - s
    assert torch.equal(paged.sums, flat.sums) and not paged.cache_seqlens.any()
    torch.testing.assert_close(gather_pages(paged.k_cache, table, 61), flat.k_cache[:, :61])


def test_from_prefill_bounds_and_the_bound_scorer():
    """``PagedPisaCache.from_prefill`` (mixed lengths), ``enable_bounds`` through the pages and
    ``scorer="bound"`` decode equal the contiguous cache's."""
    B, T = 3, 64
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    seqlens = [64, 20, 0]
    paged = PagedPisaCache.from_prefill(k, v, seqlens=seqlens, max_seqlen=80, block_size=C)
    flat = PisaCache.from_prefill(k, v, seqlens=seqlens, max_seqlen=80, block_size=C)
    assert paged.cache_seqlens.tolist() == seqlens and paged.free_pages == 30 - 11
    assert torch.equal(paged.sums, flat.sums)
    paged.enable_bounds()
    flat.enable_bounds()
    assert torch.equal(paged.mins, flat.mins) and torch.equal(paged.maxs, flat.maxs)
    q = torch.randn(2, 1, H * G, D, generator=gen)
    new = torch.randn(2, 1, H, D, generator=gen)
    for s in paged.live_slots[:2]:
        paged.reserve(s, seqlens[s] + 1)
    kw = dict(topk=4, beam=2, scorer="bound", beam_leaf=3, backend="torch")
    got = pisa_attn_with_kvcache(q, paged, new, new, cache_batch_idx=[1, 0], **kw)
    want = pisa_attn_with_kvcache(q[[1, 0]], flat, new[[1, 0]], new[[1, 0]],
                                  cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32), **kw)
    torch.testing.assert_close(got, want[[1, 0]], rtol=1e-6, atol=1e-6)
    assert paged.cache_seqlens.tolist() == [65, 21, 0]
    assert flat.cache_seqlens.tolist() == [65, 21, 0]


def _bad_call(over):
    cache = PagedPisaCache(20, 2, 32, H, D, block_size=C)
    a, b = cache.add_sequence(10), cache.add_sequence(17)
    args = dict(q=torch.zeros(2, 1, H * G, D), k_new=torch.zeros(2, 1, H, D),
                v_new=torch.zeros(2, 1, H, D), backend="torch")
    args.update(over(cache, a, b))
    cache = args.pop("cache", cache)
    return lambda: pisa_attn_with_kvcache(cache=cache, **args)


@pytest.mark.parametrize("over,exc,msg", [
    (lambda c, a, b: dict(cache=PisaCache(2, 32, H, D, block_size=C),
                          block_table=c.block_table), ValueError, "needs a pisa.PagedPisaCache"),
    (lambda c, a, b: dict(block_table=c.block_table.long()), ValueError,
     "block_table must be an int32"),
    (lambda c, a, b: dict(block_table=c.block_table[:, :3]), ValueError, "sums must be"),
    (lambda c, a, b: dict(block_table=c.block_table.clone().fill_(-1)), ValueError,
     r"block_table\[0, 0\] = -1 is not a page of the pool \[0, 20\)"),
    (lambda c, a, b: dict(block_table=torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]],
                                                   dtype=torch.int32),
                          cache_seqlens=torch.tensor([25, 9], dtype=torch.int32)),
     ValueError, r"page 3 is used by rows \[0, 1\]"),
    (lambda c, a, b: dict(block_table=c.block_table, cache_seqlens=32), ValueError,
     r"cache_seqlens must be in \[0, max_seqlen - seqlen_new\]"),
    (lambda c, a, b: dict(cache_batch_idx=[1, 1]), ValueError, "distinct slots"),
    (lambda c, a, b: dict(cache_batch_idx=[0, 2]), ValueError, r"cache_batch_idx\[1\] = 2"),
    (lambda c, a, b: dict(cache_batch_idx=torch.tensor([0, 1])), ValueError,
     "cache_batch_idx must be an int32"),
    (lambda c, a, b: dict(cache_batch_idx=[0]), ValueError, r"q must have shape \[B=1"),
    (lambda c, a, b: dict(cache_batch_idx=[0, 1], scorer="bound"), ValueError,
     "needs a cache made with bounds=True"),
])
def test_pisa_attn_with_kvcache_rejects_bad_paged_input(over, exc, msg):
    """On CPU (and in chunked prefill) a caller's table and slots are checked on the host: the
    error names the argument and the first bad entry."""
    with pytest.raises(exc, match=msg):
        _bad_call(over)()


def test_appends_need_their_pages():
    """The cache's own table: a sequence without a page for its next token is an error on CPU
    (``reserve`` first)."""
    lens = torch.tensor([16, 17], dtype=torch.int32)
    call = _bad_call(lambda c, a, b: dict(cache_seqlens=lens))
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = -1 is not a page"):
        call()  # slot 0 holds 2 pages: its token 16 has none


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_running_batch_step_replays_in_a_cuda_graph():
    """bf16, config A's heads: a step of a running batch (the lengths and table rows of the slots
    ``cache_batch_idx`` gathered, append, decode through the pages, lengths scattered back)
    captured in a CUDA graph; replays equal the eager steps, and a contiguous cache's rows."""
    B, T, HKV, HQ, Dh = 3, 8192, 4, 64, 128
    kw = dict(topk=16, backend="triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(B, 4000, HKV, Dh, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    seqlens = [4000, 1234, 77]

    def paged():
        cache = PagedPisaCache.from_prefill(k, v, seqlens=seqlens, max_seqlen=T, block_size=64,
                                            num_pages=400, max_batch=4)
        for s in cache.live_slots:
            cache.reserve(s, seqlens[s] + 4)
        return cache
    idx = torch.tensor([2, 0, 1], device="cuda", dtype=torch.int32)
    steps = [[torch.randn(B, 1, h, Dh, device="cuda", dtype=torch.bfloat16, generator=gen)
              for h in (HQ, HKV, HKV)] for _ in range(3)]

    def step(cache, q, k_new, v_new):
        return pisa_attn_with_kvcache(q, cache, k_new, v_new, cache_batch_idx=idx, **kw)
    eager_cache = paged()
    eager = [step(eager_cache, *x) for x in steps]
    warm, captured = paged(), paged()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm, *steps[0])
    torch.cuda.current_stream().wait_stream(side)
    static = [torch.empty_like(x) for x in steps[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(captured, *static)
    for x, want in zip(steps, eager):
        for dst, src in zip(static, x):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert captured.cache_seqlens.tolist()[:3] == [n + 3 for n in seqlens]
    flat = PisaCache.from_prefill(k, v, seqlens=seqlens, max_seqlen=T, block_size=64)
    to_slots = torch.argsort(idx.long())  # row i of a step is slot idx[i]
    for x, want in zip(steps, eager):
        q, k_new, v_new = (y[to_slots] for y in x)
        o = pisa_attn_with_kvcache(q, flat, k_new, v_new, **kw)
        torch.testing.assert_close(o[idx.long()], want, rtol=1e-2, atol=1e-2)
