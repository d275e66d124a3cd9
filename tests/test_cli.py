import json

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
