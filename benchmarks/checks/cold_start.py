"""Cold start: what the first ``pisa_attn`` call at a new sequence length costs.

Config A (bf16, B=1, HQ=64, HKV=4, D=128, C=64, K=W=16), forward+backward, Triton backend. One
fresh process with an empty Triton cache (``TRITON_CACHE_DIR`` a new temporary folder, so nothing
compiled by an earlier run is reused) times

- the first call of the process at ``--warm-len`` (the JIT of every kernel: the first-call cost),
- then, for ``--n`` lengths drawn log-uniformly from ``[--min-len, --max-len]`` (seeded, any
  integer, most not multiples of 16), the first call at that length and its steady state (median
  of ``--reps`` further calls), all wall clock with the device synchronised, and how many kernel
  variants each first call compiled (``pisa.bench.triton_variants``).

The bar (issue 12): after one warm-up call, every first call at a new length costs < 1.5x its
steady state.

    python benchmarks/checks/cold_start.py --json benchmarks/results/cold_start_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

BAR = 1.5


def _worker(args) -> list[dict]:
    import torch
    from common import C, HKV, HQ, K, D, randn_qkv
    from pisa import pisa_attn
    from pisa.bench import triton_variants

    def call(T):
        q, k, v = randn_qkv(T, HQ, HKV, D, seed=T, requires_grad=True)
        do = torch.randn_like(q)
        torch.cuda.synchronize()

        def once():
            t0 = time.perf_counter()
            pisa_attn(q, k, v, block_size=C, topk=K).backward(do)
            torch.cuda.synchronize()
            q.grad = k.grad = v.grad = None
            return (time.perf_counter() - t0) * 1e3
        return once

    rows = []
    once = call(args.warm_len)
    n0 = triton_variants()
    first = once()
    rows.append({"T": args.warm_len, "what": "first call of the process", "first_ms": first,
                 "steady_ms": statistics.median(once() for _ in range(args.reps)),
                 "compiled": triton_variants() - n0})
    rng = random.Random(args.seed)
    lo, hi = args.min_len, args.max_len
    lengths = [int(lo * (hi / lo) ** rng.random()) for _ in range(args.n)]
    for T in lengths:
        once = call(T)
        n0 = triton_variants()
        first = once()
        compiled = triton_variants() - n0
        steady = statistics.median(once() for _ in range(args.reps))
        rows.append({"T": T, "what": "first call at a new length", "first_ms": first,
                     "steady_ms": steady, "ratio": first / steady, "compiled": compiled})
        print(json.dumps(rows[-1]), flush=True)
        del once
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm-len", type=int, default=8192)
    ap.add_argument("--min-len", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=1 << 20)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("ROWS " + json.dumps(_worker(args)), flush=True)
        return
    from common import command, meta, shape, write_result
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                             check=True, stdout=subprocess.PIPE, text=True).stdout
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("ROWS "))[5:])
    new = [r for r in rows if "ratio" in r]
    worst = max(r["ratio"] for r in new)
    for r in rows:
        r.update(shape(), op="fwdbwd", impl="pisa", backend="triton")
    ok = worst < BAR
    write_result(args.json, meta("cuda", command(), bar=BAR, worst_ratio=worst, passed=ok,
                                 first_call_ms=rows[0]["first_ms"]), rows)
    print(f"first call {rows[0]['first_ms']:.0f} ms; worst new-length ratio {worst:.2f} "
          f"({'PASS' if ok else 'FAIL'} < {BAR})")


if __name__ == "__main__":
    main()
