"""64-bit offsets: PISA on inputs whose element offsets pass 2**31, checked on sampled rows.

Two cases, bf16 on one GPU, Triton backend, the library's default selection (query tiles):

- ``head_major_1M``: config A (HQ=64, HKV=4, D=128) at T = 1M with q, k, v head-major views
  (``torch.randn(B, H, T, D).transpose(1, 2)``, accepted by the checks): q's head stride is
  ``T * D = 2**27``, so head 16 on sits past 2**31 elements. The forward and all three gradients
  are compared with the same call on contiguous copies (which stay under 2**31), both with
  ``deterministic=True`` so they can match bitwise: ``o`` and ``dq``
  on sampled rows, ``dk``, ``dv`` whole, and sampled rows with a readable fp32 reference.
- ``hkv64_512K``: HQ = HKV = 64, D = 128 at T = 512K, head-major: k's head stride ``2**26`` times
  63 heads passes 2**31 in the pyramid, the selection and the attention. Checked against the fp32
  reference on sampled rows (``o``, ``dq``) and sampled key blocks (``dk``, ``dv``); atomics
  (the default), as the deterministic scratch of 2**29 entries' chunks would not fit beside it.

The reference (``_reference``) recomputes, in fp32 with autograd, the attention of chosen query
rows over the blocks the selection gave them; a key block's ``dk`` / ``dv`` come from every query
that chose it, so for a sampled block all of them are taken. Errors are relative L2 norms.

    python benchmarks/checks/overflow_h200.py --json benchmarks/results/overflow_h200.json
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import C, K, command, meta, write_result

from pisa import pisa_attn, pisa_select
from pisa.ops.select import tiles_to_tokens
from pisa.ops.utils.config import query_tile_of

TOL = 2e-2  # bf16 kernel vs fp32 reference, relative L2


def _head_major(B, T, H, D, gen):
    return torch.randn(B, H, T, D, generator=gen, device="cuda",
                       dtype=torch.bfloat16).transpose(1, 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _reference(q, k, v, do, block_idx, h_kv, tokens, scale):
    """fp32 attention rows of query ``tokens`` (all G heads of KV head ``h_kv``) over their
    selected blocks, and the gradients of ``sum(o * do)``: ``o, dq [n, G, D]`` and ``dk, dv``
    ``[T, D]`` (the contributions of these rows only)."""
    HQ, HKV = q.shape[2], k.shape[2]
    G = HQ // HKV
    heads = slice(h_kv * G, (h_kv + 1) * G)
    kk = k[0, :, h_kv].float().requires_grad_()
    vv = v[0, :, h_kv].float().requires_grad_()
    qq = q[0, tokens, heads].float().requires_grad_()  # [n, G, D]
    blocks = block_idx[0, tokens, h_kv].long()  # [n, S]
    pos = blocks[:, :, None] * C + torch.arange(C, device=q.device)  # [n, S, C]
    ok = (blocks[:, :, None] >= 0) & (pos <= tokens[:, None, None]) & (pos < k.shape[1])
    pos, ok = pos.flatten(1).clamp(0, k.shape[1] - 1), ok.flatten(1)
    s = torch.einsum("ngd,nkd->ngk", qq, kk[pos]) * scale
    p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), -1)
    o = torch.einsum("ngk,nkd->ngd", p, vv[pos])
    (o * do[0, tokens, heads].float()).sum().backward()
    return o.detach(), qq.grad, kk.grad, vv.grad


def _token_selection(q, k):
    """The selection ``pisa_attn`` makes at the library defaults (query tiles), one row per
    token ``[1, T, HKV, K]``: what the readable reference attends."""
    T = q.shape[1]
    idx, cnt = pisa_select(q.detach(), k.detach(), block_size=C, topk=K)
    return tiles_to_tokens(idx, cnt, T, T, query_tile_of(None, C))[0]


def _choosers(block_idx, h_kv, block):
    """The query tokens whose selection (KV head ``h_kv``) holds ``block``."""
    return (block_idx[0, :, h_kv] == block).any(-1).nonzero()[:, 0]


def _run(q, k, v, do, deterministic):
    for x in (q, k, v):
        x.grad = None
    o = pisa_attn(q, k, v, block_size=C, topk=K, deterministic=deterministic)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _sampled_rows(gen, T, HKV, n):
    """``n`` query tokens per sampled KV head, spread over the sequence (the last included)."""
    toks = torch.randint(0, T, (n - 1,), generator=gen, device="cuda")
    return torch.cat([toks, torch.tensor([T - 1], device="cuda")]).unique()


def _check_rows(name, q, k, v, do, out, block_idx, heads_kv, gen, n_rows, n_blocks):
    """Rows and blocks of ``out = (o, dq, dk, dv)`` against ``_reference``."""
    o, dq, dk, dv = out
    T, HKV, G = q.shape[1], k.shape[2], q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5
    rows = []
    for h in heads_kv:
        toks = _sampled_rows(gen, T, HKV, n_rows)
        heads = slice(h * G, (h + 1) * G)
        ro, rdq, _, _ = _reference(q, k, v, do, block_idx, h, toks, scale)
        rows.append({"case": name, "kv_head": h, "what": "o, dq rows", "n": int(toks.numel()),
                     "o_err": _rel(o[0, toks, heads], ro), "dq_err": _rel(dq[0, toks, heads], rdq)})
        n_b = (T + C - 1) // C
        for blk in torch.randint(n_b // 2, n_b, (n_blocks,), generator=gen, device="cuda").tolist():
            who = _choosers(block_idx, h, blk)
            _, _, rdk, rdv = _reference(q, k, v, do, block_idx, h, who, scale)
            keys = slice(blk * C, min((blk + 1) * C, T))
            rows.append({"case": name, "kv_head": h, "what": f"dk, dv block {blk}",
                         "n": int(who.numel()), "dk_err": _rel(dk[0, keys, h], rdk[keys]),
                         "dv_err": _rel(dv[0, keys, h], rdv[keys])})
    return rows


def head_major_1m(gen, T):
    HQ, HKV, D = 64, 4, 128
    q, k, v = (_head_major(1, T, h, D, gen).requires_grad_() for h in (HQ, HKV, HKV))
    do = torch.randn(1, T, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    view = _run(q, k, v, do, True)
    block_idx = _token_selection(q, k)
    rows = _check_rows("head_major_1M", q.detach(), k.detach(), v.detach(), do, view, block_idx,
                       [0, 3], gen, 48, 2)
    toks = _sampled_rows(gen, T, HKV, 256)
    o_s, dq_s, dk_v, dv_v = view[0][0, toks].clone(), view[1][0, toks].clone(), view[2], view[3]
    del view
    gc.collect()
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    del q, k, v
    gc.collect()
    cont = _run(qc, kc, vc, do, True)
    idx_c = _token_selection(qc, kc)
    rows.append({"case": "head_major_1M", "what": "view vs contiguous copy",
                 "selection_equal": bool(torch.equal(block_idx, idx_c)),
                 "o_rows_equal": bool(torch.equal(o_s, cont[0][0, toks])),
                 "dq_rows_equal": bool(torch.equal(dq_s, cont[1][0, toks])),
                 "dk_equal": bool(torch.equal(dk_v, cont[2])),
                 "dv_equal": bool(torch.equal(dv_v, cont[3])),
                 "o_rows_err": _rel(o_s, cont[0][0, toks]), "dk_err": _rel(dk_v, cont[2])})
    return rows


def hkv64(gen, T):
    HQ = HKV = 64
    D = 128
    q, k, v = (_head_major(1, T, h, D, gen).requires_grad_() for h in (HQ, HKV, HKV))
    do = torch.randn(1, T, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = _run(q, k, v, do, False)
    block_idx = _token_selection(q, k)
    return _check_rows("hkv64_512K", q.detach(), k.detach(), v.detach(), do, out, block_idx,
                       [0, 31, 63], gen, 48, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len-a", type=int, default=1 << 20)
    ap.add_argument("--len-b", type=int, default=1 << 19)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fn, T in ((head_major_1m, args.len_a), (hkv64, args.len_b)):
        new = fn(gen, T)
        for r in new:
            print(r, flush=True)
        rows += new
        gc.collect()
        torch.cuda.empty_cache()
        errs = [v for r in rows for key, v in r.items() if key.endswith("_err")]
        equal = [v for r in rows for key, v in r.items() if key.endswith("_equal")]
        ok = max(errs) < TOL and all(equal)
        write_result(args.json, meta("cuda", command(), tol=TOL, passed=ok, C=C, K=K), rows)
        print("PASS" if ok else "FAIL", f"max rel err {max(errs):.2e}, all equal: {all(equal)}")


if __name__ == "__main__":
    main()
