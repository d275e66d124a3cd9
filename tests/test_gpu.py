"""End-to-end checks on CUDA (skipped without it): the Triton path of the public API in bf16
against the fp32 torch backend, at real sizes."""
import pytest
import torch

from pisa import pisa_attn, pisa_select

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("T", [4096, 32768])
@pytest.mark.parametrize("G,D", [(4, 64), (16, 128), (4, 128), (16, 64)])
def test_bf16_outputs_and_grads_match_fp32_reference(T, G, D, rng):
    HKV = 2 if T > 4096 else 4
    q = torch.randn(1, T, HKV * G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx, counts = pisa_select(q, k, backend="triton")
    ref_idx, ref_counts = pisa_select(q.float(), k.float(), backend="torch")
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same > 0.99, f"triton selection rows equal to the fp32 torch selection: {same:.4f}"
    o = pisa_attn(q, k, v, block_idx=idx, backend="triton")
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = pisa_attn(*ref_in, block_idx=idx, backend="torch")
    assert _rel(o, ref) < 1e-2
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, ref_in, do.float())
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 2e-2


def test_all_blocks_equals_dense_sdpa(rng):
    T, HKV, G, D = 2048, 2, 8, 128
    q = torch.randn(1, T, HKV * G, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    o = pisa_attn(q, k, v, topk=T // 64, backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.repeat_interleave(G, 2).transpose(1, 2).float(),
        v.repeat_interleave(G, 2).transpose(1, 2).float(), is_causal=True).transpose(1, 2)
    assert _rel(o, ref) < 1e-2


def test_deterministic_backward_repeats_bitwise(rng):
    from pisa.ops.attn_triton import sparse_attn_triton
    T, HKV, G, D = 8192, 2, 8, 128
    q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HKV * G, HKV, HKV))
    idx, _ = pisa_select(q, k, backend="triton")
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        o, _ = sparse_attn_triton(q, k, v, idx, 64, D ** -0.5, deterministic=True)
        runs.append(torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_public_path_equals_direct_deterministic_kernel_call(rng):
    """pisa_attn (custom op, atomic dK/dV) against sparse_attn_triton(deterministic=True): the
    forward is the same kernel, so bitwise equal; gradients differ only by summation order."""
    from pisa.ops.attn_triton import sparse_attn_triton
    T, HKV, G, D = 16384, 4, 16, 128
    q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HKV * G, HKV, HKV))
    idx, _ = pisa_select(q, k, backend="triton")
    do = torch.randn_like(q)
    o1, lse1 = pisa_attn(q, k, v, block_idx=idx, return_lse=True, backend="triton")
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    o2, lse2 = sparse_attn_triton(q, k, v, idx, 64, D ** -0.5, deterministic=True)
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    for a, b in zip(g1, g2):
        assert _rel(a, b) < 1e-3


@pytest.mark.parametrize("branching", [3, 4])
def test_fp32_selection_other_branching_matches_torch(branching, rng):
    T, HKV, G, D = 8192, 2, 8, 128
    q = torch.randn(1, T, HKV * G, D, device="cuda")
    k = torch.randn(1, T, HKV, D, device="cuda")
    idx, counts = pisa_select(q, k, branching=branching, backend="triton")
    ref_idx, ref_counts = pisa_select(q, k, branching=branching, backend="torch")
    assert torch.equal(counts, ref_counts)
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same > 0.999, f"rows equal to the torch selection: {same:.5f}"


def test_model_compiles_with_inductor_fullgraph(rng):
    """torch.compile(fullgraph=True) with the default inductor backend over a small PISA model on
    the GPU: same output as eager, and gradients flow."""
    from pisa import PisaAttention
    torch._dynamo.reset()
    layer = torch.nn.Sequential(PisaAttention(256, 8, 2, block_size=64, topk=4),
                                PisaAttention(256, 8, 2, block_size=64, topk=4)).cuda()
    x = torch.randn(2, 2048, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert _rel(compiled, eager) < 2e-2
    compiled.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
