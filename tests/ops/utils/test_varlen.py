"""Packed sequences (``pisa_attn_varlen`` / ``pisa_select_varlen`` on the layout row of
``utils.varlen``): each sequence equals ``pisa_attn`` / ``pisa_select`` on it alone — outputs,
LSE, dq/dk/dv and selections — for every selector and knob, ragged lengths (0, 1, C - 1, C + 1,
shorter than K * C, several pyramid levels), queries shorter than keys and GQA; bad inputs.

Without CUDA the Triton kernels run under the interpreter on tiny fp32 shapes with poisoned
buffers; the GPU section checks bf16 at real sizes.
"""
import importlib.util

import pytest
import torch

from pisa import pisa_attn, pisa_attn_varlen, pisa_select, pisa_select_varlen
from pisa.ops.select import tiles_to_tokens
from pisa.ops.utils.config import QUERY_TILE
from pisa.ops.utils.varlen import gather_rows, varlen_layout
from tests.ops.conftest import INTERPRET

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
pytestmark = pytest.mark.usefixtures("fast_interpreter")

C, K = 16, 4
LEN_K = (1, C - 1, 0, C + 1, 3 * C - 3, 7 * C + 4)  # 0: an empty sequence
LEN_Q = (1, C - 1, 0, 5, 3 * C - 3, 5 * C)          # the last two: Tq < Tk and Tq = Tk
KNOBS = [{}, {"selector": "flat_lse"}, {"selector": "flat_mean"}, {"scorer": "mean"},
         {"scorer": "meanvar", "beam_leaf": 3}, {"scorer": "bound"}, {"branching": 4},
         {"branching": 3}, {"forced_in_budget": False}, {"query_tile": 4},
         {"query_tile": 8, "tile_reduce": "lse"}, {"query_tile": 4, "tile_reduce": "qmean"},
         {"selector": "auto"}, {"query_tile": 1, "scorer": "lse", "tile_reduce": "sum"},
         {"query_tile": 8, "tile_reduce": "mass"}, {"query_tile": 4, "tile_reduce": "mass",
                                                    "scorer": "bound", "beam_leaf": 3}]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _packed(dtype, device, HQ=4, HKV=2, D=16, len_q=LEN_Q, len_k=LEN_K):
    q = torch.randn(sum(len_q), HQ, D, dtype=dtype, device=device)
    k = torch.randn(sum(len_k), HKV, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return q, k, v, _cu(len_q).to(device), _cu(len_k).to(device)


def _attn_both(q, k, v, cu_q, cu_k, knobs, tol, ref_backend=None):
    """Varlen forward and backward (an lse gradient too) against ``pisa_attn`` per sequence
    (with ``ref_backend``: on the CPU in that backend)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
    o, lse = pisa_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **knobs)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == torch.float32
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    grads = torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), (q, k, v))
    for i in range(len(lq)):
        sq, sk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lq[i] == 0:
            continue
        dev = q.device if ref_backend is None else "cpu"
        qi, ki, vi = (x[s].detach()[None].to(dev).requires_grad_()
                      for x, s in ((q, sq), (k, sk), (v, sk)))
        oi, li = pisa_attn(qi, ki, vi, return_lse=True,
                           **dict(knobs, backend=ref_backend or knobs["backend"]))
        ref = torch.autograd.grad((oi[0] * do[sq].to(dev)).sum()
                                  + (li[0] * dlse[:, sq].to(dev)).sum(), (qi, ki, vi))
        torch.testing.assert_close(o[sq].to(dev), oi[0], **tol)
        torch.testing.assert_close(lse[:, sq].to(dev), li[0], **tol)
        for got, want, s in zip(grads, ref, (sq, sk, sk)):
            torch.testing.assert_close(got[s].to(dev), want[0], **tol)


def _tile(knobs):
    """The query tile ``knobs`` resolve to (``pisa_select``'s default: ``min(16, block_size)``)."""
    return knobs.get("query_tile") or min(QUERY_TILE, knobs["block_size"])


def _knob_id(knobs):
    return ",".join(f"{a}={b}" for a, b in knobs.items()) or "default"


@pytest.mark.parametrize("knobs", KNOBS, ids=_knob_id)
def test_torch_equals_each_sequence_alone(knobs, rng):
    q, k, v, cu_q, cu_k = _packed(torch.float64, "cpu")
    knobs = dict(block_size=C, topk=K, beam=2, backend="torch", **knobs)
    _attn_both(q, k, v, cu_q, cu_k, knobs, dict(rtol=1e-10, atol=1e-10))


@pytest.mark.parametrize("knobs", [{}, {"query_tile": 4, "scorer": "bound"},
                                   {"selector": "flat_mean", "query_tile": 2},
                                   {"query_tile": 8, "tile_reduce": "mass"}],
                         ids=["pyramid", "tiles-bound", "flat_mean-tiles", "mass"])
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_equals_each_sequence_alone(knobs, rng, poison_outputs, poison_empty):
    q, k, v, cu_q, cu_k = _packed(torch.float32, DEV)
    knobs = dict(block_size=C, topk=K, beam=2, backend="triton", **knobs)
    # against the torch backend per sequence: the Triton selections are the torch ones (the
    # oracle's, on random inputs), a different selection would change the outputs
    _attn_both(q, k, v, cu_q, cu_k, knobs, dict(rtol=2e-4, atol=2e-5), ref_backend="torch")


@pytest.mark.parametrize("knobs", [{}, {"query_tile": 4}, {"selector": "flat_lse"},
                                   {"query_tile": 1, "scorer": "lse", "tile_reduce": "sum"}])
def test_select_equals_each_sequence_alone_and_feeds_attn(knobs, rng):
    q, k, v, cu_q, cu_k = _packed(torch.float64, "cpu")
    knobs = dict(block_size=C, topk=K, beam=2, backend="torch", **knobs)
    lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
    idx, cnt = pisa_select_varlen(q, k, cu_q, cu_k, max(lq), max(lk), **knobs)
    for i in range(len(lq)):
        if lq[i] == 0:
            continue
        s = slice(int(cu_q[i]), int(cu_q[i + 1]))
        ri, ci = pisa_select(q[s][None], k[int(cu_k[i]):int(cu_k[i + 1])][None], **knobs)
        ri, ci = tiles_to_tokens(ri, ci, lq[i], lk[i], _tile(knobs))
        assert torch.equal(idx[s], ri[0]) and torch.equal(cnt[s], ci[0])
    o = pisa_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), block_idx=idx, **knobs)
    torch.testing.assert_close(o, pisa_attn_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                   **knobs))


BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qt", [2, 4, 16])
def test_qmean_rows_average_each_tile_over_its_own_queries(qt, backend, poison_outputs):
    """The layout row's zeros (before a sequence's first query, past its end) are no queries: a
    ``qmean`` tile a sequence fills in part must average its own ``n`` queries, as the sequence
    alone does, not shrink by ``n / qt`` (the selection of such tiles differed from
    ``pisa_select`` on the sequence alone, e.g. the last 4 queries of a 116-key sequence with
    16-token tiles)."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, _, cu_q, cu_k = _packed(dtype, DEV)
    lay = varlen_layout(cu_q, cu_k, q.shape[0], k.shape[0], max(LEN_K), C, 2)
    row = lay.mean_tile_rows(q, qt, backend)[0]
    got = row.view(-1, qt, *q.shape[1:]).mean(1)
    tile = lay.pos_q // qt
    n = torch.bincount(tile, minlength=got.shape[0]).to(dtype)
    want = torch.zeros_like(got).index_add_(0, tile, q) / n.clamp_min(1)[:, None, None]
    assert (n[tile] < qt).any()  # partial tiles are there
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    full = n.repeat_interleave(qt) == qt
    assert torch.equal(lay.rows(q, False, backend)[0][full], row[full])  # full tiles: unchanged


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_and_back_are_gathers_with_exact_gradients(backend, dtype, poison_outputs):
    """``lay.rows`` puts each packed token at its row position and zeros elsewhere;
    ``lay.unrows`` reads the queries back; both backward passes are the inverse gathers: the
    gradients equal those of the scatter / index formulation exactly (every output element is
    one input element)."""
    q, k, _, cu_q, cu_k = _packed(dtype, DEV)
    k = k[:, :, :5]  # a row of 10 elements: not a power of two
    lay = varlen_layout(cu_q, cu_k, q.shape[0], k.shape[0], max(LEN_K), C, 2)
    for x, keys, pos in ((q, False, lay.pos_q), (k, True, lay.pos_k)):
        x = x.detach().requires_grad_()
        row = lay.rows(x, keys, backend)
        want = x.new_zeros(lay.length, *x.shape[1:]).index_copy(0, pos, x.detach())
        assert torch.equal(row[0], want)
        g = torch.randn_like(row)
        row.backward(g)
        assert torch.equal(x.grad, g[0][pos])
    o_row = torch.randn(lay.length, *q.shape[1:], dtype=dtype, device=DEV, requires_grad=True)
    o = lay.unrows(o_row, backend)
    assert torch.equal(o, o_row.detach()[lay.pos_q])
    g = torch.randn_like(o)
    o.backward(g)
    assert torch.equal(o_row.grad, torch.zeros_like(o_row).index_copy(0, lay.pos_q, g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_rows_weights_and_strided_input(backend, poison_outputs):
    """``gather_rows`` with a per-row weight (in fp32) on a row-strided input (a slice of a
    fused projection) equals indexing and a product."""
    x = torch.randn(50, 3, 2, 8, device=DEV)[:, 1]  # [50, 2, 8], rows 48 elements apart
    src = torch.randint(-1, 50, (70,), device=DEV)
    w = torch.rand(70, device=DEV)
    got = gather_rows(x, src, w, backend)
    want = torch.where((src >= 0)[:, None, None], x[src.clamp_min(0)] * w[:, None, None], 0.)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(gather_rows(x, src, None, backend),
                       torch.where((src >= 0)[:, None, None], x[src.clamp_min(0)], 0.))


def test_layout_keeps_sequences_apart_and_aligned():
    """Each sequence gets a power-of-g run of blocks starting at a multiple of it; runs do not
    overlap; every query sits in its sequence's run at its own offset."""
    lens = (1, 40, 300, 0, 17, 64, 129)
    cu = _cu(lens)
    lay = varlen_layout(cu, cu, sum(lens), sum(lens), max(lens), C, 2)
    owner = torch.full((lay.n_blocks,), -1)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        blocks = lay.pos_k[int(cu[i]):int(cu[i + 1])] // C
        start, size = int(blocks[0]), 1
        while size < -(-n // C):
            size *= 2
        assert start % size == 0 and (owner[start:start + size] == -1).all()
        owner[start:start + size] = i
        assert torch.equal(lay.pos_k[int(cu[i]):int(cu[i + 1])], start * C + torch.arange(n))
        assert (lay.blk0[start:start + -(-n // C)] == start).all()
    assert torch.equal(lay.pos_q, lay.pos_k)


def test_bad_inputs_name_the_argument():
    q, k, v, cu_q, cu_k = _packed(torch.float32, "cpu")
    mq, mk = max(LEN_Q), max(LEN_K)
    kw = dict(block_size=C, topk=K)
    bad_order = cu_q.clone()
    bad_order[2], bad_order[3] = bad_order[3], bad_order[2] - 1
    cases = [
        ((q, k, v, bad_order, cu_k, mq, mk), ValueError, "cu_seqlens_q must be non-decreasing"),
        ((q, k, v, cu_q.long(), cu_k, mq, mk), TypeError, "cu_seqlens_q must be int32"),
        ((q, k, v, cu_q, torch.cat([cu_k, cu_k[-1:]]), mq, mk), ValueError,
         "cu_seqlens_q and cu_seqlens_k"),
        ((q[:-1], k, v, cu_q, cu_k, mq, mk), ValueError, r"cu_seqlens_q\[-1\] must equal"),
        ((q, k[:-1], v[:-1], cu_q, cu_k, mq, mk), ValueError, r"cu_seqlens_k\[-1\] must equal"),
        ((q, k, v, cu_q, cu_k, mq, mk - 1), ValueError, "max_seqlen_k=.* is below"),
        ((q, k, v, cu_q, cu_k, mq - 1, mk), ValueError, "max_seqlen_q=.* is below"),
        ((q, k, v, cu_k, cu_q, mk, mq), ValueError, r"cu_seqlens_q\[-1\]"),
        ((q[None], k, v, cu_q, cu_k, mq, mk), ValueError, "q must have shape"),
        ((q, k, v, cu_q, cu_k, float(mq), mk), TypeError, "max_seqlen_q must be an int"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            pisa_attn_varlen(*args, **kw)
    swapped = _cu((1, 2))
    with pytest.raises(ValueError, match="len_q <= len_k"):
        pisa_attn_varlen(q[:3], k[:3], v[:3], swapped, _cu((2, 1)), 2, 2, **kw)
    with pytest.raises(ValueError, match="backend='naive'"):
        pisa_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, backend="naive", **kw)
    idx, _ = pisa_select_varlen(q, k, cu_q, cu_k, mq, mk, **kw)
    idx[-1, 0, 0] = 7 * C  # a block of no sequence
    with pytest.raises(ValueError, match="not a valid selection"):
        pisa_attn_varlen(q, k, v, cu_q, cu_k, mq, mk, block_idx=idx, **kw)


def test_no_queries_gives_empty_outputs_and_zero_gradients():
    q, k, v, _, cu_k = _packed(torch.float32, "cpu", len_q=(0,) * len(LEN_K))
    k.requires_grad_()
    o, lse = pisa_attn_varlen(q, k, v, torch.zeros(len(LEN_K) + 1, dtype=torch.int32), cu_k, 0,
                              max(LEN_K), return_lse=True, block_size=C, topk=K)
    assert o.shape == q.shape and lse.shape == (q.shape[1], 0)
    o.sum().backward()
    assert (k.grad == 0).all()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("knobs", [{}, {"query_tile": 1, "scorer": "lse", "tile_reduce": "sum"},
                                   {"selector": "flat_mean"}, {"tile_reduce": "mass"}])
def test_gpu_bf16_equals_each_sequence_alone(knobs, rng):
    """bf16 at real sizes: the varlen selection equals each sequence's on (nearly) every row, and
    attention over that selection equals ``pisa_attn`` per sequence given it (outputs, LSE,
    gradients)."""
    lens_k = (1000, 4096, 63, 2049, 64, 8192)
    lens_q = (1000, 4096, 1, 2000, 64, 4097)
    q, k, v, cu_q, cu_k = _packed(torch.bfloat16, "cuda", HQ=16, HKV=4, D=128, len_q=lens_q,
                                  len_k=lens_k)
    knobs = dict(block_size=64, topk=16, **knobs)
    idx, _ = pisa_select_varlen(q, k, cu_q, cu_k, max(lens_q), max(lens_k), **knobs)
    agree = []
    for i in range(len(lens_q)):
        s = slice(int(cu_q[i]), int(cu_q[i + 1]))
        ri, ci = pisa_select(q[s][None], k[int(cu_k[i]):int(cu_k[i + 1])][None], **knobs)
        ri, _ = tiles_to_tokens(ri, ci, lens_q[i], lens_k[i], _tile(knobs))
        agree.append((idx[s] == ri[0]).all(-1).float().mean().item())
    assert min(agree) > 0.99, agree
    knobs.pop("query_tile", None)  # a per-token block_idx
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = pisa_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), block_idx=idx,
                              return_lse=True, **knobs)
    do = torch.randn_like(o)
    grads = torch.autograd.grad((o.float() * do).sum(), (q, k, v))
    for i in range(len(lens_q)):
        sq, sk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qi, ki, vi = (x[s].detach()[None].requires_grad_() for x, s in ((q, sq), (k, sk), (v, sk)))
        oi, li = pisa_attn(qi, ki, vi, block_idx=idx[sq][None], return_lse=True, **knobs)
        ref = torch.autograd.grad((oi[0].float() * do[sq]).sum(), (qi, ki, vi))
        torch.testing.assert_close(o[sq], oi[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse[:, sq], li[0], rtol=1e-3, atol=1e-3)
        for got, want, s in zip(grads, ref, (sq, sk, sk)):
            torch.testing.assert_close(got[s].float(), want[0].float(), rtol=3e-2, atol=3e-2)
