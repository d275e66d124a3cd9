"""``pisa.layers.attention.PisaAttention``: training, the dense fast path, argument checks."""
import pytest
import torch
from torch import nn

from pisa import PisaAttention, pisa_attn


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, width=32, heads=4, kv_heads=2, layers=2, **attn_kw):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            PisaAttention(width, heads, kv_heads, **attn_kw) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, attn in zip(self.norms, self.blocks):
            x = x + attn(norm(x))
        return self.head(x)


def test_gpt_with_pisa_trains_one_step(rng):
    model = TinyGPT(block_size=8, topk=4, beam=4)
    ids = torch.randint(0, 50, (2, 120))
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_pisa_layer_equals_dense_layer_while_context_fits_in_k_blocks(rng):
    dense = PisaAttention(32, 4, 2, attn="dense")
    sparse = PisaAttention(32, 4, 2, block_size=8, topk=6)
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 48, 32)  # 6 blocks of 8 = the budget: the layer takes SDPA ...
    torch.testing.assert_close(sparse(x), dense(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # ... which is what the sparse kernels give when they select every block
        o = pisa_attn(*sparse.qkv(x), **sparse.pisa_kwargs)
        torch.testing.assert_close(sparse(x), sparse.o_proj(o.flatten(2)), rtol=1e-5, atol=1e-5)
    y = torch.randn(2, 200, 32)
    assert (sparse(y) - dense(y)).abs().max() > 1e-3, "beyond K blocks the layer is sparse"


def test_short_context_skips_the_sparse_kernels(monkeypatch):
    import pisa.layers.attention as layer
    calls = []
    monkeypatch.setattr(layer, "pisa_attn", lambda *a, **kw: calls.append(1) or
                        torch.zeros(a[0].shape))
    attn = PisaAttention(32, 4, 2, block_size=8, topk=6)
    attn(torch.randn(1, 48, 32))
    assert calls == []
    attn(torch.randn(1, 49, 32))
    assert calls == [1]
    assert PisaAttention(32, 4, 2).dense_up_to == 16 * 64  # pisa_attn's defaults
    assert PisaAttention(32, 4, 2, dense_below=8192).dense_up_to == 8192
    with pytest.raises(ValueError, match="dense_below must be >= 0"):
        PisaAttention(32, 4, 2, dense_below=-1)


def test_layer_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PisaAttention(32, 4, 3)
    with pytest.raises(ValueError, match="attn must be"):
        PisaAttention(32, 4, 2, attn="flash")


def test_scale_is_the_softmax_scale_on_every_path(rng):
    """``scale`` reaches SDPA too: the shortcut (T <= topk * block_size) equals the sparse kernels
    selecting every block at that scale, and ``attn="dense"`` uses it as well."""
    layer = PisaAttention(32, 4, 2, block_size=8, topk=6, scale=0.3)
    x = torch.randn(2, 48, 32)
    with torch.no_grad():
        o = pisa_attn(*layer.qkv(x), **layer.pisa_kwargs)
        torch.testing.assert_close(layer(x), layer.o_proj(o.flatten(2)), rtol=1e-5, atol=1e-5)
        default = PisaAttention(32, 4, 2, block_size=8, topk=6)
        default.load_state_dict(layer.state_dict())
        assert (default(x) - layer(x)).abs().max() > 1e-3, "the scale changes the output"
        dense = PisaAttention(32, 4, 2, attn="dense", scale=0.3)
        dense.load_state_dict(layer.state_dict())
        torch.testing.assert_close(dense(x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(selector="bogus"), ValueError, "selector must be one of"),
    (dict(scorer="max"), ValueError, "scorer must be one of"),
    (dict(topk=0), ValueError, "topk must be an int >= 3"),
    (dict(topk=16.0), TypeError, "topk must be an int"),
    (dict(beam=0), ValueError, "beam"),
    (dict(beam=True), TypeError, "beam must be an int"),
    (dict(block_size=48), ValueError, "block_size must be a power of two"),
    (dict(block_size="64"), TypeError, "block_size must be an int"),
    (dict(block_size=8, backend="triton"), ValueError, r"\[16, 128\] for backend 'triton'"),
    (dict(branching=1), ValueError, "branching"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(scale="0.1"), TypeError, "scale must be a real number or None"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(forced_in_budget="no"), TypeError, "forced_in_budget must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(topK=4), TypeError, r"unexpected keyword arguments \['topK'\]"),
    (dict(return_lse=True), ValueError, "return_lse is not a PisaAttention option"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
    (dict(head_dim=0), ValueError, "head_dim must be >= 1"),
    (dict(hidden_size=32.0), TypeError, "hidden_size must be an int"),
], ids=lambda x: str(x)[:40])
def test_layer_checks_every_knob_at_construction(kwargs, exc, msg):
    """A bad knob fails where the layer is built, with the library's own checks, not at the first
    input longer than ``topk * block_size``."""
    args = dict(hidden_size=32, num_heads=4, num_kv_heads=2)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        PisaAttention(**args)


def test_layer_accepts_every_good_knob():
    layer = PisaAttention(32, 4, None, block_size=8, topk=4, branching=4, beam=8, scorer="mean",
                          selector="auto", forced_in_budget=False, scale=1, deterministic=True,
                          backend="auto")
    assert layer.num_kv_heads == 4 and layer.scale == 1.0
    assert layer(torch.randn(1, 40, 32)).shape == (1, 40, 32)  # sparse: 40 > 4 * 8
