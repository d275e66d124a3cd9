"""How much of the ``aggregate`` task a fixed block budget can see (CPU, no model).

``aggregate`` (``pisa.eval.tasks``) asks for the most frequent of ~4 symbols, each marked
``MARK s`` 4..8 times (the winner 2..4 more), scattered over the row. A sparse layer whose query
attends ``free`` key blocks of ``C`` tokens (the budget ``K`` less the forced sink / previous /
current blocks) sees the marks of those blocks only. Per row this counts the distinct blocks that
hold a mark, and scores an oracle that picks the ``free`` blocks holding the most marks and
answers with the symbol most frequent among them (a tie counts as wrong): an upper bound on what
one selection can count (not on a model: other heads, layers and a compressed branch may carry
more).

    python benchmarks/quality/aggregate_bound.py --json benchmarks/results/aggregate_bound_cpu.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import Results  # noqa: E402

from pisa.eval.tasks import MARK, make_task  # noqa: E402


def oracle_correct(row: torch.Tensor, answer: int, C: int, free: int) -> tuple[int, bool]:
    """Distinct mark blocks of ``row`` (the question cut off), and whether the ``free`` blocks
    with the most marks name ``answer`` alone as the most frequent symbol."""
    pos = (row == MARK).nonzero().flatten()
    sym, blk = row[pos + 1], pos // C
    top = torch.bincount(blk, minlength=row.numel() // C + 1).argsort(descending=True)[:free]
    values, counts = sym[torch.isin(blk, top)].unique(return_counts=True)
    best = values[counts == counts.max()]
    return int(blk.unique().numel()), best.numel() == 1 and int(best[0]) == answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--free", type=int, nargs="+", default=[13, 16],
                    help="blocks a query chooses (K = 16 less 3 forced: 13)")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = Results(args.json, "cpu", task="aggregate", rows_per_length=args.rows)
    for T in args.lengths:
        batch = make_task("aggregate", args.rows, T, torch.Generator().manual_seed(args.seed + T))
        body, answers = batch.tokens[:, :-3], batch.tokens[:, -1].tolist()  # QRY MARK winner
        for free in args.free:
            seen = [oracle_correct(body[r], answers[r], args.block_size, free)
                    for r in range(args.rows)]
            blocks = torch.tensor([b for b, _ in seen], dtype=torch.float)
            res.add({"op": "aggregate_bound", "T": T, "C": args.block_size, "free": free,
                     "mark_blocks_mean": round(float(blocks.mean()), 2),
                     "mark_blocks_min": int(blocks.min()), "mark_blocks_max": int(blocks.max()),
                     "oracle_acc": round(sum(ok for _, ok in seen) / args.rows, 4)})
    res.save()


if __name__ == "__main__":
    main()
