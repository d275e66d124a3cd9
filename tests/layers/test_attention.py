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


def test_layer_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PisaAttention(32, 4, 3)
    with pytest.raises(ValueError, match="attn must be"):
        PisaAttention(32, 4, 2, attn="flash")
