"""``pisa eval ppl``: perplexity of long documents per arm, by position, and agreement with dense.

Documents of ``T`` tokens from the offline corpus (``pisa.eval.corpus``; held out: the ones after
those ``pisa eval recall`` reads first). Per arm, one forward per document gives every position's
next-token loss and argmax prediction; the positions (of the predicted tokens, ``1 .. T-1``) are
cut into ``--buckets`` equal ranges, so a loss that appears only far from the start shows in the
last buckets instead of being averaged away. Dense (sdpa) always runs first: it is the reference
of ``agreement``, the share of positions whose argmax next token equals dense's.

Result file (``--json``): ``{"meta": {...}, "rows": [...]}``, rows in ``pisa.results``'s schema
(op "ppl", impl = the arm, ``ms`` the mean forward time per document) plus ``model``, ``layers``,
``context``, ``device``, ``samples`` (documents), ``lo`` / ``hi`` (the bucket: predicted
positions ``lo <= p < hi``; the whole document is ``1 .. T``), ``metric`` ("ppl", "agreement",
"ppl_ratio": the arm's perplexity over dense's) and ``value``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from .common import (DEFAULT_ARMS, add_arm_arguments, add_model_arguments,
                     check_common_arguments, eval_row, parse_arms, run_knobs, warn_past_context)

LM_CHUNK = 1024  # positions per lm_head call: the full [T, vocab] logits would be GBs at 8K


def next_token_stats(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of ``ids [1, T]`` (all but the last): the negative log-likelihood of the next
    token and the argmax prediction, ``([T-1] fp32, [T-1] int64)`` on the CPU; the lm_head runs in
    chunks so the ``[T, vocab]`` logits never exist at once."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        target = ids[0, 1:]
        nll, pred = [], []
        for s in range(0, hidden.shape[0], LM_CHUNK):
            logits = model.lm_head(hidden[s:s + LM_CHUNK]).float()
            nll.append(torch.nn.functional.cross_entropy(logits, target[s:s + LM_CHUNK],
                                                         reduction="none"))
            pred.append(logits.argmax(-1))
    return torch.cat(nll).cpu(), torch.cat(pred).cpu()


def bucket_edges(T: int, buckets: int) -> list[int]:
    """Edges ``1 = e0 < e1 < ... = T`` of ``buckets`` near-equal ranges of the predicted
    positions ``1 .. T-1`` (fewer when ``T - 1 < buckets``)."""
    return sorted({1 + (T - 1) * i // buckets for i in range(buckets + 1)})


@dataclass
class PplConfig:
    lengths: list[int] = field(default_factory=lambda: [8192])
    samples: int = 1                    # documents per length
    buckets: int = 8
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    knobs: dict = field(default_factory=dict)   # the run's: block_size, topk, beam, backend
    log: object = field(default_factory=lambda: sys.stderr, repr=False)  # stderr when run


def ppl_rows(model, documents: dict[int, list[torch.Tensor]], cfg: PplConfig, fields: dict,
             timings: dict | None = None) -> list[dict]:
    """Rows per (T, arm, bucket) and per (T, arm) over the whole document on ``documents =
    {T: [ids [1, T], ...]}``; dense is measured first whether asked or not (the reference) and
    reported when asked. ``timings`` (a dict) gets each (T, arm)'s seconds."""
    from .model import arm_fields, set_arm

    arms = parse_arms(cfg.arms, cfg.knobs)
    order = sorted(arms, key=lambda a: not a.dense)  # dense first
    if not order[0].dense:
        order.insert(0, parse_arms(["dense"])[0])
    device = next(model.parameters()).device
    rows = []
    for T, docs in documents.items():
        edges = bucket_edges(T, cfg.buckets)
        stats, dense_ppl = {}, {}
        for arm in order:
            set_arm(model, arm, **cfg.knobs)
            t0 = time.perf_counter()
            got = [next_token_stats(model, ids.to(device)) for ids in docs]
            seconds = time.perf_counter() - t0
            if timings is not None:
                timings[f"T={T}/{arm.name}"] = round(seconds, 2)
            nll = torch.stack([n for n, _ in got])                   # [docs, T-1]
            agree = torch.stack([p == pd for (_, p), (_, pd) in
                                 zip(got, stats.get("dense", got))]).float()
            stats.setdefault("dense", got)
            columns = arm_fields(model, arm)
            for lo, hi in [(1, T)] + list(zip(edges, edges[1:])):
                ppl = math.exp(float(nll[:, lo - 1:hi - 1].mean()))
                if arm.dense:
                    dense_ppl[lo, hi] = ppl
                values = {"ppl": ppl, "ppl_ratio": ppl / dense_ppl[lo, hi],
                          "agreement": float(agree[:, lo - 1:hi - 1].mean())}
                if arm in arms:
                    rows += [eval_row("ppl", columns, fields, T, 1000 * seconds / len(docs),
                                      samples=len(docs), lo=lo, hi=hi, metric=m, value=v)
                             for m, v in values.items()]
            print(f"[ppl] T={T} {arm.name}: ppl {math.exp(float(nll.mean())):.3f} by bucket "
                  + " ".join(f"{math.exp(float(nll[:, lo - 1:hi - 1].mean())):.2f}"
                             for lo, hi in zip(edges, edges[1:]))
                  + f" ({seconds:.1f} s)", file=cfg.log, flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown: per (T, bucket) the perplexity of each arm, with its agreement with dense."""
    arms = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["T"], r["lo"], r["hi"], r["impl"], r["metric"]): r["value"] for r in rows}
    lines = ["| T | positions | " + " | ".join(f"{a} ppl (agreement)" for a in arms) + " |",
             "|---|---|" + "---|" * len(arms)]
    for T, lo, hi in dict.fromkeys((r["T"], r["lo"], r["hi"]) for r in rows):
        cells = []
        for a in arms:
            p, g = by.get((T, lo, hi, a, "ppl")), by.get((T, lo, hi, a, "agreement"))
            cells.append("" if p is None else f"{p:.3f} ({g:.3f})")
        where = "all" if (lo, hi) == (1, T) else f"{lo}-{hi - 1}"
        lines.append(f"| {T} | {where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[8192],
                   help="document lengths T in tokens")
    p.add_argument("--samples", type=int, default=1, help="documents per length")
    p.add_argument("--buckets", type=int, default=8,
                   help="equal ranges of positions the loss is reported for")
    add_arm_arguments(p)
    add_model_arguments(p)


def check_arguments(args: argparse.Namespace) -> None:
    """The flags of this task the shared checks (``pisa.cli.check_flags``) leave:
    ``ValueError("argument --flag: ...")``."""
    if args.buckets < 1:
        raise ValueError(f"argument --buckets: must be >= 1, got {args.buckets}")
    if any(T < 2 for T in args.lengths):
        raise ValueError(f"argument --lengths: a document needs >= 2 tokens, got {args.lengths}")
    check_common_arguments(args)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from ..results import write_result
    from .corpus import HELD_OUT_SKIP, corpus, token_samples
    from .model import start_eval

    cfg = PplConfig(lengths=args.lengths, samples=args.samples, buckets=args.buckets,
                    arms=args.arms, knobs=run_knobs(args))
    model, tokenizer, info, fields = start_eval("ppl", args, argv)
    warn_past_context(fields, cfg.lengths, "ppl")
    info.update(corpus=corpus()[0], samples=cfg.samples, buckets=cfg.buckets)
    rows = []
    for T in cfg.lengths:
        docs = {T: token_samples(tokenizer, T, cfg.samples, skip=HELD_OUT_SKIP)}
        rows += ppl_rows(model, docs, cfg, fields, info["timings"])
        write_result(args.json, info, rows)
    print(format_table(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0
