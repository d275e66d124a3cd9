"""Every ```python block of README.md runs as written: each in a fresh interpreter, from an empty
folder, importing this checkout's pisa (the blocks assert their own results against references).
Bash blocks are not run: the CLI has its own tests."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Use, Inference, Hugging Face, Context parallelism: a block that drops out (or a new one) fails
# test_block_count until this number says so.
N_PYTHON_BLOCKS = 4
FENCE_RE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def code_blocks(text: str, language: str = "python") -> list[str]:
    """The bodies of the fenced blocks of ``language`` in markdown ``text``, in order."""
    return [body for lang, body in FENCE_RE.findall(text) if lang == language]


def _blocks() -> list[str]:
    return code_blocks((ROOT / "README.md").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_code_blocks_extracts_fenced_python_only():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```\nplain\n```\n```python\ny = 2\n```\n"
    assert code_blocks(text) == ["x = 1\n", "y = 2\n"]


def test_block_count():
    assert len(_blocks()) == N_PYTHON_BLOCKS


def _run(index: int, block: str, folder: Path) -> subprocess.CompletedProcess:
    """Run ``block`` as ``python3 readme_block_<index>.py`` in ``folder``, as a user would (no
    ``TRITON_INTERPRET``, which conftest sets for the kernels' tests), with this checkout's pisa,
    a free port for the CP block's process group and one torch thread (the blocks run side by
    side; two threads each on two cores spent twice the CPU time for the same wall time)."""
    script = folder / f"readme_block_{index}.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, script.name], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every block's run, started together: interpreter start-up and imports, single-threaded,
    are most of each block's time, so as many at once as there are cores cut the file's time."""
    blocks = _blocks()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        yield [pool.submit(_run, i, block, tmp_path_factory.mktemp(f"block{i}"))
               for i, block in enumerate(blocks)]


@pytest.mark.parametrize("index", range(N_PYTHON_BLOCKS))
def test_block_runs(index, runs):
    block = _blocks()[index]
    if "transformers" in block:
        pytest.importorskip("transformers", minversion="5.0")  # the `test` extra has it
    run = runs[index].result()
    assert run.returncode == 0, (f"README python block {index} exited {run.returncode}:\n"
                                 f"{block}\n--- stderr ---\n{run.stderr}")
