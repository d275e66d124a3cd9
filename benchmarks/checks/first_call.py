"""The first call of a fresh process: compiled one kernel after another, or all at once from a
``pisa warmup`` manifest (``pisa.ops.utils.kernel_cache``).

Each row is one fresh process with an empty Triton cache (a new ``TRITON_CACHE_DIR``) timing its
first call, wall clock with the device synchronised, after ``import pisa``, CUDA's initialisation
and, for ``train``, torch's own first backward (of a 4-element tensor: it imports sympy and
torch's symbolic shapes, ~2 s on the H200's host, which any model's first backward pays; timed
apart: ``import_s``, ``cuda_init_s``, ``autograd_init_s``):

- ``train``: ``pisa_attn`` forward + backward at ``--T`` (config A unless ``--shape``);
- ``decode``: a ``PisaCache`` prefilled with ``--T`` tokens through ``pisa_attn_with_kvcache``,
  then one decode step (the decode defaults);

in modes ``cold`` (no manifest: ``PISA_PRECOMPILE=0``), ``manifest`` (the manifest that a
``pisa warmup`` in another process, with its own Triton cache, recorded for the shape: the call
compiles its kernels in parallel first), ``shipped`` (no user manifest: what ships with pisa), and
``warm`` (Triton's disk cache filled by that warmup: binaries load, nothing compiles). Each row
lists when each kernel finished compiling or loading (``compiles``: name, seconds into the call,
``preload`` from a manifest or at its ``launch``; ``at_launch`` counts the latter: kernels no
manifest named).

    python benchmarks/checks/first_call.py --json benchmarks/results/first_call_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

BAR_S = 5.0
MODES = ("cold", "manifest", "shipped", "warm")
OPS = ("train", "decode")


def _worker(args) -> dict:
    t0 = time.perf_counter()
    import torch
    import triton

    import pisa
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    t_cuda = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.op == "train":  # torch's own first backward: any model's pays it (sympy's import)
        x = torch.randn(4, device="cuda", requires_grad=True)
        (x * 2).backward(torch.ones_like(x))
        torch.cuda.synchronize()
    t_autograd = time.perf_counter() - t0
    HQ, HKV, D = (int(x) for x in args.shape.split("/"))
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda T, H: torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                    generator=g)
    compiles = []
    start = [0.0]
    triton.knobs.runtime.jit_post_compile_hook = lambda *, fn, is_manual_warmup, **_: \
        compiles.append((fn.name, round(time.perf_counter() - start[0], 3),
                         "preload" if is_manual_warmup else "launch"))
    if args.op == "train":
        q, k, v = (make(args.T, H).requires_grad_() for H in (HQ, HKV, HKV))
        do = torch.randn_like(q)

        def call():
            pisa.pisa_attn(q, k, v).backward(do)
    else:
        q, k, v = make(args.T + 1, HQ), make(args.T + 1, HKV), make(args.T + 1, HKV)
        cache = pisa.PisaCache(1, args.T + 1, HKV, D, dtype=torch.bfloat16, device="cuda")

        def call():
            pisa.pisa_attn_with_kvcache(q[:, :-1], cache, k[:, :-1], v[:, :-1])
            pisa.pisa_attn_with_kvcache(q[:, -1:], cache, k[:, -1:], v[:, -1:])
    torch.cuda.synchronize()
    profile = cProfile.Profile() if args.profile else None
    start[0] = time.perf_counter()
    if profile:
        profile.enable()
    call()
    torch.cuda.synchronize()
    first = time.perf_counter() - start[0]
    if profile:
        profile.disable()
        with open(args.profile, "w") as f:
            for order, n in (("cumulative", 45), ("tottime", 15)):
                pstats.Stats(profile, stream=f).sort_stats(order).print_stats(n)
    return {"first_s": first, "import_s": t_import, "cuda_init_s": t_cuda,
            "autograd_init_s": t_autograd,
            "compiled": len(compiles),
            "at_launch": sum(1 for c in compiles if c[2] == "launch"), "compiles": compiles}


def _run(args, op: str, mode: str, pisa_cache: str, warm_triton: str) -> dict:
    profile = ["--profile", args.profile] if args.profile and f"{op}/{mode}" == args.profile_row \
        else []
    env = dict(os.environ, PISA_CACHE_DIR=pisa_cache)
    if mode == "cold":
        env["PISA_PRECOMPILE"] = "0"
    if mode == "shipped":
        env["PISA_CACHE_DIR"] = tempfile.mkdtemp()
    with tempfile.TemporaryDirectory() as triton_cache:
        env["TRITON_CACHE_DIR"] = warm_triton if mode == "warm" else triton_cache
        out = subprocess.run([sys.executable, __file__, "--worker", "--op", op, "--shape",
                              args.shape, "--T", str(args.T), *profile], env=env, check=True,
                             stdout=subprocess.PIPE, text=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("ROW "))[4:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="64/4/128", help="HQ/HKV/D (default config A)")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None,
                    help="write a cProfile of one row's first call here (--profile-row)")
    ap.add_argument("--profile-row", default="train/warm", help="OP/MODE (default train/warm)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", choices=OPS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("ROW " + json.dumps(_worker(args)), flush=True)
        return
    from common import command, meta, write_result
    HQ, HKV, D = (int(x) for x in args.shape.split("/"))
    rows = []
    with tempfile.TemporaryDirectory() as pisa_cache, \
            tempfile.TemporaryDirectory() as warm_triton:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pisa.cli", "warmup", "--shape", args.shape,
                        "--ops", "train", "decode", "--lengths", str(args.T)], check=True,
                       env=dict(os.environ, PISA_CACHE_DIR=pisa_cache,
                                TRITON_CACHE_DIR=warm_triton))
        warmup_s = time.perf_counter() - t0
        for op in args.ops:
            for mode in args.modes:
                row = _run(args, op, mode, pisa_cache, warm_triton)
                row.update(op=op, mode=mode, T=args.T, HQ=HQ, HKV=HKV, D=D, impl="pisa",
                           backend="triton")
                rows.append(row)
                print(f"{op:6s} {mode:8s} first call {row['first_s']:6.2f} s "
                      f"({row['compiled']} kernels compiled or loaded, {row['at_launch']} at "
                      f"their launch; import {row['import_s']:.1f} s, "
                      f"CUDA init {row['cuda_init_s']:.1f} s)", flush=True)
    worst = max(r["first_s"] for r in rows if r["mode"] == "manifest") \
        if any(r["mode"] == "manifest" for r in rows) else None
    write_result(args.json, meta("cuda", command(), bar_s=BAR_S, warmup_s=warmup_s,
                                 worst_manifest_first_s=worst), rows)
    print(f"pisa warmup took {warmup_s:.1f} s; worst first call with its manifest: {worst}")


if __name__ == "__main__":
    main()
