"""``pisa.ops.decode``: the input checks of a decode step (``PisaCache.prepare``), the dispatch of
``decode_step`` and chunked prefill against a cache (``prefill_with_cache``)."""
import dataclasses
import importlib.util

import pytest
import torch

import pisa.ops.decode as decode_ops
from pisa import PisaCache, pisa_attn, pisa_attn_with_kvcache
from pisa.ops.attn.naive import naive_attn
from pisa.ops.decode import decode_step, prefill_with_cache
from pisa.ops.decode.kvcache import bounds_from_keys
from pisa.ops.decode.torch_backend import decode_torch
from pisa.ops.pyramid import build_pyramid
from pisa.ops.select import tiles_to_tokens
from pisa.ops.select.naive import naive_select
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.decode.common import filled_cache, make_cache, oracle_rows, pyramid_sums

# A decode step is per token: the prefill rows it must equal are those of the per-token walk
# (``pisa_attn`` defaults to 16-token qmean bound tiles).
PER_TOKEN = dict(query_tile=1, scorer="lse", tile_reduce="sum", beam_leaf=None)

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def _cfg(C=8, K=5, g=2, W=2, scorer="lse", selector="pyramid", fib=True, D=16):
    return per_token_config(C, K, g, W, scorer, selector, fib, D ** -0.5)


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_prefill_with_cache_equals_naive_oracle(backend, rng):
    B, T, H, G, D, L = 3, 250, 2, 2, 16, 12
    cfg = _cfg(D=D)
    q = torch.randn(B, L, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    for seqlens in ([L, 130, 250], [170] * B):  # one sequence at a time / all together
        cache = filled_cache(k, v, seqlens, T, cfg.block_size, cfg.branching)
        o, lse = prefill_with_cache(q, *cache[:3], seqlens, cfg=cfg, backend=backend)
        want_o, want_lse = oracle_rows(q, k, v, seqlens, cfg)
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10, msg=f"seed {rng}")
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_prefill_with_cache_triton(rng):
    """The sums pyramid feeds the Triton selection (fp32; the interpreter on CPU, CUDA on a GPU)."""
    dev = "cpu" if INTERPRET else "cuda"
    B, T, H, G, D, L = 2, 200, 1, 2, 16, 3
    cfg = per_token_config(16, 4, 2, 2, "lse", "pyramid", True, D ** -0.5)
    q = torch.randn(B, L, H * G, D)
    k, v = torch.randn(2, B, T, H, D)
    seqlens = [90, 200]  # 13 leaves, 5 levels: the walk prunes
    cache = filled_cache(k.to(dev), v.to(dev), seqlens, T, cfg.block_size, cfg.branching)
    o, _ = prefill_with_cache(q.to(dev), *cache[:3], seqlens, cfg=cfg, backend="triton")
    want, _ = oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o.cpu(), want.float(), rtol=2e-4, atol=2e-4, msg=f"seed {rng}")


def _decode_cache():
    """A decode query and a cache of two sequences (5 and 30 of 40 keys, C = 8)."""
    k, v = torch.randn(2, 2, 40, 2, 16, dtype=torch.float64)
    cache = PisaCache.from_prefill(k, v, seqlens=[5, 30], block_size=8)
    return torch.randn(2, 1, 4, 16, dtype=torch.float64), cache


BAD = [  # what a call hands over (q, a caller's lengths), or a cache's tensor swapped by hand
    (dict(q=torch.randn(2, 0, 4, 16, dtype=torch.float64)), ValueError,
     r"\[B=2, seqlen_q >= 1, .*D=16\]"),
    (dict(q=torch.randn(2, 1, 3, 16, dtype=torch.float64)), ValueError, "multiple of HKV"),
    (dict(q=torch.randn(2, 1, 4, 16)), TypeError, "q must be torch.float64"),
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(v_cache=torch.zeros(2, 40, 2, 8, dtype=torch.float64)), ValueError, "v_cache"),
    (dict(sums=torch.zeros(2, 3, 2, 16, dtype=torch.float64)), ValueError, "sums must be"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, "cache_seqlens must be"),
]


@pytest.mark.parametrize("change,exc,msg", BAD, ids=lambda x: str(x)[:30])
def test_a_cache_call_rejects_bad_input(change, exc, msg):
    """``PisaCache.prepare``, the one check of a call (metadata: no host sync), names the bad
    argument."""
    q, cache = _decode_cache()
    cache.prepare(q)
    kw = {}
    for name, value in change.items():
        if name == "q":
            q = value
        elif name == "cache_seqlens":
            kw[name] = value
        else:
            setattr(cache, name, value)
    with pytest.raises(exc, match=msg):
        cache.prepare(q, **kw)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_a_triton_decode_step_is_checked_before_dispatch():
    """The shape and cache errors of a Triton decode step (``PisaCache.prepare``, before the
    dispatch)."""
    q, k, v, sums, lens = make_cache(1, 64, 1, 2, 16, [40], 16, 2)
    dev = "cpu" if INTERPRET else "cuda"
    q, k, v, sums, lens = (x.to(dev) for x in (q, k, v, sums, lens))
    cache = PisaCache.from_prefill(k[:, :40], v[:, :40], max_seqlen=64, block_size=16)

    def step(q, **kw):
        return pisa_attn_with_kvcache(q, cache, topk=4, beam=2, backend="triton", **kw)
    with pytest.raises(ValueError, match=r"q must have shape \[B=1, seqlen_q >= 1"):
        step(q[:, :0])
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        step(q, cache_seqlens=lens.long())
    cache.sums = sums[:, :-1]
    with pytest.raises(ValueError, match="sums must be"):
        step(q)


@pytest.mark.parametrize("selector,scorer", [("pyramid", "lse"), ("pyramid", "meanvar"),
                                             ("flat_lse", "lse")])
def test_decode_step_dispatches(selector, scorer, rng):
    """torch: ``decode_torch``; triton: the fused kernel for the pyramid walk with LSE scores,
    the torch path otherwise: the same result either way."""
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=2, scorer=scorer,
                           selector=selector, scale=0.25)
    seqlens = [200, 37]
    q, k, v, _, lens = make_cache(2, 256, 2, 2, 16, seqlens, 16, 2, seed=rng)
    sums = pyramid_sums(k, seqlens, 16, 2)
    want = decode_torch(q, k, v, sums, lens, cfg)
    backends = ["torch"] + (["triton"] if HAS_TRITON else [])
    for backend in backends:
        dev = "cuda" if backend == "triton" and not INTERPRET else "cpu"
        o, lse = decode_step(*(x.to(dev) for x in (q, k, v, sums, lens)), cfg=cfg,
                             backend=backend)
        torch.testing.assert_close(o.cpu(), want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse.cpu(), want[1], rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN warnings, in the interpreter
def test_decode_propagates_nan_and_keeps_empty_sequences_empty(rng):
    """A NaN query head gives NaN in that head only; a NaN or Inf key the query attends (its own
    block, always selected) gives NaN in every head; an empty sequence (cache_seqlens = 0) still
    gives o = 0, lse = -inf. Torch and Triton (one split, and several merged by the combine
    kernel) alike; before, the Triton rows came out with lse = -inf."""
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    seqlens = [0, 70, 100, 90]
    q, k, v, sums, lens = make_cache(4, 128, 1, 2, 16, seqlens, 16, 2, seed=rng)
    q[1, 0, 1, 3] = float("nan")
    k[2, 97, 0, 2] = float("nan")  # the query's own block (96..99)
    k[3, 89, 0] = float("inf")  # the query's own key
    runs = [lambda: decode_step(q, k, v, sums, lens, cfg=cfg, backend="torch")]
    if HAS_TRITON:
        from pisa.ops.decode.triton import decode_triton
        dev = "cpu" if INTERPRET else "cuda"
        args = [x.to(dev) for x in (q, k, v, sums, lens)]
        runs += [lambda s=s: decode_triton(*args, cfg, num_splits=s) for s in (1, 4)]
    want = torch.tensor([[False, False], [False, True], [True, True], [True, True]])
    for run in runs:
        o, lse = (x.cpu() for x in run())
        assert torch.equal(o[:, 0].isnan().any(-1), want)
        assert torch.equal(lse[..., 0].isnan(), want)
        assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()
        assert torch.isfinite(o[1, 0, 0]).all() and torch.isfinite(lse[1, 0]).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max of NaNs
def test_decode_lengths_out_of_range_give_nan_rows(rng):
    """Caller-owned lengths are not read on the host in a CUDA decode step: a length below 0 or
    above T_max gives NaN rows (torch and Triton, one split and several), the others are as with
    valid lengths; before, they came out clamped and finite."""
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    q, k, v, sums, _ = make_cache(3, 128, 1, 2, 16, [128, 100, 128], 16, 2, seed=rng)
    lens = torch.tensor([129, 100, -1], dtype=torch.int32)
    runs = [lambda: decode_step(q, k, v, sums, lens, cfg=cfg, backend="torch")]
    if HAS_TRITON:
        from pisa.ops.decode.triton import decode_triton
        dev = "cpu" if INTERPRET else "cuda"
        args = [x.to(dev) for x in (q, k, v, sums, lens)]
        runs += [lambda s=s: decode_triton(*args, cfg, num_splits=s) for s in (1, 4)]
    ok_o, ok_lse = decode_step(q[1:2], k[1:2], v[1:2], sums[1:2], lens[1:2], cfg=cfg,
                               backend="torch")
    for run in runs:
        o, lse = (x.cpu() for x in run())
        assert o[0].isnan().all() and lse[0].isnan().all()
        assert o[2].isnan().all() and lse[2].isnan().all()
        torch.testing.assert_close(o[1:2].float(), ok_o.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[1:2], ok_lse, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Selection v2 knobs (docs/spec.md §11): beam_leaf, scorer="bound", query_tile
# ------------------------------------------------------------------------------------------------
def _at(x, pos):
    """Rows ``x[b, pos[b] + i]`` for ``pos [B, L]``: ``[B, L, ...]``."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], pos]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_with_new_knobs_reproduces_prefill_rows(backend, rng):
    """Token by token through ``PisaCache(bounds=True)`` (ragged prefill, then ``append``) and
    ``decode_step``: every decoded row equals that row of ``pisa_attn`` (torch) over the whole
    sequence, with ``beam_leaf != beam`` (wider and narrower), ``scorer="bound"``, and both. The
    Triton backend (the interpreter on CPU) runs fp32, torch fp64. The knobs change some rows'
    selection, so the match is not the plain walk's."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("needs triton")
    dev = "cuda" if backend == "triton" and not INTERPRET else "cpu"
    dtype = torch.float32 if backend == "triton" else torch.float64
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    B, T, H, G, D, C, K, W = 2, 224, 1, 2, 16, 16, 4, 1  # 14 leaves, 5 levels
    start = [190, 150]
    changed = 0
    # a draw where no knob changes a row proves nothing (seldom; seed 1513954882 is one): the
    # next seed is drawn then
    for seed in range(rng, rng + 4):
        if changed:
            break
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, T, h, D, generator=gen, dtype=dtype).to(dev)
                   for h in (H * G, H, H))
        for beam_leaf, scorer in ((3, "lse"), (None, "bound"), (5, "bound"), (2, "bound")):
            W_ = 2 if beam_leaf == 2 else W  # beam_leaf narrower than beam
            cfg = per_token_config(C, K, 2, W_, scorer, "pyramid", True, D ** -0.5,
                                   beam_leaf=beam_leaf)
            want = pisa_attn(q, k, v, block_size=C, topk=K, beam=W_, backend="torch",
                             **dict(PER_TOKEN, scorer=scorer, beam_leaf=beam_leaf))
            plain = pisa_attn(q, k, v, block_size=C, topk=K, beam=W_, backend="torch",
                              **PER_TOKEN)
            cache = PisaCache.from_prefill(k[:, :max(start)], v[:, :max(start)], max_seqlen=T,
                                           seqlens=start, block_size=C, bounds=True)
            for _ in range(3):
                pos = cache.cache_seqlens.long()[:, None]
                cache.append(_at(k, pos), _at(v, pos))
                rows = cache.prepare(_at(q, pos))  # the checks of a step, before the dispatch
                o, _ = decode_step(_at(q, pos), cache.k_cache, cache.v_cache, cache.sums,
                                   rows.seqlens, cache.mins, cache.maxs, cfg=cfg, backend=backend)
                for b in range(B):
                    t = int(pos[b])
                    torch.testing.assert_close(o[b, 0], want[b, t], rtol=tol, atol=tol,
                                               msg=f"{beam_leaf} {scorer} t={t} seed {seed}")
                    changed += not torch.allclose(want[b, t], plain[b, t])
    assert changed, "the knobs never changed a row: the test proves nothing"


def test_decode_step_is_per_token_whatever_the_query_tile(rng):
    """A decode step ignores ``query_tile`` / ``tile_reduce``: the per-token result."""
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=1, scale=0.25, beam_leaf=2)
    seqlens = [200, 77]
    q, k, v, sums, lens = make_cache(2, 256, 1, 2, 16, seqlens, 16, 2, seed=rng)
    want = decode_step(q, k, v, sums, lens, cfg=cfg, backend="torch")
    for tile, reduce in ((4, "lse"), (16, "qmean"), (8, "sum")):
        tiled = dataclasses.replace(cfg, query_tile=tile, tile_reduce=reduce)
        for backend in ["torch"] + (["triton"] if HAS_TRITON else []):
            dev = "cuda" if backend == "triton" and not INTERPRET else "cpu"
            o, lse = decode_step(*(x.to(dev) for x in (q, k, v, sums, lens)), cfg=tiled,
                                 backend=backend)
            torch.testing.assert_close(o.cpu(), want[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(lse.cpu(), want[1], rtol=1e-4, atol=1e-4)


def test_bound_decode_needs_the_cache_bounds():
    """``scorer="bound"`` reads the cache's key bounds: the cache builds them from its keys at the
    first such step, but not for the slots of a running batch (a cache made with
    ``bounds=True`` is needed there); the flat scans read none; the kernel refuses to run
    without."""
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=2, scorer="bound", scale=0.25)
    q, k, v, sums, lens = make_cache(1, 64, 1, 2, 16, [40], 16, 2)
    cache = PisaCache.from_prefill(k[:, :40], v[:, :40], max_seqlen=64, block_size=16)
    with pytest.raises(ValueError, match="bounds=True"):
        cache.attend(q, cache.prepare(q, cache_batch_idx=[0]), cfg=cfg, backend="torch")
    flat = dataclasses.replace(cfg, selector="flat_lse")  # the flat scans read no bounds
    cache.attend(q, cache.prepare(q, cache_batch_idx=[0]), cfg=flat, backend="torch")
    assert not cache.has_bounds
    cache.attend(q, cache.prepare(q), cfg=cfg, backend="torch")
    assert cache.has_bounds
    with pytest.raises(ValueError, match="key bounds"):
        decode_torch(q, k, v, sums, lens, cfg)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's log(0) in the interpreter
@pytest.mark.parametrize("backend", ["torch", "naive"] + (["triton"] if HAS_TRITON else []))
@pytest.mark.parametrize("knobs", [dict(beam_leaf=4), dict(scorer="bound"),
                                   dict(scorer="bound", beam_leaf=3, query_tile=4),
                                   dict(query_tile=8, tile_reduce="lse")],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_prefill_with_cache_new_knobs_equal_the_oracle(backend, knobs, rng):
    """Chunked prefill with ``beam_leaf``, the bound scorer (the cache's bounds handed to the
    selection) and query tiles (tile rows expanded to the tokens) against the fp64 oracle:
    ``naive_select`` by tiles, ``tiles_to_tokens``, ``naive_attn``."""
    dev = "cuda" if backend == "triton" and not INTERPRET else "cpu"
    dtype = torch.float32 if backend == "triton" else torch.float64
    B, T, H, G, D, L, C = 2, 200, 1, 2, 16, 9, 16
    cfg = per_token_config(C, 4, 2, 1, knobs.get("scorer", "lse"), "pyramid", True, D ** -0.5,
                           query_tile=knobs.get("query_tile", 1), beam_leaf=knobs.get("beam_leaf"),
                           tile_reduce=knobs.get("tile_reduce", "sum"))
    gen = torch.Generator().manual_seed(rng)
    q = torch.randn(B, L, H * G, D, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, generator=gen, dtype=torch.float64)
    for seqlens in ([190, 150], [170, 170]):
        cache = filled_cache(k.to(dtype), v.to(dtype), seqlens, T, C, 2)
        mins, maxs = bounds_from_keys(cache[0], cache[3], C, 2)
        o, _ = prefill_with_cache(q.to(dtype).to(dev), *(x.to(dev) for x in cache[:3]), seqlens,
                                  mins.to(dev), maxs.to(dev), cfg=cfg, backend=backend)
        for b, n in enumerate(seqlens):
            qb, kb, vb = q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]
            idx, cnt = naive_select(qb, kb, cfg)
            idx, _ = tiles_to_tokens(idx, cnt, L, n, cfg.query_tile)
            want, _ = naive_attn(qb, kb, vb, idx, C, cfg.scale)
            tol = 1e-4 if dtype == torch.float32 else 1e-10
            torch.testing.assert_close(o[b:b + 1].cpu().double(), want, rtol=tol, atol=tol,
                                       msg=f"{seqlens} b={b} seed {rng}")


def test_prefill_with_cache_hands_the_bounds_to_the_selection(monkeypatch, rng):
    """With the cache's bounds, the selection's pyramid carries them (rows of the prefix
    geometry); without them (or for another scorer) it has none."""
    seen = []
    real = decode_ops.select

    def spy(q, k, *, cfg, backend, pyramid=None):
        seen.append(pyramid)
        return real(q, k, cfg=cfg, backend=backend, pyramid=pyramid)
    monkeypatch.setattr(decode_ops, "select", spy)
    cfg = per_token_config(block_size=8, topk=4, branching=2, beam=2, scorer="bound", scale=0.25)
    q = torch.randn(1, 3, 2, 16, dtype=torch.float64)
    k, v = torch.randn(2, 1, 100, 1, 16, dtype=torch.float64)
    cache = filled_cache(k, v, [90], 100, 8, 2)
    mins, maxs = bounds_from_keys(cache[0], cache[3], 8, 2)
    prefill_with_cache(q, *cache[:3], [90], mins, maxs, cfg=cfg, backend="torch")
    want = build_pyramid(k[:, :90], 8, 2, "torch", bounds=True)
    assert torch.equal(seen[-1].mins, want.mins) and torch.equal(seen[-1].maxs, want.maxs)
    prefill_with_cache(q, *cache[:3], [90], mins, maxs, cfg=dataclasses.replace(cfg, scorer="lse"),
                       backend="torch")
    assert seen[-1].mins is None
    prefill_with_cache(q, *cache[:3], [90], cfg=cfg, backend="torch")  # the selection's own
    assert seen[-1].mins is None
