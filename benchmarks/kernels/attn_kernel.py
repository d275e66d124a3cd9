"""The sparse attention kernels alone, given a selection, against dense cuDNN attention on one GPU.

    python benchmarks/kernels/attn_kernel.py --seqlens 131072 --share 1,16 --query-tiles 16 \
        --no-dense --json benchmarks/results/attn_kernel_tiles_h200.json

Times ``pisa_attn(q, k, v, block_idx=...)`` (Triton; the selection step skipped), forward and
forward + backward, and dense causal attention (``common.dense_attention``: SDPA forced to cuDNN)
on the same inputs. Config (defaults): B=1, HQ=64, HKV=4, D=128, block C=64, K=16 blocks per
query, bf16. Selections are random but valid: forced blocks 0, cur-1, cur plus random past blocks,
ascending, -1 padded. ``--share 1`` draws the random blocks per token (no overlap between
neighbours beyond the forced blocks: the worst case for the kernels' token tiles); ``--share 64``
gives every aligned group of 64 tokens the same random blocks (neighbours overlap, as in real
models' selections). ``--query-tiles 16`` also times, for each share that is one of them, the tile
kernels (``query_tile``) on that selection's one row per tile (``impl`` ``pisa_tile_kernel``).

Effective TFLOP/s (``common.attn_tflops``): the forward counts 4 * HQ * D * (keys attended) per
token, forward + backward 3.5x that; the dense causal baseline is counted the same way (keys
attended = its causal prefix). Before timing, an accuracy check at T=2048: the bf16 kernels
against the torch backend on fp32 copies (o, lse, dq, dk, dv), with the atomic and the
deterministic backward, and the deterministic backward's bitwise repeatability (the JSON's
``accuracy``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (DTYPE, Results, attn_tflops, dense_attention, dense_backend, fwd_bwd,
                    keys_attended, pisa_backend, randn_qkv, random_selection, result_row, shape,
                    time_ms)
from pisa import pisa_attn


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_accuracy(args, backend: str) -> dict:
    """bf16 kernels vs the torch backend on fp32 copies (o, lse, dq, dk, dv), atomic and
    deterministic backward, and the deterministic backward's bitwise repeatability."""
    T, C = 2048, args.block
    q, k, v = randn_qkv(T, args.hq, args.hkv, args.d, seed=0, device=args.device, dtype=DTYPE,
                        requires_grad=True)
    idx = random_selection(1, T, args.hkv, C, args.topk, share=1, device=args.device)
    do = torch.randn_like(q)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ro, rlse = pisa_attn(*ref_in, block_size=C, block_idx=idx, return_lse=True, backend="torch")
    rgrads = torch.autograd.grad(ro, ref_in, do.float())
    finite = torch.isfinite(rlse)
    out, worst = {}, 0.0
    for deterministic in (False, True):
        def run():
            o, lse = pisa_attn(q, k, v, block_size=C, block_idx=idx, return_lse=True,
                               deterministic=deterministic, backend=backend)
            return o, lse, torch.autograd.grad(o, (q, k, v), do)
        o, lse, grads = run()
        errs = {"o": rel_err(o, ro), "lse_max_abs": (lse - rlse)[finite].abs().max().item()}
        errs.update({f"d{n}": rel_err(g, r) for n, g, r in zip("qkv", grads, rgrads)})
        out["deterministic" if deterministic else "atomic"] = errs
        worst = max(worst, *(errs[n] for n in ("o", "dq", "dk", "dv")))
    repeat = all(torch.equal(a, b) for a, b in zip(grads, run()[2]))  # deterministic again
    out.update(worst_rel_err=worst, bitwise_repeat=repeat, ok=bool(worst < 2e-2 and repeat))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default="16384,65536,131072")
    ap.add_argument("--share", default="1,64", help="tokens sharing random picks (see docstring)")
    ap.add_argument("--query-tiles", default="", help="shares also timed as query tiles")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--deterministic", action="store_true", help="time the deterministic bwd")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (Triton backend) or cpu (torch)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = args.device
    backend = pisa_backend(dev)
    HQ, HKV, D, C, K = args.hq, args.hkv, args.d, args.block, args.topk
    acc = check_accuracy(args, backend)
    print(f"# accuracy vs fp32 (T=2048): {json.dumps(acc)}", file=sys.stderr, flush=True)
    out = Results(args.json, dev)
    cols = shape(HQ, HKV, D, K=K, C=C, W=None)

    def time_pair(fwd, leaves, do):
        """(forward ms, forward + backward ms) of ``fwd``."""
        with torch.no_grad():
            ms_f = time_ms(fwd, dev)
        return ms_f, time_ms(fwd_bwd(fwd, do, leaves), dev)

    for T in (int(x) for x in args.seqlens.split(",")):
        q, k, v = randn_qkv(T, HQ, HKV, D, seed=T, device=dev, dtype=DTYPE, requires_grad=True)
        do = torch.randn_like(q)
        if not args.no_dense:
            dq, dk, dv = (x.detach().requires_grad_() for x in (q, k, v))
            fwd, fb = time_pair(dense_attention(dq, dk, dv, dev), (dq, dk, dv),
                                do.transpose(1, 2))
            keys = (T + 1) / 2
            for op, ms, passes in (("attn_fwd", fwd, 1.0), ("attn_fwdbwd", fb, 3.5)):
                out.add(result_row(op, "dense", dense_backend(dev), T=T, ms=ms, **cols,
                                   keys_per_token=keys,
                                   tflops=attn_tflops(ms, T, keys, HQ, D, passes)))
            del dq, dk, dv
        tiles = {int(x) for x in args.query_tiles.split(",") if x}
        for share in (int(x) for x in args.share.split(",")):
            idx = random_selection(1, T, HKV, C, K, share, seed=T + share, device=dev)
            keys = keys_attended(idx, T, C)
            # a tile's tokens lie in one block, so their rows are equal: the tile row is its first
            runs = [("pisa_kernel", 1, idx)]
            if share in tiles:
                runs.append(("pisa_tile_kernel", share, idx[:, ::share]))
            for impl, qt, sel in runs:
                fwd, fb = time_pair(
                    lambda: pisa_attn(q, k, v, block_size=C, block_idx=sel, query_tile=qt,
                                      deterministic=args.deterministic, backend=backend),
                    (q, k, v), do)
                for op, ms, passes in (("attn_fwd", fwd, 1.0), ("attn_fwdbwd", fb, 3.5)):
                    out.add(result_row(op, impl, backend, T=T, ms=ms, **cols, share=share,
                                       query_tile=qt, deterministic=args.deterministic,
                                       keys_per_token=keys,
                                       tflops=attn_tflops(ms, T, keys, HQ, D, passes)))
        q = k = v = idx = None  # free this length's tensors
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        out.save(accuracy=acc)

    print("\n|      T | impl             | share | fwd ms | TF/s | f+b ms | TF/s |\n"
          "|---|---|---|---|---|---|---|", file=sys.stderr)
    by = {}
    for r in out.rows:
        by.setdefault((r["T"], r["impl"], r.get("share")), {})[r["op"]] = r
    for (T, impl, share), d in by.items():
        f, fb = d["attn_fwd"], d["attn_fwdbwd"]
        print(f"| {T:>6} | {impl:<16} | {share or '-':>5} | {f['ms']:6.2f} | {f['tflops']:4.0f} | "
              f"{fb['ms']:6.1f} | {fb['tflops']:4.0f} |", file=sys.stderr)
    print(f"accuracy ok: {acc['ok']}", file=sys.stderr)


if __name__ == "__main__":
    main()
