"""``pisa.ops.select.triton`` (the pyramid walk) through the public dispatch
``pisa.ops.select.select(..., "triton")``, against the fp64 oracle ``naive_select``.

Without CUDA the kernels run in the Triton interpreter on tiny fp32/fp16 shapes (the interpreter
mishandles bf16 dots); the GPU section runs bf16 at real shapes and is skipped without CUDA. Every
``torch.empty`` buffer starts poisoned (``poison_empty``), so an element a kernel forgets to write
shows up as a mismatch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pisa.ops.select import select
from pisa.ops.select.naive import naive_select
from pisa.ops.utils.geometry import cdiv
from tests.ops.conftest import INTERPRET, per_token_config
from tests.ops.select.common import assert_same, inputs, rows_equal

pytest.importorskip("triton")

import pisa.ops.select.triton as select_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_empty")


def _triton(q, k, cfg, pyramid=None):
    return select(q.to(DEVICE), k.to(DEVICE), cfg=cfg, backend="triton", pyramid=pyramid)


# (scorer, branching, beam, forced_in_budget, G, Tk, Tq, C, D, topk, HKV, B, dtype)
PYRAMID_CASES = [
    ("lse", 2, 2, True, 4, 127, 16, 4, 16, 6, 1, 1, torch.float32),
    ("lse", 4, 4, False, 1, 300, 12, 8, 32, 5, 1, 1, torch.float32),
    ("lse", 3, 3, True, 1, 100, 12, 4, 16, 6, 1, 1, torch.float32),
    ("lse", 2, 1000, True, 4, 127, 10, 4, 16, 6, 1, 1, torch.float32),  # beam >= leaves: flat
    ("lse", 2, 4, True, 4, 200, 12, 8, 32, 8, 1, 1, torch.float16),
    ("lse", 2, 4, False, 4, 300, 16, 16, 16, 8, 1, 1, torch.float32),
    ("lse", 2, 2, True, 2, 90, 8, 4, 16, 6, 2, 2, torch.float32),
    ("lse", 2, 16, True, 4, 33, 33, 4, 16, 16, 1, 1, torch.float32),
    ("lse", 2, 3, True, 1, 1, 1, 4, 16, 4, 1, 1, torch.float32),
    ("mean", 2, 4, True, 4, 65, 65, 4, 16, 6, 1, 1, torch.float32),
    ("mean", 4, 2, False, 1, 140, 10, 4, 16, 5, 1, 1, torch.float32),
    ("meanvar", 2, 3, True, 1, 63, 20, 4, 16, 6, 2, 1, torch.float32),
    ("meanvar", 4, 2, False, 4, 140, 10, 4, 32, 5, 1, 1, torch.float32),
    ("meanvar", 2, 1000, False, 4, 90, 12, 4, 16, 6, 1, 1, torch.float32),
]


@pytest.mark.parametrize("case", PYRAMID_CASES, ids=lambda c: "-".join(map(str, c[:12])))
def test_pyramid_select_matches_naive(case):
    scorer, g, W, in_budget, G, Tk, Tq, C, D, K, HKV, B, dtype = case
    cfg = per_token_config(block_size=C, topk=K, branching=g, beam=W, scorer=scorer,
                           selector="pyramid", forced_in_budget=in_budget, scale=D ** -0.5)
    q, k = inputs(B, Tk, Tq, HKV, G, D, dtype, seed=Tk + W)
    got = _triton(q, k, cfg)
    assert got[0].shape == (B, Tq, HKV, cfg.slots) and got[0].device.type == DEVICE
    assert_same(got, naive_select(q, k, cfg), f"pyramid {case}")


def test_deep_pyramid_and_leaf_chunks(monkeypatch):
    """Nine levels (Tk = 1024, C = 4): the walk skips the top levels (at most W causal nodes) and
    scores the rest. Then with leaf-stage chunks of 3 queries (``LEAF_CHUNK``, 1024 by default:
    longer prefills have several), whose groups straddle chunk borders: the same selection."""
    C, Tk, Tq, HKV = 4, 1024, 6, 1
    q, k = inputs(1, Tk, Tq, HKV, 2, 16, seed=8)
    cfg = per_token_config(block_size=C, topk=5, branching=2, beam=3, selector="pyramid", scale=0.3)
    want = naive_select(q, k, cfg)
    assert_same(_triton(q, k, cfg), want, "deep pyramid")
    monkeypatch.setattr(select_triton, "_LAUNCH",
                        dataclasses.replace(select_triton._LAUNCH, leaf_chunk=3))
    assert_same(_triton(q, k, cfg), want, "deep pyramid, 3-query leaf chunks")


@pytest.mark.parametrize("scorer", ["lse", "mean"])
def test_wide_beam_equals_flat(scorer):
    """A beam no level can overflow prunes nothing: the pyramid's leaf stage is the exact flat scan
    (flat_lse under the lse scorer). W = #level-2 nodes runs the walk kernel; W >= #blocks takes the
    flat kernel directly."""
    Tk, Tq, C, g = 110, 16, 4, 2
    q, k = inputs(1, Tk, Tq, 2, 4, 16, seed=3)
    flat = _triton(q, k, per_token_config(block_size=C, topk=7, selector="flat_lse", scale=0.25))
    for W in (cdiv(cdiv(Tk, C), g), cdiv(Tk, C)):
        cfg = per_token_config(block_size=C, topk=7, branching=g, beam=W, scorer=scorer,
                               selector="pyramid", scale=0.25)
        pyr = _triton(q, k, cfg)
        if scorer == "lse":
            assert_same(pyr, flat, f"beam={W} vs flat_lse")
        else:
            assert_same(pyr, naive_select(q, k, cfg), f"beam={W}, mean scorer")


def test_beam_too_wide_for_the_kernel():
    """Refused before any work: W = 300 needs 1024-wide candidate tiles, and the 1000 level-3
    nodes of 16000 keys at C = 4 do not cap it."""
    q, k = inputs(1, 4 * 4000, 1, 1, 1, 16)
    cfg = per_token_config(block_size=4, topk=4, branching=2, beam=300, scale=0.25)
    with pytest.raises(ValueError, match="too wide"):
        _triton(q, k, cfg)


# ------------------------------------------------------------------------------------------------
# GPU (bf16, real shapes)
# ------------------------------------------------------------------------------------------------

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(INTERPRET, reason="needs CUDA")(test))


@gpu
@pytest.mark.parametrize("scorer,g,in_budget,dtype", [
    ("lse", 2, True, torch.bfloat16), ("lse", 4, False, torch.bfloat16),
    ("mean", 2, True, torch.bfloat16), ("meanvar", 2, True, torch.bfloat16),
    ("lse", 3, True, torch.float32), ("lse", 2, True, torch.float16),
])
def test_gpu_select_matches_naive(scorer, g, in_budget, dtype):
    C, Tk, Tq, HKV, G, D = 64, 2000, 48, 2, 8, 128
    q, k = inputs(1, Tk, Tq, HKV, G, D, dtype, seed=1)
    cfg = per_token_config(block_size=C, topk=8, branching=g, beam=8, scorer=scorer,
                           selector="pyramid", forced_in_budget=in_budget, scale=D ** -0.5)
    assert_same(_triton(q, k, cfg), naive_select(q, k, cfg), f"gpu {scorer} g={g} {dtype}")


@gpu
def test_gpu_selection_at_16k_matches_fp32_torch_and_the_oracle():
    """The default training shapes (bf16, HQ=64, HKV=4, D=128, C=64, K=W=16) at 16K. Against the
    torch backend in fp32 on three windows of 256 query rows (a query's selection depends on its
    own prefix only, so a window selects against the keys up to its end), and against the fp64
    oracle on the last 4 rows. Both read the same bf16 values and score in fp32 (the walk's means
    to ~16 bits), so only near-ties at rounding level may differ."""
    T, HQ, HKV, D, rows = 16384, 64, 4, 128, 256
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, T, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, T, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    cfg = per_token_config(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    idx, cnt = select(q, k, cfg=cfg, backend="triton")
    assert bool((cnt == torch.clamp(torch.arange(T, device="cuda") // 64 + 1, max=16)[
        None, :, None]).all()), "every budget filled"
    for end in (3000, 9000, T):
        want = select(q[:, end - rows:end].float(), k[:, :end].float(), cfg=cfg, backend="torch")
        got = idx[:, end - rows:end], cnt[:, end - rows:end]
        assert torch.equal(got[1], want[1])
        same = rows_equal(got, want)
        assert same >= 0.99, f"window ending at {end}: {same:.4f} of the rows equal fp32 torch"
    want = naive_select(q[:, -4:].cpu(), k.cpu(), cfg)
    same = rows_equal((idx[:, -4:], cnt[:, -4:]), want)
    assert same >= 15 / 16, f"last rows: {same:.3f} equal the fp64 oracle"


@gpu
@pytest.mark.parametrize("branching", [3, 4])
def test_gpu_fp32_selection_other_branching_matches_torch(branching, rng):
    from pisa import pisa_select
    T, HKV, G, D = 8192, 2, 8, 128
    q = torch.randn(1, T, HKV * G, D, device="cuda")
    k = torch.randn(1, T, HKV, D, device="cuda")
    idx, counts = pisa_select(q, k, branching=branching, backend="triton")
    ref_idx, ref_counts = pisa_select(q, k, branching=branching, backend="torch")
    assert torch.equal(counts, ref_counts)
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same > 0.999, f"rows equal to the torch selection: {same:.5f}"
