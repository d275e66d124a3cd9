"""Time the Triton block-selection kernels on the GPU, and check that the pyramid variants agree.

    python benchmarks/select_kernel.py                       # T = 16K..128K, default variants
    python benchmarks/select_kernel.py --lengths 16384 65536 --json benchmarks/results/select.json
    python benchmarks/select_kernel.py --variants pyramid pyramid_tile4 --warps 4 8
    python benchmarks/select_kernel.py --lengths 32768 131072 --variants speed   # the variant sweep

Config (PISA_SPEC.md §10): B=1, HQ=64, HKV=4, D=128, C=64, K=16, W=16, g=2, random bf16 q/k,
all queries (Tq = Tk). Times are ``triton.testing.do_bench`` medians after warm-up. ``pyramid*``
rows time the selection alone on a prebuilt pyramid; ``build`` times the pyramid build;
``flat_mean`` reads the leaf means of that pyramid. ``flat_lse`` is the exact flat scan (~T^2, so
by default only up to ``--flat-lse-max``).

Every pyramid row also reports ``mismatch``: the share of (token, KV head) rows whose selection
differs from the default kernel's (``pyramid``) on the same inputs. The exact variants compute the
same fp32 scores in other summation orders, so only rounding-level near-ties may differ (~0); the
levers and ``walk_means="input"`` rows measure how far they depart. Rows of ``csc`` variants carry
``breakdown``: device milliseconds per kernel (walk / sort / group search / leaf / top-K) from one
profiled call.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pisa.bench import meta, result_row  # noqa: E402
from pisa.ops.select_triton import build_pyramid_triton, select_triton  # noqa: E402
from pisa.ops.utils import SelectConfig  # noqa: E402

# name -> (selector, select_triton keywords). Levers and walk_means="input" are approximate;
# every other pyramid row must select what "pyramid" (the library default, variant "csc") does.
VARIANTS = {
    "pyramid": ("pyramid", {}),
    "fused": ("pyramid", {"variant": "fused"}),
    "pyramid_tile4": ("pyramid", {"walk_tile": 4}),
    "pyramid_tile8": ("pyramid", {"walk_tile": 8}),
    "pyramid_tile16": ("pyramid", {"walk_tile": 16}),
    "pyramid_sub4": ("pyramid", {"leaf_sub_blocks": 4}),
    "pyramid_tile8_sub4": ("pyramid", {"walk_tile": 8, "leaf_sub_blocks": 4}),
    "pyramid_input": ("pyramid", {"variant": "fused", "walk_means": "input"}),
    "fused_fast": ("pyramid", {"variant": "fused_fast"}),
    "fused_fast_s2": ("pyramid", {"variant": "fused_fast", "num_stages": 2}),
    "csc": ("pyramid", {"variant": "csc"}),
    "csc_r96": ("pyramid", {"variant": "csc", "walk_maxnreg": 96}),
    "csc_pb4": ("pyramid", {"variant": "csc", "leaf_pairs": 4}),
    "csc_lw8": ("pyramid", {"variant": "csc", "leaf_warps": 8}),
    "csc_ls3": ("pyramid", {"variant": "csc", "leaf_stages": 3}),
    "csc_nochunk": ("pyramid", {"variant": "csc", "leaf_chunk": 0}),
    "csc_chunk16k": ("pyramid", {"variant": "csc", "leaf_chunk": 16384}),
    "csc_input": ("pyramid", {"variant": "csc", "walk_means": "input"}),
    "csc_input_r96": ("pyramid", {"variant": "csc", "walk_means": "input", "walk_maxnreg": 96}),
    "flat_mean": ("flat_mean", {}),
    "flat_mean_tile4": ("flat_mean", {"flat_tile": 4}),
    "flat_mean_tile16": ("flat_mean", {"flat_tile": 16}),
    "flat_lse": ("flat_lse", {}),
    "flat_lse_tile4": ("flat_lse", {"flat_tile": 4}),
    "flat_lse_tile16": ("flat_lse", {"flat_tile": 16}),
}
DEFAULT_VARIANTS = ["build", "pyramid", "pyramid_tile4", "pyramid_tile8", "pyramid_sub4",
                    "flat_mean", "flat_lse"]
# `--variants speed`: the implementations of the default (exact) pyramid selection, and the
# 16-bit-means approximation, against the fused kernel and flat_mean.
SPEED_VARIANTS = ["pyramid", "fused", "fused_fast", "fused_fast_s2", "csc", "csc_r96", "csc_pb4",
                  "csc_lw8", "csc_nochunk", "pyramid_input", "csc_input", "flat_mean"]
# fla NSA's flat top-k selection at the same shapes (PISA_SPEC.md §10), for orientation.
NSA_SELECT_MS = {16384: 1.8, 32768: 6.3, 65536: 24.8, 131072: 98.4}


def _bench(fn, warmup_ms: int, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def _mismatch(got, want) -> float:
    """Share of (token, KV head) rows whose selection (indices or count) differs."""
    return ((got[0] != want[0]).any(-1) | (got[1] != want[1])).float().mean().item()


def _breakdown(fn) -> dict[str, float]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    choices=["build", "speed", *VARIANTS],
                    help="'speed' expands to the exact pyramid implementations and knobs")
    ap.add_argument("--warps", type=int, nargs="+", default=None,
                    help="num_warps values tried for each selection variant (default: its own)")
    ap.add_argument("--flat-lse-max", type=int, default=65536,
                    help="skip flat_lse above this length (its cost grows as T^2)")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--beam", type=int, default=16)
    ap.add_argument("--branching", type=int, default=2)
    ap.add_argument("--warmup-ms", type=int, default=50)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None, help="write the rows to this JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    names = [v for name in args.variants for v in (SPEED_VARIANTS if name == "speed" else [name])]

    rows = []
    shape = dict(B=1, HQ=args.hq, HKV=args.hkv, D=args.dim, K=args.topk, C=args.block,
                 g=args.branching, W=args.beam, dtype="bfloat16")
    print(f"{'T':>7} {'variant':<18} {'warps':>5} {'ms':>9} {'mismatch':>9} {'NSA sel ms':>10}"
          "  breakdown (ms)")
    for T in args.lengths:
        gen = torch.Generator(device="cuda").manual_seed(T)
        q = torch.randn(1, T, args.hq, args.dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(1, T, args.hkv, args.dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
        pyramid = build_pyramid_triton(k, args.block, args.branching)
        cfg_of = {sel: SelectConfig(block_size=args.block, topk=args.topk, branching=args.branching,
                                    beam=args.beam, selector=sel, scale=args.dim ** -0.5)
                  for sel in ("pyramid", "flat_mean", "flat_lse")}
        reference = None  # the default pyramid kernel's selection, for the mismatch column
        if any(VARIANTS.get(n, ("",))[0] == "pyramid" for n in names):
            reference = [x.clone() for x in select_triton(q, k, cfg_of["pyramid"], pyramid)]
        for name in names:
            if name.startswith("flat_lse") and T > args.flat_lse_max:
                continue
            mismatch, breakdown = None, None
            if name == "build":
                runs = [(None, lambda: build_pyramid_triton(k, args.block, args.branching))]
            else:
                selector, knobs = VARIANTS[name]
                cfg = cfg_of[selector]
                out = select_triton(q, k, cfg, pyramid, **knobs)  # compile, and reuse buffers
                if selector == "pyramid":
                    mismatch = _mismatch(out, reference)
                runs = [(w, lambda w=w: select_triton(q, k, cfg, pyramid, out=out,
                                                      **{**knobs, "num_warps": w}))
                        for w in (args.warps or [knobs.get("num_warps")])]
                if knobs.get("variant") == "csc":
                    breakdown = _breakdown(runs[0][1])
            for warps, fn in runs:
                fn()
                torch.cuda.synchronize()
                ms = _bench(fn, args.warmup_ms, args.rep_ms)
                ref = NSA_SELECT_MS.get(T)
                parts = " ".join(f"{n}={v:.2f}" for n, v in (breakdown or {}).items())
                print(f"{T:>7} {name:<18} {warps or '':>5} {ms:>9.3f} "
                      f"{'' if mismatch is None else f'{mismatch:.2e}':>9} "
                      f"{ref if ref is not None else '':>10}  {parts}", flush=True)
                rows.append(result_row("build" if name == "build" else "select", name, "triton",
                                       T=T, ms=ms, num_warps=warps, mismatch=mismatch,
                                       breakdown=breakdown, **shape))
        q = k = pyramid = reference = None  # free this length's tensors
        torch.cuda.empty_cache()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"meta": meta("cuda", "python " + " ".join(sys.argv)), "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
