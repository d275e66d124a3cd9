"""Registers and spills of the selection kernels compiled for sm_90, without a GPU.

The launcher runs on CPU tensors with every ``@triton.jit`` kernel of ``pisa.ops.select.triton``
replaced by a stand-in that binds its arguments as a launch would, compiles the kernel for
``sm_90a`` (Triton's own pipeline) and runs ``ptxas -v`` on the PTX; nothing is launched (the
sort between the walk and the leaf stage is stubbed). Needs ``ptxas`` on the PATH (Triton ships
one under ``triton/backends/nvidia/bin``).

    python benchmarks/checks/kernel_regs.py --tile-reduce qmean mass
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the real JITFunction's binder, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import pisa.ops.select.triton as st  # noqa: E402
from pisa.ops.pyramid import Pyramid  # noqa: E402
from pisa.ops.utils.config import SelectConfig  # noqa: E402
from pisa.ops.utils.geometry import level_offsets  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
KERNELS = ("_pyramid_walk_kernel", "_leaf_groups_kernel", "_leaf_topk_kernel", "_leaf_mass_kernel")
SHAPES = {"A": (64, 4, 128), "llama3_8b": (32, 8, 128), "qwen2.5_7b": (28, 4, 128)}


class Offline:
    """Stands in for ``kernel[grid](...)``: compiles for sm_90a and reports ``ptxas -v``."""

    def __init__(self, kernel, name: str, out: list):
        self.kernel, self.name, self.out = kernel, name, out
        self.bind = create_function_from_signature(kernel.signature, kernel.params, BACKEND)

    def __getitem__(self, grid):
        return self.run

    def run(self, *args, **kwargs):
        bound, spec, options = self.bind(*args, **kwargs)
        options, signature, constexprs, attrs = self.kernel._pack_args(BACKEND, kwargs, bound,
                                                                       spec, options)
        src = triton.compiler.ASTSource(self.kernel, signature, constexprs, attrs)
        ptx = triton.compile(src, target=TARGET, options=options.__dict__).asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            log = subprocess.run(["ptxas", "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                                 capture_output=True, text=True, check=True).stderr
        self.out.append((self.name, int(re.search(r"Used (\d+) registers", log).group(1)),
                         int(re.search(r"(\d+) bytes spill stores", log).group(1)),
                         options.num_warps))


def kernel_regs(HQ: int, HKV: int, D: int, T: int, **knobs) -> list[tuple]:
    """``(kernel, registers, spill-store bytes, warps)`` of each kernel one bf16 selection of
    ``T`` tokens launches with ``knobs`` (``pisa_select``'s)."""
    out: list = []
    saved = {name: getattr(st, name) for name in KERNELS + ("sort_by_key", "device_offsets")}
    for name in KERNELS:
        setattr(st, name, Offline(saved[name], name, out))
    st.sort_by_key = lambda keys, n: (torch.zeros_like(keys), torch.zeros(n + 1, dtype=torch.int32))
    st.device_offsets = lambda offsets, device: torch.tensor(offsets, dtype=torch.int64)
    try:
        cfg = SelectConfig(**{"scale": D ** -0.5, **knobs})
        off = level_offsets(T, cfg.block_size, cfg.branching)
        node = lambda: torch.empty(1, off[-1], HKV, D)  # noqa: E731
        pyramid = Pyramid(node(), torch.ones(off[-1], dtype=torch.int32), off, node(), node())
        q = torch.empty(1, T, HQ, D, dtype=torch.bfloat16)
        st.select_pyramid_triton(q, torch.empty(1, T, HKV, D, dtype=torch.bfloat16), cfg, pyramid)
    finally:
        for name, fn in saved.items():
            setattr(st, name, fn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile-reduce", nargs="+", default=["qmean", "mass"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--length", type=int, default=32768)
    args = ap.parse_args()
    print("| shape | tile_reduce | kernel | registers | spill stores (bytes) | warps |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        for reduce in args.tile_reduce:
            for name, regs, spill, warps in kernel_regs(*SHAPES[shape], args.length,
                                                         tile_reduce=reduce):
                print(f"| {shape} | {reduce} | `{name}` | {regs} | {spill} | {warps} |")


if __name__ == "__main__":
    main()
