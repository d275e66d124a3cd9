"""Training-path benchmark on one GPU: selection, forward, backward, forward+backward.

Times, in one run and on the same random bf16 inputs per length, ``pisa_attn`` with the pyramid,
``flat_mean`` and ``flat_lse`` selectors (Triton backend) against dense SDPA forced to cuDNN, plus
the sparse attention kernel alone (``pisa_attn(block_idx=...)`` on the pyramid's selection) with
its effective TFLOP/s, counting ``4 * HQ * D * keys attended`` per token. Peak memory per row.

    python benchmarks/train_h200.py --config A --json benchmarks/results/train_h200.json

Rows use the project's schema (``pisa.results``); ``tflops`` and ``keys_per_token`` are extra.
``--device cpu`` runs the same rows through the torch backend (a smoke test at small lengths).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common import (CONFIGS, DTYPE, G_BR, Results, attn_tflops, dense_attention, dense_backend,
                    fwd_bwd, keys_attended, peak_gb, pisa_backend, randn_qkv, reset_peak,
                    result_row, shape, time_ms)
from pisa import pisa_attn, pisa_select


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A", choices=sorted(CONFIGS))
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576])
    ap.add_argument("--selectors", nargs="+", default=["pyramid", "flat_mean", "flat_lse"])
    ap.add_argument("--flat-max", type=int, default=1 << 20, help="longest T for flat_mean")
    ap.add_argument("--flat-lse-max", type=int, default=131072, help="longest T for flat_lse")
    ap.add_argument("--dense-max", type=int, default=262144, help="longest T for dense fwd+bwd")
    ap.add_argument("--dense-fwd-max", type=int, default=524288)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--beam", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cuda (Triton backend) or cpu (torch)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    HQ, HKV, D = CONFIGS[args.config]
    C, K, W, dev = args.block_size, args.topk, args.beam, args.device
    backend = pisa_backend(dev)
    knobs = dict(block_size=C, topk=K, beam=W, branching=G_BR, backend=backend)
    cols = shape(HQ, HKV, D, K=K, C=C, W=W)
    out = Results(args.json, dev)

    def row(op, impl, T, ms, peak, **extra):
        out.add(result_row(op, impl, dense_backend(dev) if impl == "dense" else backend, T=T,
                           ms=ms, peak_gb=peak, **cols, **extra))

    def timed(fn):
        reset_peak(dev)
        ms = time_ms(fn, dev)
        return ms, peak_gb(dev)

    for T in args.lengths:
        t0 = time.time()
        q, k, v = randn_qkv(T, HQ, HKV, D, seed=T, device=dev, dtype=DTYPE, requires_grad=True)
        do = torch.randn_like(q)
        for sel in args.selectors:
            if T > {"pyramid": T, "flat_mean": args.flat_max, "flat_lse": args.flat_lse_max}[sel]:
                continue
            impl = "pisa" if sel == "pyramid" else sel
            with torch.no_grad():
                row("select", impl, T, *timed(lambda: pisa_select(q, k, selector=sel, **knobs)))
                row("fwd", impl, T, *timed(lambda: pisa_attn(q, k, v, selector=sel, **knobs)))
            o = pisa_attn(q, k, v, selector=sel, **knobs)
            row("bwd", impl, T, *timed(lambda: torch.autograd.backward(o, do, retain_graph=True)))
            del o
            q.grad = k.grad = v.grad = None
            row("fwdbwd", impl, T, *timed(fwd_bwd(
                lambda: pisa_attn(q, k, v, selector=sel, **knobs), do, (q, k, v))))
            if sel == "pyramid":  # the attention kernel alone, on the pyramid's selection
                idx, _ = pisa_select(q, k, **knobs)
                keys = keys_attended(idx, T, C)
                with torch.no_grad():
                    ms, pk = timed(lambda: pisa_attn(q, k, v, block_idx=idx, **knobs))
                row("attn_fwd", "pisa_kernel", T, ms, pk, keys_per_token=keys,
                    tflops=attn_tflops(ms, T, keys, HQ, D))
                del idx
        if T <= args.dense_fwd_max:
            dense = dense_attention(q.detach(), k.detach(), v.detach(), dev)
            with torch.no_grad():
                row("fwd", "dense", T, *timed(dense))
            if T <= args.dense_max:
                dq, dk, dv = (x.detach().requires_grad_() for x in (q, k, v))
                row("fwdbwd", "dense", T, *timed(fwd_bwd(dense_attention(dq, dk, dv, dev),
                                                         do.transpose(1, 2), (dq, dk, dv))))
                del dq, dk, dv
            del dense
        del q, k, v, do
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"# T={T} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        out.save()  # after every length: a timeout keeps what finished


if __name__ == "__main__":
    main()
