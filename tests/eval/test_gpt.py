import pytest
import torch

from pisa.eval.gpt import GPT, GPTConfig


def _pair(arm, **kw):
    dense = GPT(GPTConfig(width=32, depth=2, heads=2, kv_heads=1, mlp_hidden=64, arm="dense"))
    sparse = GPT(GPTConfig(width=32, depth=2, heads=2, kv_heads=1, mlp_hidden=64, arm=arm,
                           topk=4, block_size=16, **kw))
    missing = sparse.load_state_dict(dense.state_dict(), strict=False).missing_keys
    assert all(".attn.gate." in key for key in missing), missing  # a recipe arm's gates only
    return dense.eval(), sparse.eval()


@pytest.mark.parametrize("arm", ["pisa", "pisa_qt1", "pisa_mass", "flat_mean", "flat_lse"])
def test_sparse_arm_is_dense_within_k_blocks_sparse_beyond_and_dense_when_switched(arm, rng):
    dense, sparse = _pair(arm)
    with torch.no_grad():
        short = torch.randint(0, 264, (2, 64))  # 4 blocks of 16 = the whole budget
        torch.testing.assert_close(sparse(short), dense(short), rtol=1e-4, atol=1e-4)
        long = torch.randint(0, 264, (2, 256))
        assert (sparse(long) - dense(long)).abs().max() > 1e-3
        sparse.set_sparse(False)
        torch.testing.assert_close(sparse(long), dense(long), rtol=1e-4, atol=1e-4)


def test_tied_head_and_bad_arm():
    model = GPT(GPTConfig(width=32, depth=1, heads=2, kv_heads=1, mlp_hidden=64))
    ids = torch.randint(0, 264, (1, 8))
    logits = model(ids)
    assert logits.shape == (1, 8, 264)
    logits.sum().backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="arm must be one of"):
        GPTConfig(arm="moba")


def test_a_beam_as_wide_as_the_blocks_walks_to_the_flat_lse_selection(rng):
    _, pisa = _pair("pisa_qt1")  # per token, as the flat arms select
    _, flat = _pair("flat_lse")
    flat.load_state_dict(pisa.state_dict())
    ids = torch.randint(0, 264, (2, 1024))  # 64 blocks: beam 4 prunes the walk, beam 64 not
    with torch.no_grad():
        assert (pisa(ids) - flat(ids)).abs().max() > 1e-3
        pisa.set_beam(64)
        torch.testing.assert_close(pisa(ids), flat(ids), rtol=1e-4, atol=1e-4)
        pisa.set_beam(None)
        assert (pisa(ids) - flat(ids)).abs().max() > 1e-3


@pytest.mark.parametrize("arm", ["pisa_cmp", "pisa_cmp_win"])
def test_recipe_arms_add_gated_branches_to_the_pisa_arm(arm, rng):
    """The recipe arms are the "pisa" arm plus ``PisaAttention``'s branches: with their gates
    shut they equal it on the same weights, open they differ, and they are never plain dense
    attention (no shared dense stem)."""
    from pisa.eval.gpt import dense_within_budget
    _, plain = _pair("pisa")
    _, recipe = _pair(arm)
    recipe.load_state_dict(plain.state_dict(), strict=False)  # all but the gates
    assert all(b.attn.gate is not None for b in recipe.blocks)
    ids = torch.randint(0, 264, (2, 256))
    with torch.no_grad():
        assert (recipe(ids) - plain(ids)).abs().max() > 1e-4
        for block in recipe.blocks:
            block.attn.gate.bias.fill_(-1e4)
        torch.testing.assert_close(recipe(ids), plain(ids), rtol=1e-4, atol=1e-4)
    assert not dense_within_budget(arm) and dense_within_budget("pisa")
