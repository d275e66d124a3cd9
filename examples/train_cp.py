"""Train a small GPT (``pisa.eval.gpt``) with its sequence split over ranks (context parallelism,
``pisa.distributed``) and data parallelism (DDP) over the rest of the world.

The world of ``W`` ranks is a ``dp x cp`` grid: ranks ``[i * cp, (i + 1) * cp)`` share one
sequence (a context-parallel group, each holding a zigzag shard of it) and the ``dp = W / cp``
groups see different sequences. DDP all-reduces every parameter's gradient over the whole world:
a context-parallel rank's gradient is that of its shard's tokens, so the world mean is the mean
over all tokens of all sequences (shards of equal length). The context-parallel collectives run
on their own process groups, beside DDP's.

The task is a copy: a random first half, then the same tokens again, so the second half's
next-token loss falls only when attention reaches back half a sequence (through the selected
blocks). Tiny on CPU with gloo:

    torchrun --nproc_per_node 2 examples/train_cp.py --steps 30
    torchrun --nproc_per_node 4 examples/train_cp.py --cp 2     # dp = 2 x cp = 2

On GPUs (NCCL, one GPU a rank): ``--device cuda --seqlen 65536 --width 512 ...``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled checkout

from pisa.distributed import comm_bytes, reset_comm_bytes, shard  # noqa: E402
from pisa.eval.gpt import GPT, GPTConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="ranks a sequence is split over (default 2)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens a sequence (default 512)")
    p.add_argument("--batch", type=int, default=2, help="sequences a data-parallel rank")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16, help="C (default 16)")
    p.add_argument("--topk", type=int, default=4, help="K (default 4)")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    return p.parse_args(argv)


def copy_batch(batch: int, seqlen: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, seqlen + 1]`` ids: a random half, then the same half again."""
    half = torch.randint(0, vocab, (batch, (seqlen + 2) // 2), generator=gen)
    return torch.cat([half, half], dim=1)[:, :seqlen + 1]


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.cp:
        sys.exit(f"the world ({world} ranks) must be a multiple of --cp {args.cp}")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dp_index, cp_rank = divmod(rank, args.cp)
    cp_group = None
    for i in range(world // args.cp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(i * args.cp, (i + 1) * args.cp)))
        if i == dp_index:
            cp_group = group
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway
    cfg = GPTConfig(vocab_size=args.vocab, width=args.width, depth=args.depth, heads=4,
                    kv_heads=2, mlp_hidden=2 * args.width, arm="pisa", topk=args.topk,
                    block_size=args.block_size)
    model = GPT(cfg).to(device)
    model.set_context_parallel(cp_group)
    model = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + dp_index)  # one stream a sequence group
    cut = dict(group=cp_group, block_size=args.block_size)
    half = args.seqlen // 2
    for step in range(args.steps):
        ids = copy_batch(args.batch, args.seqlen, args.vocab, gen).to(device)
        inputs, targets = shard(ids[:, :-1], **cut), shard(ids[:, 1:], **cut)
        second = shard(torch.arange(args.seqlen, device=device)[None] >= half, **cut)
        reset_comm_bytes()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():  # the copied half's loss, over the whole world
            tok = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
            stats = torch.stack([loss.detach(), (tok * second.flatten().repeat(args.batch)).sum(),
                                 second.sum() * args.batch * 1.0])
            dist.all_reduce(stats)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {float(stats[0]) / world:.3f}  copied half "
                  f"{float(stats[1] / stats[2]):.3f}  cp bytes sent by rank 0 "
                  f"{comm_bytes()['total']:,}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
