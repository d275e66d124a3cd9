"""``pisa.ops.pyramid``: the backend dispatch of ``build_pyramid`` (the ``Pyramid`` layout is
``utils.geometry``'s)."""
import pytest
import torch

from pisa.ops.pyramid import build_pyramid
from pisa.ops.pyramid.torch_backend import build_pyramid_torch

pytestmark = pytest.mark.usefixtures("fast_interpreter")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_build_pyramid_dispatches(backend, rng):
    if backend == "triton":
        pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k = torch.randn(2, 77, 2, 16, device=dev)
    got = build_pyramid(k, 8, 2, backend)
    want = build_pyramid_torch(k, 8, 2)
    assert got.offsets == want.offsets and torch.equal(got.counts, want.counts)
    assert got.means.dtype == torch.float32 and got.means.device == k.device
    torch.testing.assert_close(got.means, want.means, rtol=1e-5, atol=1e-6)


def test_build_pyramid_bounds(rng):
    """``bounds=True`` builds mins and maxs in either backend: the same ones."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k = torch.randn(1, 50, 2, 16, device=dev)
    want = build_pyramid_torch(k, 8, 2, bounds=True)
    for backend in ("torch", "triton"):
        pyr = build_pyramid(k, 8, 2, backend, bounds=True)
        assert torch.equal(pyr.maxs, want.maxs) and torch.equal(pyr.mins, want.mins), backend
        assert build_pyramid(k, 8, 2, backend).mins is None
