"""``launch=``, the public launch knobs of the Triton launchers (``pisa.ops.utils.launch``): a
setting reaches its kernels and changes how the work is cut, not the result (the tuning scripts
sweep them through these keywords)."""
from dataclasses import replace

import pytest
import torch

from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.utils.launch import AttnLaunch, FlatSelectLaunch, SelectLaunch
from tests.ops.attn.common import make_qkv, random_selection
from tests.ops.conftest import per_token_config
from tests.ops.select.common import assert_same, inputs

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1 without CUDA

import pisa.ops.attn.triton as attn_triton  # noqa: E402
from pisa.ops.select.flat import select_flat_triton  # noqa: E402
from pisa.ops.select.triton import select_pyramid_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_attn_launch_reaches_the_kernels_and_keeps_the_result(monkeypatch):
    """Tile forward and backward at 16-row programs and 2-warp dK/dV steps instead of the
    defaults: the plans see the given rows, the outputs and gradients match the defaults'."""
    T, HQ, HKV, D, C, Qt = 48, 2, 1, 16, 16, 8
    q, k, v = (x.detach() for x in make_qkv(1, T, T, HQ, HKV, D, torch.float32, device=DEVICE))
    idx = random_selection(1, T, T, HKV, C, 3, device=DEVICE, query_tile=Qt)
    do = torch.randn_like(q)
    plans = []
    tile_part = attn_triton._tile_part
    monkeypatch.setattr(attn_triton, "_tile_part",
                        lambda *a: plans.append(a[2]) or tile_part(*a))

    def run(launch):
        o, lse = attn_triton.attn_fwd_triton(q, k, v, idx, C, D ** -0.5, Qt, launch=launch)
        grads = attn_triton.attn_bwd_triton(do, None, q, k, v, o, lse, idx, C, D ** -0.5, False,
                                            Qt, launch=launch)
        return (o, lse) + grads

    want = run(None)
    assert plans == [AttnLaunch().tile_fwd_rows, AttnLaunch().tile_dq_rows]
    plans.clear()
    got = run(AttnLaunch(tile_fwd_rows=16, tile_dq_rows=16, tile_min_rows=16, tile_dkv_rows=16,
                         tile_dkv_warps=2, dkv_chunk=8))
    assert plans == [16, 16]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_select_launches_keep_the_selection():
    """The pyramid walk with 3-token leaf chunks and 2-warp programs, the flat scan with 2 tiles
    of 32 rows a program: the selections of the defaults."""
    T, HKV, G, D, C = 96, 1, 2, 16, 8
    q, k = (x.to(DEVICE) for x in inputs(1, T, T, HKV, G, D, seed=1))
    cfg = per_token_config(block_size=C, topk=4, branching=2, beam=2, scale=D ** -0.5, query_tile=4,
                       tile_reduce="lse")
    pyramid = build_pyramid_torch(k, C, 2)
    assert_same(select_pyramid_triton(q, k, cfg, pyramid,
                                      launch=replace(SelectLaunch(), leaf_chunk=3, walk_warps=2)),
                select_pyramid_triton(q, k, cfg, pyramid), "pyramid")
    flat = replace(cfg, selector="flat_lse")
    assert_same(select_flat_triton(q, k, flat, None, "lse",
                                   launch=FlatSelectLaunch(rows=32, max_tiles=2, warps=4)),
                select_flat_triton(q, k, flat, None, "lse"), "flat")
