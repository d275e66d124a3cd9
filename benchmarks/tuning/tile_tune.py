"""Launch-knob sweep of the tile attention kernels (forward, dQ, dK/dV) on one GPU.

    python benchmarks/tuning/tile_tune.py --budget 170 --kernels dkv dq \
        --json benchmarks/results/tile_tune_h200_qt16.json

Config A at ``--len`` tokens (bf16, B=1, HQ=64, HKV=4, D=128, C=64, K=16), one random selection
per query tile of ``--query-tile`` tokens (``attn_kernel.random_selection`` shared by the tile's
tokens, or by ``--share`` tokens; ``--query-tile 1`` times the per-token kernels). Every setting
of one kernel's ``pisa.ops.utils.launch.AttnLaunch`` knobs in the grid below, the others at their
defaults, is timed (``time_ms``) through the public launchers' ``launch=`` argument: the forward
through ``attn_fwd_triton``, the dQ and dK/dV knobs through ``attn_bwd_triton`` (the whole
backward: the other kernel's fixed time is in every row of the group, so the rows differ by the
swept kernel's). Rows give ms and effective TFLOP/s (``common.attn_tflops``, the forward counting
4 * HQ * D * keys per token, the backward 2.5 times that, ``_PASSES``). ``--budget`` seconds
stops the sweep early (what finished is written).
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
from pisa.ops.attn.triton import attn_bwd_triton, attn_fwd_triton
from pisa.ops.utils.launch import AttnLaunch

# in forward passes (2 products of one QK^T's size each): the backward's 2.5 passes count the 5
# products a fused backward needs (dQ and dK/dV groups time the whole backward)
_PASSES = {"fwd": 1.0, "dq": 2.5, "dkv": 2.5}
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
    base = AttnLaunch()
    o, lse = attn_fwd_triton(q, k, v, idx, C, scale, qt)

    def backward(launch):
        return attn_bwd_triton(do, None, q, k, v, o, lse, idx, C, scale, False, qt, launch=launch)
    calls = {"fwd": lambda launch: attn_fwd_triton(q, k, v, idx, C, scale, qt, launch=launch),
             "dq": backward, "dkv": backward}
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
