"""``pisa.ops.pyramid.triton``: the one-pass Triton build against the torch build and the oracle.

Without CUDA the kernels run in the Triton interpreter; the GPU test runs bf16 at a real size.
"""
import pytest
import torch

from pisa.ops.pyramid.naive import naive_pyramid
from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from tests.ops.conftest import INTERPRET

pytest.importorskip("triton")

from pisa.ops.pyramid.triton import build_pyramid_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_empty")


def _keys(B, T, HKV, D, dtype=torch.float32, seed=0):
    return torch.randn(B, T, HKV, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 127, 300])
@pytest.mark.parametrize("C,g", [(4, 2), (8, 4), (4, 3), (16, 2)])
def test_pyramid_build_matches_torch(T, C, g):
    k = _keys(2, T, 3, 16, seed=T).to(DEVICE)
    got = build_pyramid_triton(k, C, g)
    want = build_pyramid_torch(k, C, g)
    assert got.offsets == want.offsets
    assert torch.equal(got.counts, want.counts)
    torch.testing.assert_close(got.means, want.means, rtol=1e-5, atol=1e-6)
    for lvl, (means, counts) in enumerate(naive_pyramid(k.cpu(), C, g), start=1):
        got_means, got_counts = got.level(lvl)
        assert torch.equal(got_counts.cpu().long(), counts)
        torch.testing.assert_close(got_means.cpu().double(), means, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 65, 300])
@pytest.mark.parametrize("C,g", [(4, 2), (8, 4), (4, 3), (16, 2)])
def test_pyramid_bounds_match_torch(T, C, g):
    """``bounds=True``: the same one pass also writes every node's per-channel key min and max
    (ragged tail included; 300 keys at C=4 reach the top kernel), exactly the torch build's; the
    means and counts are those of the plain build."""
    k = _keys(2, T, 3, 16, seed=T + 1).to(DEVICE)
    got = build_pyramid_triton(k, C, g, bounds=True)
    want = build_pyramid_torch(k, C, g, bounds=True)
    assert got.mins.dtype == got.maxs.dtype == torch.float32
    assert torch.equal(got.mins, want.mins) and torch.equal(got.maxs, want.maxs)
    plain = build_pyramid_triton(k, C, g)
    assert plain.mins is None and plain.maxs is None
    assert torch.equal(got.means, plain.means) and torch.equal(got.counts, plain.counts)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("C,g", [(64, 2), (64, 4), (16, 2)])
def test_gpu_pyramid_build(C, g):
    k = _keys(2, 5000, 4, 128, torch.bfloat16).cuda()
    got, want = build_pyramid_triton(k, C, g), build_pyramid_torch(k, C, g)
    assert got.offsets == want.offsets and torch.equal(got.counts, want.counts)
    torch.testing.assert_close(got.means, want.means, rtol=1e-5, atol=1e-5)
    got, want = build_pyramid_triton(k, C, g, True), build_pyramid_torch(k, C, g, True)
    assert torch.equal(got.mins, want.mins) and torch.equal(got.maxs, want.maxs)
    torch.testing.assert_close(got.means, want.means, rtol=1e-5, atol=1e-5)
