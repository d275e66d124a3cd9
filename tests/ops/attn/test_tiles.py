"""Attention over selections by query tiles (``query_tile = Qt > 1``: a row per aligned tile of
``Qt`` absolute positions) in every backend, against the fp64 oracle on the per-token expansion
(``select.tiles_to_tokens``): outputs, LSE and the gradients of both.

Without CUDA the Triton kernels run under the interpreter on tiny fp32/fp16 shapes; outputs start
as NaN (``poison_outputs``). The GPU section checks bf16 at real sizes against an fp32 reference.
"""
import dataclasses
import importlib.util

import pytest
import torch

from pisa.ops.attn import sparse_attn
from pisa.ops.attn.naive import naive_attn, naive_dense_attn
from pisa.ops.select import tiles_to_tokens
from pisa.ops.utils.config import check_block_idx, n_query_tiles
from tests.ops.attn.common import (all_blocks, assert_matches_fp32_reference, compare_with_oracle,
                                   make_qkv, random_selection, rel_err)
from tests.ops.conftest import INTERPRET, per_token_config

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def per_token(idx, Tq, Tk, Qt):
    """The per-token expansion of a tile selection (the oracle's input)."""
    return tiles_to_tokens(idx, (idx >= 0).sum(-1, dtype=torch.int32), Tq, Tk, Qt)[0]


def device(backend):
    return DEV if backend == "triton" else "cpu"


@pytest.fixture
def triton_cfg(monkeypatch):
    """Replace Triton launch knobs (``AttnLaunch`` fields) for one test."""
    def set_cfg(**knobs):
        import pisa.ops.attn.triton as attn_triton
        monkeypatch.setattr(attn_triton, "_LAUNCH",
                            dataclasses.replace(attn_triton._LAUNCH, **knobs))
    return set_cfg


def run_and_compare(backend, q, k, v, idx, C, scale, Qt, tol, lse_tol, *, reference=None,
                    deterministic=False):
    """Forward and backward (with an lse gradient) of ``backend`` vs fp64 naive autograd on the
    per-token expansion; returns the backend's tensors."""
    Tq, Tk = q.shape[1], k.shape[1]
    o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=scale),
                         backend=backend, deterministic=deterministic, query_tile=Qt)
    rows = per_token(idx.cpu(), Tq, Tk, Qt)
    ref = (lambda *x: naive_attn(*x, rows, C, scale)) if reference is None else \
        (lambda *x: reference(*x, scale))
    return o, lse, compare_with_oracle(o, lse, q, k, v, ref, tol, lse_tol, grad_lse=True)


# (dtype, B, Tq, Tk, HQ, HKV, D, C, S, Qt, dkv_chunk, deterministic)
CASES = [
    (torch.float32, 1, 37, 100, 8, 2, 16, 16, 5, 1, 512, False),   # Qt=1: the per-token path
    (torch.float32, 1, 45, 78, 16, 1, 16, 16, 4, 2, 512, False),   # G=16, first tile partial
    (torch.float32, 2, 50, 50, 2, 2, 16, 16, 4, 4, 8, False),      # G=1: padded rows; split
    (torch.float32, 2, 50, 50, 2, 2, 16, 16, 4, 4, 8, True),       # same, deterministic reduce
    (torch.float32, 1, 33, 90, 4, 1, 64, 32, 3, 4, 512, False),    # D=64, C=32
    (torch.float32, 1, 70, 101, 8, 2, 16, 32, 4, 16, 512, False),  # Qt=16 G=4, 1-token 1st tile
    (torch.float32, 1, 40, 64, 16, 1, 16, 16, 3, 16, 16, False),   # 256 rows: 2 programs a tile
    (torch.float32, 1, 24, 40, 4, 1, 128, 16, 3, 8, 512, False),   # D=128
    (torch.float32, 1, 50, 77, 3, 1, 16, 16, 4, 2, 16, False),     # G=3: heads padded to 4
    (torch.float32, 1, 100, 300, 2, 1, 16, 128, 3, 64, 512, False),  # C=128: two sub-blocks
    (torch.float16, 1, 64, 80, 8, 2, 32, 16, 4, 4, 512, False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_tile_selection_matches_naive(backend, case, rng, triton_cfg):
    dtype, B, Tq, Tk, HQ, HKV, D, C, S, Qt, chunk, deterministic = case
    if backend == "torch" and dtype == torch.float16:
        dtype = torch.float32
    dev = device(backend)
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=rng, device=dev)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device=dev, query_tile=Qt)
    assert idx.shape[1] == n_query_tiles(Tq, Tk, Qt)
    tol, lse_tol = (1e-5, 1e-4) if dtype == torch.float32 else (3e-3, 1e-2)
    if backend == "triton":
        triton_cfg(dkv_chunk=chunk)
    run_and_compare(backend, q, k, v, idx, C, D ** -0.5, Qt, tol, lse_tol,
                    deterministic=deterministic)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("knobs", [dict(tile_fwd_rows=32, tile_dq_rows=32, tile_dkv_rows=16),
                                   dict(tile_min_rows=64, tile_dkv_rows=128)])
def test_triton_row_budgets(knobs, rng, triton_cfg):
    """Smaller and larger row budgets: tiles split over 2-8 programs (some with no real query),
    or padded to 64 rows; dK/dV steps of one tile part or of 8 whole tiles."""
    B, Tq, Tk, HQ, HKV, D, C, S, Qt = 1, 40, 57, 4, 1, 16, 16, 3, 16
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng, device=DEV)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device=DEV, query_tile=Qt)
    triton_cfg(**knobs)
    run_and_compare("triton", q, k, v, idx, C, 0.25, Qt, 1e-5, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_blocks_equal_dense_causal(backend, rng):
    B, Tq, Tk, HQ, HKV, D, C, Qt = 1, 45, 70, 4, 2, 32, 16, 4
    dev = device(backend)
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng, device=dev)
    idx = all_blocks(B, Tq, Tk, HKV, C, device=dev, query_tile=Qt)
    run_and_compare(backend, q, k, v, idx, C, 0.2, Qt, 1e-5, 1e-4, reference=naive_dense_attn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_few_blocks_and_empty_tiles(backend, rng):
    """Tiles with one block, or none (their queries: o = 0, lse = -inf, zero dq)."""
    B, Tq, Tk, HQ, HKV, D, C, S, Qt = 1, 46, 64, 4, 2, 16, 16, 5, 4
    dev = device(backend)
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng, device=dev)
    idx = random_selection(B, Tq, Tk, HKV, C, S, min_blocks=1, seed=rng, device=dev,
                           query_tile=Qt)
    idx[:, ::3, 0] = -1  # tiles of KV head 0 with no key at all
    o, lse, grads = run_and_compare(backend, q, k, v, idx, C, 0.3, Qt, 1e-5, 1e-4)
    empty = per_token(idx.cpu(), Tq, Tk, Qt)[0, :, 0, 0] < 0  # tokens of the empty tiles
    assert empty.any()
    assert (o[:, empty.to(o.device), :2] == 0).all()
    assert torch.isneginf(lse[:, :2, empty.to(o.device)]).all()
    assert (grads[0][:, empty.to(o.device), :2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_arbitrary_selection_with_future_blocks(backend, rng):
    """Random picks among all blocks, future ones included (a caller's selection past the checks):
    every block that ends after a tile's first position gets the causal mask."""
    B, Tq, Tk, HQ, HKV, D, C, S, Qt = 1, 33, 65, 2, 2, 16, 16, 3, 8
    dev = device(backend)
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng, device=dev)
    idx = random_selection(B, Tq, Tk, HKV, C, S, min_blocks=1, causal=False, seed=rng,
                           device=dev, query_tile=Qt)
    run_and_compare(backend, q, k, v, idx, C, 0.25, Qt, 1e-5, 1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("chunk", [4, 512])
def test_deterministic_is_bitwise_repeatable(chunk, rng, triton_cfg):
    """``dkv_chunk=4`` with 2-token tiles: 2 tiles a chunk, the sink block's list in many chunks
    (the straggler split), reduced in a fixed order."""
    B, Tq, Tk, HQ, HKV, D, C, S, Qt = 1, 64, 64, 4, 1, 16, 16, 4, 2
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng, device=DEV)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device=DEV, query_tile=Qt)
    triton_cfg(dkv_chunk=chunk)
    g = torch.randn(B, Tq, HQ, D).to(DEV)
    runs = []
    for deterministic in (True, True, False):
        o, _ = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=0.25),
                           backend="triton", deterministic=deterministic, query_tile=Qt)
        runs.append(torch.autograd.grad(o, (q, k, v), g))
    for a, b, c in zip(*runs):
        assert torch.equal(a, b)
        assert rel_err(c, a) < 1e-6


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tile_plans():
    """Rows per program: whole tiles in [tile_min_rows, rows], split above, padded below; dK/dV
    steps of ``tile_dkv_rows`` rows and chunks of about ``dkv_chunk`` tokens."""
    from pisa.ops.attn.triton import _LAUNCH, _dkv_plan, _tile_part
    from pisa.ops.utils.launch import AttnLaunch
    assert _tile_part(16, 16, 128, 32, 128) == (8, 2)    # 256 rows: two programs of 128
    assert _tile_part(16, 4, 128, 32, 128) == (16, 1)    # 64 rows
    assert _tile_part(2, 1, 128, 32, 128) == (32, 1)     # 2 rows padded to 32
    assert _tile_part(64, 64, 128, 32, 128) == (2, 32)   # at least 2 tokens a program
    assert _tile_part(16, 16, 128, 32, 256) == (4, 4)    # D=256 halves the rows
    # the H200-tuned defaults: 32-row dK/dV steps, chunks of 2048 tokens
    assert (_LAUNCH.dkv_rows, _LAUNCH.tile_dkv_rows, _LAUNCH.dkv_chunk) == (32, 32, 2048)
    assert _dkv_plan(16, 16, _LAUNCH) == (2, 1, 128)        # a tile over 8 steps
    assert _dkv_plan(2, 4, _LAUNCH) == (2, 4, 1024)         # 4 tiles a step
    assert _dkv_plan(64, 16, _LAUNCH) == (2, 1, 32)         # 32 rows: 2 tokens of G=16 a step
    assert _dkv_plan(1, 16, _LAUNCH) == (1, 2, 2048)        # per token: 2 tokens (the minimum)
    assert _dkv_plan(1, 4, _LAUNCH) == (1, 8, 2048)         # per token: 32 rows
    # the same rules at 64-row steps and 512-token chunks
    big = AttnLaunch(dkv_rows=64, tile_dkv_rows=64, dkv_chunk=512)
    assert _dkv_plan(16, 16, big) == (4, 1, 32)          # a tile over 4 steps
    assert _dkv_plan(2, 4, big) == (2, 8, 256)           # 8 tiles a step
    assert _dkv_plan(1, 16, big) == (1, 4, 512)          # per token


def test_row_count_is_checked_and_fake_kernel_gives_the_layout():
    q = torch.zeros(1, 10, 4, 16)
    k = torch.zeros(1, 30, 2, 16)
    with pytest.raises(ValueError, match="n_query_tiles"):
        sparse_attn(q, k, k, torch.zeros(1, 10, 2, 3, dtype=torch.int32),
                    cfg=per_token_config(block_size=8, scale=0.25), backend="torch", query_tile=4)
    rows = n_query_tiles(10, 30, 4)  # positions 20..29: tiles 5, 6, 7
    assert rows == 3
    q, k = q.to("meta"), k.to("meta")
    idx = torch.empty(1, rows, 2, 3, dtype=torch.int32, device="meta")
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        o, lse = sparse_attn(q, k, k, idx, cfg=per_token_config(block_size=8, scale=0.25),
                             backend="torch", query_tile=4)
    assert o.shape == q.shape and lse.shape == (1, 4, 10) and lse.dtype == torch.float32


def test_check_block_idx_of_tiles():
    B, Tq, Tk, HKV, C, S, Qt = 1, 21, 50, 2, 8, 4, 4  # positions 29..49: tiles 7..12
    q, k = torch.zeros(B, Tq, 4, 16), torch.zeros(B, Tk, HKV, 16)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=0, device="cpu", query_tile=Qt)
    check_block_idx(idx, q, k, C, Qt)
    check_block_idx(random_selection(B, Tq, Tk, HKV, C, S, device="cpu"), q, k, C, 1)
    with pytest.raises(ValueError, match="n_query_tiles"):
        check_block_idx(idx[:, 1:], q, k, C, Qt)
    with pytest.raises(TypeError, match="int32"):
        check_block_idx(idx.long(), q, k, C, Qt)
    bad = idx.clone()
    bad[0, 0, 1, 0] = 4  # tile 0 starts at position 28, in block 3
    with pytest.raises(ValueError, match=r"block_idx\[0, 0, 1\].*tile 0 of 4.*ids <= 3"):
        check_block_idx(bad, q, k, C, Qt)
    bad = idx.clone()
    bad[0, 2, 0, :2] = torch.tensor([2, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_idx\[0, 2, 0\]"):
        check_block_idx(bad, q, k, C, Qt)


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, bf16 against an fp32 reference
# ----------------------------------------------------------------------------------------------
GPU_CASES = [  # (dtype, B, Tq, Tk, HQ, HKV, D, C, S, Qt)
    (torch.bfloat16, 1, 4096, 4096, 64, 4, 128, 64, 16, 16),   # the target configuration
    (torch.bfloat16, 1, 2048, 2048, 64, 4, 128, 64, 16, 64),
    (torch.bfloat16, 2, 1500, 4000, 16, 4, 64, 64, 16, 2),     # first tile partial
    (torch.bfloat16, 1, 2048, 2048, 8, 8, 128, 128, 8, 32),    # C=128: sub-blocks
    (torch.float16, 1, 1024, 1024, 32, 4, 128, 32, 32, 8),
    (torch.float32, 1, 512, 700, 8, 2, 64, 64, 8, 16),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x) for x in c))
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_tiles_match_fp32_reference(case, deterministic, rng):
    dtype, B, Tq, Tk, HQ, HKV, D, C, S, Qt = case
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=rng, device="cuda")
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device="cuda", query_tile=Qt)
    o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=D ** -0.5),
                         backend="triton", deterministic=deterministic, query_tile=Qt)
    assert_matches_fp32_reference(q, k, v, o, lse, per_token(idx, Tq, Tk, Qt), C, D ** -0.5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_tiles_equal_the_per_token_path(rng):
    """The tile kernels and the per-token kernels on the expanded selection agree (bf16)."""
    B, T, HQ, HKV, D, C, S, Qt = 1, 4096, 64, 4, 128, 64, 16, 16
    q, k, v = make_qkv(B, T, T, HQ, HKV, D, torch.bfloat16, seed=rng, device="cuda")
    idx = random_selection(B, T, T, HKV, C, S, seed=rng, device="cuda", query_tile=Qt)
    g = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    outs = []
    for sel, qt in ((idx, Qt), (per_token(idx, T, T, Qt).contiguous(), 1)):
        o, lse = sparse_attn(q, k, v, sel, cfg=per_token_config(block_size=C, scale=D ** -0.5),
                             backend="triton", query_tile=qt)
        outs.append((o, lse) + torch.autograd.grad(o, (q, k, v), g))
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_gpu_tiles_deterministic_bitwise(rng, triton_cfg):
    B, T, HQ, HKV, D, C, S, Qt = 1, 4096, 64, 4, 128, 64, 16, 16
    q, k, v = make_qkv(B, T, T, HQ, HKV, D, torch.bfloat16, seed=rng, device="cuda")
    idx = random_selection(B, T, T, HKV, C, S, seed=rng, device="cuda", query_tile=Qt)
    g = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    triton_cfg(dkv_chunk=256)
    runs = []
    for _ in range(2):
        o, _ = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=D ** -0.5),
                           backend="triton", deterministic=True, query_tile=Qt)
        runs.append(torch.autograd.grad(o, (q, k, v), g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_gpu
def test_gpu_tile_lengths_compile_nothing(rng):
    """Lengths are runtime values in the tile kernels too: after one call, forward+backward at
    lengths of every divisibility compile no new variant."""
    from pisa.bench import triton_variants

    def call(Tq, Tk):
        B, HQ, HKV, D, C, S, Qt = 2, 16, 4, 64, 64, 8, 16
        q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.bfloat16, seed=rng, device="cuda")
        idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device="cuda", query_tile=Qt)
        o, _ = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=D ** -0.5),
                           backend="triton", query_tile=Qt)
        o.sum().backward()
        torch.cuda.synchronize()

    call(4096, 4096)
    n = triton_variants()
    for Tq, Tk in ((4160, 4160), (4500, 4500), (1001, 8193), (7777, 7777)):
        call(Tq, Tk)
        assert triton_variants() == n, f"Tq={Tq}, Tk={Tk} compiled new variants"
