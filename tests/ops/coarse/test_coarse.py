"""``pisa.ops.coarse.coarse_attn`` (the compressed branch) on every backend against the fp64 loop
oracle ``naive_coarse_attn``: outputs, LSE, gradients (through the pooling), the rows without a
node, O(N) saved memory, argument checks. Triton runs under the interpreter on tiny fp32 shapes
with NaN-poisoned outputs."""
import math

import pytest
import torch

from pisa.ops.coarse import coarse_attn
from pisa.ops.coarse.naive import naive_coarse_attn, naive_pool
from tests.ops.conftest import INTERPRET

pytest.importorskip("triton")

import pisa.ops.coarse.triton as coarse_triton  # noqa: E402


@pytest.fixture
def small_tiles(monkeypatch):
    """16 x 16 program tiles, so tiny inputs span several query and node tiles."""
    monkeypatch.setattr(coarse_triton, "_BM", 16)
    monkeypatch.setattr(coarse_triton, "_BN", 16)


def make(B, Tq, Tk, HQ, HKV, D, dtype=torch.float32):
    q = torch.randn(B, Tq, HQ, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=True)
    return q, k, v


def grads(o, inputs, do):
    return torch.autograd.grad(o, inputs, do, allow_unused=True, materialize_grads=True)


def rel_err(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# (B, Tq, Tk, HQ, HKV, D, C): GQA, ragged Tk (the incomplete block has no node), Tq < Tk,
# rows without a node (t_abs < C - 1), D not a power of two, several 16-node tiles
CASES = [
    (2, 37, 37, 4, 2, 8, 4),
    (1, 20, 70, 4, 1, 16, 4),
    (1, 50, 50, 3, 3, 12, 3),
    (1, 90, 90, 2, 1, 16, 2),
    (1, 6, 6, 2, 2, 16, 8),   # no node at all: o = 0
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_oracle_forward_and_backward(rng, backend, case, small_tiles,
                                                 poison_outputs):
    B, Tq, Tk, HQ, HKV, D, C = case
    q, k, v = make(B, Tq, Tk, HQ, HKV, D)
    o, lse = coarse_attn(q, k, v, block_size=C, return_lse=True, backend=backend)
    ref_o, ref_lse = naive_coarse_attn(q, k, v, C, D ** -0.5)
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (B, HQ, Tq)
    assert rel_err(o, ref_o) < 1e-5 if ref_o.abs().max() > 0 else not o.abs().max()
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)  # -inf in place
    do = torch.randn_like(o)
    got, want = grads(o, (q, k, v), do), grads(ref_o, (q, k, v), do.double())
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), name
        if w.abs().max() > 0:
            assert rel_err(g, w) < 1e-5, name
        else:
            assert not g.abs().max(), name


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_gradcheck_fp64(rng, backend):
    q, k, v = make(1, 9, 13, 4, 2, 4, torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: coarse_attn(q, k, v, block_size=3, scale=0.7, backend=backend),
        (q, k, v))


def test_rows_see_the_blocks_that_end_at_or_before_them(rng):
    """Visibility, from a case computed by hand: C = 4, query 7 sees nodes 0 and 1 (blocks ending
    at 3 and 7), query 6 only node 0 (its own block is not complete), queries 0..2 none; the
    incomplete tail block 2 (keys 8, 9) is never a node."""
    q, k, v = make(1, 10, 10, 1, 1, 4, torch.float64)
    o = coarse_attn(q, k, v, block_size=4, backend="torch").detach()
    kc, vc = naive_pool(k, 4), naive_pool(v, 4)
    assert kc.shape[1] == 2
    assert not o[0, :3].abs().max()
    torch.testing.assert_close(o[0, 3:7, 0], vc[0, 0, 0].expand(4, -1))  # one node: its value
    p = torch.softmax(0.5 * (kc[0, :, 0] @ q[0, 7, 0].detach()), dim=0)
    torch.testing.assert_close(o[0, 7, 0], p @ vc[0, :, 0])
    p = torch.softmax(0.5 * (kc[0, :, 0] @ q[0, 9, 0].detach()), dim=0)
    torch.testing.assert_close(o[0, 9, 0], p @ vc[0, :, 0])  # the tail block is no node


def test_equals_dense_attention_over_pooled_keys_with_block_size_one(rng):
    """C = 1: every key is its own node, visible from its own position on: dense causal."""
    q, k, v = make(2, 24, 24, 4, 2, 8, torch.float64)
    o = coarse_attn(q, k, v, block_size=1, backend="torch")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(o, ref)


def test_keys_of_the_incomplete_block_get_no_gradient(rng):
    q, k, v = make(1, 11, 11, 2, 1, 4)
    coarse_attn(q, k, v, block_size=4, backend="torch").sum().backward()
    assert not k.grad[:, 8:].abs().max() and not v.grad[:, 8:].abs().max()
    assert k.grad[:, :8].abs().min() > 0 and v.grad[:, :8].abs().min() > 0


def test_bf16_on_torch_within_bf16_tolerance(rng):
    q, k, v = make(1, 64, 64, 4, 2, 16, torch.bfloat16)
    o = coarse_attn(q, k, v, block_size=4, backend="torch")
    ref, _ = naive_coarse_attn(q, k, v, 4, 0.25)
    assert o.dtype == torch.bfloat16 and rel_err(o[:, 3:], ref[:, 3:]) < 1e-2


def test_saved_memory_is_linear_not_queries_by_nodes(rng, monkeypatch):
    """The autograd graph keeps no ``[T, T / C]`` tensor: with 4 query chunks the largest saved
    tensor is one of the inputs' size (the chunk's logits are recomputed in backward)."""
    import pisa.ops.coarse.torch_backend as tb
    B, T, HQ, HKV, D, C = 1, 512, 2, 1, 4, 2
    monkeypatch.setattr(tb, "CHUNK_ELEMS", B * HQ * (T // C) * T // 4)
    q, k, v = make(B, T, T, HQ, HKV, D)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o = coarse_attn(q, k, v, block_size=C, backend="torch")
    assert max(saved) <= B * T * HQ * D
    o.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(block_size=4.0), TypeError, "block_size must be an int"),
    (dict(scale="0.1"), TypeError, "scale must be a real number"),
    (dict(scale=math.inf), ValueError, "scale must be finite"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
])
def test_bad_arguments_raise_naming_them(kwargs, exc, msg):
    q, k, v = make(1, 8, 8, 2, 1, 4)
    with pytest.raises(exc, match=msg):
        coarse_attn(q, k, v, **kwargs)


def test_bad_shapes_raise():
    q, k, v = make(1, 8, 8, 3, 2, 4)
    with pytest.raises(ValueError, match="multiple of k heads"):
        coarse_attn(q, k, v)
    q, k, v = make(1, 9, 8, 2, 1, 4)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        coarse_attn(q, k, v)


@pytest.mark.skipif(INTERPRET, reason="needs CUDA")
def test_triton_bf16_on_gpu_matches_fp32_torch(rng):
    """Forward and gradients (the dK / dV of a program per query head, summed over the group)
    against the fp32 torch path, GQA 4:1."""
    q, k, v = (x.detach().cuda().bfloat16().requires_grad_()
               for x in make(2, 1000, 1000, 8, 2, 64))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    o = coarse_attn(q, k, v, block_size=64, backend="triton")
    ref = coarse_attn(q32, k32, v32, block_size=64, backend="torch")
    assert rel_err(o[:, 63:], ref[:, 63:]) < 2e-2
    do = torch.randn_like(ref)
    do[:, :63] = 0  # rows before the first full block attend nothing
    o.backward(do.bfloat16())
    ref.backward(do)
    for x, x32 in ((q, q32), (k, k32), (v, v32)):
        assert torch.isfinite(x.grad).all()
        assert rel_err(x.grad, x32.grad) < 3e-2
