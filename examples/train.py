"""Train a small GPT whose attention is PISA (``pisa.PisaAttention``) on a task it learns on a CPU
in a minute or two, printing the loss against chance as it goes.

The task (``repeat_batch``): each row is a random segment of ``P`` tokens (vocabulary ``V``)
repeated to fill the row, so from position ``P`` on every token equals the one ``P`` positions
back. Loss and accuracy count those tokens only; chance is ``ln V`` (4.159 for V = 64) and
``1 / V``.

What it exercises. PISA gives every query tile ``topk`` blocks of ``block_size`` (C) keys: the
sink (block 0), the previous and the current block are always in (forced), the other
``topk - 3`` are chosen by the pyramid walk over the keys. With ``P > 2C`` (default P = 40,
C = 16) the token to copy is never in the previous or current block, so the model can learn the
task only through blocks the selection picked. The selection has no gradient: it ranks blocks
by the same ``q . k`` that attention learns. Wherever the walk happens to show a head the block
``P`` back, that head learns to look ``P`` back (a relative position, through RoPE), and then
the walk ranks that block first everywhere. The ``found`` column follows it: the share of
copied tokens whose source block the best-placed head selects: at the defaults 0.62 after the
first step, 0.94 at step 40 while the loss is still at chance, 1.00 from step 60.

When (measured on CPU; defaults: T = 256, C = 16, topk = 6, width 64, depth 2, batch 16,
lr 3e-3): the loss falls below half of chance (2.08) at step 64 / 65 / 64 (seeds 0 / 1 / 2)
with PISA and at step 58 / 59 / 59 with ``--attn dense``; both reach accuracy 1.00 by step
~80-100. With ``--topk 4`` (one selected block) PISA gets there at step 84 and levels off near
accuracy 0.97 (the best head's ``found`` stays at 0.61: a tile of 16 queries needs two source
blocks, so heads share the work). The 150 steps take about a minute on one CPU thread (dense:
25 s).

What the selection alone is slow at: retrieval it seldom stumbles on. With ``--period`` half the
sequence the source block is one of ~``T / C`` candidates that the walk at initialisation rarely
shows a head, and no gradient tells the selection where to look: at ``--seqlen 512 --period 256``
the loss falls below half of chance at step 99 / 61 / 90 with PISA against 65 / 59 / 68 with dense
attention (seeds 0 / 1 / 2, ``benchmarks/training/copy_recipes.py``); ``--compressed`` (a gated
branch over every block's mean key and value, whose gradient trains them) 66 / 73 / 80
(``docs/training.md``).

    python examples/train.py                  # PISA, 150 steps, ~1 min on CPU
    python examples/train.py --attn dense     # the same model with dense (SDPA) attention
    python examples/train.py --seqlen 64 --block-size 4 --period 10 --vocab 16 --batch 8 \
        --width 32 --heads 2 --lr 1e-2 --steps 50 --json    # the test's size: seconds
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled checkout

import pisa  # noqa: E402


class Block(nn.Module):
    """Pre-norm decoder block: RMSNorm -> ``PisaAttention`` -> residual, RMSNorm -> MLP ->
    residual."""

    def __init__(self, width: int, heads: int, attn: str, cp_group, branches: dict,
                 **pisa_knobs):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width)
        self.attn = pisa.PisaAttention(width, heads, attn=attn, cp_group=cp_group, **branches,
                                       **pisa_knobs)
        self.mlp_norm = nn.RMSNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """``forward(ids [B, T]) -> logits [B, T, vocab]``. ``attn="pisa"`` (default) or ``"dense"``;
    ``pisa_knobs`` (``block_size``, ``topk``, ...) go to every ``PisaAttention``, as do
    ``window`` and ``compressed`` (its gated training branches, ``docs/training.md``). With
    ``cp_group`` the layers attend a sequence sharded over that process group
    (``pisa.distributed``): ``forward`` takes this rank's shard of the ids."""

    def __init__(self, vocab: int, width: int = 64, depth: int = 2, heads: int = 4,
                 attn: str = "pisa", cp_group=None, window: int = 0, compressed: bool = False,
                 **pisa_knobs):
        super().__init__()
        self.pisa_knobs = pisa_knobs
        self.embed = nn.Embedding(vocab, width)
        branches = {"window": window, "compressed": compressed}
        self.blocks = nn.ModuleList(Block(width, heads, attn, cp_group, branches, **pisa_knobs)
                                    for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def repeat_batch(batch: int, seqlen: int, period: int, vocab: int, gen: torch.Generator):
    """``ids [batch, seqlen + 1]``: a random segment of ``period`` tokens repeated; ``inputs`` are
    ``ids[:, :-1]``, ``targets`` ``ids[:, 1:]``. Returns ``(ids, copied [seqlen] bool)``:
    ``copied[t]`` marks the inputs whose target repeats an earlier token."""
    segment = torch.randint(0, vocab, (batch, period), generator=gen)
    ids = segment.repeat(1, seqlen // period + 2)[:, :seqlen + 1]
    return ids, torch.arange(seqlen) + 1 >= period


@torch.no_grad()
def found_rate(model: TinyGPT, ids: torch.Tensor, period: int) -> float:
    """How often the best-placed head's selection holds the token to copy: per layer and KV head,
    the share of the copied tokens whose source (``period - 1`` back) lies in a block it
    attends (``pisa.pisa_select`` at the layer's knobs on the layer's own q and k: the
    selection its ``pisa_attn`` runs; forced blocks count), maximised over layers and heads."""
    T = ids.shape[1]
    t = torch.arange(period - 1, T, device=ids.device)
    source = (t + 1 - period) // model.pisa_knobs["block_size"]
    best, x = 0.0, model.embed(ids)
    for block in model.blocks:
        q, k, _ = block.attn.qkv(block.attn_norm(x))
        block_idx, _ = pisa.pisa_select(q, k, **model.pisa_knobs)  # [B, tiles, HKV, topk]
        per_token = block_idx.repeat_interleave(T // block_idx.shape[1], dim=1)[:, t]
        hit = (per_token == source[None, :, None, None]).any(-1)  # [B, tokens, HKV]
        best = max(best, hit.float().mean((0, 1)).max().item())
        x = block(x)
    return best


def parser() -> argparse.ArgumentParser:
    """The options (``train_cp.py`` extends them)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--attn", choices=("pisa", "dense"), default="pisa")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seqlen", type=int, default=256, help="T, a multiple of --block-size")
    p.add_argument("--period", type=int, default=40, help="P (default 40 > 2C)")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="C (default 16)")
    p.add_argument("--topk", type=int, default=6, help="blocks a query tile attends, the three "
                   "forced ones included (default 6)")
    p.add_argument("--window", type=int, default=0,
                   help="blocks of the gated sliding-window branch (default 0: none)")
    p.add_argument("--compressed", action="store_true",
                   help="add the gated compressed branch over the blocks' mean keys / values")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (torch backend) or cuda (Triton kernels; C >= 16)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the "
                   "matrices are tiny, and extra threads spin on a busy machine)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    return p


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.seqlen % args.block_size:
        p.error(f"--seqlen {args.seqlen} must be a multiple of --block-size {args.block_size}")
    if args.seqlen <= args.topk * args.block_size:
        p.error(f"--seqlen {args.seqlen} must exceed --topk x --block-size: up to that length "
                "every causal block fits the budget and PisaAttention runs dense attention")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[parser()])
    return checked(p, p.parse_args(argv))


def build(args, cp_group=None) -> TinyGPT:
    """The model of ``args``, its weights a function of ``args.seed`` only."""
    torch.manual_seed(args.seed)
    return TinyGPT(args.vocab, args.width, args.depth, args.heads, attn=args.attn,
                   cp_group=cp_group, window=args.window, compressed=args.compressed,
                   block_size=args.block_size, topk=args.topk)


def learned_at(losses: list[float], chance: float) -> int | None:
    """The first step (1-based) whose loss is below half of chance."""
    return next((i + 1 for i, loss in enumerate(losses) if loss < chance / 2), None)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build(args).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    chance = math.log(args.vocab)
    knobs = f" {model.pisa_knobs}, window {args.window}, compressed {args.compressed}" \
        if args.attn == "pisa" else ""
    print(f"{args.attn}{knobs}: T={args.seqlen}, P={args.period}; chance: loss {chance:.3f}, "
          f"accuracy {1 / args.vocab:.3f}", flush=True)
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, copied = repeat_batch(args.batch, args.seqlen, args.period, args.vocab, gen)
        ids, copied = ids.to(args.device), copied.to(args.device)
        logits = model(ids[:, :-1])[:, copied]
        targets = ids[:, 1:][:, copied]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            acc = (logits.argmax(-1) == targets).float().mean().item()
            found = found_rate(model, ids[:, :-1], args.period) if args.attn == "pisa" else None
            print(f"step {step:4d}  loss {loss.item():.3f}  accuracy {acc:.3f}"
                  + ("" if found is None else f"  found {found:.3f}")
                  + f"  {time.perf_counter() - start:5.1f} s", flush=True)
    result = {"example": "train", "attn": args.attn, "seed": args.seed, "steps": args.steps,
              "period": args.period, "window": args.window, "compressed": args.compressed,
              "chance": chance, "learned_at": learned_at(losses, chance),
              "final_loss": sum(losses[-5:]) / len(losses[-5:]), "final_accuracy": acc,
              "found": found, "losses": losses, "seconds": time.perf_counter() - start}
    print(f"loss below half of chance ({chance / 2:.3f}) from step {result['learned_at']}",
          flush=True)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
