"""``pisa.ops.utils.geometry``: level sizes, the one-buffer offsets, forced leaves."""
import pytest
import torch

from pisa.ops.utils.geometry import (Pyramid, cdiv, compute_dtype, forced_leaves,
                                     forced_leaves_tensor, level_offsets, level_sizes, pow2)


def test_small_helpers():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [pow2(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
    assert compute_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64
    assert compute_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32


@pytest.mark.parametrize("n,g,want", [(1, 2, [1]), (5, 2, [5, 3, 2, 1]), (13, 4, [13, 4, 1]),
                                      (9, 3, [9, 3, 1]), (10, 3, [10, 4, 2, 1])])
def test_level_sizes_end_at_one_root(n, g, want):
    assert level_sizes(n, g) == want


def test_level_offsets_are_cumulative_sizes():
    assert level_offsets(100, 8, 4) == (0, 13, 17, 18)
    assert level_offsets(1, 64, 2) == (0, 1)
    for T, C, g in [(1000, 16, 2), (130, 8, 3), (64, 4, 2)]:
        sizes = level_sizes(cdiv(T, C), g)
        offsets = level_offsets(T, C, g)
        assert len(offsets) == len(sizes) + 1 and offsets[0] == 0
        assert [b - a for a, b in zip(offsets, offsets[1:])] == sizes


@pytest.mark.parametrize("C", [4, 16])
def test_forced_leaves_tensor_matches_the_list(C):
    t = torch.arange(0, 6 * C)
    got = forced_leaves_tensor(t, C)
    assert got.shape == (t.numel(), 3)
    for i, t_abs in enumerate(t.tolist()):
        want = forced_leaves(t_abs, C)
        assert want == sorted(set(want)) and want[0] == 0 and want[-1] == t_abs // C
        assert sorted(x for x in got[i].tolist() if x >= 0) == want


def test_levels_are_slices_of_one_buffer():
    offsets = level_offsets(40, 8, 2)  # 5 + 3 + 2 + 1 nodes
    means = torch.arange(offsets[-1], dtype=torch.float32).view(1, -1, 1, 1)
    pyr = Pyramid(means, torch.arange(offsets[-1], dtype=torch.int32), offsets)
    assert pyr.n_levels == 4
    assert pyr.level(1)[0].flatten().tolist() == [0, 1, 2, 3, 4]
    assert pyr.level(3)[1].tolist() == [8, 9] and pyr.level(4)[1].tolist() == [10]
