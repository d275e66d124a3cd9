"""Compile Triton kernels for the H100 / H200 (sm_90) on a machine without a GPU.

Triton's CPU interpreter runs a kernel's Python body and never meets its compiler, which rejects
what the interpreter lets pass (a ``NamedTuple`` constexpr's field inside a shape list, a layout
no lowering supports) only on the GPU, at the first launch. Here the launches of real library
calls are captured instead of run, their arguments bound and specialised as ``JITFunction.run``
does, and each kernel compiled with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``: the
frontend, TTGIR, LLVM and ptxas, all on the CPU. Run in a process without ``TRITON_INTERPRET``
(its kernels must be ``JITFunction``s): ``python -m tests.ops.sm90_compile`` prints a line a
kernel variant and exits non-zero on the first that does not compile
(``tests/ops/test_sm90_compile.py`` runs it).
"""
from __future__ import annotations

import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") != "1", "compile in a process without the interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import pisa  # noqa: E402
import pisa.api  # noqa: E402
from pisa.ops.coarse import triton as coarse  # noqa: E402
from pisa.ops.decode import kvcache_triton  # noqa: E402
from pisa.ops.decode import triton as decode  # noqa: E402
from pisa.ops.utils.geometry import level_offsets  # noqa: E402
from tests.ops.conftest import per_token_config  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
_LAUNCHES: list = []


class _Capture:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn: JITFunction):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _LAUNCHES.append((self.fn, args, kwargs))


def _stub(*modules) -> None:
    for module in modules:
        for name, fn in list(vars(module).items()):
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _Capture(fn))


def compile_launches(label: str) -> None:
    """Compile every captured launch for sm_90 (raising on the first failure), then forget them."""
    for fn, args, kwargs in _LAUNCHES:
        kwargs = {"debug": False, "instrumentation_mode": "", **kwargs}
        binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, spec,
                                                               options)
        t0 = time.perf_counter()
        out = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                             options=options.__dict__)
        print(f"{label}: {fn.__name__} compiled for sm_90 ({out.metadata.num_warps} warps, "
              f"{out.metadata.shared} B shared, {time.perf_counter() - t0:.1f} s)", flush=True)
    _LAUNCHES.clear()


def _decode_steps() -> None:
    """A decode step (walk, attention, combine) of every variant a server meets: the defaults at
    batch 1 and 16, the bound scorer with a wider leaf beam, branching 4, a paged cache with
    slots and the selection returned; and the fused cache append (contiguous, paged)."""
    HQ, HKV, D, T, C = 64, 4, 128, 65536, 64
    for label, B, cache_kw, kw in (("decode", 1, {}, {}), ("decode B=16", 16, {}, {}),
                                   ("decode bound W2=32", 1, {"bounds": True},
                                    {"scorer": "bound", "beam_leaf": 32}),
                                   ("decode g=4", 1, {"branching": 4}, {})):
        cache = pisa.PisaCache(B, T, HKV, D, block_size=C, dtype=torch.bfloat16, **cache_kw)
        cache.cache_seqlens.fill_(T - 1)
        q = torch.randn(B, 1, HQ, D, dtype=torch.bfloat16)
        pisa.pisa_attn_with_kvcache(q, cache, topk=16, **kw)
        compile_launches(label)
    B, n_pages = 2, 2 * T // C
    pool = torch.randn(n_pages, C, HKV, D, dtype=torch.bfloat16)
    sums = torch.zeros(B, level_offsets(T, C, 2)[-1], HKV, D)
    table = torch.randint(0, n_pages, (B, T // C), dtype=torch.int32)
    lens = torch.full((B,), T - 5, dtype=torch.int32)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    cfg = per_token_config(block_size=C, topk=16, scale=D ** -0.5)
    decode.decode_triton(torch.randn(B, 1, HQ, D, dtype=torch.bfloat16), pool, pool, sums, lens,
                         cfg, block_table=table, cache_batch_idx=slots, return_block_idx=True)
    compile_launches("decode paged")
    new = torch.randn(B, 1, HKV, D, dtype=torch.bfloat16)
    kvcache_triton.append_triton(pool, pool, sums, new, new, lens, C, 2, 11, sums, sums,
                                 block_table=table, cache_batch_idx=slots)
    compile_launches("append paged, bounds")


def _coarse_branch() -> None:
    """The compressed branch's forward, dQ and dK/dV kernels (config A's heads, 4K tokens)."""
    q = torch.randn(1, 4096, 64, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 4096, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    o, _ = coarse.coarse_attn_triton(q, k, k, 64, 128 ** -0.5)
    o.float().sum().backward()
    compile_launches("coarse")


def main() -> int:
    _stub(decode, coarse, kvcache_triton)
    pisa.api.resolve_backend = lambda backend, q: "triton"  # CPU tensors take the Triton path
    _decode_steps()
    _coarse_branch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
