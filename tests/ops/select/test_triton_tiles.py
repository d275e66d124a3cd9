"""Selection v2 in the Triton kernels (``docs/spec.md`` §11): query tiles (``query_tile``), the
level-wise beam (``beam_leaf``), the token reductions (``tile_reduce``: sum, lse, qmean) and the
bound scorer, through ``pisa.ops.select.select(..., "triton")``, against the fp64 oracle.

Without CUDA the kernels run in the Triton interpreter on tiny fp32 / fp16 shapes; every
``torch.empty`` buffer starts poisoned (``poison_empty``), the mean-query rows of ``qmean`` tiles
included. The GPU section runs bf16 at the training shapes against the torch backend in fp32.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.select import select
from pisa.ops.select.naive import naive_select
from pisa.ops.utils.config import n_query_tiles
from pisa.ops.utils.launch import SelectLaunch
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.select.common import assert_same, inputs, rows_equal

pytest.importorskip("triton")

import pisa.ops.select.triton as select_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# the interpreter's NumPy warns on log(0), the -inf of a tile reduction over no token
pytestmark = [pytest.mark.usefixtures("fast_interpreter", "poison_empty"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log")]
F16, F32 = torch.float16, torch.float32


def _triton(q, k, cfg, pyramid=None):
    return select(q.to(DEVICE), k.to(DEVICE), cfg=cfg, backend="triton", pyramid=pyramid)


def _cfg(C, K, g, W, W2=None, scorer="lse", Qt=1, reduce="sum", fib=True, D=16,
         selector="pyramid"):
    return per_token_config(C, K, g, W, scorer, selector, fib, D ** -0.5, Qt, W2, reduce)


# Qt, Tq, Tk, G, D, C, g, W, W2, K, scorer, reduce, forced_in_budget, HKV, dtype. Tq < Tk puts
# the first query inside a tile (a partial first tile), Tk not a multiple of Qt a partial last
# one; Qt * G = 256 rows (16, 16) run the walk in 4 chunks of rows and the leaf stage in 2.
CASES = [
    (2, 63, 63, 1, 16, 4, 2, 2, None, 5, "bound", "lse", True, 2, F32),
    (4, 127, 127, 4, 16, 8, 3, 2, 5, 5, "bound", "sum", True, 2, F32),
    (4, 101, 299, 16, 16, 8, 2, 3, 3, 6, "lse", "lse", True, 1, F32),
    (4, 90, 203, 4, 16, 8, 4, 2, 1, 5, "mean", "lse", True, 2, F32),
    (16, 333, 333, 4, 64, 16, 2, 2, 4, 5, "bound", "lse", True, 1, F32),
    (16, 250, 517, 1, 16, 16, 2, 3, 1, 6, "lse", "sum", False, 2, F32),
    (16, 250, 517, 16, 16, 16, 2, 3, 6, 6, "meanvar", "lse", True, 1, F32),
    (16, 250, 517, 16, 16, 16, 2, 3, 1, 6, "lse", "qmean", True, 1, F32),
    (2, 101, 300, 4, 64, 8, 2, 4, 2, 6, "meanvar", "sum", False, 1, F32),
    (4, 101, 300, 4, 64, 8, 2, 2, 4, 6, "lse", "qmean", True, 2, F32),
    (8, 101, 300, 4, 16, 8, 2, 2, 4, 6, "bound", "qmean", False, 2, F16),
    (4, 101, 300, 16, 16, 8, 2, 2, 4, 6, "mean", "qmean", True, 1, F16),
    (1, 40, 150, 4, 16, 8, 2, 2, 5, 6, "bound", "sum", True, 2, F32),
    (1, 40, 150, 4, 16, 8, 2, 3, 1, 6, "meanvar", "lse", True, 1, F16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:14])))
def test_tile_select_matches_naive(case):
    Qt, Tq, Tk, G, D, C, g, W, W2, K, scorer, reduce, fib, HKV, dtype = case
    cfg = _cfg(C, K, g, W, W2, scorer, Qt, reduce, fib, D)
    q, k = inputs(1, Tk, Tq, HKV, G, D, dtype, seed=Tk + Qt + G)
    got = _triton(q, k, cfg)
    assert got[0].shape == (1, n_query_tiles(Tq, Tk, Qt), HKV, cfg.slots)
    assert got[0].device.type == DEVICE
    assert_same(got, naive_select(q, k, cfg), f"tiles {case}")


def test_one_token_tiles_are_todays_selection():
    """``query_tile=1`` with ``beam_leaf=beam`` (or None) is the per-token selection: every token
    reduction and both spellings of the leaf beam give the same rows, the oracle's (the kernels'
    per-token path, unchanged: on these inputs its rows equal the kernels' before selection v2)."""
    Tk, Tq, C = 130, 20, 4
    q, k = inputs(1, Tk, Tq, 2, 4, 16, F32, seed=11)
    base = _cfg(C, 6, 2, 2)
    want = _triton(q, k, base)
    assert_same(want, naive_select(q, k, base), "per token")
    for cfg in (_cfg(C, 6, 2, 2, W2=2, reduce="lse"), _cfg(C, 6, 2, 2, W2=2, reduce="qmean")):
        assert_same(_triton(q, k, cfg), want, str(cfg))


def test_tile_leaf_chunks(monkeypatch):
    """Leaf-stage chunks of 3 tiles (``LEAF_CHUNK`` query rows a chunk: 1024 by default), whose
    groups straddle chunk borders, select the same; a deep pyramid (Tk = 1024, C = 4: nine
    levels) skips its top levels."""
    q, k = inputs(1, 1024, 70, 1, 4, 16, seed=8)
    cfg = _cfg(4, 5, 2, 2, W2=4, Qt=4, reduce="qmean")
    want = naive_select(q, k, cfg)
    assert_same(_triton(q, k, cfg), want, "deep pyramid")
    monkeypatch.setattr(select_triton, "_LAUNCH",
                        dataclasses.replace(select_triton._LAUNCH, leaf_chunk=3))
    assert_same(_triton(q, k, cfg), want, "3-tile leaf chunks")


@pytest.mark.parametrize("W,W2", [(1000, 1000), (2, 1000), (1000, 2)])
def test_wide_beams_with_tiles(W, W2):
    """Beams covering every block are the flat scan (the flat kernel, with tiles); a leaf beam
    that wide or a narrow one under a wide beam above runs the walk kernel."""
    q, k = inputs(1, 127, 63, 2, 4, 16, seed=W + W2)
    cfg = _cfg(4, 5, 2, W, W2, Qt=4, reduce="lse")
    assert_same(_triton(q, k, cfg), naive_select(q, k, cfg), f"W={W}, W2={W2}")


def test_bound_pyramid_prebuilt_or_rebuilt():
    """``scorer="bound"`` uses a caller's pyramid with bounds, and rebuilds one without (the
    decode cache's); a pyramid with bounds of the wrong shape is refused."""
    q, k = inputs(1, 150, 30, 2, 2, 16, seed=4)
    cfg = _cfg(8, 5, 2, 2, W2=3, scorer="bound", Qt=2)
    want = naive_select(q, k, cfg)
    kd = k.to(DEVICE)
    for bounds in (True, False):
        pyr = build_pyramid_torch(kd, 8, 2, bounds=bounds)
        assert_same(_triton(q, k, cfg, pyr), want, f"prebuilt, bounds={bounds}")
    pyr = build_pyramid_torch(kd, 8, 2, bounds=True)
    bad = type(pyr)(pyr.means, pyr.counts, pyr.offsets, pyr.mins[:, :-1], pyr.maxs)
    with pytest.raises(ValueError, match="pyramid.mins must be fp32"):
        _triton(q, k, cfg, bad)


# ------------------------------------------------------------------------------------------------
# GPU (bf16, the training shapes)
# ------------------------------------------------------------------------------------------------

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(INTERPRET, reason="needs CUDA")(test))


@gpu
@pytest.mark.parametrize("scorer,reduce,W2,selector", [
    ("lse", "qmean", None, "pyramid"), ("lse", "qmean", 32, "pyramid"),
    ("bound", "qmean", 32, "pyramid"), ("lse", "sum", None, "pyramid"),
    ("lse", "lse", 32, "pyramid"), ("meanvar", "qmean", None, "pyramid"),
    ("lse", "qmean", None, "flat_lse"), ("lse", "sum", None, "flat_mean")])
def test_gpu_tile_selection_matches_fp32_torch(scorer, reduce, W2, selector):
    """Config A (bf16, HQ=64, HKV=4, D=128, C=64, K=W=16) at 8K with 16-token tiles, against the
    torch backend on the same values in fp32. The kernels read the bf16 values exactly and score
    in fp32 (the fp32 summaries and mean queries to ~16 bits), so only near-ties at rounding
    level may differ."""
    T, HQ, HKV, D, Qt = 8192, 64, 4, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, T, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, T, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    cfg = per_token_config(64, 16, 2, 16, scorer, selector, True, D ** -0.5, Qt, W2, reduce)
    got = select(q, k, cfg=cfg, backend="triton")
    want = select(q.float(), k.float(), cfg=cfg, backend="torch")
    assert got[0].shape == want[0].shape == (1, T // Qt, HKV, 16)
    assert torch.equal(got[1], want[1]), "counts"
    same = rows_equal(got, want)
    assert same >= 0.99, f"{same:.4f} of the tile rows equal fp32 torch"


@gpu
def test_gpu_tile_lengths_compile_nothing(rng):
    """Lengths are runtime values in the tile selection kernels too: after one call per
    configuration, other lengths and query offsets compile no new variant."""
    from pisa.bench import triton_variants
    cfgs = [per_token_config(64, 16, 2, 16, s, "pyramid", True, 0.125, 16, W2, r)
            for s, W2, r in (("lse", 32, "qmean"), ("bound", None, "sum"))]
    cfgs.append(per_token_config(64, 16, 2, 16, "lse", "flat_lse", True, 0.125, 16, None, "qmean"))

    def call(Tq, Tk):
        q = torch.randn(2, Tq, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, Tk, 4, 128, device="cuda", dtype=torch.bfloat16)
        for cfg in cfgs:
            select(q, k, cfg=cfg, backend="triton")
        torch.cuda.synchronize()

    call(4096, 4096)
    n = triton_variants()
    for Tq, Tk in ((4160, 4160), (4500, 4500), (1001, 8193), (7777, 7777), (17, 9000)):
        call(Tq, Tk)
        assert triton_variants() == n, f"Tq={Tq}, Tk={Tk} compiled new variants"


@pytest.mark.parametrize("scorer", ["bound", "lse"])
def test_without_residuals_selections_stay_valid_and_close(scorer, poison_outputs):
    """``SelectLaunch(residuals=False)`` (16-bit summaries and mean queries, no residuals):
    every row is still a valid selection with the default's counts, and all but near-tied rows
    equal the default's (the knob only rounds the internal scores)."""
    from dataclasses import replace
    T, HKV, G, D, C = 300, 2, 4, 16, 8
    q, k = inputs(1, T, T, HKV, G, D, F16, seed=3)
    q, k = q.to(DEVICE), k.to(DEVICE)
    cfg = _cfg(C, 6, 2, 2, 4, scorer, 4, "qmean", D=D)
    pyramid = build_pyramid_torch(k.float(), C, 2, cfg.uses_bounds)
    n = n_query_tiles(T, T, 4)

    def run(launch):  # outputs poisoned: every element written
        idx, cnt = select_triton.select_pyramid_triton(q, k, cfg, pyramid, launch=launch)
        assert idx.shape == (1, n, HKV, cfg.slots)
        return idx, cnt

    want = run(SelectLaunch())
    got = run(replace(SelectLaunch(), residuals=False))
    assert torch.equal(got[1], want[1])
    idx = got[0].cpu()
    valid = idx >= 0
    assert (valid.sum(-1) == got[1].cpu()).all() and (idx[..., 1:][valid[..., 1:]]
                                                      > idx[..., :-1][valid[..., 1:]]).all()
    assert rows_equal(got, want) >= 0.9
