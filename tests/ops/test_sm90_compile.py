"""The kernels a decode step, the cache append and the compressed branch launch compile for
sm_90 (H100 / H200) on this CPU machine: Triton's compiler, which the interpreter-run tests never
reach (``tests/ops/sm90_compile.py``)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))  # compile, not a cache hit
    res = subprocess.run([sys.executable, "-m", "tests.ops.sm90_compile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    compiled = [line for line in res.stdout.splitlines() if "compiled for sm_90" in line]
    kernels = {line.split(": ")[1].split()[0] for line in compiled}
    assert kernels == {"_walk_kernel", "_attend_kernel", "_combine_kernel", "_append_kernel",
                       "_coarse_fwd_kernel", "_coarse_dq_kernel", "_coarse_dkv_kernel"}
    assert len(compiled) == 19
