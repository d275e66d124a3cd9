"""``import pisa`` (``pisa/__init__.py``): quiet, and the public names."""
import os
import subprocess
import sys
from pathlib import Path

import pisa

ROOT = Path(__file__).resolve().parents[1]

# A torch-only install, simulated: NumPy cannot be imported (as there, "No module named 'numpy'").
NO_NUMPY = """
import sys

class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoNumpy())
import pisa
assert "numpy" not in sys.modules
"""


def test_import_without_numpy_is_silent():
    """torch without NumPy warns "Failed to initialize NumPy" when first imported; ``import
    pisa`` (which imports torch) must not print it: no warning even under ``-W error``."""
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run([sys.executable, "-W", "error", "-c", NO_NUMPY], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]


def test_public_names():
    assert set(pisa.__all__) == {"pisa_attn", "pisa_select", "pisa_attn_varlen",
                                 "pisa_select_varlen", "pisa_attn_with_kvcache", "PisaCache",
                                 "PagedPisaCache", "PisaAttention", "__version__"}
    assert all(hasattr(pisa, name) for name in pisa.__all__)
