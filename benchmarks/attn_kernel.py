"""Time the Triton sparse-attention kernels against dense cuDNN attention on one GPU.

    python benchmarks/attn_kernel.py --json benchmarks/results/attn_kernel.json

Config (defaults): B=1, HQ=64, HKV=4, D=128, block C=64, K=16 blocks per query, bf16.
Selections are random but valid: forced blocks 0, cur-1, cur plus random past blocks, ascending,
-1 padded. ``--share 1`` draws the random blocks per token (no overlap between neighbours beyond the
forced blocks: the worst case for token tiles); ``--share 64`` gives every aligned group of 64
tokens the same random blocks (neighbours overlap, as in real models' selections).

Effective TFLOP/s: forward counts 4 * HQ * D * (keys attended) per token, backward 2.5x that; the
dense causal baseline is counted the same way (keys attended = its causal prefix).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pisa.ops.attn_triton import (  # noqa: E402
    KernelConfig, _pow2, _tile_tokens, _tile_union, _transpose_selection, sparse_attn_triton)
from pisa.bench import keys_attended  # noqa: E402
from pisa.ops.attn import sparse_attn  # noqa: E402
from pisa.ops.utils import cdiv  # noqa: E402

BIG = 1 << 30


def random_selection(B, T, H, C, K, share, seed=0, device="cuda"):
    """[B, T, H, K] int32: forced {0, cur-1, cur} plus up to K-3 distinct random blocks in
    [1, cur-2], shared by aligned groups of ``share`` tokens; all causal blocks when they fit."""
    g = torch.Generator(device).manual_seed(seed)
    cur = torch.arange(T, device=device) // C
    n_draw = 4 * (K - 3)

    def per_group(shape):  # the same random numbers for every token of a group
        x = torch.rand(B, cdiv(T, share), H, *shape, generator=g, device=device)
        return x.repeat_interleave(share, 1)[:, :T]

    span = (cur - 2).clamp_min(0)[None, :, None, None]
    draws = torch.where(span > 0, 1 + (per_group([n_draw]) * span).long(), BIG).sort(-1).values
    dup = torch.zeros_like(draws, dtype=torch.bool)
    dup[..., 1:] = draws[..., 1:] == draws[..., :-1]
    draws = torch.where(dup, BIG, draws)
    priority = torch.where(draws == BIG, 2.0, per_group([n_draw]))
    picks = draws.gather(-1, priority.argsort(-1)[..., :K - 3])
    c = cur[None, :, None, None].expand(B, T, H, 1)
    forced = torch.cat([torch.zeros_like(c), torch.where(c >= 2, c - 1, BIG),
                        torch.where(c >= 1, c, BIG)], -1)
    idx = torch.cat([forced, picks], -1).sort(-1).values
    dense = torch.arange(K, device=device).expand(B, T, H, K)
    idx = torch.where((c + 1 <= K), torch.where(dense <= c, dense, BIG), idx)
    return torch.where(idx >= BIG, -1, idx).to(torch.int32).contiguous()


def fp32_reference(q, k, v, block_idx, C, scale):
    """The torch backend on fp32 copies (tested against the fp64 oracle): o and lse."""
    return sparse_attn(q.float(), k.float(), v.float(), block_idx, C, scale, "torch")


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_accuracy(args, rows_list):
    """bf16 kernel vs fp32 reference (o, lse, dq, dk, dv) for every tile size, atomic and
    deterministic backward, and deterministic repeatability."""
    T, HQ, HKV, D, C, K = 2048, args.hq, args.hkv, args.d, args.block, args.topk
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (HQ, HKV, HKV))
    idx = random_selection(1, T, HKV, C, K, share=1)
    do = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ro, rlse = fp32_reference(*ref_in, idx, C, D ** -0.5)
    rgrads = torch.autograd.grad(ro, ref_in, do.float())
    finite = torch.isfinite(rlse)
    out, worst, repeat = {}, 0.0, True
    for rows in rows_list:
        cfg = make_config(args, rows)
        for deterministic in (False, True):
            o, lse = sparse_attn_triton(q, k, v, idx, C, None, deterministic, cfg)
            grads = torch.autograd.grad(o, (q, k, v), do)
            errs = {"o": rel_err(o, ro), "lse_max_abs": (lse - rlse)[finite].abs().max().item()}
            errs.update({f"d{n}": rel_err(g, r) for n, g, r in zip("qkv", grads, rgrads)})
            out[f"rows{rows}_{'deterministic' if deterministic else 'atomic'}"] = errs
            worst = max(worst, *(errs[n] for n in ("o", "dq", "dk", "dv")))
        o2, _ = sparse_attn_triton(q, k, v, idx, C, None, True, cfg)
        grads2 = torch.autograd.grad(o2, (q, k, v), do)
        repeat &= all(torch.equal(a, b) for a, b in zip(grads, grads2))
    out.update(worst_rel_err=worst, bitwise_repeat=repeat, ok=bool(worst < 2e-2 and repeat))
    return out


def bench(fn, grad_to_none=None):
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                   return_mode="median")


def bench_sparse(q, k, v, idx, C, cfg, deterministic):
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            sparse_attn_triton(q, k, v, idx, C, None, deterministic, cfg)

    def fwd_bwd():
        o, _ = sparse_attn_triton(q, k, v, idx, C, None, deterministic, cfg)
        o.backward(do)

    return bench(fwd), bench(fwd_bwd, [q, k, v])


def bench_dense(q, k, v):
    G = q.shape[2] // k.shape[2]
    qt = q.detach().transpose(1, 2).requires_grad_()
    kt, vt = (x.detach().repeat_interleave(G, 2).transpose(1, 2).requires_grad_() for x in (k, v))
    do = torch.randn_like(qt)

    def fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        o.backward(do)

    return bench(fwd), bench(fwd_bwd, [qt, kt, vt])


def make_config(args, rows):
    return KernelConfig(fwd_rows=rows, fwd_warps=4 if rows <= 64 else 8,
                        fwd_stages=args.stages, dq_rows=rows, dq_warps=4 if rows <= 64 else 8,
                        dq_stages=args.stages, dkv_rows=args.dkv_rows, dkv_warps=args.dkv_warps,
                        dkv_stages=args.stages, dkv_chunk=args.dkv_chunk)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default="16384,65536,131072")
    ap.add_argument("--rows", default="16,64,128",
                    help="rows (query tokens x G) per forward/dQ tile to sweep; 16 = per token")
    ap.add_argument("--share", default="1,64", help="tokens sharing random picks (see docstring)")
    ap.add_argument("--hq", type=int, default=64)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dkv-rows", type=int, default=64)
    ap.add_argument("--dkv-warps", type=int, default=8)
    ap.add_argument("--dkv-chunk", type=int, default=512)
    ap.add_argument("--deterministic", action="store_true", help="time the deterministic bwd")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    acc = check_accuracy(args, rows_list)
    print(f"# accuracy vs fp32 (T=2048): {json.dumps(acc)}", flush=True)

    HQ, HKV, D, C, K = args.hq, args.hkv, args.d, args.block, args.topk
    G = HQ // HKV
    results = []
    for T in (int(x) for x in args.seqlens.split(",")):
        torch.manual_seed(T)
        q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for h in (HQ, HKV, HKV))
        dense = {}
        if not args.no_dense:
            fwd, fb = bench_dense(q, k, v)
            flops = 4 * HQ * D * T * (T + 1) / 2
            dense = {"dense_fwd_ms": fwd, "dense_fwd_tflops": flops / fwd * 1e-9,
                     "dense_fwdbwd_ms": fb, "dense_fwdbwd_tflops": 3.5 * flops / fb * 1e-9}
            print(f"T={T} dense cuDNN: {json.dumps(dense)}", flush=True)
        for share in (int(x) for x in args.share.split(",")):
            idx = random_selection(1, T, HKV, C, K, share, seed=T + share)
            flops = 4 * D * HQ * T * keys_attended(idx, T, C)
            for rows in rows_list:
                cfg = make_config(args, rows)
                fwd, fb = bench_sparse(q, k, v, idx, C, cfg, args.deterministic)
                tokens = _tile_tokens(rows, _pow2(G))
                prep = bench(lambda: (_tile_union(idx, tokens), _tile_union(idx, tokens),
                                      _transpose_selection(idx, cdiv(T, C), cfg.dkv_chunk)))
                row = {"T": T, "share": share, "rows": rows, "fwd_ms": fwd,
                       "fwd_tflops": flops / fwd * 1e-9, "fwdbwd_ms": fb,
                       "fwdbwd_tflops": 3.5 * flops / fb * 1e-9, "prep_ms": prep,
                       "keys_per_token": flops / (4 * D * HQ * T),
                       "deterministic": args.deterministic, **dense}
                results.append(row)
                print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()

    nan = float("nan")
    print("\n     T share rows |  fwd ms  TF/s | f+b ms  TF/s | prep ms | dense fwd  TF/s | "
          "dense f+b  TF/s")
    for r in results:
        print(f"{r['T']:>6} {r['share']:>5} {r['rows']:>4} | {r['fwd_ms']:7.2f} "
              f"{r['fwd_tflops']:5.0f} | {r['fwdbwd_ms']:6.1f} {r['fwdbwd_tflops']:5.0f} | "
              f"{r['prep_ms']:7.2f} | {r.get('dense_fwd_ms', nan):9.1f} "
              f"{r.get('dense_fwd_tflops', nan):5.0f} | {r.get('dense_fwdbwd_ms', nan):9.1f} "
              f"{r.get('dense_fwdbwd_tflops', nan):5.0f}")
    print(f"accuracy ok: {acc['ok']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": dev, "accuracy": acc, "results": results,
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))


if __name__ == "__main__":
    main()
