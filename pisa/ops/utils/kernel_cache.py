"""Kernel manifests: the Triton variants a call compiles, recorded once and compiled in parallel.

A fresh process compiles each Triton kernel at its first launch, one after another: a first
``pisa_attn`` forward+backward waits for every kernel of the selection, the attention and its
backward in turn. The variants a call needs depend only on what ``call_key`` names (entry point,
dtype, head counts and dim, whether it differentiates) and the knobs, never on the sequence length
(lengths are runtime values, ``docs/design.md``), so they can be recorded by running the call once
(``pisa warmup``, ``record``) and, in a later process, compiled all at once on a thread pool before
the call's first launch (``precompile``; Triton's compiler releases the GIL, so the wall time is
the slowest kernel's instead of their sum). Each entry is Triton's own serialised specialisation
(``JITFunction.preload``), kept per Triton version and GPU target.

Manifests: the one shipped with pisa (``kernels.json`` beside this file: the benchmark shapes,
built on the H200 with ``pisa warmup``) and the user's (``$PISA_CACHE_DIR/kernels.json``, default
``~/.cache/pisa``), which ``pisa warmup`` writes. ``PISA_PRECOMPILE=0`` turns ``precompile`` off.
The first ``precompile`` of a process also seeds Triton's cache with the shipped binaries
(``kernel_binaries``), so on a matching machine the preloads load instead of compiling.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import torch

from .kernel_binaries import seed_once

SHIPPED = Path(__file__).with_name("kernels.json")
VERSION = 2  # 2: constexprs kept with their types (``encode``)
# Workers compiling at once: ptxas and the MLIR passes use one core each.
MAX_WORKERS = 16

_lock = threading.Lock()
_done: set[tuple] = set()  # calls this process has precompiled (or found nothing for)
_keys: dict[tuple, str] = {}  # call -> its call_key, made once
_current = threading.local()  # .key: the call_key of this thread's latest pisa call
# the latest of any thread: ``record`` files a backward's kernels under it (autograd runs a CUDA
# backward in a thread of its own, which makes no pisa call)
_latest: str | None = None
_recording = threading.Event()  # set inside ``record``: precompile stands aside
_manifests: dict | None = None  # target -> key -> entries, shipped + user, read once


def user_manifest() -> Path:
    """The user's manifest: ``$PISA_CACHE_DIR/kernels.json`` (default ``~/.cache/pisa``)."""
    root = os.environ.get("PISA_CACHE_DIR") or Path.home() / ".cache" / "pisa"
    return Path(root) / "kernels.json"


def call_key(entry: str, q: torch.Tensor, num_kv_heads: int, grad: bool, cfg=None) -> str:
    """What decides the kernel variants of a call: ``entry`` (the public function), ``q``'s dtype,
    heads and head dim, the key/value heads, whether a backward follows, and with ``cfg`` (its
    resolved ``SelectConfig``) a digest of the knobs (the softmax scale aside: a runtime value)."""
    HQ, D = q.shape[-2], q.shape[-1]
    key = f"{entry}|{str(q.dtype).removeprefix('torch.')}|{HQ}/{num_kv_heads}/{D}|" \
          f"{'grad' if grad else 'nograd'}"
    if cfg is None:
        return key
    knobs = sorted((f.name, getattr(cfg, f.name)) for f in fields(cfg) if f.name != "scale")
    return f"{key}|{hashlib.sha1(repr(knobs).encode()).hexdigest()[:12]}"


def target() -> str:
    """The Triton version and GPU target that compiled kernels are valid for."""
    import triton
    from triton.runtime import driver
    t = driver.active.get_current_target()
    return f"triton-{triton.__version__}/{t.backend}:{t.arch}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("targets", {}) if data.get("version") == VERSION else {}


def _merge(into: dict, targets: dict) -> dict:
    for tgt, keys in targets.items():
        for key, entries in keys.items():
            known = into.setdefault(tgt, {}).setdefault(key, [])
            known.extend(e for e in entries if e not in known)
    return into


def manifest_entries(key: str) -> list[dict]:
    """The recorded kernels of ``key`` for this process's target, shipped and user manifests; for
    a key with a knob digest that none recorded, those of its key without one (a manifest
    recorded before keys named the knobs: every variant of the call's shape)."""
    global _manifests
    if _manifests is None:
        _manifests = _merge(_merge({}, _read(SHIPPED)), _read(user_manifest()))
    keys = _manifests.get(target(), {})
    return keys.get(key) or keys.get(key.rsplit("|", 1)[0] if key.count("|") > 3 else key, [])


def _kernel(name: str):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def encode(value):
    """A constexpr value as JSON, its type kept: Triton's own record (``serialize_specialization
    _data``) turns the kernels' NamedTuple bundles into lists and keeps machine paths."""
    import triton.language as tl
    if isinstance(value, tl.dtype):
        return {"dtype": str(value)}
    if isinstance(value, tl.constexpr):
        return {"constexpr": encode(value.value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        kind = type(value)
        return {"namedtuple": f"{kind.__module__}:{kind.__qualname__}",
                "values": [encode(v) for v in value]}
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    return value


def decode(value):
    """``encode``'s inverse."""
    import triton.language as tl
    if not isinstance(value, dict):
        return value
    if "dtype" in value:
        return tl.dtype(value["dtype"])
    if "constexpr" in value:
        return tl.constexpr(decode(value["constexpr"]))
    if "namedtuple" in value:
        return _kernel(value["namedtuple"])(*(decode(v) for v in value["values"]))
    return tuple(decode(v) for v in value["tuple"])


def _preload(entry: dict, device: int) -> None:
    """Compile one recorded variant into its kernel's in-process cache, under the key its launch
    will look up (what ``JITFunction.preload`` does, with ``encode``'s constexprs and this
    machine's library paths)."""
    from triton.runtime.jit import convert_to_tuple_if_list
    fn, spec = _kernel(entry["kernel"]), json.loads(entry["spec"])
    with torch.cuda.device(device):  # a new thread's current device is 0
        backend = fn.device_caches[device][3]
        options = {k: tuple(v) if isinstance(v, list) else v
                   for k, v in spec["options"].items() if k != "extern_libs"}
        fn._do_compile(spec["key"], {k: convert_to_tuple_if_list(v)
                                     for k, v in spec["signature"].items()}, device,
                       {tuple(path): decode(v) for path, v in entry["constants"]},
                       backend.parse_options(options),
                       dict(zip(map(tuple, spec["attrs_keys"]), spec["attrs_vals"])), warmup=True)


def precompile(entry: str, q: torch.Tensor, num_kv_heads: int, grad: bool, cfg=None) -> None:
    """Compile the kernels recorded for this call's ``call_key`` in parallel, once per process
    and key (later calls cost a dict lookup); the call's own launches then find them compiled.
    Entries that no longer fit a kernel (its parameters changed since they were recorded) are
    skipped with a warning: the launch compiles as usual. The key is also this thread's current
    call, which ``record`` files the kernels it compiles under."""
    seen = (entry, q.dtype, q.shape[-2], num_kv_heads, q.shape[-1], grad, cfg)
    key = _keys.get(seen)
    if key is None:
        if len(_keys) >= 1024:  # configs that come and go (tests): no unbounded growth
            _keys.clear()
        key = _keys[seen] = call_key(entry, q, num_kv_heads, grad, cfg)
    if _recording.is_set() and key != getattr(_current, "key", None):
        # every variant this call launches compiles again and is filed under it, also those an
        # earlier call of the record compiled (a kernel two calls share is in both entries)
        _forget_compiled()
    global _latest
    _current.key = _latest = key
    # while recording, the call's launches compile in this thread, where the hook knows the
    # call (a preload on the pool would compile them unseen: a thread without ``_current.key``)
    if seen in _done or _recording.is_set() or os.environ.get("PISA_PRECOMPILE") == "0" \
            or os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter compiles nothing
        return
    with _lock:
        if seen in _done:
            return
        seed_once(target)  # shipped binaries first: the preloads below then load, not compile
        entries = manifest_entries(key)
        if entries:
            device = torch.cuda.current_device()
            with ThreadPoolExecutor(min(MAX_WORKERS, len(entries))) as pool:
                futures = [pool.submit(_preload, e, device) for e in entries]
            failed = [e["kernel"] for e, f in zip(entries, futures) if f.exception() is not None]
            if failed:
                warnings.warn(f"pisa: {len(failed)} recorded kernel variants of {key} did not "
                              f"compile ({sorted(set(failed))}); run `pisa warmup` again",
                              stacklevel=3)
        _done.add(seen)


def pisa_kernels():
    """Every ``@triton.jit`` function of the loaded ``pisa.ops`` modules, each once (where it is
    defined)."""
    from triton.runtime.jit import JITFunction
    for name, module in list(sys.modules.items()):
        if name.startswith("pisa.ops.") and module is not None:
            for obj in vars(module).values():
                if isinstance(obj, JITFunction) and getattr(obj, "__module__", name) == name:
                    yield obj


def _forget_compiled() -> None:
    """Drop this process's compiled variants of every pisa kernel (Triton's and those a
    ``Relaunch`` keeps), so that the next launch compiles (from Triton's disk cache: fast) and
    ``record`` sees it."""
    from .relaunch import forget_compiled  # Triton's: imported where Triton is
    for fn in pisa_kernels():
        fn.device_caches.clear()
    forget_compiled()


@contextmanager
def record(into: dict):
    """Collect into ``into`` (target -> key -> entries) every pisa kernel variant the block
    launches, each under the ``call_key`` of the public call it ran for (``precompile`` names
    it; a backward's kernels go with their forward's call). Each is compiled again for it
    (from Triton's disk cache when there); ``precompile`` does nothing meanwhile."""
    import triton
    _forget_compiled()
    _recording.set()
    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook
    tgt = target()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        call = getattr(_current, "key", None) or _latest
        if fn.module.startswith("pisa.") and call is not None:
            entries = into.setdefault(tgt, {}).setdefault(call, [])
            entry = {"kernel": f"{fn.module}:{fn.name}", "spec": compile["specialization_data"],
                     "constants": [[list(path), encode(v)]
                                   for path, v in compile["constants"].items()]}
            if entry not in entries:
                entries.append(entry)
        return previous(key=key, repr=repr, fn=fn, compile=compile,
                        is_manual_warmup=is_manual_warmup,
                        already_compiled=already_compiled) if previous else None

    knobs.jit_post_compile_hook = hook
    try:
        yield into
    finally:
        knobs.jit_post_compile_hook = previous
        _recording.clear()


def write_manifest(path: Path, targets: dict) -> None:
    """Merge ``targets`` into the manifest at ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = _merge(_read(path), targets)
    path.write_text(json.dumps({"version": VERSION, "targets": merged}, indent=1) + "\n")
    global _manifests
    _manifests = None  # read again, with the new entries
