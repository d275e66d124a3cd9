"""Host (Python) time of one eager decode step, without a GPU: ``pisa_attn_with_kvcache`` on CPU
tensors with the Triton launches replaced by Triton's own argument binder and cache-key lookup
(``JITFunction.run`` up to the driver call), i.e. everything a CUDA step spends on the host
before the launch itself; where the tree launches through ``pisa.ops.utils.relaunch`` (the
compiled kernel called directly after a first launch), the binder returns a stand-in compiled
kernel whose launcher does nothing, so later steps time the direct launch's checks. Shape: B=1, HQ=64, HKV=4, D=128, C=64, bf16, a 64K-key PisaCache,
topk=16 (config A).

``--hf``: one layer's step of transformers' decode over a ``PisaHFCache`` instead (the cache's
``update``, which appends the token with its key bounds (the fused append's launch, as on CUDA,
where the tree has it), then ``pisa_attention_forward``; a
Llama attention of 32 query / 4 KV heads of 64, the integration's default knobs, a 128K-key
cache): the pisa side of a ``generate`` step, per layer (needs transformers).

CPU time of the thread (``time.thread_time``: the box is shared), best of 15 rounds.
``--cuda``: the same step on a GPU, nothing stubbed (host time and back-to-back wall time a step).

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
        return _COMPILED


class _Compiled:
    """Stands in for the compiled kernel the binder found: its launcher does nothing, so a
    ``Relaunch`` (where the tree has it) times its own checks before the driver call."""

    function = packed_metadata = None

    def run(self, *args):
        pass


class _Driver:
    """Triton's driver on a machine without a GPU: device 0, stream 0."""

    active = property(lambda self: self)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0


_COMPILED = _Compiled()


def _profile(step, n: int, order: str) -> None:
    """cProfile of ``n`` steps: its top 30 rows by ``order``."""
    import cProfile
    import pstats
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats(order).print_stats(30)


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
    ap.add_argument("--cuda", action="store_true",
                    help="the real step on a GPU: host time a step, launches included")
    ap.add_argument("--hf", action="store_true",
                    help="a PisaHFCache layer step (update + attention), 128K keys")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.hf:
        return _hf(args)
    if args.cuda:
        return _cuda(args)
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
    print(f"  step, launches stubbed: {_time(step, args.n):7.1f} us")
    if args.profile:
        _profile(step, 300, "cumtime")


def _cuda(args) -> None:
    """The ``--cuda`` mode: the eager step on the GPU, nothing stubbed. ``host``: the thread's
    CPU time a step (the launches' driver calls included); ``wall``: steps back to back, then one
    synchronisation (a step costs the larger of its host and GPU time); ``torch.empty``: one
    small CUDA allocation, for scale."""
    B, HQ, HKV, D = 1, 64, 4, 128
    cache = pisa.PisaCache(B, args.seqlen, HKV, D, block_size=64, dtype=torch.bfloat16,
                           device="cuda")
    cache.k_cache.normal_()
    cache.v_cache.normal_()
    cache.cache_seqlens.fill_(args.seqlen - 1)
    lens = torch.full((B,), args.seqlen - 1, dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, HQ, D, dtype=torch.bfloat16, device="cuda")

    def step():
        pisa.pisa_attn_with_kvcache(q, cache, cache_seqlens=lens, topk=16)

    def wall(fn, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    print(f"{torch.cuda.get_device_name()}  seqlen {args.seqlen}")
    print(f"  step host: {_time(step, args.n):7.1f} us   wall: {wall(step, 1000):7.1f} us")
    print(f"  torch.empty host: {_time(lambda: torch.empty(64, device='cuda'), 2000):7.2f} us")
    if args.profile:
        _profile(step, 1000, "tottime")


def _stub_decode() -> dict:
    """The decode module's Triton functions replaced by their binders (its kernels, whatever a
    tree names them; its ``@triton.jit`` helpers are never launched) and returned by name."""
    from triton.runtime.jit import JITFunction
    binders = {name: _Binder(f) for name, f in vars(dec).items() if isinstance(f, JITFunction)}
    try:
        from pisa.ops.utils import relaunch
        relaunch.driver = _Driver()
    except ImportError:  # trees before it
        pass
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
        _profile(step, 200, "tottime")


if __name__ == "__main__":
    sys.exit(main())
