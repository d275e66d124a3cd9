"""Learnability probe: train a dense small GPT (``pisa.eval.gpt``) on ONE synthetic task for a
fixed wall-clock time and log its answer loss and accuracy; several probes run side by side as
processes. It asks whether a task can be learned at all at a shape, apart from the mixed suite of
``benchmarks/quality/quality_train.py`` (where the retrieval tasks stayed at chance for every arm).
Every ``--log-every`` steps a point (step, seconds, loss, token accuracy and the arguments) is
printed as a JSON line and, with ``--json``, saved as a row of ``{"meta", "rows"}`` (``common``).

    python benchmarks/quality/quality_probe.py --task assoc_recall --T 256 --batch 64 \
        --seconds 200 --json probe.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import Results, default_device

from pisa.eval.gpt import GPT, GPTConfig
from pisa.eval.tasks import TASKS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="assoc_recall", choices=sorted(TASKS))
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--key-len", type=int, help="assoc_recall / needle key letters")
    ap.add_argument("--seconds", type=float, default=200.0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--json", help="the result file (meta and every point)")
    ap.add_argument("--device", default=default_device())
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = args.device
    model = GPT(GPTConfig(width=args.width, depth=args.depth, heads=args.heads,
                          kv_heads=args.heads, mlp_hidden=3 * args.width)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(dev).manual_seed(1)
    extra = {} if args.key_len is None else {"key_len": args.key_len}
    out = Results(args.json, dev)
    t0, step = time.time(), 0
    while time.time() - t0 < args.seconds:
        b = TASKS[args.task](args.batch, args.T, gen, **extra)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.startswith("cuda")):
            logits = model(b.tokens)[:, :-1]
        mask = b.answer[:, 1:]
        target = b.tokens[:, 1:][mask]
        loss = F.cross_entropy(logits[mask].float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_every == 0:
            acc = (logits[mask].argmax(-1) == target).float().mean()
            point = {"step": step, "sec": round(time.time() - t0, 1), "loss": round(loss.item(), 4),
                     "token_acc": round(acc.item(), 4), **{k: v for k, v in vars(args).items()
                                                           if k not in ("json", "device")}}
            out.add(point)
            out.save()


if __name__ == "__main__":
    main()
