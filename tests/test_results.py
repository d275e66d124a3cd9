"""``pisa.results``: the result-row schema, run metadata and the JSON writer."""
import json
import re
import shutil
import subprocess

import pytest

import pisa
from pisa.results import default_device, git_commit, meta, result_row, write_result

FIELDS = ["op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype", "ms",
          "ms_min", "ms_max", "peak_gb", "recall", "mass"]


def test_result_row_has_the_schema_in_order_then_extra_columns():
    row = result_row("select", "pyramid", "torch", B=1, T=256, HQ=4, HKV=2, D=16, K=6, C=16, g=2,
                     W=None, dtype="float32", ms=1.5, splits=3)
    assert list(row) == FIELDS + ["splits"]
    assert row["ms"] == 1.5 and row["W"] is None and row["recall"] is None and row["splits"] == 3
    assert row["ms_min"] is None and row["ms_max"] is None, "a script timing one number"
    with pytest.raises(TypeError):
        result_row("select", "pyramid", "torch", B=1, T=256)  # every schema column is required


def test_meta_names_version_commit_device_versions_date_and_command():
    info = meta("cpu", "pisa bench --lengths 256", lengths=[256])
    assert set(info) == {"pisa", "commit", "device", "torch", "triton", "date", "command",
                         "lengths"}
    assert info["pisa"] == pisa.__version__ and info["commit"] == git_commit()
    assert info["device"].startswith("cpu") and info["command"] == "pisa bench --lengths 256"
    assert info["date"].endswith("+00:00"), "UTC"
    assert default_device() in ("cpu", "cuda")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_of_a_checkout_and_none_elsewhere(tmp_path, monkeypatch):
    commit = git_commit()  # this checkout, if the tests run from one
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    repo = tmp_path / "repo"
    (repo / "pisa").mkdir(parents=True)
    assert git_commit(repo) is None, "not a git checkout"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "pisa" / "x.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert git_commit(repo) == head
    (repo / "pisa" / "x.py").write_text("x = 2\n")
    assert git_commit(repo) == head + "+dirty"
    assert git_commit(repo / "pisa") is None, "inside a checkout, not its top"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert git_commit(repo) is None


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
