"""Per-kernel CUDA time of ``pisa_select`` (config A, bf16; per token, or at the selection-v2
knobs given) under torch.profiler, for the
checkout that ``pisa`` imports from (run it with ``PYTHONPATH=<tree>`` from outside that tree, so a
before/after pair compares kernels, not timers). The total is triton's ``do_bench`` median called
here, not ``common.time_ms`` (``pisa.bench``'s, which would come from the tree under test).

    PYTHONPATH=.before python benchmarks/kernels/select_profile.py --json before.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import C, HKV, HQ, K, D, command, kernel_times, meta, randn_qkv, write_result

import pisa
from pisa import pisa_select


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", type=int, default=131072)
    ap.add_argument("--query-tile", type=int, default=None)
    ap.add_argument("--beam-leaf", type=int, default=None)
    ap.add_argument("--scorer", default=None)
    ap.add_argument("--tile-reduce", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    q, k, _ = randn_qkv(args.len, HQ, HKV, D, seed=0)
    knobs = {n: getattr(args, n) for n in ("query_tile", "beam_leaf", "scorer", "tile_reduce")
             if getattr(args, n) is not None}

    def f():
        return pisa_select(q, k, block_size=C, topk=K, **knobs)
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    total = float(do_bench(f, warmup=100, rep=1000, return_mode="median"))
    rows = kernel_times(f, calls=5)
    print(f"pisa from {pisa.__file__} {knobs}: {total:.2f} ms")
    for r in rows[:6]:
        print(f"  {r['kernel'][:50]:50s} {r['ms']:8.3f} ms")
    write_result(args.json, meta("cuda", command(), pisa=pisa.__file__, T=args.len,
                                 select_ms=total, **knobs), rows)


if __name__ == "__main__":
    main()
