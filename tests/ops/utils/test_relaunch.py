"""``pisa.ops.utils.relaunch``: after a first launch through ``kernel[grid]``, a ``Relaunch`` calls
the compiled kernel's launcher with the same arguments while the compiled code's assumptions hold,
and goes back through ``kernel[grid]`` when they do not (CPU: stand-ins for the kernel, its
compiled form and the driver; the real launches run in the decode GPU tests)."""
import pytest

pytest.importorskip("triton")
import torch  # noqa: E402
from triton import knobs  # noqa: E402

from pisa.ops.utils import relaunch  # noqa: E402

GRID = (2, 3, 4)
ARGS = (7, (1, 2), "SHAPE")


class _Compiled:
    """A compiled kernel: ``run`` is its launcher (grid, stream, handles, hooks, arguments)."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("fast", args))


class _Kernel:
    """``kernel[grid](*args, **options)``: records the launch, returns ``compiled`` (None under
    the interpreter)."""

    def __init__(self, interpreted=False):
        self.calls = []
        self.compiled = None if interpreted else _Compiled(self.calls)

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(("jit", grid, args, options))
            return self.compiled
        return launch


class _Driver:
    def __init__(self):
        self.device = 0
        self.active = self

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def driver(monkeypatch):
    d = _Driver()
    monkeypatch.setattr(relaunch, "driver", d)
    return d


def _tensors():
    x = torch.randn(64)
    return x, (torch.randn(8), x), torch.zeros(4, dtype=torch.int32)


def test_second_launch_calls_the_compiled_kernel(driver):
    kernel = _Kernel()
    launch = relaunch.Relaunch(kernel, GRID, ARGS, num_warps=8, num_stages=3)
    first, second = _tensors(), _tensors()
    launch(*first)
    launch(*second)
    assert kernel.calls[0] == ("jit", GRID, (*first, *ARGS), {"num_warps": 8, "num_stages": 3})
    kind, args = kernel.calls[1]
    assert kind == "fast"
    assert args[:9] == (*GRID, 1000, "function", "metadata", None, None, None)
    assert len(args) == 9 + 6 and all(a is b for a, b in zip(args[9:12], second))
    assert args[12:] == ARGS


@pytest.mark.parametrize("change", ["misaligned", "nested misaligned", "hook"])
def test_broken_assumption_goes_back_through_the_jit(driver, change, monkeypatch):
    kernel = _Kernel()
    launch = relaunch.Relaunch(kernel, GRID, ARGS)
    launch(*_tensors())
    x, pair, n = _tensors()
    with monkeypatch.context() as m:
        if change == "misaligned":  # a view 4 bytes in: Triton's 16-byte pointer hint fails
            x = x[1:]
        elif change == "nested misaligned":
            pair = (pair[0], pair[1][1:])
        else:
            m.setattr(knobs.runtime.launch_enter_hook, "calls", [print])
        launch(x, pair, n)
        launch(x, pair, n)
    assert [c[0] for c in kernel.calls] == ["jit"] * 3
    launch(*_tensors())  # the kernel compiled for aligned tensors is still the one kept
    assert kernel.calls[3][0] == "fast"


def test_another_device_goes_back_through_the_jit(driver):
    kernel = _Kernel()
    launch = relaunch.Relaunch(kernel, GRID, ARGS)
    launch(*_tensors())
    driver.device = 1
    launch(*_tensors())  # compiles (and keeps) for device 1
    launch(*_tensors())
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "fast"]
    assert kernel.calls[2][1][3] == 1001  # device 1's stream


def test_misaligned_first_launch_is_never_direct(driver):
    kernel = _Kernel()
    launch = relaunch.Relaunch(kernel, GRID, ARGS)
    x, pair, n = _tensors()
    launch(x[1:], pair, n)
    launch(*_tensors())  # an aligned launch after it compiles (and keeps) the aligned variant
    launch(*_tensors())
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "fast"]


def test_interpreter_launches_through_the_jit_every_time(driver):
    kernel = _Kernel(interpreted=True)
    launch = relaunch.Relaunch(kernel, GRID, ARGS)
    for _ in range(3):
        launch(*_tensors())
    assert [c[0] for c in kernel.calls] == ["jit"] * 3


def test_forget_compiled_sends_the_next_launch_through_the_jit(driver):
    kernel = _Kernel()
    launch = relaunch.Relaunch(kernel, GRID, ARGS)
    launch(*_tensors())
    relaunch.forget_compiled()
    launch(*_tensors())
    launch(*_tensors())
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "fast"]
