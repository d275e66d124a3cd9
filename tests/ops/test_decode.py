import math

import pytest
import torch

from pisa.ops.decode import decode_torch, prefill_with_cache
from pisa.ops.kvcache import append_kv
from pisa.ops.naive import naive_attn, naive_dense_attn, naive_select
from pisa.ops.pyramid import level_offsets
from pisa.ops.utils import SelectConfig, compute_dtype


def _cfg(C=8, K=5, g=2, W=2, scorer="lse", selector="pyramid", fib=True, D=16):
    return SelectConfig(C, K, g, W, scorer, selector, fib, D ** -0.5)


def _filled_cache(k, v, seqlens, T, C, g):
    """A cache of capacity ``T`` holding ``k, v [B, >= max(seqlens), H, D]`` up to each sequence's
    length; slots past the lengths hold NaN (never read)."""
    B, _, H, D = k.shape
    k_cache = torch.full((B, T, H, D), math.nan, dtype=k.dtype, device=k.device)
    v_cache = k_cache.clone()
    sums = torch.zeros(B, level_offsets(T, C, g)[-1], H, D, dtype=compute_dtype(k), device=k.device)
    lens = torch.zeros(B, dtype=torch.int32, device=k.device)
    for b, n in enumerate(seqlens):
        rows = slice(b, b + 1)
        append_kv(k_cache[rows], v_cache[rows], sums[rows], k[rows, :n], v[rows, :n], lens[rows],
                  C, g)
    lens.copy_(torch.tensor(seqlens))
    return k_cache, v_cache, sums, lens


def _oracle_rows(q, k, v, seqlens, cfg):
    """Naive selection + attention of the last ``q.shape[1]`` positions of each sequence."""
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]
        idx, _ = naive_select(qb, kb, cfg)
        o, lse = naive_attn(qb, kb, vb, idx, cfg.block_size, cfg.scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


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
    o, lse = decode_torch(q, *_filled_cache(k, v, seqlens, T, C, g), cfg)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, H * G, 1) and lse.dtype == torch.float32
    want_o, want_lse = _oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10, msg=f"seed {rng}")
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


def test_decode_in_the_first_k_blocks_is_dense_causal(rng):
    B, T, H, G, D, C, K = 4, 100, 2, 2, 16, 8, 5
    seqlens = [1, 9, 33, K * C]
    q = torch.randn(B, 1, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    o, _ = decode_torch(q, *_filled_cache(k, v, seqlens, T, C, 2), _cfg(C, K, D=D))
    for b, n in enumerate(seqlens):
        want, _ = naive_dense_attn(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], D ** -0.5)
        torch.testing.assert_close(o[b:b + 1], want, rtol=1e-12, atol=1e-12)


def test_decode_of_an_empty_sequence_is_zero(rng):
    q = torch.randn(2, 1, 2, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 40, 1, 16, dtype=torch.float64)
    o, lse = decode_torch(q, *_filled_cache(k, v, [0, 20], 40, 8, 2), _cfg())
    assert torch.equal(o[0], torch.zeros_like(o[0])) and bool((lse[0] == -math.inf).all())
    assert torch.isfinite(o[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_prefill_with_cache_equals_naive_oracle(backend, rng):
    B, T, H, G, D, L = 3, 250, 2, 2, 16, 12
    cfg = _cfg(D=D)
    q = torch.randn(B, L, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    for seqlens in ([L, 130, 250], [170] * B):  # one sequence at a time / all together
        cache = _filled_cache(k, v, seqlens, T, cfg.block_size, cfg.branching)
        o, lse = prefill_with_cache(q, *cache[:3], seqlens, cfg, backend)
        want_o, want_lse = _oracle_rows(q, k, v, seqlens, cfg)
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10, msg=f"seed {rng}")
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


def test_prefill_with_cache_triton_interpreter(rng):
    """The sums pyramid feeds the Triton selection (fp32; the interpreter on CPU, CUDA on a GPU)."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, H, G, D, L = 2, 200, 1, 2, 16, 3
    cfg = SelectConfig(16, 4, 2, 2, "lse", "pyramid", True, D ** -0.5)
    q = torch.randn(B, L, H * G, D)
    k, v = torch.randn(2, B, T, H, D)
    seqlens = [90, 200]  # 13 leaves, 5 levels: the walk prunes
    cache = _filled_cache(k.to(dev), v.to(dev), seqlens, T, cfg.block_size, cfg.branching)
    o, _ = prefill_with_cache(q.to(dev), *cache[:3], seqlens, cfg, "triton")
    want, _ = _oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o.cpu(), want.float(), rtol=2e-4, atol=2e-4, msg=f"seed {rng}")


def _decode_args():
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 40, 2, 16, dtype=torch.float64)
    return [q, *_filled_cache(k, v, [5, 30], 40, 8, 2), _cfg()]


BAD = [
    (0, torch.randn(2, 2, 4, 16, dtype=torch.float64), ValueError, r"\[B=2, 1, HQ, D=16\]"),
    (0, torch.randn(2, 1, 3, 16, dtype=torch.float64), ValueError, "multiple of HKV"),
    (0, torch.randn(2, 1, 4, 16), TypeError, "q must be torch.float64"),
    (3, torch.zeros(2, 3, 2, 16, dtype=torch.float64), ValueError, "sums must be"),
    (4, torch.zeros(2, dtype=torch.int64), ValueError, "cache_seqlens must be"),
    (5, _cfg(selector="auto"), ValueError, "must be resolved"),
]


@pytest.mark.parametrize("pos,value,exc,msg", BAD, ids=lambda x: str(x)[:30])
def test_decode_rejects_bad_input(pos, value, exc, msg):
    args = _decode_args()
    args[pos] = value
    with pytest.raises(exc, match=msg):
        decode_torch(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_torch_on_cuda_equals_naive_oracle(rng):
    B, T, H, G, D = 4, 500, 2, 4, 64
    seqlens = [1, 77, 300, 500]
    cfg = _cfg(16, 6, 2, 3, D=D)
    q = torch.randn(B, 1, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    cache = [x.cuda() for x in _filled_cache(k, v, seqlens, T, cfg.block_size, cfg.branching)]
    o, lse = decode_torch(q.cuda(), *cache, cfg)
    want_o, want_lse = _oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o.cpu(), want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.cpu(), want_lse.float(), rtol=1e-6, atol=1e-6)
