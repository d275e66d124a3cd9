"""Host (Python) time of one eager decode step, without a GPU: ``pisa_attn_with_kvcache`` on CPU
tensors with the Triton launches replaced by Triton's own argument binder and cache-key lookup
(``JITFunction.run`` up to the driver call), i.e. everything a CUDA step spends on the host
before the launch itself. Shape: B=1, HQ=64, HKV=4, D=128, C=64, bf16, a 64K-key PisaCache,
topk=16 (config A).

``--hf``: one layer's step of transformers' decode over a ``PisaHFCache`` instead (the cache's
``update``, which appends the token with its key bounds (the fused append's launch, as on CUDA,
where the tree has it), then ``pisa_attention_forward``; a
Llama attention of 32 query / 4 KV heads of 64, the integration's default knobs, a 128K-key
cache): the pisa side of a ``generate`` step, per layer (needs transformers).

CPU time of the thread (``time.thread_time``: the box is shared), best of 15 rounds.
Run from a tree's root: ``PYTHONPATH=$PWD python3 benchmarks/decode/decode_host.py [--profile]``; works on
trees before the decode refactor too (it only reaches ``pisa.ops.decode.triton``'s kernels).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the real JITFunction's binder, not the interpreter

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime.jit import compute_cache_key, create_function_from_signature  # noqa: E402

import pisa  # noqa: E402
import pisa.api  # noqa: E402
from pisa.ops.decode import triton as dec  # noqa: E402

BACKEND = CUDABackend(GPUTarget("cuda", 90, 32))


class _Binder:
    """Stands in for ``kernel[grid](...)``: binds and specialises the arguments and looks the
    compiled kernel up as ``JITFunction.run`` does, and launches nothing."""

    def __init__(self, kernel):
        self.bind = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
        self.keys = {}

    def __getitem__(self, grid):
        return self.run

    def run(self, *args, **kwargs):
        _, spec, options = self.bind(*args, **kwargs)
        compute_cache_key(self.keys, spec, options)


def _time(fn, n: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(15):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--hf", action="store_true",
                    help="a PisaHFCache layer step (update + attention), 128K keys")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.hf:
        return _hf(args)
    B, HQ, HKV, D = 1, 64, 4, 128
    cache = pisa.PisaCache(B, args.seqlen, HKV, D, block_size=64, dtype=torch.bfloat16)
    cache.cache_seqlens.fill_(args.seqlen - 1)
    lens = torch.full((B,), args.seqlen - 1, dtype=torch.int32)
    q = torch.randn(B, 1, HQ, D, dtype=torch.bfloat16)
    binders = _stub_decode()
    pisa.api.resolve_backend = lambda backend, q: "triton"  # a CUDA q resolves to triton

    def step():
        pisa.pisa_attn_with_kvcache(q, cache, cache_seqlens=lens, topk=16)

    def decode_args():  # the binder on the kernel's real argument list, alone
        captured = {}
        first = "_walk_kernel" if "_walk_kernel" in binders else "_decode_kernel"  # trees before
        b = binders[first]
        bind = b.run
        b.run = lambda *a, **k: captured.setdefault("x", (a, k))
        step()
        b.run = bind
        a, k = captured["x"]
        return lambda: b.bind(*a, **k)

    print(f"tree {os.getcwd()}  seqlen {args.seqlen}")
    print(f"  decode binder alone: {_time(decode_args(), 2000):7.1f} us")
    print(f"  step, launch stubbed by the binder: {_time(step, args.n):7.1f} us")
    if args.profile:
        import cProfile
        import pstats
        cProfile.runctx("for _ in range(300): step()", globals(), locals(), "/tmp/decode_host.prof")
        pstats.Stats("/tmp/decode_host.prof").sort_stats("cumtime").print_stats(25)


def _stub_decode() -> dict:
    """The decode module's Triton functions replaced by their binders (its kernels, whatever a
    tree names them; its ``@triton.jit`` helpers are never launched) and returned by name."""
    from triton.runtime.jit import JITFunction
    binders = {name: _Binder(f) for name, f in vars(dec).items() if isinstance(f, JITFunction)}
    for name, b in binders.items():
        setattr(dec, name, b)
    return binders


def _fused_append() -> None:
    """The cache append as on CUDA: the fused Triton kernel's launch (the binder) where the tree
    has it (``kvcache._fused``), the torch ops before."""
    import pisa.ops.decode.kvcache as kvcache
    if hasattr(kvcache, "_fused"):
        import pisa.ops.decode.kvcache_triton as kt
        kt._append_kernel = _Binder(kt._append_kernel)
        kvcache._fused = lambda k_new, v_new, sums: sums.dtype == torch.float32


def _hf(args) -> None:
    """One decode step of one layer through ``pisa.integrations.hf`` (the ``--hf`` mode)."""
    torch.set_num_threads(1)  # the append's small CPU ops: no pool hand-offs
    import pisa.integrations.hf as hf
    from pisa.eval.model import random_model

    _stub_decode()
    pisa.api.resolve_backend = lambda backend, q: "triton"
    _fused_append()
    model = random_model("llama", vocab_size=64, num_layers=1, hidden_size=64, num_heads=32,
                         num_kv_heads=4, head_dim=64)
    attn = model.model.layers[0].self_attn
    T = 131072
    layer = hf.PisaCacheLayer(T + 64, bounds=True)  # the bound scorer's cache, as PisaHFCache's
    k = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 32, 1, 64, dtype=torch.bfloat16)
    layer.lazy_initialization(k, k)
    layer.pisa.cache_seqlens.fill_(T - 100)
    layer.length = T - 100

    def step():  # the length is put back after each step, so every step appends at one place
        kwargs = {}
        keys, values = layer.update(k, k, kwargs=kwargs)
        hf.pisa_attention_forward(attn, q, keys, values, None, scaling=0.125, **kwargs)
        layer.length -= 1
        layer.pisa.cache_seqlens.sub_(1)

    print(f"tree {os.getcwd()}  PisaHFCache layer step at {T} keys")
    print(f"  update + attention, launch stubbed by the binder: {_time(step, 30):7.1f} us")
    if args.profile:
        import cProfile
        import pstats
        cProfile.runctx("for _ in range(200): step()", globals(), locals(), "/tmp/decode_host.prof")
        pstats.Stats("/tmp/decode_host.prof").sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())
