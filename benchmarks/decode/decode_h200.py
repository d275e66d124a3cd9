"""Decode latency per step on one GPU: PISA's fused Triton decode kernel against dense SDPA over the
same KV cache, plus the prefill of a long prompt (issue 4's benchmark).

    python benchmarks/decode/decode_h200.py --lengths 1048576 --batches 1 16 --splits --warps \
        --stages --sweep-lengths --prefill-len 0 --out benchmarks/results/decode_h200_v3.json
    python benchmarks/decode/decode_h200.py --quick  # 32K and 1M, batch 1 and 16, the sweep

Config A (docs/spec.md §10): bf16, HQ=64, HKV=4, D=128, C=64, K=16, W=16, g=2; batch 1 and 16;
contexts 32K, 64K, ..., 1M. Each ``PisaCache`` is filled to its full length with random keys and
values (pyramid sums from the Triton pyramid build), one random query per sequence.

Timing (``benchmarks/common.py``). ``ms``: one step captured in a CUDA graph, its replays timed by
``time_ms`` (do_bench: the L2 cache flushed before each replay, as in a model whose other layers
evict this layer's cache between steps; median of CUDA events). ``warm_ms``:
``triton.testing.do_bench_cudagraph`` (the step unrolled in a graph, back to back, L2 warm), for
comparison with figures measured that way (the dense anchors of docs/spec.md §10). ``eager_ms``
(the pisa rows): the step called from Python, its host checks and launches included (``time_ms``,
L2 flushed): issue 27's eager bar.

Rows (``pisa.results`` schema; ``splits``, ``num_warps``, ``num_stages``, ``warm_ms``,
``best_of`` are extra columns; ``None`` is the default):
- ``decode/pisa``: ``pisa_attn_with_kvcache`` (one query per sequence, no append: the fused
  kernel ``decode_triton`` with its default split count, warps and stages);
  ``decode/pisa_sweep`` (batch 1, ``--sweep-lengths``): ``decode_triton`` varying one knob at a
  time from the defaults, each split count of ``--splits``, each ``--warps``, each ``--stages``.
- ``decode/pisa_append_kv``: ``kvcache.write_kv`` of one token per sequence, the cache write of a
  step (not in the decode rows: the dense rows leave their cache write out too): the fused Triton
  append (``kvcache_triton``); ``decode/pisa_append_kv_torch``: the same through the torch ops.
- ``decode/pisa_<selection>`` (``--selections``; issue 27's study of decode's default selection):
  the step with another scorer and leaf beam, ``{lse,bound}_W2_{16,32}`` (``scorer``;
  ``beam_leaf`` None, i.e. W = 16, or 32), and on a cache of branching 4 (``_g4``: half the
  levels), on a cache that keeps the key bounds for "bound" (``decode/pisa_append_kv_bounds_g*``:
  its cache write, bounds included).
- ``decode/sdpa_<backend>_<gqa>``: SDPA over every key of the same cache (read in place as a
  ``[B, HKV, T, D]`` view) with the FLASH, EFFICIENT and CUDNN backends; GQA either folded into the
  query length (``fold``: ``dense_decode``, the G query heads of a KV head as G query tokens, no
  repeated K/V) or through ``enable_gqa=True`` (``gqa``). Variants that fail are skipped.
  ``decode/dense`` repeats the fastest of them (named in ``best_of``).
- ``fwd/pisa`` and ``fwd/dense``: prefill of a ``--prefill-len`` prompt (batch 1), ``pisa_attn``
  (Triton) against dense causal SDPA forced to cuDNN.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (C, D, DTYPE, G_BR, HKV, HQ, K, W, Results, dense_attention,
                    dense_decode, graph_ms, graph_warm_ms, peak_gb, randn_qkv, reset_peak,
                    result_row, shape, time_ms)
from pisa import PisaCache, pisa_attn, pisa_attn_with_kvcache
from pisa.ops.decode.kvcache import write_kv
from pisa.ops.decode.triton import decode_triton, default_num_splits
from pisa.ops.pyramid import build_pyramid
from pisa.ops.utils.config import DECODE_DEFAULTS, SelectConfig

# Targets of issue 4 (H200): batch 1 at 1M <= 0.12 ms and <= 1.5x its 32K time; batch 16 at 1M
# >= 20x faster than the fastest dense decode.
TARGET_B1_MS, TARGET_B1_RATIO, TARGET_B16_SPEEDUP = 0.12, 1.5, 20.0
# Issue 27 (serving): batch 1 at 1M <= 0.08 ms in a CUDA graph, <= 0.12 ms called eagerly.
TARGET27_GRAPH_MS, TARGET27_EAGER_MS = 0.08, 0.12
# ``--selections``: decode's scorer and leaf beam, and the cache's branching (the default is
# lse_W2_16 on g = 2)
SELECTIONS = {f"{scorer}_W2_{leaf or W}" + (f"_g{g}" if g != G_BR else ""):
              dict(scorer=scorer, beam_leaf=leaf, branching=g)
              for g, scorer, leaf in [(G_BR, s, leaf) for s in ("lse", "bound")
                                      for leaf in (None, 32)]
              + [(4, "lse", None), (4, "lse", 32), (4, "bound", 32)]}


def sdpa_variants(q, k_cache, v_cache):
    """``{name: fn}`` dense decode over the cache, per SDPA backend and GQA handling."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        out[f"sdpa_{name}_fold"] = dense_decode(q, k_cache, v_cache, backend)

        def gqa(backend=backend):  # pisa.bench.dense_decode has no enable_gqa form
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        out[f"sdpa_{name}_gqa"] = gqa
    return out


def filled_cache(B: int, T: int, seed: int, device: str = "cuda", bounds: bool = False,
                 branching: int = G_BR):
    """A ``PisaCache`` holding ``T`` random keys/values per sequence (its sums, and with
    ``bounds`` its key bounds, from the pyramid build) and one random query per sequence."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = PisaCache(B, T, HKV, D, block_size=C, branching=branching, dtype=DTYPE,
                      device=device, bounds=bounds)
    cache.k_cache.normal_(generator=gen)
    cache.v_cache.normal_(generator=gen)
    pyramid = build_pyramid(cache.k_cache, C, branching,
                            "triton" if device == "cuda" else "torch", bounds=bounds)
    cache.sums.copy_(pyramid.means.mul_(pyramid.counts[None, :, None, None]))
    if bounds:
        cache.mins.copy_(pyramid.mins)
        cache.maxs.copy_(pyramid.maxs)
    cache.cache_seqlens.fill_(T)
    q = torch.randn(B, 1, HQ, D, device=device, dtype=DTYPE, generator=gen)
    return q, cache


def bench_shape(B: int, T: int, cfg: SelectConfig, args, row) -> None:
    """The decode rows of one (batch, context): pisa (default splits, and the sweep), every dense
    SDPA variant and the fastest, and the cache write."""
    reset_peak("cuda")
    q, cache = filled_cache(B, T, seed=T + B)
    kc, vc, sums, lens = cache.k_cache, cache.v_cache, cache.sums, cache.cache_seqlens

    def step():
        return pisa_attn_with_kvcache(q, cache, topk=K, beam=W, backend="triton")
    splits = default_num_splits(B, HKV, cfg.slots, q.device)
    row("decode", "pisa", "triton", B, T, graph_ms(step), splits=splits, num_warps=None,
        num_stages=None, warm_ms=graph_warm_ms(step), eager_ms=time_ms(step, "cuda"))
    if B == 1 and T in args.sweep_lengths:
        sweep = [(s, None, None) for s in args.splits] + [(splits, w, None) for w in args.warps] \
            + [(splits, None, st) for st in args.stages]
        for s, w, st in sweep:
            def fn(s=s, w=w, st=st):
                return decode_triton(q, kc, vc, sums, lens, cfg, num_splits=s, num_warps=w,
                                     num_stages=st)
            row("decode", "pisa_sweep", "triton", B, T, graph_ms(fn), splits=min(s, cfg.slots),
                num_warps=w, num_stages=st, warm_ms=graph_warm_ms(fn))
    dense = []
    for name, fn in sdpa_variants(q, kc, vc).items():
        reset_peak("cuda")
        try:
            ms = graph_ms(fn)
        except RuntimeError as e:  # the backend refuses the shape, dtype or layout
            print(f"# skip {name} B={B} T={T}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        dense.append(row("decode", name, "sdpa", B, T, ms, warm_ms=graph_warm_ms(fn)))
    if dense:
        best = min(dense, key=lambda r: r["ms"])
        row("decode", "dense", "sdpa", B, T, best["ms"], warm_ms=best["warm_ms"],
            best_of=best["impl"])
    # the cache write of a step, at a fixed position (the lengths do not advance)
    k1, v1 = (torch.randn(B, 1, HKV, D, device="cuda", dtype=DTYPE) for _ in range(2))
    at = lens - 1

    def append():
        write_kv(kc, vc, sums, k1, v1, at, C, G_BR)
    append_rows(row, "pisa_append_kv", B, T, append)
    del q, cache, kc, vc, sums
    bench_selections(B, T, args, row)


def append_rows(row, name: str, B: int, T: int, append) -> None:
    """The cache write ``append`` as a step runs it (``name``: the fused Triton append on CUDA)
    and through the torch ops (``name + "_torch"``), in the same run. A variant that fails (a
    kernel the GPU tests have not yet seen) is reported and skipped, so the rows after it still
    run."""
    import pisa.ops.decode.kvcache as kvcache
    fused = kvcache._fused
    for impl, backend, use in ((name, "triton", fused), (name + "_torch", "torch", None)):
        kvcache._fused = use or (lambda *a: False)
        try:
            row("decode", impl, backend, B, T, graph_ms(append), warm_ms=graph_warm_ms(append))
        except Exception as e:  # noqa: BLE001 (reported, then the next rows)
            print(f"# skip {impl} B={B} T={T}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            kvcache._fused = fused


def bench_selections(B: int, T: int, args, row) -> None:
    """``decode/pisa_<selection>`` for each of ``--selections``, on a cache of the selection's
    branching with key bounds for the bound scorer (whose cache write is timed too)."""
    kinds = sorted({(s["branching"], s["scorer"] == "bound")
                    for s in map(SELECTIONS.get, args.selections)})
    for g, bounds in kinds:
        q, cache = filled_cache(B, T, seed=T + B, bounds=bounds, branching=g)
        for name in args.selections:
            knobs = dict(SELECTIONS[name])
            if (knobs.pop("branching"), knobs["scorer"] == "bound") != (g, bounds):
                continue

            def step(knobs=knobs):
                return pisa_attn_with_kvcache(q, cache, topk=K, beam=W, backend="triton",
                                              **knobs)
            row("decode", f"pisa_{name}", "triton", B, T, graph_ms(step),
                warm_ms=graph_warm_ms(step), eager_ms=time_ms(step, "cuda"),
                **SELECTIONS[name])
        if bounds:
            k1, v1 = (torch.randn(B, 1, HKV, D, device="cuda", dtype=DTYPE) for _ in range(2))
            at = cache.cache_seqlens - 1

            def append():
                write_kv(cache.k_cache, cache.v_cache, cache.sums, k1, v1, at, C, g,
                         cache.mins, cache.maxs)
            append_rows(row, f"pisa_append_kv_bounds_g{g}", B, T, append)
        del q, cache


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
    ap.add_argument("--reps", type=int, default=None,
                    help="ignored (kept so older command lines run): graph replays are timed by "
                         "common.time_ms, ~100 ms of replays each")
    ap.add_argument("--prefill-len", type=int, default=131072, help="0 skips the prefill rows")
    ap.add_argument("--selections", nargs="*", default=[], choices=SELECTIONS,
                    help="decode rows with these scorers and leaf beams too")
    ap.add_argument("--quick", action="store_true",
                    help="batch 1 and 16 at 32K and 1M only (and the sweep), no prefill")
    ap.add_argument("--out", type=Path, default=None,
                    help="default decode_h200.json (_quick.json with --quick), here")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.batches, args.prefill_len = [32768, 1 << 20], [1, 16], 0
    if args.out is None:
        args.out = Path(f"decode_h200{'_quick' if args.quick else ''}.json")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cfg = SelectConfig(block_size=C, topk=K, branching=G_BR, beam=W, scale=D ** -0.5,
                       **DECODE_DEFAULTS)
    out = Results(args.out, "cuda")
    t_start = time.time()

    def row(op, impl, backend, B, T, ms, **extra):
        r = out.add(result_row(op, impl, backend, T=T, ms=ms, peak_gb=peak_gb("cuda"),
                               **shape(B=B), **extra))
        out.save()  # after every row: a timeout keeps them
        return r

    for B in args.batches:
        for T in args.lengths:
            t0 = time.time()
            bench_shape(B, T, cfg, args, row)
            torch.cuda.empty_cache()
            print(f"# B={B} T={T} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)

    if args.prefill_len:
        T = args.prefill_len
        q, k, v = randn_qkv(T, seed=T)
        with torch.no_grad():
            reset_peak("cuda")
            row("fwd", "pisa", "triton", 1, T, time_ms(
                lambda: pisa_attn(q, k, v, block_size=C, topk=K, beam=W, branching=G_BR,
                                  backend="triton"), "cuda"))
            reset_peak("cuda")
            row("fwd", "dense", "cudnn", 1, T, time_ms(dense_attention(q, k, v, "cuda"), "cuda"))
    print(f"# total {time.time() - t_start:.0f}s, wrote {len(out.rows)} rows to {args.out}",
          file=sys.stderr)
    print(table(out.rows))


def table(rows: list[dict]) -> str:
    """Markdown: decode per (B, T) — pisa (cold / warm L2, splits), its cache write, the fastest
    dense SDPA and the speedup; then the prefill rows and the issue's targets."""
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["T"]), {})[(r["op"], r["impl"])] = r
    lines = ["| B | T | pisa ms | pisa warm ms | pisa eager ms | splits | append_kv ms "
             "(torch ops) | dense ms | dense | speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (B, T), d in sorted(by.items()):
        p, a, at, dn = (d.get(("decode", name)) for name in (
            "pisa", "pisa_append_kv", "pisa_append_kv_torch", "dense"))
        if p is None:
            continue
        eager = p.get("eager_ms")
        cells = [B, T, f"{p['ms']:.4f}", f"{p['warm_ms']:.4f}",
                 f"{eager:.4f}" if eager else "-", p["splits"],
                 (f"{a['ms']:.4f}" if a else "-") + (f" ({at['ms']:.4f})" if at else ""),
                 f"{dn['ms']:.3f}" if dn else "-",
                 dn["best_of"] if dn else "-", f"{dn['ms'] / p['ms']:.1f}x" if dn else "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    sweep = [r for r in rows if r["impl"] == "pisa_sweep"]
    if sweep:
        lines += ["", "| T | splits | num_warps | num_stages | ms | warm ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['T']} | {r['splits']} | {r['num_warps'] or 'default'} | "
                  f"{r.get('num_stages') or 'default'} | {r['ms']:.4f} | {r['warm_ms']:.4f} |"
                  for r in sweep]
    picks = [r for r in rows if r["impl"].startswith("pisa_") and r.get("scorer")
             or r["impl"].startswith("pisa_append_kv_bounds")]
    if picks:
        lines += ["", "| B | T | decode selection | ms | warm ms | eager ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['B']} | {r['T']} | {r['impl'][5:]} | {r['ms']:.4f} | "
                  f"{r['warm_ms']:.4f} | {r['eager_ms']:.4f} |" if r.get("eager_ms") else
                  f"| {r['B']} | {r['T']} | {r['impl'][5:]} | {r['ms']:.4f} | "
                  f"{r['warm_ms']:.4f} | - |" for r in picks]
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
        eager = b1[("decode", "pisa")].get("eager_ms")
        for what, x, bar in (("in a CUDA graph", ms, TARGET27_GRAPH_MS),
                             ("eager", eager, TARGET27_EAGER_MS)):
            if x is not None:
                out.append(f"- issue 27, batch 1 at 1M {what}: {x:.4f} ms (target <= {bar}): "
                           f"{'met' if x <= bar else 'NOT met'}")
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
