"""Every ```python block of docs/training.md runs as written (each in a fresh interpreter, as
``tests/test_readme.py`` runs the README's)."""
from pathlib import Path

import pytest

from tests.test_readme import _run, code_blocks

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training.md"
# gated branches (layer, op), hybrid HF layers, dense warm-up
N_PYTHON_BLOCKS = 4


def _blocks():
    return code_blocks(PAGE.read_text())


def test_block_count():
    assert len(_blocks()) == N_PYTHON_BLOCKS


@pytest.mark.parametrize("index", range(N_PYTHON_BLOCKS))
def test_block_runs(index, tmp_path):
    block = _blocks()[index]
    if "transformers" in block:
        pytest.importorskip("transformers", minversion="5.0")
    run = _run(index, block, tmp_path)
    assert run.returncode == 0, f"block {index} exited {run.returncode}:\n{run.stderr}"
