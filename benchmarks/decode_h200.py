"""Decode latency per step on one GPU: PISA's fused Triton decode kernel against dense SDPA over the
same KV cache, plus the prefill of a long prompt (issue 4's benchmark).

    python benchmarks/decode_h200.py --out benchmarks/results/decode_h200.json
    python benchmarks/decode_h200.py --quick  # 32K and 1M, batch 1 and 16, the sweep

Config A (PISA_SPEC.md §10): bf16, HQ=64, HKV=4, D=128, C=64, K=16, W=16, g=2; batch 1 and 16;
contexts 32K, 64K, ..., 1M. Each cache is filled to its full length with random keys and values
(pyramid sums from the Triton pyramid build), one random query per sequence.

Timing. ``ms``: one step captured in a CUDA graph, replayed ``--reps`` times with the L2 cache
flushed before each replay (in a model the other layers evict this layer's cache between steps),
median of CUDA events around each replay. ``warm_ms``: ``triton.testing.do_bench_cudagraph``
(the step unrolled in a graph, back to back, L2 warm), for comparison with figures measured that
way (the dense anchors of PISA_SPEC.md §10).

Rows (``pisa/bench.py`` schema; ``splits``, ``num_warps``, ``num_stages``, ``warm_ms``,
``best_of`` are extra columns; ``None`` is the default):
- ``decode/pisa``: ``decode_triton`` with its default split count, warps and stages;
  ``decode/pisa_sweep`` (batch 1, ``--sweep-lengths``): the same step varying one knob at a time
  from the defaults, each split count of ``--splits``, each ``--warps``, each ``--stages``.
- ``decode/pisa_append_kv``: ``append_kv`` of one token per sequence, the cache write of a step
  (not in the decode rows: the dense rows leave their cache write out too).
- ``decode/sdpa_<backend>_<gqa>``: SDPA over every key of the same cache (read in place as a
  ``[B, HKV, T, D]`` view) with the FLASH, EFFICIENT and CUDNN backends; GQA either folded into the
  query length (``fold``: the G query heads of a KV head as G query tokens, no repeated K/V) or
  through ``enable_gqa=True`` (``gqa``). Variants that fail are skipped. ``decode/dense`` repeats
  the fastest of them (named in ``best_of``).
- ``fwd/pisa`` and ``fwd/dense``: prefill of a ``--prefill-len`` prompt (batch 1), ``pisa_attn``
  (Triton) against dense causal SDPA forced to cuDNN.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pisa import pisa_attn  # noqa: E402
from pisa.bench import (dense_attention, dense_decode, meta, peak_gb, reset_peak,  # noqa: E402
                        result_row, time_ms)
from pisa.ops.decode_triton import decode_triton, default_num_splits  # noqa: E402
from pisa.ops.kvcache import append_kv  # noqa: E402
from pisa.ops.select_triton import build_pyramid_triton  # noqa: E402
from pisa.ops.utils import SelectConfig  # noqa: E402

HQ, HKV, D, C, K, W, G_BR = 64, 4, 128, 64, 16, 16, 2
DTYPE = torch.bfloat16
# Targets of issue 4 (H200): batch 1 at 1M <= 0.12 ms and <= 1.5x its 32K time; batch 16 at 1M
# >= 20x faster than the fastest dense decode.
TARGET_B1_MS, TARGET_B1_RATIO, TARGET_B16_SPEEDUP = 0.12, 1.5, 20.0


def graph_ms(fn, reps: int, flush: torch.Tensor) -> float:
    """Median ms of ``reps`` replays of a CUDA graph holding one call of ``fn``, the L2 cache
    flushed (``flush`` zeroed, untimed) before each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def warm_ms(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


def sdpa_variants(q, k_cache, v_cache):
    """``{name: fn}`` dense decode over the cache, per SDPA backend and GQA handling."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        out[f"sdpa_{name}_fold"] = dense_decode(q, k_cache, v_cache, backend)

        def gqa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        out[f"sdpa_{name}_gqa"] = gqa
    return out


def filled_cache(B: int, T: int, seed: int):
    """A full cache of ``T`` random keys/values per sequence, its pyramid sums and lengths."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k_cache = torch.randn(B, T, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn(B, T, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    pyramid = build_pyramid_triton(k_cache, C, G_BR)
    sums = pyramid.means.mul_(pyramid.counts[None, :, None, None])
    lens = torch.full((B,), T, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=DTYPE, generator=gen)
    return q, k_cache, v_cache, sums, lens


def bench_shape(B: int, T: int, cfg: SelectConfig, args, flush: torch.Tensor, row) -> None:
    """The decode rows of one (batch, context): pisa (default splits, and the sweep), every dense
    SDPA variant and the fastest, and the cache write."""
    reset_peak("cuda")
    q, k_cache, v_cache, sums, lens = filled_cache(B, T, seed=T + B)

    def step(splits=None, warps=None, stages=None):
        return decode_triton(q, k_cache, v_cache, sums, lens, cfg, num_splits=splits,
                             num_warps=warps, num_stages=stages)
    splits = default_num_splits(B, HKV, cfg.slots, q.device)
    row("decode", "pisa", "triton", B, T, graph_ms(step, args.reps, flush), splits=splits,
        num_warps=None, num_stages=None, warm_ms=warm_ms(step))
    if B == 1 and T in args.sweep_lengths:
        sweep = [(s, None, None) for s in args.splits] + [(splits, w, None) for w in args.warps] \
            + [(splits, None, st) for st in args.stages]
        for s, w, st in sweep:
            fn = lambda s=s, w=w, st=st: step(s, w, st)  # noqa: E731
            row("decode", "pisa_sweep", "triton", B, T, graph_ms(fn, args.reps, flush),
                splits=min(s, cfg.slots), num_warps=w, num_stages=st, warm_ms=warm_ms(fn))
    dense = []
    for name, fn in sdpa_variants(q, k_cache, v_cache).items():
        reset_peak("cuda")
        try:
            ms = graph_ms(fn, args.reps, flush)
        except RuntimeError as e:  # the backend refuses the shape, dtype or layout
            print(f"# skip {name} B={B} T={T}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        dense.append(row("decode", name, "sdpa", B, T, ms, warm_ms=warm_ms(fn)))
    if dense:
        best = min(dense, key=lambda r: r["ms"])
        row("decode", "dense", "sdpa", B, T, best["ms"], warm_ms=best["warm_ms"],
            best_of=best["impl"])
    # the cache write of a step, at a fixed position (the lengths do not advance)
    k1, v1 = (torch.randn(B, 1, HKV, D, device="cuda", dtype=DTYPE) for _ in range(2))
    at = lens - 1

    def append():
        append_kv(k_cache, v_cache, sums, k1, v1, at, C, G_BR)
    row("decode", "pisa_append_kv", "torch", B, T, graph_ms(append, args.reps, flush),
        warm_ms=warm_ms(append))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1 << p for p in range(15, 21)])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--splits", type=int, nargs="*", default=[4, 8, 16],
                    help="split counts of the batch-1 sweep (default warps and stages; counts "
                         "above K are capped at K, one selected block per split)")
    ap.add_argument("--warps", type=int, nargs="*", default=[4],
                    help="num_warps values of the batch-1 sweep (default splits and stages)")
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 4],
                    help="num_stages values of the batch-1 sweep (default splits and warps)")
    ap.add_argument("--sweep-lengths", type=int, nargs="*", default=[32768, 1 << 20])
    ap.add_argument("--reps", type=int, default=50, help="graph replays per timing (median)")
    ap.add_argument("--prefill-len", type=int, default=131072, help="0 skips the prefill rows")
    ap.add_argument("--quick", action="store_true",
                    help="batch 1 and 16 at 32K and 1M only (and the sweep), no prefill")
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/decode_h200.json (_quick.json with --quick)")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.batches, args.prefill_len = [32768, 1 << 20], [1, 16], 0
    if args.out is None:
        args.out = Path(f"benchmarks/results/decode_h200{'_quick' if args.quick else ''}.json")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cfg = SelectConfig(block_size=C, topk=K, branching=G_BR, beam=W, scale=D ** -0.5)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    rows = []
    t_start = time.time()

    def row(op, impl, backend, B, T, ms, **extra):
        r = result_row(op, impl, backend, B=B, T=T, HQ=HQ, HKV=HKV, D=D, K=K, C=C, g=G_BR, W=W,
                       dtype="bfloat16", ms=ms, peak_gb=peak_gb("cuda"), **extra)
        rows.append(r)
        print(json.dumps(r), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # after every row: a timeout keeps them
        args.out.write_text(json.dumps({"meta": meta("cuda", "python " + " ".join(sys.argv)),
                                        "rows": rows}, indent=1))
        return r

    for B in args.batches:
        for T in args.lengths:
            t0 = time.time()
            bench_shape(B, T, cfg, args, flush, row)
            torch.cuda.empty_cache()
            print(f"# B={B} T={T} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)

    if args.prefill_len:
        T = args.prefill_len
        gen = torch.Generator(device="cuda").manual_seed(T)
        q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=DTYPE, generator=gen)
                   for h in (HQ, HKV, HKV))
        with torch.no_grad():
            reset_peak("cuda")
            row("fwd", "pisa", "triton", 1, T, time_ms(
                lambda: pisa_attn(q, k, v, block_size=C, topk=K, beam=W, branching=G_BR,
                                  backend="triton"), "cuda"))
            reset_peak("cuda")
            row("fwd", "dense", "cudnn", 1, T, time_ms(dense_attention(q, k, v, "cuda"), "cuda"))
    print(f"# total {time.time() - t_start:.0f}s, wrote {len(rows)} rows to {args.out}",
          file=sys.stderr)
    print(table(rows))


def table(rows: list[dict]) -> str:
    """Markdown: decode per (B, T) — pisa (cold / warm L2, splits), its cache write, the fastest
    dense SDPA and the speedup; then the prefill rows and the issue's targets."""
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["T"]), {})[(r["op"], r["impl"])] = r
    lines = ["| B | T | pisa ms | pisa warm ms | splits | append_kv ms | dense ms | dense | "
             "speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for (B, T), d in sorted(by.items()):
        p, a, dn = d.get(("decode", "pisa")), d.get(("decode", "pisa_append_kv")), \
            d.get(("decode", "dense"))
        if p is None:
            continue
        cells = [B, T, f"{p['ms']:.4f}", f"{p['warm_ms']:.4f}", p["splits"],
                 f"{a['ms']:.4f}" if a else "-", f"{dn['ms']:.3f}" if dn else "-",
                 dn["best_of"] if dn else "-", f"{dn['ms'] / p['ms']:.1f}x" if dn else "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    sweep = [r for r in rows if r["impl"] == "pisa_sweep"]
    if sweep:
        lines += ["", "| T | splits | num_warps | num_stages | ms | warm ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['T']} | {r['splits']} | {r['num_warps'] or 'default'} | "
                  f"{r.get('num_stages') or 'default'} | {r['ms']:.4f} | {r['warm_ms']:.4f} |"
                  for r in sweep]
    fwd = [r for r in rows if r["op"] == "fwd"]
    if fwd:
        lines += ["", "| prefill T | impl | ms | peak GB |", "|---|---|---|---|"]
        lines += [f"| {r['T']} | {r['impl']} | {r['ms']:.1f} | {r['peak_gb']:.1f} |" for r in fwd]
    lines += ["", *targets(by)]
    return "\n".join(lines)


def targets(by: dict) -> list[str]:
    """The issue's done-when checks, where the rows to judge them exist."""
    out = []
    b1, b1_32k = by.get((1, 1 << 20), {}), by.get((1, 32768), {})
    if ("decode", "pisa") in b1:
        ms = b1[("decode", "pisa")]["ms"]
        out.append(f"- batch 1 at 1M: {ms:.4f} ms (target <= {TARGET_B1_MS}): "
                   f"{'met' if ms <= TARGET_B1_MS else 'NOT met'}")
        if ("decode", "pisa") in b1_32k:
            ratio = ms / b1_32k[("decode", "pisa")]["ms"]
            out.append(f"- batch 1, 1M / 32K: {ratio:.2f}x (target <= {TARGET_B1_RATIO}): "
                       f"{'met' if ratio <= TARGET_B1_RATIO else 'NOT met'}")
    b16 = by.get((16, 1 << 20), {})
    if ("decode", "pisa") in b16 and ("decode", "dense") in b16:
        speedup = b16[("decode", "dense")]["ms"] / b16[("decode", "pisa")]["ms"]
        out.append(f"- batch 16 at 1M: {speedup:.1f}x faster than "
                   f"{b16[('decode', 'dense')]['best_of']} (target >= {TARGET_B16_SPEEDUP}): "
                   f"{'met' if speedup >= TARGET_B16_SPEEDUP else 'NOT met'}")
    return out


if __name__ == "__main__":
    main()
