import pytest
import torch

from pisa import pisa_attn, pisa_select
from pisa.ops.naive import naive_dense_attn


def _qkv(B=1, Tq=100, Tk=100, HQ=4, HKV=2, D=16, dtype=torch.float32, grad=False):
    q = torch.randn(B, Tq, HQ, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=grad)
    return q, k, v


def test_queries_within_first_k_blocks_get_dense_causal_attention(rng):
    C, K = 8, 6
    q, k, v = _qkv(Tq=K * C, Tk=K * C, dtype=torch.float64)
    o = pisa_attn(q, k, v, block_size=C, topk=K, backend="torch")
    torch.testing.assert_close(o, naive_dense_attn(q, k, v, 16 ** -0.5)[0],
                               rtol=1e-10, atol=1e-10)


def test_decode_row_equals_prefill_row(rng):
    """A single query at the end of the keys (decode) sees what prefill row T-1 sees."""
    q, k, v = _qkv(Tq=300, Tk=300, dtype=torch.float64)
    kw = dict(block_size=8, topk=6, beam=4, backend="torch")
    full = pisa_attn(q, k, v, **kw)
    for t in (0, 7, 150, 299):
        row = pisa_attn(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], **kw)
        torch.testing.assert_close(row[:, 0], full[:, t], rtol=1e-12, atol=1e-12)


def test_naive_and_torch_backends_agree_through_the_api(rng):
    q, k, v = _qkv(Tq=90, Tk=90, dtype=torch.float64)
    kw = dict(block_size=8, topk=5, beam=3, scorer="meanvar")
    i1, c1 = pisa_select(q, k, backend="naive", **kw)
    i2, c2 = pisa_select(q, k, backend="torch", **kw)
    assert torch.equal(i1, i2) and torch.equal(c1, c2)
    torch.testing.assert_close(pisa_attn(q, k, v, backend="naive", **kw),
                               pisa_attn(q, k, v, backend="torch", **kw))


def test_return_lse_and_precomputed_block_idx(rng):
    q, k, v = _qkv(Tq=64, Tk=64, grad=True)
    idx, counts = pisa_select(q, k, block_size=8, topk=4, forced_in_budget=False)
    assert idx.shape == (1, 64, 2, 7) and counts.shape == (1, 64, 2)
    o, lse = pisa_attn(q, k, v, block_size=8, block_idx=idx, return_lse=True)
    assert lse.shape == (1, 4, 64) and lse.dtype == torch.float32
    o.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


BAD = [
    (dict(q=torch.randn(2, 8, 4)), ValueError, "q must have shape"),
    (dict(k=torch.randn(1, 16, 3, 16)), ValueError, "multiple of k heads"),
    (dict(k=torch.randn(2, 16, 2, 16)), ValueError, "k batch"),
    (dict(k=torch.randn(1, 16, 2, 32)), ValueError, "k head dim"),
    (dict(v=torch.randn(1, 16, 2, 8)), ValueError, "v shape"),
    (dict(q=torch.randn(1, 17, 4, 16)), ValueError, "Tq <= Tk"),
    (dict(k=torch.randn(1, 16, 2, 16, dtype=torch.float64)), TypeError, "k.dtype"),
    (dict(q=torch.randint(0, 3, (1, 16, 4, 16))), TypeError, "floating-point"),
    (dict(q=torch.randn(1, 16, 16, 4).transpose(2, 3)), ValueError, "contiguous"),
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(block_size=48), ValueError, "block_size"),
    (dict(block_size=512), ValueError, "block_size"),
    (dict(topk=2), ValueError, "topk"),
    (dict(branching=1), ValueError, "branching"),
    (dict(beam=0), ValueError, "beam"),
    (dict(scorer="max"), ValueError, "scorer"),
    (dict(selector="random"), ValueError, "selector"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(block_idx=torch.zeros(1, 16, 2, 4, dtype=torch.int64)), TypeError, "int32"),
    (dict(block_idx=torch.zeros(1, 16, 4, 4, dtype=torch.int32)), ValueError, "block_idx"),
    (dict(q=torch.randn(1, 16, 4, 300), k=torch.randn(1, 16, 2, 300),
          v=torch.randn(1, 16, 2, 300)), ValueError, "head dim"),
]


@pytest.mark.parametrize("override,err,msg", BAD, ids=[b[2] for b in BAD])
def test_invalid_input_raises_a_named_error(override, err, msg):
    args = dict(q=torch.randn(1, 16, 4, 16), k=torch.randn(1, 16, 2, 16),
                v=torch.randn(1, 16, 2, 16))
    args.update(override)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(err, match=msg):
        pisa_attn(q, k, v, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_device_mismatch_is_reported():
    q = torch.randn(1, 16, 4, 16)
    k = torch.randn(1, 16, 2, 16, device="meta")
    with pytest.raises(ValueError, match="is on meta"):
        pisa_select(q, k)


def test_lse_gradient_matches_oracle(rng):
    """Gradients flow through the returned lse too (for users merging partial results)."""
    q, k, v = _qkv(Tq=70, Tk=70, dtype=torch.float64, grad=True)
    idx, _ = pisa_select(q.detach(), k.detach(), block_size=8, topk=5, backend="torch")
    o, lse = pisa_attn(q, k, v, block_size=8, block_idx=idx, return_lse=True, backend="torch")
    o2, lse2 = pisa_attn(q, k, v, block_size=8, block_idx=idx, return_lse=True, backend="naive")
    w = torch.randn_like(lse2)
    g1 = torch.autograd.grad((lse.double() * w).sum() + o.sum(), (q, k, v))
    g2 = torch.autograd.grad((lse2.double() * w).sum() + o2.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_model_compiles_with_fullgraph(rng):
    """Selection and attention are custom ops, so torch.compile traces through pisa_attn."""
    from pisa import PisaAttention
    torch._dynamo.reset()
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4)
    x = torch.randn(1, 64, 32, requires_grad=True)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
