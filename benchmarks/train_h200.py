"""Training-path benchmark on one GPU: selection, forward, backward, forward+backward.

Times, in one run and on the same random bf16 inputs per length, ``pisa_attn`` with the pyramid,
``flat_mean`` and ``flat_lse`` selectors (Triton backend) against dense SDPA forced to cuDNN, plus
the sparse attention kernel alone (given indices) with its effective TFLOP/s, counting
``4 * HQ * D * keys attended`` per token (x2.5 for the backward). Peak memory per row.

    python benchmarks/train_h200.py --config A --json benchmarks/results/train_h200.json

Rows use the project's schema (``pisa/bench.py``); ``tflops`` and ``keys_per_token`` are extra.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pisa import pisa_attn, pisa_select
from pisa.bench import dense_attention, keys_attended, meta, peak_gb, reset_peak, time_ms
from pisa.ops.attn import sparse_attn

CONFIGS = {"A": (64, 4, 128), "B": (32, 8, 128)}


def main() -> None:
    ap = argparse.ArgumentParser()
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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    HQ, HKV, D = CONFIGS[args.config]
    C, K, W, dev = args.block_size, args.topk, args.beam, "cuda"
    knobs = dict(block_size=C, topk=K, beam=W, backend="triton")
    rows = []

    def row(op, impl, T, ms, peak, **extra):
        r = {"op": op, "impl": impl, "backend": "triton" if impl != "dense" else "cudnn",
             "B": 1, "T": T, "HQ": HQ, "HKV": HKV, "D": D, "K": K, "C": C, "g": 2, "W": W,
             "dtype": "bfloat16", "ms": ms, "peak_gb": peak, "recall": None, "mass": None,
             **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    def timed(fn):
        reset_peak(dev)
        ms = time_ms(fn, dev)
        return ms, peak_gb(dev)

    for T in args.lengths:
        t0 = time.time()
        torch.manual_seed(T)
        q = torch.randn(1, T, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, T, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, T, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
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

            def fwdbwd():
                torch.autograd.backward(pisa_attn(q, k, v, selector=sel, **knobs), do)
                q.grad = k.grad = v.grad = None
            row("fwdbwd", impl, T, *timed(fwdbwd))
            if sel == "pyramid":  # the attention kernel alone, on the pyramid's selection
                idx, _ = pisa_select(q, k, **knobs)
                keys = keys_attended(idx, T, C)
                with torch.no_grad():
                    ms, pk = timed(lambda: sparse_attn(q, k, v, idx, C, D ** -0.5, "triton"))
                row("attn_fwd", "pisa_kernel", T, ms, pk, keys_per_token=keys,
                    tflops=4 * HQ * D * keys * T / ms / 1e9)
                del idx
        if T <= args.dense_fwd_max:
            dense = dense_attention(q.detach(), k.detach(), v.detach(), dev)
            with torch.no_grad():
                row("fwd", "dense", T, *timed(dense))
            if T <= args.dense_max:
                dq, dk, dv = (x.detach().requires_grad_() for x in (q, k, v))
                dense_g = dense_attention(dq, dk, dv, dev)

                def dense_fb():
                    torch.autograd.backward(dense_g(), do.transpose(1, 2))
                    dq.grad = dk.grad = dv.grad = None
                row("fwdbwd", "dense", T, *timed(dense_fb))
                del dq, dk, dv, dense_g
            del dense
        del q, k, v, do
        torch.cuda.empty_cache()
        print(f"# T={T} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        if args.json:  # write after every length: a timeout keeps what finished
            result = {"meta": meta(dev, "python " + " ".join(sys.argv)), "rows": rows}
            args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
