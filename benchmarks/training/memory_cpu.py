"""Peak host memory of the torch backend against sequence length (each point in a fresh process).

For each T it measures the growth of the process's peak RSS (``ru_maxrss``) caused by one op, after
the inputs exist: ``select`` (pyramid selection) and ``fwdbwd`` (pisa_attn forward + backward).
Linear memory means the ratio between successive doublings stays near 2 (the outputs and gradients
are themselves O(T)); a quadratic term would show as 4.

    python benchmarks/training/memory_cpu.py --lengths 8192 16384 32768 65536 \
        --json benchmarks/results/memory_cpu.json
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import Results, result_row, shape

HQ, HKV, D, K, C = 8, 2, 64, 16, 64


def measure(op: str, T: int) -> float:
    """Run in this process: GiB of peak-RSS growth caused by ``op`` at length ``T``."""
    import torch

    from pisa import pisa_attn, pisa_select
    torch.manual_seed(0)
    q = torch.randn(1, T, HQ, D, requires_grad=op == "fwdbwd")
    k = torch.randn(1, T, HKV, D, requires_grad=op == "fwdbwd")
    v = torch.randn(1, T, HKV, D, requires_grad=op == "fwdbwd")
    do = torch.randn_like(q)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if op == "select":
        pisa_select(q, k, topk=K, block_size=C, backend="torch")
    else:
        pisa_attn(q, k, v, topk=K, block_size=C, backend="torch").backward(do)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20  # KiB -> GiB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--json")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(measure(args.child[0], int(args.child[1])))
        return
    res = Results(args.json, "cpu")
    for op in ("select", "fwdbwd"):
        for T in args.lengths:
            child = subprocess.run([sys.executable, __file__, "--child", op, str(T)], check=True,
                                   capture_output=True, text=True).stdout
            gb = float(child.strip().splitlines()[-1])
            res.rows.append(result_row(op, "pisa", "torch", T=T, ms=None, peak_gb=gb,
                                       **shape(HQ, HKV, D, K=K, C=C, W=K, dtype="float32")))
            print(f"{op:7s} T={T:<7d} peak growth {gb:.3f} GiB", flush=True)
    res.save()


if __name__ == "__main__":
    main()
