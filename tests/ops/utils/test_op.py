"""``pisa.ops.utils.op``: the shared Triton primitives (packed keys, the online-softmax step)
and the launch helpers (poisoned allocations, cached device offsets)."""
import math

import pytest
import torch

from tests.ops.conftest import INTERPRET

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pisa.ops.utils import op  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.usefixtures("fast_interpreter")


@triton.jit
def _pack_kernel(p_s, p_key, p_idx, N: tl.constexpr):
    o = tl.arange(0, N)
    b_key = op.pack(tl.load(p_s + o), o)
    tl.store(p_key + o, b_key)
    tl.store(p_idx + o, op.unpack_idx(b_key))


def test_packed_keys_order_by_score_then_lower_index():
    """One integer comparison is the oracle's rule: higher score first, ties to the lower index;
    the index comes back out."""
    s = torch.tensor([0.5, -1.0, 0.5, 3.0, -0.0, 0.0, -math.inf, 2e-30, -2e-30, 0.5, 7.0, -7.0,
                      1e30, -1e30, 3.0, 1.0], device=DEVICE)
    key = torch.empty(16, dtype=torch.int64, device=DEVICE)
    idx = torch.empty(16, dtype=torch.int32, device=DEVICE)
    _pack_kernel[(1,)](s, key, idx, N=16)
    assert idx.tolist() == list(range(16))
    got = torch.argsort(key.cpu(), descending=True).tolist()
    want = sorted(range(16), key=lambda i: (-float(s[i]), i))
    # -0.0 and 0.0 are equal scores to the oracle but differ in bits: only their order may swap
    swap = {4: 5, 5: 4}
    assert [swap.get(i, i) for i in got] in (want, [swap.get(i, i) for i in want])
    assert int(key.min()) > op.KEY_NONE.value, "no real score packs to the empty key"


@triton.jit
def _softmax_kernel(p_s, p_v, p_o, p_lse, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                    TILES: tl.constexpr):
    o_m, o_n, o_d = tl.arange(0, M), tl.arange(0, N), tl.arange(0, D)
    b_m = tl.full([M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([M], dtype=tl.float32)
    b_acc = tl.zeros([M, D], dtype=tl.float32)
    for t in tl.static_range(TILES):
        b_s = tl.load(p_s + o_m[:, None] * (N * TILES) + t * N + o_n[None, :])
        b_v = tl.load(p_v + (t * N + o_n)[:, None] * D + o_d[None, :])
        b_m, b_l, b_acc = op.online_softmax_step(b_s * op.LOG2E_K, b_v, b_m, b_l, b_acc, "ieee")
    b_o, b_lse = op.softmax_output(b_m, b_l, b_acc)
    tl.store(p_o + o_m[:, None] * D + o_d[None, :], b_o)
    tl.store(p_lse + o_m, b_lse)


def test_online_softmax_over_tiles_equals_softmax():
    """Three key tiles folded one at a time give softmax attention and its LSE; a row that sees
    no key (all -inf) gives o = 0 and lse = -inf, not NaN."""
    M, N, D, tiles = 16, 16, 16, 3
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(M, N * tiles, generator=gen) * 3
    s[2, :N] = -math.inf  # the first tile masked: the running max starts at -inf
    s[5] = -math.inf  # no key at all
    v = torch.randn(N * tiles, D, generator=gen)
    o = torch.empty(M, D, device=DEVICE)
    lse = torch.empty(M, device=DEVICE)
    _softmax_kernel[(1,)](s.to(DEVICE), v.to(DEVICE), o, lse, M=M, N=N, D=D, TILES=tiles)
    want_lse = torch.logsumexp(s, -1)
    want_o = torch.softmax(s, -1).nan_to_num(0.0) @ v
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.cpu(), want_o, rtol=1e-5, atol=1e-5)
    assert bool((o[5] == 0).all()) and lse[5].item() == -math.inf


def test_empty_is_poisoned_on_request(monkeypatch):
    monkeypatch.delenv("PISA_TRITON_POISON", raising=False)
    assert not op.poisoned()
    monkeypatch.setenv("PISA_TRITON_POISON", "1")
    assert op.poisoned()
    assert torch.isnan(op.empty(3, 2, dtype=torch.float32, device="cpu")).all()
    assert (op.empty(4, dtype=torch.int32, device="cpu") == -7).all()
    monkeypatch.setenv("PISA_TRITON_POISON", "0")
    assert not op.poisoned()


def test_device_offsets_are_made_once_per_geometry():
    a = op.device_offsets((0, 5, 8, 10, 11), torch.device("cpu"))
    assert a.dtype == torch.int32 and a.tolist() == [0, 5, 8, 10, 11]
    assert op.device_offsets((0, 5, 8, 10, 11), torch.device("cpu")) is a
