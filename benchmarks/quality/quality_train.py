"""Trained-model quality: small GPTs with dense, PISA and flat-selector attention, trained at 4K on
a mix of synthetic long-context tasks and byte-level code, tested at 4K, 8K and 16K.

One process trains and evaluates one run (arm, K, seed, schedule); ``--launch`` starts every run
of the suite as parallel processes, round robin over the visible GPUs, and merges their results:

    PYTHONPATH=. python benchmarks/quality/quality_train.py --launch --out $OUT --time-budget 500

writes ``$OUT/quality_trained.json`` (``{"meta", "rows": [{"task", "arm", "K", "seed", "train_T",
"test_T", "metric", "value", "steps", "schedule", "query_tile", "beam_leaf"}], "beam_rows": [...
and "W"]}``) and
``$OUT/quality_logs.tar.gz`` (every run's log with its loss curve, every run's record, the
launcher's log).

Protocol
- Model (``pisa.eval.gpt``): 4 layers, width 256, 4 query / 2 KV heads of 64, SwiGLU 768, byte
  vocabulary + task markers, tied embeddings, RoPE; bf16 autocast, AdamW (0.9, 0.95, wd 0.1 on
  matrices), linear warm-up then cosine to 10%, grad clip 1.
- Batch: ``--batch`` rows of ``--train-T`` tokens, split evenly over language modelling and the
  five tasks of ``pisa.eval.tasks`` (one model per run serves every task). Loss: the mean over
  the six of each one's mean cross-entropy (LM: every next byte; tasks: answer tokens only).
- Curriculum (``--curriculum``, default 256 for 60% of the steps, 2048 for 20%, then
  ``--train-T``): the same tokens per step, so short phases have more rows (96 at T = 256, 16
  per task). The tasks need many examples per step to be learned at all: with one or a few rows
  per task per step they stayed at chance for every arm, while 16 rows at T = 256 learn every
  task in ~3000 steps (``docs/quality.md``). While T <= K * C every block fits in the budget, so
  the sparse arms are dense there (``PisaAttention`` then runs SDPA): the "sparse" schedule is
  sparse from the first phase longer than K * C (2048 for K = 16).
- Arms (``pisa.eval.gpt.ARMS``): dense; pisa (the library defaults: selection v2) and pisa_qt1
  (the first wave's per-token walk) at K = 8 and 16; flat_mean and flat_lse at K = 16 (C = 64,
  W = K; per token); nsa (``nsa:16``, issue 26): fla's NSA as a peer (``pisa.eval.nsa_arm``:
  fla-core's ``parallel_nsa`` with its per-head gates, mean-pooled compressed branch and a
  64-token sliding window; K = 16 selected blocks of C = 64 a token, forced sink / previous /
  current inside the count, as PISA's budget; the window lies inside the forced blocks).
  Schedules:
  "sparse" (sparse from step 0) and "warmup" (dense for the first ``--warmup-frac`` of the steps,
  then sparse; default 0.7, past the curriculum's start where every block fits the budget — a
  warm-up that ends inside it would equal the sparse run and is rejected). Dense rows carry
  schedule "sparse" (dense attention from step 0). Seeds 0, 1, 2: the seed sets the
  initialisation and the training data stream, so arms of one seed see the same batches; the
  evaluation data are the same for every run.
- NSA-compatible shape: fla's NSA kernels need a GQA group ``HQ / HKV`` that is a power of two
  >= 16 (and a head dim in [16, 256]; ``pisa/eval/nsa_arm.py`` lists what fla needs), so the
  default 4 / 2 heads cannot run the nsa arm. PISA's Triton attention takes head dims 16, 32,
  64, 128, 256 (``pisa/ops/attn/triton.py``; 16 <= D <= 256 overall, ``check_qk``) and any
  group. The smallest shape both run keeps the width and the query/output projections:
  ``--heads 16 --kv-heads 1 --head-dim 16`` (width 256 = 16 x 16; K/V projections 256 -> 16;
  one selection per KV head shared by the 16 query heads, in both libraries). Every arm of a
  comparison runs in that one shape (``--head-dim`` decouples the head width from
  ``--width``; ``--head-dim 64`` is the same group at the default head width, 4x the
  attention). nsa runs do not resume the dense stems (``--share-start``): NSA is not dense
  while ``T <= K * C`` (its gated branches add up at any length), so they train from step 0
  (so do the gated-branch arms), unless ``--stem-all`` warm-starts them from it too;
  the step count, the batches and the tokens per step stay those of every other run;
  ``meta.runs`` reports each run's ``train_seconds`` (wall time).

      pip install 'pisa[nsa]'  # fla-core (or: pip install --no-deps fla-core einops)
      PYTHONPATH=. python benchmarks/quality/quality_train.py --launch --out $OUT \
          --arms dense pisa:16 flat_lse:16 nsa:16 --warmup-arms --sweep --seeds 0 1 2 \
          --heads 16 --kv-heads 1 --head-dim 16
- Same steps for every run: each run compiles its kernels, waits for all others, times a few
  steps under full contention, and the launcher sets one step count for all from those paces and
  the time left (``plan_steps``; ``--steps`` fixes it instead). ``--time-budget`` is a hard wall:
  training stops at its deadline (the steps reached are recorded), evaluation at its own, and the
  launcher terminates what still runs before the budget ends.
- Shared start (``--share-start``, on with ``--steps``): the curriculum's first steps, where
  every arm attends every block (``T <= K * C``), are the same computation for every arm of a
  seed (same initialisation, data and learning rate; ``PisaAttention`` runs SDPA there as the
  dense arm does), so one dense "stem" per seed trains them, saves weights, optimizer and data
  stream, and every run of that seed resumes it (bitwise equal to training straight through on
  CPU: ``tests/eval/test_quality_train.py``). ``--stem-dir`` keeps the stems for a later launch
  with the same settings (``stem_key``), so arms split over several launches share them too.
  ``meta.stems`` and each run's ``stem`` record it.
- Learning rate: tuned on dense only: the ``--sweep`` multipliers of ``--lr`` run as extra dense
  seed-0 runs; ``meta.lr_sweep`` compares them with the main dense seed-0 run. The default 1e-3
  won the sweep 2.5e-4 / 5e-4 / 1e-3 on task accuracy (``docs/history/quality_trained_lr5e-4.md``).
- Evaluation at every ``--test-T``: per task ``--eval-examples`` rows (exact match per question,
  teacher-forced argmax over the answer tokens -> metric "accuracy"), and language-modelling loss
  on ``--lm-windows`` held-out windows (``pisa.eval.tasks.ByteCorpus``: train on torch's sources,
  validate on triton's), overall (task "lm") and on tokens at positions >= ``--lm-past`` (task
  "lm_past2048") -> metric "loss". The pisa runs then re-evaluate the tasks with wider walks
  (beam ``W = mult * K`` for each ``--eval-beams`` mult; same weights) -> ``beam_rows``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import meta, write_result

from pisa.eval.gpt import ARM_NAMES, GPT, GPTConfig, dense_within_budget
from pisa.eval.nsa_arm import check_nsa_shape
from pisa.eval.tasks import TASKS, ByteCorpus, lm_eval_windows, lm_windows, make_task

TRAIN_TASKS = ("lm",) + tuple(TASKS)
SCHEDULES = ("sparse", "warmup")
CALIB_FROM, CALIB_TO = 3, 10  # steps timed (under full contention) to set the step count
SAFETY = 0.8  # fraction of the time left that the planned steps fill (evaluation of early
#                finishers shares the GPU too)
CALIB_WAIT = 60.0  # seconds the launcher waits for the paces once the runs are released


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------

def train_batch(rows: int, T: int, gen: torch.Generator, train_data: torch.Tensor):
    """``tokens [rows, T]``, loss ``weights [rows, T - 1]`` (each of the six parts sums to 1/6)
    and each row's part index ``[rows]``."""
    per = rows // len(TRAIN_TASKS)
    lm = lm_windows(train_data, per, T, gen)
    tasks = [make_task(name, per, T, gen) for name in TASKS]
    tokens = torch.cat([lm] + [b.tokens for b in tasks])
    mask = torch.cat([torch.ones_like(lm[:, 1:], dtype=torch.float32)]
                     + [b.answer[:, 1:].float() for b in tasks])
    part = torch.arange(len(TRAIN_TASKS), device=lm.device).repeat_interleave(per)
    per_part = torch.zeros(len(TRAIN_TASKS), device=lm.device).index_add_(0, part, mask.sum(1))
    weights = mask / (per_part[part, None] * len(TRAIN_TASKS))
    return tokens, weights, part


def lr_at(step: int, steps: int | None, args) -> float:
    warm = args.lr_warmup if steps is None else min(args.lr_warmup, max(1, steps // 5))
    if step < warm:
        return args.lr * (step + 1) / warm
    if steps is None:
        return args.lr
    p = min(1.0, (step - warm) / max(1, steps - warm))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def parse_curriculum(items: list[str], train_T: int, batch: int) -> list[tuple[int, float]]:
    """``["T:frac", ...]`` -> ``[(T, frac), ...]``: the first ``frac`` of the steps at length
    ``T`` (phases in order, the rest at ``train_T``). Every phase keeps the tokens per step:
    ``batch * train_T / T`` rows, which must split evenly over the six parts."""
    phases = []
    for item in items:
        T, _, frac = item.partition(":")
        try:
            phase = (int(T), float(frac))
        except ValueError:
            raise ValueError(f"--curriculum items must be 'T:fraction', got {item!r}") from None
        if not (0 < phase[0] < train_T and train_T % phase[0] == 0 and 0 < phase[1] < 1) or \
                (batch * train_T // phase[0]) % len(TRAIN_TASKS):
            raise ValueError(f"--curriculum {item!r}: T must divide --train-T {train_T} and give "
                             f"a multiple of {len(TRAIN_TASKS)} rows, the fraction lie in (0, 1)")
        phases.append(phase)
    if sum(f for _, f in phases) >= 1:
        raise ValueError(f"--curriculum fractions must sum to less than 1, got {items}")
    return phases


def length_at(step: int, steps: int | None, args) -> tuple[int, int]:
    """``(rows, T)`` of the batch at ``step`` under ``args.curriculum``."""
    end = 0.0
    for T, frac in args.phases:
        end += frac
        if steps is not None and step < end * steps:
            return args.batch * args.train_T // T, T
    return args.batch, args.train_T


def _wait_for(path: Path, deadline: float) -> bool:
    while not path.exists():
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def _write_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _model(args) -> GPT:
    return GPT(GPTConfig(width=args.width, depth=args.depth, heads=args.heads,
                         kv_heads=args.kv_heads, head_dim=args.head_dim, mlp_hidden=args.mlp,
                         arm=args.arm, topk=args.topk, block_size=args.block_size,
                         backend=args.backend))


def _param_names(model: GPT) -> list[list[str]]:
    """The optimizer's two groups by parameter name, in its order: weights decay, the rest
    (norms, biases) do not."""
    named = list(model.named_parameters())
    return [[n for n, p in named if p.dim() >= 2], [n for n, p in named if p.dim() < 2]]


def _optimizer(model: GPT, args) -> torch.optim.AdamW:
    params = dict(model.named_parameters())
    decay, rest = ([params[n] for n in group] for group in _param_names(model))
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr,
                             betas=(0.9, 0.95), fused=args.device.startswith("cuda"))


def _loss(model: GPT, tokens, weights, device):
    with _autocast(device):
        logits = model(tokens)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                         reduction="none").view_as(weights)
    return ce * weights


def save_state(path: Path, model: GPT, opt, gen: torch.Generator, step: int, acc, n_acc: int,
               record: dict) -> None:
    """Everything the rest of a run depends on after ``step`` steps: weights, optimizer, data
    stream, the loss accumulator and the curve so far."""
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "opt_names": _param_names(model), "gen": gen.get_state(), "step": step,
                "acc": acc, "n_acc": n_acc, "curve": record["curve"],
                "seconds": record["train_seconds"]}, path)


def load_state(path: str, model: GPT, opt, gen: torch.Generator, record: dict):
    """Continue from :func:`save_state`'s file (the stem); ``(step, acc, n_acc)``. A model with
    parameters the stem lacks (an arm with gated branches or NSA's gates warm-started from the
    dense stem, ``--stem-all``) starts those fresh, with empty optimizer moments."""
    state = torch.load(path, map_location=next(model.parameters()).device, weights_only=False)
    unexpected = model.load_state_dict(state["model"], strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"stem {path} has parameters this model lacks: {unexpected}")
    opt.load_state_dict(_opt_state_for(state["opt"], state["opt_names"], _param_names(model)))
    gen.set_state(state["gen"].cpu())  # map_location moved it to the device
    record["curve"] = list(state["curve"])
    record["stem"] = {"file": Path(path).name, "steps": state["step"],
                      "train_seconds": state["seconds"]}
    return state["step"], state["acc"], state["n_acc"]


def _opt_state_for(saved: dict, saved_names: list[list[str]], names: list[list[str]]) -> dict:
    """``saved`` (an optimizer state dict over ``saved_names``' parameters) re-indexed for an
    optimizer over ``names`` (the same groups, possibly more parameters: those have no state)."""
    old = {n: i for i, n in enumerate(n for group in saved_names for n in group)}
    new = [n for group in names for n in group]
    groups, start = [], 0
    for group, hyper in zip(names, saved["param_groups"]):
        groups.append(dict(hyper, params=list(range(start, start + len(group)))))
        start += len(group)
    return {"state": {j: saved["state"][old[n]] for j, n in enumerate(new)
                      if n in old and old[n] in saved["state"]}, "param_groups": groups}


def train(model: GPT, args, train_data: torch.Tensor, record: dict, log) -> None:
    """Train until ``args.steps`` (or the step count the launcher sets) or the train deadline;
    from ``args.resume``'s state if given; with ``args.stop_at``, stop after that many steps and
    save the state to ``args.save_state`` (a stem that other runs resume)."""
    dev = args.device
    opt = _optimizer(model, args)
    params = list(model.parameters())
    gen = torch.Generator(dev).manual_seed(1000 + args.seed)
    acc = torch.zeros(len(TRAIN_TASKS), device=dev)
    start, n_acc = 0, 0
    if args.resume:
        start, acc, n_acc = load_state(args.resume, model, opt, gen, record)
    sync_dir = Path(args.sync) if args.sync else None
    if sync_dir:  # compile every kernel of the sparse phase, then wait for every other run
        tokens, weights, _ = train_batch(args.batch, args.train_T,
                                         torch.Generator(dev).manual_seed(1), train_data)
        model.set_sparse(True)
        _loss(model, tokens, weights, dev).sum().backward()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        (sync_dir / f"{args.run}.ready").touch()
        _wait_for(sync_dir / "go", args.train_deadline)
    steps = args.steps
    switch = 0 if args.schedule == "sparse" else None
    if steps is not None and switch is None:
        switch = round(args.warmup_frac * steps)
    t_start, t_calib = time.time(), None
    model.train()
    for step in itertools.count(start):
        if steps is not None and step >= steps or time.time() > args.train_deadline:
            break
        if step == args.stop_at:
            record["train_seconds"] = round(time.time() - t_start, 2)
            save_state(Path(args.save_state), model, opt, gen, step, acc, n_acc, record)
            return
        if sync_dir and steps is None and step in (CALIB_FROM, CALIB_TO):
            _sync(dev)
            if step == CALIB_FROM:
                t_calib = time.time()
            else:
                pace = (time.time() - t_calib) / (CALIB_TO - CALIB_FROM)
                record["sec_per_step"] = pace
                _write_atomic(sync_dir / f"{args.run}.calib", {"sec_per_step": pace})
                if _wait_for(sync_dir / "steps", args.train_deadline):
                    steps = json.loads((sync_dir / "steps").read_text())["steps"]
                    record["target_steps"] = steps
                    if switch is None:
                        switch = round(args.warmup_frac * steps)
        model.set_sparse(switch is not None and step >= switch)
        lr = lr_at(step, steps, args)
        for group in opt.param_groups:
            group["lr"] = lr
        rows, T = length_at(step, steps, args)
        tokens, weights, part = train_batch(rows, T, gen, train_data)
        per_token = _loss(model, tokens, weights, dev)
        per_token.sum().backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc.index_add_(0, part, per_token.detach().sum(1) * len(TRAIN_TASKS))
        n_acc += 1
        if (step + 1) % args.log_every == 0:
            parts = (acc / n_acc).tolist()  # the only host sync of the loop
            acc.zero_()
            n_acc = 0
            point = {"step": step + 1, "T": T, "sec": round(time.time() - t_start, 2), "lr": lr,
                     "loss": sum(parts) / len(parts),
                     **{name: round(v, 5) for name, v in zip(TRAIN_TASKS, parts)}}
            record["curve"].append(point)
            print(json.dumps(point), file=log, flush=True)
        record["steps"] = step + 1
    _sync(dev)
    model.set_sparse(True)
    record["train_seconds"] = round(time.time() - t_start, 2)


def _eval_seed(task: str, T: int) -> int:
    return 1_000_003 * (TRAIN_TASKS.index(task) + 1) + T


@torch.no_grad()
def task_accuracy(model: GPT, task: str, T: int, args) -> float:
    """Exact match per question over ``args.eval_examples`` rows (the same for every run)."""
    gen = torch.Generator(args.device).manual_seed(_eval_seed(task, T))
    b = make_task(task, args.eval_examples, T, gen)
    wrong = torch.zeros(args.eval_examples, b.n_spans, dtype=torch.long, device=args.device)
    chunk = max(1, args.eval_tokens // T)
    for s in range(0, args.eval_examples, chunk):
        tokens = b.tokens[s:s + chunk]
        with _autocast(args.device):
            pred = model(tokens)[:, :-1].argmax(-1)
        miss = (pred != tokens[:, 1:]) & b.answer[s:s + chunk, 1:]
        wrong[s:s + chunk].scatter_add_(1, b.span[s:s + chunk, 1:].clamp_min(0), miss.long())
    return float((wrong == 0).float().mean())


@torch.no_grad()
def lm_loss(model: GPT, val_data: torch.Tensor, T: int, args) -> tuple[float, float]:
    """Mean next-byte loss on held-out windows: over all positions, and over targets at
    positions >= ``args.lm_past``."""
    windows = lm_eval_windows(val_data, args.lm_windows, T)
    late = torch.arange(1, T, device=args.device) >= args.lm_past
    total = torch.zeros(2, device=args.device)
    chunk = max(1, args.eval_tokens // T)
    for s in range(0, len(windows), chunk):
        tokens = windows[s:s + chunk]
        with _autocast(args.device):
            logits = model(tokens)[:, :-1]
        ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                             reduction="none").view(len(tokens), T - 1)
        total += torch.stack([ce.sum(), ce[:, late].sum()])
    n_late = int(late.sum()) * len(windows)
    overall, past = (total / torch.tensor([(T - 1) * len(windows), max(n_late, 1)],
                                          device=args.device)).tolist()
    return overall, past if n_late else float("nan")


def evaluate(model: GPT, args, val_data: torch.Tensor, record: dict, out: Path, log) -> None:
    model.eval()
    base = {"arm": args.arm, "K": None if args.arm == "dense" else args.topk, "seed": args.seed,
            "train_T": args.train_T, "schedule": args.schedule,
            **model.selection_knobs()}
    t0 = time.time()
    for T in sorted(args.test_T):
        for task in TASKS:
            if time.time() > args.eval_deadline:
                record["status"] = "eval cut by the deadline"
                return
            acc = task_accuracy(model, task, T, args)
            record["rows"].append({"task": task, **base, "test_T": T, "metric": "accuracy",
                                   "value": acc, "steps": record["steps"]})
        if time.time() > args.eval_deadline:
            record["status"] = "eval cut by the deadline"
            return
        overall, past = lm_loss(model, val_data, T, args)
        for task, v in (("lm", overall), (f"lm_past{args.lm_past}", past)):
            if not math.isnan(v):
                record["rows"].append({"task": task, **base, "test_T": T, "metric": "loss",
                                       "value": v, "steps": record["steps"]})
        record["eval_seconds"] = round(time.time() - t0, 2)
        print(f"# eval T={T} done at {record['eval_seconds']}s", file=log, flush=True)
        _write_atomic(out / f"{args.run}.json", record)
    if args.arm.startswith("pisa") and not eval_beams(model, args, record, base):
        record["status"] = "beam eval cut by the deadline"
        return
    record["status"] = "done"


def eval_beams(model: GPT, args, record: dict, base: dict) -> bool:
    """The pisa arm's task accuracy with wider walks (beam ``W = mult * K`` for each
    ``--eval-beams`` mult; with ``--eval-grown`` also beams grown past the training length,
    ``beam_ref_len = train_T``, at the longer test lengths: ``W`` None), the trained weights
    unchanged: how much of a loss is the walk's pruning. Rows go to ``record["beam_rows"]``
    (with ``W``); False if the deadline cut it."""
    for mult, T in itertools.product(args.eval_beams, sorted(args.test_T)):
        model.set_beam(mult * args.topk)
        for task in TASKS:
            if time.time() > args.eval_deadline:
                return False
            record["beam_rows"].append({"task": task, **base, "W": mult * args.topk,
                                        **model.selection_knobs(),
                                        "test_T": T, "metric": "accuracy",
                                        "value": task_accuracy(model, task, T, args),
                                        "steps": record["steps"]})
    model.set_beam(None)
    if args.eval_grown:  # beams grown with the context past the training length
        model.set_beam_ref_len(args.train_T)
        for T in sorted(t for t in args.test_T if t > args.train_T):
            for task in TASKS:
                if time.time() > args.eval_deadline:
                    return False
                record["beam_rows"].append({"task": task, **base, "W": None,
                                            "beam_ref_len": args.train_T, "test_T": T,
                                            "metric": "accuracy",
                                            "value": task_accuracy(model, task, T, args),
                                            "steps": record["steps"]})
        model.set_beam_ref_len(None)
    return True


def run_one(args) -> dict:
    """Train and evaluate one run; writes ``<out>/<run>.json`` and returns the record."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = sys.stdout
    torch.manual_seed(args.seed)
    corpus = ByteCorpus.load(args.corpus) if args.corpus else \
        ByteCorpus.from_site_packages(args.site)
    train_data, val_data = corpus.train.to(args.device), corpus.val.to(args.device)
    model = _model(args).to(args.device)
    record = {"run": args.run, "arm": args.arm, "K": None if args.arm == "dense" else args.topk,
              "seed": args.seed, "schedule": args.schedule, "lr": args.lr,
              "params": model.num_params(), "steps": 0, "target_steps": args.steps,
              "curve": [], "rows": [], "beam_rows": [], "status": "training"}
    print(f"# {args.run}: {record['params']} parameters, device {args.device}", file=log,
          flush=True)
    train(model, args, train_data, record, log)
    if args.stop_at is not None:
        record["status"] = "stem saved" if record["steps"] == args.stop_at else "stem cut short"
        _write_atomic(out / f"{args.run}.json", record)
        return record
    record["status"] = "trained"
    _write_atomic(out / f"{args.run}.json", record)
    evaluate(model, args, val_data, record, out, log)
    _write_atomic(out / f"{args.run}.json", record)
    return record


# ------------------------------------------------------------------------------------------------
# The suite: every run as a process on one device
# ------------------------------------------------------------------------------------------------

def _arm_spec(spec: str) -> tuple[str, int | None]:
    """``"dense"`` -> ``("dense", None)``; ``"<arm>:<K>"`` -> ``(arm, K)`` for the sparse arms
    (``pisa:16``, ``flat_lse:16``, ``nsa:16``: K blocks a token, ``nsa``'s block count)."""
    arm, colon, k = spec.partition(":")
    if arm == "dense" and not colon:
        return arm, None
    sparse = [a for a in ARM_NAMES if a != "dense"]
    if arm not in sparse or not k.isdigit() or int(k) < 1:
        raise ValueError(f"arm spec must be 'dense' or '<{'|'.join(sparse)}>:<K>' with K >= 1 "
                         f"(blocks a token), got {spec!r}")
    return arm, int(k)


def dense_share(phases: list[tuple[int, float]], train_T: int, reach: int) -> float:
    """Share of the steps at the curriculum's start whose length ``T <= reach = K * C``: every
    block fits the budget there, so a sparse arm computes dense attention."""
    share = 0.0
    for T, frac in phases + [(train_T, 1.0)]:
        if T > reach:
            return share
        share += frac
    return 1.0


def plan(args) -> list[dict]:
    """The runs: every ``--arms`` x ``--seeds`` (schedule "sparse"), every ``--warmup-arms`` x
    ``--seeds`` (schedule "warmup"), and the dense learning-rate sweep (seed 0)."""
    runs = []
    for schedule, specs in (("sparse", args.arms), ("warmup", args.warmup_arms)):
        for spec, seed in itertools.product(specs, args.seeds):
            arm, k = _arm_spec(spec)
            if arm == "dense" and schedule == "warmup":
                raise ValueError("--warmup-arms: the dense arm has no warm-up schedule")
            if arm == "nsa":  # every run would fail at its model: say so before launching
                check_nsa_shape(args.heads, args.kv_heads, args.head_dim or args.width //
                                args.heads, args.block_size, k)
            fits = dense_share(args.phases, args.train_T, k * args.block_size) \
                if k and dense_within_budget(arm) else 0.0  # nsa is never dense
            if schedule == "warmup" and args.warmup_frac <= fits:
                raise ValueError(f"--warmup-frac {args.warmup_frac}: {spec} attends every block "
                                 f"for the first {fits:g} of the steps anyway (T <= K * C), so "
                                 "its warm-up run would equal its sparse twin; raise it above "
                                 f"{fits:g}")
            dense_frac = 1.0 if arm == "dense" else \
                max(fits, args.warmup_frac if schedule == "warmup" else 0.0)
            runs.append({"name": f"{arm}{k or ''}_{schedule}_s{seed}", "arm": arm, "K": k,
                         "seed": seed, "schedule": schedule, "lr": args.lr, "sweep": False,
                         "dense_frac": dense_frac,
                         "from_stem": args.stem_all or dense_within_budget(arm)})
    for mult in args.sweep:
        lr = args.lr * mult
        runs.append({"name": f"dense_lr{lr:g}_s0", "arm": "dense", "K": None, "seed": 0,
                     "schedule": "sparse", "lr": lr, "sweep": True, "dense_frac": 1.0,
                     "from_stem": False})
    return runs


SHARED = ("train_T", "batch", "width", "depth", "heads", "kv_heads", "head_dim", "mlp",
          "block_size", "backend", "warmup_frac", "lr_warmup", "min_lr_frac", "wd", "clip",
          "eval_examples", "lm_windows", "lm_past", "eval_tokens", "log_every", "device", "threads")
LISTS = ("test_T", "curriculum", "eval_beams")  # list-valued options every run shares


def stem_steps(args, runs: list[dict]) -> int:
    """Steps at the curriculum's start that every run of the suite computes alike: dense
    attention (``T <= K * C`` for every sparse run; ``PisaAttention`` runs SDPA there, as the
    dense arm does), the same initialisation, data and learning rate per seed. One stem per seed
    trains them and every run of that seed resumes from its state (``--share-start``; the step
    count must be fixed). Runs of arms that are never dense (nsa, the gated-branch arms:
    ``resumes_stem`` False) train from step 0 and do not bound it, unless ``--stem-all`` warm-starts
    them from the dense stem too. 0: nothing to share."""
    reach = min((r["K"] * args.block_size for r in runs if r["K"] and resumes_stem(r)),
                default=None)
    if args.steps is None or not args.share_start or reach is None:
        return 0
    return next((s for s in range(args.steps) if length_at(s, args.steps, args)[1] > reach),
                args.steps)


def resumes_stem(run: dict) -> bool:
    """Whether ``run`` resumes its seed's dense stem (with ``--share-start``; ``plan`` decides):
    its arm computes dense attention while every block fits (``pisa.eval.gpt.dense_within_budget``)
    or ``--stem-all`` warm-starts every arm from it (a dense warm-up: the branches' gates and
    NSA's start fresh at the stem's end), and it is not a learning-rate sweep run."""
    return run["from_stem"]


def stem_key(args, seed: int, steps: int) -> dict:
    """What a stem's state depends on: a saved stem with the same key is reused."""
    return {name: getattr(args, name) for name in SHARED if name not in ("device", "threads")} \
        | {"lr": args.lr, "steps": args.steps, "curriculum": args.phases, "seed": seed,
           "stem_steps": steps}


def _reuse_stem(state: Path, key: dict, record: Path) -> bool:
    """True (and the stem's ``record`` written) if ``state`` was saved under ``key`` (its
    ``.key.json`` beside it, written once the stem finished); else both files are removed, so a
    stale state cannot stand in for a stem that fails."""
    sidecar = state.with_suffix(".key.json")
    if state.exists() and sidecar.exists() and \
            json.loads(sidecar.read_text()) == json.loads(json.dumps(key)):
        saved = torch.load(state, map_location="cpu", weights_only=False)
        _write_atomic(record, {"status": f"reused {state}", "steps": saved["step"],
                               "train_seconds": saved["seconds"]})
        return True
    sidecar.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    return False


def _child_argv(args, run: dict, work: Path, corpus: Path, deadlines) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--run", run["name"],
            "--arm", run["arm"], "--topk", str(run["K"] or args.topk), "--seed", str(run["seed"]),
            "--schedule", run["schedule"], "--lr", repr(run["lr"]), "--out", str(work),
            "--corpus", str(corpus), "--train-deadline", repr(deadlines[0]),
            "--eval-deadline", repr(deadlines[1])]
    for name in SHARED:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    for name in LISTS:  # also when empty: the default may not be
        argv += ["--" + name.replace("_", "-"), *map(str, getattr(args, name))]
    argv.append("--eval-grown" if args.eval_grown else "--no-eval-grown")
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    else:
        argv += ["--sync", str(work / "sync")]
    return argv


def _say(msg: str, log) -> None:
    for stream in (sys.stdout, log):
        print(msg, file=stream, flush=True)


def _alive(procs: dict) -> dict:
    return {name: p for name, p in procs.items() if p.poll() is None}


def _barrier(procs: dict, sync: Path, suffix: str, deadline: float) -> list[str]:
    """Wait until every live run has written ``<run><suffix>`` (or the deadline); the names."""
    while time.time() < deadline:
        if all((sync / f"{n}{suffix}").exists() for n in _alive(procs)):
            break
        time.sleep(0.2)
    return [n for n in procs if (sync / f"{n}{suffix}").exists()]


def plan_steps(runs: list[dict], paces: dict, seconds: float, gpus: int = 1) -> int:
    """Optimizer steps every run can make in ``seconds``.

    ``paces`` are seconds per step measured with all runs training at once, at the full length;
    run ``i`` of ``runs`` trains on GPU ``i % gpus``. A GPU time-slices between processes with
    work, so with ``n`` runs on it each gets ``1/n`` of it and a run's own GPU cost is
    ``pace / n`` per step; runs that finish early free their share, so a GPU is done when its
    total work ``steps * sum(cost)`` is, and the busiest GPU sets the steps.

    A run computes dense attention for the ``dense_frac`` of its steps (warm-up, or curriculum
    phases where every block fits the budget) and sparse attention for the rest. A sparse run
    timed its sparse step, a warm-up run its dense one: the other kind costs what the dense
    arm's runs do (mean) or what the warm-up's sparse twin does; the costliest pace stands in
    for what was not timed, and for runs that did not report."""
    gpu_of = {run["name"]: i % gpus for i, run in enumerate(runs)}
    sharing = [sum(gpu_of[n] == g for n in paces) or 1 for g in range(gpus)]
    cost = {n: v / sharing[gpu_of[n]] for n, v in paces.items()}
    worst = max(cost.values())
    dense = [cost[r["name"]] for r in runs if r["arm"] == "dense" and r["name"] in cost]
    dense_cost = sum(dense) / len(dense) if dense else worst
    total = [0.0] * gpus
    for run in runs:
        if run["schedule"] == "warmup":
            twin = run["name"].replace("_warmup_", "_sparse_")
            dense_step, sparse_step = cost.get(run["name"], worst), cost.get(twin, worst)
        else:
            sparse_step = cost.get(run["name"], worst)
            dense_step = min(dense_cost, sparse_step)
        frac = run["dense_frac"]
        total[gpu_of[run["name"]]] += frac * dense_step + (1 - frac) * sparse_step
    return CALIB_TO + max(1, int(SAFETY * seconds / max(total)))


def calibrate(procs: dict, runs: list[dict], sync: Path, ready_by: float,
              train_deadline: float, gpus: int, log) -> dict:
    """Release the runs together once all compiled (or at ``ready_by``), time them under full
    contention, and set one step count for all (a straggler reads it when it gets there)."""
    ready = _barrier(procs, sync, ".ready", min(ready_by, train_deadline))
    (sync / "go").touch()
    _say(f"[launch] {len(ready)}/{len(procs)} runs compiled; go", log)
    timed = _barrier(procs, sync, ".calib", min(time.time() + CALIB_WAIT, train_deadline))
    paces = {n: json.loads((sync / f"{n}.calib").read_text())["sec_per_step"] for n in timed}
    if not paces:
        _say("[launch] no run reached calibration before the training deadline: see the logs",
             log)
        return {"steps": None, "sec_per_step": {}}
    left = train_deadline - time.time()
    steps = plan_steps(runs, paces, left, gpus)
    _write_atomic(sync / "steps", {"steps": steps})
    _say("[launch] paces (s/step, all runs at once): "
         + ", ".join(f"{n}={v:.3f}" for n, v in sorted(paces.items()))
         + f"\n[launch] {steps} steps for every run in the {left:.0f}s left", log)
    return {"steps": steps, "sec_per_step": paces, "seconds_left": round(left, 1)}


def launch(args) -> dict:
    t0 = time.time()
    end = t0 + args.time_budget
    deadlines = (end - args.eval_reserve - args.merge_reserve, end - args.merge_reserve)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="pisa_quality_"))
    (work / "sync").mkdir(parents=True, exist_ok=True)
    log = open(work / "launch.log", "w")
    runs = plan(args)
    if args.corpus:
        corpus_path = Path(args.corpus)
        corpus_info = ByteCorpus.load(corpus_path).info
    else:  # read the sources once; every run loads the saved tensors
        corpus_path = work / "corpus.pt"
        corpus = ByteCorpus.from_site_packages(args.site)
        corpus.save(corpus_path)
        corpus_info = corpus.info
        del corpus
    _say(f"[launch] {len(runs)} runs on {args.gpus} GPU(s) in {work}; corpus {corpus_info}", log)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH")])))
    procs = {}

    def start(run: dict, gpu: int, extra: list[str]) -> None:
        if args.gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu % args.gpus)
        with open(work / f"{run['name']}.log", "w") as f:
            procs[run["name"]] = subprocess.Popen(
                _child_argv(args, run, work, corpus_path, deadlines) + extra, stdout=f,
                stderr=subprocess.STDOUT, env=env)

    shared_steps = stem_steps(args, runs)
    stem_dir = Path(args.stem_dir) if args.stem_dir else work
    stem_dir.mkdir(parents=True, exist_ok=True)
    waiting = {}  # seed -> runs that resume its stem once it is saved
    stems = []
    for run in runs:
        if shared_steps and resumes_stem(run):
            waiting.setdefault(run["seed"], []).append(run)
    for seed in waiting:
        stems.append({"name": f"stem_s{seed}", "arm": "dense", "K": None, "seed": seed,
                      "schedule": "sparse", "lr": args.lr, "sweep": False})
        state = stem_dir / f"stem_s{seed}.pt"
        if not _reuse_stem(state, stem_key(args, seed, shared_steps), work / f"stem_s{seed}.json"):
            start(stems[-1], len(stems) - 1, ["--stop-at", str(shared_steps), "--save-state",
                                              str(state)])
    if stems:
        _say(f"[launch] the first {shared_steps} steps (dense for every arm) are trained once "
             f"per seed (stems in {stem_dir}): " + ", ".join(
                 s["name"] + (" (reused)" if s["name"] not in procs else "") for s in stems),
             log)
    for i, run in enumerate(runs):  # round robin over the GPUs, as plan_steps assumes
        if run["seed"] not in waiting or not resumes_stem(run):  # sweeps, nsa: from step 0
            start(run, i, [])
    calib = None if args.steps is not None else \
        calibrate(procs, runs, work / "sync", t0 + args.ready_timeout, deadlines[0],
                  args.gpus, log)
    last = 0.0
    while (_alive(procs) or waiting) and time.time() < end - 8:
        for seed in [s for s in waiting
                     if f"stem_s{s}" not in procs or procs[f"stem_s{s}"].poll() is not None]:
            state = stem_dir / f"stem_s{seed}.pt"
            resume = ["--resume", str(state)] if state.exists() else []
            if not resume:
                _say(f"[launch] stem_s{seed} saved no state: its runs start from step 0", log)
            elif f"stem_s{seed}" in procs:  # just trained: reusable by a later launch
                _write_atomic(state.with_suffix(".key.json"),
                              stem_key(args, seed, shared_steps))
            for run in waiting.pop(seed):
                start(run, runs.index(run), resume)
        time.sleep(1)
        if time.time() - last > 60:
            last = time.time()
            steps = [_last_step(work / f"{name}.log") for name in procs]
            _say(f"[launch] t={last - t0:.0f}s: {len(procs) - len(_alive(procs))}/{len(procs)} "
                 f"runs finished; steps logged {min(steps)}..{max(steps)}", log)
    for name, p in _alive(procs).items():
        _say(f"[launch] {name} still running at the budget's end: terminated", log)
        p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
    for name, p in procs.items():
        if p.returncode:
            _say(f"[launch] {name} exited with {p.returncode}; its log ends:\n"
                 + _tail(work / f"{name}.log"), log)
    result = merge(args, runs, work, corpus_info, calib, t0, stems)
    write_result(out / "quality_trained.json", result["meta"], result["rows"],
                 beam_rows=result["beam_rows"])
    log.close()
    with tarfile.open(out / "quality_logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.glob("*.log")) + sorted(work.glob("*.json")):
            tar.add(path, arcname=f"quality_logs/{path.name}")
    print(summary(result))
    print(f"[launch] done in {time.time() - t0:.0f}s: {out / 'quality_trained.json'}, "
          f"{out / 'quality_logs.tar.gz'}")
    return result


def _last_step(path: Path) -> int:
    points = [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith("{")]
    return json.loads(points[-1])["step"] if points else 0


def _tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _run_info(run: dict, rec: dict) -> dict:
    return {k: run[k] for k in ("name", "arm", "K", "seed", "schedule", "lr", "sweep")} \
        | {k: rec.get(k) for k in ("status", "steps", "target_steps", "sec_per_step",
                                   "train_seconds", "eval_seconds", "params", "stem")}


def _record(work: Path, name: str) -> dict:
    path = work / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {"status": "no record", "rows": []}


def merge(args, runs: list[dict], work: Path, corpus_info: dict, calib, t0: float,
          stems: list[dict] = ()) -> dict:
    rows, beam_rows, run_info, records = [], [], [], {}
    for run in runs:
        rec = records[run["name"]] = _record(work, run["name"])
        run_info.append(_run_info(run, rec))
        if not run["sweep"]:
            rows += rec["rows"]
            beam_rows += rec.get("beam_rows", [])
    sweep = []
    for run in runs:
        if run["arm"] == "dense" and run["seed"] == 0 and (run["sweep"] or run["lr"] == args.lr):
            got = {(r["task"], r["metric"]): r["value"] for r in records[run["name"]]["rows"]
                   if r["test_T"] == args.train_T}
            accs = [v for (task, m), v in got.items() if m == "accuracy"]
            sweep.append({"lr": run["lr"], "steps": records[run["name"]].get("steps"),
                          "lm_loss": got.get(("lm", "loss")),
                          "mean_task_accuracy": sum(accs) / len(accs) if accs else None})
    command = "python benchmarks/quality/quality_train.py " + " ".join(sys.argv[1:])
    m = meta(args.device, command)
    m.update({
        "config": {name: getattr(args, name) for name in SHARED}
        | {"test_T": args.test_T, "eval_beams": args.eval_beams, "eval_grown": args.eval_grown,
           "lr": args.lr, "seeds": args.seeds, "arms": args.arms,
           "warmup_arms": args.warmup_arms, "time_budget": args.time_budget,
           "curriculum": args.phases, "gpus": args.gpus, "share_start": args.share_start,
           "stem_all": args.stem_all},
        "tasks": list(TRAIN_TASKS), "corpus": corpus_info, "calibration": calib,
        "runs": run_info, "stems": [_run_info(s, _record(work, s["name"])) for s in stems],
        "lr_sweep": sorted(sweep, key=lambda s: s["lr"]),
        "wall_seconds": round(time.time() - t0, 1),
        "notes": "accuracy = exact match per question (teacher-forced argmax of every answer "
                 "token); lm / lm_past<N> = mean next-byte cross-entropy (nats) on held-out "
                 "code, over all positions / targets at positions >= N; dense rows carry "
                 "schedule 'sparse' (dense from step 0); steps = optimizer steps reached; "
                 "beam_rows = the pisa runs' task accuracy re-evaluated with a wider walk "
                 "(beam W), the same weights (rows: W = K)."})
    return {"meta": m, "rows": rows, "beam_rows": beam_rows}


def summary(result: dict) -> str:
    """Mean over seeds per task, arm and schedule, one column per test length."""
    cells: dict[tuple, list] = {}
    for r in result["rows"] + result.get("beam_rows", []):
        arm = f"{r['arm']} W={r['W']}" if "W" in r else r["arm"]
        cells.setdefault((r["task"], arm, r["K"], r["schedule"], r["test_T"]), []).append(
            r["value"])
    lengths = sorted({k[4] for k in cells})
    lines = ["task | arm | K | schedule | " + " | ".join(f"T={T}" for T in lengths)]
    for key in sorted({k[:4] for k in cells}, key=lambda k: (k[0], k[1], k[2] or 0, k[3])):
        vals = [cells.get(key + (T,)) for T in lengths]
        lines.append(" | ".join(map(str, key)) + " | " + " | ".join(
            "-" if not v else f"{sum(v) / len(v):.4f} (n={len(v)})" for v in vals))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

def _optional_int(text: str) -> int | None:
    """An int, or "None" (how ``_child_argv`` passes an unset ``--head-dim``)."""
    return None if text == "None" else int(text)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launch", action="store_true", help="run the whole suite (parallel runs)")
    ap.add_argument("--out", default="quality_out", help="output folder")
    ap.add_argument("--time-budget", type=float, default=500.0,
                    help="seconds of wall clock for everything (launch) or this run")
    ap.add_argument("--eval-reserve", type=float, default=110.0,
                    help="seconds kept after the training deadline for evaluation")
    ap.add_argument("--merge-reserve", type=float, default=15.0,
                    help="seconds kept after the evaluation deadline for merging")
    ap.add_argument("--work", help="launcher scratch folder (default: a new temp folder)")
    ap.add_argument("--ready-timeout", type=float, default=180.0,
                    help="seconds after launch when the runs start even if some still compile")
    ap.add_argument("--arms", nargs="+",
                    default=["dense", "pisa:8", "pisa:16", "flat_mean:16", "flat_lse:16"])
    ap.add_argument("--warmup-arms", nargs="*", default=["pisa:16", "flat_mean:16"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sweep", type=float, nargs="*", default=[0.5, 2.0],
                    help="learning-rate multipliers of extra dense seed-0 runs")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    ap.add_argument("--share-start", action=argparse.BooleanOptionalAction, default=True,
                    help="with --steps: train the curriculum's start, where every arm attends "
                         "every block (T <= K * C), once per seed and resume every run of that "
                         "seed from it")
    ap.add_argument("--stem-all", action="store_true",
                    help="with --share-start: every arm (nsa and the gated-branch arms too) "
                         "resumes its seed's dense stem, the stem a dense warm-up for those")
    ap.add_argument("--stem-dir", help="folder the stems are saved in and reused from by a "
                    "later launch with the same settings (default: the scratch folder)")
    ap.add_argument("--gpus", type=int,
                    help="GPUs the runs are spread over (default: every visible one)")
    # one run
    ap.add_argument("--run", default="run", help="run name (file names)")
    ap.add_argument("--arm", default="dense", choices=ARM_NAMES)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule", default="sparse", choices=SCHEDULES)
    ap.add_argument("--steps", type=int, help="optimizer steps (default: set by the launcher)")
    ap.add_argument("--sync", help="barrier folder shared with the launcher")
    ap.add_argument("--stop-at", type=int, help="stop after this many steps and save the state")
    ap.add_argument("--save-state", help="file --stop-at saves the state to")
    ap.add_argument("--resume", help="continue from a state file --stop-at saved (a stem)")
    ap.add_argument("--train-deadline", type=float, help="unix time training stops")
    ap.add_argument("--eval-deadline", type=float, help="unix time evaluation stops")
    ap.add_argument("--corpus", help="corpus file saved by ByteCorpus.save")
    ap.add_argument("--site", help="site-packages folder to read the corpus from")
    # shared by every run
    ap.add_argument("--train-T", type=int, default=4096)
    ap.add_argument("--curriculum", nargs="*", default=["256:0.6", "2048:0.2"], metavar="T:FRAC",
                    help="shorter lengths first: the first FRAC of the steps at length T, phase "
                         "after phase, the same tokens per step (e.g. 512:0.3 2048:0.3)")
    ap.add_argument("--test-T", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--batch", type=int, default=6, help="rows per step (multiple of 6)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=_optional_int, default=None,
                    help="per-head width (default width // heads); the nsa arm needs heads / "
                         "kv-heads >= 16: e.g. --heads 16 --kv-heads 1 --head-dim 16")
    ap.add_argument("--mlp", type=int, default=768)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-warmup", type=int, default=50)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.7,
                    help="schedule 'warmup': fraction of the steps trained densely")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-examples", type=int, default=32)
    ap.add_argument("--eval-beams", type=int, nargs="*", default=[2, 4], metavar="MULT",
                    help="pisa runs: also evaluate the tasks with beam W = MULT * K")
    ap.add_argument("--eval-grown", action=argparse.BooleanOptionalAction, default=True,
                    help="pisa runs: also evaluate past train_T with beam_ref_len = train_T")
    ap.add_argument("--lm-windows", type=int, default=8)
    ap.add_argument("--lm-past", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=65536, help="tokens per eval forward")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if (args.stop_at is None) != (args.save_state is None):
        ap.error("--stop-at and --save-state go together")
    if args.batch % len(TRAIN_TASKS):
        ap.error(f"--batch must be a multiple of {len(TRAIN_TASKS)} (LM + {len(TASKS)} tasks)")
    try:
        args.phases = parse_curriculum(args.curriculum, args.train_T, args.batch)
    except ValueError as e:
        ap.error(str(e))
    if args.gpus is None:
        args.gpus = max(1, torch.cuda.device_count()) if args.device.startswith("cuda") else 1
    now = time.time()
    if args.train_deadline is None:
        args.train_deadline = now + args.time_budget - args.eval_reserve
    if args.eval_deadline is None:
        args.eval_deadline = now + args.time_budget
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.launch:
        return launch(args)
    torch.set_num_threads(args.threads)
    return run_one(args)


if __name__ == "__main__":
    main()
