"""What the benchmark scripts share: the timer, the dense baselines, config A, the result files.

- Timing: ``time_ms``, the one timer (``pisa.bench``'s, which ``pisa bench`` uses too): triton's
  ``do_bench`` median on CUDA (the L2 cache flushed before every timed run), event-timed runs for
  calls over 100 ms, wall clock on CPU. ``graph_ms`` is ``time_ms`` of a CUDA-graph replay (a
  sub-millisecond decode step without launch overhead); ``graph_warm_ms`` is triton's
  ``do_bench_cudagraph`` (the step unrolled in a graph, back to back, L2 warm), for comparison
  with figures measured that way.
- Dense baselines: ``dense_attention`` (causal SDPA, forced to cuDNN on CUDA, GQA by repeating
  K/V) and ``dense_decode`` (one query per sequence over a cache, GQA folded into the query
  length), both ``pisa.bench``'s.
- Config A (``docs/spec.md`` §10): bf16, B = 1, HQ = 64, HKV = 4, D = 128, C = 64, K = W = 16,
  g = 2; ``CONFIGS`` holds the (HQ, HKV, D) of configs A and B.
- Inputs: ``randn_qkv`` (seeded random q, k, v), ``random_selection`` (valid random block
  selections for the attention kernels alone).
- Results: ``Results`` collects rows of the project's schema (``pisa.results.result_row``) and
  writes ``{"meta", "rows"}`` through ``pisa.results.write_result``; ``read_results`` and
  ``header`` read them back for the report scripts.

Scripts live in ``benchmarks/<concern>/`` and run as files, ``python benchmarks/<concern>/<x>.py``
(from any directory). Each puts its parent folder, ``benchmarks/``, on ``sys.path`` in one line
before ``from common import ...``. Where ``pisa`` is neither installed nor on ``PYTHONPATH``,
importing this puts the repository root on ``sys.path``, so ``pisa`` imports from an uninstalled
checkout (an installed or ``PYTHONPATH`` one wins: a before/after comparison picks its checkout
that way, which ``python -m`` from the repository root would defeat).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

if importlib.util.find_spec("pisa") is None:  # not installed, not on PYTHONPATH: this checkout's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pisa.bench import (dense_attention, dense_decode, keys_attended, peak_gb,  # noqa: E402
                        reset_peak, time_ms)
from pisa.results import default_device, meta, result_row, write_result  # noqa: E402

__all__ = ["knob_sweep", "kernel_times", "time_ms", "graph_ms", "graph_warm_ms", "cuda_graph",
           "dense_attention", "dense_backend", "pisa_backend", "dense_decode", "keys_attended",
           "peak_gb", "reset_peak", "default_device", "meta", "result_row", "write_result",
           "read_results", "header", "command", "shape", "randn_qkv", "random_selection",
           "fwd_bwd", "attn_tflops", "Results", "CONFIGS", "DTYPE", "BATCH", "HQ", "HKV", "D",
           "C", "K", "W", "G_BR"]

# Config A
DTYPE = torch.bfloat16
BATCH, HQ, HKV, D = 1, 64, 4, 128
C, K, W, G_BR = 64, 16, 16, 2  # block size, blocks per query, beam, pyramid branching
CONFIGS = {"A": (HQ, HKV, D), "B": (32, 8, 128)}  # (HQ, HKV, D)
_BIG = 1 << 30  # random_selection: a block index past every real one (sorts last, then -1)


def pisa_backend(device: str) -> str:
    """The pisa backend a benchmark runs on ``device``: Triton on CUDA (exits when no GPU is
    there), torch elsewhere (a smoke test on CPU)."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --device cpu)")
        return "triton"
    return "torch"


def dense_backend(device: str) -> str:
    """The ``backend`` column of ``dense_attention``'s rows: ``"cudnn"`` on CUDA, else
    ``"sdpa"``."""
    return "cudnn" if device.startswith("cuda") else "sdpa"


def command() -> str:
    """The command line of this run, for ``meta``."""
    return "python " + " ".join(sys.argv)


def shape(HQ: int = HQ, HKV: int = HKV, D: int = D, *, B: int = BATCH, K: int = K, C: int = C,
          g: int = G_BR, W: int | None = W, dtype: str = "bfloat16") -> dict:
    """The shape columns of a result row (``result_row``'s keywords), config A by default."""
    return dict(B=B, HQ=HQ, HKV=HKV, D=D, K=K, C=C, g=g, W=W, dtype=dtype)


def randn_qkv(T: int, HQ: int = HQ, HKV: int = HKV, D: int = D, *, B: int = BATCH,
              seed: int = 0, device: str = "cuda", dtype: torch.dtype = DTYPE,
              requires_grad: bool = False):
    """Random normal ``q [B, T, HQ, D]``, ``k, v [B, T, HKV, D]`` from a generator seeded with
    ``seed`` (q, k, v drawn in that order)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(B, T, h, D, device=device, dtype=dtype, generator=gen)
                 .requires_grad_(requires_grad) for h in (HQ, HKV, HKV))


def random_selection(B, T, H, C, K, share, seed=0, device="cuda"):
    """[B, T, H, K] int32: forced {0, cur-1, cur} plus up to K-3 distinct random blocks in
    [1, cur-2], shared by aligned groups of ``share`` tokens; all causal blocks when they fit."""
    g = torch.Generator(device).manual_seed(seed)
    cur = torch.arange(T, device=device) // C
    n_draw = 4 * (K - 3)

    def per_group(shape):  # the same random numbers for every token of a group
        x = torch.rand(B, -(-T // share), H, *shape, generator=g, device=device)
        return x.repeat_interleave(share, 1)[:, :T]

    span = (cur - 2).clamp_min(0)[None, :, None, None]
    draws = torch.where(span > 0, 1 + (per_group([n_draw]) * span).long(), _BIG).sort(-1).values
    dup = torch.zeros_like(draws, dtype=torch.bool)
    dup[..., 1:] = draws[..., 1:] == draws[..., :-1]
    draws = torch.where(dup, _BIG, draws)
    priority = torch.where(draws == _BIG, 2.0, per_group([n_draw]))
    picks = draws.gather(-1, priority.argsort(-1)[..., :K - 3])
    c = cur[None, :, None, None].expand(B, T, H, 1)
    forced = torch.cat([torch.zeros_like(c), torch.where(c >= 2, c - 1, _BIG),
                        torch.where(c >= 1, c, _BIG)], -1)
    idx = torch.cat([forced, picks], -1).sort(-1).values
    dense = torch.arange(K, device=device).expand(B, T, H, K)
    idx = torch.where((c + 1 <= K), torch.where(dense <= c, dense, _BIG), idx)
    return torch.where(idx >= _BIG, -1, idx).to(torch.int32).contiguous()


def fwd_bwd(fwd, grad: torch.Tensor, leaves):
    """A callable running ``fwd()`` and the backward of its output with ``grad``, then dropping
    the gradients of ``leaves`` (so repeated runs neither accumulate nor keep them)."""
    def run():
        torch.autograd.backward(fwd(), grad)
        for x in leaves:
            x.grad = None
    return run


def attn_tflops(ms: float, T: int, keys_per_token: float, HQ: int = HQ, D: int = D,
                passes: float = 1.0) -> float:
    """Effective TFLOP/s of causal attention of ``T`` queries over ``keys_per_token`` keys each:
    ``4 * HQ * D`` FLOPs per (query, key) (``QK^T`` and ``PV``) times ``passes`` (1 for the
    forward, 2.5 for the backward, 3.5 for forward + backward), over ``ms``."""
    return passes * 4 * HQ * D * keys_per_token * T / ms / 1e9


def knob_sweep(grid: dict, base, call, device: str, deadline: float):
    """Every setting of ``grid`` (knob -> values: their product) applied to the frozen dataclass
    ``base``: yields ``(setting, cfg, ms)``, ``ms`` = ``time_ms`` of ``call(cfg)``, until
    ``time.time()`` passes ``deadline``. A setting that does not compile (registers, shared
    memory) is printed and skipped."""
    for values in itertools.product(*grid.values()):
        if time.time() > deadline:
            return
        setting = dict(zip(grid, values))
        cfg = replace(base, **setting)
        try:
            ms = time_ms(lambda: call(cfg), device)
        except Exception as e:
            print(f"{setting}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        yield setting, cfg, ms


def kernel_times(fn, calls: int = 3, top: int | None = None) -> list[dict]:
    """Device milliseconds per call of each kernel ``fn`` launches (``torch.profiler``, ``calls``
    calls after one warm-up), longest first (the ``top`` longest): ``[{"kernel", "ms"}]``."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key, "ms": e.self_device_time_total / calls / 1e3}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def cuda_graph(fn) -> torch.cuda.CUDAGraph:
    """One call of ``fn`` captured in a CUDA graph (compiled and warmed up on a side stream
    first, outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn) -> float:
    """Median ms of replays of ``fn`` captured in a CUDA graph, the L2 cache flushed before each
    (``time_ms`` of the replay): a step's latency with no launch overhead and a cold L2, as in a
    model whose other layers evict this layer's data between steps."""
    return time_ms(cuda_graph(fn).replay, "cuda")


def graph_warm_ms(fn) -> float:
    """Median ms per call of ``fn`` unrolled in a CUDA graph and replayed back to back, L2 warm
    (triton's ``do_bench_cudagraph``)."""
    import triton.testing
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


def read_results(paths) -> list[dict]:
    """The result files at ``paths`` (``{"meta", "rows", ...}`` each), in order."""
    return [json.loads(Path(p).read_text()) for p in paths]


def header(meta: dict) -> str:
    """Two markdown lines naming a result's card, versions, date and command."""
    return (f"{meta['device']} · torch {meta['torch']} · triton {meta['triton']} · {meta['date']}"
            f"  \n`{meta['command']}`\n")


class Results:
    """The rows of one run and their file. ``add`` appends a row and prints it as a JSON line;
    ``save`` (re)writes ``{"meta", "rows", **more}`` to ``path`` (nothing without one) through
    ``pisa.results.write_result``, atomically, so a script that saves as it goes keeps what
    finished when it is cut short. ``meta`` is taken once, at the start (``command()``)."""

    def __init__(self, path: str | Path | None, device: str, **meta_extra):
        self.path = Path(path) if path else None
        self.meta = meta(device, command(), **meta_extra)
        self.rows: list[dict] = []

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    def save(self, **more) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_result(self.path, self.meta, self.rows, **more)
