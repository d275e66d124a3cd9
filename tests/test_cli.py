import json

import pytest
import torch

import pisa
from pisa.cli import main

FIELDS = {"op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype", "ms",
          "peak_gb", "recall", "mass"}


def test_bench_prints_table_and_writes_schema(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "--device", "cpu", "--lengths", "256", "512", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "16", "--block-size", "16", "--topk", "6",
                 "--reps", "1", "--backward", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "sel pyr ms" in table and "| 512 |" in table
    result = json.loads(out.read_text())
    assert set(result["meta"]) == {"device", "torch", "triton", "date", "command"}
    rows = result["rows"]
    assert {(r["op"], r["impl"]) for r in rows} >= {
        ("select", "pyramid"), ("select", "flat_mean"), ("select", "flat_lse"), ("fwd", "pisa"),
        ("fwd", "dense"), ("fwdbwd", "pisa"), ("fwdbwd", "dense")}
    for r in rows:
        assert set(r) == FIELDS and r["ms"] > 0
        if r["op"] == "select":
            assert 0 <= r["recall"] <= 1 and 0 < r["mass"] <= 1


def test_bench_decode_adds_decode_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "--device", "cpu", "--lengths", "300", "--heads", "4", "--kv-heads",
                 "2", "--head-dim", "16", "--block-size", "16", "--topk", "6", "--reps", "1",
                 "--quality-max", "0", "--no-backward", "--decode", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "pisa dec ms" in table and "dense dec ms" in table
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
