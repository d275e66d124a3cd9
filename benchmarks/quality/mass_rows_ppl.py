"""``pisa eval ppl`` with ``tile_reduce="mass"`` scoring fewer rows a tile than the library does:
``--mass-rows R`` sets ``pisa.ops.utils.config.MASS_ROWS`` (64) before the run, so a model with few
heads a group samples tokens as a wide-group model would (SmolLM2, G = 3 padded to 4:
``--mass-rows 16`` scores 4 tokens of a 16-token tile, the share config A's G = 16 gets at 64).
Every other argument goes to ``pisa eval ppl``.

    python benchmarks/quality/mass_rows_ppl.py --mass-rows 16 --device cpu --lengths 8192 \
        --samples 2 --buckets 4 --arms dense mass16:tile_reduce=mass \
        --json benchmarks/results/quality_ppl_smollm2_mass_rows16_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys

import pisa.ops.utils.config as config
from pisa.cli import main as pisa_main


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--mass-rows", type=int, required=True)
    args, rest = ap.parse_known_args()
    saved, config.MASS_ROWS = config.MASS_ROWS, args.mass_rows
    try:
        code = pisa_main(["eval", "ppl", *rest])
    finally:
        config.MASS_ROWS = saved
    if "--json" in rest:
        note_rows(rest[rest.index("--json") + 1], args.mass_rows)
    return code


def note_rows(path: str, mass_rows: int) -> None:
    """Record the override and this script's command line in the result's meta."""
    with open(path) as f:
        result = json.load(f)
    result["meta"].update(mass_rows=mass_rows,
                          command="python benchmarks/quality/mass_rows_ppl.py " + " ".join(sys.argv[1:]))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
