"""The fused Triton decode step on CUDA (skipped without it), bf16 at real sizes: against fp32
references of the selection and the attention, against the prefill rows of the training kernels
while decoding token by token, and under CUDA-graph capture and replay."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from pisa.ops.attn import sparse_attn  # noqa: E402
from pisa.ops.decode_triton import decode_triton  # noqa: E402
from pisa.ops.kvcache import append_kv  # noqa: E402
from pisa.ops.pyramid import level_offsets  # noqa: E402
from pisa.ops.select import select  # noqa: E402
from pisa.ops.utils import SelectConfig  # noqa: E402

BF16 = torch.bfloat16


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _qkv(B, T, HKV, G, D, seed, dtype=BF16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, T, h, D, device="cuda", dtype=dtype, generator=gen)
            for h in (HKV * G, HKV, HKV)]


def _cache(k, v, seqlens, T_max, cfg: SelectConfig):
    """An empty cache of ``T_max`` slots per sequence, filled with each sequence's first
    ``seqlens[b]`` keys through ``append_kv`` (one sequence at a time: the lengths differ)."""
    B, _, H, D = k.shape
    k_cache = torch.zeros(B, T_max, H, D, device="cuda", dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    sums = torch.zeros(B, level_offsets(T_max, cfg.block_size, cfg.branching)[-1], H, D,
                       device="cuda", dtype=torch.float32)
    zero = torch.zeros(1, device="cuda", dtype=torch.int32)
    for b, s in enumerate(seqlens):
        append_kv(k_cache[b:b + 1], v_cache[b:b + 1], sums[b:b + 1], k[b:b + 1, :s],
                  v[b:b + 1, :s], zero, cfg.block_size, cfg.branching)
    return k_cache, v_cache, sums, torch.tensor(seqlens, device="cuda", dtype=torch.int32)


def _reference(q, k, v, seqlens, idx, cfg: SelectConfig):
    """Per sequence, fp32: the torch backend's selection of the last position over its keys, and
    the attention over the decode's own selection ``idx [B, 1, HKV, S]``."""
    sel, outs, lses = [], [], []
    for b, s in enumerate(seqlens):
        qb, kb, vb = q[b:b + 1].float(), k[b:b + 1, :s].float(), v[b:b + 1, :s].float()
        sel.append(select(qb, kb, cfg, "torch")[0])
        o, lse = sparse_attn(qb, kb, vb, idx[b:b + 1], cfg.block_size, cfg.scale, "torch")
        outs.append(o)
        lses.append(lse)
    return torch.cat(sel), torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("T_max,splits,g,dtype", [
    (4096, None, 2, BF16), (4096, 1, 4, BF16), (32768, None, 2, BF16), (32768, 1, 2, BF16),
    (4096, 3, 2, torch.float16), (4096, None, 2, torch.float32)])
def test_decode_matches_fp32_reference(T_max, splits, g, dtype):
    """Batch 3, mixed lengths (a full cache, 3/4 of it, a short one): the selection equals the
    fp32 torch selection up to near-ties, the output the fp32 attention over it."""
    B, HKV, G, D = 3, 4, 8, 128
    cfg = SelectConfig(block_size=64, topk=16, branching=g, beam=16, scale=D ** -0.5)
    seqlens = [T_max, T_max * 3 // 4 + 5, 777]
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=T_max, dtype=dtype)  # G = 0: keys and values only
    q = _qkv(B, 1, HKV, G, D, seed=T_max + 1, dtype=dtype)[0]
    k_cache, v_cache, sums, lens = _cache(k, v, seqlens, T_max, cfg)
    o, lse, idx = decode_triton(q, k_cache, v_cache, sums, lens, cfg, num_splits=splits,
                                return_block_idx=True)
    ref_idx, ref_o, ref_lse = _reference(q, k, v, seqlens, idx, cfg)
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same >= 0.9, f"(sequence, KV head) rows selected as by fp32 torch: {same:.3f}"
    assert _rel(o, ref_o) < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-2)


def test_tuning_knobs_keep_results():
    """``num_stages`` only changes when tiles are loaded, not the arithmetic: bitwise the default's
    outputs and selection. ``num_warps=4`` changes tile layouts (reduction orders): the same
    selection up to near-ties, and where it is the same, the same output to bf16 accuracy. 64K
    cache: several walk levels skipped and several ranked."""
    B, HKV, G, D, T_max = 3, 4, 16, 128, 65536
    cfg = SelectConfig(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=5)
    q = _qkv(B, 1, HKV, G, D, seed=6)[0]
    k_cache, v_cache, sums, lens = _cache(k, v, [T_max, 40000, 777], T_max, cfg)

    def run(**kw):
        return decode_triton(q, k_cache, v_cache, sums, lens, cfg, num_splits=4,
                             return_block_idx=True, **kw)
    o, lse, idx = run()
    for stages in (1, 2, 4):
        o_s, lse_s, idx_s = run(num_stages=stages)
        assert torch.equal(idx_s, idx) and torch.equal(o_s, o) and torch.equal(lse_s, lse), stages
    o_w, lse_w, idx_w = run(num_warps=4)
    same = (idx_w == idx).all(-1)  # [B, 1, HKV]
    assert same.float().mean().item() >= 0.9
    heads = same.repeat_interleave(G, dim=2)  # [B, 1, HQ]: the heads of those KV heads
    assert _rel(o_w[heads], o[heads]) < 1e-2
    torch.testing.assert_close(lse_w[heads[:, 0]], lse[heads[:, 0]], rtol=0, atol=2e-2)


def test_token_by_token_decode_equals_prefill_rows():
    """Append and decode the last ``P`` tokens of each sequence one at a time; each step equals
    that row of prefill (Triton selection + sparse attention over the whole prefix). Selections
    may differ only on near-ties (append and prefill sum the pyramid in different orders): rows
    that differ are checked against attention over the decode's own selection instead."""
    B, HKV, G, D, P = 2, 2, 8, 128, 6
    cfg = SelectConfig(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    lengths = [8192, 5000]
    q, k, v = _qkv(B, 8192, HKV, G, D, seed=7)
    k_cache, v_cache, sums, lens = _cache(k, v, [n - P for n in lengths], 8192, cfg)
    prefill = []
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b:b + 1, n - P:n], k[b:b + 1, :n], v[b:b + 1, :n]
        idx, _ = select(qb, kb, cfg, "triton")
        prefill.append((idx, sparse_attn(qb, kb, vb, idx, cfg.block_size, cfg.scale, "triton")[0]))
    n_same = 0
    for p in range(P):
        pos = lens.long()
        rows = torch.arange(B, device="cuda")
        append_kv(k_cache, v_cache, sums, k[rows, pos][:, None], v[rows, pos][:, None], lens,
                  cfg.block_size, cfg.branching)
        lens += 1
        o, _, idx = decode_triton(q[rows, pos][:, None], k_cache, v_cache, sums, lens, cfg,
                                  return_block_idx=True)
        for b, n in enumerate(lengths):
            want_idx, want_o = prefill[b][0][:, p:p + 1], prefill[b][1][:, p:p + 1]
            if torch.equal(idx[b:b + 1], want_idx):
                n_same += 1
                assert _rel(o[b:b + 1], want_o) < 1e-2, (p, b)
            else:
                qb = q[b:b + 1, n - P + p:n - P + p + 1].float()
                kb, vb = k[b:b + 1, :n - P + p + 1].float(), v[b:b + 1, :n - P + p + 1].float()
                ref, _ = sparse_attn(qb, kb, vb, idx[b:b + 1], cfg.block_size, cfg.scale, "torch")
                assert _rel(o[b:b + 1], ref) < 1e-2, (p, b)
    assert n_same >= 0.9 * P * B, f"{n_same} of {P * B} decode rows selected as prefill did"


def test_cuda_graph_replay_equals_eager():
    """append_kv + advance the lengths + decode_triton, captured once; two replays with new
    inputs give bitwise the outputs of the same two steps run eagerly from the same cache."""
    B, T_max, HKV, G, D = 4, 8192, 2, 8, 128
    cfg = SelectConfig(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    seqlens = [5000, 100, 8000, 64]
    _, k, v = _qkv(B, T_max, HKV, 0, D, seed=11)
    state0 = _cache(k, v, seqlens, T_max, cfg)
    inputs = [_qkv(B, 1, HKV, G, D, seed=20 + i) for i in range(2)]

    def step(state, q, k_new, v_new):
        k_cache, v_cache, sums, lens = state
        append_kv(k_cache, v_cache, sums, k_new, v_new, lens, cfg.block_size, cfg.branching)
        lens.add_(1)
        return decode_triton(q, k_cache, v_cache, sums, lens, cfg)

    eager_state = [x.clone() for x in state0]
    eager = [step(eager_state, *x) for x in inputs]  # also compiles the kernels

    warm = [x.clone() for x in state0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(warm, *inputs[0])
    torch.cuda.current_stream().wait_stream(side)
    state = [x.clone() for x in state0]
    static = [torch.empty_like(x) for x in inputs[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(state, *static)
    for x, (o_want, lse_want) in zip(inputs, eager):
        for dst, src in zip(static, x):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], o_want) and torch.equal(out[1], lse_want)
    assert torch.equal(state[3], eager_state[3])
