"""Packed sequences on one GPU: ``pisa_attn_varlen`` against a batch of equal-length sequences
and one long sequence, selection included, forward and forward+backward.

Config A (bf16, HQ = 64, HKV = 4, D = 128, C = 64, K = 16), the same random tokens in every arm:

- ``varlen``: ``--docs`` documents of ``--doc-len`` tokens packed into one
  ``[docs * doc_len, H, D]`` row (``pisa_attn_varlen``, each document attended alone);
- ``batch``: the same documents as a batch ``[docs, doc_len, H, D]`` (``pisa_attn``): the cost
  varlen should match (its layout copies and tables on top);
- ``long``: the row as one sequence of ``docs * doc_len`` tokens (``pisa_attn``): deeper
  pyramids, every block a candidate of every later query.

Times (``common.time_ms``: triton's ``do_bench`` median on CUDA) ``fwd`` and ``fwdbwd`` per arm,
with peak memory, as rows of ``pisa.results`` written to ``--out``; ``--profile`` adds to each
row its 12 longest kernels (``common.kernel_times``: device ms per call), to see where varlen's
extra time goes.

    python benchmarks/training/varlen_h200.py --profile --out benchmarks/results/varlen_h200_v2.json

``--smoke`` runs tiny sizes through the torch backend on the CPU (a check that it runs).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (CONFIGS, DTYPE, G_BR, Results, fwd_bwd, kernel_times, peak_gb, pisa_backend,
                    reset_peak, result_row, shape, time_ms)
from pisa import pisa_attn, pisa_attn_varlen
from pisa.ops.utils.config import SelectConfig, query_tile_of

ARMS = ("varlen", "batch", "long")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A", choices=sorted(CONFIGS))
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=SelectConfig.topk)
    ap.add_argument("--block-size", type=int, default=SelectConfig.block_size)
    ap.add_argument("--query-tile", type=int, default=None, help="default: the library's")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, torch backend on the CPU (HQ=4, HKV=2, D=16, 4 x 96, C=16)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of each row (CUDA)")
    ap.add_argument("--out", type=Path, help="JSON result file")
    args = ap.parse_args()
    HQ, HKV, D = CONFIGS[args.config]
    dev, dtype = "cuda", DTYPE
    if args.smoke:
        HQ, HKV, D, dev, dtype = 4, 2, 16, "cpu", torch.float32
        args.docs, args.doc_len, args.block_size, args.topk = 4, 96, 16, 4
    backend = pisa_backend(dev)
    n, L = args.docs, args.doc_len
    tile = query_tile_of(args.query_tile, args.block_size)
    knobs = dict(block_size=args.block_size, topk=args.topk, branching=G_BR,
                 query_tile=tile, backend=backend)
    saved = {name: x for name, x in knobs.items() if name != "backend"}
    out = Results(args.out, dev, docs=n, doc_len=L, knobs=saved)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(n * L, h, D, device=dev, dtype=dtype, generator=gen)
               .requires_grad_() for h in (HQ, HKV, HKV))
    do = torch.randn_like(q)
    cu = torch.arange(0, n * L + 1, L, device=dev, dtype=torch.int32)
    calls = {
        "varlen": (lambda: pisa_attn_varlen(q, k, v, cu, cu, L, L, **knobs), do, n, L),
        "batch": (lambda: pisa_attn(q.view(n, L, HQ, D), k.view(n, L, HKV, D),
                                    v.view(n, L, HKV, D), **knobs), do.view(n, L, HQ, D), n, L),
        "long": (lambda: pisa_attn(q[None], k[None], v[None], **knobs), do[None], 1, n * L),
    }
    for arm in args.arms:
        fwd, grad, B, T = calls[arm]
        for op, fn in (("fwd", fwd), ("fwdbwd", fwd_bwd(fwd, grad, (q, k, v)))):
            reset_peak(dev)
            with torch.no_grad() if op == "fwd" else torch.enable_grad():
                ms = time_ms(fn, dev)
                gb = peak_gb(dev)
                prof = {"kernels": kernel_times(fn, top=12)} if args.profile else {}
            out.add(result_row(op, arm, backend, T=T, ms=ms, peak_gb=gb, docs=n,
                               doc_len=L, query_tile=tile, **prof,
                               **dict(shape(HQ, HKV, D, K=args.topk, C=args.block_size, W=args.topk,
                                            dtype=str(dtype).removeprefix("torch.")), B=B)))
        out.save()
        print(f"# {arm} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
