"""Launch-knob sweep of the Triton pyramid selection (walk, leaf stage, top-K) on one GPU.

    python benchmarks/tuning/select_tune.py --budget 85 \
        --json benchmarks/results/select_tune_h200.json

Config A at ``--len`` tokens (bf16, B=1, HQ=64, HKV=4, D=128, C=64, K=16, g=2) at the library's
default selection (16-token ``qmean`` tiles, the bound scorer, ``beam_leaf=32``; ``--query-tile
1 --scorer lse --beam-leaf 0`` for the first wave's per-token walk). The pyramid is built once;
each setting of ``pisa.ops.utils.launch.SelectLaunch`` in the grid below (one knob group at a time,
the others at their defaults) times the selection kernels alone (``time_ms`` of the public
``select_pyramid_triton`` with ``launch=``) and checks that its
selection equals the default setting's (``same``: share of equal rows; launch knobs must not
change results). ``--budget`` seconds stops the sweep early (what finished is written). Without
a GPU it runs on the CPU under ``TRITON_INTERPRET=1`` (a check that it runs, at a small
``--len``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import C, D, HKV, HQ, K, G_BR, Results, knob_sweep, randn_qkv, result_row, shape
from pisa.ops.pyramid import build_pyramid
from pisa.ops.select.triton import select_pyramid_triton
from pisa.ops.utils.launch import SelectLaunch
from pisa.ops.utils.config import BEAM_LEAF, QUERY_TILE, SCORER, TILE_REDUCE, SelectConfig

GRID = {
    "walk": dict(walk_warps=(2, 4, 8), walk_stages=(1, 2, 3)),
    "leaf": dict(leaf_warps=(4, 8), leaf_stages=(1, 2, 3), leaf_rows=(64, 128, 256)),
    "chunk": dict(leaf_chunk=(256, 512, 1024, 2048, 4096, 16384)),
    "topk": dict(topk_warps=(1, 2, 4, 8)),
    "residuals": dict(residuals=(False,)),  # changes near-tie rankings: see ``same``
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", type=int, default=131072)
    ap.add_argument("--query-tile", type=int, default=QUERY_TILE)
    ap.add_argument("--scorer", default=SCORER)
    ap.add_argument("--tile-reduce", default=TILE_REDUCE)
    ap.add_argument("--beam-leaf", type=int, default=BEAM_LEAF, help="0: the beam")
    ap.add_argument("--groups", nargs="+", default=list(GRID), choices=list(GRID))
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    T = args.len
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, _ = randn_qkv(T, HQ, HKV, D, seed=0, device=dev)
    cfg = SelectConfig(block_size=C, topk=K, branching=G_BR, beam=K, scorer=args.scorer,
                       scale=D ** -0.5, query_tile=args.query_tile,
                       beam_leaf=args.beam_leaf or None, tile_reduce=args.tile_reduce)
    pyramid = build_pyramid(k, C, G_BR, "triton", bounds=cfg.uses_bounds)

    def run(launch):
        return select_pyramid_triton(q, k, cfg, pyramid, launch=launch)[0]

    base = SelectLaunch()
    want = run(base).clone()
    knobs = dict(query_tile=cfg.query_tile, scorer=cfg.scorer, tile_reduce=cfg.tile_reduce,
                 beam_leaf=cfg.beam_at(2))
    out = Results(args.json, dev, T=T, **knobs)
    deadline = time.time() + args.budget
    for group in args.groups:
        for setting, kcfg, ms in knob_sweep(GRID[group], base, run, dev, deadline):
            same = float((run(kcfg) == want).all(-1).float().mean())
            print(f"{group} {setting}: {ms:.2f} ms (same rows {same:.4f})", flush=True)
            out.add(result_row("select_kernels", "pisa", "triton", T=T, ms=ms,
                               **shape(K=K, C=C, W=K), **knobs, same=same, **setting))
        out.save()


if __name__ == "__main__":
    main()
