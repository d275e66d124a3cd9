"""benchmarks/report/plot_quality.py on the committed SmolLM2 results: what it reads from the
files (checked against each file's own summary) and that it draws both figures."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "report" / "plot_quality.py"
RESULTS = REPO / "benchmarks" / "results"
RULER = [RESULTS / f"quality_ruler_smollm2_{name}.json"
         for name in ("forced", "generate_4k", "generate_8k")]
PPL = RESULTS / "quality_ppl_smollm2.json"


def _script():
    spec = importlib.util.spec_from_file_location("plot_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(paths):
    return [json.loads(p.read_text()) for p in paths]


def test_ruler_panels_match_each_files_summary():
    """Scores over every depth and the flagged tasks are those the run's own summary lists; the
    generate files of two lengths pool into two panels, each with the arms that finished."""
    panels = _script().ruler_panels(_read(RULER))
    assert set(panels) == {("forced", 4096), ("forced", 8192),
                           ("generate", 4096), ("generate", 8192)}
    assert list(panels)[:2] == [("forced", 4096), ("forced", 8192)]  # forced first
    for result in _read(RULER):
        mode = result["meta"]["mode"]
        for T, summary in result["meta"]["summary"].items():
            panel = panels[(mode, int(T))]
            assert panel["scores"] == summary["scores"]
            assert panel["too_hard"] == set(summary["too_hard_for_dense"])
            assert panel["tasks"][-1] == "average" and len(panel["tasks"]) == 9
    assert set(panels[("generate", 8192)]["scores"]) == {"dense", "pisa"}
    assert panels[("forced", 4096)]["scores"]["pisa"]["niah_single_2"] == 0.65


def test_ruler_flags_from_the_bar_when_the_meta_has_no_summary():
    pq = _script()
    rows = [{"op": "ruler", "mode": "forced", "T": 64, "depth": None, "impl": arm, "task": task,
             "value": value}
            for arm, task, value in (("dense", "a", 0.95), ("dense", "b", 0.5),
                                     ("dense", "average", 0.725), ("pisa", "a", 0.9))]
    panel = pq.ruler_panels([{"meta": {}, "rows": rows}])[("forced", 64)]
    assert panel["too_hard"] == {"b"} and panel["tasks"] == ["a", "b", "average"]


def test_ppl_panels_sort_buckets_and_split_out_the_whole_document():
    panels = _script().ppl_panels(_read([PPL]))
    assert list(panels) == [4096, 8192]
    p8 = panels[8192]
    assert p8["buckets"] == [(1, 1024)] + [(lo, lo + 1024) for lo in range(1024, 8192, 1024)]
    assert list(p8["ppl"]) == ["dense", "pisa", "flat_mean", "flat_lse"]
    assert p8["all"]["ppl"]["pisa"] == pytest.approx(6.454, abs=5e-4)
    assert p8["ppl_ratio"]["dense"] == [1.0] * 8
    # each bucket's ratio is its perplexity over dense's in the same bucket
    for arm in ("pisa", "flat_mean", "flat_lse"):
        for ppl, dense, ratio in zip(p8["ppl"][arm], p8["ppl"]["dense"], p8["ppl_ratio"][arm]):
            assert ratio == pytest.approx(ppl / dense, rel=1e-9)


@pytest.mark.parametrize("kind, paths", [("ruler", RULER), ("ppl", [PPL])])
def test_draws_each_figure(kind, paths, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"{kind}.png"
    subprocess.run([sys.executable, str(SCRIPT), kind, *map(str, paths), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < out.stat().st_size < 300_000


def test_help_works_without_matplotlib():
    """matplotlib is imported after the arguments are parsed."""
    proc = subprocess.run([sys.executable, "-c",
                           "import runpy, sys; sys.modules['matplotlib'] = None; "
                           "sys.argv = ['x', '--help']; "
                           f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ruler" in proc.stdout
