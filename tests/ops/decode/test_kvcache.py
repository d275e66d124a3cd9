"""``pisa.ops.decode.kvcache``: appends keep the pyramid sums (and the optional key bounds)
exact; the cache checks."""
import math

import pytest
import torch

from pisa.ops.decode.kvcache import (append_kv, bounds_from_keys, check_cache, empty_bounds,
                                     node_counts, pyramid_from_sums, write_kv)
from pisa.ops.pyramid import build_pyramid
from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.utils.geometry import cdiv, compute_dtype, level_offsets


def _empty_cache(B, T, H, D, C, g, dtype=torch.float64, device="cpu"):
    k = torch.full((B, T, H, D), float("nan"), dtype=dtype, device=device)  # never read unwritten
    n_total = level_offsets(T, C, g)[-1]
    sums = torch.zeros(B, n_total, H, D, dtype=compute_dtype(k), device=device)
    return k, k.clone(), sums, torch.zeros(B, dtype=torch.int32, device=device)


def _rebuilt_sums(k_ref, seqlens, T, C, g):
    """Sums of the T_max-geometry pyramid over each sequence's valid keys (zero keys past it)."""
    real = torch.arange(T)[None, :] < seqlens[:, None].cpu()
    keys = torch.where(real[..., None, None], k_ref.cpu(), 0.0)
    pyr = build_pyramid_torch(keys, C, g)
    return pyr.means * pyr.counts[None, :, None, None]


@pytest.fixture(params=["one_pass", "runs", "run_pieces", "fused"])
def write_path(request, monkeypatch):
    """``write_kv``'s ways to update the levels, each test run through all: one pass over all
    levels (small appends, as tests' sizes are), the per-level dense folds of a long run, those
    folds in pieces of a few keys (as a long prompt's are), and the fused Triton append of CUDA's
    small appends (here under the interpreter, for fp32 sums)."""
    import pisa.ops.decode.kvcache as kvcache
    if request.param == "fused":
        monkeypatch.setattr(kvcache, "_fused", lambda k, v, sums: sums.dtype == torch.float32)
    elif request.param != "one_pass":
        monkeypatch.setattr(kvcache, "_ONE_PASS_ELEMS", 0)
    if request.param == "run_pieces":
        monkeypatch.setattr(kvcache, "_RUN_ELEMS", 7 * 2 * 8)  # 7 keys of [H=2, D=8] a piece
    return request.param


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("C,g", [(8, 2), (4, 3)])
def test_sums_equal_rebuilt_pyramid_after_random_appends(dtype, C, g, rng, write_path):
    B, T, H, D = 3, 203, 2, 8
    k_cache, v_cache, sums, lens = _empty_cache(B, T, H, D, C, g, dtype)
    k_ref = torch.randn(B, T, H, D).to(dtype)
    v_ref = torch.randn(B, T, H, D).to(dtype)
    while int(lens.max()) < T - 1:
        # grow the whole batch, or one sequence through views of its rows: lengths diverge
        rows = slice(None) if torch.rand(()) < 0.4 else int(torch.randint(B, ()))
        rows = rows if isinstance(rows, slice) else slice(rows, rows + 1)
        room = T - int(lens[rows].max())
        L = int(torch.randint(0, min(room, 40) + 1, ()))
        s = lens[rows].long()[:, None] + torch.arange(L)
        b = torch.arange(B)[rows][:, None]
        append_kv(k_cache[rows], v_cache[rows], sums[rows], k_ref[b, s.clamp(max=T - 1)],
                  v_ref[b, s.clamp(max=T - 1)], lens[rows], C, g)
        lens[rows] += L
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums, _rebuilt_sums(k_ref.to(sums.dtype), lens, T, C, g), **tol)
    for b in range(B):
        n = int(lens[b])
        assert torch.equal(k_cache[b, :n], k_ref[b, :n])
        assert torch.equal(v_cache[b, :n], v_ref[b, :n])
        assert k_cache[b, n:].isnan().all(), "nothing written past the sequence"
        got = pyramid_from_sums(sums[b:b + 1], n, C, g)
        want = build_pyramid_torch(k_ref[b:b + 1, :n].to(sums.dtype), C, g)
        assert got.offsets == want.offsets and torch.equal(got.counts, want.counts)
        torch.testing.assert_close(got.means, want.means, **tol)


@pytest.mark.parametrize("seqlen", [1, 7, 8, 9, 64, 100])
def test_pyramid_from_sums_geometry(seqlen, rng):
    C, g, T = 8, 2, 100
    k_cache, v_cache, sums, lens = _empty_cache(1, T, 1, 4, C, g)
    k = torch.randn(1, seqlen, 1, 4, dtype=torch.float64)
    append_kv(k_cache, v_cache, sums, k, k, lens, C, g)
    got = pyramid_from_sums(sums, seqlen, C, g)
    want = build_pyramid_torch(k, C, g)
    assert got.offsets == want.offsets and got.counts.dtype == torch.int32
    assert torch.equal(got.counts, want.counts)
    torch.testing.assert_close(got.means, want.means, rtol=1e-12, atol=1e-12)


def test_zero_length_append_changes_nothing(rng):
    k_cache, v_cache, sums, lens = _empty_cache(2, 50, 2, 4, 8, 2)
    x = torch.randn(2, 5, 2, 4, dtype=torch.float64)
    append_kv(k_cache, v_cache, sums, x, x, lens, 8, 2)
    before = sums.clone(), k_cache.clone()
    append_kv(k_cache, v_cache, sums, x[:, :0], x[:, :0], lens, 8, 2)
    assert torch.equal(sums, before[0])
    assert torch.equal(k_cache.nan_to_num(), before[1].nan_to_num())


def test_write_kv_is_append_kv_without_the_checks(rng):
    cache_a, cache_b = _empty_cache(2, 50, 2, 4, 8, 2), _empty_cache(2, 50, 2, 4, 8, 2)
    x, y = torch.randn(2, 2, 13, 2, 4, dtype=torch.float64)
    append_kv(*cache_a[:3], x, y, cache_a[3], 8, 2)
    write_kv(*cache_b[:3], x, y, cache_b[3], 8, 2)
    for a, b in zip(cache_a, cache_b):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert not cache_b[3].any(), "neither advances the lengths"


@pytest.mark.parametrize("L", [1, 5, 30])
@pytest.mark.parametrize("slots", [False, True])
def test_one_pass_over_the_levels_equals_the_runs(L, slots, rng, monkeypatch):
    """Small appends (a decode step) update every level in one pass, long ones (a prefill) fold
    each level's share of the run densely (``_add_runs``): the same K/V and key bounds exactly, the
    same sums to fp32 rounding (the runs sum a node's keys in another order), new keys sharing a
    node (L > 1) and runs starting mid-node included."""
    import pisa.ops.decode.kvcache as kvcache
    B, S, T, H, D, C, g = 2, 3, 203, 2, 4, 8, 2
    results = []
    for one_pass in (1 << 22, 0):
        monkeypatch.setattr(kvcache, "_ONE_PASS_ELEMS", one_pass)
        torch.manual_seed(rng)
        k_cache, v_cache, sums, _ = _empty_cache(S, T, H, D, C, g, torch.float32)
        mins, maxs = empty_bounds(sums)
        lens = torch.tensor([17, 90], dtype=torch.int32)  # + 3 L < T
        idx = torch.tensor([2, 0], dtype=torch.int32) if slots else None
        if not slots:
            k_cache, v_cache, sums, mins, maxs = (x[:B] for x in (k_cache, v_cache, sums, mins,
                                                                  maxs))
        for _ in range(3):
            x, y = torch.randn(2, B, L, H, D)
            write_kv(k_cache, v_cache, sums, x, y, lens, C, g, mins, maxs, cache_batch_idx=idx)
            lens += L
        results.append((k_cache, v_cache, sums, mins, maxs))
    for i, (a, b) in enumerate(zip(*results)):
        if i == 2:  # the sums
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.isfinite(results[0][3]).any() and results[0][2].abs().sum() > 0


def test_node_counts_clamp_each_node_to_the_present_keys():
    offsets = level_offsets(40, 8, 2)  # levels of 5, 3, 2, 1 nodes
    assert node_counts(19, offsets, 8, 2).tolist() == [8, 8, 3, 0, 0, 16, 3, 0, 19, 0, 19]
    assert node_counts(40, offsets, 8, 2).tolist() == [8] * 5 + [16, 16, 8, 32, 8, 40]


def _bad(**over):
    k_cache, v_cache, sums, lens = _empty_cache(2, 40, 2, 4, 8, 2)
    args = dict(k_cache=k_cache, v_cache=v_cache, sums=sums,
                k_new=torch.randn(2, 3, 2, 4, dtype=torch.float64),
                v_new=torch.randn(2, 3, 2, 4, dtype=torch.float64), cache_seqlens=lens,
                block_size=8, branching=2)
    args.update(over)
    return args


BAD = [
    (dict(sums=torch.zeros(2, 5, 2, 4, dtype=torch.float64)), ValueError, "sums must be"),
    (dict(sums=torch.zeros(2, 9, 2, 4, dtype=torch.float32)), ValueError, "sums must be"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, "cache_seqlens must be"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens must be"),
    (dict(cache_seqlens=torch.full((2,), 38, dtype=torch.int32)), ValueError, "exceed"),
    (dict(v_cache=torch.zeros(2, 40, 2, 4)), ValueError, "v_cache"),
    (dict(k_cache=torch.zeros(2, 40, 2)), ValueError, "k_cache must be"),
    (dict(k_new=torch.randn(2, 3, 1, 4, dtype=torch.float64)), ValueError, "k_new must have"),
    (dict(v_new=torch.randn(2, 4, 2, 4, dtype=torch.float64)), ValueError, "v_new shape"),
    (dict(k_new=torch.randn(2, 3, 2, 4)), TypeError, "k_new must be torch.float64"),
    (dict(k_new=None), TypeError, "k_new must be a torch.Tensor"),
    (dict(block_size=6), ValueError, "block_size"),
    (dict(branching=1), ValueError, "branching"),
]


@pytest.mark.parametrize("over,exc,msg", BAD, ids=lambda x: str(x)[:40])
def test_append_kv_rejects_bad_input(over, exc, msg):
    with pytest.raises(exc, match=msg):
        append_kv(**_bad(**over))


def test_pyramid_from_sums_rejects_bad_input():
    # 40 keys, C = 8: 5 + 3 + 2 + 1 = 11 nodes; no leaf count gives 9
    with pytest.raises(ValueError, match="seqlen must be"):
        pyramid_from_sums(torch.zeros(1, 11, 1, 4), 41, 8, 2)
    with pytest.raises(ValueError, match="seqlen must be"):
        pyramid_from_sums(torch.zeros(1, 11, 1, 4), 0, 8, 2)
    with pytest.raises(ValueError, match="no pyramid"):
        pyramid_from_sums(torch.zeros(1, 9, 1, 4), 8, 8, 2)
    with pytest.raises(ValueError, match="sums must be"):
        pyramid_from_sums(torch.zeros(11, 1, 4), 8, 8, 2)


def test_check_cache_returns_offsets():
    k_cache, v_cache, sums, lens = _empty_cache(1, 40, 1, 4, 8, 2)
    assert check_cache(k_cache, v_cache, sums, lens, 8, 2) == level_offsets(40, 8, 2)


def _assert_bounds_match_keys(mins, maxs, k_ref, lens, C, g):
    """Each sequence's cache bounds (``T_max`` geometry) against ``build_pyramid(..., "torch",
    bounds=True)`` of its prefix: equal node by node (min / max are exact), and every node without
    a real key (past the prefix's pyramid, or its nodes past the prefix) ``+inf`` / ``-inf``."""
    T = k_ref.shape[1]
    full = level_offsets(T, C, g)
    for b in range(k_ref.shape[0]):
        n = int(lens[b])
        real = node_counts(n, full, C, g) > 0
        assert torch.isposinf(mins[b][~real]).all() and torch.isneginf(maxs[b][~real]).all()
        if n == 0:
            continue
        got = pyramid_from_sums(torch.zeros_like(mins[b:b + 1]), n, C, g, mins[b:b + 1],
                                maxs[b:b + 1])
        want = build_pyramid(k_ref[b:b + 1, :n].to(mins.dtype), C, g, "torch", bounds=True)
        assert got.offsets == want.offsets
        assert torch.equal(got.mins, want.mins) and torch.equal(got.maxs, want.maxs), b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("C,g", [(8, 2), (4, 3)])
def test_bounds_equal_rebuilt_pyramid_after_appends(dtype, C, g, rng, write_path):
    """One token at a time, chunks, and one sequence alone (ragged lengths): after each round of
    appends the bounds equal amin / amax of each sequence's real keys under every node, and
    ``bounds_from_keys`` over the cache rebuilds them exactly. Slots past the lengths hold NaN."""
    B, T, H, D = 3, 203, 2, 4
    k_cache, v_cache, sums, lens = _empty_cache(B, T, H, D, C, g, dtype)
    mins, maxs = empty_bounds(sums)
    assert mins.dtype == sums.dtype and mins.shape == sums.shape
    k_ref = torch.randn(B, T, H, D).to(dtype)
    steps = [(slice(None), 1)] * 3 + [(slice(None), 17), (slice(1, 2), 40), (slice(2, 3), 1),
                                      (slice(None), 64), (slice(0, 1), 5), (slice(None), 1)]
    for rows, L in steps:
        s = lens[rows].long()[:, None] + torch.arange(L)
        b = torch.arange(B)[rows][:, None]
        append_kv(k_cache[rows], v_cache[rows], sums[rows], k_ref[b, s], k_ref[b, s], lens[rows],
                  C, g, mins[rows], maxs[rows])
        lens[rows] += L
        _assert_bounds_match_keys(mins, maxs, k_ref, lens, C, g)
    assert len(set(lens.tolist())) == B, "ragged lengths"
    rebuilt = bounds_from_keys(k_cache, lens, C, g)
    assert torch.equal(rebuilt[0], mins) and torch.equal(rebuilt[1], maxs)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums, _rebuilt_sums(k_ref.to(sums.dtype), lens, T, C, g), **tol)


def test_bounds_from_keys_in_chunks_with_empty_and_ragged_sequences():
    """``bounds_from_keys`` in many leaf chunks (down to one leaf a chunk) and in one equals the
    pyramid's bounds of each prefix: an empty sequence has none, a ragged last leaf bounds its
    real keys only (the NaN keys after them are never read)."""
    B, T, H, D, C, g = 3, 77, 1, 4, 4, 2
    k = torch.randn(B, T, H, D)
    lens = torch.tensor([0, 77, 30], dtype=torch.int32)
    k_nan = k.clone()
    k_nan[2, 30:] = math.nan
    k_nan[0] = math.nan
    for chunk in (1, 3 * C * H * D * 5, 1 << 24):
        mins, maxs = bounds_from_keys(k_nan, lens, C, g, chunk_elems=chunk)
        _assert_bounds_match_keys(mins, maxs, k, lens, C, g)


def test_write_kv_without_bounds_and_bound_checks():
    """``write_kv`` without bounds leaves them alone; ``check_cache`` wants both bounds or
    neither, each in the layout of sums."""
    k_cache, v_cache, sums, lens = _empty_cache(1, 40, 1, 4, 8, 2)
    mins, maxs = empty_bounds(sums)
    x = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    write_kv(k_cache, v_cache, sums, x, x, lens, 8, 2)
    assert torch.isposinf(mins).all() and torch.isneginf(maxs).all()
    check_cache(k_cache, v_cache, sums, lens, 8, 2, mins, maxs)
    with pytest.raises(ValueError, match="given together"):
        check_cache(k_cache, v_cache, sums, lens, 8, 2, mins, None)
    for bad in (mins.float(), mins[:, :-1], mins.repeat(1, 1, 1, 2)[..., ::2]):
        with pytest.raises(ValueError, match="mins must be"):
            check_cache(k_cache, v_cache, sums, lens, 8, 2, bad, maxs)
    with pytest.raises(TypeError, match="maxs must be a torch.Tensor"):
        check_cache(k_cache, v_cache, sums, lens, 8, 2, mins, [0.0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_append_is_captured_by_a_cuda_graph(rng):
    """Appending one token per sequence replays from a CUDA graph (no host sync inside)."""
    B, T, H, D, C, g = 3, 300, 2, 64, 16, 2
    k_cache, v_cache, sums, lens = _empty_cache(B, T, H, D, C, g, torch.bfloat16, "cuda")
    start = torch.tensor([0, 17, 150], dtype=torch.int32)
    k_ref = torch.randn(B, T, H, D, dtype=torch.bfloat16, device="cuda")
    for b in range(B):  # mixed starting lengths
        s = int(start[b])
        append_kv(k_cache[b:b + 1], v_cache[b:b + 1], sums[b:b + 1], k_ref[b:b + 1, :s],
                  k_ref[b:b + 1, :s], lens[b:b + 1], C, g)
    lens.copy_(start)
    k_new = torch.empty(B, 1, H, D, dtype=torch.bfloat16, device="cuda")

    def step():
        append_kv(k_cache, v_cache, sums, k_new, k_new, lens, C, g)
        lens.add_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture, then undo its effect
        k_new.zero_()
        step()
        lens.sub_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(100):
        k_new.copy_(k_ref[torch.arange(B, device="cuda"), lens.long()][:, None])
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lens.cpu(), start + 100)
    torch.testing.assert_close(sums.cpu().double(),
                               _rebuilt_sums(k_ref.double(), lens.cpu(), T, C, g),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_long_ragged_appends_equal_the_rebuilt_pyramid(device, rng):
    """A prefill's long runs (``_add_runs``: each level folded densely, distinct rows into the
    cache; on CUDA with its float atomics), starting mid-node at different lengths per sequence:
    the sums and key bounds of the rebuilt pyramid."""
    B, T, H, D, C, g = 3, 20000, 2, 64, 64, 2
    k_cache, v_cache, sums, lens = _empty_cache(B, T, H, D, C, g, torch.bfloat16, device)
    mins, maxs = empty_bounds(sums)
    k_ref = torch.randn(B, T, H, D, dtype=torch.bfloat16, device=device)

    def run(rows, L):
        s = lens[rows].long()[:, None] + torch.arange(L, device=device)
        b = torch.arange(B, device=device)[rows][:, None]
        append_kv(k_cache[rows], v_cache[rows], sums[rows], k_ref[b, s], k_ref[b, s],
                  lens[rows], C, g, mins[rows], maxs[rows])
        lens[rows] += L
    run(slice(1, 2), 37)  # ragged starts: 0, 37, 100 keys
    run(slice(2, 3), 100)
    for L in (9000, 1, 6100):
        run(slice(None), L)
    _assert_bounds_match_keys(mins.cpu(), maxs.cpu(), k_ref.cpu(), lens.cpu(), C, g)
    # fp32 sums of up to 20000 keys added in the order the CUDA atomics choose: the rounding
    # grows as sqrt(n) * ulp(|sum| ~ 400) ~ 2e-3 at the top levels (1e-3 failed once on the
    # H200); a key more or less would move a sum by ~1
    torch.testing.assert_close(sums.cpu().double(),
                               _rebuilt_sums(k_ref.double(), lens.cpu(), T, C, g),
                               rtol=1e-5, atol=1e-2)


def _fused_and_torch(monkeypatch, *args, **kwargs):
    """The cache tensors ``args[:3]`` and bounds after ``write_kv(*args, **kwargs)`` through the
    fused Triton append (the interpreter on CPU) and through the torch ops, from the same
    start."""
    import pisa.ops.decode.kvcache as kvcache
    out = []
    for fused in (True, False):
        monkeypatch.setattr(kvcache, "_fused", lambda k, v, sums, fused=fused: fused)
        cache = [x.clone() for x in args[:3]]
        bounds = {k: v.clone() for k, v in kwargs.items() if k in ("mins", "maxs")}
        write_kv(*cache, *args[3:], **{**kwargs, **bounds})
        out.append(cache + [bounds[k] for k in sorted(bounds)])
    return out


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("form", ["contiguous", "slots", "paged"])
def test_fused_append_equals_the_torch_path(form, L, rng, monkeypatch):
    """The fused append (one program per new token and KV head, atomics into every ancestor)
    writes what the torch ops write: K / V rows, sums (to fp32 rounding: the atomics add in
    another order) and bounds exactly, through slots or a page table, new tokens of one call
    sharing nodes (L > 1) and sequences at different lengths, g = 4 too."""
    S, T, H, D, C, g = 3, 200, 2, 16, 8, 4 if L == 3 else 2
    B = 2 if form != "contiguous" else S
    k_cache, v_cache, sums, _ = _empty_cache(S, T, H, D, C, g, torch.float16)
    sums.normal_()
    mins, maxs = sums - 1, sums + 1
    lens = torch.tensor([0, 71, 130][:B], dtype=torch.int32)
    x, y = torch.randn(2, B, L, H, D).half()
    kw = dict(mins=mins, maxs=maxs)
    if form == "slots":
        kw["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
    if form == "paged":  # a pool of 60 pages of C rows; a shuffled table of T / C pages a row
        k_cache, v_cache = (x.view(-1, C, H, D)[:60].clone() for x in (k_cache, v_cache))
        table = torch.randperm(60)[:B * cdiv(T, C)].view(B, -1).to(torch.int32)
        kw["block_table"] = table
        sums, mins, maxs = sums[:B], mins[:B], maxs[:B]
        kw.update(mins=mins, maxs=maxs)
    fused, ref = _fused_and_torch(monkeypatch, k_cache, v_cache, sums, x, y, lens, C, g, **kw)
    for i, (a, b) in enumerate(zip(fused, ref)):
        if i == 2:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), i
    assert not torch.equal(fused[2], sums) and not torch.equal(fused[3], maxs)


def test_fused_append_drops_positions_slots_and_pages_out_of_range(rng, monkeypatch):
    """A token past ``T_max``, of a slot outside the cache or whose page lies outside the pool is
    not written (no device assert: the decode step's NaN rows tell such a sequence); the other
    tokens of the call are."""
    import pisa.ops.decode.kvcache as kvcache
    monkeypatch.setattr(kvcache, "_fused", lambda k, v, sums: True)
    S, T, H, D, C, g = 3, 64, 2, 16, 8, 2
    k_cache, v_cache, sums, _ = _empty_cache(S, T, H, D, C, g, torch.float16)
    x = torch.randn(S, 1, H, D).half()
    lens = torch.tensor([T, 5, 9], dtype=torch.int32)  # sequence 0 is full
    write_kv(k_cache, v_cache, sums, x, x, lens, C, g, cache_batch_idx=torch.tensor(
        [0, 1, 7], dtype=torch.int32))  # slot 7 is not in the cache
    assert torch.equal(k_cache[1, 5], x[1, 0]) and k_cache[1].isfinite().sum() == H * D
    assert k_cache[0].isnan().all() and k_cache[2].isnan().all()
    assert sums[0].abs().sum() == 0 and sums[2].abs().sum() == 0 and sums[1].abs().sum() > 0
    pool = torch.full((4, C, H, D), float("nan"), dtype=torch.float16)
    table = torch.tensor([[0, 1], [-1, 2], [3, 9]], dtype=torch.int32)  # -1 and 9: no page
    sums = torch.zeros(S, level_offsets(2 * C, C, g)[-1], H, D)
    write_kv(pool, pool.clone(), sums, x, x, torch.tensor([3, 2, C + 1], dtype=torch.int32), C, g,
             block_table=table)
    assert torch.equal(pool[0, 3], x[0, 0]) and pool.isfinite().sum() == H * D
    assert sums[1:].abs().sum() == 0
