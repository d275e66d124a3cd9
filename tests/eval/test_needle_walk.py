import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality" / "needle_walk.py"


def _script():
    spec = importlib.util.spec_from_file_location("needle_walk", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hit_rates_separate_the_exact_scan_from_mean_pooling():
    nw = _script()
    gen = torch.Generator().manual_seed(0)
    # 32 blocks: beam 32 prunes nothing (= flat_lse); a needle of 8 logit units stands out of
    # any block for the exact scan, and weighs 8/64 (one noise std) in its block mean
    rates = nw.hit_rates(2048, 8.0, 40, [4, 32], gen, chunk=20)
    assert rates["flat_lse"] == 1.0 and rates["pisa v1 W=32"] == 1.0
    assert rates["flat_mean"] < 0.9 and rates["pisa v1 W=4"] < 1.0
    assert rates["pisa"] == 1.0  # the defaults' beam_leaf=32 keeps all 16 level-2 nodes
    no_needle = nw.hit_rates(2048, 0.0, 40, [32], gen, chunk=20)  # K = 16 of ~29 free blocks
    assert 0.3 < no_needle["flat_lse"] < 0.8


def test_markdown_has_a_row_per_length_and_margin():
    nw = _script()
    rows = [{"T": T, "z": z, "selector": s, "K": 16, "hit_rate": 0.5}
            for T in (4096, 8192) for z in (4.0, 8.0) for s in ("pisa W=16", "flat_lse")]
    lines = nw.markdown(rows).splitlines()
    assert lines[0] == "| T | z | pisa W=16 | flat_lse |" and len(lines) == 2 + 4
    assert lines[2] == "| 4096 | 4 | 0.50 | 0.50 |"
