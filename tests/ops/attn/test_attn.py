"""``pisa.ops.attn``: the custom op ``pisa::sparse_attn`` (autograd, fake kernel) and its
dispatch to the naive / torch / Triton implementations."""
import importlib.util

import pytest
import torch

from pisa.ops.attn import sparse_attn
from pisa.ops.attn.naive import naive_attn
from tests.ops.attn.common import make_qkv, random_selection, rel_err
from tests.ops.conftest import INTERPRET

pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def test_backends_agree_through_the_op(rng):
    B, T, HQ, HKV, D, C = 1, 50, 4, 2, 16, 16
    q, k, v = make_qkv(B, T, T, HQ, HKV, D, torch.float64, seed=rng, device="cpu")
    idx = random_selection(B, T, T, HKV, C, 3, seed=rng, device="cpu")
    want_o, want_lse = naive_attn(q, k, v, idx, C, 0.25)
    do = torch.randn_like(want_o)
    want_g = torch.autograd.grad(want_o, (q, k, v), do)
    for backend in ("naive", "torch"):
        o, lse = sparse_attn(q, k, v, idx, C, 0.25, backend)
        assert o.dtype == torch.float64 and lse.dtype == torch.float32
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
        for got, want in zip(torch.autograd.grad(o, (q, k, v), do), want_g):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    if importlib.util.find_spec("triton") is not None:
        dev = "cpu" if INTERPRET else "cuda"
        q32, k32, v32 = (x.detach().float().to(dev).requires_grad_() for x in (q, k, v))
        for deterministic in (False, True):
            o, lse = sparse_attn(q32, k32, v32, idx.to(dev), C, 0.25, "triton", deterministic)
            assert o.dtype == torch.float32 and lse.dtype == torch.float32
            assert rel_err(o, want_o) < 1e-5 and rel_err(lse, want_lse) < 1e-5
            for got, want in zip(torch.autograd.grad(o, (q32, k32, v32), do.float().to(dev)),
                                 want_g):
                assert rel_err(got, want) < 4e-5


def test_fake_kernel_gives_the_output_layout():
    q = torch.empty(2, 7, 4, 16, device="meta")
    k = torch.empty(2, 30, 2, 16, device="meta")
    idx = torch.empty(2, 7, 2, 5, dtype=torch.int32, device="meta")
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        o, lse = sparse_attn(q, k, k, idx, 8, 0.25, "torch")
    assert o.shape == q.shape and lse.shape == (2, 4, 7) and lse.dtype == torch.float32
