"""``pisa.ops.utils.kernel_binaries``: packing Triton cache entries and seeding a cache with them
(CPU: a Triton cache made by Triton's own manager with stand-in files)."""
import json

import pytest

triton = pytest.importorskip("triton")
from triton.runtime.cache import FileCacheManager  # noqa: E402

from pisa.ops.utils import kernel_binaries as kb  # noqa: E402

TARGET = "triton-3.6.0/cuda:90"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Point Triton's cache at a folder of the test's; returns a function that moves it."""
    def use(name):
        path = tmp_path / name
        monkeypatch.setattr(triton.knobs.cache, "dir", str(path))
        return path
    return use


def _compiled(key: str, name: str, extra: bool = True) -> dict[str, bytes]:
    """A kernel as Triton's compile leaves it in the current cache: its files and group."""
    manager = FileCacheManager(key)
    files = {f"{name}.json": json.dumps({"name": name}).encode(),
             f"{name}.cubin": b"\x7fELF" + key.encode()}
    if extra:
        files[f"{name}.ptx"] = b"// ptx"
    manager.put_group(f"{name}.json", {c: manager.put(d, c) for c, d in files.items()})
    return files


def test_pack_then_seed_gives_the_kernels_metadata_and_binary(cache_dir, tmp_path):
    cache_dir("filled")
    a = _compiled("a" * 16, "_decode_kernel")
    b = _compiled("b" * 16, "_combine_kernel")
    _compiled("c" * 16, "_other_library_kernel")
    archive = tmp_path / "bin.tar.xz"
    assert kb.pack(triton.knobs.cache.dir, {"_decode_kernel", "_combine_kernel"}, TARGET,
                   archive) == 2
    cache_dir("fresh")
    assert kb.seed("triton-3.5.0/cuda:90", archive) == 0, "another target's binaries"
    assert kb.seed(TARGET, archive) == 2
    for key, name, files in (("a" * 16, "_decode_kernel", a), ("b" * 16, "_combine_kernel", b)):
        group = FileCacheManager(key).get_group(f"{name}.json")
        assert sorted(group) == [f"{name}.cubin", f"{name}.json"], "no IR, just what loads"
        for child, path in group.items():
            assert path.startswith(triton.knobs.cache.dir)
            assert open(path, "rb").read() == files[child]
    assert FileCacheManager("c" * 16).get_group("_other_library_kernel.json") is None
    assert kb.seed(TARGET, archive) == 0, "present entries are left as they are"


def test_pack_then_seed_gives_triton_s_host_modules_of_this_python(cache_dir, tmp_path):
    """Kernel launchers (C modules Triton builds at a kernel's first load) travel too, and are
    seeded only where their file name carries this Python's extension suffix."""
    import sysconfig
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    cache_dir("filled")
    _compiled("a" * 16, "_decode_kernel")
    ours = FileCacheManager("l" * 16).put(b"\x7fELF ours", f"__triton_launcher{suffix}",
                                         binary=True)
    FileCacheManager("m" * 16).put(b"\x7fELF py99", "__triton_launcher.cpython-99.so",
                                   binary=True)
    archive = tmp_path / "bin.tar.xz"
    kb.pack(triton.knobs.cache.dir, {"_decode_kernel"}, TARGET, archive)
    cache_dir("fresh")
    assert kb.seed(TARGET, archive) == 1
    seeded = FileCacheManager("l" * 16).get_file(f"__triton_launcher{suffix}")
    assert seeded is not None and open(seeded, "rb").read() == open(ours, "rb").read()
    assert FileCacheManager("m" * 16).get_file("__triton_launcher.cpython-99.so") is None


def test_pack_keeps_other_targets_and_skips_incomplete_entries(cache_dir, tmp_path):
    archive = tmp_path / "bin.tar.xz"
    cache_dir("h100")
    _compiled("d" * 16, "_decode_kernel")
    kb.pack(triton.knobs.cache.dir, {"_decode_kernel"}, "triton-3.6.0/cuda:90", archive)
    cache_dir("other")
    _compiled("e" * 16, "_decode_kernel")
    manager = FileCacheManager("f" * 16)  # a group without its binary: not packed
    manager.put_group("_decode_kernel.json",
                      {"_decode_kernel.json": manager.put(b"{}", "_decode_kernel.json")})
    assert kb.pack(triton.knobs.cache.dir, {"_decode_kernel"}, "triton-3.6.0/cuda:100",
                   archive) == 1
    cache_dir("fresh")
    assert kb.seed("triton-3.6.0/cuda:90", archive) == 1
    assert kb.seed("triton-3.6.0/cuda:100", archive) == 1


def test_seed_once_seeds_once_and_only_warns_on_a_broken_archive(cache_dir, tmp_path,
                                                                monkeypatch):
    cache_dir("filled")
    _compiled("a" * 16, "_decode_kernel", extra=False)
    archive = tmp_path / "bin.tar.xz"
    kb.pack(triton.knobs.cache.dir, {"_decode_kernel"}, TARGET, archive)
    cache_dir("fresh")
    monkeypatch.setattr(kb, "SHIPPED", archive)
    monkeypatch.setattr(kb, "_seeded", kb.threading.Event())
    calls = []
    kb.seed_once(lambda: calls.append(1) or TARGET)
    kb.seed_once(lambda: calls.append(1) or TARGET)
    assert calls == [1] and FileCacheManager("a" * 16).get_group("_decode_kernel.json")
    broken = tmp_path / "broken.tar.xz"
    broken.write_bytes(b"not an archive")
    monkeypatch.setattr(kb, "SHIPPED", broken)
    monkeypatch.setattr(kb, "_seeded", kb.threading.Event())
    with pytest.warns(UserWarning, match="shipped kernel binaries were not seeded"):
        kb.seed_once(lambda: TARGET)
