import pytest
import torch

from pisa.eval.gpt import GPT, GPTConfig


def _pair(arm, **kw):
    dense = GPT(GPTConfig(width=32, depth=2, heads=2, kv_heads=1, mlp_hidden=64, arm="dense"))
    sparse = GPT(GPTConfig(width=32, depth=2, heads=2, kv_heads=1, mlp_hidden=64, arm=arm,
                           topk=4, block_size=16, **kw))
    sparse.load_state_dict(dense.state_dict())
    return dense.eval(), sparse.eval()


@pytest.mark.parametrize("arm", ["pisa", "flat_mean", "flat_lse"])
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
