"""Does the selection find ONE sharp key? A single planted key in random keys, the last query.

Keys and the query are Gaussian (the query's logits ``scale * q . k`` have std 1); one key at a
random position outside the forced blocks gets ``z`` added to its logit. A selector "hits" when
the needle's block is among its K blocks. flat_lse scores every block exactly and finds it once
``z`` stands out of the block's noise; flat_mean scores block means, where the needle weighs
``1 / C``; the first wave's walk (``pisa v1``) prunes each level by LogSumExp over its children's
mean keys, so at level ``l`` the needle weighs ``1 / (C * g^(l-2))`` of its child's summary: the
deeper the walk (the longer the context for a fixed beam), the larger ``z`` must be to survive the
coarse levels. The default walk (``pisa``) ranks internal nodes by per-channel key bounds, which
do not dilute the needle (``docs/spec.md`` §11).
This isolates the walk's pruning from training effects (see ``docs/quality.md``).

    python benchmarks/quality/needle_walk.py --json benchmarks/results/needle_walk.json
    python benchmarks/quality/needle_walk.py --table benchmarks/results/needle_walk.json  # table
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import meta, read_results, write_result

from pisa import pisa_select

D, C, K = 64, 64, 16


V1 = dict(scorer="lse", beam_leaf=None)  # the first wave's walk: LSE of means, one beam


def _arms(beams, pisa_beams=()):
    """``pisa`` at the library defaults (the bound scorer, ``beam_leaf=32``), and with wider
    beams (``pisa W=w``: ``beam=w, beam_leaf=2w``, what a beam grown with the context gives at
    a length), the first wave's walk at each beam, the flat selectors."""
    return [("pisa", {})] + [(f"pisa W={w}", dict(beam=w, beam_leaf=2 * w)) for w in pisa_beams] \
        + [(f"pisa v1 W={w}", dict(beam=w, **V1)) for w in beams] + [
        ("flat_mean", dict(selector="flat_mean")), ("flat_lse", dict(selector="flat_lse"))]


def hit_rates(T: int, z: float, trials: int, beams, gen: torch.Generator,
              chunk: int = 25, pisa_beams=()) -> dict[str, float]:
    """Share of ``trials`` whose needle block each selector picks, last query of ``T`` keys."""
    arms = _arms(beams, pisa_beams)
    hits = {name: 0 for name, _ in arms}
    scale = D ** -0.5
    for s in range(0, trials, chunk):
        n = min(chunk, trials - s)
        q = torch.randn(n, 1, 1, D, generator=gen)
        k = torch.randn(n, T, 1, D, generator=gen)
        # not in the forced blocks (sink, previous, current: T is a multiple of C)
        pos = torch.randint(C, T - 2 * C, (n,), generator=gen)
        lift = z / (scale * q[:, 0, 0].pow(2).sum(-1))  # adds z to the needle's logit
        k[torch.arange(n), pos, 0] += lift[:, None] * q[:, 0, 0]
        block = (pos // C)[:, None]
        for name, kw in arms:
            idx, _ = pisa_select(q, k, block_size=C, topk=K, backend="torch", **kw)
            hits[name] += int((idx[:, 0, 0] == block).any(-1).sum())
    return {name: h / trials for name, h in hits.items()}


def markdown(rows: list[dict]) -> str:
    """Hit rate per (T, z), one column per selector."""
    names = list(dict.fromkeys(r["selector"] for r in rows))
    cells = {(r["T"], r["z"], r["selector"]): r["hit_rate"] for r in rows}
    out = ["| T | z | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for T, z in dict.fromkeys((r["T"], r["z"]) for r in rows):
        out.append(f"| {T} | {z:g} | " + " | ".join(f"{cells[T, z, n]:.2f}" for n in names)
                   + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--margins", type=float, nargs="+", default=[4.0, 6.0, 8.0, 12.0])
    ap.add_argument("--beams", type=int, nargs="+", default=[16, 32, 64],
                    help="beams of the first wave's walk (pisa v1 W=w)")
    ap.add_argument("--pisa-beams", type=int, nargs="*", default=[],
                    help="wider beams of the default walk (pisa W=w: beam=w, beam_leaf=2w)")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", help="print the markdown table of this results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(read_results([args.table])[0]["rows"]))
        return
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for T in args.lengths:
        for z in args.margins:
            rates = hit_rates(T, z, args.trials, args.beams, gen, pisa_beams=args.pisa_beams)
            rows += [{"T": T, "z": z, "selector": name, "K": K, "hit_rate": r}
                     for name, r in rates.items()]
            print(f"T={T} z={z:g}: " + ", ".join(f"{n} {r:.2f}" for n, r in rates.items()),
                  flush=True)
    if args.json:
        given = sys.argv[1:] if argv is None else argv
        m = meta("cpu", "python benchmarks/quality/needle_walk.py " + " ".join(given))
        m.update({"D": D, "C": C, "K": K, "branching": 2, "trials": args.trials,
                  "notes": "hit_rate = share of trials whose needle block is selected by the "
                           "last query; z = the needle's logit minus the mean logit (logit "
                           "std 1); forced blocks excluded from needle positions"})
        write_result(args.json, m, rows)
    print(markdown(rows))


if __name__ == "__main__":
    main()
