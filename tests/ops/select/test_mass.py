"""Selection v3's ``tile_reduce="mass"`` (``docs/selection_v3.md``): the walk ranks by the tile's
mean query, the leaf stage by the summed per-row softmax share of each candidate, in the fp64
oracle, the torch backend and the Triton kernels (interpreter on the CPU, bf16 on a GPU)."""
from __future__ import annotations

import math

import pytest
import torch

from pisa import pisa_attn, pisa_select
from pisa.ops.select import select, tiles_to_tokens
from pisa.ops.select.naive import naive_select
from pisa.ops.select.torch_backend import select_torch
from pisa.ops.utils.config import MASS_ROWS, mass_row_tokens, mass_tokens
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.select.common import assert_same, inputs, rows_equal

DEVICE = "cpu" if INTERPRET else "cuda"


def _cfg(C, K, W, W2, Qt, D, scorer="bound", fib=True, g=2):
    return per_token_config(C, K, g, W, scorer, "pyramid", fib, D ** -0.5, Qt, W2, "mass")


@pytest.mark.parametrize("n_real,qt,group", [(16, 16, 16), (16, 16, 3), (5, 16, 16), (16, 16, 7),
                                             (3, 4, 1), (1, 16, 64), (16, 16, 128), (9, 16, 8)])
def test_mass_tokens_spread_over_the_real_tokens(n_real, qt, group):
    """Distinct offsets in ``[0, n_real)``, from the first, as many as ``MASS_ROWS`` rows of
    ``next_pow2(group)`` heads allow (at least one, at most the tile's real tokens)."""
    got = mass_tokens(n_real, qt, group)
    want_n = min(n_real, qt, max(1, MASS_ROWS // (1 << (group - 1).bit_length())))
    assert len(got) == want_n == min(n_real, mass_row_tokens(qt, group))
    assert got[0] == 0 and got == sorted(set(got)) and got[-1] < n_real


def test_oracle_ranks_by_the_summed_row_shares():
    """Beams covering every leaf (no pruning): each tile keeps the forced blocks and the free
    blocks whose softmax shares, summed over its mass rows, are largest — computed here from the
    dense scores, independently of the oracle's code."""
    torch.manual_seed(0)
    C, K, Qt, G, D, T = 8, 5, 4, 4, 16, 96
    q, k = torch.randn(1, T, G, D, dtype=torch.float64), torch.randn(1, T, 1, D,
                                                                      dtype=torch.float64)
    cfg = _cfg(C, K, 64, 64, Qt, D)
    idx, cnt = naive_select(q, k, cfg)
    z = torch.einsum("thd,sd->ths", q[0], k[0, :, 0]) * D ** -0.5      # [T, G, T]
    blse = torch.logsumexp(z.view(T, G, T // C, C), -1)               # [T, G, N]
    for j in range(T // Qt):
        cur = j * Qt // C
        free = list(range(1, cur - 1))
        forced = sorted({0, max(cur - 1, 0), cur})
        want = forced
        if free:
            rows = blse[[j * Qt + o for o in mass_tokens(Qt, Qt, G)]][:, :, free]
            share = torch.exp(rows - torch.logsumexp(rows, -1, keepdim=True)).sum((0, 1))
            best = sorted(range(len(free)), key=lambda i: (-float(share[i]), free[i]))
            want = sorted(forced + [free[i] for i in best[:K - len(forced)]])
        assert idx[0, j, 0, :cnt[0, j, 0]].tolist() == want, j


CASES = [  # Qt, Tq, Tk, HKV, G, D, C, W, W2, K, scorer, forced_in_budget
    (16, 333, 333, 2, 4, 16, 16, 2, 4, 5, "bound", True),
    (16, 250, 517, 1, 7, 16, 16, 3, 3, 6, "lse", True),
    (4, 101, 299, 1, 16, 16, 8, 3, 5, 6, "bound", False),
    (8, 150, 211, 2, 3, 32, 8, 2, 4, 5, "lse", True),
    (1, 40, 150, 2, 4, 16, 8, 2, 5, 6, "bound", True),
    (16, 700, 777, 1, 64, 16, 16, 2, 3, 5, "bound", True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_torch_mass_equals_the_oracle(case, rng):
    """Partial first / last tiles, ``Tq < Tk``, GQA 1-64 (7 included), both leaf-LSE scorers."""
    Qt, Tq, Tk, HKV, G, D, C, W, W2, K, scorer, fib = case
    q, k = inputs(1, Tk, Tq, HKV, G, D, torch.float64, seed=rng)
    cfg = _cfg(C, K, W, W2, Qt, D, scorer, fib)
    assert_same(select_torch(q, k, cfg), naive_select(q, k, cfg), f"seed {rng}")


@pytest.mark.usefixtures("fast_interpreter", "poison_empty")
@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: "-".join(map(str, c)))
def test_triton_mass_equals_the_oracle(case):
    pytest.importorskip("triton")
    Qt, Tq, Tk, HKV, G, D, C, W, W2, K, scorer, fib = case
    q, k = inputs(1, Tk, Tq, HKV, G, D, torch.float32, seed=Tk + Qt + G)
    cfg = _cfg(C, K, W, W2, Qt, D, scorer, fib)
    got = select(q.to(DEVICE), k.to(DEVICE), cfg=cfg, backend="triton")
    assert_same(got, naive_select(q, k, cfg), f"mass {case}")


def test_mass_differs_from_qmean_and_attends_what_it_selects():
    """The leaf ranking changes rows (the walk is qmean's), and ``pisa_attn`` with the knob equals
    attention over the selection it makes."""
    torch.manual_seed(1)
    q, k = inputs(1, 640, 640, 2, 4, 16, torch.float32, seed=3)
    v = torch.randn_like(k)
    kn = dict(block_size=16, topk=5, beam=3, beam_leaf=4, query_tile=16, backend="torch")
    mass = pisa_select(q, k, tile_reduce="mass", **kn)
    qmean = pisa_select(q, k, tile_reduce="qmean", **kn)
    assert rows_equal(mass, qmean) < 0.9
    out = pisa_attn(q, k, v, tile_reduce="mass", **kn)
    ref = pisa_attn(q, k, v, block_idx=mass[0], block_size=16, query_tile=16, backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_mass_with_every_block_in_budget_is_dense_attention():
    torch.manual_seed(2)
    q, k = inputs(1, 256, 256, 1, 4, 16, torch.float64, seed=5)
    v = torch.randn_like(k)
    out = pisa_attn(q, k, v, block_size=16, topk=16, query_tile=16, tile_reduce="mass",
                    backend="torch")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(4, 1),
        v.transpose(1, 2).repeat_interleave(4, 1), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("knobs,needle", [(dict(scorer="mean"), "tile_reduce='mass'"),
                                          (dict(selector="flat_lse"), "selector='pyramid'")])
def test_mass_needs_the_pyramid_and_an_exact_leaf_score(knobs, needle):
    q, k = inputs(1, 128, 128, 1, 2, 16)
    with pytest.raises(ValueError, match=needle):
        pisa_select(q, k, block_size=16, topk=4, tile_reduce="mass", **knobs)


def test_auto_selector_keeps_the_walk_for_mass():
    """``selector="auto"`` below the crossover is the flat scan, which has no candidates to rank
    by mass: with ``tile_reduce="mass"`` it walks (the oracle's pyramid selection)."""
    q, k = inputs(1, 300, 300, 1, 4, 16, torch.float64, seed=7)
    kn = dict(block_size=16, topk=5, beam=2, beam_leaf=3, query_tile=16, tile_reduce="mass")
    auto = pisa_select(q, k, selector="auto", backend="torch", **kn)
    assert_same(auto, pisa_select(q, k, selector="pyramid", backend="naive", **kn))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("HQ,HKV,T", [(64, 4, 20000), (32, 8, 16384), (28, 4, 9999), (14, 2, 8192)])
def test_triton_mass_bf16_matches_torch_at_model_shapes(HQ, HKV, T):
    """bf16 at model shapes (GQA 16, 4, 7): the kernels' rows equal the torch backend's on fp32
    copies of the same bf16 inputs but for near-ties (>= 99% of rows)."""
    q, k = inputs(1, T, T, HKV, HQ // HKV, 128, torch.bfloat16, seed=T)
    kn = dict(block_size=64, topk=16, query_tile=16, tile_reduce="mass")
    got = pisa_select(q.cuda(), k.cuda(), backend="triton", **kn)
    want = pisa_select(q.float().cuda(), k.float().cuda(), backend="torch", **kn)
    assert rows_equal(got, want) >= 0.99
