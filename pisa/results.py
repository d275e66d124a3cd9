"""The result files every benchmark and eval command of the project writes.

Schema::

    {"meta": {"pisa", "commit", "device", "torch", "triton", "date", "command", ...},
     "rows": [{"op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype",
               "ms", "ms_min", "ms_max", "peak_gb", "recall", "mass", ...}]}

``meta`` says what was measured, where and when: the pisa version and git commit (``None``
outside a git checkout; ``+dirty`` with uncommitted changes), the card, torch and triton versions,
the UTC date and the command. A command that selects blocks adds ``backend`` (as resolved) and
``knobs`` (every selection knob, as given to ``pisa_select`` / ``pisa_attn``; ``None`` where the
library resolves it). In a row, ``ms`` is the median of the timed runs and ``ms_min`` / ``ms_max``
their spread (``None`` where a script keeps one number); ``W`` is the beam as resolved. A
benchmark adds its own keys to either (``extra`` columns of ``result_row``, keys of ``meta``).
The rows of ``pisa eval ruler`` / ``ppl`` on a real model (``impl`` the attention arm) add the
model's ``model`` (name), ``layers``, ``context`` (trained positions) and ``device``, then the
task's columns; their ``meta`` holds the same model fields and ``timings`` (seconds).
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from .version import __version__

# The root of the checkout this package runs from, when it runs from one.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def default_device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _git(root: Path, *args: str) -> str | None:
    """stdout of ``git -C root args``, or None when git is missing or fails."""
    try:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def git_commit(root: str | os.PathLike = PACKAGE_ROOT) -> str | None:
    """The commit checked out at ``root`` (default: the checkout pisa runs from), ``+dirty`` when
    tracked files differ from it; None when ``root`` is not the top of a git checkout (an
    installed wheel, even one inside another repository) or git is missing."""
    root = Path(root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return None
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    return commit + ("+dirty" if dirty else "")


def meta(device: str, command: str, **extra) -> dict:
    """Run metadata: pisa version and commit, card, torch and triton versions, UTC date, command
    (and ``extra`` keys)."""
    triton_version = None
    if importlib.util.find_spec("triton") is not None:
        import triton
        triton_version = triton.__version__
    return {"pisa": __version__, "commit": git_commit(), "device": device_name(device),
            "torch": torch.__version__, "triton": triton_version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, **extra}


def result_row(op: str, impl: str, backend: str, *, B: int, T: int, HQ: int, HKV: int, D: int,
               K: int, C: int, g: int, W: int | None, dtype: str, ms: float | None,
               ms_min: float | None = None, ms_max: float | None = None,
               peak_gb: float | None = None, recall: float | None = None,
               mass: float | None = None, **extra) -> dict:
    """One row of the schema above; ``extra`` (a benchmark's own columns) follows."""
    return {"op": op, "impl": impl, "backend": backend, "B": B, "T": T, "HQ": HQ, "HKV": HKV,
            "D": D, "K": K, "C": C, "g": g, "W": W, "dtype": dtype, "ms": ms, "ms_min": ms_min,
            "ms_max": ms_max, "peak_gb": peak_gb, "recall": recall, "mass": mass, **extra}


def write_result(path: str | os.PathLike | None, info: dict, rows: list[dict], **more) -> None:
    """``{"meta": info, "rows": rows, **more}`` as JSON to ``path`` (nothing without one). Writes
    to a temporary file and renames it, so a run killed mid-write keeps the previous file."""
    if not path:
        return
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": info, "rows": rows, **more}, f, indent=1)
    os.replace(tmp, path)
