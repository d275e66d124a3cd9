"""Log-log plot of time against T from result files (one line per (op, impl), the rows of every
file together: a sweep saved in pieces plots as one).

    python benchmarks/report/plot.py benchmarks/results/train_h200.json --out docs/train_h200.png \
        --ops select fwdbwd
    python benchmarks/report/plot.py benchmarks/results/history/decode_h200.json \
        --out docs/decode_h200.png --ops decode --batches 1 16
    python benchmarks/report/plot.py benchmarks/results/select_v3_final_h200/v3_{final,long}_*.json \
        benchmarks/results/select_v3_final_h200/v3_nsa_A.json benchmarks/results/train_h200_v2.json \
        --out docs/select_v3_h200.png --ops fwdbwd --by-shape

``--by-shape`` draws a panel per model shape (HQ / HKV / D) as well as per op.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import read_results


def _shape(row: dict) -> str:
    return f"{row['HQ']}/{row['HKV']}/{row['D']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+", help="result files")
    ap.add_argument("--out", required=True, help="the image to write")
    ap.add_argument("--ops", nargs="+", default=["select", "fwdbwd"])
    ap.add_argument("--batches", type=int, nargs="+", default=[None],
                    help="one panel per batch size per op (default: every row)")
    ap.add_argument("--by-shape", action="store_true", help="one panel per HQ / HKV / D too")
    args = ap.parse_args()
    import matplotlib  # after the arguments: --help works without it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = read_results(args.paths)
    rows = [r for result in results for r in result["rows"]]
    metas = [result["meta"] for result in results]
    shapes = sorted({_shape(r) for r in rows}, reverse=True) if args.by_shape else [None]
    panels = [(op, b, s) for op in args.ops for b in args.batches for s in shapes]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (op, batch, shape) in zip(axes[0], panels):
        lines: dict[str, list] = {}
        for r in rows:
            if r["op"] == op and r["ms"] is not None and batch in (None, r["B"]) \
                    and shape in (None, _shape(r)):
                lines.setdefault(r["impl"], []).append((r["T"], r["ms"]))
        for impl, pts in lines.items():
            pts.sort()
            ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("ms")
        title = op if batch is None else f"{op}, batch {batch}"
        ax.set_title(title if shape is None else f"{title}, HQ/HKV/D {shape}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    m = metas[0]
    dates = sorted({x["date"][:10] for x in metas})
    fig.suptitle(f"{m['device']} · torch {m['torch']} · triton {m['triton']} · "
                 f"{' / '.join(dates)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
