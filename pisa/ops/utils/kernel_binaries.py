"""Shipped kernel binaries: Triton cache entries of the recorded variants, seeded into the user's
Triton cache so that a fresh machine's first call loads them instead of compiling.

A manifest (``kernel_cache``) says which variants a call compiles; compiling them, even all at
once, is most of a fresh process's first call. Triton keeps each compiled kernel in its on-disk
cache (``triton.knobs.cache.dir``, ``$TRITON_CACHE_DIR``) under a hash of everything that decides
the binary (Triton's version and backend, the kernel's source, its specialisation and options),
as a group file naming the kernel's metadata (``<name>.json``) and binary (``<name>.cubin``),
which is all a launch loads. ``pack`` copies those two files of pisa's kernels from a filled cache
(``pisa warmup --binaries``, on the machine the binaries are for) into a tar.xz, per target;
``seed`` writes the missing ones into this process's Triton cache, through Triton's own cache
manager. An entry that no longer matches (another Triton, GPU, or kernel source) is simply never
looked up: the launch compiles as usual.
"""
from __future__ import annotations

import io
import json
import os
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
    metadata and binary) to the archive ``out`` under ``target`` (entries already there for
    other targets are kept); returns how many kernels it holds for ``target``."""
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
    files); returns how many."""
    from triton.runtime.cache import FileCacheManager
    root = _member_root(target) + "/"
    groups: dict[tuple[str, str], dict[str, bytes]] = {}
    for member, data in _read_archive(Path(archive)).items():
        if member.startswith(root):
            key, filename = member[len(root):].split("/", 1)
            groups.setdefault((key, filename.rsplit(".", 1)[0]), {})[filename] = data
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
