"""``pisa eval recall``: does the pyramid find the blocks a full scan would, on real attention?

One dense prefill per document records every layer's post-RoPE queries and keys
(``pisa.eval.model.capture_qk``); per layer, selectors are scored against the exact flat scan
(``flat_lse``, the mass-optimal top-K): recall@K of its free blocks, the softmax mass the selected
blocks capture and that mass over ``flat_lse``'s. Selectors: the pyramid (``"pisa"``) at beam
W = K, 2K, 4K (and wider while some layer's recall is below the target and a wider beam can still
change the selection), ``flat_mean`` (mean-pooled block keys) and ``random`` (uniform over the
causal blocks, same forced blocks and budget).

Result file (``--json``): ``{"meta": {...}, "rows": [{"model", "layer", "T", "selector", "K", "W",
"recall", "mass", "mass_ratio"}]}``, values averaged over the documents (``meta["samples"]``);
``W`` is null for the flat and random selectors. ``meta["summary"]`` holds the per-length verdicts.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from ..ops.utils.config import CHUNK_ELEMS, SelectConfig
from ..ops.utils.geometry import cdiv
# The knobs every selector and arm starts from: the per-token walk (``pisa_select`` defaults to
# 16-token tiles since selection v2; the beam sweep and the recorded arms, e.g. ``qt1_w16:beam=16``
# in ``benchmarks/results/quality_recall_v2.json``, are on top of the per-token knobs).
from .common import add_model_arguments, check_common_arguments, parse_arms
from .gpt import PER_TOKEN
from .metrics import SelectionScorer

CUSTOM_BASE = "pisa_qt1"  # the arm an --arms name not of ARMS starts from: the per-token walk
FIELDS = ("model", "layer", "T", "selector", "K", "W", "recall", "mass", "mass_ratio")


@dataclass
class RecallConfig:
    lengths: list[int] = field(default_factory=lambda: [4096])
    layers: list[int] | None = None       # None: every layer
    samples: int = 1                      # documents per length
    topk: int = SelectConfig.topk
    block_size: int = SelectConfig.block_size
    branching: int = SelectConfig.branching
    beams: list[int] = field(default_factory=lambda: [1, 2, 4])  # W in multiples of K
    target: float = 0.95                  # recall the W search looks for
    # named pisa_select knob sets (selection v2: query_tile, beam_leaf, scorer, tile_reduce):
    # when given, each arm and flat_mean are measured instead of the beam sweep and random
    arms: dict[str, dict] | None = None
    backend: str = "auto"
    seed: int = 0
    log: object = field(default_factory=lambda: sys.stderr, repr=False)  # stderr when run


def random_select(batch: int, n_queries: int, n_keys: int, n_kv_heads: int, block_size: int,
                  topk: int, generator: torch.Generator | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Uniformly random blocks: ``block_idx [B, Tq, HKV, topk]`` int32 in ``pisa_select``'s format
    (ascending, -1 padded). The forced blocks (sink, previous, current) are always in, as for
    every selector; the rest of the budget is drawn without replacement from the earlier causal
    blocks. Queries are the last ``n_queries`` positions; chunked over queries."""
    n_blocks = cdiv(n_keys, block_size)
    blocks = torch.arange(n_blocks, device=device)
    step = max(1, CHUNK_ELEMS // (batch * n_kv_heads * n_blocks))
    out = []
    for s in range(0, n_queries, step):
        e = min(n_queries, s + step)
        cur = (torch.arange(n_keys - n_queries + s, n_keys - n_queries + e,
                            device=device) // block_size)[:, None, None]       # [Tc, 1, 1]
        forced = (blocks == 0) | (blocks == cur) | (blocks == cur - 1)          # [Tc, 1, NB]
        draw = torch.rand(batch, e - s, n_kv_heads, n_blocks, generator=generator,
                          device=generator.device if generator is not None else device)
        # forced blocks rank first (2), earlier causal blocks by the draw, future ones never (-1)
        score = torch.where(forced, 2.0, torch.where(blocks <= cur, draw.to(device), -1.0))
        top = score.topk(min(topk, n_blocks), dim=-1)
        idx = torch.where(top.values >= 0, top.indices, n_blocks).sort(-1).values
        idx = torch.where(idx == n_blocks, -1, idx)
        out.append(torch.nn.functional.pad(idx, (0, topk - idx.shape[-1]), value=-1))
    return torch.cat(out, dim=1).to(torch.int32)


class LayerQuality:
    """Selection quality on one layer's ``q [B, T, HQ, D]``, ``k [B, T, HKV, D]`` against the
    exact flat scan (``SelectionScorer``: its selection and the dense LSE computed once)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cfg: RecallConfig):
        self.cfg = cfg
        self.score = SelectionScorer(q, k, cfg.backend, block_size=cfg.block_size,
                                     topk=cfg.topk, branching=cfg.branching, **PER_TOKEN)

    def measure(self, selector: str, W: int | None = None,
                generator: torch.Generator | None = None) -> dict:
        """``{"selector", "W", "recall", "mass", "mass_ratio"}`` of ``selector`` ("pisa" at beam
        ``W``, "flat_mean" or "random")."""
        q, k, cfg = self.score.q, self.score.k, self.cfg
        if selector == "pisa":
            idx = self.score.select("pyramid", beam=W)
        elif selector == "flat_mean":
            idx = self.score.select("flat_mean")
        elif selector == "random":
            idx = random_select(q.shape[0], q.shape[1], k.shape[1], k.shape[2], cfg.block_size,
                                cfg.topk, generator, q.device)
        else:
            raise ValueError(f"selector must be 'pisa', 'flat_mean' or 'random', got {selector!r}")
        return {"selector": selector, "W": W, **self.score(idx)}

    def measure_arm(self, name: str, knobs: dict) -> dict:
        """The row of the selection at ``knobs`` (``pisa_select`` keywords on top of ``PER_TOKEN``,
        ``selector`` among them, default the pyramid; tile selections are scored per token, each
        token with its tile's blocks), named ``name``."""
        knobs = dict(knobs)
        idx = self.score.select(knobs.pop("selector", "pyramid"), **knobs)  # per token
        return {"selector": name, "W": knobs.get("beam", self.cfg.topk), **self.score(idx)}


def _widest_useful_beam(T: int, cfg: RecallConfig) -> int:
    """Beyond this W the walk keeps every node (``g * W >= leaves``): the selection is exact."""
    return cdiv(cdiv(T, cfg.block_size), cfg.branching)


def recall_rows(model, documents: dict[int, list[torch.Tensor]], cfg: RecallConfig,
                model_name: str) -> list[dict]:
    """Rows (``FIELDS``) for ``model`` on ``documents = {T: [ids [1, T], ...]}``, each value
    averaged over the documents of its length. Prints progress to ``cfg.log``."""
    from .model import capture_qk

    n_layers = model.config.num_hidden_layers
    layers = list(range(n_layers)) if cfg.layers is None else list(cfg.layers)
    if any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"layers must be in [0, {n_layers}), got {layers}")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    rows = []
    for T, docs in documents.items():
        beams = [m * cfg.topk for m in cfg.beams]
        sums: dict[tuple, list[float]] = {}
        for d, ids in enumerate(docs):
            t0 = time.perf_counter()
            with torch.no_grad(), capture_qk(model, set(layers)) as qk:
                model(ids.to(device), use_cache=False, logits_to_keep=1)
            print(f"[recall] T={T} doc {d + 1}/{len(docs)}: prefill {time.perf_counter() - t0:.1f}"
                  " s", file=cfg.log, flush=True)
            for layer in layers:
                t0 = time.perf_counter()
                q, k = qk.pop(layer)
                lq = LayerQuality(q, k, cfg)
                if cfg.arms:
                    got = [lq.measure_arm(n, kn) for n, kn in cfg.arms.items()]
                    if "flat_mean" not in cfg.arms:  # always the reference
                        got.append(lq.measure("flat_mean"))
                    _accumulate(sums, layer, got)
                    print(f"[recall] T={T} doc {d + 1} layer {layer}: "
                          + " ".join(f"{r['selector']}:{r['recall']:.3f}/{r['mass_ratio']:.4f}"
                                     for r in got)
                          + f" ({time.perf_counter() - t0:.1f} s)", file=cfg.log, flush=True)
                    continue
                got = [lq.measure("pisa", W) for W in beams]
                got += [lq.measure("flat_mean"), lq.measure("random", generator=generator)]
                pyr = {r["W"]: r["recall"] for r in got if r["selector"] == "pisa"}
                # widen the beam while this layer misses the target and wider can still help
                while pyr[max(pyr)] < cfg.target and max(pyr) < _widest_useful_beam(T, cfg):
                    got.append(lq.measure("pisa", 2 * max(pyr)))
                    pyr[got[-1]["W"]] = got[-1]["recall"]
                _accumulate(sums, layer, got)
                flat = next(r["recall"] for r in got if r["selector"] == "flat_mean")
                print(f"[recall] T={T} doc {d + 1} layer {layer}: pisa recall "
                      + " ".join(f"W={W}:{v:.3f}" for W, v in sorted(pyr.items()))
                      + f" | flat_mean {flat:.3f} ({time.perf_counter() - t0:.1f} s)",
                      file=cfg.log, flush=True)
        for (layer, selector, W), (rec, mass, ratio, n) in sorted(
                sums.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
            rows.append({"model": model_name, "layer": layer, "T": T, "selector": selector,
                         "K": cfg.topk, "W": W, "recall": rec / n, "mass": mass / n,
                         "mass_ratio": ratio / n})
    return rows


def _accumulate(sums: dict, layer: int, got: list[dict]) -> None:
    """Add one document's rows of ``layer`` to the per-(layer, selector, W) sums."""
    for r in got:
        acc = sums.setdefault((layer, r["selector"], r["W"]), [0.0, 0.0, 0.0, 0])
        for i, name in enumerate(("recall", "mass", "mass_ratio")):
            acc[i] += r[name]
        acc[3] += 1


def summarize_arms(rows: list[dict], arms: dict[str, dict]) -> dict[str, dict]:
    """Per length and arm: its knobs, mean recall, mean and worst-layer mass ratio over
    ``flat_lse`` (the bars of selection v2: mean >= 0.995, every layer >= 0.98)."""
    out = {}
    for T in sorted({r["T"] for r in rows}):
        out[str(T)] = {}
        for name in list(arms) + ["flat_mean"]:
            at = [r for r in rows if r["T"] == T and r["selector"] == name]
            if at:
                out[str(T)][name] = {
                    "knobs": arms.get(name, {}), "layers": len(at),
                    "mean_recall": sum(r["recall"] for r in at) / len(at),
                    "mean_mass_ratio": sum(r["mass_ratio"] for r in at) / len(at),
                    "min_mass_ratio": min(r["mass_ratio"] for r in at),
                    "worst_layer": min(at, key=lambda r: r["mass_ratio"])["layer"]}
    return out


def recall_arms(texts: list[str]) -> dict[str, dict]:
    """``--arms`` -> ``{name: pisa_select knobs}`` (``parse_arms``; names not of ``ARMS`` start
    from the per-token walk, ``CUSTOM_BASE``)."""
    return {a.name: a.knobs for a in parse_arms(texts, custom_base=CUSTOM_BASE)}


def _layer_recall(by: dict, layer: int, W: int) -> float:
    """Pyramid recall of ``layer`` at beam ``W``; a layer's beam search stops once it reaches the
    target, so wider beams read its widest measured one."""
    return by[(layer, "pisa", max(w for (i, s, w) in by if i == layer and s == "pisa" and w <= W))]


def summarize(rows: list[dict], target: float = 0.95) -> dict[str, dict]:
    """Per length: the share of layers where the pyramid at W = K recalls at least as much as
    flat_mean, mean recalls, and the smallest W whose recall reaches ``target`` in every layer
    (``w_target_all``) and on the mean over layers (``w_target_mean``; None if not reached)."""
    out = {}
    for T in sorted({r["T"] for r in rows}):
        at = [r for r in rows if r["T"] == T]
        K = at[0]["K"]
        by = {(r["layer"], r["selector"], r["W"]): r["recall"] for r in at}
        layers = sorted({r["layer"] for r in at})
        n = len(layers)
        wins = [by[(i, "pisa", K)] >= by[(i, "flat_mean", None)] for i in layers]
        widths = sorted({r["W"] for r in at if r["selector"] == "pisa"})
        all_ok = [W for W in widths if all(_layer_recall(by, i, W) >= target for i in layers)]
        mean_ok = [W for W in widths if sum(_layer_recall(by, i, W) for i in layers) / n >= target]
        out[str(T)] = {
            "layers": n, "K": K,
            "pisa_ge_flat_mean_layers": sum(wins), "pisa_ge_flat_mean_share": sum(wins) / n,
            "layers_pisa_below_flat_mean": [i for i, w in zip(layers, wins) if not w],
            "mean_recall_pisa_W=K": sum(by[(i, "pisa", K)] for i in layers) / n,
            "mean_recall_flat_mean": sum(by[(i, "flat_mean", None)] for i in layers) / n,
            "mean_recall_random": sum(by[(i, "random", None)] for i in layers) / n,
            "w_target_all": all_ok[0] if all_ok else None,
            "w_target_mean": mean_ok[0] if mean_ok else None}
    return out


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per (T, layer) with recall and mass ratio of each selector."""
    widths = sorted({r["W"] for r in rows if r["selector"] == "pisa"})
    head = [f"pisa W={W}" for W in widths] + ["flat_mean", "random"]
    lines = ["| T | layer | " + " | ".join(f"{h} recall / mass ratio" for h in head) + " |",
             "|---|---|" + "---|" * len(head)]
    by = {(r["T"], r["layer"], r["selector"], r["W"]): r for r in rows}
    for T, layer in sorted({(r["T"], r["layer"]) for r in rows}):
        cells = []
        for sel, W in [("pisa", W) for W in widths] + [("flat_mean", None), ("random", None)]:
            r = by.get((T, layer, sel, W))
            cells.append("" if r is None else f"{r['recall']:.3f} / {r['mass_ratio']:.3f}")
        lines.append(f"| {T} | {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[4096],
                   help="document lengths T in tokens (default 4096, the shortest where the "
                        "pyramid prunes at C=64, K=W=16; SmolLM2's context is 8192)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="layers to measure (default: every 6th and the last, SmolLM2's "
                        "0 6 12 18 24 29; '--layers -1' for all)")
    p.add_argument("--samples", type=int, default=1, help="documents per length")
    p.add_argument("--topk", type=int, default=16, help="blocks per query K")
    p.add_argument("--block-size", type=int, default=64, help="leaf block size C")
    p.add_argument("--branching", type=int, default=2, help="pyramid branching g")
    p.add_argument("--target", type=float, default=0.95,
                   help="recall the beam search (W = K, 2K, 4K, ...) looks for")
    p.add_argument("--arms", nargs="+", default=None, metavar="NAME:KNOB=V,...",
                   help="selections to compare instead of the beam sweep and random, each with "
                        "flat_mean: pisa, pisa_qt1, flat_lse, flat_mean or NAME:KNOB=V,... (a NAME "
                        "not among those starts from the per-token walk: query_tile=1, "
                        "scorer=lse, tile_reduce=sum; e.g. 'qt16:query_tile=16,beam_leaf=32,"
                        "tile_reduce=qmean')")
    add_model_arguments(p)


def default_layers(n_layers: int) -> list[int]:
    """Every 6th layer and the last (SmolLM2's 30: 0 6 12 18 24 29)."""
    return sorted(set(range(0, n_layers, 6)) | {n_layers - 1})


def check_arguments(args: argparse.Namespace) -> None:
    """The flags of this task the shared checks (``pisa.cli.check_flags``) leave:
    ``ValueError("argument --flag: ...")``."""
    if args.layers is not None and args.layers != [-1] and any(i < 0 for i in args.layers):
        raise ValueError(f"argument --layers: layer indices must be >= 0 (or '--layers -1' for "
                         f"all), got {args.layers}")
    if not 0 < args.target <= 1:
        raise ValueError(f"argument --target: must be in (0, 1], got {args.target}")
    if args.arms and "dense" in args.arms:
        raise ValueError("argument --arms: recall scores selections; dense selects nothing")
    check_common_arguments(args, custom_base=CUSTOM_BASE)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from .corpus import corpus, token_samples
    from ..results import write_result
    from .model import start_eval

    model, tokenizer, info, fields = start_eval("recall", args, argv)
    layers = default_layers(fields["layers"]) if args.layers is None else (
        None if args.layers == [-1] else args.layers)
    cfg = RecallConfig(lengths=args.lengths, layers=layers, samples=args.samples,
                       topk=args.topk, block_size=args.block_size, branching=args.branching,
                       target=args.target, backend=args.backend,
                       arms=recall_arms(args.arms) if args.arms else None)
    source = corpus()[0]
    print(f"[recall] documents: {source}", file=cfg.log, flush=True)
    info.update(corpus=source, samples=cfg.samples, C=cfg.block_size, g=cfg.branching,
                target=cfg.target)
    rows = []
    for T in cfg.lengths:
        docs = {T: token_samples(tokenizer, T, cfg.samples)}
        t0 = time.perf_counter()
        rows += recall_rows(model, docs, cfg, fields["model"])
        info["timings"][f"T={T}"] = round(time.perf_counter() - t0, 2)  # prefill + selections
        info["summary"] = summarize_arms(rows, cfg.arms) if cfg.arms else \
            summarize(rows, cfg.target)
        write_result(args.json, info, rows)
    if cfg.arms:
        print("| T | arm | knobs | mean recall | mean mass ratio | worst layer (mass ratio) |\n"
              "|---|---|---|---|---|---|")
        for T, by in info["summary"].items():
            for name, s in by.items():
                print(f"| {T} | {name} | {s['knobs']} | {s['mean_recall']:.3f} | "
                      f"{s['mean_mass_ratio']:.4f} | {s['worst_layer']} "
                      f"({s['min_mass_ratio']:.4f}) |")
        return 0
    print(format_table(rows))
    for T, s in info["summary"].items():
        print(f"T={T}: pisa (W=K) recall >= flat_mean in {s['pisa_ge_flat_mean_layers']}/"
              f"{s['layers']} layers; mean recall pisa {s['mean_recall_pisa_W=K']:.3f}, "
              f"flat_mean {s['mean_recall_flat_mean']:.3f}, random "
              f"{s['mean_recall_random']:.3f}; W for recall >= {cfg.target}: every layer "
              f"{s['w_target_all']}, layer mean {s['w_target_mean']}")
    if args.json:
        print(f"wrote {args.json}")
    return 0
