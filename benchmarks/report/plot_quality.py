"""Plots of `pisa eval ruler` and `pisa eval ppl` result files.

ruler: each task's score per arm (grouped bars, the average over tasks last), one panel per
length and mode; tasks the dense arm scores below the bar on (``meta["summary"]``'s
``too_hard_for_dense``) are hatched and starred: too hard for the model, not the arm's loss.
ppl: per position bucket, each arm's perplexity over dense's (top) and its next-token agreement
with dense (bottom), one column per length; the legend gives each arm's ratio over all positions.

    python benchmarks/report/plot_quality.py ruler benchmarks/results/quality_ruler_smollm2_forced.json \
        benchmarks/results/quality_ruler_smollm2_generate_4k.json \
        benchmarks/results/quality_ruler_smollm2_generate_8k.json --out docs/quality_ruler_smollm2.png
    python benchmarks/report/plot_quality.py ppl benchmarks/results/quality_ppl_smollm2.json \
        --out docs/quality_ppl_smollm2.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import read_results

# the order of `pisa eval`'s named arms; custom arms (name:knob=value) follow in file order
ARM_ORDER = ("dense", "pisa", "pisa_qt1", "flat_mean", "flat_lse")
DENSE_BAR = 0.9  # the bar, used when a file's meta has no summary


def _arms(rows: list[dict]) -> list[str]:
    seen = list(dict.fromkeys(r["impl"] for r in rows))
    return [a for a in ARM_ORDER if a in seen] + [a for a in seen if a not in ARM_ORDER]


def ruler_panels(results: list[dict]) -> dict[tuple[str, int], dict]:
    """Result files of `pisa eval ruler` -> ``{(mode, T): {"scores": {arm: {task: score}},
    "tasks": [task, ..., "average"], "too_hard": set of tasks}}``, from the rows over every depth
    (``depth`` None). Files of the same mode and length pool their arms (a later file's arm
    replaces an earlier one's)."""
    panels: dict[tuple[str, int], dict] = {}
    for result in results:
        meta = result["meta"]
        for r in result["rows"]:
            if r["op"] != "ruler" or r["depth"] is not None:
                continue
            key = (r["mode"], r["T"])
            panel = panels.setdefault(key, {"scores": {}, "tasks": [], "too_hard": set()})
            panel["scores"].setdefault(r["impl"], {})[r["task"]] = r["value"]
            if r["task"] not in panel["tasks"]:
                panel["tasks"].append(r["task"])
        for (mode, T), panel in panels.items():
            summary = meta.get("summary", {}).get(str(T))
            if meta.get("mode") == mode and summary is not None:
                panel["too_hard"] |= set(summary["too_hard_for_dense"])
    for panel in panels.values():
        panel["tasks"] = [t for t in panel["tasks"] if t != "average"] + ["average"]
        dense = panel["scores"].get("dense", {})
        if not panel["too_hard"]:  # no summary in the meta: apply the bar to the dense rows
            panel["too_hard"] = {t for t, v in dense.items() if t != "average" and v < DENSE_BAR}
    return dict(sorted(panels.items(), key=lambda kv: (kv[0][0] != "forced", kv[0])))


def ppl_panels(results: list[dict]) -> dict[int, dict]:
    """Result files of `pisa eval ppl` -> ``{T: {"buckets": [(lo, hi), ...], "ppl" / "ppl_ratio" /
    "agreement": {arm: [value per bucket]}, "all": {metric: {arm: value}}}}``; the bucket of every
    position (``lo == 1, hi == T``) goes to ``"all"``, the others sorted by position."""
    panels: dict[int, dict] = {}
    for result in results:
        for r in result["rows"]:
            if r["op"] != "ppl":
                continue
            panel = panels.setdefault(r["T"], {"cells": {}, "all": {}})
            if (r["lo"], r["hi"]) == (1, r["T"]):
                panel["all"].setdefault(r["metric"], {})[r["impl"]] = r["value"]
            else:
                panel["cells"][(r["metric"], r["impl"], r["lo"], r["hi"])] = r["value"]
    for panel in panels.values():
        cells = panel.pop("cells")
        panel["buckets"] = sorted({(lo, hi) for _, _, lo, hi in cells})
        for metric in ("ppl", "ppl_ratio", "agreement"):
            arms = _arms([{"impl": a} for m, a, _, _ in cells if m == metric])
            panel[metric] = {a: [cells.get((metric, a, lo, hi)) for lo, hi in panel["buckets"]]
                             for a in arms}
    return dict(sorted(panels.items()))


def _title(results: list[dict]) -> str:
    m = results[0]["meta"]
    dates = sorted({x["meta"]["date"][:10] for x in results})
    return (f"{m.get('model', '?')} ({m.get('dtype', '?')}) · {m['device']} · torch {m['torch']} · "
            f"triton {m['triton']} · {' / '.join(dates)}")


def plot_ruler(results: list[dict], out: str, plt) -> None:
    panels = ruler_panels(results)
    modes = list(dict.fromkeys(mode for mode, _ in panels))
    lengths = sorted({T for _, T in panels})
    arms = _arms([{"impl": a} for p in panels.values() for a in p["scores"]])
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    fig, axes = plt.subplots(len(modes), len(lengths), figsize=(7 * len(lengths), 3.6 * len(modes)),
                             squeeze=False, sharey=True)
    width = 0.8 / len(arms)
    for (mode, T), panel in panels.items():
        ax = axes[modes.index(mode)][lengths.index(T)]
        tasks = panel["tasks"]
        for i, arm in enumerate(arms):
            scores = panel["scores"].get(arm)
            if scores is None:
                continue
            for j, task in enumerate(tasks):
                if task not in scores:
                    continue
                hard = task in panel["too_hard"]
                ax.bar(j + (i - (len(arms) - 1) / 2) * width, scores[task], width,
                       color=colors[arm], alpha=0.45 if hard else 1.0,
                       hatch="//" if hard else None, edgecolor="white" if hard else None,
                       linewidth=0, label=arm if j == 0 else None)
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels([t + ("*" if t in panel["too_hard"] else "") for t in tasks],
                           rotation=30, ha="right", fontsize=8)
        ax.axvline(len(tasks) - 1.5, color="grey", lw=0.6)  # the average stands apart
        ax.axhline(DENSE_BAR, color="grey", lw=0.6, ls=":")
        missing = [a for a in arms if a not in panel["scores"]]
        note = f" (no rows: {', '.join(missing)})" if missing else ""
        ax.set_title(f"{mode}, T = {T}{note}", fontsize=10)
        ax.set_ylim(0, 1.05)
        ax.grid(True, axis="y", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("score")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="upper right", ncol=len(handles),
               fontsize=8)
    fig.suptitle(_title(results) + f"\n* hatched: dense < {DENSE_BAR} there "
                 "(too hard for the model at that length)", fontsize=9, x=0.4)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=100)


def plot_ppl(results: list[dict], out: str, plt) -> None:
    panels = ppl_panels(results)
    fig, axes = plt.subplots(2, len(panels), figsize=(6.5 * len(panels), 7), squeeze=False)
    for col, (T, panel) in enumerate(panels.items()):
        mids = [(lo + hi) / 2 for lo, hi in panel["buckets"]]
        for row, metric, label in ((0, "ppl_ratio", "perplexity / dense's"),
                                   (1, "agreement", "next-token agreement with dense")):
            ax = axes[row][col]
            for i, (arm, values) in enumerate(panel[metric].items()):
                whole = panel["all"].get(metric, {}).get(arm)
                ax.plot(mids, values, marker="o", ms=4, color=f"C{i}",
                        ls="--" if arm == "dense" else "-",
                        label=f"{arm} (all: {whole:.3f})" if whole is not None else arm)
            ax.set_xlabel("position (bucket middle, tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"T = {T}, {len(panel['buckets'])} buckets", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("ruler", "ppl"))
    ap.add_argument("paths", nargs="+", help="result files of `pisa eval <kind>`")
    ap.add_argument("--out", required=True, help="the image to write")
    args = ap.parse_args(argv)
    import matplotlib  # after the arguments: --help works without it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = read_results(args.paths)
    (plot_ruler if args.kind == "ruler" else plot_ppl)(results, args.out, plt)
    plt.close("all")


if __name__ == "__main__":
    main()
