"""Shared fixtures. Without CUDA, Triton kernels run under the interpreter: the variable must be
set before any ``@triton.jit`` module is imported, hence here."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter_for_numpy2():
    """Triton 3.6's interpreter holds scalars as 1-element arrays and calls int() on them for loop
    bounds, which NumPy >= 2.4 refuses; read the element instead."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    try:
        int(np.ones(1))
        return
    except TypeError:
        pass
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_for_numpy2()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Run torch on one CPU thread: the fp64 oracles' loops of tiny products take ~10x longer when
    two threads contend for two cores (naive_select over 300 queries: 7.1 s on 2 threads, 0.8 s
    on 1), and the other CPU tests are small. Restored after the session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rng():
    """A fresh, unseeded-by-test generator state each test: inputs differ run to run, and the seed
    is printed on failure so a failing draw can be replayed."""
    seed = torch.seed() % (2**31)
    torch.manual_seed(seed)
    yield seed


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA")
