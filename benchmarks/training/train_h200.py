"""Training-path benchmark on one GPU: selection, forward, backward, forward+backward.

Times, in one run and on the same random bf16 inputs per length, a set of *arms* against dense
SDPA forced to cuDNN and fla's ``parallel_nsa`` (NSA: compressed attention, its flat top-k
selection and the selected attention, ``window_size=0``; needs the ``fla-core`` wheel and a GQA
group of at least 16 heads):

- ``pisa``: ``pisa_attn`` at the library defaults, or at the knobs given (``--query-tile``,
  ``--beam-leaf``, ``--scorer``, ``--tile-reduce``, ``--beam``, ``--beam-ref-len``: beams grown
  with the context, rows report the grown widths and ``beam_ref_len``);
- ``pisa_qt1``: per-token PISA at today's knobs (``query_tile=1``, ``beam_leaf = beam = K``);
- ``flat_mean`` / ``flat_lse``: the flat selectors on the same attention (per token);
- ``compressed`` / ``window``: the training recipes' gated branches alone (``PisaAttention``'s
  ``compressed_attn``, attention over every complete block's mean key / value, and
  ``window_attn``, exact attention over the last ``--window`` blocks): a recipe's layer costs its
  selection arm plus its branches (plus the gate's small projection).

Per arm: ``select``, ``fwd``, ``bwd`` (the backward alone, graph kept), ``fwdbwd``, and the sparse
attention kernels alone on the arm's selection (``attn_fwd``, ``attn_bwd``) with their effective
TFLOP/s, counting ``4 * HQ * D * keys attended`` per token (x2.5 for the backward). Peak memory per
row; ``query_tile`` and ``beam_leaf`` columns.

    python benchmarks/training/train_h200.py --config A --json benchmarks/results/train_h200.json

``--device cpu`` runs the PISA and flat rows through the torch backend (a smoke test at small
lengths).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (CONFIGS, DTYPE, G_BR, Results, attn_tflops, dense_attention, dense_backend,
                    fwd_bwd, keys_attended, peak_gb, pisa_backend, randn_qkv, reset_peak,
                    result_row, shape, time_ms)
from pisa import pisa_attn, pisa_select
from pisa.ops.select import tiles_to_tokens
from pisa.ops.utils.config import (BEAM_LEAF, SCORER, TILE_REDUCE, SelectConfig, grown_beams,
                                   query_tile_of)

ARMS = ("pisa", "pisa_qt1", "flat_mean", "flat_lse", "compressed", "window", "dense", "nsa")
BRANCH_ARMS = ("compressed", "window")


def _arm_knobs(args, backend: str) -> dict:
    """``pisa_attn`` keywords of each selection arm."""
    base = dict(block_size=args.block_size, topk=args.topk, branching=G_BR, backend=backend)
    given = ("beam", "beam_leaf", "beam_ref_len", "scorer", "query_tile", "tile_reduce")
    new = {name: getattr(args, name) for name in given if getattr(args, name) is not None}
    per_token = dict(query_tile=1, beam=args.topk, beam_leaf=None, scorer="lse")
    return {"pisa": {**base, **new}, "pisa_qt1": {**base, **per_token},
            "flat_mean": {**base, "query_tile": 1, "selector": "flat_mean"},
            "flat_lse": {**base, "query_tile": 1, "selector": "flat_lse"}}


def _nsa(q, k, v, block_size: int, topk: int):
    """fla's NSA forward (compression, flat top-k, selected attention; no sliding window)."""
    from fla.ops.nsa import parallel_nsa
    gen = torch.Generator(device=q.device).manual_seed(1)
    g_cmp, g_slc = (torch.rand(q.shape[:3], generator=gen, device=q.device, dtype=q.dtype)
                    for _ in range(2))
    return lambda: parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=topk,
                                block_size=block_size, window_size=0)


def _branch(arm: str, HQ: int, HKV: int, D: int, args, backend: str):
    """``fn(q, k, v)`` of a recipe's branch: ``PisaAttention``'s own method (it reads no
    parameter of the layer)."""
    from pisa.layers import PisaAttention
    layer = PisaAttention(HQ * D, HQ, HKV, D, window=args.window, compressed=True,
                          block_size=args.block_size, topk=args.topk, backend=backend)
    return layer.compressed_attn if arm == "compressed" else layer.window_attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="A", choices=sorted(CONFIGS))
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--flat-mean-max", type=int, default=1 << 20, help="longest T for flat_mean")
    ap.add_argument("--flat-lse-max", type=int, default=131072, help="longest T for flat_lse")
    ap.add_argument("--dense-max", type=int, default=262144, help="longest T for dense fwd+bwd")
    ap.add_argument("--dense-fwd-max", type=int, default=524288)
    ap.add_argument("--nsa-max", type=int, default=524288, help="longest T for NSA")
    ap.add_argument("--topk", type=int, default=SelectConfig.topk)
    ap.add_argument("--block-size", type=int, default=SelectConfig.block_size)
    ap.add_argument("--beam", type=int, default=None)
    ap.add_argument("--beam-leaf", type=int, default=None)
    ap.add_argument("--beam-ref-len", type=int, default=None,
                    help="pisa arm: beams grow past this many keys (beam_ref_len)")
    ap.add_argument("--scorer", default=None)
    ap.add_argument("--query-tile", type=int, default=None)
    ap.add_argument("--window", type=int, default=2, help="blocks of the window arm")
    ap.add_argument("--tile-reduce", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (Triton backend) or cpu (torch)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    HQ, HKV, D = CONFIGS[args.config]
    dev = args.device
    backend = pisa_backend(dev)
    arms = _arm_knobs(args, backend)
    nsa_ok = "nsa" in args.arms and dev.startswith("cuda") and HQ // HKV >= 16 \
        and importlib.util.find_spec("fla") is not None
    branches = {"compressed": {}, "window": {"window": args.window}}
    out = Results(args.json, dev, arms={a: {k: v for k, v in kw.items() if k != "backend"}
                                        for a, kw in {**arms, **branches}.items()
                                        if a in args.arms})
    longest = {"flat_mean": args.flat_mean_max, "flat_lse": args.flat_lse_max}

    def row(op, impl, T, ms, peak, knobs=None, **extra):
        """A result row; ``knobs`` (a selection arm's) fill the beam and tile columns."""
        be = dense_backend(dev) if impl == "dense" else "fla" if impl == "nsa" else backend
        beam = (knobs or {}).get("beam") or args.topk
        # a knob the arm leaves out takes pisa_attn's default; beams grown past beam_ref_len
        # are reported as grown
        tiles = dict(query_tile=None, beam_leaf=None) if knobs is None else dict(
            query_tile=query_tile_of(knobs.get("query_tile"), args.block_size),
            beam_leaf=knobs.get("beam_leaf", BEAM_LEAF) or beam,
            scorer=knobs.get("scorer", SCORER), tile_reduce=knobs.get("tile_reduce", TILE_REDUCE))
        if knobs is not None and knobs.get("beam_ref_len"):
            beam, tiles["beam_leaf"] = grown_beams(beam, tiles["beam_leaf"], T,
                                                   knobs["beam_ref_len"], args.block_size, G_BR)
            extra["beam_ref_len"] = knobs["beam_ref_len"]
        out.add(result_row(op, impl, be, T=T, ms=ms, peak_gb=peak,
                           **shape(HQ, HKV, D, K=args.topk, C=args.block_size,
                                   W=None if knobs is None else beam), **tiles, **extra))

    def timed(fn):
        reset_peak(dev)
        ms = time_ms(fn, dev)
        return ms, peak_gb(dev)

    def phases(T, impl, fwd, q, k, v, do, knobs=None):
        """select (when ``knobs``), fwd, bwd, fwdbwd of one arm."""
        if knobs is not None:
            with torch.no_grad():
                row("select", impl, T, *timed(lambda: pisa_select(q, k, **knobs)), knobs)
        with torch.no_grad():
            row("fwd", impl, T, *timed(fwd), knobs)
        o = fwd()
        row("bwd", impl, T, *timed(lambda: torch.autograd.backward(o, do, retain_graph=True)),
            knobs)
        del o
        q.grad = k.grad = v.grad = None
        row("fwdbwd", impl, T, *timed(fwd_bwd(fwd, do, (q, k, v))), knobs)

    def kernels(T, impl, q, k, v, do, knobs):
        """The sparse attention kernels alone on the arm's selection."""
        idx, cnt = pisa_select(q, k, **knobs)
        qt = query_tile_of(knobs.get("query_tile"), args.block_size)
        per_token = idx if qt == 1 else tiles_to_tokens(idx, cnt, T, T, qt)[0]
        keys = keys_attended(per_token, T, args.block_size)
        del per_token
        # the kernels the arm runs: tile selections go to the tile kernels as they are
        attn = {n: x for n, x in knobs.items() if n in ("block_size", "backend", "query_tile")}
        with torch.no_grad():
            ms, pk = timed(lambda: pisa_attn(q, k, v, block_idx=idx, **attn))
        row("attn_fwd", impl + "_kernel", T, ms, pk, knobs, keys_per_token=keys,
            tflops=attn_tflops(ms, T, keys, HQ, D))
        o = pisa_attn(q, k, v, block_idx=idx, **attn)
        ms, pk = timed(lambda: torch.autograd.backward(o, do, retain_graph=True))
        row("attn_bwd", impl + "_kernel", T, ms, pk, knobs, keys_per_token=keys,
            tflops=attn_tflops(ms, T, keys, HQ, D, passes=2.5))
        del o, idx
        q.grad = k.grad = v.grad = None

    for T in args.lengths:
        t0 = time.time()
        q, k, v = randn_qkv(T, HQ, HKV, D, seed=T, device=dev, dtype=DTYPE, requires_grad=True)
        do = torch.randn_like(q)
        for arm in args.arms:
            if arm in BRANCH_ARMS:
                branch = _branch(arm, HQ, HKV, D, args, backend)
                phases(T, arm, lambda: branch(q, k, v), q, k, v, do)
                continue
            if arm not in arms or T > longest.get(arm, T):
                continue
            knobs = arms[arm]
            phases(T, arm, lambda: pisa_attn(q, k, v, **knobs), q, k, v, do, knobs)
            if arm in ("pisa", "pisa_qt1"):
                kernels(T, arm, q, k, v, do, knobs)
        if nsa_ok and T <= args.nsa_max:
            phases(T, "nsa", _nsa(q, k, v, args.block_size, args.topk), q, k, v, do)
        if "dense" in args.arms and T <= args.dense_fwd_max:
            dense = dense_attention(q.detach(), k.detach(), v.detach(), dev)
            with torch.no_grad():
                row("fwd", "dense", T, *timed(dense))
            if T <= args.dense_max:
                dq, dk, dv = (x.detach().requires_grad_() for x in (q, k, v))
                row("fwdbwd", "dense", T, *timed(fwd_bwd(dense_attention(dq, dk, dv, dev),
                                                         do.transpose(1, 2), (dq, dk, dv))))
                del dq, dk, dv
            del dense
        del q, k, v, do
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"# T={T} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        out.save()  # after every length: a timeout keeps what finished


if __name__ == "__main__":
    main()
