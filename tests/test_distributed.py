"""``pisa.distributed``: context-parallel selection and attention on gloo (CPU), 2 and 4 processes
spawned by ``torch.multiprocessing``, against single-process ``pisa_select`` / ``pisa_attn`` of
the gathered sequence (fp64 torch backend: selections and forward outputs bitwise, dK / dV up to
their summation order). One process group per test serves all its cases."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pisa import PisaAttention, pisa_attn, pisa_select
from pisa.distributed import (comm_bytes, pisa_attn_cp, pisa_select_cp, reset_comm_bytes, shard,
                              shard_positions, unshard, zigzag_ranges)
from pisa.ops.utils.config import QUERY_TILE

C = 8
PER_TOKEN = dict(query_tile=1, scorer="lse", tile_reduce="sum", beam_leaf=None)
# (layout, T, contiguous shard lengths or None, HQ, HKV, knobs); without query_tile: the
# defaults, 8-token (min(16, C)) qmean tiles with the bound scorer
CASES_2 = [
    ("zigzag", 300, None, 4, 2, dict(topk=5, beam=3, **PER_TOKEN)),
    ("zigzag", 300, None, 4, 2, dict(topk=5, beam=3)),
    ("contiguous", 203, [96, 107], 4, 1, dict(topk=5, beam=3)),  # ragged, GQA 4
    ("zigzag", 257, None, 2, 2, dict(topk=4, beam=2, scorer="bound", query_tile=4)),
    ("contiguous", 160, [40, 120], 4, 2, dict(topk=6, beam_leaf=4, tile_reduce="lse",
                                              query_tile=2, forced_in_budget=False)),
    ("zigzag", 200, None, 4, 2, dict(topk=5, selector="flat_mean")),
    ("contiguous", 203, [96, 107], 4, 1, dict(topk=5, beam=3, tile_reduce="mass")),
]
CASES_4 = [
    ("zigzag", 330, None, 4, 2, dict(topk=5, beam=3)),
    ("zigzag", 330, None, 4, 2, dict(topk=5, beam=3, **PER_TOKEN)),
    ("contiguous", 300, [64, 24, 136, 76], 2, 1, dict(topk=4, beam=2, query_tile=4)),
]


def _run(world: int, fn, tmp_path, backend: str = "gloo") -> None:
    mp.spawn(_worker, args=(world, fn, str(tmp_path / "store"), backend), nprocs=world)


def _worker(rank: int, world: int, fn, store: str, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        fn()
    finally:
        dist.destroy_process_group()
    # Leave without running the interpreter's teardown: gloo's threads, destroyed there, aborted
    # about every other run ("terminate called without an active exception", SIGABRT) after
    # every check had passed. A failure above still raises (mp.spawn reports it).
    os._exit(0)


def _inputs(T, HQ, HKV, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, T, HQ, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, T, HKV, 16, dtype=torch.float64, generator=g)
    v = torch.randn(2, T, HKV, 16, dtype=torch.float64, generator=g)
    do = torch.randn(2, T, HQ, 16, dtype=torch.float64, generator=g)
    return q, k, v, do


def _check_cases(cases):
    for layout, T, lengths, HQ, HKV, knobs in cases:
        what = f"{layout} T={T} lengths={lengths} HQ={HQ} HKV={HKV} {knobs}"
        kw = dict(block_size=C, backend="torch", **knobs)
        cut = dict(layout=layout, block_size=C, lengths=lengths)
        q, k, v, do = _inputs(T, HQ, HKV)
        # selection: this rank's rows of the single-process one (per token or per tile)
        idx, _ = pisa_select(q, k, **kw)
        qt = knobs.get("query_tile") or min(QUERY_TILE, C)
        ql, kl, vl = (shard(x, **cut) for x in (q, k, v))
        want = shard(idx, layout=layout, block_size=C // qt,
                     lengths=None if lengths is None else [n // qt for n in lengths[:-1]]
                     + [idx.shape[1] - sum(n // qt for n in lengths[:-1])])
        assert torch.equal(pisa_select_cp(ql, kl, layout=layout, **kw), want), what
        # attention, lse and gradients
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o, lse = pisa_attn(q, k, v, return_lse=True, **kw)
        (o * do).sum().backward()
        ql, kl, vl = (shard(x.detach(), **cut).requires_grad_() for x in (q, k, v))
        ol, lsel = pisa_attn_cp(ql, kl, vl, layout=layout, return_lse=True, **kw)
        (ol * shard(do, **cut)).sum().backward()
        assert torch.equal(ol, shard(o.detach(), **cut)), what
        assert torch.equal(lsel, shard(lse.detach(), dim=2, **cut)), what
        assert torch.equal(ql.grad, shard(q.grad, **cut)), what
        for name, full, part in (("dk", k.grad, kl.grad), ("dv", v.grad, vl.grad)):
            torch.testing.assert_close(part, shard(full, **cut), rtol=1e-12, atol=1e-12,
                                       msg=f"{name}: {what}")
            torch.testing.assert_close(unshard(part, layout=layout, block_size=C), full,
                                       rtol=1e-12, atol=1e-12)


def _two_ranks():
    _check_cases(CASES_2)
    # communication is counted; a shard of the wrong length is refused by name
    reset_comm_bytes()
    q, k, v, _ = _inputs(300, 4, 2)
    pisa_attn_cp(*(shard(x, block_size=C) for x in (q, k, v)), block_size=C, topk=5,
                 backend="torch")
    sent = comm_bytes()
    assert sent["kv"] > 0 and sent["summaries"] > 0 and sent["total"] == sum(
        n for key, n in sent.items() if key != "total")
    with pytest.raises(ValueError, match="layout='zigzag'"):
        pisa_attn_cp(q[:, :150], k[:, :150], v[:, :150], block_size=C, backend="torch")
    # the layer: a sharded forward and backward equal the single-process layer's
    torch.manual_seed(0)
    layer = PisaAttention(32, 4, 2, block_size=C, topk=4, backend="torch").double()
    cp_layer = PisaAttention(32, 4, 2, block_size=C, topk=4, backend="torch",
                             cp_group=dist.group.WORLD).double()
    cp_layer.load_state_dict(layer.state_dict())
    x = torch.randn(2, 200, 32, dtype=torch.float64)
    y = layer(x)
    y.square().sum().backward()
    y_cp = cp_layer(shard(x, block_size=C))
    y_cp.square().sum().backward()
    torch.testing.assert_close(y_cp, shard(y.detach(), block_size=C), rtol=1e-12, atol=1e-12)
    for p, p_cp in zip(layer.parameters(), cp_layer.parameters()):
        dist.all_reduce(p_cp.grad)
        torch.testing.assert_close(p_cp.grad, p.grad, rtol=1e-10, atol=1e-10)
    assert torch.equal(shard_positions(200, block_size=C), shard(torch.arange(200)[None],
                                                                 block_size=C)[0])


def test_two_ranks(tmp_path):
    _run(2, _two_ranks, tmp_path)


def _four_ranks():
    _check_cases(CASES_4)


def test_four_ranks(tmp_path):
    _run(4, _four_ranks, tmp_path)


def test_zigzag_ranges():
    """Rank r holds chunks r and 2W-1-r of whole blocks; together they tile the sequence."""
    ranges = zigzag_ranges(1000, 2, 64)
    assert ranges == [((0, 256), (768, 1000)), ((256, 512), (512, 768))]
    spans = sorted(r for rank in zigzag_ranges(333, 3, 8) for r in rank)
    assert spans[0][0] == 0 and spans[-1][1] == 333
    assert all(a[1] == b[0] and a[1] % 8 == 0 for a, b in zip(spans, spans[1:]))


def _one_rank_cuda():
    """The one-rank path on the GPU (NCCL, Triton): bf16, the library defaults, 16K tokens, GQA
    16; o, lse and the gradients equal ``pisa_attn``'s on the same inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 16384, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (64, 4, 4, 64))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = pisa_attn(q, k, v, return_lse=True)
    want = torch.autograd.grad((o.float() * do).sum(), (q, k, v))
    ol, lsel = pisa_attn_cp(q, k, v, return_lse=True)
    got = torch.autograd.grad((ol.float() * do).sum(), (q, k, v))
    assert torch.equal(ol, o) and torch.equal(lsel, lse)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_one_rank_nccl_equals_pisa_attn(tmp_path):
    _run(1, _one_rank_cuda, tmp_path, backend="nccl")
