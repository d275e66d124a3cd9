"""Time / recall trade-off of the selection levers on one GPU (issue 3, item 7).

For each variant — the default pyramid (exact leaf LSE, W = K), wider beams, a shared walk over a
tile of consecutive queries (``walk_tile``), a leaf scored from sub-block means
(``leaf_sub_blocks``), and ``flat_mean`` — it times the Triton selection (median do_bench) and
measures recall@K against ``flat_lse`` and the captured attention mass, on
``pisa.eval.structured_qkv`` inputs (bf16, config A: HQ=64, HKV=4, D=128, C=64, K=16).

    python benchmarks/levers_h200.py --lengths 32768 --json benchmarks/results/levers_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pisa.bench import meta, time_ms
from pisa.eval import captured_mass, dense_lse, recall_at_k, structured_qkv
from pisa.ops.select_triton import select_triton
from pisa.ops.utils import SelectConfig

VARIANTS = {  # name: (selector, beam, walk_tile, leaf_sub_blocks)
    "pyramid": ("pyramid", 16, 1, 0),
    "pyramid_W32": ("pyramid", 32, 1, 0),
    "pyramid_W64": ("pyramid", 64, 1, 0),
    "pyramid_tile4": ("pyramid", 16, 4, 0),
    "pyramid_tile8": ("pyramid", 16, 8, 0),
    "pyramid_sub4": ("pyramid", 16, 1, 4),
    "pyramid_tile4_sub4": ("pyramid", 16, 4, 4),
    "flat_mean": ("flat_mean", 16, 1, 0),
    "flat_lse": ("flat_lse", 16, 1, 0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    HQ, HKV, D, C, K = 64, 4, 128, 64, 16
    rows = []
    for T in args.lengths:
        q, k, _ = structured_qkv(1, T, HQ, HKV, D, block_size=C, dtype=torch.bfloat16,
                                 device="cuda", seed=T)
        full = dense_lse(q, k, D ** -0.5)
        oracle = None
        for name in ["flat_lse"] + [v for v in args.variants if v != "flat_lse"]:
            selector, W, tile, sub = VARIANTS[name]
            cfg = SelectConfig(C, K, 2, W, "lse", selector, True, D ** -0.5)
            run = lambda: select_triton(q, k, cfg, walk_tile=tile, leaf_sub_blocks=sub)  # noqa
            ms = time_ms(run, "cuda")
            idx, _ = run()
            oracle = idx if oracle is None else oracle
            r = {"op": "select", "impl": name, "backend": "triton", "B": 1, "T": T, "HQ": HQ,
                 "HKV": HKV, "D": D, "K": K, "C": C, "g": 2, "W": W, "dtype": "bfloat16",
                 "ms": ms, "peak_gb": None, "recall": recall_at_k(idx, oracle, T, C),
                 "mass": captured_mass(q, k, idx, C, full_lse=full, backend="triton"),
                 "walk_tile": tile, "leaf_sub_blocks": sub}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta("cuda", "python " + " ".join(sys.argv)),
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
