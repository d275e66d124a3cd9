"""Time the Triton block-selection kernels on the GPU.

    python benchmarks/select_kernel.py                       # T = 16K..128K, default variants
    python benchmarks/select_kernel.py --lengths 16384 65536 --json benchmarks/results/select.json
    python benchmarks/select_kernel.py --variants pyramid pyramid_tile4 --warps 4 8

Config (PISA_SPEC.md §10): B=1, HQ=64, HKV=4, D=128, C=64, K=16, W=16, g=2, random bf16 q/k,
all queries (Tq = Tk). Times are ``triton.testing.do_bench`` medians after warm-up. ``pyramid*``
rows time the selection alone on a prebuilt pyramid; ``build`` times the pyramid build;
``flat_mean`` reads the leaf means of that pyramid. ``flat_lse`` is the exact flat scan (~T^2, so
by default only up to ``--flat-lse-max``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pisa.bench import meta  # noqa: E402
from pisa.ops.select_triton import build_pyramid_triton, select_triton  # noqa: E402
from pisa.ops.utils import SelectConfig  # noqa: E402

# name -> (selector, select_triton keyword levers)
VARIANTS = {
    "pyramid": ("pyramid", {}),
    "pyramid_tile4": ("pyramid", {"walk_tile": 4}),
    "pyramid_tile8": ("pyramid", {"walk_tile": 8}),
    "pyramid_tile16": ("pyramid", {"walk_tile": 16}),
    "pyramid_sub4": ("pyramid", {"leaf_sub_blocks": 4}),
    "pyramid_tile8_sub4": ("pyramid", {"walk_tile": 8, "leaf_sub_blocks": 4}),
    "flat_mean": ("flat_mean", {}),
    "flat_mean_tile4": ("flat_mean", {"flat_tile": 4}),
    "flat_mean_tile16": ("flat_mean", {"flat_tile": 16}),
    "flat_lse": ("flat_lse", {}),
    "flat_lse_tile4": ("flat_lse", {"flat_tile": 4}),
    "flat_lse_tile16": ("flat_lse", {"flat_tile": 16}),
}
DEFAULT_VARIANTS = ["build", "pyramid", "pyramid_tile4", "pyramid_tile8", "pyramid_sub4",
                    "flat_mean", "flat_lse"]
# fla NSA's flat top-k selection at the same shapes (PISA_SPEC.md §10), for orientation.
NSA_SELECT_MS = {16384: 1.8, 32768: 6.3, 65536: 24.8, 131072: 98.4}


def _bench(fn, warmup_ms: int, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    choices=["build", *VARIANTS])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8],
                    help="num_warps values tried for each selection variant")
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

    rows = []
    print(f"{'T':>7} {'variant':<20} {'warps':>5} {'ms':>9} {'NSA sel ms':>10}")
    for T in args.lengths:
        gen = torch.Generator(device="cuda").manual_seed(T)
        q = torch.randn(1, T, args.hq, args.dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(1, T, args.hkv, args.dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
        pyramid = build_pyramid_triton(k, args.block, args.branching)
        for name in args.variants:
            if name.startswith("flat_lse") and T > args.flat_lse_max:
                continue
            if name == "build":
                runs = [(0, lambda: build_pyramid_triton(k, args.block, args.branching))]
            else:
                selector, levers = VARIANTS[name]
                cfg = SelectConfig(block_size=args.block, topk=args.topk,
                                   branching=args.branching, beam=args.beam, selector=selector,
                                   scale=args.dim ** -0.5)
                out = select_triton(q, k, cfg, pyramid, **levers)  # compile, and reuse buffers
                runs = [(w, lambda w=w: select_triton(q, k, cfg, pyramid, num_warps=w, out=out,
                                                      **levers)) for w in args.warps]
            for warps, fn in runs:
                fn()
                torch.cuda.synchronize()
                ms = _bench(fn, args.warmup_ms, args.rep_ms)
                ref = NSA_SELECT_MS.get(T)
                print(f"{T:>7} {name:<20} {warps or '':>5} {ms:>9.3f} "
                      f"{ref if ref is not None else '':>10}", flush=True)
                rows.append({"op": "build" if name == "build" else "select", "impl": name,
                             "backend": "triton", "B": 1, "T": T, "HQ": args.hq,
                             "HKV": args.hkv, "D": args.dim, "K": args.topk, "C": args.block,
                             "g": args.branching, "W": args.beam, "dtype": "bfloat16", "ms": ms,
                             "peak_gb": None, "recall": None, "mass": None,
                             "num_warps": warps or None})
        del q, k, pyramid
        torch.cuda.empty_cache()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"meta": meta("cuda", "python " + " ".join(sys.argv)), "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
