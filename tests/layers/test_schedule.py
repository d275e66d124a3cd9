"""``pisa.layers.schedule``: ``set_attn_mode`` and the ``DenseWarmup`` schedule."""
import pytest
import torch
from torch import nn

from pisa import PisaAttention
from pisa.layers import DenseWarmup, set_attn_mode
from tests.layers.test_attention import TinyGPT


def test_set_attn_mode_switches_every_layer_and_the_output(rng):
    model = TinyGPT(block_size=8, topk=4)
    ids = torch.randint(0, 50, (1, 80))
    with torch.no_grad():
        sparse = model(ids)
        assert set_attn_mode(model, "dense") == 2
        assert all(b.attn == "dense" for b in model.blocks)
        dense = model(ids)
        assert (dense - sparse).abs().max() > 1e-3
        set_attn_mode(model, "pisa")
        torch.testing.assert_close(model(ids), sparse, rtol=0, atol=0)
        ref = TinyGPT(block_size=8, topk=4, attn="dense")
        ref.load_state_dict(model.state_dict())
        set_attn_mode(model, "dense")
        torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)


def test_set_attn_mode_on_a_layer_itself():
    layer = PisaAttention(32, 4, 2)
    assert set_attn_mode(layer, "dense") == 1 and layer.attn == "dense"


@pytest.mark.parametrize("model,mode,exc,msg", [
    (PisaAttention(32, 4, 2), "flash", ValueError, "mode must be one of"),
    (nn.Linear(2, 2), "dense", ValueError, "holds no PisaAttention layer and is not a "),
    ("model", "dense", TypeError, "model must be a torch.nn.Module"),
])
def test_set_attn_mode_rejects_bad_arguments(model, mode, exc, msg):
    with pytest.raises(exc, match=msg):
        set_attn_mode(model, mode)


def test_dense_warmup_then_pisa(rng):
    schedule = DenseWarmup(dense_steps=3)
    assert [schedule.mode(s) for s in range(5)] == ["dense"] * 3 + ["pisa"] * 2
    assert DenseWarmup().mode(0) == "pisa"
    model = TinyGPT(block_size=8, topk=4)
    assert schedule.apply(model, 0) == "dense" and model.blocks[0].attn == "dense"
    assert schedule.apply(model, 3) == "pisa" and model.blocks[1].attn == "pisa"


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(dense_steps=-1), ValueError, "dense_steps must be >= 0"),
    (dict(dense_steps=1.5), TypeError, "dense_steps must be an int"),
])
def test_dense_warmup_checks_its_steps(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        DenseWarmup(**kwargs)
    with pytest.raises(ValueError, match="step must be >= 0"):
        DenseWarmup(2).mode(-1)


def test_dense_warmup_switches_a_transformers_model(rng):
    """A transformers model with ``attn_implementation="pisa"``: dense steps run sdpa (the dense
    model's logits), then PISA again, past K blocks."""
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import tiny_llama
    seed = int(torch.randint(0, 2**31, ()))
    dense = tiny_llama(seed=seed)
    model = tiny_llama(seed=seed, attn_implementation="pisa", block_size=8, topk=3)
    ids = torch.randint(0, 128, (1, 96))  # 12 blocks, 3 attended
    schedule = DenseWarmup(dense_steps=1)
    with torch.no_grad():
        sparse_logits = model(ids).logits
        assert schedule.apply(model, 0) == "dense"
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(ids).logits, dense(ids).logits)
        assert schedule.apply(model, 1) == "pisa" and set_attn_mode(model, "pisa") == 2
        assert torch.equal(model(ids).logits, sparse_logits)
    assert not torch.allclose(sparse_logits, dense(ids).logits, atol=1e-3)
