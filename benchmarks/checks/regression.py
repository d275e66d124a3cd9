"""Before/after check of a refactor on one GPU: the public paths of two checkouts, timed in one run.

Times, per checkout, on the same seeded random bf16 inputs (config A: B=1, HQ=64, HKV=4, D=128,
C=64, K=W=16, g=2): ``pisa_select`` at ``--select-len`` (default 128K), ``pisa_attn``
forward+backward at ``--train-len`` (128K) and one decode step ``pisa_attn_with_kvcache`` against a
cache of ``--decode-len`` (1M) keys (no append), captured in a CUDA graph and replayed (as
``decode_h200.py`` times it; ``decode_eager``: the same step called from Python, input checks and
launch overhead included). The checkouts alternate ``--rounds`` times, each in a fresh process
whose ``PYTHONPATH`` is the checkout (so each imports its own ``pisa``); a row's ``ms`` is the
median over rounds of ``time_ms`` (``pisa.bench``: do_bench medians, CUDA events). The child
processes import nothing but the checkout's ``pisa`` (``common`` would bind them to this
checkout's helpers, which an older tree's ``pisa.bench`` may lack); this process writes the rows
and meta through ``common``.

    mkdir .before && git archive de2d551 pisa | tar -x -C .before   # the tree before the move
    python benchmarks/checks/regression.py --trees before=.before after=. --json results.json

Rows use the project's schema (``pisa.results``) with extra columns ``tree`` and ``round_ms``;
``meta["ratio"]`` gives ``after / before`` per op; ``meta["equivalence"]`` compares the trees'
outputs at ``--compare-len`` (``_outputs``: exact-match share of the selections, relative L2 error
of outputs, LSE, gradients and a decode step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

B, HQ, HKV, D, C, K, G_BR = 1, 64, 4, 128, 64, 16, 2
OPS = ("select", "fwdbwd", "decode", "decode_eager")


def _randn(gen, *shape):
    import torch
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def _time_select(gen, T: int) -> float:
    from pisa import pisa_select
    from pisa.bench import time_ms
    q, k = _randn(gen, B, T, HQ, D), _randn(gen, B, T, HKV, D)
    return time_ms(lambda: pisa_select(q, k, block_size=C, topk=K), "cuda")


def _time_fwdbwd(gen, T: int) -> float:
    import torch
    from pisa import pisa_attn
    from pisa.bench import time_ms
    q, k, v = (_randn(gen, B, T, h, D).requires_grad_() for h in (HQ, HKV, HKV))
    do = _randn(gen, B, T, HQ, D)

    def step():
        torch.autograd.backward(pisa_attn(q, k, v, block_size=C, topk=K), do)
        q.grad = k.grad = v.grad = None
    return time_ms(step, "cuda")


def _time_decode(gen, T: int) -> tuple[float, float]:
    """One step against a full cache of ``T`` keys: called from Python (checks and launches
    included) and captured in a CUDA graph (replays timed)."""
    import torch
    from pisa import PisaCache, pisa_attn_with_kvcache
    from pisa.bench import time_ms
    cache = PisaCache.from_prefill(_randn(gen, B, T, HKV, D), _randn(gen, B, T, HKV, D),
                                   block_size=C, branching=G_BR)
    q1 = _randn(gen, B, 1, HQ, D)
    lens = cache.cache_seqlens.clone()

    def step():
        return pisa_attn_with_kvcache(q1, cache, cache_seqlens=lens, topk=K)
    eager = time_ms(step, "cuda")  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return eager, time_ms(graph.replay, "cuda")


def _outputs(T: int) -> dict:
    """Selection, forward output and gradients at ``T`` tokens and a decode step against a cache
    of ``T`` keys, on seeded inputs: what a refactor must leave unchanged (CPU tensors)."""
    import torch
    from pisa import PisaCache, pisa_attn, pisa_attn_with_kvcache, pisa_select
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (_randn(gen, B, T, h, D).requires_grad_() for h in (HQ, HKV, HKV))
    do = _randn(gen, B, T, HQ, D)
    idx, counts = pisa_select(q.detach(), k.detach(), block_size=C, topk=K)
    o, lse = pisa_attn(q, k, v, block_size=C, topk=K, return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    cache = PisaCache.from_prefill(k.detach(), v.detach(), block_size=C, branching=G_BR)
    o1 = pisa_attn_with_kvcache(q.detach()[:, -1:], cache, cache_seqlens=cache.cache_seqlens,
                                topk=K)
    return {name: x.detach().cpu() for name, x in dict(
        block_idx=idx, counts=counts, o=o, lse=lse, dq=dq, dk=dk, dv=dv, decode_o=o1).items()}


def _compare(ref: dict, out: dict) -> dict:
    """Exact-match share of the selections, relative L2 error of every other output."""
    res = {}
    for name, a in ref.items():
        b = out[name]
        if not a.is_floating_point():
            res[name] = float((a == b).float().mean())
        else:
            a, b = a.double(), b.double()
            res[name] = float((a - b).norm() / a.norm().clamp_min(1e-30))
    return res


def _measure(select_len: int, train_len: int, decode_len: int, ops=OPS) -> dict:
    """One checkout's times (ms) in this process of ``ops`` (of ``{"select", "fwdbwd", "decode",
    "decode_eager"}``)."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    if "select" in ops:
        out["select"] = _time_select(gen, select_len)
    if "fwdbwd" in ops:
        out["fwdbwd"] = _time_fwdbwd(gen, train_len)
    if "decode" in ops or "decode_eager" in ops:
        out["decode_eager"], out["decode"] = _time_decode(gen, decode_len)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", default=["after=."], metavar="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--select-len", type=int, default=131072)
    ap.add_argument("--train-len", type=int, default=131072)
    ap.add_argument("--decode-len", type=int, default=1 << 20)
    ap.add_argument("--compare-len", type=int, default=16384,
                    help="length of the outputs compared between the trees")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS,
                    help="what to time (decode alone: a decode bisect over many trees)")
    ap.add_argument("--no-compare", action="store_true", help="skip the output comparison")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    lens = (args.select_len, args.train_len, args.decode_len)
    if args.child:
        if args.save:
            import torch
            torch.save(_outputs(args.compare_len), args.save)
        print(json.dumps(_measure(*lens, ops=args.ops)))
        return
    trees = dict(t.split("=", 1) for t in args.trees)
    times = {name: [] for name in trees}
    tmp = Path(tempfile.mkdtemp())
    saves = {name: tmp / f"{name}.pt" for name in trees}
    for r in range(args.rounds):
        for name, path in trees.items():
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
            cmd = [sys.executable, __file__, "--child", "--select-len", str(lens[0]),
                   "--train-len", str(lens[1]), "--decode-len", str(lens[2]),
                   "--compare-len", str(args.compare_len), "--ops", *args.ops]
            if r == 0 and not args.no_compare:
                cmd += ["--save", str(saves[name])]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            times[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {times[name][-1]}", flush=True)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
    from common import command, meta, result_row, write_result
    rows, med = [], {}
    for name, runs in times.items():
        for op, T in zip(OPS, lens + lens[-1:]):
            if op not in runs[0]:
                continue
            per_round = [run[op] for run in runs]
            med[name, op] = statistics.median(per_round)
            rows.append(result_row(op, "pisa", "triton", B=B, T=T, HQ=HQ, HKV=HKV, D=D, K=K,
                                   C=C, g=G_BR, W=K, dtype="bfloat16", ms=med[name, op],
                                   tree=name, round_ms=per_round))
    names = list(trees)
    import torch
    equivalence = {}
    if not args.no_compare:
        ref = torch.load(saves[names[0]])
        equivalence = {name: _compare(ref, torch.load(saves[name])) for name in names[1:]}
    ratio = {op: med[names[-1], op] / med[names[0], op] for op in OPS
             if (names[0], op) in med} if len(names) > 1 else {}
    info = meta("cuda", command(), trees=trees, ratio=ratio, equivalence=equivalence,
                compare_len=args.compare_len)
    write_result(args.json, info, rows)
    for (name, op), ms in med.items():
        print(f"{name:8s} {op:7s} {ms:9.3f} ms")
    for op, x in ratio.items():
        print(f"ratio {names[-1]}/{names[0]} {op}: {x:.4f}")
    print(f"equivalence vs {names[0]} at T={args.compare_len}: {json.dumps(equivalence)}")


if __name__ == "__main__":
    main()
