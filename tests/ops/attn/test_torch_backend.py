"""``pisa.ops.attn.torch_backend`` (through the ``pisa::sparse_attn`` op, ``backend="torch"``)
against the fp64 oracle ``pisa.ops.attn.naive``: outputs, LSE and gradients."""
import math

import pytest
import torch

from pisa.ops.attn import sparse_attn
from pisa.ops.attn.naive import naive_attn, naive_dense_attn
from pisa.ops.attn.torch_backend import attn_fwd_torch
from pisa.ops.select.torch_backend import select_torch
from tests.ops.conftest import per_token_config


def _inputs(B, Tq, Tk, HKV, G, D, dtype=torch.float64):
    q = torch.randn(B, Tq, HKV * G, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=True)
    return q, k, v


def _random_selection(B, Tq, Tk, HKV, C, S):
    """Forced blocks plus random earlier blocks, ascending, -1 padded (rows of varying fill)."""
    idx = torch.full((B, Tq, HKV, S), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(Tq):
            cur = (Tk - Tq + t) // C
            for h in range(HKV):
                pool = torch.randperm(cur + 1)[:torch.randint(1, S + 1, ()).item()].tolist()
                chosen = sorted(set(pool) | {cur})[:S]
                idx[b, t, h, :len(chosen)] = torch.tensor(sorted(chosen), dtype=torch.int32)
    return idx


def _grads(o, inputs, do):
    return torch.autograd.grad(o, inputs, do)


CASES = [  # T, G, D, scorer
    (1, 1, 32, "lse"), (63, 4, 64, "mean"), (65, 16, 32, "meanvar"), (127, 1, 64, "lse"),
    (1000, 4, 32, "lse"), (127, 16, 64, "meanvar"), (65, 1, 32, "lse")]


@pytest.mark.parametrize("T,G,D,scorer", CASES)
def test_torch_attention_equals_naive_with_pyramid_selection(T, G, D, scorer, rng):
    B, HKV = (1, 1) if T >= 1000 else (2, 2)
    C = 16 if T >= 1000 else 8
    q, k, v = _inputs(B, T, T, HKV, G, D)
    cfg = per_token_config(C, 6, 2, 4, scorer, "pyramid", True, D ** -0.5)
    idx, _ = select_torch(q.detach(), k.detach(), cfg)  # == naive_select (select/ tests)
    o, lse = sparse_attn(q, k, v, idx, cfg=cfg, backend="torch")
    o_ref, lse_ref = naive_attn(q, k, v, idx, C, cfg.scale)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=1e-6)
    do = torch.randn_like(o)
    for got, want in zip(_grads(o, (q, k, v), do), _grads(o_ref, (q, k, v), do)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 2e-3),
                                       (torch.bfloat16, 1.6e-2)])
def test_low_precision_within_dtype_tolerance(dtype, tol, rng):
    B, Tq, Tk, HKV, G, D, C = 2, 70, 150, 2, 4, 32, 8
    q, k, v = _inputs(B, Tq, Tk, HKV, G, D, dtype)
    idx = _random_selection(B, Tq, Tk, HKV, C, 6)
    o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=D ** -0.5),
                         backend="torch")
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, HKV * G, Tq)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = naive_attn(qd, kd, vd, idx, C, D ** -0.5)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert rel(o.detach(), o_ref.detach()) < tol
    assert rel(lse.detach(), lse_ref.detach()) < tol
    do = torch.randn_like(o)
    for got, want in zip(_grads(o, (q, k, v), do), _grads(o_ref, (qd, kd, vd), do.double())):
        assert rel(got, want.detach()) < 2 * tol


def test_every_block_selected_equals_dense_causal(rng):
    B, Tq, Tk, HKV, G, D, C = 1, 50, 131, 2, 4, 16, 8
    q, k, v = _inputs(B, Tq, Tk, HKV, G, D)
    n = -(-Tk // C)
    idx = torch.arange(n, dtype=torch.int32).expand(B, Tq, HKV, n).contiguous()
    o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=0.3),
                         backend="torch")
    o_ref, lse_ref = naive_dense_attn(q, k, v, 0.3)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=1e-6)


def test_gqa_equals_repeated_kv_mha(rng):
    B, T, HKV, G, D, C = 2, 90, 2, 4, 16, 8
    q, k, v = _inputs(B, T, T, HKV, G, D)
    idx = _random_selection(B, T, T, HKV, C, 5)
    cfg = per_token_config(block_size=C, scale=0.25)
    o = sparse_attn(q, k, v, idx, cfg=cfg, backend="torch")[0]
    rep = lambda x: x.repeat_interleave(G, dim=2)  # noqa: E731
    o_mha = sparse_attn(q, rep(k), rep(v), rep(idx).contiguous(), cfg=cfg, backend="torch")[0]
    torch.testing.assert_close(o, o_mha, rtol=1e-12, atol=1e-12)


def test_lse_matches_torch_logsumexp_of_selected_logits(rng):
    B, T, HKV, G, D, C = 1, 40, 1, 2, 16, 8
    q, k, v = _inputs(B, T, T, HKV, G, D)
    idx = _random_selection(B, T, T, HKV, C, 3)
    _, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=C, scale=0.5),
                         backend="torch")
    for t in range(T):
        keys = [j for c in idx[0, t, 0].tolist() if c >= 0
                for j in range(c * C, min((c + 1) * C, t + 1))]
        logits = 0.5 * q[0, t].detach() @ k[0, keys, 0].detach().T  # [G, n]
        torch.testing.assert_close(lse[0, :, t].double(), torch.logsumexp(logits, -1),
                                   rtol=1e-6, atol=1e-6)


def test_outputs_are_poisoned_then_fully_written(rng, monkeypatch):
    """The torch backend allocates o/lse filled with NaN; a row the kernel skipped would stay NaN.
    Also check an empty selection row yields o = 0 and lse = -inf rather than NaN."""
    B, T, HKV, G, D, C = 1, 33, 1, 2, 16, 8
    q, k, v = _inputs(B, T, T, HKV, G, D)
    idx = _random_selection(B, T, T, HKV, C, 3)
    idx[0, 5] = -1  # a row with no block at all
    with torch.no_grad():
        o, lse = attn_fwd_torch(q, k, v, idx, C, 0.25)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert bool((o[0, 5] == 0).all()) and bool((lse[0, :, 5] == -math.inf).all())


def test_selection_of_padding_only_attends_to_nothing(rng):
    """Every row -1 (a chunk with no (query, block) pair at all; it crashed on a view of zero
    elements): o = 0, lse = -inf and zero gradients, as the oracle gives."""
    q, k, v = _inputs(1, 20, 30, 2, 2, 16)
    idx = torch.full((1, 20, 2, 3), -1, dtype=torch.int32)
    o, lse = sparse_attn(q, k, v, idx, cfg=per_token_config(block_size=8, scale=0.25),
                         backend="torch")
    assert (o == 0).all() and torch.isneginf(lse).all()
    for g in torch.autograd.grad(o, (q, k, v), torch.randn_like(o)):
        assert (g == 0).all()
