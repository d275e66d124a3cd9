"""A Triton kernel launched again and again with the same arguments but its tensors: the decode
step's launches, where the host time of ``kernel[grid](...)`` is most of an eager step.

``JITFunction.run`` (Triton 3.6) binds and specialises every argument, hashes the
specialisation to look the compiled kernel up, checks the kernel's globals, builds launch
metadata for the (empty) launch hooks and then calls the compiled kernel's launcher: ~15-25 us on
a server's host for a kernel of ~40 arguments, three times a decode step. Everything but the
tensors is fixed per decode plan (its sizes, strides and constexpr bundles), so after the first
launch a ``Relaunch`` calls the compiled kernel's launcher directly (``CompiledKernel.run``, as
Triton's own ``CompiledKernel[grid]`` does) while what the compiled code was specialised on
still holds: each tensor's dtype (fixed by the plan's key) and 16-byte alignment (the pointer
hint Triton specialises on: a kernel compiled for aligned tensors is kept, and launched directly
while every tensor is aligned, as the allocator's and a cache's tensors are), the current device
and no launch hooks (a profiler's). Otherwise it launches through ``kernel[grid]`` again and keeps what that
compiled. Under the interpreter ``kernel[grid]`` returns no compiled kernel: every launch goes
through it.
"""
from __future__ import annotations

import weakref

import torch
from triton import knobs
from triton.runtime.driver import driver


def _aligned(tensors: tuple) -> bool:
    """Whether every tensor (one level of tuples flattened) starts on a 16-byte boundary."""
    bits = 0
    for x in tensors:
        if isinstance(x, tuple):
            for y in x:
                bits |= y.data_ptr()
        else:
            bits |= x.data_ptr()
    return bits % 16 == 0


def _hooked() -> bool:
    runtime = knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)


class Relaunch:
    """``kernel[grid](*tensors, *args, **options)`` with ``grid``, ``args`` (the non-tensor
    arguments after the tensors, in the kernel's order) and ``options`` (``num_warps``,
    ``num_stages``) fixed; ``__call__(*tensors)`` launches it."""

    __slots__ = ("kernel", "grid", "args", "options", "compiled", "device", "__weakref__")

    def __init__(self, kernel, grid: tuple[int, int, int], args: tuple, **options):
        self.kernel, self.grid, self.args, self.options = kernel, grid, args, options
        self.compiled = self.device = None
        _LIVE.add(self)

    def __call__(self, *tensors) -> None:
        compiled = self.compiled
        if compiled is not None:
            device = driver.active.get_current_device()
            if device == self.device and _aligned(tensors) and not _hooked():
                stream = driver.active.get_current_stream(device)
                compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata,
                             None, None, None, *tensors, *self.args)
                return
        compiled = self.kernel[self.grid](*tensors, *self.args, **self.options)
        # kept only when compiled for aligned tensors (None under the interpreter), so that
        # aligned tensors are all the direct launch checks for
        if hasattr(compiled, "packed_metadata") and _aligned(tensors):
            self.compiled, self.device = compiled, driver.active.get_current_device()


_LIVE: weakref.WeakSet[Relaunch] = weakref.WeakSet()


def forget_compiled() -> None:
    """Every ``Relaunch``'s next launch goes through ``kernel[grid]`` again (``kernel_cache.record``
    clears Triton's in-memory kernels so that it sees each variant compile: kept ones would hide
    them)."""
    for launch in list(_LIVE):
        launch.compiled = launch.device = None
