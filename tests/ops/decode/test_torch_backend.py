"""``pisa.ops.decode.torch_backend.decode_torch`` against the fp64 oracle (the last row of
prefill over each sequence's keys)."""
import math

import pytest
import torch

from pisa.ops.attn.naive import naive_dense_attn
from pisa.ops.decode.kvcache import empty_bounds, write_kv
from pisa.ops.decode.torch_backend import decode_torch
from tests.ops.conftest import per_token_config
from tests.ops.decode.common import filled_cache, oracle_rows


def _cfg(C=8, K=5, g=2, W=2, scorer="lse", selector="pyramid", fib=True, D=16):
    return per_token_config(C, K, g, W, scorer, selector, fib, D ** -0.5)


CASES = [  # G, C, g, W, K, scorer, selector, forced_in_budget
    (1, 8, 2, 2, 5, "lse", "pyramid", True),
    (4, 8, 2, 2, 5, "lse", "pyramid", True),
    (2, 4, 3, 3, 6, "meanvar", "pyramid", True),
    (4, 8, 4, 2, 4, "mean", "pyramid", False),
    (2, 8, 2, 2, 5, "lse", "flat_lse", True),
    (2, 8, 2, 2, 5, "lse", "flat_mean", False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_equals_naive_oracle_mixed_lengths(case, rng):
    G, C, g, W, K, scorer, selector, fib = case
    B, T, H, D = 6, 307, 2, 16
    seqlens = [1, K * C, K * C + 1] + torch.randint(K * C + 2, T + 1, (B - 3,)).tolist()
    q = torch.randn(B, 1, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    cfg = _cfg(C, K, g, W, scorer, selector, fib, D)
    o, lse = decode_torch(q, *filled_cache(k, v, seqlens, T, C, g), cfg)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, H * G, 1) and lse.dtype == torch.float32
    want_o, want_lse = oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10, msg=f"seed {rng}")
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


CASES_V2 = [  # G, C, g, W, beam_leaf, K, scorer, forced_in_budget
    (2, 8, 2, 2, 5, 5, "lse", True),
    (2, 8, 2, 4, 1, 5, "lse", True),
    (4, 8, 2, 2, None, 5, "bound", True),
    (2, 4, 3, 2, 7, 6, "bound", False),
    (2, 8, 4, 1, 3, 4, "bound", True),
]


@pytest.mark.parametrize("case", CASES_V2, ids=lambda c: "-".join(map(str, c)))
def test_decode_v2_knobs_equal_naive_oracle_mixed_lengths(case, rng):
    """``beam_leaf`` (through ``walk``'s ``beam_at``) and ``scorer="bound"`` (the cache's key
    bounds, built here by appends): each sequence's step equals the last row of the oracle's
    prefill over its keys (slots past a length hold NaN and never enter a bound)."""
    G, C, g, W, W2, K, scorer, fib = case
    B, T, H, D = 6, 307, 2, 16
    seqlens = [1, K * C, K * C + 1] + torch.randint(K * C + 2, T + 1, (B - 3,)).tolist()
    q = torch.randn(B, 1, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    cfg = per_token_config(C, K, g, W, scorer, "pyramid", fib, D ** -0.5, beam_leaf=W2)
    k_cache, v_cache, sums, lens = filled_cache(k, v, seqlens, T, C, g)
    mins, maxs = empty_bounds(sums)
    empty = torch.zeros_like(lens)
    for b, n in enumerate(seqlens):  # the bounds by appends, as the cache keeps them
        rows = slice(b, b + 1)
        write_kv(k_cache[rows].clone(), v_cache[rows].clone(), sums[rows].clone(), k[rows, :n],
                 v[rows, :n], empty[rows], C, g, mins[rows], maxs[rows])
    o, lse = decode_torch(q, k_cache, v_cache, sums, lens, cfg, mins=mins, maxs=maxs)
    want_o, want_lse = oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10, msg=f"seed {rng}")
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


def test_decode_in_the_first_k_blocks_is_dense_causal(rng):
    B, T, H, G, D, C, K = 4, 100, 2, 2, 16, 8, 5
    seqlens = [1, 9, 33, K * C]
    q = torch.randn(B, 1, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    o, _ = decode_torch(q, *filled_cache(k, v, seqlens, T, C, 2), _cfg(C, K, D=D))
    for b, n in enumerate(seqlens):
        want, _ = naive_dense_attn(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], D ** -0.5)
        torch.testing.assert_close(o[b:b + 1], want, rtol=1e-12, atol=1e-12)


def test_decode_of_an_empty_sequence_is_zero(rng):
    q = torch.randn(2, 1, 2, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 40, 1, 16, dtype=torch.float64)
    o, lse = decode_torch(q, *filled_cache(k, v, [0, 20], 40, 8, 2), _cfg())
    assert torch.equal(o[0], torch.zeros_like(o[0])) and bool((lse[0] == -math.inf).all())
    assert torch.isfinite(o[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_torch_on_cuda_equals_naive_oracle(rng):
    B, T, H, G, D = 4, 500, 2, 4, 64
    seqlens = [1, 77, 300, 500]
    cfg = _cfg(16, 6, 2, 3, D=D)
    q = torch.randn(B, 1, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    cache = [x.cuda() for x in filled_cache(k, v, seqlens, T, cfg.block_size, cfg.branching)]
    o, lse = decode_torch(q.cuda(), *cache, cfg)
    want_o, want_lse = oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o.cpu(), want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.cpu(), want_lse.float(), rtol=1e-6, atol=1e-6)
