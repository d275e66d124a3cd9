"""Long offline documents for the quality evaluations (no network).

First choice: the Python documentation Debian ships in ``python3.X-doc`` (its ``_sources/*.rst.txt``
are the pages as plain reStructuredText). Fallback, present on any machine that runs this
package: the standard library's own ``.py`` sources. Documents come largest first, so sample ``i``
of a given length is deterministic on a given machine.
"""
from __future__ import annotations

import functools
import glob
import os
import sysconfig

import torch

DOC_SOURCES = "/usr/share/doc/python3*/html/_sources"
# Characters read per wanted token (generous: code and markup tokenise at ~3-4 characters).
CHARS_PER_TOKEN = 8
# Documents that ``pisa eval recall`` reads first; the language-modelling measurements
# (``pisa eval ppl``, passkey's) skip them.
HELD_OUT_SKIP = 8


def _doc_files() -> tuple[str, list[str]]:
    for folder in sorted(glob.glob(DOC_SOURCES), reverse=True):
        files = glob.glob(os.path.join(folder, "**", "*.rst.txt"), recursive=True)
        if files:
            return f"python docs ({os.path.dirname(os.path.dirname(folder))})", files
    stdlib = sysconfig.get_paths()["stdlib"]
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d != "site-packages"]  # a walk of it takes seconds
        files += [f for f in (os.path.join(root, n) for n in names if n.endswith(".py"))
                  if f"{os.sep}test" not in f[len(stdlib):]]
    return f"python stdlib sources ({stdlib})", files


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, list[str]]:
    """``(description, files)``: the corpus in use and its documents, largest first."""
    name, files = _doc_files()
    return name, sorted(files, key=lambda f: (-os.path.getsize(f), f))


def token_samples(tokenizer, length: int, n: int, skip: int = 0) -> list[torch.Tensor]:
    """``n`` token sequences ``[1, length]`` (int64), each the start of one document holding at
    least ``length`` tokens, taking documents largest first after skipping the first ``skip``
    of those long enough."""
    out, seen = [], 0
    for path in corpus()[1]:
        if os.path.getsize(path) < length:  # a token takes at least one byte: none left
            break
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(CHARS_PER_TOKEN * length)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        if ids.shape[1] < length:
            continue
        seen += 1
        if seen > skip:
            out.append(ids[:, :length])
        if len(out) == n:
            return out
    raise ValueError(f"the corpus ({corpus()[0]}) has only {len(out)} documents of >= {length} "
                     f"tokens after skipping {skip}, {n} wanted")
