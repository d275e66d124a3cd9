"""The result files every benchmark and eval command of the project writes.

Schema::

    {"meta": {"device", "torch", "triton", "date", "command", ...},
     "rows": [{"op", "impl", "backend", "B", "T", "HQ", "HKV", "D", "K", "C", "g", "W", "dtype",
               "ms", "peak_gb", "recall", "mass", ...}]}

``meta`` says where and when the numbers were measured (card, versions, UTC date, the command);
a benchmark adds its own keys to either (``extra`` columns of ``result_row``, keys of ``meta``).
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

import torch


def default_device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def meta(device: str, command: str, **extra) -> dict:
    """Run metadata: card, torch and triton versions, UTC date, command (and ``extra`` keys)."""
    triton_version = None
    if importlib.util.find_spec("triton") is not None:
        import triton
        triton_version = triton.__version__
    return {"device": device_name(device), "torch": torch.__version__, "triton": triton_version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, **extra}


def result_row(op: str, impl: str, backend: str, *, B: int, T: int, HQ: int, HKV: int, D: int,
               K: int, C: int, g: int, W: int | None, dtype: str, ms: float | None,
               peak_gb: float | None = None, recall: float | None = None,
               mass: float | None = None, **extra) -> dict:
    """One row of the schema above; ``extra`` (a benchmark's own columns) follows."""
    return {"op": op, "impl": impl, "backend": backend, "B": B, "T": T, "HQ": HQ, "HKV": HKV,
            "D": D, "K": K, "C": C, "g": g, "W": W, "dtype": dtype, "ms": ms, "peak_gb": peak_gb,
            "recall": recall, "mass": mass, **extra}


def write_result(path: str | os.PathLike | None, info: dict, rows: list[dict], **more) -> None:
    """``{"meta": info, "rows": rows, **more}`` as JSON to ``path`` (nothing without one). Writes
    to a temporary file and renames it, so a run killed mid-write keeps the previous file."""
    if not path:
        return
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": info, "rows": rows, **more}, f, indent=1)
    os.replace(tmp, path)
