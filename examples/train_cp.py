"""Train ``train.py``'s model and task with the sequence split over ranks (context parallelism,
``pisa.distributed``) and data parallelism (DDP) over the rest of the world; the loss follows
single-process ``train.py`` at the same seed (``--batch`` there = ``dp x --batch`` here).

The world of ``W`` ranks is a ``dp x cp`` grid: ranks ``[i * cp, (i + 1) * cp)`` share a
sequence (a context-parallel group, each rank holding a zigzag shard of it: ``pisa.distributed.
shard``), and the ``dp = W / cp`` groups see different sequences. Every ``PisaAttention`` gets
the group (``cp_group=``) and runs ``pisa_attn_cp``: the same selection and attention as one
process over the whole sequence, its collectives on the group's own communicator beside DDP's.

DDP averages every parameter's gradient over the world, and a rank's gradient is that of its own
tokens. So each rank's loss is its tokens' summed loss over the global token count, times
``W``: the average is then the gradient of the global mean. A per-rank mean would weigh the
shards unequally (the zigzag shard holding the sequence's start has fewer copied tokens).

On CPU (gloo) the script spawns its ranks itself; under ``torchrun`` it joins the launcher's:

    python examples/train_cp.py                         # 2 ranks: cp = 2, ~1.5 min on CPU
    python examples/train_cp.py --nproc 4 --cp 2        # dp = 2 x cp = 2
    torchrun --nproc_per_node 2 examples/train_cp.py
    torchrun --nproc_per_node 8 examples/train_cp.py --device cuda --cp 8 --seqlen 8192  # GPUs

Options as in ``train.py`` (PISA only: context parallelism has no dense path; ``--device cuda``
runs NCCL, one GPU a rank, not yet tried) plus ``--cp`` and ``--nproc``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train.py beside this file
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # an uninstalled checkout

import train  # noqa: E402
from pisa.distributed import comm_bytes, reset_comm_bytes, shard  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[train.parser()])
    p.add_argument("--cp", type=int, default=2, help="ranks a sequence is split over (default 2)")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn when not under torchrun (default 2)")
    args = train.checked(p, p.parse_args(argv))
    if args.attn != "pisa":
        p.error("context parallelism runs PISA only (--attn pisa)")
    if args.window or args.compressed:
        p.error("the gated branches (--window, --compressed) are not context-parallel")
    if "RANK" not in os.environ and args.nproc % args.cp:
        p.error(f"--nproc {args.nproc} must be a multiple of --cp {args.cp}")
    return args


def cp_groups(cp: int):
    """This rank's data-parallel index and its context-parallel group. Every rank creates every
    group, in the same order (``new_group`` is collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % cp:
        raise SystemExit(f"the world ({world} ranks) must be a multiple of --cp {cp}")
    groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(world // cp)]
    return rank // cp, groups[rank // cp]


def run(args) -> None:
    """One rank's training, in an initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)  # a rank
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dp_index, group = cp_groups(args.cp)
    dp = world // args.cp
    model = DDP(train.build(args, cp_group=group).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)  # train.py's stream, on every rank
    cut = dict(group=group, block_size=args.block_size)
    chance = math.log(args.vocab)
    if rank == 0:
        print(f"world {world} = dp {dp} x cp {args.cp}; T={args.seqlen}, P={args.period}; "
              f"chance: loss {chance:.3f}, accuracy {1 / args.vocab:.3f}", flush=True)
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        # the global batch of dp x batch sequences; this group's rows; this rank's shard
        ids, copied = train.repeat_batch(dp * args.batch, args.seqlen, args.period, args.vocab,
                                         gen)
        ids = ids[dp_index * args.batch:(dp_index + 1) * args.batch].to(device)
        inputs, targets = shard(ids[:, :-1], **cut), shard(ids[:, 1:], **cut)
        mask = shard(copied[None].to(device), **cut)[0]
        reset_comm_bytes()
        logits = model(inputs)[:, mask]
        targets = targets[:, mask]
        tok_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        stats = torch.stack([tok_loss.detach(), (logits.argmax(-1) == targets).sum().float(),
                             torch.tensor(float(targets.numel()), device=device)])
        dist.all_reduce(stats)  # summed loss, correct tokens, tokens: over the world
        loss = tok_loss * world / stats[2]  # DDP's mean of these is the global mean's gradient
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(stats[0] / stats[2]))
        if rank == 0 and (step == 1 or step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {losses[-1]:.3f}  accuracy "
                  f"{float(stats[1] / stats[2]):.3f}  bytes sent by rank 0 "
                  f"{comm_bytes()['total']:,}  {time.perf_counter() - start:5.1f} s", flush=True)
    if rank == 0:
        result = {"example": "train_cp", "world": world, "cp": args.cp, "seed": args.seed,
                  "steps": args.steps, "chance": chance,
                  "learned_at": train.learned_at(losses, chance),
                  "final_loss": sum(losses[-5:]) / len(losses[-5:]),
                  "final_accuracy": float(stats[1] / stats[2]), "losses": losses,
                  "seconds": time.perf_counter() - start}
        print(f"loss below half of chance ({chance / 2:.3f}) from step {result['learned_at']}",
              flush=True)
        if args.json:
            print(json.dumps(result), flush=True)


def spawned(rank: int, world: int, port: int, args) -> None:
    """A rank started by ``main``: joins the gloo group on this host."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun set up the world
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            run(args)
        finally:
            dist.destroy_process_group()
    elif args.device == "cuda":
        sys.exit("--device cuda: launch with torchrun (one process a GPU)")
    else:
        # fork where it is safe (Linux, nothing run yet): the ranks share this process's imports
        mp.start_processes(spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc,
                           start_method="fork" if sys.platform == "linux" else "spawn")


if __name__ == "__main__":
    main()
