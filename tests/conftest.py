"""Shared fixtures. Without CUDA, Triton kernels run under the interpreter: the variable must be
set before any ``@triton.jit`` module is imported, hence here."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pisa.ops.utils.interpreter import patch_interpreter  # noqa: E402 (after the variable)

patch_interpreter()  # the library's NumPy >= 2.4 shim (pisa.ops.utils.op applies it too)


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
