"""``pisa.ops.select``: the custom op ``pisa::select`` and its dispatch (a prebuilt pyramid, the
naive backend, the Triton dtype check)."""
from __future__ import annotations

import pytest
import torch

from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.select import select
from pisa.ops.select.naive import naive_select
from pisa.ops.select.torch_backend import select_torch
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.select.common import assert_same, inputs

DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_empty")


@pytest.mark.parametrize("selector", ["pyramid", "flat_lse", "flat_mean"])
def test_naive_and_torch_backends_through_the_op(selector, rng):
    q, k = inputs(2, 90, 30, 2, 2, 16, torch.float64, seed=rng)
    cfg = per_token_config(block_size=8, topk=5, beam=2, selector=selector, scale=0.25)
    want = naive_select(q, k, cfg)
    assert_same(select(q, k, cfg=cfg, backend="naive"), want, "naive")
    assert_same(select(q, k, cfg=cfg, backend="torch"), want, "torch")
    assert_same(select_torch(q, k, cfg), want, "select_torch")


def test_torch_backend_takes_a_prebuilt_pyramid(rng):
    q, k = inputs(1, 120, 40, 2, 2, 16, torch.float64, seed=rng)
    cfg = per_token_config(block_size=8, topk=5, beam=2, scorer="meanvar", scale=0.25)
    assert_same(select(q, k, cfg=cfg, backend="torch", pyramid=build_pyramid_torch(k, 8, 2)),
                naive_select(q, k, cfg), "given pyramid")


def test_triton_takes_a_prebuilt_pyramid_for_every_selector():
    """A pyramid built once serves the walk and flat_mean; one of another geometry is refused."""
    pytest.importorskip("triton")
    from pisa.ops.pyramid.triton import build_pyramid_triton
    C, g = 4, 2
    q, k = inputs(1, 90, 9, 2, 2, 16, seed=5)
    q, k = q.to(DEVICE), k.to(DEVICE)
    pyramid = build_pyramid_triton(k, C, g)
    for selector in ("pyramid", "flat_mean", "flat_lse"):
        cfg = per_token_config(block_size=C, topk=6, branching=g, beam=3, selector=selector,
                               scale=0.25)
        assert_same(select(q, k, cfg=cfg, backend="triton", pyramid=pyramid),
                    naive_select(q.cpu(), k.cpu(), cfg), selector)
    wrong = build_pyramid_triton(k, C, 4)
    # the op rebuilds the offsets from the config: the means' row count tells the mismatch
    with pytest.raises(ValueError, match=r"pyramid.means must be fp32 \[1, 47, 2, 16\]"):
        select(q, k, cfg=per_token_config(block_size=C, topk=6, branching=g, scale=0.25),
               backend="triton", pyramid=wrong)
    as_fp64 = type(pyramid)(pyramid.means.double(), pyramid.counts, pyramid.offsets)
    with pytest.raises(ValueError, match="fp32"):
        select(q, k, cfg=per_token_config(block_size=C, topk=6, branching=g, scale=0.25),
               backend="triton", pyramid=as_fp64)


def test_triton_refuses_fp64():
    pytest.importorskip("triton")
    q, k = inputs(1, 16, 4, 1, 1, 16, torch.float64)
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        select(q.to(DEVICE), k.to(DEVICE), cfg=per_token_config(block_size=4, topk=4, scale=0.25),
               backend="triton")


def test_fake_kernel_gives_the_output_layout():
    """The op's fake (meta) kernel, which torch.compile traces, has the real outputs' layout."""
    q = torch.empty(2, 7, 4, 16, device="meta")
    k = torch.empty(2, 30, 2, 16, device="meta")
    for fib, slots in ((True, 5), (False, 8)):
        cfg = per_token_config(block_size=8, topk=5, forced_in_budget=fib, scale=0.25)
        with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
            idx, cnt = select(q, k, cfg=cfg, backend="torch")
        assert idx.shape == (2, 7, 2, slots) and idx.dtype == torch.int32
        assert cnt.shape == (2, 7, 2) and cnt.dtype == torch.int32
