"""Context parallelism on H200s: one config-A layer (bf16, B = 1, HQ = 64, HKV = 4, D = 128,
C = 64, K = W = 16) forward + backward, selection included, with its sequence over the ranks
(``pisa.distributed.pisa_attn_cp``, zigzag shards) against ``pisa_attn`` on one GPU.

    torchrun --nproc_per_node 2 benchmarks/distributed/cp_h200.py --json cp_h200.json
    torchrun --nproc_per_node 2 benchmarks/distributed/cp_h200.py --smoke  # gloo on CPU, tiny

Rows (``pisa.results`` schema; ``impl`` "cp" or "single", ``ranks``): ``ms`` is the slowest
rank's median of ``--reps`` fwd + bwd steps (a barrier before each, so every rank starts
together); ``peak_gb`` the largest per-rank peak of allocated memory (``peak_gb_ranks`` lists
all); ``sent_gb`` the bytes the busiest rank sends per step (``sent`` per phase, from
``pisa.distributed.comm_bytes``) against ``kv_gb``, the K and V of the whole sequence, and
``shard_kv_gb``, one rank's. Defaults: CP at 1M and 2M (``--lengths``), the single GPU at 1M
(``--single-lengths``, rank 0 alone while the others wait).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import BATCH, C, D, DTYPE, HKV, HQ, K, W, Results, result_row, shape

from pisa import pisa_attn
from pisa.distributed import comm_bytes, make_layout, pisa_attn_cp, reset_comm_bytes

SMOKE = dict(HQ=8, HKV=2, D=32, C=16, K=8, dtype=torch.float32, lengths=[2048],
             single=[2048])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1 << 20, 1 << 21],
                   help="global sequence lengths of the CP runs (default 1M 2M)")
    p.add_argument("--single-lengths", type=int, nargs="*", default=[1 << 20],
                   help="lengths of the one-GPU baseline (default 1M; none: skip it)")
    p.add_argument("--reps", type=int, default=3, help="timed steps (default 3, after one warm-up)")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--smoke", action="store_true",
                   help="gloo on CPU at a tiny size (HQ=8, HKV=2, D=32, C=16, K=8, T=2048, fp32)")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    return p.parse_args(argv)


def _timed(step, reps: int, device: str) -> float:
    """Median ms of ``reps`` calls of ``step`` after one warm-up, slowest rank (a collective)."""
    times = []
    for i in range(reps + 1):
        dist.barrier()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _per_rank(x: float, device: str) -> list[float]:
    out = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    out[dist.get_rank()] = x
    dist.all_reduce(out)
    return out.tolist()


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else 0.0


def _reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def main(argv=None) -> None:
    args = parse_args(argv)
    sizes = dict(HQ=HQ, HKV=HKV, D=D, C=C, K=K, dtype=DTYPE, lengths=args.lengths,
                 single=args.single_lengths)
    if args.smoke:
        sizes = SMOKE
    cuda = not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    backend = "triton" if cuda else "torch"
    hq, hkv, d, c, k_top, dtype = (sizes[n] for n in ("HQ", "HKV", "D", "C", "K", "dtype"))
    knobs = dict(block_size=c, topk=k_top, beam=k_top, backend=backend)
    res = Results(args.json if rank == 0 else None, device, ranks=world, layout=args.layout)
    cols = shape(hq, hkv, d, B=BATCH, K=k_top, C=c, W=k_top if args.smoke else W,
                 dtype=str(dtype).removeprefix("torch."))
    elt = torch.empty(0, dtype=dtype).element_size()

    def inputs(T_local: int, seed: int):
        gen = torch.Generator(device=device).manual_seed(seed)
        return [torch.randn(BATCH, T_local, h, d, device=device, dtype=dtype, generator=gen)
                .requires_grad_() for h in (hq, hkv, hkv)]

    for T in sizes["lengths"]:
        lay = make_layout(T, world=world, rank=rank, layout=args.layout, block_size=c)
        q, k, v = inputs(lay.local_len(), 1000 + rank)
        grad = torch.randn_like(q)

        def step():
            reset_comm_bytes()
            o = pisa_attn_cp(q, k, v, layout=lay, **knobs)
            o.backward(grad)
            for x in (q, k, v):
                x.grad = None

        _reset(device)
        ms = _timed(step, args.reps, device)
        sent = comm_bytes()
        busiest = max(_per_rank(sent["total"], device))
        peaks = _per_rank(_peak(device), device)
        kv = 2 * BATCH * T * hkv * d * elt
        if rank == 0:
            res.add(result_row("fwd_bwd", "cp", backend, T=T, ms=ms,
                               peak_gb=max(peaks) if cuda else None, ranks=world,
                               peak_gb_ranks=peaks if cuda else None, sent_gb=busiest / 2**30,
                               sent={n: b / 2**30 for n, b in sent.items()}, kv_gb=kv / 2**30,
                               shard_kv_gb=kv / world / 2**30, **cols))
            res.save()
        del q, k, v, grad
    for T in sizes["single"]:
        _reset(device)
        if rank == 0:
            q, k, v = inputs(T, 0)
            grad = torch.randn_like(q)

            def single():
                pisa_attn(q, k, v, **knobs).backward(grad)
                for x in (q, k, v):
                    x.grad = None

            times = []
            for i in range(args.reps + 1):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                single()
                if cuda:
                    torch.cuda.synchronize()
                if i:
                    times.append((time.perf_counter() - t0) * 1e3)
            res.add(result_row("fwd_bwd", "single", backend, T=T, ms=statistics.median(times),
                               peak_gb=_peak(device) if cuda else None, ranks=1, **cols))
            res.save()
            del q, k, v, grad
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
