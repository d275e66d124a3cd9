"""Render the ``quality_trained.json`` of ``benchmarks/quality/quality_train.py`` as a markdown
page (mean +- std over seeds per task, arm, schedule and test length; LM loss against dense; the
pisa runs re-evaluated with wider walks; where PISA loses) and its plot (skipped when matplotlib
is missing). The defaults render the current suite, ``docs/quality_trained_v2.md``:

    python benchmarks/quality/quality_tables.py benchmarks/results/quality_trained_v2.json \\
        benchmarks/results/quality_trained_v2_b.json \\
        --md docs/quality_trained_v2.md --png docs/quality_trained_v2.png

Several files (launches of one protocol that ran different arms) render as one: their rows and
runs are pooled, the first file's meta heads the page and every launch's command is listed.
``FILE:arm,arm`` takes only those arms of a file (an arm re-run at equal steps in a later launch
replaces the earlier launch's cut runs).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import header, read_results

RETRIEVAL = ("needle_single", "needle_multi", "assoc_recall", "var_track")
ARM_ORDER = ("dense", "pisa", "pisa_qt1", "pisa_mass", "pisa_cmp", "pisa_cmp_win", "flat_mean",
             "flat_lse", "nsa")
HARD = ("aggregate",)


def _config_key(c):
    arm, K, schedule = c
    return (ARM_ORDER.index(arm), K or 0, schedule)


def _label(c) -> str:
    arm, K, schedule, *W = c
    return (arm + (f" K={K}" if K else "") + (f" W={W[0]}" if W else "")
            + (" (dense warm-up)" if schedule == "warmup" else ""))


class Results:
    """Values grouped by (task, config, test_T), config = (arm, K, schedule)."""

    def __init__(self, result: dict):
        self.meta, self.rows = result["meta"], result["rows"]
        self.cells: dict[tuple, list[float]] = {}
        self.by_seed: dict[tuple, dict[int, float]] = {}
        for r in self.rows:
            key = (r["task"], (r["arm"], r["K"], r["schedule"]), r["test_T"])
            self.cells.setdefault(key, []).append(r["value"])
            self.by_seed.setdefault(key, {})[r["seed"]] = r["value"]
        # the pisa runs re-evaluated with a wider walk: config (arm, K, schedule, W), W "grown"
        # for beams grown past the training length (beam_ref_len)
        for r in result.get("beam_rows", []):
            W = "grown" if r["W"] is None else r["W"]
            key = (r["task"], (r["arm"], r["K"], r["schedule"], W), r["test_T"])
            self.cells.setdefault(key, []).append(r["value"])
        self.wide = sorted({k[1] for k in self.cells if len(k[1]) == 4},
                           key=lambda c: (_config_key(c[:3]), isinstance(c[3], str), str(c[3])
                                          if isinstance(c[3], str) else c[3]))
        self.tasks = sorted({k[0] for k in self.cells}, key=lambda t: (
            t.startswith("lm"), (RETRIEVAL + HARD + (t,)).index(t), t))
        self.configs = sorted({k[1] for k in self.cells if len(k[1]) == 3}, key=_config_key)
        self.lengths = sorted({k[2] for k in self.cells})

    def stats(self, task, config, T):
        v = self.cells.get((task, config, T))
        if not v:
            return None
        return statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)

    def paired_gap(self, task, config, T):
        """Per-seed gap of ``config`` to dense in % of dense (the runs of a seed share their
        initialisation, data and dense start): ``(mean, std, n)`` over the seeds both have."""
        a = self.by_seed.get((task, config, T), {})
        d = self.by_seed.get((task, ("dense", None, "sparse"), T), {})
        gaps = [100 * (a[s] / d[s] - 1) for s in sorted(set(a) & set(d))]
        if not gaps:
            return None
        return statistics.mean(gaps), statistics.stdev(gaps) if len(gaps) > 1 else 0.0, len(gaps)

    def mean(self, task, config, T):
        s = self.stats(task, config, T)
        return None if s is None else s[0]

    def partner(self, arm: str, K, schedule: str):
        """The config of ``arm`` to compare with: same schedule when trained, else "sparse"."""
        for c in ((arm, K, schedule), (arm, K, "sparse")):
            if c in self.configs:
                return c
        return None


def _num(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _cell(s, fmt=".3f") -> str:
    if s is None:
        return "-"
    m, sd, n = s
    return f"{m:{fmt}} ± {sd:{fmt}}" + ("" if n == 3 else f" (n={n})")


def task_table(res: Results, task: str) -> str:
    head = "| arm | " + " | ".join(f"T={T}" for T in res.lengths) + " |"
    lines = [head, "|---|" + "---|" * len(res.lengths)]
    for c in res.configs:
        cells = [_cell(res.stats(task, c, T)) for T in res.lengths]
        if any(x != "-" for x in cells):
            lines.append(f"| {_label(c)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def beam_table(res: Results, task: str) -> str:
    """A pisa config at W = K (its trained walk), the same weights at the wider beams, and the
    flat selectors and dense for reference."""
    head = "| arm | " + " | ".join(f"T={T}" for T in res.lengths) + " |"
    lines = [head, "|---|" + "---|" * len(res.lengths)]
    base = sorted({c[:3] for c in res.wide}, key=_config_key)
    refs = [c for c in res.configs if not c[0].startswith("pisa") and c[2] == "sparse"]
    for c in [x for b in base for x in [b] + [w for w in res.wide if w[:3] == b]] + refs:
        lines.append(f"| {_label(c)} | "
                     + " | ".join(_cell(res.stats(task, c, T)) for T in res.lengths) + " |")
    return "\n".join(lines)


def lm_table(res: Results, task: str) -> str:
    dense = ("dense", None, "sparse")
    head = "| arm | " + " | ".join(f"T={T} | vs dense | paired" for T in res.lengths) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(res.lengths)]
    for c in res.configs:
        cells = []
        for T in res.lengths:
            s, d = res.stats(task, c, T), res.mean(task, dense, T)
            cells.append(_cell(s, ".4f"))
            cells.append("-" if s is None or d is None else f"{100 * (s[0] / d - 1):+.2f}%")
            g = res.paired_gap(task, c, T) if c != dense else None
            cells.append("-" if g is None else f"{g[0]:+.2f}% ± {g[1]:.2f}")
        lines.append(f"| {_label(c)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def where_pisa_loses(res: Results) -> list[str]:
    """Every (task, length, schedule) where a PISA config is worse than a flat selector at the
    same K or than dense, with the gap and the seed spreads."""
    out = []
    for c in res.configs:
        arm, K, schedule = c
        if not arm.startswith("pisa"):
            continue
        for other_arm in ("flat_mean", "flat_lse", "dense"):
            other = res.partner(other_arm, None if other_arm == "dense" else K, schedule)
            if other is None:
                continue
            for task in res.tasks:
                sign = -1 if task.startswith("lm") else 1  # loss: lower is better
                for T in res.lengths:
                    a, b = res.stats(task, c, T), res.stats(task, other, T)
                    if a is None or b is None or sign * (a[0] - b[0]) >= 0:
                        continue
                    gap = abs(a[0] - b[0])
                    beyond = "beyond" if gap > a[1] + b[1] else "within"
                    out.append(f"- {task} T={T}: {_label(c)} {a[0]:.4g} vs {_label(other)} "
                               f"{b[0]:.4g} (gap {gap:.3g}, {beyond} the summed seed std "
                               f"{a[1] + b[1]:.3g})")
    return out


# a task counts as learned when dense answers at least this share of its questions
LEARNED = 0.2


def within_dense(res: Results, c, task: str, T: int) -> bool:
    """``c``'s mean is at least dense's mean less dense's seed spread (sample std; for a loss:
    at most its mean plus the spread)."""
    a, d = res.stats(task, c, T), res.stats(task, ("dense", None, "sparse"), T)
    if task.startswith("lm"):
        return a[0] <= d[0] + d[1]
    return a[0] >= d[0] - d[1]


def below(res: Results, c, other, task: str, T: int) -> bool:
    """``c``'s mean accuracy is below ``other``'s (False where either has no rows)."""
    a, b = res.mean(task, c, T), res.mean(task, other, T)
    return a is not None and b is not None and a < b


def checks(res: Results) -> list[str]:
    """The issue's acceptance criteria, evaluated on the means over seeds."""
    out = []
    train_T = res.meta.get("config", {}).get("train_T")
    dense = ("dense", None, "sparse")
    learned = [t for t in res.tasks if not t.startswith("lm")
               and (res.mean(t, dense, train_T) or 0) >= LEARNED]
    unlearned = [t for t in RETRIEVAL if t not in learned]
    if unlearned:
        out.append(f"- not learned even by dense (accuracy < {LEARNED} at T={train_T}): "
                   f"{', '.join(unlearned)} — comparisons between arms on these tasks are noise "
                   "around chance, not evidence either way")
    for c in res.configs:
        arm, K, schedule = c
        if not arm.startswith("pisa"):
            continue
        if res.stats("lm", dense, train_T) is not None:
            bad = [t for t in learned if res.stats(t, c, train_T) is not None
                   and not within_dense(res, c, t, train_T)]
            out.append(f"- {_label(c)} within dense's seed spread at T={train_T} on every task "
                       f"dense learns ({', '.join(learned)}): "
                       + ("PASS" if not bad else "FAIL (" + ", ".join(bad) + ")"))
        fm = res.partner("flat_mean", K, schedule)
        if fm is not None and train_T in res.lengths:
            bad = [t for t in RETRIEVAL if below(res, c, fm, t, train_T)]
            out.append(f"- {_label(c)} ≥ {_label(fm)} on every retrieval task at T={train_T}: "
                       + ("PASS" if not bad else "FAIL (" + ", ".join(bad) + ")"))
        longer = [T for T in res.lengths if T > (train_T or 0)]
        if fm is not None and longer:
            for wide in [c] + [w for w in res.wide if w[:3] == c]:
                bad = [f"{t}@{T}" for t in RETRIEVAL for T in longer
                       if below(res, wide, fm, t, T)]
                out.append(f"- {_label(wide)} ≥ {_label(fm)} on every retrieval task beyond the "
                           f"training length: "
                           f"{'PASS' if not bad else 'FAIL (' + ', '.join(bad) + ')'}"
                           + ("" if wide is c else " — same weights, wider walk (not the bar)"))
        d, p = res.mean("lm", ("dense", None, "sparse"), train_T), res.mean("lm", c, train_T)
        if d is not None and p is not None:
            gap, paired = 100 * (p / d - 1), res.paired_gap("lm", c, train_T)
            out.append(f"- {_label(c)} validation LM loss at T={train_T} within 1% of dense: "
                       f"{gap:+.2f}% {'PASS' if gap <= 1 else 'FAIL'} (per seed: "
                       f"{paired[0]:+.2f}% ± {paired[1]:.2f}); within 0.5% (issue 26): "
                       f"{'PASS' if gap <= 0.5 else 'FAIL'}")
        out += _against_nsa(res, c, train_T)
    return out


def _against_nsa(res: Results, c, train_T: int) -> list[str]:
    """Issue 26's peer bar for ``c``: at least NSA's (same K, trained from step 0) on LM loss at
    the training length and on every retrieval task at every length tested."""
    nsa = res.partner("nsa", c[1], "sparse")
    if nsa is None or c[1] is None:
        return []
    worse = [f"lm@{train_T}"] if (res.mean("lm", c, train_T) or 0) > (
        res.mean("lm", nsa, train_T) or float("inf")) else []
    worse += [f"{t}@{T}" for t in RETRIEVAL for T in res.lengths if below(res, c, nsa, t, T)]
    return [f"- {_label(c)} ≥ {_label(nsa)} on LM loss at T={train_T} and on every retrieval "
            f"task at every length (issue 26): " + ("PASS" if not worse else
                                                    "FAIL (" + ", ".join(worse) + ")")]


def runs_table(meta: dict) -> str:
    lines = ["| run | lr | steps | target | s/step (calibration) | train s | eval s | status |",
             "|---|---|---|---|---|---|---|---|"]
    paces = (meta.get("calibration") or {}).get("sec_per_step", {})
    for r in meta.get("runs", []):
        pace = paces.get(r["name"])
        lines.append(f"| {r['name']} | {r['lr']:g} | {r.get('steps')} | {r.get('target_steps')} "
                     f"| {'-' if pace is None else f'{pace:.3f}'} | {r.get('train_seconds')} "
                     f"| {r.get('eval_seconds')} | {r.get('status')} |")
    return "\n".join(lines)


def sweep_table(meta: dict) -> str:
    lines = ["| lr | steps | LM loss (train T) | mean task accuracy (train T) |",
             "|---|---|---|---|"]
    for s in meta.get("lr_sweep", []):
        lines.append(f"| {s['lr']:g} | {s['steps']} | {_num(s['lm_loss'])} | "
                     f"{_num(s['mean_task_accuracy'])} |")
    return "\n".join(lines)


def markdown(res: Results, png: str | None) -> str:
    cfg = res.meta.get("config", {})
    launches = res.meta.get("launches", [])
    parts = ["# Trained-model quality: dense vs PISA vs flat selectors", "", header(res.meta)]
    if len(launches) > 1:
        parts += ["Launches pooled on this page: "
                  + "; ".join(f"`{m['command']}` ({m['date']}"
                              + (f"; arms taken: {', '.join(m['arms'])}" if m.get("arms") else "")
                              + ")" for m in launches), ""]
    parts += [
             "Small GPTs (`pisa/eval/gpt.py`) trained at T = "
             f"{cfg.get('train_T')} on language modelling plus the synthetic tasks of "
             "`pisa/eval/tasks.py`, one model per run, evaluated at every length below. "
             "Protocol: `benchmarks/quality/quality_train.py` (docstring). Cells: mean ± std "
             "over seeds (sample std; n = 3 unless shown). Accuracy = exact match per "
             "question; loss = next-byte cross-entropy (nats) on held-out code "
             f"({', '.join(res.meta.get('corpus', {}).get('val_packages', []))}).", "",
             f"Model: width {cfg.get('width')}, {cfg.get('depth')} layers, {cfg.get('heads')} "
             f"query / {cfg.get('kv_heads')} KV heads, MLP {cfg.get('mlp')}; batch "
             f"{cfg.get('batch')} rows; lr {cfg.get('lr')}; C = {cfg.get('block_size')}, "
             "W = K.", ""]
    if png:
        parts += [f"![quality]({Path(png).name})", ""]
    parts += ["## Acceptance checks", ""] + (checks(res) or ["- (no pisa rows)"]) + [""]
    for task in res.tasks:
        parts += [f"## {task}", ""]
        parts += [lm_table(res, task) if task.startswith("lm") else task_table(res, task), ""]
    if res.wide:
        parts += ["## PISA with wider walks (same weights)", "",
                  "Each pisa run re-evaluated with beam W > K (selection keeps K blocks; the "
                  "walk prunes less): how much of pisa's gap is the walk's pruning rather than "
                  "the trained model.", ""]
        for task in (t for t in res.tasks if not t.startswith("lm")):
            parts += [f"### {task}", "", beam_table(res, task), ""]
    losses = where_pisa_loses(res)
    parts += ["## Where PISA loses", "",
              "Every cell where a PISA arm's mean is worse than flat_mean / flat_lse at the same "
              "K (same schedule where trained) or than dense:", ""]
    parts += (losses or ["- nowhere"]) + [""]
    sweeps = res.meta.get("lr_sweep", [])
    parts += ["## Learning rate (dense only)", "", sweep_table(res.meta), ""]
    if len({s["lr"] for s in sweeps}) < 2:
        parts += ["No sweep runs in this launch: its learning rate comes from an earlier "
                  "launch's sweep (`docs/quality.md`).", ""]
    parts += ["## Runs", "", runs_table(res.meta), ""]
    stems = res.meta.get("stems") or []
    if stems:
        parts += [f"Shared dense start (`--share-start`): the first {stems[0].get('steps')} "
                  "steps of every run of a seed (every arm attends every block there) were "
                  "trained once, by a dense stem, and resumed: "
                  + "; ".join(f"{s['name']} {s.get('status')}, {s.get('train_seconds')} s"
                              for s in stems)
                  + ". A run's train s counts its own steps only.", ""]
    return "\n".join(parts)


def plot(res: Results, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    n = len(res.tasks)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, task in zip(axes.flat, res.tasks):
        for c in res.configs:
            pts = [(T, res.stats(task, c, T)) for T in res.lengths]
            pts = [(T, s) for T, s in pts if s is not None]
            if pts:
                ax.errorbar([T for T, _ in pts], [s[0] for _, s in pts],
                            yerr=[s[1] for _, s in pts], label=_label(c), capsize=3,
                            linestyle="--" if c[2] == "warmup" else "-", marker="o", ms=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(res.lengths, [f"{T // 1024}K" for T in res.lengths])
        ax.set_title(task)
        ax.set_ylabel("loss (nats)" if task.startswith("lm") else "accuracy")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(f"trained at T={res.meta.get('config', {}).get('train_T')}; mean ± std over "
                 "seeds vs test length")
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(path, dpi=110)
    return True


def pool(results: list[dict]) -> dict:
    """One result from several launches: rows, beam rows, runs and sweeps pooled; the first
    launch's meta, with every launch's command and date under ``launches``."""
    meta = dict(results[0]["meta"])
    meta["launches"] = [{k: r["meta"].get(k) for k in ("command", "date", "arms")}
                        for r in results]
    for key in ("runs", "lr_sweep"):
        meta[key] = [x for r in results for x in r["meta"].get(key, [])]
    meta["calibration"] = {"sec_per_step": {k: v for r in results for k, v in (
        (r["meta"].get("calibration") or {}).get("sec_per_step", {}).items())}}
    return {"meta": meta, "rows": [x for r in results for x in r["rows"]],
            "beam_rows": [x for r in results for x in r.get("beam_rows", [])]}


def only_arms(result: dict, arms: set[str]) -> dict:
    """``result`` with the rows, beam rows and runs of ``arms`` only."""
    meta = dict(result["meta"], arms=sorted(arms),
                runs=[r for r in result["meta"].get("runs", []) if r["arm"] in arms])
    return {"meta": meta, "rows": [r for r in result["rows"] if r["arm"] in arms],
            "beam_rows": [r for r in result.get("beam_rows", []) if r["arm"] in arms]}


def read(specs: list[str]) -> list[dict]:
    """The result files of ``specs`` (``PATH`` or ``PATH:arm,arm``), arms selected."""
    split = [[spec] if spec.endswith(".json") else spec.rsplit(":", 1) for spec in specs]
    results = read_results([s[0] for s in split])
    return [only_arms(r, set(s[1].split(","))) if len(s) > 1 else r
            for r, s in zip(results, split)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="*", metavar="FILE[:arm,arm]", default=["benchmarks/results/quality_trained_v2.json",
                                                "benchmarks/results/quality_trained_v2_b.json"])
    ap.add_argument("--md", default="docs/quality_trained_v2.md")
    ap.add_argument("--png", default="docs/quality_trained_v2.png")
    args = ap.parse_args(argv)
    results = read(args.json)
    res = Results(results[0] if len(results) == 1 else pool(results))
    png = args.png if args.png and plot(res, args.png) else None
    Path(args.md).write_text(markdown(res, png))
    print(f"wrote {args.md}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
