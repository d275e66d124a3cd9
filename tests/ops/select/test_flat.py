"""``pisa.ops.select.flat`` (flat_lse / flat_mean scans) through the public dispatch
``pisa.ops.select.select(..., "triton")``, against the fp64 oracle ``naive_select``.

Interpreter on CPU (fp32 / fp16), bf16 at a real shape on a GPU; buffers start poisoned.
"""
from __future__ import annotations

import pytest
import torch

from pisa.ops.select import select
from pisa.ops.select.naive import naive_select
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.select.common import assert_same, inputs

pytest.importorskip("triton")

DEVICE = "cpu" if INTERPRET else "cuda"
# the interpreter's NumPy warns on log(0), the -inf of a tile reduction over no token
pytestmark = [pytest.mark.usefixtures("fast_interpreter", "poison_empty"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log")]

# (selector, forced_in_budget, G, Tk, Tq, C, D, topk, HKV, dtype)
FLAT_CASES = [
    (sel, in_budget, G, T, T, C, D, K, 2, torch.float32)
    for sel in ("flat_lse", "flat_mean")
    for (in_budget, G, T, C, D, K) in [
        (True, 4, 1, 4, 16, 6), (True, 1, 63, 4, 16, 6), (False, 4, 65, 8, 32, 5),
        (True, 4, 127, 4, 16, 8), (False, 1, 300, 4, 16, 20), (True, 2, 300, 16, 32, 4),
    ]
] + [
    # queries the tail of longer keys, several query tiles, GQA
    ("flat_lse", True, 2, 200, 37, 8, 16, 5, 2, torch.float32),
    ("flat_mean", True, 2, 200, 37, 8, 16, 5, 2, torch.float32),
    ("flat_lse", True, 4, 300, 37, 8, 32, 6, 1, torch.float16),
    ("flat_mean", False, 4, 300, 37, 8, 32, 6, 1, torch.float16),
]


@pytest.mark.parametrize("case", FLAT_CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_flat_select_matches_naive(case):
    selector, in_budget, G, Tk, Tq, C, D, K, HKV, dtype = case
    cfg = per_token_config(block_size=C, topk=K, selector=selector, forced_in_budget=in_budget,
                           scale=D ** -0.5)
    q, k = inputs(1, Tk, Tq, HKV, G, D, dtype, seed=Tk + K)
    got = select(q.to(DEVICE), k.to(DEVICE), cfg=cfg, backend="triton")
    assert_same(got, naive_select(q, k, cfg), f"{selector} {case}")


# (selector, query_tile, tile_reduce, G, Tk, Tq, C, D, topk, dtype): first and last tiles partial,
# 16 * 16 = 256 rows a tile (one tile a program), 16-bit mean queries (head + residual rows)
TILE_CASES = [
    ("flat_lse", 4, "lse", 4, 150, 150, 8, 16, 6, torch.float32),
    ("flat_mean", 8, "sum", 4, 211, 150, 8, 16, 6, torch.float32),
    ("flat_lse", 16, "sum", 16, 333, 100, 16, 16, 5, torch.float32),
    ("flat_lse", 16, "qmean", 16, 333, 100, 16, 16, 5, torch.float32),
    ("flat_mean", 4, "qmean", 4, 333, 100, 16, 16, 5, torch.float16),
    ("flat_lse", 4, "qmean", 4, 333, 100, 16, 32, 5, torch.float16),
    ("flat_mean", 2, "lse", 1, 63, 63, 4, 16, 5, torch.float32),
]


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_flat_tile_select_matches_naive(case):
    """Tiles of ``query_tile`` tokens share one flat selection: rows per tile, equal to the
    oracle's for every token reduction."""
    selector, Qt, reduce, G, Tk, Tq, C, D, K, dtype = case
    cfg = per_token_config(C, K, 2, K, "lse", selector, True, D ** -0.5, Qt, None, reduce)
    q, k = inputs(1, Tk, Tq, 2, G, D, dtype, seed=Tk + Qt)
    got = select(q.to(DEVICE), k.to(DEVICE), cfg=cfg, backend="triton")
    assert_same(got, naive_select(q, k, cfg), f"{case}")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("selector,in_budget", [("flat_lse", True), ("flat_mean", False)])
def test_gpu_flat_select_matches_naive(selector, in_budget):
    C, Tk, Tq, HKV, G, D = 64, 2000, 48, 2, 8, 128
    q, k = inputs(1, Tk, Tq, HKV, G, D, torch.bfloat16, seed=1)
    cfg = per_token_config(block_size=C, topk=8, beam=8, selector=selector,
                           forced_in_budget=in_budget, scale=D ** -0.5)
    got = select(q.cuda(), k.cuda(), cfg=cfg, backend="triton")
    assert_same(got, naive_select(q, k, cfg), f"gpu {selector}")
