"""``pisa.ops.utils.interpreter``: Triton's CPU interpreter works outside pytest too."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Tiny fp32 shapes (T = 80, C = 16, K = W = 3: five leaves, so the pyramid walk runs): forward and
# backward of the Triton backend against the torch one, in a fresh interpreter without conftest.
SCRIPT = """
import torch
from pisa import pisa_attn, pisa_select
torch.manual_seed(0)
q, k, v = (torch.randn(1, 80, h, 16, requires_grad=True) for h in (2, 1, 1))
kw = dict(block_size=16, topk=3, beam=3)
idx_t, _ = pisa_select(q.detach(), k.detach(), backend="triton", **kw)
idx_c, _ = pisa_select(q.detach(), k.detach(), backend="torch", **kw)
assert torch.equal(idx_t, idx_c), (idx_t, idx_c)
o_t = pisa_attn(q, k, v, backend="triton", **kw)
g_t = torch.autograd.grad(o_t.square().sum(), (q, k, v))
o_c = pisa_attn(q, k, v, backend="torch", **kw)
g_c = torch.autograd.grad(o_c.square().sum(), (q, k, v))
torch.testing.assert_close(o_t, o_c, rtol=1e-4, atol=1e-4)
for a, b in zip(g_t, g_c):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_triton_interpret_works_outside_pytest():
    """``TRITON_INTERPRET=1 python -c ...``: the library applies its own NumPy >= 2.4 shim (it
    lived only in tests/conftest.py)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_patch_is_idempotent():
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    from pisa.ops.utils.interpreter import patch_interpreter_for_numpy2
    first = patch_interpreter_for_numpy2()
    patched = interpreter._patch_lang_tensor
    assert patch_interpreter_for_numpy2() == first
    assert interpreter._patch_lang_tensor is patched  # not wrapped twice
