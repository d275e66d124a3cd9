"""``pisa.ops.decode.triton.decode_triton``, the fused decode step, against the fp64 oracle.

Without CUDA the kernel runs in the Triton interpreter on tiny fp32/fp16 shapes. The oracle of a
decode step is the last row of prefill: ``naive_select`` + ``naive_attn`` over each sequence's first
``cache_seqlens[b]`` keys, with the query as the last token. Outputs start as NaN
(``PISA_TRITON_POISON``), partials included, so a match proves every element was written. The GPU
section runs bf16 at real sizes: against fp32 references of the selection and the attention,
against the prefill rows of the training kernels while decoding token by token, and under
CUDA-graph capture and replay.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pisa.ops.attn import sparse_attn
from pisa.ops.attn.naive import naive_dense_attn
from pisa.ops.decode.kvcache import append_kv, bounds_from_keys, empty_bounds
from pisa.ops.select import select
from pisa.ops.select.naive import naive_select
from pisa.ops.utils.config import SelectConfig
from pisa.ops.utils.geometry import cdiv, level_offsets
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.decode.common import assert_matches, make_cache, oracle, pyramid_sums

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1 without CUDA

from pisa.ops.decode.torch_backend import decode_torch  # noqa: E402
from pisa.ops.decode.triton import beam_widths, decode_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def run(q, k, v, sums, lens, cfg, **kw):
    if cfg.scorer == "bound" and "mins" not in kw:  # the bounds of each sequence's real keys
        kw["mins"], kw["maxs"] = bounds_from_keys(k, lens, cfg.block_size, cfg.branching)
    for name in ("mins", "maxs"):
        if kw.get(name) is not None:
            kw[name] = kw[name].to(DEVICE)
    o, lse, idx = decode_triton(*(x.to(DEVICE) for x in (q, k, v, sums, lens)), cfg,
                                return_block_idx=True, **kw)
    return o.cpu(), lse.cpu(), idx.cpu()


# (B, HKV, G, D, C, g, W, K, forced_in_budget, T_max, seqlens, num_splits, dtype)
CASES = [
    (3, 1, 4, 16, 16, 2, 2, 6, True, 512, [512, 300, 37], 1, torch.float32),
    (3, 1, 4, 16, 16, 2, 2, 6, True, 512, [512, 300, 37], 3, torch.float32),
    (2, 2, 2, 32, 16, 4, 3, 5, False, 410, [410, 90], 2, torch.float32),
    (3, 1, 1, 16, 16, 2, 4, 4, True, 256, [1, 17, 64], 2, torch.float32),
    (2, 1, 4, 16, 16, 4, 2, 6, True, 512, [0, 481], 4, torch.float32),
    (2, 2, 2, 16, 32, 2, 3, 5, True, 448, [447, 200], 2, torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:12])))
def test_decode_matches_oracle(case):
    B, HKV, G, D, C, g, W, K, in_budget, T_max, seqlens, splits, dtype = case
    cfg = per_token_config(block_size=C, topk=K, branching=g, beam=W, forced_in_budget=in_budget,
                           scale=D ** -0.5)
    q, k, v, sums, lens = make_cache(B, T_max, HKV, G, D, seqlens, C, g, dtype, seed=T_max + W)
    want = oracle(q, k, v, seqlens, cfg)
    assert_matches(run(q, k, v, sums, lens, cfg, num_splits=splits), want,
                   1e-4 if dtype == torch.float32 else 1e-2)


# (T_max, C, g, W, seqlens): the walk's entry level. 64 leaves at g=4, W=1: at 1024 the top
# walk level already has 2 free nodes (no level skipped); at 769 it has 1 (skipped) and the next
# level starts from node 1 only (node 2 holds leaf cur - 1 and is forced). 512 / g=2 / 385: the
# same exclusion two levels down. Tiny caches: no walk level (1 leaf; 4 leaves at g=4), one level.
ENTRY_CASES = [(1024, 16, 4, 1, [1024, 769, 533]), (512, 16, 2, 1, [385, 512, 200]),
               (16, 16, 2, 2, [16, 5]), (64, 16, 4, 1, [64, 40]), (40, 16, 2, 1, [40, 33])]


@pytest.mark.parametrize("case", ENTRY_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_walk_entry_level(case):
    """The walk starts at the first level with more than W free nodes, computed from the
    position: every entry depth, the forced-node exclusion in the level above, and caches too
    small for any internal level, against the oracle."""
    T_max, C, g, W, seqlens = case
    cfg = per_token_config(block_size=C, topk=4, branching=g, beam=W, scale=0.25)
    q, k, v, sums, lens = make_cache(len(seqlens), T_max, 1, 2, 16, seqlens, C, g, seed=T_max)
    want = oracle(q, k, v, seqlens, cfg)
    assert_matches(run(q, k, v, sums, lens, cfg, num_splits=2), want, 1e-4)


def test_walk_ranks_a_level_with_one_free_node_too_many():
    """The skip stops at the first level with more than W free nodes. 16 leaves, g=2, W=1, the
    query in leaf 8: level 2 has two free nodes, 1 (leaves 2, 3) and 2 (leaves 4, 5), and keeps
    one. Node 2's keys point away from the queries but one key of leaf 4 points along them: its
    means rank node 2 last, so leaf 4 is never a leaf candidate, though its exact LSE is the
    highest; a walk that kept both nodes would select it."""
    C, g, T_max, s = 16, 2, 256, 140
    cfg = per_token_config(block_size=C, topk=4, branching=g, beam=1, scale=0.25)
    q, k, v, _, lens = make_cache(1, T_max, 1, 2, 16, [s], C, g, seed=9)
    u = F.normalize(torch.randn(16, generator=torch.Generator().manual_seed(10)), dim=0)
    q[:] = 2 * u  # both query heads along u
    k[0, 4 * C:6 * C, 0] = -16 * u
    k[0, 4 * C + 5, 0] = 16 * u
    sums = pyramid_sums(k, [s], C, g)
    want = oracle(q, k, v, [s], cfg)
    assert 4 not in want[2].flatten().tolist()
    wide = dataclasses.replace(cfg, beam=2)
    assert 4 in naive_select(q, k[:, :s], wide)[0].flatten().tolist()
    assert_matches(run(q, k, v, sums, lens, cfg, num_splits=2), want, 1e-4)


def test_splits_agree_and_default():
    """Every split count (and the default) gives the oracle's result; more splits than list
    entries are capped."""
    cfg = per_token_config(block_size=16, topk=5, branching=2, beam=3, scale=0.25)
    seqlens = [333, 160]
    q, k, v, sums, lens = make_cache(2, 336, 1, 2, 16, seqlens, 16, 2, seed=4)
    want = oracle(q, k, v, seqlens, cfg)
    for splits in (None, 2, 64):
        assert_matches(run(q, k, v, sums, lens, cfg, num_splits=splits), want, 1e-4)


def test_short_sequences_are_dense_causal():
    """A query in the first K blocks selects every causal block: dense causal attention."""
    C, K = 16, 6
    cfg = per_token_config(block_size=C, topk=K, branching=2, beam=2, scale=0.25)
    seqlens = [K * C, 5 * C + 3, 2]
    q, k, v, sums, lens = make_cache(3, 256, 1, 4, 16, seqlens, C, 2, seed=8)
    o, lse, idx = run(q, k, v, sums, lens, cfg, num_splits=2)
    for b, s in enumerate(seqlens):
        n_blocks = cdiv(s, C)
        assert idx[b, 0, 0].tolist() == list(range(n_blocks)) + [-1] * (K - n_blocks)
        wo, wlse = naive_dense_attn(q[b:b + 1], k[b:b + 1, :s], v[b:b + 1, :s], cfg.scale)
        torch.testing.assert_close(o[b:b + 1].double(), wo, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[b:b + 1].double(), wlse, rtol=1e-4, atol=1e-4)


def test_token_by_token_with_append():
    """The serving loop: append one token with ``append_kv`` (then advance the lengths), decode;
    each step equals the oracle over the keys so far."""
    B, T_max, HKV, G, D, C, g = 2, 160, 1, 2, 16, 16, 2
    cfg = per_token_config(block_size=C, topk=4, branching=g, beam=2, scale=0.25)
    start = [90, 141]
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(B, T_max, HKV, D, generator=gen)
    v = torch.randn(B, T_max, HKV, D, generator=gen)
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    k_cache[:, :], v_cache[:, :] = k, v
    sums = pyramid_sums(k, start, C, g)
    lens = torch.tensor(start, dtype=torch.int32)
    for step in range(4):
        pos = lens.long()
        k_new, v_new = k[torch.arange(B), pos][:, None], v[torch.arange(B), pos][:, None]
        append_kv(k_cache, v_cache, sums, k_new, v_new, lens, C, g)
        lens += 1
        q = torch.randn(B, 1, HKV * G, D, generator=gen)
        want = oracle(q, k, v, lens.tolist(), cfg)
        assert_matches(run(q, k_cache, v_cache, sums, lens, cfg, num_splits=2), want, 1e-4)


def test_rejects_what_the_kernel_cannot_run():
    """The kernel's own limits; the shape, dtype and cache checks are ``PisaCache.prepare``'s
    (``test_decode.py``)."""
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    q, k, v, sums, lens = make_cache(1, 64, 1, 2, 16, [40], 16, 2)
    args = (q, k, v, sums, lens)
    bad_cfgs = {"scorer='lse'": {"scorer": "mean"}, "selector='pyramid'": {"selector": "flat_lse"},
                "branching": {"branching": 3}, "block_size": {"block_size": 8}}
    for match, change in bad_cfgs.items():
        bad = dataclasses.replace(cfg, **change)
        with pytest.raises(ValueError, match=match):
            decode_triton(q, k, v, pyramid_sums(k, [40], bad.block_size, bad.branching), lens, bad)
    with pytest.raises(ValueError, match="num_splits"):
        decode_triton(*args, cfg, num_splits=0)
    with pytest.raises(ValueError, match="num_warps"):
        decode_triton(*args, cfg, num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        decode_triton(*args, cfg, num_stages=0)
    with pytest.raises(ValueError, match="beam >= 1"):
        decode_triton(*args, dataclasses.replace(cfg, beam=0))
    with pytest.raises(ValueError, match="query heads per KV head"):
        decode_triton(q.repeat(1, 1, 33, 1)[:, :, :65], k, v, sums, lens, cfg)
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        decode_triton(q.double(), k.double(), v.double(), sums.double(), lens, cfg)
    q48, k48, v48, s48, _ = make_cache(1, 64, 1, 2, 48, [40], 16, 2)
    with pytest.raises(ValueError, match="head dims"):
        decode_triton(q48, k48, v48, s48, lens, cfg)


# ------------------------------------------------------------------------------------------------
# Selection v2: beam_leaf (the level-2 beam) and scorer="bound"
# ------------------------------------------------------------------------------------------------
# (B, HKV, G, C, g, W, beam_leaf, scorer, K, T_max, seqlens, num_splits, dtype)
V2_CASES = [
    (3, 1, 4, 16, 2, 2, 5, "lse", 6, 512, [512, 300, 37], 2, torch.float32),  # wider level 2
    (3, 1, 2, 16, 2, 4, 1, "lse", 6, 512, [512, 301, 100], 1, torch.float32),  # narrower
    (2, 1, 2, 16, 2, 1, 40, "lse", 4, 1024, [1024, 700], 2, torch.float32),  # WPL capped: 16
    (2, 2, 2, 16, 4, 1, 3, "lse", 4, 1024, [1024, 769], 3, torch.float32),
    (3, 1, 4, 16, 2, 2, None, "bound", 6, 512, [512, 300, 37], 2, torch.float32),
    (2, 2, 2, 16, 4, 3, 9, "bound", 5, 410, [410, 90], 1, torch.float32),
    (2, 1, 2, 16, 2, 3, 2, "bound", 4, 1024, [1000, 513], 4, torch.float32),
    (2, 2, 2, 32, 2, 2, 4, "bound", 5, 448, [447, 200], 2, torch.float16),
]


@pytest.mark.parametrize("case", V2_CASES, ids=lambda c: "-".join(map(str, c[:12])))
def test_decode_v2_knobs_match_oracle(case):
    """``beam_leaf`` wider than ``beam`` (a second register width at level 2, capped at a
    level's candidates), narrower, and ``scorer="bound"`` (the bounds of each sequence's real
    keys; the garbage keys past a length never enter them) against the oracle."""
    B, HKV, G, C, g, W, W2, scorer, K, T_max, seqlens, splits, dtype = case
    cfg = per_token_config(block_size=C, topk=K, branching=g, beam=W, scorer=scorer,
                           scale=16 ** -0.5, beam_leaf=W2)
    q, k, v, sums, lens = make_cache(B, T_max, HKV, G, 16, seqlens, C, g, dtype, seed=T_max + W)
    want = oracle(q, k, v, seqlens, cfg)
    assert_matches(run(q, k, v, sums, lens, cfg, num_splits=splits), want,
                   1e-4 if dtype == torch.float32 else 1e-2)


# (T_max, C, g, W, W2, seqlens): where the level-2 beam decides the walk's entry level. 64
# leaves, g=2, C=16; a query in leaf c has (c - 1) // 4 - 1 free level-3 nodes and (c - 1) // 2 - 1
# free level-2 nodes. Length 410 (leaf 25: 5 and 11), W=4, W2=16: level 3 is ranked, so level 2
# ranks its candidates (and keeps all of them, <= 16) though its free nodes fit W2. 570 (leaf 35:
# 7 and 16), W=8, W2=16: both skipped, the leaf stage takes all 16. 340 (leaf 21: 4 and 9), W=8,
# W2=4 and W=4, W2=8: level 3 skipped, level 2 ranked first. Full caches rank both.
ENTRY_V2 = [(1024, 16, 2, 4, 16, [410, 1024]), (1024, 16, 2, 8, 16, [570, 1024]),
            (1024, 16, 2, 8, 4, [340, 1024]), (1024, 16, 2, 4, 8, [340, 600]),
            (64, 16, 4, 1, 3, [64, 40])]


@pytest.mark.parametrize("case", ENTRY_V2, ids=lambda c: "-".join(map(str, c[:5])))
def test_walk_entry_level_with_a_level_2_beam(case):
    T_max, C, g, W, W2, seqlens = case
    for scorer in ("lse", "bound"):
        cfg = per_token_config(block_size=C, topk=4, branching=g, beam=W, scorer=scorer, scale=0.25,
                               beam_leaf=W2)
        q, k, v, sums, lens = make_cache(len(seqlens), T_max, 1, 2, 16, seqlens, C, g, seed=W2)
        assert_matches(run(q, k, v, sums, lens, cfg, num_splits=2), oracle(q, k, v, seqlens, cfg),
                       1e-4)


def test_beam_leaf_none_is_the_single_beam_kernel():
    """``beam_leaf=None`` and ``beam_leaf=beam`` give the single-beam kernel's constexprs (one
    register width) and bitwise the same outputs and selection, the oracle's."""
    cfg = per_token_config(block_size=16, topk=5, branching=2, beam=3, scale=0.25)
    assert beam_widths(cfg, 32) == (3, 4, 3, 4)
    same = dataclasses.replace(cfg, beam_leaf=3)
    assert beam_widths(same, 32) == beam_widths(cfg, 32)
    assert beam_widths(dataclasses.replace(cfg, beam_leaf=40), 64) == (3, 4, 40, 16)
    seqlens = [333, 160]
    q, k, v, sums, lens = make_cache(2, 336, 1, 2, 16, seqlens, 16, 2, seed=4)
    got = run(q, k, v, sums, lens, cfg, num_splits=2)
    assert_matches(got, oracle(q, k, v, seqlens, cfg), 1e-4)
    for x, y in zip(got, run(q, k, v, sums, lens, same, num_splits=2)):
        assert torch.equal(x, y)


def test_bound_token_by_token_with_append():
    """The serving loop with bounds: ``append_kv`` keeps sums and bounds, decode ranks by them."""
    B, T_max, HKV, G, D, C, g = 2, 160, 1, 2, 16, 16, 2
    cfg = per_token_config(block_size=C, topk=4, branching=g, beam=1, scorer="bound", scale=0.25,
                           beam_leaf=2)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(B, T_max, HKV, D, generator=gen)
    v = torch.randn(B, T_max, HKV, D, generator=gen)
    k_cache = torch.full_like(k, float("nan"))
    v_cache = torch.full_like(v, float("nan"))
    sums = torch.zeros(B, level_offsets(T_max, C, g)[-1], HKV, D)
    mins, maxs = empty_bounds(sums)
    lens = torch.zeros(B, dtype=torch.int32)
    for b, n in enumerate((120, 141)):
        append_kv(k_cache[b:b + 1], v_cache[b:b + 1], sums[b:b + 1], k[b:b + 1, :n],
                  v[b:b + 1, :n], lens[b:b + 1], C, g, mins[b:b + 1], maxs[b:b + 1])
        lens[b] = n
    for step in range(3):
        pos = lens.long()
        append_kv(k_cache, v_cache, sums, k[torch.arange(B), pos][:, None],
                  v[torch.arange(B), pos][:, None], lens, C, g, mins, maxs)
        lens += 1
        q = torch.randn(B, 1, HKV * G, D, generator=gen)
        want = oracle(q, k, v, lens.tolist(), cfg)
        assert_matches(run(q, k_cache, v_cache, sums, lens, cfg, num_splits=2, mins=mins,
                           maxs=maxs), want, 1e-4)


def test_rejects_what_the_v2_kernel_cannot_run():
    cfg = per_token_config(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    q, k, v, sums, lens = make_cache(1, 64, 1, 2, 16, [40], 16, 2)
    mins, maxs = bounds_from_keys(k, lens, 16, 2)
    bound = dataclasses.replace(cfg, scorer="bound")
    with pytest.raises(ValueError, match="key bounds"):
        decode_triton(q, k, v, sums, lens, bound)
    with pytest.raises(ValueError, match="strides of sums"):
        decode_triton(q, k, v, sums, lens, bound, mins=mins[:, :-1], maxs=maxs[:, :-1])
    with pytest.raises(ValueError, match="beam_leaf >= 1"):
        decode_triton(q, k, v, sums, lens, dataclasses.replace(cfg, beam_leaf=0))
    wide = dataclasses.replace(cfg, beam=128, beam_leaf=512)
    with pytest.raises(ValueError, match="beam_leaf=512 is too wide"):
        beam_widths(wide, 4096)
    with pytest.raises(ValueError, match="beam=300 is too wide"):
        beam_widths(dataclasses.replace(cfg, beam=300), 4096)


# ------------------------------------------------------------------------------------------------
# GPU: bf16 at real sizes
# ------------------------------------------------------------------------------------------------
BF16 = torch.bfloat16


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(INTERPRET, reason="needs CUDA")(test))


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _qkv(B, T, HKV, G, D, seed, dtype=BF16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, T, h, D, device="cuda", dtype=dtype, generator=gen)
            for h in (HKV * G, HKV, HKV)]


def _gpu_cache(k, v, seqlens, T_max, cfg: SelectConfig):
    """An empty cache of ``T_max`` slots per sequence, filled with each sequence's first
    ``seqlens[b]`` keys through ``append_kv`` (one sequence at a time: the lengths differ)."""
    B, _, H, D = k.shape
    k_cache = torch.zeros(B, T_max, H, D, device="cuda", dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    sums = torch.zeros(B, level_offsets(T_max, cfg.block_size, cfg.branching)[-1], H, D,
                       device="cuda", dtype=torch.float32)
    zero = torch.zeros(1, device="cuda", dtype=torch.int32)
    for b, s in enumerate(seqlens):
        append_kv(k_cache[b:b + 1], v_cache[b:b + 1], sums[b:b + 1], k[b:b + 1, :s],
                  v[b:b + 1, :s], zero, cfg.block_size, cfg.branching)
    return k_cache, v_cache, sums, torch.tensor(seqlens, device="cuda", dtype=torch.int32)


def _reference(q, k, v, seqlens, idx, cfg: SelectConfig):
    """Per sequence, fp32: the torch backend's selection of the last position over its keys, and
    the attention over the decode's own selection ``idx [B, 1, HKV, S]``."""
    sel, outs, lses = [], [], []
    for b, s in enumerate(seqlens):
        qb, kb, vb = q[b:b + 1].float(), k[b:b + 1, :s].float(), v[b:b + 1, :s].float()
        sel.append(select(qb, kb, cfg=cfg, backend="torch")[0])
        o, lse = sparse_attn(qb, kb, vb, idx[b:b + 1], cfg=cfg, backend="torch")
        outs.append(o)
        lses.append(lse)
    return torch.cat(sel), torch.cat(outs), torch.cat(lses)


def replay_matches_eager(step, state0, inputs):
    """Run ``step(state, *x)`` eagerly over ``inputs`` from a copy of ``state0``, then captured in
    a CUDA graph (warmed up on a side stream) and replayed over the same inputs: every replay's
    ``(o, lse)`` must equal the eager step's. Returns the replayed and the eager final states."""
    eager_state = [x.clone() for x in state0]
    eager = [step(eager_state, *x) for x in inputs]  # also compiles the kernels
    warm = [x.clone() for x in state0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(warm, *inputs[0])
    torch.cuda.current_stream().wait_stream(side)
    state = [x.clone() for x in state0]
    static = [torch.empty_like(x) for x in inputs[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(state, *static)
    for x, (o_want, lse_want) in zip(inputs, eager):
        for dst, src in zip(static, x):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], o_want) and torch.equal(out[1], lse_want)
    return state, eager_state


@gpu
@pytest.mark.parametrize("T_max,splits,g,dtype", [
    (4096, None, 2, BF16), (4096, 1, 4, BF16), (32768, None, 2, BF16), (32768, 1, 2, BF16),
    (4096, 3, 2, torch.float16), (4096, None, 2, torch.float32)])
def test_gpu_decode_matches_fp32_reference(T_max, splits, g, dtype):
    """Batch 3, mixed lengths (a full cache, 3/4 of it, a short one): the selection equals the
    fp32 torch selection up to near-ties, the output the fp32 attention over it."""
    B, HKV, G, D = 3, 4, 8, 128
    cfg = per_token_config(block_size=64, topk=16, branching=g, beam=16, scale=D ** -0.5)
    seqlens = [T_max, T_max * 3 // 4 + 5, 777]
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=T_max, dtype=dtype)  # G = 0: keys and values only
    q = _qkv(B, 1, HKV, G, D, seed=T_max + 1, dtype=dtype)[0]
    k_cache, v_cache, sums, lens = _gpu_cache(k, v, seqlens, T_max, cfg)
    o, lse, idx = decode_triton(q, k_cache, v_cache, sums, lens, cfg, num_splits=splits,
                                return_block_idx=True)
    ref_idx, ref_o, ref_lse = _reference(q, k, v, seqlens, idx, cfg)
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same >= 0.9, f"(sequence, KV head) rows selected as by fp32 torch: {same:.3f}"
    assert _rel(o, ref_o) < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-2)


@gpu
def test_gpu_tuning_knobs_keep_results():
    """``num_stages`` only changes when tiles are loaded, not the arithmetic: bitwise the default's
    outputs and selection. ``num_warps=4`` changes tile layouts (reduction orders): the same
    selection up to near-ties, and where it is the same, the same output to bf16 accuracy. 64K
    cache: several walk levels skipped and several ranked."""
    B, HKV, G, D, T_max = 3, 4, 16, 128, 65536
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=5)
    q = _qkv(B, 1, HKV, G, D, seed=6)[0]
    k_cache, v_cache, sums, lens = _gpu_cache(k, v, [T_max, 40000, 777], T_max, cfg)

    def run(**kw):
        return decode_triton(q, k_cache, v_cache, sums, lens, cfg, num_splits=4,
                             return_block_idx=True, **kw)
    o, lse, idx = run()
    for stages in (1, 2, 4):
        o_s, lse_s, idx_s = run(num_stages=stages)
        assert torch.equal(idx_s, idx) and torch.equal(o_s, o) and torch.equal(lse_s, lse), stages
    o_w, lse_w, idx_w = run(num_warps=4)
    same = (idx_w == idx).all(-1)  # [B, 1, HKV]
    assert same.float().mean().item() >= 0.9
    heads = same.repeat_interleave(G, dim=2)  # [B, 1, HQ]: the heads of those KV heads
    assert _rel(o_w[heads], o[heads]) < 1e-2
    torch.testing.assert_close(lse_w[heads[:, 0]], lse[heads[:, 0]], rtol=0, atol=2e-2)


@gpu
def test_gpu_token_by_token_decode_equals_prefill_rows():
    """Append and decode the last ``P`` tokens of each sequence one at a time; each step equals
    that row of prefill (Triton selection + sparse attention over the whole prefix). Selections
    may differ only on near-ties (append and prefill sum the pyramid in different orders): rows
    that differ are checked against attention over the decode's own selection instead."""
    B, HKV, G, D, P = 2, 2, 8, 128, 6
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    lengths = [8192, 5000]
    q, k, v = _qkv(B, 8192, HKV, G, D, seed=7)
    k_cache, v_cache, sums, lens = _gpu_cache(k, v, [n - P for n in lengths], 8192, cfg)
    prefill = []
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b:b + 1, n - P:n], k[b:b + 1, :n], v[b:b + 1, :n]
        idx, _ = select(qb, kb, cfg=cfg, backend="triton")
        prefill.append((idx, sparse_attn(qb, kb, vb, idx, cfg=cfg, backend="triton")[0]))
    n_same = 0
    for p in range(P):
        pos = lens.long()
        rows = torch.arange(B, device="cuda")
        append_kv(k_cache, v_cache, sums, k[rows, pos][:, None], v[rows, pos][:, None], lens,
                  cfg.block_size, cfg.branching)
        lens += 1
        o, _, idx = decode_triton(q[rows, pos][:, None], k_cache, v_cache, sums, lens, cfg,
                                  return_block_idx=True)
        for b, n in enumerate(lengths):
            want_idx, want_o = prefill[b][0][:, p:p + 1], prefill[b][1][:, p:p + 1]
            if torch.equal(idx[b:b + 1], want_idx):
                n_same += 1
                assert _rel(o[b:b + 1], want_o) < 1e-2, (p, b)
            else:
                qb = q[b:b + 1, n - P + p:n - P + p + 1].float()
                kb, vb = k[b:b + 1, :n - P + p + 1].float(), v[b:b + 1, :n - P + p + 1].float()
                ref, _ = sparse_attn(qb, kb, vb, idx[b:b + 1], cfg=cfg, backend="torch")
                assert _rel(o[b:b + 1], ref) < 1e-2, (p, b)
    assert n_same >= 0.9 * P * B, f"{n_same} of {P * B} decode rows selected as prefill did"


@gpu
def test_gpu_cuda_graph_replay_equals_eager():
    """append_kv + advance the lengths + decode_triton, captured once; two replays with new
    inputs give bitwise the outputs of the same two steps run eagerly from the same cache."""
    B, T_max, HKV, G, D = 4, 8192, 2, 8, 128
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    seqlens = [5000, 100, 8000, 64]
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=11)
    state0 = _gpu_cache(k, v, seqlens, T_max, cfg)
    inputs = [_qkv(B, 1, HKV, G, D, seed=20 + i) for i in range(2)]

    def step(state, q, k_new, v_new):
        k_cache, v_cache, sums, lens = state
        append_kv(k_cache, v_cache, sums, k_new, v_new, lens, cfg.block_size, cfg.branching)
        lens.add_(1)
        return decode_triton(q, k_cache, v_cache, sums, lens, cfg)

    state, eager_state = replay_matches_eager(step, state0, inputs)
    assert torch.equal(state[3], eager_state[3])


@gpu
@pytest.mark.parametrize("beam_leaf,scorer,splits", [(32, "lse", None), (8, "lse", 1),
                                                     (None, "bound", None), (32, "bound", 2)])
def test_gpu_v2_decode_matches_torch_backend(beam_leaf, scorer, splits):
    """bf16 at 32K (batch 3, mixed lengths) with ``beam_leaf`` and / or ``scorer="bound"``: the
    selection equals the fp32 torch backend's (prefill selection of the last row) up to
    near-ties, the output the fp32 attention over the Triton kernel's own selection, and the
    torch backend's decode step of the same cache (fp32) for nearly every head."""
    B, HKV, G, D, T_max = 3, 4, 8, 128, 32768
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scorer=scorer,
                           scale=D ** -0.5, beam_leaf=beam_leaf)
    seqlens = [T_max, T_max * 3 // 4 + 5, 777]
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=31)
    q = _qkv(B, 1, HKV, G, D, seed=32)[0]
    k_cache, v_cache, sums, lens = _gpu_cache(k, v, seqlens, T_max, cfg)
    mins, maxs = bounds_from_keys(k_cache, lens, cfg.block_size, cfg.branching)
    o, lse, idx = decode_triton(q, k_cache, v_cache, sums, lens, cfg, mins=mins, maxs=maxs,
                                num_splits=splits, return_block_idx=True)
    f32 = [x.float() for x in (q, k_cache, v_cache)]
    want_o, _ = decode_torch(f32[0], f32[1], f32[2], sums, lens, cfg, mins=mins, maxs=maxs)
    ref_idx, ref_o, ref_lse = _reference(q, k, v, seqlens, idx, cfg)
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same >= 0.9, f"(sequence, KV head) rows selected as by fp32 torch: {same:.3f}"
    assert _rel(o, ref_o) < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-2)
    head_err = (o.float() - want_o).norm(dim=-1) / want_o.norm(dim=-1)  # [B, 1, HQ]
    close = (head_err < 2e-2).float().mean().item()
    assert close >= 0.9, f"heads as the torch decode step's: {close:.3f}"


@gpu
def test_gpu_append_with_bounds_is_captured_by_a_cuda_graph():
    """append_kv with the key bounds + decode_triton with scorer="bound" and beam_leaf, captured
    once: replays equal the same steps run eagerly."""
    B, T_max, HKV, G, D = 2, 8192, 2, 8, 128
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=8, scorer="bound",
                           scale=D ** -0.5, beam_leaf=32)
    seqlens = [5000, 8000]
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=41)
    k_cache, v_cache, sums, lens = _gpu_cache(k, v, seqlens, T_max, cfg)
    mins, maxs = bounds_from_keys(k_cache, lens, cfg.block_size, cfg.branching)
    state0 = [k_cache, v_cache, sums, lens, mins, maxs]
    inputs = [_qkv(B, 1, HKV, G, D, seed=50 + i) for i in range(2)]

    def step(state, q, k_new, v_new):
        kc, vc, s, n, lo, hi = state
        append_kv(kc, vc, s, k_new, v_new, n, cfg.block_size, cfg.branching, lo, hi)
        n.add_(1)
        return decode_triton(q, kc, vc, s, n, cfg, mins=lo, maxs=hi)

    state, eager_state = replay_matches_eager(step, state0, inputs)
    for a, b in zip(state, eager_state):
        assert torch.equal(a, b)
