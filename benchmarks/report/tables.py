"""Render result files (the project's row schema) as markdown tables for ``docs/``.

    python benchmarks/report/tables.py benchmarks/results/train_h200.json [--pivot]

Plain mode prints one line per row; ``--pivot`` prints one line per T with a column per (op, impl)
holding milliseconds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import header, read_results

COLS = ("op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype", "ms",
        "peak_gb", "recall", "mass")


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def plain(result: dict) -> str:
    rows = result["rows"]
    extra = sorted({k for r in rows for k in r} - set(COLS))
    cols = [c for c in COLS if any(r.get(c) is not None for r in rows)] + extra
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def pivot(result: dict) -> str:
    keys = []
    by_t: dict[int, dict] = {}
    for r in result["rows"]:
        key = f"{r['op']} {r['impl']}"
        if key not in keys:
            keys.append(key)
        by_t.setdefault(r["T"], {})[key] = r["ms"]
    out = ["| T | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for T in sorted(by_t):
        out.append(f"| {T} | " + " | ".join(fmt(by_t[T].get(k)) for k in keys) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--pivot", action="store_true")
    args = ap.parse_args()
    result, = read_results([args.path])
    print(header(result["meta"]))
    print(pivot(result) if args.pivot else plain(result))


if __name__ == "__main__":
    main()
