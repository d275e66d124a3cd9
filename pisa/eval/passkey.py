"""``pisa eval passkey``: PISA as a training-free drop-in for a pretrained model's attention.

Two measurements, each for the arms dense (sdpa), ``pisa`` (pyramid) and ``flat_mean`` — one
loaded model switched between them (``pisa.eval.model.set_arm``), so only the attention differs:

- passkey retrieval: a random 5-digit number hidden at a relative depth of repetitive filler text
  and asked for at the end; accuracy of greedy decoding (prefill and decode both through the arm).
  With ``--keys N > 1`` (multi-key), ``N`` doors each get their own key (the others at random
  depths) and the question names one door: the arm must tell the asked key from ``N - 1``
  look-alikes (task ``passkey_multi``).
- language modelling on held-out documents (``pisa.eval.corpus``; the documents after the ones
  ``pisa eval recall`` reads first): perplexity, and the share of positions whose argmax
  next token equals the dense model's, over all tokens and over the tokens past ``K * C`` (the
  first ``K`` blocks are attended in full, so PISA equals dense there).

Result file (``--json``): ``{"meta": {...}, "rows": [{"model", "task" ("passkey"|"lm"), "arm",
"T", "depth" (passkey only), "K", "C", "W", "samples", "metric", "value"}]}`` (passkey rows also
"keys", "new_tokens") with metrics
``accuracy`` (passkey) and ``ppl``, ``ppl_tail``, ``agreement``, ``agreement_tail`` (lm).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from ..ops.utils.config import SelectConfig
from .common import add_arm_arguments, add_model_arguments, check_common_arguments

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
# multi-key: a needle per door, the question about the first one
DOORS = ("red", "blue", "green", "amber", "violet", "silver", "orange", "white", "black", "gold",
         "pink", "grey", "brown", "purple", "yellow", "cyan")
DOOR_NEEDLE = "The pass key of the {door} door is {key}. Remember it. "
DOOR_QUESTION = "What is the pass key of the {door} door? The pass key of the {door} door is"


@dataclass
class PasskeyConfig:
    lengths: list[int] = field(default_factory=lambda: [2048])
    depths: list[float] = field(default_factory=lambda: [0.5])
    samples: int = 1                   # passkeys per (length, depth); documents per length for LM
    arms: list[str] = field(default_factory=lambda: ["dense", "pisa", "flat_mean"])
    topk: int = SelectConfig.topk
    block_size: int = SelectConfig.block_size
    beam: int | None = None
    backend: str = "auto"
    new_tokens: int = 8
    keys: int = 1                      # needles per prompt (> 1: multi-key, one asked)
    seed: int = 0
    log: object = field(default_factory=lambda: sys.stderr, repr=False)  # stderr when run


def passkey_prompt(tokenizer, length: int, depth: float, key: int,
                   others: tuple[tuple[float, int], ...] = ()) -> torch.Tensor:
    """``ids [1, T]`` with ``T <= length``: filler sentences with the needle holding ``key`` after
    a ``depth`` share of them, then the question. ``others`` ``(depth, key)`` pairs make it
    multi-key: every needle names its door (``DOORS``: the asked one first, then one per other
    key) and the question asks for the first door's key."""
    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids
    if others:
        if len(others) >= len(DOORS):
            raise ValueError(f"at most {len(DOORS)} keys a prompt, got {len(others) + 1}")
        needles = [(d, enc(DOOR_NEEDLE.format(door=DOORS[i], key=k)))
                   for i, (d, k) in enumerate(((depth, key),) + tuple(others))]
        question = enc(DOOR_QUESTION.format(door=DOORS[0]))
    else:
        needles, question = [(depth, enc(NEEDLE.format(key=key)))], enc(QUESTION)
    filler = enc(FILLER)
    n = (length - sum(len(x) for _, x in needles) - len(question)) // len(filler)
    if n < 1:
        raise ValueError(f"length {length} is too short for a passkey prompt")
    ids, done = [], 0
    for d, needle in sorted(needles, key=lambda x: x[0]):  # stable: the asked one first on ties
        at = round(d * n)
        ids += filler * (at - done) + needle
        done = at
    return torch.tensor([ids + filler * (n - done) + question])


def passkey_rows(model, tokenizer, cfg: PasskeyConfig, model_name: str) -> list[dict]:
    """Passkey accuracy rows per (arm, T, depth)."""
    from .model import set_arm

    device = next(model.parameters()).device
    rows = []
    for T in cfg.lengths:
        gen = torch.Generator().manual_seed(cfg.seed + T)  # keys do not depend on other lengths
        for depth in cfg.depths:
            keys = torch.randint(10000, 100000, (cfg.samples,), generator=gen).tolist()
            # look-alike keys at random depths (multi-key); prompt and answer stay within T
            # (SmolLM2's trained context is 8192)
            others = [tuple(zip(torch.rand(cfg.keys - 1, generator=gen).tolist(),
                                torch.randint(10000, 100000, (cfg.keys - 1,),
                                              generator=gen).tolist()))
                      if cfg.keys > 1 else () for _ in keys]
            prompts = [passkey_prompt(tokenizer, T - cfg.new_tokens, depth, key, o)
                       for key, o in zip(keys, others)]
            for arm in cfg.arms:
                set_arm(model, arm, **_knobs(cfg))
                hits = 0
                for key, ids in zip(keys, prompts):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = model.generate(ids.to(device), max_new_tokens=cfg.new_tokens,
                                             do_sample=False,
                                             attention_mask=torch.ones_like(ids, device=device))
                    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                    found = re.search(r"\d+", answer)
                    hits += found is not None and int(found.group()) == key
                    print(f"[passkey] T={ids.shape[1]} depth={depth} {arm}: key {key} answer "
                          f"{answer.strip()!r} ({time.perf_counter() - t0:.1f} s)",
                          file=cfg.log, flush=True)
                rows.append(_row(model_name, "passkey_multi" if cfg.keys > 1 else "passkey",
                                 arm, T, cfg, "accuracy", hits / cfg.samples, depth=depth,
                                 keys=cfg.keys, new_tokens=cfg.new_tokens))
    return rows


def lm_rows(model, documents: dict[int, list[torch.Tensor]], cfg: PasskeyConfig,
            model_name: str) -> list[dict]:
    """Perplexity (all tokens and past ``K * C``) and next-token agreement with the dense arm
    per (arm, T) on ``documents = {T: [ids [1, T], ...]}``."""
    from .model import set_arm
    from .ppl import next_token_stats

    device = next(model.parameters()).device
    tail = cfg.topk * cfg.block_size  # positions before it attend every block: PISA == dense
    rows = []
    for T, docs in documents.items():
        stats = {}
        for arm in ["dense"] + [a for a in cfg.arms if a != "dense"]:
            set_arm(model, arm, **_knobs(cfg))
            t0 = time.perf_counter()
            stats[arm] = [next_token_stats(model, ids.to(device)) for ids in docs]
            print(f"[lm] T={T} {arm}: {time.perf_counter() - t0:.1f} s", file=cfg.log, flush=True)
        for arm in cfg.arms:
            nll = torch.cat([n for n, _ in stats[arm]])
            agree = torch.cat([p == pd for (_, p), (_, pd) in zip(stats[arm], stats["dense"])])
            values = {"ppl": math.exp(float(nll.mean())),
                      "ppl_tail": math.exp(float(_tail(nll, docs, tail).mean())),
                      "agreement": float(agree.float().mean()),
                      "agreement_tail": float(_tail(agree, docs, tail).float().mean())}
            for metric, value in values.items():
                rows.append(_row(model_name, "lm", arm, T, cfg, metric, value))
            print(f"[lm] T={T} {arm}: " + " ".join(f"{m}={v:.4f}" for m, v in values.items()),
                  file=cfg.log, flush=True)
    return rows


def _tail(per_position: torch.Tensor, docs: list[torch.Tensor], start: int) -> torch.Tensor:
    """The entries of the concatenated per-document ``[T-1]`` vectors at positions >= start."""
    n = docs[0].shape[1] - 1
    return per_position.view(len(docs), n)[:, start:].reshape(-1)


def _knobs(cfg: PasskeyConfig) -> dict:
    return {"block_size": cfg.block_size, "topk": cfg.topk, "beam": cfg.beam,
            "backend": cfg.backend}


def _row(model_name, task, arm, T, cfg, metric, value, depth=None, **extra) -> dict:
    return {"model": model_name, "task": task, "arm": arm, "T": T, "depth": depth,
            "K": cfg.topk, "C": cfg.block_size, "W": cfg.beam or cfg.topk,
            "samples": cfg.samples, "metric": metric, "value": value, **extra}


def format_table(rows: list[dict]) -> str:
    """Markdown: passkey accuracy per (T, depth) and LM metrics per T, one column per arm."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["task"], r["T"], r["depth"], r["metric"], r["arm"]): r["value"] for r in rows}
    lines = ["| task | T | depth | metric | " + " | ".join(arms) + " |",
             "|---|---|---|---|" + "---|" * len(arms)]
    for task, T, depth, metric in dict.fromkeys((r["task"], r["T"], r["depth"], r["metric"])
                                                for r in rows):
        cells = [by.get((task, T, depth, metric, a)) for a in arms]
        lines.append(f"| {task} | {T} | {'' if depth is None else depth} | {metric} | "
                     + " | ".join("" if c is None else f"{c:.4g}" for c in cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[2048],
                   help="prompt / document lengths T in tokens (SmolLM2's context is 8192)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.5],
                   help="relative depths of the passkey in the filler (e.g. 0.1 0.5 0.9)")
    p.add_argument("--samples", type=int, default=1,
                   help="passkeys per (length, depth), and held-out documents per length")
    add_arm_arguments(p, default=("dense", "pisa", "flat_mean"))
    p.add_argument("--keys", type=int, default=1,
                   help="needles per prompt; > 1: multi-key (one door's key asked)")
    p.add_argument("--new-tokens", type=int, default=8,
                   help="tokens greedy decoding may write for the answer (the first number in "
                        "them is the answer; a model that restates the question first needs "
                        "more than the key's 5 digits)")
    p.add_argument("--no-lm", action="store_true", help="skip the perplexity / agreement part")
    add_model_arguments(p)


def check_arguments(args: argparse.Namespace) -> None:
    """The flags of this task the shared checks (``pisa.cli.check_flags``) leave:
    ``ValueError("argument --flag: ...")``."""
    if args.new_tokens < 1:
        raise ValueError(f"argument --new-tokens: must be >= 1, got {args.new_tokens}")
    if not 1 <= args.keys <= len(DOORS):
        raise ValueError(f"argument --keys: must be in [1, {len(DOORS)}], got {args.keys}")
    check_common_arguments(args)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from .corpus import HELD_OUT_SKIP, corpus, token_samples
    from ..results import write_result
    from .model import start_eval

    cfg = PasskeyConfig(lengths=args.lengths, depths=args.depths, samples=args.samples,
                        arms=args.arms, topk=args.topk, block_size=args.block_size,
                        beam=args.beam, backend=args.backend, keys=args.keys,
                        new_tokens=args.new_tokens)
    model, tokenizer, info, fields = start_eval("passkey", args, argv)
    info.update(filler=FILLER, needle=NEEDLE, question=QUESTION)
    if cfg.keys > 1:
        info.update(needle=DOOR_NEEDLE, question=DOOR_QUESTION, doors=DOORS[:cfg.keys])
    rows = []
    for T in cfg.lengths:
        t0 = time.perf_counter()
        rows += passkey_rows(model, tokenizer, replace(cfg, lengths=[T]), fields["model"])
        info["timings"][f"T={T}/passkey"] = round(time.perf_counter() - t0, 2)  # every arm
        write_result(args.json, info, rows)
    if not args.no_lm:
        info["corpus"] = corpus()[0]
        for T in cfg.lengths:
            docs = {T: token_samples(tokenizer, T, cfg.samples, skip=HELD_OUT_SKIP)}
            t0 = time.perf_counter()
            rows += lm_rows(model, docs, cfg, fields["model"])
            info["timings"][f"T={T}/lm"] = round(time.perf_counter() - t0, 2)
            write_result(args.json, info, rows)
    print(format_table(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0
