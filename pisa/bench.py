"""The main job, ``pisa bench``: selection and attention timings plus selection quality.

Rows follow the project's result schema (``pisa.results``). The timer and the dense baselines here
are the ones every benchmark script uses (``benchmarks/common.py``).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .api import pisa_attn, pisa_attn_with_kvcache, pisa_select
from .cache import PisaCache
from .eval.metrics import SelectionScorer
from .eval.synthetic import structured_qkv
from .ops.utils.config import SelectConfig
from .results import meta, result_row

SELECTORS = ("pyramid", "flat_mean", "flat_lse")


@dataclass
class BenchConfig:
    lengths: list[int]
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    topk: int = SelectConfig.topk
    block_size: int = SelectConfig.block_size
    branching: int = SelectConfig.branching
    beam: int | None = None
    dtype: str = "float32"
    backend: str = "auto"
    device: str = "cpu"
    flat_lse_max: int = 65536
    quality_max: int = 16384
    dense_max: int = 1 << 20
    backward: bool = False
    decode: bool = False
    reps: int = 3
    log: object = field(default=sys.stderr, repr=False)


def time_ms(fn, device: str, reps: int = 3) -> float:
    """Median milliseconds of ``fn()`` after a warm-up run. On CUDA: triton's ``do_bench`` (CUDA
    events) for short calls; calls over 100 ms (where do_bench would spend 8+ runs) get ``reps``
    event-timed runs. On CPU: wall clock over ``reps`` runs."""
    if device.startswith("cuda"):
        fn()  # warm-up (compiles)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 < 0.1:
            from triton.testing import do_bench
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def triton_variants() -> int:
    """Compiled variants of pisa's Triton kernels in this process, over every device: a call that
    raises it compiled (a new length that specialises a kernel shows up here)."""
    from triton.runtime.jit import JITFunction
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("pisa.ops.") or mod is None:
            continue
        for fn in vars(mod).values():
            if isinstance(fn, JITFunction) and getattr(fn, "__module__", name) == name:
                n += sum(len(caches[0]) for caches in fn.device_caches.values())
    return n


def peak_gb(device: str) -> float | None:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def dense_attention(q, k, v, device: str):
    """Dense causal SDPA; on CUDA forced to the cuDNN backend (GQA by repeating K/V first)."""
    G = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(G, dim=2).transpose(1, 2) if G > 1 else k.transpose(1, 2)
    vt = v.repeat_interleave(G, dim=2).transpose(1, 2) if G > 1 else v.transpose(1, 2)
    if device.startswith("cuda"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return run
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def dense_decode(q, k, v, backend=None):
    """Dense attention of one query per sequence ``q [B, 1, HQ, D]`` over every key of
    ``k, v [B, T, HKV, D]`` (the cache layout, read in place): each KV head's ``G`` query heads
    become a query length of ``G``, so GQA needs no repeated K/V. ``backend``: an ``SDPBackend``
    to force (default: SDPA's choice)."""
    B, _, HQ, D = q.shape
    qf = q.reshape(B, k.shape[2], HQ // k.shape[2], D)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if backend is None:
        return lambda: F.scaled_dot_product_attention(qf, kt, vt)
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qf, kt, vt)
    return run


def run_bench(cfg: BenchConfig, command: str = "pisa bench") -> dict:
    """Sweep ``cfg.lengths``; returns ``{"meta", "rows"}`` in the project's result schema."""
    dtype = getattr(torch, cfg.dtype)
    W = cfg.beam or cfg.topk
    knobs = dict(block_size=cfg.block_size, topk=cfg.topk, branching=cfg.branching,
                 beam=cfg.beam, backend=cfg.backend)
    rows = []

    def row(op, impl, T, ms, peak=None, recall=None, mass=None):
        r = result_row(op, impl, cfg.backend, B=cfg.batch, T=T, HQ=cfg.heads, HKV=cfg.kv_heads,
                       D=cfg.head_dim, K=cfg.topk, C=cfg.block_size, g=cfg.branching, W=W,
                       dtype=cfg.dtype, ms=ms, peak_gb=peak, recall=recall, mass=mass)
        rows.append(r)
        print(f"  {op:7s} {impl:10s} T={T:<8d} ms={ms if ms is None else round(ms, 3)}"
              f" recall={recall} mass={mass}", file=cfg.log, flush=True)

    for T in cfg.lengths:
        print(f"[pisa bench] T={T} on {cfg.device}", file=cfg.log, flush=True)
        q, k, v = structured_qkv(cfg.batch, T, cfg.heads, cfg.kv_heads, cfg.head_dim,
                                 block_size=cfg.block_size, dtype=dtype, device=cfg.device,
                                 seed=T)
        score = SelectionScorer(q, k, **knobs) if T <= cfg.quality_max else None
        for sel in SELECTORS:
            if sel == "flat_lse" and T > cfg.flat_lse_max:
                continue
            reset_peak(cfg.device)
            ms = time_ms(lambda: pisa_select(q, k, selector=sel, **knobs), cfg.device, cfg.reps)
            peak = peak_gb(cfg.device)
            quality = score(score.select(sel)) if score else {"recall": None, "mass": None}
            row("select", sel, T, ms, peak, quality["recall"], quality["mass"])
        reset_peak(cfg.device)
        row("fwd", "pisa", T, time_ms(lambda: pisa_attn(q, k, v, **knobs), cfg.device, cfg.reps),
            peak_gb(cfg.device))
        if T <= cfg.dense_max:
            reset_peak(cfg.device)
            dense = dense_attention(q, k, v, cfg.device)
            row("fwd", "dense", T, time_ms(dense, cfg.device, cfg.reps), peak_gb(cfg.device))
        if cfg.backward:
            _bench_fwdbwd(cfg, q, k, v, knobs, T, row)
        if cfg.decode:
            _bench_decode(cfg, q, k, v, T, row)
    return {"meta": meta(cfg.device, command), "rows": rows}


def _bench_decode(cfg, q, k, v, T, row):
    """One decode step at the end of the sequence: its last query against a cache holding its
    ``T`` keys (``pisa_attn_with_kvcache``: the fused Triton kernel on CUDA, the torch decode on
    CPU), and dense attention over the same keys."""
    cache = PisaCache.from_prefill(k, v, block_size=cfg.block_size, branching=cfg.branching)
    q1 = q[:, -1:]
    reset_peak(cfg.device)
    row("decode", "pisa", T, time_ms(
        lambda: pisa_attn_with_kvcache(q1, cache, topk=cfg.topk, beam=cfg.beam,
                                       backend=cfg.backend), cfg.device, cfg.reps),
        peak_gb(cfg.device))
    if T <= cfg.dense_max:
        reset_peak(cfg.device)
        row("decode", "dense", T, time_ms(dense_decode(q1, k, v), cfg.device, cfg.reps),
            peak_gb(cfg.device))


def _bench_fwdbwd(cfg, q, k, v, knobs, T, row):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)

    def step(fwd):
        def run():
            torch.autograd.backward(fwd(), do)
            q.grad = k.grad = v.grad = None
        return run
    reset_peak(cfg.device)
    row("fwdbwd", "pisa", T, time_ms(step(lambda: pisa_attn(q, k, v, **knobs)), cfg.device,
                                     cfg.reps), peak_gb(cfg.device))
    if T <= cfg.dense_max:
        dense = dense_attention(q, k, v, cfg.device)
        reset_peak(cfg.device)
        row("fwdbwd", "dense", T,
            time_ms(step(lambda: dense().transpose(1, 2)), cfg.device, cfg.reps),
            peak_gb(cfg.device))


# (header, (op, impl), field, format) of each column of the `pisa bench` table after T
TABLE_COLUMNS = (
    ("sel pyr ms", ("select", "pyramid"), "ms", ".2f"),
    ("sel fmean ms", ("select", "flat_mean"), "ms", ".2f"),
    ("sel flse ms", ("select", "flat_lse"), "ms", ".2f"),
    ("pisa fwd ms", ("fwd", "pisa"), "ms", ".2f"),
    ("dense fwd ms", ("fwd", "dense"), "ms", ".2f"),
    ("pisa fb ms", ("fwdbwd", "pisa"), "ms", ".2f"),
    ("dense fb ms", ("fwdbwd", "dense"), "ms", ".2f"),
    ("pisa dec ms", ("decode", "pisa"), "ms", ".3f"),
    ("dense dec ms", ("decode", "dense"), "ms", ".3f"),
    ("rec pyr", ("select", "pyramid"), "recall", ".3f"),
    ("rec fmean", ("select", "flat_mean"), "recall", ".3f"),
    ("mass pyr", ("select", "pyramid"), "mass", ".3f"),
    ("mass fmean", ("select", "flat_mean"), "mass", ".3f"),
    ("mass flse", ("select", "flat_lse"), "mass", ".3f"),
)


def format_table(result: dict) -> str:
    """One line per length: selection ms, attention ms, recall@K and captured mass."""
    by_t: dict[int, dict] = {}
    for r in result["rows"]:
        by_t.setdefault(r["T"], {})[(r["op"], r["impl"])] = r

    def cell(r, field_, fmt):
        return "-" if r is None or r[field_] is None else format(r[field_], fmt)
    head = ["T"] + [c[0] for c in TABLE_COLUMNS]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for T, d in sorted(by_t.items()):
        cells = [cell(d.get(key), field_, fmt) for _, key, field_, fmt in TABLE_COLUMNS]
        lines.append(" | ".join([str(T)] + cells))
    return "\n".join("| " + ln + " |" for ln in lines)


def keys_attended(block_idx: torch.Tensor, n_keys: int, block_size: int) -> float:
    """Mean number of real causal keys per (token, KV head) of a selection ``[B, Tq, HKV, S]``."""
    Tq = block_idx.shape[1]
    t = torch.arange(n_keys - Tq, n_keys, device=block_idx.device)[None, :, None, None]
    start = block_idx.long() * block_size
    n = (torch.minimum(start + block_size, t + 1) - start).clamp_min(0)
    return float(torch.where(block_idx >= 0, n, 0).sum(-1).float().mean())
