"""The long-range copy (``examples/train.py --period T/2``) with each training recipe: the step
where the loss first falls below half of chance, against dense attention (issue 26's bar: no
later than 1.25x dense's step).

At ``P = T / 2`` the token to copy sits ~``T / (2C)`` blocks back, one of ~``T / C`` candidates:
the selection rarely shows it to a head at initialisation and gets no gradient, so plain PISA
stays at chance long after dense learns (``examples/train.py``'s docstring). The recipes give
the model a gradient-carrying view of every block: the gated compressed branch (the blocks' mean
keys and values) and a window branch (``docs/training.md``).

    python benchmarks/training/copy_recipes.py --seeds 0 1 2 --json benchmarks/results/copy_recipes_cpu.json

Runs ``--jobs`` processes at once, one CPU thread each.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"
ARMS = {"dense": ["--attn", "dense"], "pisa": [], "pisa_cmp": ["--compressed"],
        "pisa_cmp_win": ["--compressed", "--window", "2"]}


def run(arm: str, seed: int, args) -> dict:
    cmd = [sys.executable, str(TRAIN), "--seqlen", str(args.seqlen), "--period",
           str(args.seqlen // 2), "--steps", str(args.steps), "--seed", str(seed),
           "--log-every", "100", "--json", *ARMS[arm]]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row.update(arm=arm, T=args.seqlen, op="copy_train", impl=arm)
    print(f"{arm:13s} seed {seed}: learned at {row['learned_at']}, final loss "
          f"{row['final_loss']:.3f}, accuracy {row['final_accuracy']:.3f} "
          f"({row['seconds']:.0f} s)", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from common import command, meta, write_result
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: run(*job, args), jobs))
    write_result(args.json, meta("cpu", command()), rows)


if __name__ == "__main__":
    main()
