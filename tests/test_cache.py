import pytest
import torch

from pisa import PisaCache, pisa_attn, pisa_attn_with_kvcache
from pisa.ops.pyramid import build_pyramid
from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.utils.geometry import level_offsets

# ``pisa_attn_with_kvcache``'s defaults, the per-token walk: the knobs of the ``pisa_attn`` prefill
# rows that decode and chunked prefill must reproduce (``pisa_attn`` defaults to 16-token tiles).
PER_TOKEN = dict(query_tile=1, scorer="lse", tile_reduce="sum", beam_leaf=None)


def _qkv(B, T, H, G, D, dtype=torch.float64, device="cpu"):
    q = torch.randn(B, T, H * G, D, dtype=dtype, device=device)
    k, v = torch.randn(2, B, T, H, D, dtype=dtype, device=device)
    return q, k, v


def _at(x, pos):
    """Rows ``x[b, pos[b] + i]`` for ``pos [B, L]``: ``[B, L, ...]``."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], pos]


def _assert_pyramid_matches_keys(cache, k):
    for b in range(cache.batch_size):
        n = int(cache.cache_seqlens[b])
        got, want = cache.pyramid(b), build_pyramid_torch(k[b:b + 1, :n], cache.block_size,
                                                          cache.branching)
        assert got.offsets == want.offsets and torch.equal(got.counts, want.counts)
        torch.testing.assert_close(got.means, want.means.to(got.means.dtype), rtol=1e-6,
                                   atol=1e-6)


def test_cache_layout_and_properties():
    cache = PisaCache(3, 100, 2, 16, block_size=8, branching=4, dtype=torch.bfloat16)
    assert cache.k_cache.shape == cache.v_cache.shape == (3, 100, 2, 16)
    assert cache.k_cache.dtype == torch.bfloat16 and cache.sums.dtype == torch.float32
    assert cache.offsets == level_offsets(100, 8, 4) == (0, 13, 17, 18) and cache.n_levels == 3
    assert cache.sums.shape == (3, cache.offsets[-1], 2, 16)
    assert cache.cache_seqlens.dtype == torch.int32 and not cache.cache_seqlens.any()
    assert (cache.batch_size, cache.max_seqlen, cache.num_kv_heads, cache.head_dim) == \
        (3, 100, 2, 16)
    assert cache.device == torch.device("cpu") and "max_seqlen=100" in repr(cache)
    cache.check()


def _assert_bounds_match_keys(cache, k):
    """The cache's key bounds of each sequence equal ``build_pyramid(..., bounds=True)`` of its
    real keys (``cache.pyramid``), and nodes without a real key hold +inf / -inf."""
    for b in range(cache.batch_size):
        n = int(cache.cache_seqlens[b])
        counts = torch.cat([(n - torch.arange(cache.offsets[i + 1] - cache.offsets[i])
                             * cache.block_size * cache.branching ** i).clamp_min(0)
                            for i in range(cache.n_levels)])
        empty = counts == 0
        assert torch.isposinf(cache.mins[b][empty]).all()
        assert torch.isneginf(cache.maxs[b][empty]).all()
        if n == 0:
            continue
        got = cache.pyramid(b)
        want = build_pyramid(k[b:b + 1, :n].to(cache.sums.dtype), cache.block_size,
                             cache.branching, "torch", bounds=True)
        assert torch.equal(got.mins, want.mins) and torch.equal(got.maxs, want.maxs), b


def test_default_cache_allocates_no_bounds():
    cache = PisaCache(2, 100, 2, 16, block_size=8, dtype=torch.float32)
    assert cache.mins is None and cache.maxs is None and not cache.has_bounds
    assert "bounds=False" in repr(cache)
    cache.append(*torch.randn(2, 2, 10, 2, 16))
    assert cache.mins is None and cache.pyramid(0).mins is None
    pre = PisaCache.from_prefill(*torch.randn(2, 2, 10, 2, 16), block_size=8)
    assert pre.mins is None and pre.maxs is None
    with pytest.raises(TypeError, match="bounds must be a bool"):
        PisaCache(1, 10, 1, 8, bounds=1)


def test_bounds_cache_layout():
    cache = PisaCache(3, 100, 2, 16, block_size=8, branching=4, dtype=torch.bfloat16,
                      bounds=True)
    assert cache.has_bounds and "bounds=True" in repr(cache)
    for x in (cache.mins, cache.maxs):
        assert x.shape == cache.sums.shape and x.dtype == torch.float32 and x.is_contiguous()
    assert torch.isposinf(cache.mins).all() and torch.isneginf(cache.maxs).all()
    cache.check()
    cache.maxs = cache.maxs[:, :-1]
    with pytest.raises(ValueError, match="maxs must be"):
        cache.check()


def test_bounds_follow_prefill_appends_and_reset(rng):
    """Ragged prefill (padding keys never enter a bound), then appends of one token and of chunks,
    a reset and a restart: the bounds equal those of each sequence's real keys throughout;
    ``enable_bounds`` on a cache made without them builds the same bounds from its keys."""
    B, T, H, D, C = 3, 150, 2, 8, 8
    _, k, v = _qkv(B, T, H, 1, D)
    pad = k.clone()
    pad[0, :] = 1e6  # sequence 0 is empty: its padding would dominate every max
    pad[1, 13:60] = -1e6
    kw = dict(max_seqlen=T, seqlens=[0, 13, 60], block_size=C, branching=3)
    cache = PisaCache.from_prefill(pad[:, :60], v[:, :60], bounds=True, **kw)
    plain = PisaCache.from_prefill(pad[:, :60], v[:, :60], **kw)
    _assert_bounds_match_keys(cache, k)
    for L in (1, 1, 20, 7):
        pos = cache.cache_seqlens.long()[:, None] + torch.arange(L)
        cache.append(_at(k, pos), _at(v, pos))
        plain.append(_at(k, pos), _at(v, pos))
        _assert_bounds_match_keys(cache, k)
    assert torch.equal(cache.sums, plain.sums)
    plain.enable_bounds()
    assert torch.equal(plain.mins, cache.mins) and torch.equal(plain.maxs, cache.maxs)
    cache.reset([1])
    assert torch.isposinf(cache.mins[1]).all() and torch.isneginf(cache.maxs[1]).all()
    cache.append(k[:, :5], v[:, :5])  # sequence 1 restarts from k[1, :5]; the others go on
    keys = torch.zeros(B, 94, H, D, dtype=k.dtype)
    for b, n in enumerate((29, 0, 89)):
        keys[b, :n + 5] = torch.cat([k[b, :n], k[b, :5]])
    _assert_bounds_match_keys(cache, keys)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(max_seqlen=1.5), ValueError, "max_seqlen"),
    (dict(block_size=12), ValueError, "block_size"),
    (dict(branching=1), ValueError, "branching"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
])
def test_cache_rejects_bad_arguments(kwargs, exc, msg):
    args = dict(batch_size=1, max_seqlen=10, num_kv_heads=1, head_dim=8)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        PisaCache(**args)


def test_from_prefill_append_and_reset_keep_the_pyramid_exact(rng):
    B, T, H, D, C = 3, 150, 2, 8, 8
    _, k, v = _qkv(B, T, H, 1, D)
    cache = PisaCache.from_prefill(k[:, :60], v[:, :60], max_seqlen=T, seqlens=[0, 13, 60],
                                   block_size=C, branching=3)
    assert cache.cache_seqlens.tolist() == [0, 13, 60]
    assert torch.equal(cache.k_cache[2, :60], k[2, :60])
    for L in (1, 20, 7):
        cache.append(_at(k, cache.cache_seqlens.long()[:, None] + torch.arange(L)),
                     _at(v, cache.cache_seqlens.long()[:, None] + torch.arange(L)))
    assert cache.cache_seqlens.tolist() == [28, 41, 88]
    _assert_pyramid_matches_keys(cache, k)
    cache.reset([1])
    assert cache.cache_seqlens.tolist() == [28, 0, 88]
    cache.append(k[:, :5], v[:, :5])  # sequence 1 restarts from k[1, :5]; the others go on
    assert cache.cache_seqlens.tolist() == [33, 5, 93]
    keys = torch.zeros(B, 93, H, D, dtype=k.dtype)
    for b, n in enumerate((28, 0, 88)):
        keys[b, :n + 5] = torch.cat([k[b, :n], k[b, :5]])
    _assert_pyramid_matches_keys(cache, keys)
    with pytest.raises(ValueError, match="seqlens must be"):
        PisaCache.from_prefill(k, v, seqlens=[1, 2, 151])


def test_token_by_token_decode_reproduces_prefill_rows(rng):
    """Mixed lengths: sequence 0 starts empty, sequence 1 after a 37-token prefill; every decoded
    row (early all-blocks rows and pruned ones) equals the prefill row of the full sequence."""
    B, T, H, G, D, C, K, W = 2, 160, 2, 2, 16, 8, 5, 2  # 20 leaves, 6 levels
    q, k, v = _qkv(B, T, H, G, D)
    kw = dict(topk=K, beam=W, backend="torch", **PER_TOKEN)
    cache = PisaCache.from_prefill(k[:, :37], v[:, :37], max_seqlen=T, seqlens=[0, 37],
                                   block_size=C)
    got = torch.full_like(q, float("nan"))
    got_lse = torch.full((B, H * G, T), float("nan"))
    for _ in range(T - 37):
        pos = cache.cache_seqlens.long()[:, None]
        o, lse = pisa_attn_with_kvcache(_at(q, pos), cache, _at(k, pos), _at(v, pos),
                                        return_lse=True, **kw)
        got[torch.arange(B)[:, None], pos] = o
        got_lse[torch.arange(B)[:, None], :, pos] = lse.transpose(1, 2)
    assert cache.cache_seqlens.tolist() == [T - 37, T]
    want, want_lse = pisa_attn(q, k, v, block_size=C, return_lse=True, **kw)
    rows = [slice(0, T - 37), slice(37, T)]
    for b in range(B):
        torch.testing.assert_close(got[b, rows[b]], want[b, rows[b]], rtol=1e-10, atol=1e-10,
                                   msg=f"seed {rng}")
        torch.testing.assert_close(got_lse[b, :, rows[b]], want_lse[b, :, rows[b]], rtol=1e-6,
                                   atol=1e-6)


def test_decode_through_the_naive_backend_equals_the_oracle_prefill(rng):
    B, T, H, G, D, C = 2, 50, 1, 2, 16, 4  # 13 leaves, 5 levels
    q, k, v = _qkv(B, T, H, G, D)
    kw = dict(topk=4, beam=2, backend="naive", **dict(PER_TOKEN, scorer="meanvar"))
    cache = PisaCache(B, T, H, D, block_size=C, dtype=torch.float64)
    got = torch.cat([pisa_attn_with_kvcache(q[:, t:t + 1], cache, k[:, t:t + 1], v[:, t:t + 1],
                                            **kw) for t in range(T)], dim=1)
    torch.testing.assert_close(got, pisa_attn(q, k, v, block_size=C, **kw), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("start", [[0, 0], [0, 45]])
def test_chunked_prefill_in_random_chunks_equals_one_shot(start, rng):
    """Chunks of random sizes (1 = a decode step) against a cache: the rows of one prefill."""
    B, T, H, G, D, C = 2, 400, 2, 2, 16, 8  # 50 leaves, 7 levels
    q, k, v = _qkv(B, T, H, G, D)
    kw = dict(topk=5, beam=2, backend="torch", **PER_TOKEN)
    cache = PisaCache.from_prefill(k[:, :max(start)], v[:, :max(start)], max_seqlen=T,
                                   seqlens=start, block_size=C)
    got = torch.full_like(q, float("nan"))
    while int(cache.cache_seqlens.max()) < T:
        room = T - int(cache.cache_seqlens.max())
        L = int(torch.randint(1, min(room, 80) + 1, ()))
        pos = cache.cache_seqlens.long()[:, None] + torch.arange(L)
        got[torch.arange(B)[:, None], pos] = pisa_attn_with_kvcache(
            _at(q, pos), cache, _at(k, pos), _at(v, pos), **kw)
    want = pisa_attn(q, k, v, block_size=C, **kw)
    for b in range(B):
        n = int(cache.cache_seqlens[b])
        torch.testing.assert_close(got[b, start[b]:n], want[b, start[b]:n], rtol=1e-10,
                                   atol=1e-10, msg=f"seed {rng}")
    _assert_pyramid_matches_keys(cache, k)


def test_caller_owned_seqlens_are_not_advanced(rng):
    B, T, H, G, D, C = 2, 120, 1, 2, 16, 8
    q, k, v = _qkv(B, T, H, G, D)
    kw = dict(topk=4, beam=2, backend="torch")
    owned = PisaCache(B, T, H, D, block_size=C, dtype=torch.float64)
    theirs = PisaCache(B, T, H, D, block_size=C, dtype=torch.float64)
    lens = torch.zeros(B, dtype=torch.int32)
    for s, e in ((0, 50), (50, 51), (51, 120)):
        a = pisa_attn_with_kvcache(q[:, s:e], owned, k[:, s:e], v[:, s:e], **kw)
        b = pisa_attn_with_kvcache(q[:, s:e], theirs, k[:, s:e], v[:, s:e],
                                   cache_seqlens=lens if s else 0, **kw)
        lens += e - s
        assert torch.equal(a, b)
    assert not theirs.cache_seqlens.any() and owned.cache_seqlens.tolist() == [T, T]
    assert torch.equal(owned.sums, theirs.sums)
    # attend to what is already cached: the last query, without appending
    last = pisa_attn_with_kvcache(q[:, -1:], owned, **kw)
    torch.testing.assert_close(last, a[:, -1:], rtol=1e-12, atol=1e-12)
    assert owned.cache_seqlens.tolist() == [T, T]


def test_auto_selector_resolves_on_the_cache_capacity(rng):
    B, T, H, D, C = 1, 300, 2, 16, 8
    q, k, v = _qkv(B, T, H, 2, D)
    kw = dict(topk=4, beam=1, backend="torch")
    cache = PisaCache.from_prefill(k, v, block_size=C)
    for rows in (slice(-1, None), slice(-50, None)):  # decode, prefill
        got = pisa_attn_with_kvcache(q[:, rows], cache, selector="auto", **kw)
        want = pisa_attn_with_kvcache(q[:, rows], cache, selector="flat_lse", **kw)
        assert torch.equal(got, want)


def _api_args():
    cache = PisaCache(2, 40, 2, 16, block_size=8, dtype=torch.float64)
    cache.append(*torch.randn(2, 2, 10, 2, 16, dtype=torch.float64))
    return dict(q=torch.randn(2, 1, 4, 16, dtype=torch.float64), cache=cache)


BAD = [
    (dict(cache=torch.zeros(1)), TypeError, "pisa.PisaCache"),
    (dict(q=torch.randn(3, 1, 4, 16, dtype=torch.float64)), ValueError, "q must have shape"),
    (dict(q=torch.randn(2, 1, 3, 16, dtype=torch.float64)), ValueError, "q must have shape"),
    (dict(q=torch.randn(2, 0, 4, 16, dtype=torch.float64)), ValueError, "q must have shape"),
    (dict(q=torch.randn(2, 1, 4, 16)), TypeError, "q must be torch.float64"),
    (dict(k_new=torch.randn(2, 1, 2, 16, dtype=torch.float64)), ValueError, "together"),
    (dict(k_new=torch.randn(2, 31, 2, 16, dtype=torch.float64),
          v_new=torch.randn(2, 31, 2, 16, dtype=torch.float64)), ValueError, "exceed"),
    (dict(q=torch.randn(2, 11, 4, 16, dtype=torch.float64)), ValueError, "Tq <= Tk"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, "cache_seqlens must"),
    (dict(topk=2), ValueError, "topk"),
    (dict(backend="cuda"), ValueError, "backend must be"),
]


@pytest.mark.parametrize("over,exc,msg", BAD, ids=lambda x: str(x)[:40])
def test_pisa_attn_with_kvcache_rejects_bad_input(over, exc, msg):
    args = _api_args()
    args.update(over)
    with pytest.raises(exc, match=msg):
        pisa_attn_with_kvcache(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_decode_on_cuda_reproduces_prefill_rows(rng):
    B, T, H, G, D, C = 2, 300, 2, 4, 64, 16
    q, k, v = _qkv(B, T, H, G, D, device="cuda")
    kw = dict(topk=6, beam=3, backend="torch", **PER_TOKEN)
    cache = PisaCache.from_prefill(k[:, :100], v[:, :100], max_seqlen=T, block_size=C)
    got = torch.cat([pisa_attn_with_kvcache(q[:, t:t + 1], cache, k[:, t:t + 1], v[:, t:t + 1],
                                            **kw) for t in range(100, T)], dim=1)
    want = pisa_attn(q, k, v, block_size=C, **kw)[:, 100:]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
