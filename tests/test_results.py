"""``pisa.results``: the result-row schema, run metadata and the JSON writer."""
import json

import pytest

from pisa.results import default_device, meta, result_row, write_result

FIELDS = ["op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype", "ms",
          "peak_gb", "recall", "mass"]


def test_result_row_has_the_schema_in_order_then_extra_columns():
    row = result_row("select", "pyramid", "torch", B=1, T=256, HQ=4, HKV=2, D=16, K=6, C=16, g=2,
                     W=None, dtype="float32", ms=1.5, splits=3)
    assert list(row) == FIELDS + ["splits"]
    assert row["ms"] == 1.5 and row["W"] is None and row["recall"] is None and row["splits"] == 3
    with pytest.raises(TypeError):
        result_row("select", "pyramid", "torch", B=1, T=256)  # every schema column is required


def test_meta_names_device_versions_date_and_command():
    info = meta("cpu", "pisa bench --lengths 256", lengths=[256])
    assert set(info) == {"device", "torch", "triton", "date", "command", "lengths"}
    assert info["device"].startswith("cpu") and info["command"] == "pisa bench --lengths 256"
    assert info["date"].endswith("+00:00"), "UTC"
    assert default_device() in ("cpu", "cuda")


def test_write_result_replaces_the_file_whole(tmp_path):
    path = tmp_path / "r.json"
    write_result(path, {"a": 1}, [{"x": 1}], extra_rows=[])
    assert json.loads(path.read_text()) == {"meta": {"a": 1}, "rows": [{"x": 1}],
                                            "extra_rows": []}
    write_result(str(path), {"a": 2}, [])
    assert json.loads(path.read_text()) == {"meta": {"a": 2}, "rows": []}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "no temporary file left"
    write_result(None, {"a": 3}, [])  # no path: nothing written
    write_result("", {"a": 3}, [])
    assert json.loads(path.read_text())["meta"] == {"a": 2}
