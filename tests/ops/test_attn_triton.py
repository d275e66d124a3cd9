"""Triton sparse attention against the fp64 oracle ``naive_attn``.

Without CUDA the kernels run under the Triton interpreter on tiny fp32/fp16 shapes; the GPU section
checks bf16 at real sizes against an fp32 PyTorch reference.
"""
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1 without CUDA

from pisa.ops.attn_triton import (  # noqa: E402
    KernelConfig, _transpose_selection, sparse_attn_triton)
from pisa.ops.naive import naive_attn, naive_dense_attn  # noqa: E402
from pisa.ops.utils import cdiv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(INTERPRET, reason="needs CUDA")


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Outputs start as NaN, so a match with the oracle proves every element was written."""
    monkeypatch.setenv("PISA_TRITON_POISON", "1")


def random_selection(B, Tq, Tk, H, C, S, *, min_blocks=3, causal=True, seed=0, device=DEVICE):
    """Ascending, -1 padded, unique block lists: forced sink / previous / current blocks first, then
    random past blocks; each row keeps a random count in [min_blocks, S]."""
    g = torch.Generator().manual_seed(seed)
    nb = cdiv(Tk, C)
    cur = ((Tk - Tq + torch.arange(Tq)) // C)[None, :, None, None]
    blocks = torch.arange(nb)
    score = torch.rand(B, Tq, H, nb, generator=g)
    if causal:
        forced = (blocks == 0) | (blocks == cur - 1) | (blocks == cur)
        score = torch.where(forced, 2.0, score).masked_fill(blocks > cur, -math.inf)
    top_s, top_i = score.topk(min(S, nb), dim=-1)
    n = torch.randint(min_blocks, S + 1, (B, Tq, H, 1), generator=g)
    keep = (top_s > -math.inf) & (torch.arange(top_i.shape[-1]) < n)
    idx = torch.where(keep, top_i, nb).sort(-1).values
    idx = torch.nn.functional.pad(idx, (0, S - idx.shape[-1]), value=nb)
    return torch.where(idx == nb, -1, idx).to(torch.int32).to(device)


def all_blocks(B, Tq, Tk, H, C, device=DEVICE):
    nb = cdiv(Tk, C)
    cur = ((Tk - Tq + torch.arange(Tq)) // C)[:, None]
    idx = torch.where(torch.arange(nb) <= cur, torch.arange(nb), -1)
    return idx[None, :, None, :].expand(B, Tq, H, nb).to(torch.int32).contiguous().to(device)


def make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, HQ, D, generator=g)
    k = torch.randn(B, Tk, HKV, D, generator=g)
    v = torch.randn(B, Tk, HKV, D, generator=g)
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]


def rel_err(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_lse(lse, ref, tol):
    lse, ref = lse.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.isfinite(lse[finite]).all()
    assert (lse[finite] - ref[finite]).abs().max().item() < tol


def run_and_compare(q, k, v, block_idx, C, scale, tol, lse_tol, *, reference=None,
                    deterministic=False, config=None, grad_lse=False):
    """Forward and backward of the kernel vs fp64 naive autograd; returns the kernel's tensors."""
    o, lse = sparse_attn_triton(q, k, v, block_idx, C, scale, deterministic, config)
    ref_in = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    if reference is None:
        ro, rlse = naive_attn(*ref_in, block_idx.cpu(), C, scale)
    else:
        ro, rlse = reference(*ref_in, scale)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32
    assert not o.isnan().any() and not lse.isnan().any()
    assert rel_err(o, ro) < tol
    check_lse(lse, rlse, lse_tol)

    g = torch.randn_like(o)
    loss = (o.float() * g.float()).sum()
    rloss = (ro * g.double().cpu()).sum()
    if grad_lse:
        w = torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0)
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0) * w).sum()
        rloss = rloss + (rlse.masked_fill(torch.isneginf(rlse), 0) * w.double().cpu()).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    rgrads = torch.autograd.grad(rloss, ref_in)
    for name, x, r in zip("qkv", grads, rgrads):
        assert x.dtype == q.dtype and not x.isnan().any(), name
        assert rel_err(x, r) < tol * 4, (name, rel_err(x, r))
    return o, lse, grads


# (dtype, B, Tq, Tk, HQ, HKV, D, C, S, rows, dkv_chunk, deterministic)
CASES = [
    (torch.float32, 2, 96, 96, 4, 1, 32, 16, 4, 16, 512, False),   # G=4, 4-token tiles
    (torch.float32, 1, 37, 100, 2, 2, 16, 16, 5, 16, 8, False),    # G=1, Tq < Tk, ragged, split
    (torch.float32, 1, 37, 100, 2, 2, 16, 16, 5, 16, 8, True),     # same, deterministic reduce
    (torch.float32, 1, 130, 130, 8, 2, 64, 32, 3, 64, 512, False),  # D=64, C=32, 16-token tiles
    (torch.float32, 1, 50, 77, 3, 1, 16, 16, 4, 16, 16, False),    # G=3: heads padded to 4
    (torch.float32, 1, 64, 64, 4, 1, 16, 16, 4, 4, 512, False),    # 16 rows: per-token tiles
    (torch.float32, 1, 80, 80, 2, 2, 16, 16, 4, 32, 512, False),   # 32-token tiles: bit 31
    (torch.float32, 1, 90, 90, 1, 1, 16, 16, 4, 64, 512, False),   # 64-token tiles: int64 bits
    (torch.float16, 1, 64, 80, 8, 2, 32, 16, 4, 16, 512, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_matches_naive(case, rng):
    dtype, B, Tq, Tk, HQ, HKV, D, C, S, rows, chunk, deterministic = case
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng)
    tol, lse_tol = (1e-5, 1e-4) if dtype == torch.float32 else (3e-3, 1e-2)
    cfg = KernelConfig(fwd_rows=rows, dq_rows=rows, dkv_rows=rows, dkv_chunk=chunk)
    run_and_compare(q, k, v, idx, C, D ** -0.5, tol, lse_tol, config=cfg,
                    deterministic=deterministic)


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


def test_arbitrary_selection_with_future_blocks(rng):
    """Random picks among all blocks, future ones included: causality still masks every key."""
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 33, 65, 2, 2, 16, 16, 3
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, min_blocks=1, causal=False, seed=rng)
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4)


def test_strided_inputs(rng):
    """q, k as views of one packed projection, v head-major: every tensor has its own strides."""
    B, T, HQ, HKV, D, C, S = 2, 40, 4, 2, 16, 16, 3
    g = torch.Generator().manual_seed(rng)
    qk = torch.randn(B, T, HQ + HKV, D, generator=g).to(DEVICE)
    q, k = qk[:, :, :HQ].requires_grad_(), qk[:, :, HQ:].requires_grad_()
    v = torch.randn(B, HKV, T, D, generator=g).to(DEVICE).transpose(1, 2).requires_grad_()
    idx = random_selection(B, T, T, HKV, C, S, seed=rng)
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4)


def test_large_blocks_run_as_sub_blocks(rng):
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 20, 300, 2, 1, 16, 256, 2
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = torch.tensor([0, 1], dtype=torch.int32).expand(B, Tq, HKV, S).contiguous().to(DEVICE)
    idx[:, :3, :, 1] = -1
    run_and_compare(q, k, v, idx, C, 0.25, 1e-5, 1e-4)


@pytest.mark.parametrize("chunk", [4, 512])
def test_deterministic_is_bitwise_repeatable(chunk, rng):
    B, Tq, Tk, HQ, HKV, D, C, S = 1, 64, 64, 4, 1, 16, 16, 4
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, torch.float32, seed=rng)
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng)
    cfg = KernelConfig(dkv_chunk=chunk)
    g = torch.randn(B, Tq, HQ, D).to(DEVICE)
    runs = []
    for deterministic in (True, True, False):
        o, _ = sparse_attn_triton(q, k, v, idx, C, 0.25, deterministic, cfg)
        runs.append(torch.autograd.grad(o, (q, k, v), g))
    for a, b, c in zip(*runs):
        assert torch.equal(a, b)
        assert rel_err(c, a) < 1e-6


def test_transpose_selection_lists(rng):
    """Every (block, token) pick appears once, lists ascend, chunks respect the limit."""
    B, Tq, Tk, H, C, S, chunk = 2, 50, 80, 3, 16, 4, 7
    idx = random_selection(B, Tq, Tk, H, C, S, min_blocks=1, seed=rng, device="cpu")
    nb = cdiv(Tk, C)
    tokens, items, n_parts = _transpose_selection(idx, nb, chunk)
    got = set()
    for key, start, end, slot, n in items.tolist():
        assert 0 < end - start <= chunk
        toks = tokens[start:end].tolist()
        assert toks == sorted(toks)
        bh, c = divmod(key, nb)
        got |= {(bh // H, t, bh % H, c) for t in toks}
    want = {(b, t, h, c) for b, t, h, s in zip(*torch.nonzero(idx >= 0, as_tuple=True))
            for c in [int(idx[b, t, h, s])]}
    assert got == {tuple(int(x) for x in w) for w in want}
    slots = items[:, 3]
    assert sorted(slots[slots >= 0].tolist()) == list(range(n_parts))


def test_unsupported_sizes_raise():
    q, k, v = make_qkv(1, 16, 16, 2, 1, 48, torch.float32)
    idx = all_blocks(1, 16, 16, 1, 16)
    with pytest.raises(ValueError, match="head dim"):
        sparse_attn_triton(q, k, v, idx, 16, 0.1)
    q, k, v = make_qkv(1, 16, 16, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        sparse_attn_triton(q, k, v, all_blocks(1, 16, 16, 1, 8), 8, 0.1)


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, bf16 / fp16 against an fp32 reference
# ----------------------------------------------------------------------------------------------
def dense_masked_reference(q, k, v, block_idx, C, scale):
    """fp32 masked dense attention (a [Tq, Tk] mask: moderate sizes only)."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, nb = HQ // HKV, cdiv(Tk, C)
    chosen = torch.zeros(B, Tq, HKV, nb + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(block_idx < 0, nb, block_idx).long(), True)
    allowed = chosen[..., :nb].repeat_interleave(C, -1)[..., :Tk]
    t_abs = Tk - Tq + torch.arange(Tq, device=q.device)
    causal = torch.arange(Tk, device=q.device) <= t_abs[:, None]
    allowed = (allowed & causal[None, :, None]).repeat_interleave(G, 2).permute(0, 2, 1, 3)
    s = scale * torch.einsum("bthd,bshd->bhts", q.float(), k.float().repeat_interleave(G, 2))
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", p, v.float().repeat_interleave(G, 2)), lse


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
@pytest.mark.parametrize("rows", [16, 64, 128])
def test_gpu_matches_fp32_reference(case, rows, rng):
    dtype, B, Tq, Tk, HQ, HKV, D, C, S = case
    q, k, v = make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=rng, device="cuda")
    idx = random_selection(B, Tq, Tk, HKV, C, S, seed=rng, device="cuda")
    warps = 8 if rows > 64 else 4
    cfg = KernelConfig(fwd_rows=rows, fwd_warps=warps, dq_rows=rows, dq_warps=warps,
                       dkv_rows=min(rows, 64))
    o, lse = sparse_attn_triton(q, k, v, idx, C, D ** -0.5, False, cfg)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ro, rlse = dense_masked_reference(*ref_in, idx, C, D ** -0.5)
    assert rel_err(o, ro) < 1e-2
    check_lse(lse, rlse, 2e-2)
    g = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), g)
    rgrads = torch.autograd.grad(ro, ref_in, g.float())
    for name, x, r in zip("qkv", grads, rgrads):
        assert rel_err(x, r) < 2e-2, (name, rel_err(x, r))


@pytest.mark.gpu
@needs_gpu
def test_gpu_deterministic_bitwise(rng):
    B, T, HQ, HKV, D, C, S = 1, 4096, 32, 4, 128, 64, 16
    q, k, v = make_qkv(B, T, T, HQ, HKV, D, torch.bfloat16, seed=rng, device="cuda")
    idx = random_selection(B, T, T, HKV, C, S, seed=rng, device="cuda")
    g = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    cfg = KernelConfig(dkv_chunk=256)
    runs = []
    for _ in range(2):
        o, _ = sparse_attn_triton(q, k, v, idx, C, None, True, cfg)
        runs.append(torch.autograd.grad(o, (q, k, v), g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
