"""What checking a caller's ``block_idx`` costs: ``pisa_attn(block_idx=...)`` against the same
attention without the check, config A at ``--len`` (128K by default), forward and forward+backward.

Rows: ``check`` (``check_block_idx`` alone: one elementwise pass, one reduction, one host sync),
``attn_checked`` (``pisa_attn`` with the selection given), ``attn_unchecked`` (the attention op
``pisa.ops.attn.sparse_attn`` on the same selection, as ``pisa_attn`` calls it after the check).

    python benchmarks/checks/block_idx_check_h200.py \
        --json benchmarks/results/block_idx_check_h200.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import C, HKV, HQ, K, D, Results, fwd_bwd, randn_qkv, result_row, shape, time_ms

from pisa import pisa_attn, pisa_select
from pisa.ops.attn import sparse_attn
from pisa.ops.utils.config import SelectConfig, check_block_idx


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", type=int, default=131072)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    T = args.len
    res = Results(args.json, "cuda")
    q, k, v = randn_qkv(T, requires_grad=True)
    do = torch.randn_like(q)
    idx, _ = pisa_select(q.detach(), k.detach(), block_size=C, topk=K)
    cfg = SelectConfig(block_size=C, scale=D ** -0.5)
    runs = {
        "check": ("check", lambda: check_block_idx(idx, q, k, C)),
        "attn_checked_fwd": ("fwd", lambda: pisa_attn(q, k, v, block_size=C, block_idx=idx)),
        "attn_unchecked_fwd": ("fwd", lambda: sparse_attn(q, k, v, idx, cfg=cfg,
                                                          backend="triton")),
        "attn_checked_fwdbwd": ("fwdbwd", fwd_bwd(
            lambda: pisa_attn(q, k, v, block_size=C, block_idx=idx), do, (q, k, v))),
        "attn_unchecked_fwdbwd": ("fwdbwd", fwd_bwd(
            lambda: sparse_attn(q, k, v, idx, cfg=cfg, backend="triton")[0], do, (q, k, v))),
    }
    for impl, (op, fn) in runs.items():
        res.add(result_row(op, impl, "triton", T=T, ms=time_ms(fn, "cuda"),
                           **shape(HQ, HKV, D)))
    res.save()


if __name__ == "__main__":
    main()
