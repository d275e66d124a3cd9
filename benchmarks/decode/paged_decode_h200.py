"""Paged against contiguous KV cache: PISA's fused decode step per token on one GPU (issue 15
part 3's benchmark; the bar: paged <= 1.1x contiguous).

    python benchmarks/decode/paged_decode_h200.py --out benchmarks/results/paged_decode_h200_v2.json
    python benchmarks/decode/paged_decode_h200.py --smoke   # CPU, Triton interpreter, tiny shapes

Config A (``docs/spec.md`` §10): bf16, HQ=64, HKV=4, D=128, C=64, K=16, W=16, g=2, at 1M batch 1
and 128K batch 16 (``--shapes``). The contiguous ``PisaCache`` is filled to its full length with
random keys and values (pyramid sums from the Triton pyramid build); the paged cache holds the same
pages, copied into a pool (with spare pages) in shuffled order, addressed by a shuffled
``block_table``, and the same per-slot pyramid sums. One random query per sequence.

Rows (``pisa.results`` schema; ``layout``, ``warm_ms``, ``ratio`` are extra columns), each a step
captured in a CUDA graph (``benchmarks/common.py``: ``ms`` with the L2 flushed before each replay,
``warm_ms`` back to back):
- ``decode/pisa``, ``layout`` "contiguous" | "paged" | "paged_slots": ``decode_triton`` on the
  contiguous cache, through the page table, and through the table with ``cache_batch_idx`` (the
  batch's rows the slots in reverse order: a running batch of continuous batching);
  ``ratio``: the paged row's ``ms`` over the contiguous one's.
- ``decode/pisa_append_kv``, the same layouts: ``kvcache.write_kv`` of one token per sequence at
  a fixed position (the cache write of a step).
- ``decode/pisa_step``, the same layouts: ``pisa_attn_with_kvcache`` with the append, as a serving
  step calls it (caller-owned lengths at a fixed position, so replays do not advance them).

``--smoke`` runs every row on CPU (fp32, the Triton interpreter, HQ=8, HKV=2, D=32, C=16, K=4) at
tiny shapes, wall-clock timed: it checks that the script runs, not the numbers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (DTYPE, G_BR, Results, graph_ms, graph_warm_ms, peak_gb,  # noqa: E402
                    reset_peak, result_row, time_ms)
from pisa import PagedPisaCache, PisaCache, pisa_attn_with_kvcache  # noqa: E402
from pisa.ops.decode.kvcache import write_kv  # noqa: E402
from pisa.ops.decode.triton import decode_triton  # noqa: E402
from pisa.ops.pyramid import build_pyramid  # noqa: E402
from pisa.ops.utils.config import DECODE_DEFAULTS, SelectConfig  # noqa: E402

BAR = 1.1  # paged ms <= 1.1x contiguous ms
A = dict(HQ=64, HKV=4, D=128, C=64, K=16, W=16, dtype=DTYPE)
SMOKE = dict(HQ=8, HKV=2, D=32, C=16, K=4, W=4, dtype=torch.float32)


def caches(B: int, T: int, p: dict, device: str, seed: int):
    """A full contiguous ``PisaCache`` of ``B`` sequences of ``T`` random keys, the same keys as a
    ``PagedPisaCache`` of shuffled pages (1/16 more pages than needed), and one query each."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C, H, D = p["C"], p["HKV"], p["D"]
    flat = PisaCache(B, T, H, D, block_size=C, branching=G_BR, dtype=p["dtype"], device=device)
    flat.k_cache.normal_(generator=gen)
    flat.v_cache.normal_(generator=gen)
    pyramid = build_pyramid(flat.k_cache, C, G_BR, "triton" if device == "cuda" else "torch")
    flat.sums.copy_(pyramid.means.mul_(pyramid.counts[None, :, None, None]))
    del pyramid
    flat.cache_seqlens.fill_(T)
    n = T // C
    num_pages = B * n + max(B * n // 16, 1)
    paged = PagedPisaCache(num_pages, B, T, H, D, block_size=C, branching=G_BR,
                           dtype=p["dtype"], device=device)
    perm = torch.randperm(num_pages, device=device, generator=gen)[:B * n]
    table = perm.view(B, n).to(torch.int32)
    for x, pool in ((flat.k_cache, paged.k_cache), (flat.v_cache, paged.v_cache)):
        pool[perm] = x.view(B * n, C, H, D)
    paged.block_table.copy_(table)  # the cache's own table, as a server's allocator left it
    paged.sums.copy_(flat.sums)
    paged.cache_seqlens.fill_(T)
    q = torch.randn(B, 1, p["HQ"], D, device=device, dtype=p["dtype"], generator=gen)
    return q, flat, paged


def bench_shape(B: int, T: int, p: dict, device: str, row) -> None:
    reset_peak(device)
    q, flat, paged = caches(B, T, p, device, seed=B + T)
    cfg = SelectConfig(block_size=p["C"], topk=p["K"], branching=G_BR, beam=p["W"],
                       scale=p["D"] ** -0.5, **DECODE_DEFAULTS)
    rev = torch.arange(B - 1, -1, -1, device=device, dtype=torch.int32)  # slots, reversed
    q_rev, rev_table = q[rev.long()], paged.block_table[rev.long()]
    k1, v1 = (torch.randn(B, 1, p["HKV"], p["D"], device=device, dtype=p["dtype"])
              for _ in range(2))
    at = flat.cache_seqlens - 1  # a fixed position: replays overwrite the last token
    C = p["C"]
    layouts = {
        "contiguous": (lambda: decode_triton(q, flat.k_cache, flat.v_cache, flat.sums,
                                             flat.cache_seqlens, cfg),
                       lambda: write_kv(flat.k_cache, flat.v_cache, flat.sums, k1, v1, at, C,
                                        G_BR),
                       lambda: pisa_attn_with_kvcache(q, flat, k1, v1, cache_seqlens=at,
                                                      topk=p["K"], beam=p["W"],
                                                      backend="triton")),
        "paged": (lambda: decode_triton(q, paged.k_cache, paged.v_cache, paged.sums,
                                        paged.cache_seqlens, cfg, block_table=paged.block_table),
                  lambda: write_kv(paged.k_cache, paged.v_cache, paged.sums, k1, v1, at, C,
                                   G_BR, block_table=paged.block_table),
                  lambda: pisa_attn_with_kvcache(q, paged, k1, v1, cache_seqlens=at,
                                                 block_table=paged.block_table, topk=p["K"],
                                                 beam=p["W"], backend="triton")),
        "paged_slots": (lambda: decode_triton(q_rev, paged.k_cache, paged.v_cache, paged.sums,
                                              paged.cache_seqlens, cfg, block_table=rev_table,
                                              cache_batch_idx=rev),
                        lambda: write_kv(paged.k_cache, paged.v_cache, paged.sums, k1, v1, at, C,
                                         G_BR, block_table=rev_table, cache_batch_idx=rev),
                        lambda: pisa_attn_with_kvcache(q_rev, paged, k1, v1, cache_seqlens=at,
                                                       block_table=rev_table,
                                                       cache_batch_idx=rev, topk=p["K"],
                                                       beam=p["W"], backend="triton")),
    }
    base = {}
    for layout, fns in layouts.items():
        for op, fn in zip(("pisa", "pisa_append_kv", "pisa_step"), fns):
            if device == "cuda":
                ms, warm = graph_ms(fn), graph_warm_ms(fn)
            else:
                ms, warm = time_ms(fn, device, reps=1), None
            base.setdefault(op, ms)
            row("decode", op, "triton", B, T, ms, p, layout=layout, warm_ms=warm,
                ratio=ms / base[op])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x1048576", "16x131072"],
                    help="BxT pairs (default: 1M batch 1 and 128K batch 16)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, Triton interpreter, tiny shapes (1x256 and 2x128 unless --shapes)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default paged_decode_h200.json here (none with --smoke)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        if args.shapes == ap.get_default("shapes"):
            args.shapes = ["1x256", "2x128"]
        p = SMOKE
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        p = A
        if args.out is None:
            args.out = Path("paged_decode_h200.json")
    out = Results(args.out, device)

    def row(op, impl, backend, B, T, ms, p, **extra):
        r = out.add(result_row(op, impl, backend, B=B, T=T, HQ=p["HQ"], HKV=p["HKV"], D=p["D"],
                               K=p["K"], C=p["C"], g=G_BR, W=p["W"],
                               dtype=str(p["dtype"]).replace("torch.", ""), ms=ms,
                               peak_gb=peak_gb(device), **extra))
        out.save()  # after every row: a timeout keeps them
        return r

    t_start = time.time()
    for shape in args.shapes:
        B, T = (int(x) for x in shape.lower().split("x"))
        t0 = time.time()
        bench_shape(B, T, p, device, row)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"# B={B} T={T} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    print(f"# total {time.time() - t_start:.0f}s, wrote {len(out.rows)} rows to {args.out}",
          file=sys.stderr)
    print(table(out.rows))


def table(rows: list[dict]) -> str:
    """Markdown: per (B, T) and layout the decode step, the cache write and the serving step
    (ms, warm ms, ratio to contiguous), and the bar on the decode step."""
    lines = ["| B | T | op | layout | ms | warm ms | / contiguous |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        warm = "-" if r["warm_ms"] is None else f"{r['warm_ms']:.4f}"
        lines.append(f"| {r['B']} | {r['T']} | {r['impl']} | {r['layout']} | {r['ms']:.4f} | "
                     f"{warm} | {r['ratio']:.3f} |")
    lines.append("")
    for r in rows:
        if r["impl"] == "pisa" and r["layout"] != "contiguous":
            ok = "met" if r["ratio"] <= BAR else "NOT met"
            lines.append(f"- B={r['B']} T={r['T']} {r['layout']}: {r['ratio']:.3f}x contiguous "
                         f"(bar <= {BAR}): {ok}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
