"""Launch-knob sweep of the tile attention kernels (forward, dQ, dK/dV) on one GPU.

    python benchmarks/tuning/tile_tune.py --budget 170 --kernels dkv dq \
        --json benchmarks/results/tile_tune_h200_qt16.json

Config A at ``--len`` tokens (bf16, B=1, HQ=64, HKV=4, D=128, C=64, K=16), one random selection
per query tile of ``--query-tile`` tokens (``attn_kernel.random_selection`` shared by the tile's
tokens, or by ``--share`` tokens; ``--query-tile 1`` times the per-token kernels). Each kernel is
timed alone (``time_ms``) for every setting of its ``KernelConfig`` knobs in the grid below, the
others at their defaults; rows give ms and effective TFLOP/s (``common.attn_tflops``, the forward
counting 4 * HQ * D * keys per token; dQ and dK/dV by their products, ``_PASSES``). ``--budget``
seconds stops the sweep early (what finished is written).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (C, D, HKV, HQ, K, Results, attn_tflops, keys_attended, knob_sweep,
                    randn_qkv, random_selection, result_row, shape)
from pisa.ops.attn import triton as kern

# in forward passes (2 products of one QK^T's size each): dQ recomputes S and dP and forms dQ
# (3 products), dK/dV recomputes S and dP and forms dV and dK (4); the backward's 2.5 passes
# count the 5 products a fused backward needs
_PASSES = {"fwd": 1.0, "dq": 1.5, "dkv": 2.0}
GRID = {
    "fwd": dict(tile_fwd_rows=(64, 128, 256), tile_fwd_warps=(4, 8), tile_fwd_stages=(2, 3)),
    "dq": dict(tile_dq_rows=(64, 128, 256), tile_dq_warps=(4, 8), tile_dq_stages=(2, 3)),
    "dkv": dict(tile_dkv_rows=(32, 64, 128), tile_dkv_warps=(2, 4, 8), tile_dkv_stages=(2,),
                dkv_chunk=(512, 2048)),
}
# per-token selections (--query-tile 1): the per-token kernels' knobs
GRID_TOKEN = {
    "fwd": dict(fwd_rows=(64, 128), fwd_warps=(4, 8), fwd_stages=(2, 3)),
    "dq": dict(dq_rows=(64, 128), dq_warps=(4, 8), dq_stages=(2, 3)),
    "dkv": dict(dkv_rows=(32, 64, 128), dkv_warps=(4, 8), dkv_stages=(2,), dkv_chunk=(512, 2048)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", type=int, default=131072)
    ap.add_argument("--query-tile", type=int, default=16, help="1: the per-token kernels")
    ap.add_argument("--share", type=int, default=None, help="tokens sharing random picks")
    ap.add_argument("--kernels", nargs="+", default=list(GRID), choices=list(GRID))
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    T, qt = args.len, args.query_tile
    q, k, v = randn_qkv(T, HQ, HKV, D, seed=0)
    do = torch.randn_like(q)
    per_token = random_selection(1, T, HKV, C, K, share=args.share or qt)
    keys = keys_attended(per_token, T, C)
    idx = per_token[:, ::qt].contiguous()
    del per_token
    scale = D ** -0.5
    base = kern.KernelConfig()
    if qt == 1:
        calls = {
            "fwd": lambda cfg: kern._attn_fwd(q, k, v, idx, C, scale, cfg),
            "dq": lambda cfg: kern._attn_dq(q, k, v, do, lse, delta, idx, C, scale, cfg)}
    else:
        calls = {
            "fwd": lambda cfg: kern._tile_fwd(q, k, v, idx, C, scale, qt, cfg),
            "dq": lambda cfg: kern._tile_dq(q, k, v, do, lse, delta, idx, C, scale, qt, cfg)}
    calls["dkv"] = lambda cfg: kern._attn_dkv(q, k, v, do, lse, delta, idx, C, scale, False, qt,
                                              cfg)
    o, lse = calls["fwd"](base)
    delta = kern._delta(o, do, None)
    out = Results(args.json, "cuda", query_tile=qt, share=args.share or qt, T=T,
                  keys_per_token=keys)
    deadline = time.time() + args.budget
    for name in args.kernels:
        grid = (GRID_TOKEN if qt == 1 else GRID)[name]
        for setting, _, ms in knob_sweep(grid, base, calls[name], "cuda", deadline):
            tf = attn_tflops(ms, T, keys, HQ, D, passes=_PASSES[name])
            print(f"{name} {setting}: {ms:.2f} ms {tf:.0f} TFLOP/s", flush=True)
            out.add(result_row(name, "pisa_tile_kernel", "triton", T=T, ms=ms,
                               **shape(K=K, C=C, W=None), query_tile=qt, tflops=tf,
                               **setting))
        out.save()


if __name__ == "__main__":
    main()
