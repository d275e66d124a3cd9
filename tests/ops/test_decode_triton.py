"""Fused Triton decode kernel (``pisa/ops/decode_triton.py``) against the fp64 oracle.

Without CUDA the kernel runs in the Triton interpreter on tiny fp32/fp16 shapes. The oracle of a
decode step is the last row of prefill: ``naive_select`` + ``naive_attn`` over each sequence's first
``cache_seqlens[b]`` keys, with the query as the last token. Outputs start as NaN
(``PISA_TRITON_POISON``), partials included, so a match proves every element was written. The
bf16 GPU checks live in ``tests/test_gpu_decode.py``.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1 without CUDA

from pisa.ops.decode_triton import decode_triton  # noqa: E402
from pisa.ops.kvcache import append_kv  # noqa: E402
from pisa.ops.naive import naive_attn, naive_dense_attn, naive_select  # noqa: E402
from pisa.ops.pyramid import level_offsets  # noqa: E402
from pisa.ops.utils import SelectConfig, cdiv  # noqa: E402
from test_select_triton import _interpreter_patched  # noqa: E402  (same folder)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True, scope="module")
def _fast_interpreter():
    """The interpreter speed-ups of ``test_select_triton`` (numpy sort / topk, one language patch
    per launch), and one torch thread for the oracle's tiny fp64 products."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield from _interpreter_patched()
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("PISA_TRITON_POISON", "1")


def pyramid_sums(k: torch.Tensor, seqlens: list[int], C: int, g: int) -> torch.Tensor:
    """The cache's pyramid sums (geometry of ``T_max = k.shape[1]``) of each sequence's first
    ``seqlens[b]`` keys, summed in fp64: leaves, then each level from the one below."""
    B, T, H, D = k.shape
    real = torch.arange(T)[None, :] < torch.tensor(seqlens)[:, None]
    x = torch.where(real[:, :, None, None], k.double(), 0.0)
    n = cdiv(T, C)
    x = F.pad(x, (0, 0, 0, 0, 0, n * C - T)).view(B, n, C, H, D).sum(2)
    levels = [x]
    while x.shape[1] > 1:
        n = cdiv(x.shape[1], g)
        x = F.pad(x, (0, 0, 0, 0, 0, n * g - x.shape[1])).view(B, n, g, H, D).sum(2)
        levels.append(x)
    sums = torch.cat(levels, 1).float()
    assert sums.shape[1] == level_offsets(T, C, g)[-1]
    return sums


def make_cache(B, T_max, HKV, G, D, seqlens, C, g, dtype=torch.float32, seed=0):
    """Random ``q [B, 1, HQ, D]`` and a full random cache (keys past a sequence's length are
    garbage the kernel must ignore), with the sums of each sequence's real keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, HKV * G, D, generator=gen).to(dtype)
    k = torch.randn(B, T_max, HKV, D, generator=gen).to(dtype)
    v = torch.randn(B, T_max, HKV, D, generator=gen).to(dtype)
    return q, k, v, pyramid_sums(k, seqlens, C, g), torch.tensor(seqlens, dtype=torch.int32)


def oracle(q, k, v, seqlens, cfg: SelectConfig):
    """fp64 ``o [B, 1, HQ, D]``, ``lse [B, HQ, 1]`` and ``block_idx [B, 1, HKV, slots]`` of
    prefill's last row over each sequence's keys (an empty sequence: ``o = 0``, ``lse = -inf``,
    sink only)."""
    B, _, HQ, D = q.shape
    HKV = k.shape[2]
    o = torch.zeros(B, 1, HQ, D, dtype=torch.float64)
    lse = torch.full((B, HQ, 1), -math.inf, dtype=torch.float64)
    idx = torch.full((B, 1, HKV, cfg.slots), -1, dtype=torch.int32)
    idx[..., 0] = 0
    for b, s in enumerate(seqlens):
        if s == 0:
            continue
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :s], v[b:b + 1, :s]
        idx[b:b + 1], _ = naive_select(qb, kb, cfg)
        o[b:b + 1], lse[b:b + 1] = naive_attn(qb, kb, vb, idx[b:b + 1], cfg.block_size, cfg.scale)
    return o, lse, idx


def run(q, k, v, sums, lens, cfg, **kw):
    o, lse, idx = decode_triton(*(x.to(DEVICE) for x in (q, k, v, sums, lens)), cfg,
                                return_block_idx=True, **kw)
    return o.cpu(), lse.cpu(), idx.cpu()


def assert_matches(got, want, rtol):
    (o, lse, idx), (wo, wlse, widx) = got, want
    bad = [tuple(x) for x in (idx != widx).any(-1).nonzero().tolist()]
    assert not bad, f"selection differs at (b, 0, h) {bad[0]}: got {idx[bad[0]].tolist()}, " \
                    f"want {widx[bad[0]].tolist()}"
    torch.testing.assert_close(o.double(), wo, rtol=rtol, atol=rtol)
    finite = torch.isfinite(wlse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], wlse[finite], rtol=rtol, atol=rtol)


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
    cfg = SelectConfig(block_size=C, topk=K, branching=g, beam=W, forced_in_budget=in_budget,
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
    cfg = SelectConfig(block_size=C, topk=4, branching=g, beam=W, scale=0.25)
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
    cfg = SelectConfig(block_size=C, topk=4, branching=g, beam=1, scale=0.25)
    q, k, v, _, lens = make_cache(1, T_max, 1, 2, 16, [s], C, g, seed=9)
    u = F.normalize(torch.randn(16, generator=torch.Generator().manual_seed(10)), dim=0)
    q[:] = 2 * u  # both query heads along u
    k[0, 4 * C:6 * C, 0] = -16 * u
    k[0, 4 * C + 5, 0] = 16 * u
    sums = pyramid_sums(k, [s], C, g)
    want = oracle(q, k, v, [s], cfg)
    assert 4 not in want[2].flatten().tolist()
    wide = SelectConfig(**{**cfg.__dict__, "beam": 2})
    assert 4 in naive_select(q, k[:, :s], wide)[0].flatten().tolist()
    assert_matches(run(q, k, v, sums, lens, cfg, num_splits=2), want, 1e-4)


def test_splits_agree_and_default():
    """Every split count (and the default) gives the oracle's result; more splits than list
    entries are capped."""
    cfg = SelectConfig(block_size=16, topk=5, branching=2, beam=3, scale=0.25)
    seqlens = [333, 160]
    q, k, v, sums, lens = make_cache(2, 336, 1, 2, 16, seqlens, 16, 2, seed=4)
    want = oracle(q, k, v, seqlens, cfg)
    for splits in (None, 2, 64):
        assert_matches(run(q, k, v, sums, lens, cfg, num_splits=splits), want, 1e-4)


def test_short_sequences_are_dense_causal():
    """A query in the first K blocks selects every causal block: dense causal attention."""
    C, K = 16, 6
    cfg = SelectConfig(block_size=C, topk=K, branching=2, beam=2, scale=0.25)
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
    cfg = SelectConfig(block_size=C, topk=4, branching=g, beam=2, scale=0.25)
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


def test_rejects_bad_arguments():
    cfg = SelectConfig(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    q, k, v, sums, lens = make_cache(1, 64, 1, 2, 16, [40], 16, 2)
    args = (q, k, v, sums, lens)
    bad_cfgs = {"scorer='lse'": {"scorer": "mean"}, "selector='pyramid'": {"selector": "flat_lse"},
                "branching": {"branching": 3}, "block_size": {"block_size": 8}}
    for match, change in bad_cfgs.items():
        bad = SelectConfig(**{**cfg.__dict__, **change})
        with pytest.raises(ValueError, match=match):
            decode_triton(q, k, v, pyramid_sums(k, [40], bad.block_size, bad.branching), lens, bad)
    with pytest.raises(ValueError, match="num_splits"):
        decode_triton(*args, cfg, num_splits=0)
    with pytest.raises(ValueError, match="num_warps"):
        decode_triton(*args, cfg, num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        decode_triton(*args, cfg, num_stages=0)
    with pytest.raises(ValueError, match="beam >= 1"):
        decode_triton(*args, SelectConfig(**{**cfg.__dict__, "beam": 0}))
    with pytest.raises(ValueError, match="query heads per KV head"):
        decode_triton(q.repeat(1, 1, 33, 1)[:, :, :65], k, v, sums, lens, cfg)
    with pytest.raises(ValueError, match=r"q must have shape \[B=1, 1"):
        decode_triton(q.expand(1, 2, 2, 16), k, v, sums, lens, cfg)
    with pytest.raises(ValueError, match="sums must be"):
        decode_triton(q, k, v, sums[:, :-1], lens, cfg)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        decode_triton(q, k, v, sums, lens.long(), cfg)
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        decode_triton(q.double(), k.double(), v.double(), sums.double(), lens, cfg)
    q48, k48, v48, s48, _ = make_cache(1, 64, 1, 2, 48, [40], 16, 2)
    with pytest.raises(ValueError, match="head dims"):
        decode_triton(q48, k48, v48, s48, lens, cfg)
