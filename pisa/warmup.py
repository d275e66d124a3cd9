"""``pisa warmup``: compile the Triton kernels of a model's shapes ahead of time and record them.

Each (shape, op) runs once on random inputs while ``pisa.ops.utils.kernel_cache.record`` notes
every kernel variant it compiles under the ``call_key`` of the public call it ran for (entry
point, dtype, heads, gradient, a digest of the resolved knobs), the key that call's first run in
another process looks up; the manifest then lets a fresh process compile them all at once, in parallel,
before its first launch (``kernel_cache.precompile``), and Triton's on-disk cache keeps the
binaries for later processes.

Ops (what a call of the library runs):
- ``train``: ``pisa_attn`` forward and backward;
- ``prefill``: ``pisa_attn`` without gradient (inference prefill without a cache);
- ``varlen``: ``pisa_attn_varlen`` forward and backward over two packed sequences (HF's padded
  and packed batches run it);
- ``decode``: a ``PisaCache`` filled by chunked prefill, then decode steps, through
  ``pisa_attn_with_kvcache``, twice: with decode's defaults, and with the
  given knobs over a cache with key bounds (what ``PisaHFCache`` runs for a model's knobs).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .api import pisa_attn, pisa_attn_varlen, pisa_attn_with_kvcache
from .cache import PisaCache
from .ops.utils.kernel_cache import record, user_manifest, write_manifest

OPS = ("train", "prefill", "decode", "varlen")
DECODE_STEPS = 3


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"HQ/HKV/D"`` -> ``(HQ, HKV, D)``; HQ a multiple of HKV."""
    try:
        HQ, HKV, D = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shape must be HQ/HKV/D (e.g. 32/8/128), got {text!r}") from None
    if min(HQ, HKV, D) < 1 or HQ % HKV:
        raise ValueError(f"shape {text!r}: heads and head dim must be positive, HQ a multiple "
                         f"of HKV")
    return HQ, HKV, D


def _qkv(T: int, HQ: int, HKV: int, D: int, dtype, device, grad: bool):
    g = torch.Generator(device=device).manual_seed(T)
    make = lambda H: torch.randn(1, T, H, D, generator=g, device=device,  # noqa: E731
                                 dtype=dtype).requires_grad_(grad)
    return make(HQ), make(HKV), make(HKV)


def _train(T, shape, dtype, device, knobs) -> None:
    q, k, v = _qkv(T, *shape, dtype, device, True)
    pisa_attn(q, k, v, **knobs).backward(torch.randn_like(q))


def _prefill(T, shape, dtype, device, knobs) -> None:
    with torch.no_grad():
        pisa_attn(*_qkv(T, *shape, dtype, device, False), **knobs)


def _decode(T, shape, dtype, device, knobs) -> None:
    HQ, HKV, D = shape
    q, k, v = _qkv(T + DECODE_STEPS, HQ, HKV, D, dtype, device, False)
    geometry = {n: knobs[n] for n in ("block_size", "branching") if n in knobs}
    step_knobs = {n: x for n, x in knobs.items() if n not in geometry}
    for bounds, kw in ((False, {}), (True, step_knobs)):
        cache = PisaCache(1, T + DECODE_STEPS, HKV, D, dtype=dtype, device=device, bounds=bounds,
                          **geometry)
        pisa_attn_with_kvcache(q[:, :T], cache, k[:, :T], v[:, :T], **kw)
        for t in range(T, T + DECODE_STEPS):
            pisa_attn_with_kvcache(q[:, t:t + 1], cache, k[:, t:t + 1], v[:, t:t + 1], **kw)


def _varlen(T, shape, dtype, device, knobs) -> None:
    q, k, v = (x[0] for x in _qkv(T, *shape, dtype, device, True))  # [T, H, D]: packed rows
    lens = [T // 3, T - T // 3]
    cu = torch.tensor([0, lens[0], T], dtype=torch.int32, device=device)
    o = pisa_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), **knobs)
    o.backward(torch.randn_like(o))


RUN = {"train": _train, "prefill": _prefill, "decode": _decode, "varlen": _varlen}

def warmup(shapes: list[tuple[int, int, int]], *, ops=OPS, lengths=(8192,),
           dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
           manifest: str | Path | None = None, **knobs) -> dict:
    """Compile and record the kernels of ``ops`` for each ``(HQ, HKV, D)`` in ``shapes``.

    Args:
        shapes: the attention shapes of a model (query heads, key/value heads, head dim).
        ops: any of ``"train"``, ``"prefill"``, ``"decode"``, ``"varlen"`` (default all).
        lengths: sequence lengths to run (default 8192; kernel variants do not depend on the
            length, except through knobs such as ``selector="auto"``).
        dtype: default bf16. device: a CUDA device (default "cuda").
        manifest: where to merge the record (default ``$PISA_CACHE_DIR/kernels.json``,
            ``~/.cache/pisa/kernels.json``).
        **knobs: ``pisa_attn`` selection knobs (``block_size``, ``topk``, ...), the ones the
            model runs.

    Returns the record: ``{target: {call key: [kernel entries]}}``. Kernels this process compiled
    before are recorded again (``record`` forgets them first).
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"ops must be among {OPS}, got {unknown}")
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise ValueError(f"warmup compiles Triton kernels: device must be CUDA, got {device!r} "
                         f"(CUDA available: {torch.cuda.is_available()})")
    targets: dict = {}
    for shape in shapes:
        for op in ops:
            with record(targets):
                for T in lengths:
                    RUN[op](T, shape, dtype, device, knobs)
            torch.cuda.synchronize(device)
    write_manifest(Path(manifest) if manifest else user_manifest(), targets)
    return targets
