"""``pisa.layers.attention.PisaAttention``: training, the dense fast path, argument checks."""
import pytest
import torch
from torch import nn

from pisa import PisaAttention, pisa_attn
from pisa.ops.attn import dense_causal_attn


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


# Training branches: window, compressed, their gates.
def _masked_reference(q, k, v, allowed, scale):
    """fp64 softmax attention over ``allowed [Tq, Tk]`` keys (shared by batch and heads)."""
    G = q.shape[2] // k.shape[2]
    kk, vv = (x.double().repeat_interleave(G, dim=2) for x in (k, v))
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", p, vv)


@pytest.mark.parametrize("window,T", [(1, 50), (3, 50), (2, 64), (4, 37)])
@pytest.mark.parametrize("query_tile", [None, 1])
def test_window_branch_is_exact_attention_over_the_last_blocks(rng, window, T, query_tile):
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4, window=window, query_tile=query_tile)
    q, k, v = layer.qkv(torch.randn(2, T, 32))
    pos = torch.arange(T)
    allowed = (pos[None, :] <= pos[:, None]) \
        & (pos[None, :] // 8 >= pos[:, None] // 8 - window + 1)
    ref = _masked_reference(q, k, v, allowed, layer.head_dim ** -0.5)
    torch.testing.assert_close(layer.window_attn(q, k, v).double(), ref, rtol=1e-5, atol=1e-5)


def test_window_covering_every_block_is_dense_causal(rng):
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4, window=7)
    q, k, v = layer.qkv(torch.randn(1, 56, 32))
    torch.testing.assert_close(layer.window_attn(q, k, v), dense_causal_attn(q, k, v, None),
                               rtol=1e-5, atol=1e-5)


def test_compressed_branch_is_the_coarse_op_on_the_layers_blocks(rng):
    from pisa.ops.coarse.naive import naive_coarse_attn
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4, compressed=True, scale=0.3)
    q, k, v = layer.qkv(torch.randn(2, 45, 32))
    ref, _ = naive_coarse_attn(q, k, v, 8, 0.3)
    torch.testing.assert_close(layer.compressed_attn(q, k, v).double(), ref, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("attn", ["pisa", "dense"])
def test_layer_output_is_core_plus_gated_branches(rng, attn):
    """``o = o_sel + sigmoid(g_win) * o_win + sigmoid(g_cmp) * o_cmp`` per head, with the gates
    of a linear layer on x (random weights here, not the initial zeros)."""
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4, window=2, compressed=True, attn=attn)
    plain = PisaAttention(32, 4, 2, block_size=8, topk=4, attn=attn)
    plain.load_state_dict(layer.state_dict(), strict=False)
    torch.nn.init.normal_(layer.gate.weight)
    x = torch.randn(2, 70, 32)
    with torch.no_grad():
        q, k, v = layer.qkv(x)
        g = torch.sigmoid(layer.gate(x)).view(2, 70, 4, 2)
        o = g[..., 0, None] * layer.window_attn(q, k, v) \
            + g[..., 1, None] * layer.compressed_attn(q, k, v)
        want = plain(x) + layer.o_proj(o.flatten(2))
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_closed_gates_give_the_plain_pisa_layer_and_gates_start_small(rng):
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4, window=3, compressed=True)
    assert layer.branches == ("window", "compressed") and layer.gate.out_features == 8
    assert not layer.gate.weight.abs().max()
    torch.testing.assert_close(torch.sigmoid(layer.gate.bias), torch.full((8,), 0.0474),
                               atol=1e-4, rtol=0)
    plain = PisaAttention(32, 4, 2, block_size=8, topk=4)
    plain.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(2, 70, 32)
    with torch.no_grad():
        assert (layer(x) - plain(x)).abs().max() > 1e-4, "open gates add the branches"
        layer.gate.bias.fill_(-1e4)  # sigmoid = 0 exactly
        torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)
    assert not hasattr(plain, "gate") or plain.gate is None


def test_branches_train_the_gates_and_the_key_value_projections(rng):
    """The branches alone (no core output in the loss) give gradients to the projections (the
    compressed branch to k and v through the pooling) and to the gate."""
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4, compressed=True)
    x = torch.randn(2, 70, 32)
    q, k, v = layer.qkv(x)
    loss = layer.gated_branches(x, q, k, v).square().sum()
    loss.backward()
    for name in ("k_proj", "v_proj", "q_proj", "gate"):
        grad = getattr(layer, name).weight.grad
        assert grad is not None and grad.abs().max() > 0, name


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(window=-1), ValueError, "window must be >= 0"),
    (dict(window=2.0), TypeError, "window must be an int"),
    (dict(compressed="yes"), TypeError, "compressed must be a bool"),
    (dict(compressed=True, cp_group=object()), ValueError, "not context-parallel"),
])
def test_branch_knobs_are_checked(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        PisaAttention(32, 4, 2, **kwargs)


def test_branches_train_in_a_gpt(rng):
    model = TinyGPT(block_size=8, topk=4, window=2, compressed=True)
    ids = torch.randint(0, 50, (2, 90))
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(float(b.gate.weight.grad.abs().max()) > 0 for b in model.blocks)
