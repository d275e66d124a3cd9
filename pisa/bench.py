"""The main job, ``pisa bench``: selection and attention timings plus selection quality.

Rows follow the project's result schema (``pisa.results``). The timer and the dense baselines here
are the ones every benchmark script uses (``benchmarks/common.py``).
"""
from __future__ import annotations

import inspect
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .api import pisa_attn, pisa_attn_with_kvcache, pisa_select
from .cache import PisaCache
from .eval.metrics import SelectionScorer, recall_at_k
from .eval.synthetic import structured_qkv
from .ops.select import tiles_to_tokens
from .ops.utils.config import SelectConfig, resolve_backend, resolve_config
from .ops.utils.geometry import cdiv, level_sizes
from .results import meta, result_row

SELECTORS = ("pyramid", "flat_mean", "flat_lse")
# Every selection knob of ``pisa_select`` / ``pisa_attn`` with its default, read from the public
# signature so that the bench runs (and ``pisa bench --help`` shows) what a user's call gets.
SELECT_DEFAULTS = {name: p.default for name, p in inspect.signature(pisa_select).parameters.items()
                   if p.kind is p.KEYWORD_ONLY and name != "backend"}


@dataclass
class BenchConfig:
    lengths: list[int]
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    # the selection knobs handed to pisa_select / pisa_attn (``selector``: the one the pisa
    # attention rows use; the selection rows time all of ``SELECTORS``)
    knobs: dict = field(default_factory=lambda: dict(SELECT_DEFAULTS))
    dtype: str = "float32"
    backend: str = "auto"
    device: str = "cpu"
    flat_lse_max: int = 131072
    quality_max: int = 16384
    dense_max: int = 1 << 20
    backward: bool = False
    decode: bool = False
    reps: int = 3
    log: object = field(default=sys.stderr, repr=False)


class Timing(NamedTuple):
    """Milliseconds of the timed runs of one call."""
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, times: list[float]) -> "Timing":
        return cls(min(times), statistics.median(times), max(times))


def time_stats(fn, device: str, reps: int = 3) -> Timing:
    """Min / median / max milliseconds of ``fn()`` after a warm-up run. On CUDA: triton's
    ``do_bench`` (CUDA events, every run it makes) for short calls; calls over 100 ms (where
    do_bench would spend 8+ runs) get ``reps`` event-timed runs. On CPU: wall clock over ``reps``
    runs."""
    if device.startswith("cuda"):
        fn()  # warm-up (compiles)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 < 0.1:
            from triton.testing import do_bench
            return Timing.of(do_bench(fn, warmup=25, rep=100, return_mode="all"))
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return Timing.of(times)
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(times)


def time_ms(fn, device: str, reps: int = 3) -> float:
    """Median milliseconds of ``fn()`` (``time_stats``)."""
    return time_stats(fn, device, reps).median


def triton_variants() -> int:
    """Compiled variants of pisa's Triton kernels in this process, over every device: a call that
    raises it compiled (a new length that specialises a kernel shows up here)."""
    from .ops.utils.kernel_cache import pisa_kernels
    return sum(len(caches[0]) for fn in pisa_kernels() for caches in fn.device_caches.values())


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


# Extra columns of every ``pisa bench`` row (None where they do not apply): the resolved level-2
# beam ``W2`` and query tile ``Qt``; on the pyramid's selection row the pyramid levels its walk
# prunes at this length; on each selection row the share of rows (query tile x KV head) where it
# differs from flat_lse's at the same knobs, and its recall of flat_lse's blocks (same tiles).
BENCH_COLUMNS = ("W2", "Qt", "levels_pruned", "differ_share", "recall_tiled")
ORACLE = ("flat_lse with query_tile=1: per token, the K blocks of highest exact LSE (forced ones "
          "included)")


def run_bench(cfg: BenchConfig, command: str = "pisa bench") -> dict:
    """Sweep ``cfg.lengths``; returns ``{"meta", "rows"}`` in the project's result schema
    (``BENCH_COLUMNS`` on top). ``meta`` adds the resolved backend, the knobs, the inputs, the
    timed repetitions and the quality oracle."""
    backend = resolve_backend(cfg.backend, torch.empty(0, device=cfg.device))
    info = meta(cfg.device, command, backend=backend, knobs=dict(cfg.knobs),
                inputs=dict(generator="pisa.eval.structured_qkv", seed="T", B=cfg.batch,
                            HQ=cfg.heads, HKV=cfg.kv_heads, D=cfg.head_dim, dtype=cfg.dtype),
                reps=cfg.reps, oracle=ORACLE)
    rows = []
    for T in cfg.lengths:
        print(f"[pisa bench] T={T} on {cfg.device}", file=cfg.log, flush=True)
        q, k, v = structured_qkv(cfg.batch, T, cfg.heads, cfg.kv_heads, cfg.head_dim,
                                 block_size=cfg.knobs["block_size"],
                                 dtype=getattr(torch, cfg.dtype), device=cfg.device, seed=T)
        rows += _bench_length(cfg, backend, q, k, v)
    return {"meta": info, "rows": rows}


def levels_pruned(walk: SelectConfig, n_keys: int) -> int:
    """Internal pyramid levels of ``n_keys`` keys holding more nodes than the beam kept there
    (``beam_leaf`` at level 2, ``beam`` above): those the walk of the last query ranks and cuts.
    0: it keeps every node, and its selection is the flat scan's."""
    sizes = level_sizes(cdiv(n_keys, walk.block_size), walk.branching)
    return sum(n > walk.beam_at(level) for level, n in enumerate(sizes, 1) if level >= 2)


def _bench_length(cfg: BenchConfig, backend: str, q, k, v) -> list[dict]:
    """The rows of one length: each selector's selection, pisa and dense attention (and, as
    asked, forward+backward and decode)."""
    T = k.shape[1]
    knobs = dict(cfg.knobs, backend=backend)
    walk = resolve_config(q, k, backend, **dict(cfg.knobs, selector="pyramid"))
    rows = []

    def row(op, impl, timing=None, peak=None, **columns):
        extra = dict.fromkeys(BENCH_COLUMNS) | {"W2": walk.beam_at(2), "Qt": walk.query_tile} \
            | {name: columns[name] for name in BENCH_COLUMNS if name in columns}
        r = result_row(op, impl, backend, B=cfg.batch, T=T, HQ=cfg.heads, HKV=cfg.kv_heads,
                       D=cfg.head_dim, K=walk.topk, C=walk.block_size, g=walk.branching,
                       W=walk.beam, dtype=cfg.dtype, ms=timing and timing.median,
                       ms_min=timing and timing.min, ms_max=timing and timing.max,
                       peak_gb=peak, recall=columns.get("recall"), mass=columns.get("mass"),
                       **extra)
        rows.append(r)
        print(f"  {op:7s} {impl:10s} T={T:<8d} ms={_cell_ms(r)} recall={r['recall']} "
              f"mass={r['mass']}", file=cfg.log, flush=True)

    def timed(fn):
        reset_peak(cfg.device)
        timing = time_stats(fn, cfg.device, cfg.reps)
        return timing, peak_gb(cfg.device)

    sels, timings = {}, {}
    for sel in SELECTORS:
        if sel == "flat_lse" and T > cfg.flat_lse_max:
            continue

        at = dict(knobs, selector=sel)
        if sel != "pyramid" and at["tile_reduce"] == "mass":  # ranks walk candidates: the flat
            at["tile_reduce"] = "qmean"                        # scans take the mean query

        def select(at=at):  # keeps the last selection, to score it below
            sels[at["selector"]] = pisa_select(q, k, **at)
        timings[sel] = timed(select)
    quality = _quality(q, k, sels, walk, knobs) if T <= cfg.quality_max else {}
    for sel, (timing, peak) in timings.items():
        columns = quality.get(sel, {})
        if "flat_lse" in sels:
            columns["differ_share"] = differ_share(sels[sel][0], sels["flat_lse"][0])
        if sel == "pyramid":
            columns["levels_pruned"] = levels_pruned(walk, T)
        row("select", sel, timing, peak, **columns)
    if "oracle" in quality:
        row("select", "oracle", **quality["oracle"])
    row("fwd", "pisa", *timed(lambda: pisa_attn(q, k, v, **knobs)))
    if T <= cfg.dense_max:
        row("fwd", "dense", *timed(dense_attention(q, k, v, cfg.device)))
    if cfg.backward:
        _bench_fwdbwd(cfg, q, k, v, knobs, row, timed)
    if cfg.decode:
        _bench_decode(cfg, q, k, v, backend, row, timed)
    return rows


def differ_share(block_idx: torch.Tensor, other: torch.Tensor) -> float:
    """Share of the rows of two selections ``[B, rows, HKV, S]`` (ascending, -1 padded) that
    hold different blocks."""
    return float((block_idx != other).any(-1).float().mean())


def _defined(x: float) -> float | None:
    """``None`` for an undefined (NaN) measure: recall of a selection without a free block."""
    return None if math.isnan(x) else x


def _quality(q, k, sels: dict, walk: SelectConfig, knobs: dict) -> dict[str, dict]:
    """Recall and captured mass of each selection ``sels[name] = (block_idx, counts)`` against the
    per-token oracle (``ORACLE``), its recall of flat_lse's blocks at the same knobs, and the
    oracle's own row."""
    T, C = k.shape[1], walk.block_size
    score = SelectionScorer(q, k, **{n: x for n, x in knobs.items() if n != "selector"})
    tokens = {sel: tiles_to_tokens(idx, cnt, T, T, walk.query_tile)[0]
              for sel, (idx, cnt) in sels.items()}
    out = {"oracle": {"recall": _defined(recall_at_k(score.oracle, score.oracle, T, C)),
                      "mass": score.oracle_mass}}
    for sel, tok in tokens.items():
        measured = score(tok)
        out[sel] = {"recall": _defined(measured["recall"]), "mass": measured["mass"]}
        if "flat_lse" in tokens:
            out[sel]["recall_tiled"] = _defined(recall_at_k(tok, tokens["flat_lse"], T, C))
    return out


def _bench_decode(cfg, q, k, v, backend, row, timed):
    """One decode step at the end of the sequence: its last query against a cache holding its
    ``T`` keys (``pisa_attn_with_kvcache`` with its own per-token defaults and this run's ``topk``
    and ``beam``: the fused Triton kernel on CUDA, the torch decode on CPU), and dense attention
    over the same keys."""
    kn = cfg.knobs
    cache = PisaCache.from_prefill(k, v, block_size=kn["block_size"], branching=kn["branching"])
    q1 = q[:, -1:]
    per_token = {"W2": kn["beam"] or kn["topk"], "Qt": 1}
    row("decode", "pisa", *timed(lambda: pisa_attn_with_kvcache(
        q1, cache, topk=kn["topk"], beam=kn["beam"], backend=backend)), **per_token)
    if k.shape[1] <= cfg.dense_max:
        row("decode", "dense", *timed(dense_decode(q1, k, v)), **per_token)


def _bench_fwdbwd(cfg, q, k, v, knobs, row, timed):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)

    def step(fwd):
        def run():
            torch.autograd.backward(fwd(), do)
            q.grad = k.grad = v.grad = None
        return run
    row("fwdbwd", "pisa", *timed(step(lambda: pisa_attn(q, k, v, **knobs))))
    if k.shape[1] <= cfg.dense_max:
        dense = dense_attention(q, k, v, cfg.device)
        row("fwdbwd", "dense", *timed(step(lambda: dense().transpose(1, 2))))


def _num(x: float) -> str:
    """A time in ms with about three significant digits."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 \
        else f"{x:.3f}"


def _cell_ms(r: dict | None) -> str:
    """``median (min-max)`` of a row's timings; ``-`` when it has none."""
    if r is None or r["ms"] is None:
        return "-"
    return f"{_num(r['ms'])} ({_num(r['ms_min'])}-{_num(r['ms_max'])})"


def _cell(r: dict | None, name: str, fmt: str = ".3f") -> str:
    return "-" if r is None or r.get(name) is None else format(r[name], fmt)


# (header, (op, impl)) of each timing column; a column no row fills is left out
TIMING_COLUMNS = (
    ("select pyramid", ("select", "pyramid")), ("select flat_mean", ("select", "flat_mean")),
    ("select flat_lse", ("select", "flat_lse")), ("pisa fwd", ("fwd", "pisa")),
    ("dense fwd", ("fwd", "dense")), ("pisa fwd+bwd", ("fwdbwd", "pisa")),
    ("dense fwd+bwd", ("fwdbwd", "dense")), ("pisa decode", ("decode", "pisa")),
    ("dense decode", ("decode", "dense")),
)
# (header, impl of the selection row, field, format) of each quality column after T, W / W2
QUALITY_COLUMNS = (
    ("levels pruned", "pyramid", "levels_pruned", "d"),
    ("pyr != flse rows", "pyramid", "differ_share", ".3f"),
    ("recall pyr", "pyramid", "recall", ".3f"), ("recall fmean", "flat_mean", "recall", ".3f"),
    ("recall flse", "flat_lse", "recall", ".3f"),
    ("pyr vs flse, same tiles", "pyramid", "recall_tiled", ".3f"),
    ("fmean vs flse, same tiles", "flat_mean", "recall_tiled", ".3f"),
    ("mass pyr", "pyramid", "mass", ".3f"), ("mass fmean", "flat_mean", "mass", ".3f"),
    ("mass flse", "flat_lse", "mass", ".3f"), ("mass oracle", "oracle", "mass", ".3f"),
)


def _markdown(head: list[str], body: list[list[str]]) -> str:
    lines = [head, ["---"] * len(head)] + body
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def format_table(result: dict) -> str:
    """The timing table (one line per length, ms as ``median (min-max)``) and the selection
    table (pruning, recall and captured mass), in markdown."""
    by_t: dict[int, dict] = {}
    for r in result["rows"]:
        by_t.setdefault(r["T"], {})[(r["op"], r["impl"])] = r
    timing = [(name, key) for name, key in TIMING_COLUMNS
              if any(key in d for d in by_t.values())]
    times = _markdown(["T"] + [name for name, _ in timing],
                      [[str(T)] + [_cell_ms(d.get(key)) for _, key in timing]
                       for T, d in sorted(by_t.items())])

    def beams(d):
        r = next(iter(d.values()))
        return f"{r['W']} / {r['W2']}"
    quality = _markdown(["T", "W / W2"] + [c[0] for c in QUALITY_COLUMNS],
                        [[str(T), beams(d)] + [_cell(d.get(("select", impl)), name, fmt)
                                               for _, impl, name, fmt in QUALITY_COLUMNS]
                         for T, d in sorted(by_t.items())])
    return f"{times}\n\n{quality}"


# The symbol of a knob in the rows, which hold its resolved value
_KNOB_LABELS = {"block_size": "C", "topk": "K", "branching": "g", "beam": "W",
                "beam_leaf": "W2", "query_tile": "Qt"}


def format_header(result: dict) -> str:
    """What was run: versions and device, inputs, every selection knob (resolved values after
    ``->``), and what recall and mass are measured against."""
    m = result["meta"]
    first = result["rows"][0] if result["rows"] else {}
    commit = m.get("commit") or "unknown"
    inputs = m["inputs"]
    knobs = []
    for name, value in m["knobs"].items():
        symbol = _KNOB_LABELS.get(name)
        text = f"{name} {symbol}={value}" if symbol else f"{name}={value}"
        if name in ("beam", "beam_leaf") and m["knobs"].get("beam_ref_len") is not None:
            text += " (grown per length: the W / W2 column)"
        elif symbol and value is None and symbol in first:
            text += f" (-> {first[symbol]})"
        knobs.append(text)
    return "\n".join([
        f"pisa bench | pisa {m['pisa']} (commit {commit}) | {m['device']} | torch {m['torch']} | "
        f"triton {m['triton']} | backend {m['backend']}",
        f"inputs: {inputs['generator']} (seed T), B={inputs['B']} HQ={inputs['HQ']} "
        f"HKV={inputs['HKV']} D={inputs['D']} {inputs['dtype']}",
        f"timings: ms, median (min-max) of {m['reps']} run(s) after a warm-up (on CUDA, of all "
        "of triton's do_bench runs for calls under 100 ms)",
        "selection knobs (pisa_select / pisa_attn keywords, each a flag: pisa bench --help): "
        + ", ".join(knobs),
        "  'selector' is what pisa fwd uses; the select columns time pyramid, flat_mean and "
        "flat_lse at the same knobs (with tile_reduce='mass' the flat scans rank by the mean "
        "query: 'mass' ranks the walk's candidates)",
        f"recall and mass are measured against the per-token oracle: {m['oracle']}",
    ])


LEGEND = """\
Legend
- Timings: select = pisa_select; pisa fwd = pisa_attn (selection + attention); pisa decode =
  one step of pisa_attn_with_kvcache (its per-token walk, K and W as here); dense = SDPA (the
  cuDNN backend on CUDA). Good, on CUDA (Triton kernels): the pyramid below flat_lse and pisa
  below dense at long T, the gaps growing with T (docs/results_h200.md). On a CPU the torch
  backend runs: its timings are not the point (the readable path, not a fast one).
- levels pruned: pyramid levels with more nodes than the beam kept there (W2 at level 2, W
  above), which the walk ranks and cuts. 0: it keeps every node and selects what flat_lse does.
- pyr != flse rows: share of selection rows (query tile x KV head) where the pyramid's blocks
  differ from flat_lse's at the same knobs: > 0 once it prunes.
- recall: share of the oracle's free (non-forced) blocks a selection also picks. With query
  tiles (Qt > 1) a tile's Qt tokens share one selection, so even flat_lse recalls < 1: 'recall
  flse' is the cost of the tiling alone (here the worst case: structured_qkv's tokens pick
  their blocks independently, where a real model's neighbouring tokens agree,
  docs/selection_v2.md; --query-tile 1 selects per token). 'vs flse, same tiles': recall of
  flat_lse's blocks at the same knobs, the walk's own misses (1: it found the exact top-K).
  Good: pyramid above flat_mean, and near 1 with beams wide enough (--beam, --beam-leaf).
- mass: mean share of each query's softmax mass in the blocks it attends (1 = dense); oracle:
  the most K blocks per token hold. Good: pyramid close to flat_lse, above flat_mean.
- '-': not measured (T above --quality-max / --flat-lse-max / --dense-max, or not asked:
  --backward, --decode) or undefined (see the notes)."""


def format_notes(result: dict) -> str:
    """A line per length whose recall is undefined: no query has a block to choose."""
    notes = []
    for r in result["rows"]:
        if (r["op"], r["impl"]) != ("select", "oracle") or r["recall"] is not None:
            continue
        if r["T"] <= r["K"] * r["C"]:
            why = (f"T <= K*C = {r['K'] * r['C']}: every query attends all of its causal blocks, "
                   "nothing is selected (mass 1)")
        else:
            why = "the budget K holds only the forced blocks (sink, previous, current)"
        notes.append(f"T={r['T']}: recall is undefined: {why}.")
    return "\n".join(notes)


def format_report(result: dict) -> str:
    """``pisa bench``'s output: header, tables, notes and legend."""
    parts = [format_header(result), format_table(result), format_notes(result), LEGEND]
    return "\n\n".join(p for p in parts if p)


def keys_attended(block_idx: torch.Tensor, n_keys: int, block_size: int) -> float:
    """Mean number of real causal keys per (token, KV head) of a selection ``[B, Tq, HKV, S]``."""
    Tq = block_idx.shape[1]
    t = torch.arange(n_keys - Tq, n_keys, device=block_idx.device)[None, :, None, None]
    start = block_idx.long() * block_size
    n = (torch.minimum(start + block_size, t + 1) - start).clamp_min(0)
    return float(torch.where(block_idx >= 0, n, 0).sum(-1).float().mean())
