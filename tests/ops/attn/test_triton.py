"""``pisa.ops.attn.triton`` through the public path ``pisa_attn(..., block_idx=...,
backend="triton")``, against the fp64 oracle ``naive_attn``: outputs, LSE and gradients.

Without CUDA the kernels run under the Triton interpreter on tiny fp32/fp16 shapes; the GPU section
checks bf16 at real sizes against an fp32 reference. Outputs start as NaN (``poison_outputs``).
The tile size follows the GQA group (``_tile_tokens``: 64 tokens at G = 1, 32 at G = 2, ... 2 at
G >= 32), so the cases below cover every tile width by their head counts.
"""
import dataclasses

import pytest
import torch

from pisa import pisa_attn
from pisa.ops.attn.naive import naive_attn, naive_dense_attn
from tests.ops.attn.common import (all_blocks, assert_matches_fp32_reference, compare_with_oracle,
                                   make_qkv, random_selection, rel_err)
from tests.ops.conftest import INTERPRET

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1 without CUDA

import pisa.ops.attn.triton as attn_triton  # noqa: E402
import pisa.ops.utils.config as config  # noqa: E402

needs_gpu = pytest.mark.skipif(INTERPRET, reason="needs CUDA")
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def attn(q, k, v, block_idx, C, scale, deterministic=False):
    return pisa_attn(q, k, v, block_idx=block_idx, block_size=C, scale=scale, return_lse=True,
                     deterministic=deterministic, backend="triton")


@pytest.fixture
def dkv_chunk(monkeypatch):
    """Set the most query tokens one dK/dV program takes (512 by default: a block chosen by more
    queries, the sink of any longer prefill, is split into chunks summed by atomics or, when
    deterministic, by the fixed-order reduce), so small inputs reach the split path."""
    def set_chunk(chunk):
        monkeypatch.setattr(attn_triton, "_LAUNCH",
                            dataclasses.replace(attn_triton._LAUNCH, dkv_chunk=chunk))
    return set_chunk


def run_and_compare(q, k, v, block_idx, C, scale, tol, lse_tol, *, reference=None,
                    deterministic=False, grad_lse=False):
    """Forward and backward of the kernel vs fp64 naive autograd; returns the kernel's tensors."""
    o, lse = attn(q, k, v, block_idx, C, scale, deterministic)
    ref = (lambda *x: naive_attn(*x, block_idx.cpu(), C, scale)) if reference is None else \
        (lambda *x: reference(*x, scale))
    return o, lse, compare_with_oracle(o, lse, q, k, v, ref, tol, lse_tol, grad_lse)


# (dtype, B, Tq, Tk, HQ, HKV, D, C, S, dkv_chunk, deterministic)
CASES = [
    (torch.float32, 2, 96, 96, 4, 1, 32, 16, 4, 512, False),   # G=4: 16-token tiles
    (torch.float32, 1, 37, 100, 2, 2, 16, 16, 5, 8, False),    # G=1, Tq < Tk, ragged, split
    (torch.float32, 1, 37, 100, 2, 2, 16, 16, 5, 8, True),     # same, deterministic reduce
    (torch.float32, 1, 130, 130, 8, 2, 64, 32, 3, 512, False),  # D=64, C=32
    (torch.float32, 1, 50, 77, 3, 1, 16, 16, 4, 16, False),    # G=3: heads padded to 4, split
    (torch.float32, 1, 40, 40, 32, 1, 16, 16, 3, 512, False),  # G=32: 2-token tiles, the fewest
    (torch.float32, 1, 80, 80, 4, 2, 16, 16, 4, 512, False),   # G=2: 32-token tiles, bit 31
    (torch.float32, 1, 90, 90, 1, 1, 16, 16, 4, 512, False),   # G=1: 64-token tiles, int64 bits
    (torch.float16, 1, 64, 80, 8, 2, 32, 16, 4, 512, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_matches_naive(case, rng, dkv_chunk):
    dtype, B, Tq, Tk, HQ, HKV, D, C, S, chunk, deterministic = case
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng)
    tol, lse_tol = (1e-5, 1e-4) if dtype == torch.float32 else (3e-3, 1e-2)
    dkv_chunk(chunk)
    run_and_compare(q, k, v, idx, C, D ** -0.5, tol, lse_tol, deterministic=deterministic)


def test_rows_with_fewer_blocks_and_empty_rows(rng):
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 48, 64, 4, 2, 16, 16, 5
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, min_blocks=1, seed=rng)
    idx[:, ::7, 0] = -1  # queries with no key at all
    o, lse, grads = run_and_compare(q, k, v, idx, C, 0.3, 1e-5, 1e-4)
    assert (o[:, ::7, :2] == 0).all() and torch.isneginf(lse[:, :2, ::7]).all()
    assert (grads[0][:, ::7, :2] == 0).all()


def test_all_blocks_equals_dense_causal(rng):
    B, Tq, Tk, HQ, HKV, D, C = 1, 45, 70, 4, 2, 32, 16
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    run_and_compare(q, k, v, all_blocks(B, Tq, Tk, HKV, C), C, 0.2, 1e-5, 1e-4,
                    reference=naive_dense_attn)


def test_lse_gradient(rng):
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 40, 40, 2, 1, 16, 16, 3
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng)
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4, grad_lse=True)


def test_arbitrary_selection_with_future_blocks(rng, monkeypatch):
    """Random picks among all blocks, future ones included: ``pisa_attn`` rejects them
    (``check_block_idx_values``); past that check, the kernels' causal mask still hides every
    future key."""
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 33, 65, 2, 2, 16, 16, 3
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, min_blocks=1, causal=False, seed=rng)
    monkeypatch.setattr(config, "check_block_idx_values", lambda *args: None)
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4)


def test_strided_inputs(rng):
    """q, k as views of one packed projection, v head-major: every tensor has its own strides."""
    B, T, HQ, HKV, D, C, S = 2, 40, 4, 2, 16, 16, 3
    g = torch.Generator().manual_seed(rng)
    dev = "cpu" if INTERPRET else "cuda"
    qk = torch.randn(B, T, HQ + HKV, D, generator=g).to(dev)
    q, k = qk[:, :, :HQ].requires_grad_(), qk[:, :, HQ:].requires_grad_()
    v = torch.randn(B, HKV, T, D, generator=g).to(dev).transpose(1, 2).requires_grad_()
    idx = random_selection(B, T, T, HKV, C, S, seed=rng)
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4)


def test_large_blocks_run_as_sub_blocks(rng):
    """C = 128, the largest Triton block size, runs as two 64-key tiles."""
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 20, 300, 2, 1, 16, 128, 2
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = torch.tensor([0, 1], dtype=torch.int32).expand(B, Tq, HKV, S).contiguous().to(q.device)
    idx[:, :3, :, 1] = -1
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4)


@pytest.mark.parametrize("chunk", [4, 512])
def test_deterministic_is_bitwise_repeatable(chunk, rng, dkv_chunk):
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 64, 64, 4, 1, 16, 16, 4
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng)
    dkv_chunk(chunk)
    g = torch.randn(B, Tq, HQ, D).to(q.device)
    runs = []
    for deterministic in (True, True, False):
        o, _ = attn(q, k, v, idx, C, 0.25, deterministic)
        runs.append(torch.autograd.grad(o, (q, k, v), g))
    for a, b, c in zip(*runs):
        assert torch.equal(a, b)
        assert rel_err(c, a) < 1e-6


def test_unsupported_sizes_raise():
    q, k, v = make_qkv(1, 16, 16, 2, 1, 48, torch.float32)
    idx = all_blocks(1, 16, 16, 1, 16)
    with pytest.raises(ValueError, match="head dims"):
        attn(q, k, v, idx, 16, 0.1)
    q, k, v = make_qkv(1, 16, 16, 2, 1, 16, torch.float32)
    for C in (8, 256):  # the Triton range is [16, 128]
        with pytest.raises(ValueError, match=r"block_size must be a power of two in \[16, 128\]"):
            attn(q, k, v, all_blocks(1, 16, 16, 1, C), C, 0.1)
    q, k, v = make_qkv(1, 16, 16, 65, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="up to 64 query heads per KV head"):
        attn(q, k, v, all_blocks(1, 16, 16, 1, 16), 16, 0.1)


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, bf16 / fp16 against an fp32 reference
# ----------------------------------------------------------------------------------------------
GPU_CASES = [  # (dtype, B, Tq, Tk, HQ, HKV, D, C, S)
    (torch.bfloat16, 1, 2048, 2048, 64, 4, 128, 64, 16),
    (torch.bfloat16, 2, 1500, 4000, 16, 4, 64, 64, 16),
    (torch.bfloat16, 1, 2048, 2048, 8, 8, 128, 128, 8),
    (torch.float16, 1, 1024, 1024, 32, 4, 128, 32, 32),
    (torch.float32, 1, 512, 700, 8, 2, 64, 64, 8),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_matches_fp32_reference(case, deterministic, rng):
    dtype, B, Tq, Tk, HQ, HKV, D, C, S = case
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=rng, device="cuda")
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device="cuda")
    o, lse = attn(q, k, v, idx, C, D ** -0.5, deterministic)
    assert_matches_fp32_reference(q, k, v, o, lse, idx, C, D ** -0.5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_deterministic_bitwise(rng, dkv_chunk):
    B, T, HQ, HKV, D, C, S = 1, 4096, 32, 4, 128, 64, 16
    q, k, v = make_qkv(B, T, T, HQ, HKV, D, torch.bfloat16, seed=rng, device="cuda")
    idx = random_selection(B, T, T, HKV, C, S, seed=rng, device="cuda")
    g = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    dkv_chunk(256)
    runs = []
    for _ in range(2):
        o, _ = attn(q, k, v, idx, C, None, deterministic=True)
        runs.append(torch.autograd.grad(o, (q, k, v), g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
