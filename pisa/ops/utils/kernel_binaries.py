"""Shipped kernel binaries: Triton cache entries of the recorded variants, seeded into the user's
Triton cache so that a fresh machine's first call loads them instead of compiling.

A manifest (``kernel_cache``) says which variants a call compiles; compiling them, even all at
once, is most of a fresh process's first call. Triton keeps each compiled kernel in its on-disk
cache (``triton.knobs.cache.dir``, ``$TRITON_CACHE_DIR``) under a hash of everything that decides
the binary (Triton's version and backend, the kernel's source, its specialisation and options),
as a group file naming the kernel's metadata (``<name>.json``) and binary (``<name>.cubin``),
which is all a launch loads. Each kernel signature also needs a host launcher, a C module Triton
builds with the system's compiler at the kernel's first load (~0.3 s each: 3 s of a fresh
process's first ``pisa_attn`` forward + backward whose binaries were all on disk) and keeps in the
same cache as a lone ``__triton_launcher<EXT_SUFFIX>`` under a hash of its C source and the
platform (its CUDA utilities module likewise). ``pack`` copies those two files of pisa's kernels
and every such host module from a filled cache (``pisa warmup --binaries``, on the machine the
binaries are for) into a tar.xz, per target; ``seed`` writes the missing ones into this process's
Triton cache, through Triton's own cache manager (host modules only where their file name carries
this Python's extension suffix). An entry that no longer matches (another Triton, GPU, kernel
source, Python or platform) is simply never looked up: the launch compiles as usual.
"""
from __future__ import annotations

import io
import json
import os
import sysconfig
import tarfile
import threading
import warnings
from pathlib import Path

SHIPPED = Path(__file__).with_name("kernels_bin.tar.xz")
BINARY_SUFFIXES = (".cubin", ".hsaco")

_seeded = threading.Event()


def _member_root(target: str) -> str:
    """A target (``kernel_cache.target()``, e.g. ``triton-3.6.0/cuda:90``) as an archive folder."""
    return target.replace("/", "_").replace(":", "-")


def pack(cache_dir: str | os.PathLike, names: set[str], target: str,
         out: str | os.PathLike) -> int:
    """Add the Triton cache entries under ``cache_dir`` of the kernels named ``names`` (their
    metadata and binary) and its host modules to the archive ``out`` under ``target`` (entries
    already there for other targets are kept); returns how many kernels it holds for
    ``target``."""
    root = _member_root(target)
    files = _read_archive(Path(out))
    files = {k: v for k, v in files.items() if not k.startswith(root + "/")}
    for group in Path(cache_dir).glob("*/__grp__*.json"):
        name = group.name.removeprefix("__grp__").removesuffix(".json")
        if name not in names:
            continue
        children = json.loads(group.read_text()).get("child_paths", {})
        keep = [c for c in children if c == f"{name}.json" or c.endswith(BINARY_SUFFIXES)]
        if len(keep) != 2 or not all(os.path.exists(children[c]) for c in keep):
            continue
        for c in keep:
            files[f"{root}/{group.parent.name}/{c}"] = Path(children[c]).read_bytes()
    for module in Path(cache_dir).glob("*/*.so"):  # Triton's host modules: launchers, utilities
        files[f"{root}/{module.parent.name}/{module.name}"] = module.read_bytes()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz") as tar:
        for member, data in sorted(files.items()):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sum(1 for m in files if m.startswith(root + "/") and m.endswith(".json"))


def _read_archive(path: Path) -> dict[str, bytes]:
    if not path.exists():
        return {}
    with tarfile.open(path, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def seed(target: str, archive: str | os.PathLike) -> int:
    """Write the entries for ``target`` of the archive (``SHIPPED``: pisa's) that this process's
    Triton cache lacks into it (Triton's ``FileCacheManager``: atomic writes, its own group
    files), and the host modules of this Python; returns how many kernels."""
    from triton.runtime.cache import FileCacheManager
    root = _member_root(target) + "/"
    groups: dict[tuple[str, str], dict[str, bytes]] = {}
    modules: dict[tuple[str, str], bytes] = {}
    for member, data in _read_archive(Path(archive)).items():
        if member.startswith(root):
            key, filename = member[len(root):].split("/", 1)
            if filename.endswith(".so"):
                modules[key, filename] = data
            else:
                groups.setdefault((key, filename.rsplit(".", 1)[0]), {})[filename] = data
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for (key, filename), data in modules.items():
        manager = FileCacheManager(key)
        if filename.endswith(suffix) and manager.get_file(filename) is None:
            manager.put(data, filename, binary=True)
    written = 0
    for (key, name), children in groups.items():
        manager = FileCacheManager(key)
        if manager.get_group(f"{name}.json"):
            continue
        paths = {c: manager.put(data, c, binary=True) for c, data in children.items()}
        manager.put_group(f"{name}.json", paths)
        written += 1
    return written


def seed_once(target_fn) -> None:
    """``seed`` the shipped archive for this process's target (``target_fn()``), once per
    process, before its first precompile; a failure only warns (the launches compile)."""
    if _seeded.is_set() or not SHIPPED.exists():
        return
    _seeded.set()
    try:
        seed(target_fn(), SHIPPED)
    except Exception as e:  # a broken archive or cache must not stop a call
        warnings.warn(f"pisa: the shipped kernel binaries were not seeded ({e!r})", stacklevel=3)
