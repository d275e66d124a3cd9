"""``pisa.ops.attn``: the custom op ``pisa::sparse_attn`` (autograd, fake kernel) and its
dispatch to the naive / torch / Triton implementations."""
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from pisa.ops.attn import sparse_attn
from pisa.ops.attn.naive import naive_attn
from tests.ops.attn.common import all_blocks, make_qkv, random_selection, rel_err
from tests.ops.conftest import INTERPRET, per_token_config

pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def test_backends_agree_through_the_op(rng):
    B, T, HQ, HKV, D, C = 1, 50, 4, 2, 16, 16
    q, k, v = make_qkv(B, T, T, HQ, HKV, D, torch.float64, seed=rng, device="cpu")
    idx = random_selection(B, T, T, HKV, C, 3, seed=rng, device="cpu")
    want_o, want_lse = naive_attn(q, k, v, idx, C, 0.25)
    do = torch.randn_like(want_o)
    want_g = torch.autograd.grad(want_o, (q, k, v), do)
    for backend in ("naive", "torch"):
        o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=0.25),
                             backend=backend)
        assert o.dtype == torch.float64 and lse.dtype == torch.float32
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
        for got, want in zip(torch.autograd.grad(o, (q, k, v), do), want_g):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    if importlib.util.find_spec("triton") is not None:
        dev = "cpu" if INTERPRET else "cuda"
        q32, k32, v32 = (x.detach().float().to(dev).requires_grad_() for x in (q, k, v))
        for deterministic in (False, True):
            o, lse = sparse_attn(q32, k32, v32, idx.to(dev),
                                 cfg=per_token_config(block_size=C, scale=0.25), backend="triton",
                                 deterministic=deterministic)
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
        o, lse = sparse_attn(q, k, k, idx, cfg=per_token_config(block_size=8, scale=0.25),
                             backend="torch")
    assert o.shape == q.shape and lse.shape == (2, 4, 7) and lse.dtype == torch.float32


def _backends():
    return ["naive", "torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def _device(backend):
    return "cuda" if backend == "triton" and not INTERPRET else "cpu"


def _poison(case, q, k):
    """One NaN / Inf in q or k, or fp32 inputs x 1e20 (the logits overflow to +-inf)."""
    q, k = q.clone(), k.clone()
    if case == "nan_q":
        q[0, 10, 1, 3] = math.nan
    elif case == "nan_k":
        k[0, 20, 0, 3] = math.nan
    elif case == "inf_k":
        k[0, 25, 0] = math.inf
    elif case == "neg_inf_q":
        q[0, 30, 0] = -math.inf
    else:
        q, k = q * 1e20, k * 1e20
    return q, k


# x 1e20 only overflows in fp32: the fp64 oracle's logits of 1e40 stay finite
NON_FINITE = [(b, c) for b in _backends() for c in ("nan_q", "nan_k", "inf_k", "neg_inf_q", "x1e20")
              if (b, c) != ("naive", "x1e20")]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("backend,case", NON_FINITE)
def test_non_finite_input_gives_nan_rows_like_dense_sdpa(backend, case):
    """With every causal block selected, a row's output is NaN exactly where dense SDPA's is (on
    the same inputs, in the backend's compute dtype: fp64 for the naive oracle), with a
    non-finite lse there; the other rows match SDPA. Before, those rows came out as exact zeros
    with lse = -inf, a finite loss hiding NaN gradients."""
    B, T, HQ, HKV, D, C = 1, 40, 2, 1, 16, 16
    dev = _device(backend)
    q, k, v = (x.detach() for x in make_qkv(B, T, T, HQ, HKV, D, torch.float32, device=dev))
    q, k = _poison(case, q, k)
    o, lse = sparse_attn(q, k, v, all_blocks(B, T, T, HKV, C, device=dev),
                         cfg=per_token_config(block_size=C, scale=0.25), backend=backend)
    ct = torch.float64 if backend == "naive" else torch.float32
    want = F.scaled_dot_product_attention(
        *(x.to(ct).repeat_interleave(HQ // x.shape[2], 2).transpose(1, 2) for x in (q, k, v)),
        is_causal=True, scale=0.25).transpose(1, 2)
    o, lse, want = o.cpu(), lse.cpu(), want.cpu()
    nan_rows = want.isnan().any(-1)  # [B, T, HQ]
    assert nan_rows.any()
    assert torch.equal(o.isnan().any(-1), nan_rows)
    bad_lse = lse.transpose(1, 2)[nan_rows]
    assert not (torch.isfinite(bad_lse) | torch.isneginf(bad_lse)).any()
    assert torch.isfinite(lse.transpose(1, 2)[~nan_rows]).all()
    torch.testing.assert_close(o[~nan_rows].double(), want[~nan_rows].double(), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("backend", _backends())
def test_nan_reaches_the_rows_that_attend_it_and_no_other(backend):
    """A NaN key makes NaN exactly the rows that selected its block at or after its position; a
    NaN query only its own row; a row of -1 only (no key) keeps o = 0, lse = -inf."""
    B, T, HQ, HKV, D, C, S = 1, 64, 4, 2, 16, 8, 3
    dev = _device(backend)
    q, k, v = (x.detach() for x in make_qkv(B, T, T, HQ, HKV, D, torch.float32, device=dev))
    idx = random_selection(B, T, T, HKV, C, S, seed=1, device=dev)
    idx[0, 50, 1] = -1  # no key
    q[0, 50, 2, 0] = math.nan  # heads 2, 3 share KV head 1: its row attends nothing
    q[0, 40, 0, 5] = math.nan
    k[0, 27, 1, 2] = math.nan  # block 3 of KV head 1
    o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=0.25),
                         backend=backend)
    o, lse, idx = o.cpu(), lse.cpu().transpose(1, 2), idx.cpu()
    t = torch.arange(T)
    want = torch.zeros(B, T, HQ, dtype=torch.bool)
    want[0, :, 2:] = ((idx[0, :, 1] == 3).any(-1) & (t >= 27))[:, None]
    want[0, 40, 0] = True
    assert torch.equal(o.isnan().any(-1), want)
    assert torch.equal(lse.isnan(), want)
    assert (o[0, 50, 2:] == 0).all() and torch.isneginf(lse[0, 50, 2:]).all()
