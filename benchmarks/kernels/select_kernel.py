"""Block selection on one GPU: time, recall and captured mass of the three public selectors.

    python benchmarks/kernels/select_kernel.py --json select_h200.json   # 16K..1M
    python benchmarks/kernels/select_kernel.py --lengths 32768 --beams 16 32 64  # beam trade-off

Config A (docs/spec.md §10): B=1, HQ=64, HKV=4, D=128, C=64, K=16, g=2, bf16, all queries
(Tq = Tk), per-token selection at the first wave's knobs (``query_tile=1``, ``scorer="lse"``).
Times (``common.time_ms``) are of ``pisa_select`` (Triton) on random normal q/k, each
pyramid row (one per ``--beams`` width W) and ``flat_mean`` including the pyramid build, which the
``build`` row times alone (``pisa.ops.pyramid.build_pyramid``); ``flat_lse`` is the exact flat
scan (~T^2, so only up to ``--flat-lse-max``). The pyramid row at the first beam carries
``breakdown``: device ms per kernel of one profiled call (walk / sort / leaf groups / top-K /
pyramid build; torch's own kernels as ``torch``).

Quality, up to ``--quality-max``: on ``pisa.eval.structured_qkv`` inputs (each query head aims at a
few earlier blocks carried by a few sharp keys), for the last ``--quality-queries`` queries:
``recall`` = recall@K of the free (non-forced) blocks that ``flat_lse`` (the mass-optimal exact
scan) selects, and ``mass`` = the share of the true softmax mass the selection captures
(``pisa.eval``). ``structured_qkv`` holds a ``[B, T, HQ, 4, D]`` fp32 temporary (16 GiB at 128K),
hence the bound.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DTYPE, Results, pisa_backend, randn_qkv, result_row, shape, time_ms
from pisa import pisa_select
from pisa.eval import captured_mass, dense_lse, recall_at_k, structured_qkv
from pisa.ops.pyramid import build_pyramid

SELECTORS = ("pyramid", "flat_mean", "flat_lse")
# fla NSA's flat top-k selection at the same shapes (docs/spec.md §10), for orientation.
NSA_SELECT_MS = {16384: 1.8, 32768: 6.3, 65536: 24.8, 131072: 98.4}


def breakdown(fn) -> dict[str, float]:
    """Device milliseconds per kernel of one call of ``fn``: Triton kernels by name, the rest
    (torch's sort and searchsorted) as ``torch``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ms = defaultdict(float)
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us <= 0 or ev.key.startswith(("cudaDevice", "Memcpy", "Memset")):
            continue
        name = ev.key if ev.key.startswith("_") and ev.key.endswith("kernel") else "torch"
        ms[name.strip("_").removesuffix("_kernel")] += us / 1e3
    return dict(ms)


def arms(args, flat_lse: bool = True) -> list[tuple[str, int | None, dict]]:
    """``(selector, beam, pisa_select keywords)`` of every selection row (``flat_lse`` too when
    asked for): the pyramid at each beam, the flat selectors (no beam)."""
    out = [("pyramid", w, dict(selector="pyramid", beam=w)) for w in args.beams]
    out += [(sel, None, dict(selector=sel)) for sel in ("flat_mean", "flat_lse")]
    return [a for a in out if a[0] in args.selectors and (flat_lse or a[0] != "flat_lse")]


def quality(args, T: int, knobs: dict, device: str) -> dict[tuple, dict]:
    """``{(selector, W): {"recall", "mass"}}`` on structured inputs, last queries only."""
    q, k, _ = structured_qkv(1, T, args.hq, args.hkv, args.dim, block_size=args.block,
                             dtype=DTYPE, device=device, seed=T)
    q = q[:, -min(args.quality_queries, T):].contiguous()
    scale = args.dim ** -0.5
    full = dense_lse(q, k, scale)
    oracle = pisa_select(q, k, selector="flat_lse", **knobs)[0]
    out = {}
    for sel, beam, kw in arms(args):  # flat_lse too (recall 1 by definition; its mass)
        idx = pisa_select(q, k, **knobs, **kw)[0]
        out[sel, beam] = {
            "recall": recall_at_k(idx, oracle, T, args.block),
            "mass": captured_mass(q, k, idx, args.block, scale, full, knobs["backend"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1 << p for p in range(14, 21)])
    ap.add_argument("--selectors", nargs="+", default=list(SELECTORS), choices=SELECTORS)
    ap.add_argument("--beams", type=int, nargs="+", default=[16],
                    help="pyramid beam widths W (one pyramid row each)")
    ap.add_argument("--flat-lse-max", type=int, default=65536,
                    help="skip flat_lse above this length (its cost grows as T^2)")
    ap.add_argument("--no-build", action="store_true", help="skip the pyramid build rows")
    ap.add_argument("--quality-max", type=int, default=131072,
                    help="longest T with recall and mass (0: none)")
    ap.add_argument("--quality-queries", type=int, default=2048,
                    help="last queries scored for recall and mass")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--branching", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (Triton backend) or cpu (torch)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows to this JSON file")
    args = ap.parse_args()
    dev = args.device
    backend = pisa_backend(dev)
    # per-token selection at the v1 knobs (selection v2's tiles: train_h200.py, select_profile.py)
    knobs = dict(block_size=args.block, topk=args.topk, branching=args.branching,
                 query_tile=1, scorer="lse", beam_leaf=None, backend=backend)
    out = Results(args.json, dev)
    print(f"{'T':>7} {'selector':<10} {'W':>3} {'ms':>9} {'recall':>7} {'mass':>6} "
          f"{'NSA ms':>7}  breakdown (ms)", file=sys.stderr)
    for T in args.lengths:
        scores = quality(args, T, knobs, dev) if T <= args.quality_max else {}
        q, k, _ = randn_qkv(T, args.hq, args.hkv, args.dim, seed=T, device=dev)
        runs = [] if args.no_build else [
            ("build", "pyramid", None, lambda: build_pyramid(k, args.block, args.branching,
                                                              backend))]
        runs += [("select", sel, beam, lambda kw=kw: pisa_select(q, k, **knobs, **kw))
                 for sel, beam, kw in arms(args, T <= args.flat_lse_max)]
        for op, impl, beam, fn in runs:
            ms = time_ms(fn, dev)
            profile = op == "select" and impl == "pyramid" and beam == args.beams[0] \
                and dev.startswith("cuda")
            parts = breakdown(fn) if profile else None
            got = scores.get((impl, beam), {}) if op == "select" else {}
            r = out.add(result_row(op, impl, backend, T=T, ms=ms, **got, breakdown=parts,
                                   **shape(args.hq, args.hkv, args.dim, K=args.topk,
                                           C=args.block, g=args.branching, W=beam)))
            cells = [format(r[c], ".3f") if r[c] is not None else "" for c in ("recall", "mass")]
            print(f"{T:>7} {impl if op == 'select' else 'build':<10} {beam or '':>3} {ms:>9.3f} "
                  f"{cells[0]:>7} {cells[1]:>6} {NSA_SELECT_MS.get(T, ''):>7}  "
                  + " ".join(f"{n}={v:.2f}" for n, v in (parts or {}).items()),
                  file=sys.stderr, flush=True)
        q = k = None  # free this length's tensors
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        out.save()
    if args.json is not None:
        print(f"wrote {len(out.rows)} rows to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
