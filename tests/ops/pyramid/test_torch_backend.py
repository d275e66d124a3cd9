"""``pisa.ops.pyramid.torch_backend``: the vectorised pyramid against exact means and the oracle."""
import pytest
import torch

from pisa.ops.pyramid.naive import naive_pyramid
from pisa.ops.pyramid.torch_backend import build_pyramid_torch
from pisa.ops.utils.geometry import level_offsets, level_sizes


@pytest.mark.parametrize("T,C,g", [(1, 4, 2), (63, 4, 2), (64, 4, 2), (65, 8, 4), (1000, 16, 2),
                                   (130, 8, 3)])
def test_every_summary_is_the_exact_mean_of_its_keys(T, C, g, rng):
    k = torch.randn(2, T, 3, 8, dtype=torch.float64)
    pyr = build_pyramid_torch(k, C, g)
    assert pyr.means.dtype == torch.float64 and pyr.counts.dtype == torch.int32
    assert pyr.n_levels == len(level_sizes(-(-T // C), g))
    assert pyr.level(pyr.n_levels)[1].tolist() == [T], "the root holds every key"
    for lvl in range(1, pyr.n_levels + 1):
        means, counts = pyr.level(lvl)
        span = C * g ** (lvl - 1)
        for i in range(means.shape[1]):
            keys = k[:, i * span:(i + 1) * span]
            assert counts[i] == keys.shape[1]
            torch.testing.assert_close(means[:, i].double(), keys.mean(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,C,g", [(127, 4, 2), (300, 8, 4)])
def test_torch_pyramid_matches_naive(T, C, g, rng):
    k = torch.randn(1, T, 2, 16)
    pyr = build_pyramid_torch(k, C, g)
    assert pyr.means.dtype == torch.float32
    levels = naive_pyramid(k, C, g)
    assert pyr.offsets == level_offsets(T, C, g) and pyr.n_levels == len(levels)
    for lvl, (means, counts) in enumerate(levels, start=1):
        got_means, got_counts = pyr.level(lvl)
        assert torch.equal(got_counts.long(), counts)
        torch.testing.assert_close(got_means.double(), means, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,C,g", [(1, 4, 2), (65, 8, 4), (130, 8, 3), (300, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bounds_are_the_min_and_max_of_every_nodes_keys(T, C, g, dtype, rng):
    """With ``bounds=True`` every node holds the per-channel min and max of its keys (ragged tail
    included), exactly; the oracle, which takes them from the keys, agrees; the means are those
    of the plain build."""
    k = torch.randn(2, T, 3, 8, dtype=dtype)
    pyr = build_pyramid_torch(k, C, g, bounds=True)
    assert build_pyramid_torch(k, C, g).mins is None
    assert pyr.mins.shape == pyr.means.shape == pyr.maxs.shape
    assert pyr.mins.dtype == pyr.maxs.dtype == pyr.means.dtype
    assert torch.equal(pyr.means, build_pyramid_torch(k, C, g).means)
    levels = naive_pyramid(k, C, g, bounds=True)
    for lvl, (_, counts, mins, maxs) in enumerate(levels, start=1):
        lo, hi = pyr.offsets[lvl - 1], pyr.offsets[lvl]
        span = C * g ** (lvl - 1)
        for i in range(hi - lo):
            keys = k[:, i * span:(i + 1) * span]
            assert torch.equal(pyr.mins[:, lo + i], keys.amin(1))
            assert torch.equal(pyr.maxs[:, lo + i], keys.amax(1))
        assert torch.equal(pyr.mins[:, lo:hi].double(), mins)
        assert torch.equal(pyr.maxs[:, lo:hi].double(), maxs)
        assert torch.equal(pyr.counts[lo:hi].long(), counts)
