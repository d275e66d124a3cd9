"""The selection-v3 study scripts (``docs/selection_v3.md``): the lever study's arithmetic, the
row-override ppl wrapper, and the offline register count."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import pisa.ops.utils.config as config

ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT))  # benchmarks/common.py
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT))
    return module


def _qk(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, 6, 32, generator=gen), torch.randn(T, 2, 32, generator=gen)


def test_levers_are_exact_when_every_block_fits_the_budget():
    """1024 tokens, C = 64: 16 blocks, all in K = 16: every selector attends everything."""
    got = _script("quality/tile_levers.py").layer_levers(*_qk(1024))
    ratios = {a: v for a, v in got.items() if not a.startswith(("union", "cand"))
              or a.endswith("_mass")}
    assert all(v == pytest.approx(1.0, abs=1e-6) for v in ratios.values()), ratios


def test_levers_grow_with_the_budget_and_unions_bound_the_picks():
    got = _script("quality/tile_levers.py").layer_levers(*_qk(4096, seed=1))
    # the same ranking with more blocks keeps a superset
    assert got["defaults"] <= got["qmean_K20"] <= got["qmean_K24"] <= got["qmean_K32"]
    assert got["msum_K16"] <= got["msum_K20"]
    assert 16 <= got["union4"] <= got["union16"] <= got["cand_size"] + 3
    assert got["union16_mass"] >= got["pick_exact"] - 1e-6  # the union holds every token's pick
    assert all(0 < v < 2 for a, v in got.items() if not a.startswith(("union", "cand"))
               or a.endswith("_mass"))


def test_library_study_measures_the_mass_knob_monotone_in_k():
    got = _script("quality/tile_levers.py").layer_levers(*_qk(4096, seed=2), "library")
    assert set(got) == {"defaults", "mass_K16", "mass_K17", "mass_K18", "mass_K20"}
    assert got["mass_K16"] <= got["mass_K17"] <= got["mass_K18"] <= got["mass_K20"]
    assert all(0.5 < v < 2 for v in got.values())


def test_mass_rows_override_reaches_the_run_and_is_undone(tmp_path, tiny_model_dirs, monkeypatch):
    mod = _script("quality/mass_rows_ppl.py")
    out = tmp_path / "ppl.json"
    argv = ["mass_rows_ppl.py", "--mass-rows", "4", "--model", tiny_model_dirs["llama"],
            "--device", "cpu", "--lengths", "256", "--buckets", "2", "--block-size", "16",
            "--topk", "4", "--arms", "dense", "m:tile_reduce=mass", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert mod.main() == 0
    assert config.MASS_ROWS == 64
    meta = json.loads(out.read_text())["meta"]
    assert meta["mass_rows"] == 4 and meta["command"].startswith(
        "python benchmarks/quality/mass_rows_ppl.py --mass-rows 4")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
def test_kernel_regs_compiles_the_mass_kernel_for_sm90():
    """In a process of its own: the tests run the kernels in the interpreter, the script compiles
    them."""
    pytest.importorskip("triton")
    import os
    import subprocess
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "checks" / "kernel_regs.py"), "--tile-reduce",
                          "mass", "--shapes", "A", "--length", "4096"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| A | mass")]
    assert [r[2] for r in rows] == ["`_pyramid_walk_kernel`", "`_leaf_mass_kernel`"]
    assert all(0 < int(r[3]) <= 255 and int(r[4]) >= 0 for r in rows)
