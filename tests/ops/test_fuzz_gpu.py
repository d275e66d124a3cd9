"""GPU fuzz of the Triton selection and attention kernels against fp32/fp64 references (issue 25):
random shapes in one GPU run — GQA groups 1 to 16 (7 included), head dims 64 and 128, lengths
that are no multiple of the query tile or the block, batch 1–2 or packed sequences — over the
selection knobs in use (the defaults, ``tile_reduce="mass"`` at K = 16 and 20, the per-token walk,
the flat exact scan).

Per case:
- selection: Triton on fp32 inputs equals the torch backend on the same inputs but for near-ties
  (>= 99% of rows; the kernels score in another order);
- attention: Triton on bf16 inputs, outputs poisoned with NaN before the kernels run, against the
  fp32 masked reference (``attn.common.dense_masked_reference``) over the same selection (output, LSE and the
  gradients of a loss through both), to bf16 relative tolerances;
- packed sequences: each sequence's rows are checked against its own reference.
"""
from __future__ import annotations

import random

import pytest
import torch

from pisa import pisa_attn, pisa_attn_varlen, pisa_select, pisa_select_varlen
from pisa.ops.utils.config import SelectConfig, resolve_config
from pisa.ops.utils.csr import token_rows

from .attn.common import dense_masked_reference, rel_err
from .select.common import rows_equal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KNOBS = {"defaults": {}, "mass": dict(tile_reduce="mass"),
         "mass_k20": dict(tile_reduce="mass", topk=20, beam=16),
         "per_token": dict(query_tile=1, scorer="lse", tile_reduce="sum", beam_leaf=None),
         "flat_lse": dict(selector="flat_lse", query_tile=1)}
N_CASES = 40
C = SelectConfig.block_size  # no case sets another
REL = 2e-2  # bf16 inputs, fp32 accumulation: relative error of a whole output / gradient


def draw_case(i: int) -> dict:
    r = random.Random(i)
    G = r.choice([1, 2, 3, 4, 7, 8, 16])
    HKV = r.choice([1, 2] if G >= 8 else [1, 2, 4])
    T = r.randrange(700, 3000)
    T += (T % 16 == 0)                         # never a multiple of the tile (or the block)
    packed = i % 4 == 3
    lens = None
    if packed:                                 # 2-3 sequences, one of them short
        cuts = sorted(r.sample(range(50, T - 50), r.choice([1, 2])))
        lens = [b - a for a, b in zip([0] + cuts, cuts + [T])]
    return dict(G=G, HKV=HKV, D=r.choice([64, 128]), T=T, B=1 if packed else r.choice([1, 2]),
                lens=lens, knobs=list(KNOBS)[i % len(KNOBS)], seed=i)


def inputs(case, dtype):
    gen = torch.Generator(device="cuda").manual_seed(case["seed"])
    B, T, HKV, G, D = case["B"], case["T"], case["HKV"], case["G"], case["D"]
    q = torch.randn(B, T, HKV * G, D, device="cuda", generator=gen, dtype=dtype)
    k = torch.randn(B, T, HKV, D, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(B, T, HKV, D, device="cuda", generator=gen, dtype=dtype)
    return q, k, v


def check_attention(leaves, o, lse, reference_fn, what):
    """``o``, ``lse`` and the gradients of ``(o * do).sum() + (lse * dlse).sum()`` in the bf16
    ``leaves`` against ``reference_fn(*fp32 leaves) -> (o, lse)``."""
    refs = [x.detach().float().requires_grad_() for x in leaves]
    o_ref, lse_ref = reference_fn(*refs)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all()), f"{what}: not finite"
    assert rel_err(o, o_ref) < REL, f"{what}: output {rel_err(o, o_ref):.2e}"
    assert float((lse.double() - lse_ref).abs().max()) < 5e-2, f"{what}: lse"
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    got = torch.autograd.grad((o.float() * do).sum() + (lse * dlse).sum(), leaves)
    want = torch.autograd.grad((o_ref * do).sum() + (lse_ref * dlse).sum(), refs)
    for name, a, b in zip("qkv", got, want):
        assert rel_err(a, b) < REL, f"{what}: d{name} {rel_err(a, b):.2e}"


@pytest.mark.parametrize("i", range(N_CASES))
def test_gpu_fuzz_select_and_attend(i, poison_outputs, poison_empty):
    case = draw_case(i)
    knobs = KNOBS[case["knobs"]]
    what = repr(case)
    scale = case["D"] ** -0.5
    if case["lens"] is None:
        qf, kf, _ = inputs(case, torch.float32)
        got = pisa_select(qf, kf, backend="triton", **knobs)
        want = pisa_select(qf, kf, backend="torch", **knobs)
        assert got[0].shape == want[0].shape, what
        assert rows_equal(got, want) >= 0.99, f"{what}: selection"
        q, k, v = (x.requires_grad_() for x in inputs(case, torch.bfloat16))
        tile = resolve_config(q, k, "triton", **knobs).query_tile
        idx = token_rows(pisa_select(q, k, backend="triton", **knobs)[0], case["T"], case["T"],
                         tile)
        o, lse = pisa_attn(q, k, v, return_lse=True, backend="triton", **knobs)
        check_attention((q, k, v), o, lse,
                        lambda *x: dense_masked_reference(*x, idx, C, scale), what)
        return
    cu = torch.tensor([0] + case["lens"], device="cuda").cumsum(0).to(torch.int32)
    mx = max(case["lens"])
    qf, kf, _ = (x[0] for x in inputs(case, torch.float32))
    got = pisa_select_varlen(qf, kf, cu, cu, mx, mx, backend="triton", **knobs)
    want = pisa_select_varlen(qf, kf, cu, cu, mx, mx, backend="torch", **knobs)
    assert rows_equal((got[0][None], got[1][None]), (want[0][None], want[1][None])) >= 0.99, \
        f"{what}: packed selection"
    q, k, v = (x[0].requires_grad_() for x in inputs(case, torch.bfloat16))
    idx, _ = pisa_select_varlen(q, k, cu, cu, mx, mx, backend="triton", **knobs)
    o, lse = pisa_attn_varlen(q, k, v, cu, cu, mx, mx, return_lse=True, backend="triton",
                              **knobs)
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def packed_reference(q, k, v):
        """Each sequence alone over its rows of the packed selection (ids from its start)."""
        outs = [dense_masked_reference(q[a:b][None], k[a:b][None], v[a:b][None],
                                       idx[a:b][None], C, scale) for a, b in spans]
        return torch.cat([x[0][0] for x in outs]), torch.cat([x[1][0] for x in outs], -1)

    check_attention((q, k, v), o, lse, packed_reference, what)
