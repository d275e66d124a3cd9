"""Every ```python block of the guides in docs/ runs as written (each in a fresh interpreter, as
``tests/test_readme.py`` runs the README's)."""
from pathlib import Path

import pytest

from tests.test_readme import _run, code_blocks

DOCS = Path(__file__).resolve().parents[1] / "docs"
# page: its python blocks (training: gated branches (layer, op), hybrid HF layers, dense warm-up;
# serving: generate over PisaHFCache (eager, static), PisaGraphDecoder, the cache API)
PAGES = {"training.md": 4, "serving.md": 3}
BLOCKS = [(page, i) for page, n in PAGES.items() for i in range(n)]


def _blocks(page: str) -> list[str]:
    return code_blocks((DOCS / page).read_text())


@pytest.mark.parametrize("page", PAGES)
def test_block_count(page):
    assert len(_blocks(page)) == PAGES[page]


@pytest.mark.parametrize("page,index", BLOCKS)
def test_block_runs(page, index, tmp_path):
    block = _blocks(page)[index]
    if "transformers" in block:
        pytest.importorskip("transformers", minversion="5.0")
    run = _run(index, block, tmp_path)
    assert run.returncode == 0, f"{page} block {index} exited {run.returncode}:\n{run.stderr}"
