"""Synthetic long-context tasks and a byte-level code corpus, generated on the fly for training and
evaluating small models whose attention is dense, PISA or a flat selector.

Tokens are bytes (0..255) plus a few markers (``KEY`` .. ``MARK``, ids 256..259); ``VOCAB_SIZE``
leaves room for four more. Every task fills a length-``T`` row with random filler (lowercase
letters and spaces) and scatters its facts and questions through it (uniformly random,
non-overlapping). Answers are spans of tokens; the model predicts each answer token from the
tokens before it (teacher forcing), and a question counts as answered when all its tokens are.

=================  ==========================================================  ==================
task               facts  ->  questions                                        hard because
=================  ==========================================================  ==================
``needle_single``  ``KEY k1..k4 v1..v4`` once  ->  ``QRY k1..k4`` v1..v4          one block of T
                   ending the row
``needle_multi``   4 pairs of needles whose 4-letter keys differ in one letter  near-duplicate
                   ->  one question per pair, ending the row                   keys
``assoc_recall``   128 facts ``KEY k1 k2 v1 v2``, each asked once by            many facts, any
                   ``QRY k1 k2`` v1 v2 somewhere after it (multi-query)        distance
``var_track``      16 chains: ``SET x1 x2 d1 d2``, later ``SET y1 y2 x1 x2``,  two hops
                   later ``QRY y1 y2`` d1 d2 (interleaved)
``aggregate``      28 +- 8 marks ``MARK s`` over 4 symbols, one of them 2-4    every mark counts
                   more frequent than any other  ->  ``QRY MARK`` s ending      (top-K cannot see
                   the row                                                     them all)
=================  ==========================================================  ==================

(Counts are the defaults from ``T >= 4096``; assoc_recall and var_track scale them down below.)
Keys, names and symbols are uppercase letters, values digits. The answer follows the key
directly, with no marker between: a model answers by finding the earlier occurrence of the key
and copying what follows it (the induction pattern a language model on code learns anyway). A
marker between key and answer (``QRY k VAL`` -> v) would leave the token before every answer the
same marker, so one-token matching would carry no signal at all; here matching only the key's
last letter already answers many questions, and training sharpens it into matching the whole
key. The multi-query tasks give many answer tokens per row.

The language-modelling corpus is the Python sources of installed packages (see ``ByteCorpus``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

KEY, QRY, SET, MARK = range(256, 260)
VOCAB_SIZE = 264
FILLER = tuple(range(ord("a"), ord("z") + 1)) + (ord(" "),)
UPPER = tuple(range(ord("A"), ord("Z") + 1))
DIGITS = tuple(range(ord("0"), ord("9") + 1))


@dataclass
class TaskBatch:
    """One batch of a task.

    tokens: ``[B, T]`` int64 token ids.
    answer: ``[B, T]`` bool, True on answer tokens (the model predicts ``tokens[:, t]`` from
        position ``t - 1``, so the loss mask on logits is ``answer[:, 1:]``).
    span: ``[B, T]`` int64, the question index (``0 .. n_spans - 1``) of each answer token, -1
        elsewhere. Questions are numbered in generation order, not by position.
    n_spans: questions per row.
    """

    tokens: torch.Tensor
    answer: torch.Tensor
    span: torch.Tensor
    n_spans: int


@functools.cache  # built once per device: a host-to-device copy per call would sync every batch
def _alphabet(chars, device) -> torch.Tensor:
    return torch.tensor(chars, dtype=torch.long, device=device)


def _draw(alphabet: torch.Tensor, shape, gen: torch.Generator) -> torch.Tensor:
    """Uniform tokens of ``alphabet`` in ``shape``."""
    return alphabet[torch.randint(len(alphabet), shape, generator=gen, device=alphabet.device)]


def _distinct(n_choices: int, shape, gen: torch.Generator, device) -> torch.Tensor:
    """``[B, n]`` distinct integers in ``[0, n_choices)`` per row (``shape = (B, n)``)."""
    B, n = shape
    return torch.rand(B, n_choices, generator=gen, device=device).argsort(1)[:, :n]


def _codes(index: torch.Tensor, length: int, alphabet: torch.Tensor) -> torch.Tensor:
    """Strings ``[..., length]`` over ``alphabet``: the base-``len(alphabet)`` digits of
    ``index``, so distinct indices give distinct strings."""
    powers = len(alphabet) ** torch.arange(length - 1, -1, -1, device=index.device)
    return alphabet[(index[..., None] // powers) % len(alphabet)]


def _check_fits(name: str, T: int, need: int) -> None:
    if T < need:
        raise ValueError(f"T={T} is too short for task {name!r}: its facts and questions need "
                         f"{need} tokens")


def _haystack(B: int, T: int, gen: torch.Generator, device) -> torch.Tensor:
    return _draw(_alphabet(FILLER, device), (B, T), gen)


def _place(tokens: torch.Tensor, items: torch.Tensor, region: int,
           gen: torch.Generator) -> torch.Tensor:
    """Write ``items [B, n, L]`` into ``tokens[:, :region]`` in order, at random non-overlapping
    starts (sorted gaps drawn from the slack); returns the starts ``[B, n]``."""
    B, n, L = items.shape
    slack = region - n * L
    gaps = torch.randint(slack + 1, (B, n), generator=gen, device=tokens.device).sort(1).values
    starts = gaps + torch.arange(n, device=tokens.device) * L
    pos = (starts[:, :, None] + torch.arange(L, device=tokens.device)).flatten(1)
    tokens.scatter_(1, pos, items.flatten(1))
    return starts


def _marker(B: int, n: int, tok: int, device) -> torch.Tensor:
    return torch.full((B, n, 1), tok, dtype=torch.long, device=device)


def _random_rank(B: int, n: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[B, n]``: a random permutation of ``0 .. n-1`` per row."""
    return torch.rand(B, n, generator=gen, device=device).argsort(1)


def _scatter_items(tokens: torch.Tensor, items: torch.Tensor, rank: torch.Tensor, region: int,
                   gen: torch.Generator) -> torch.Tensor:
    """Write ``items [B, n, L]`` at random non-overlapping places in ``tokens[:, :region]``, item
    ``i`` the ``rank[b, i]``-th from the left; returns each item's start ``[B, n]``."""
    L = items.shape[2]
    ordered = torch.empty_like(items).scatter_(1, rank[..., None].expand(-1, -1, L), items)
    return _place(tokens, ordered, region, gen).gather(1, rank)


def _after(rank: torch.Tensor, first: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """Swap ranks so that item ``then[b, j]`` comes after item ``first[b, j]`` (the items of
    ``first`` are distinct, as are those of ``then``)."""
    a, b = rank.gather(1, first), rank.gather(1, then)
    return rank.scatter(1, first, torch.minimum(a, b)).scatter(1, then, torch.maximum(a, b))


def _batch(tokens: torch.Tensor, q_starts: torch.Tensor, q_len: int, answer_len: int) -> TaskBatch:
    """Questions start at ``q_starts [B, q]``, each ``q_len`` tokens ending in its answer of
    ``answer_len`` tokens."""
    B, T = tokens.shape
    q, dev = q_starts.shape[1], tokens.device
    pos = q_starts[:, :, None] + (q_len - answer_len) + torch.arange(answer_len, device=dev)
    span = torch.full((B, T), -1, dtype=torch.long, device=dev)
    span.scatter_(1, pos.flatten(1), torch.arange(q, device=dev).repeat_interleave(answer_len)
                  .expand(B, -1))
    return TaskBatch(tokens, span >= 0, span, q)


def _at_end(tokens: torch.Tensor, questions: torch.Tensor, answer_len: int) -> TaskBatch:
    """Write ``questions [B, q, L]`` as the last ``q * L`` tokens."""
    B, T = tokens.shape
    _, q, L = questions.shape
    tokens[:, T - q * L:] = questions.flatten(1)
    starts = T - q * L + L * torch.arange(q, device=tokens.device).expand(B, -1)
    return _batch(tokens, starts, L, answer_len)


def _retrieval(name: str, keys: torch.Tensor, values: torch.Tensor, asked: torch.Tensor, T: int,
               gen: torch.Generator, interleave: bool) -> TaskBatch:
    """Facts ``KEY key value`` for ``keys [B, n, Lk]``, ``values [B, n, Lv]`` and questions
    ``QRY key value`` for the facts ``asked [B, q]`` (distinct): all questions at the end, or
    (``interleave``) each somewhere after the fact it asks."""
    B, n, Lk = keys.shape
    Lv, q = values.shape[2], asked.shape[1]
    dev = keys.device
    facts = torch.cat([_marker(B, n, KEY, dev), keys, values], 2)
    idx = asked[:, :, None]
    questions = torch.cat([_marker(B, q, QRY, dev), keys.gather(1, idx.expand(-1, -1, Lk)),
                           values.gather(1, idx.expand(-1, -1, Lv))], 2)
    L = facts.shape[2]
    _check_fits(name, T, (n + q) * L)
    tokens = _haystack(B, T, gen, dev)
    if not interleave:
        _scatter_items(tokens, facts, _random_rank(B, n, gen, dev), T - q * L, gen)
        return _at_end(tokens, questions, Lv)
    rank = _after(_random_rank(B, n + q, gen, dev), asked,
                  n + torch.arange(q, device=dev).expand(B, -1))
    starts = _scatter_items(tokens, torch.cat([facts, questions], 1), rank, T, gen)
    return _batch(tokens, starts[:, n:], L, Lv)


def needle_single(batch: int, T: int, gen: torch.Generator, *, key_len: int = 4,
                  value_len: int = 4) -> TaskBatch:
    """One needle ``KEY k v`` (``key_len`` letters, ``value_len`` digits) at a uniformly
    random depth; the question ``QRY k`` ends the row."""
    dev = gen.device
    keys = _draw(_alphabet(UPPER, dev), (batch, 1, key_len), gen)
    values = _draw(_alphabet(DIGITS, dev), (batch, 1, value_len), gen)
    asked = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    return _retrieval("needle_single", keys, values, asked, T, gen, interleave=False)


def needle_multi(batch: int, T: int, gen: torch.Generator, *, pairs: int = 4, key_len: int = 4,
                 value_len: int = 4) -> TaskBatch:
    """``pairs`` pairs of needles whose keys differ in exactly one letter (not the first), each
    with its own value; one question per pair, at the end, asks one of its two keys (at random),
    so every question has a near-duplicate distractor. Keys of different pairs differ in their
    first letter (so all ``2 * pairs <= 52`` keys are distinct)."""
    if not 1 <= pairs <= len(UPPER) or key_len < 2:
        raise ValueError(f"needle_multi needs 1 <= pairs <= 26 and key_len >= 2, got pairs={pairs}"
                         f", key_len={key_len}")
    dev = gen.device
    upper = _alphabet(UPPER, dev)
    base = _draw(upper, (batch, pairs, key_len), gen)
    base[:, :, 0] = upper[_distinct(len(UPPER), (batch, pairs), gen, dev)]
    pos = torch.randint(1, key_len, (batch, pairs, 1), generator=gen, device=dev)
    shift = torch.randint(1, len(UPPER), (batch, pairs, 1), generator=gen, device=dev)
    old = base.gather(2, pos) - UPPER[0]
    twin = base.scatter(2, pos, upper[(old + shift) % len(UPPER)])  # one letter changed
    keys = torch.cat([base, twin], 1)  # pair p = facts p and pairs + p
    values = _draw(_alphabet(DIGITS, dev), (batch, 2 * pairs, value_len), gen)
    which = torch.randint(2, (batch, pairs), generator=gen, device=dev)
    asked = torch.arange(pairs, device=dev) + which * pairs
    return _retrieval("needle_multi", keys, values, asked, T, gen, interleave=False)


def assoc_recall(batch: int, T: int, gen: torch.Generator, *, pairs: int | None = None,
                 key_len: int = 2, value_len: int = 2) -> TaskBatch:
    """Multi-query associative recall: ``pairs`` (default ``min(128, T // 32)``) facts
    ``KEY k v`` with distinct ``key_len``-letter keys, each asked once by ``QRY k`` at a
    random place after it; facts and questions are scattered through the whole row, so every
    question is answered by a fact a random distance back, among many others."""
    pairs = min(128, T // 32) if pairs is None else pairs
    if not 1 <= pairs <= len(UPPER) ** key_len:
        raise ValueError(f"assoc_recall needs 1 <= pairs <= 26**key_len, got pairs={pairs}, "
                         f"key_len={key_len}")
    dev = gen.device
    keys = _codes(_distinct(len(UPPER) ** key_len, (batch, pairs), gen, dev), key_len,
                  _alphabet(UPPER, dev))
    values = _draw(_alphabet(DIGITS, dev), (batch, pairs, value_len), gen)
    asked = torch.arange(pairs, device=dev).expand(batch, -1)
    return _retrieval("assoc_recall", keys, values, asked, T, gen, interleave=True)


def var_track(batch: int, T: int, gen: torch.Generator, *, chains: int | None = None,
              name_len: int = 2) -> TaskBatch:
    """Two-hop variable tracking over ``chains`` (default ``min(16, T // 64)``) chains: a root
    ``SET x d`` (``name_len`` digits ``d``), later an alias ``SET y x``, later the question
    ``QRY y``, answered by ``d``; all chains interleaved through the row."""
    chains = min(16, T // 64) if chains is None else chains
    if not 1 <= 2 * chains <= len(UPPER) ** name_len:
        raise ValueError(f"var_track needs 1 <= 2 * chains <= 26**name_len, got chains={chains}, "
                         f"name_len={name_len}")
    dev = gen.device
    names = _codes(_distinct(len(UPPER) ** name_len, (batch, 2 * chains), gen, dev), name_len,
                   _alphabet(UPPER, dev))
    roots, aliases = names[:, :chains], names[:, chains:]
    digits = _draw(_alphabet(DIGITS, dev), (batch, chains, name_len), gen)
    set_ = _marker(batch, chains, SET, dev)
    items = torch.cat([torch.cat([set_, roots, digits], 2),
                       torch.cat([set_, aliases, roots], 2),
                       torch.cat([_marker(batch, chains, QRY, dev), aliases, digits], 2)], 1)
    L = items.shape[2]
    _check_fits("var_track", T, 3 * chains * L)
    # Three ranks per chain, sorted: root, then alias, then question.
    rank = _random_rank(batch, 3 * chains, gen, dev).view(batch, chains, 3).sort(2).values
    tokens = _haystack(batch, T, gen, dev)
    starts = _scatter_items(tokens, items, rank.transpose(1, 2).flatten(1), T, gen)
    return _batch(tokens, starts[:, 2 * chains:], L, name_len)


def aggregate(batch: int, T: int, gen: torch.Generator, *, symbols: int = 4,
              others: tuple[int, int] = (4, 8), margin: tuple[int, int] = (2, 4)) -> TaskBatch:
    """Most-frequent marked symbol. ``symbols`` distinct letters per row; every symbol but one
    is marked ``MARK s`` a uniform ``others`` (inclusive range) times, the winner ``margin``
    (inclusive range) times more than the most frequent of them; all marks scattered. The
    question ``QRY MARK`` ends the row and is answered by the winner."""
    if symbols < 2 or not 1 <= others[0] <= others[1] or not 1 <= margin[0] <= margin[1]:
        raise ValueError(f"aggregate needs symbols >= 2 and 1 <= lo <= hi ranges, got "
                         f"symbols={symbols}, others={others}, margin={margin}")
    dev = gen.device
    n_max = symbols * others[1] + margin[1]
    _check_fits("aggregate", T, 2 * n_max + 3)
    counts = torch.randint(others[0], others[1] + 1, (batch, symbols), generator=gen, device=dev)
    extra = torch.randint(margin[0], margin[1] + 1, (batch,), generator=gen, device=dev)
    counts[:, 0] = counts[:, 1:].max(1).values + extra  # symbol 0 wins
    letters = _alphabet(UPPER, dev)[_distinct(len(UPPER), (batch, symbols), gen, dev)]
    # Mark j carries symbol searchsorted(cumsum(counts), j); marks past the total become filler.
    slots = torch.arange(n_max, device=dev).repeat(batch, 1)
    which = torch.searchsorted(counts.cumsum(1), slots, right=True)
    real = which < symbols
    sym = letters.gather(1, which.clamp_max(symbols - 1))
    filler = _alphabet(FILLER, dev)
    marks = torch.stack([torch.where(real, MARK, _draw(filler, (batch, n_max), gen)),
                         torch.where(real, sym, _draw(filler, (batch, n_max), gen))], 2)
    tokens = _haystack(batch, T, gen, dev)
    _scatter_items(tokens, marks, _random_rank(batch, n_max, gen, dev), T - 3, gen)
    win = letters[:, :1]
    question = torch.cat([torch.full_like(win, QRY), torch.full_like(win, MARK), win], 1)
    return _at_end(tokens, question[:, None], 1)


TASKS = {"needle_single": needle_single, "needle_multi": needle_multi,
         "assoc_recall": assoc_recall, "var_track": var_track, "aggregate": aggregate}


def make_task(name: str, batch: int, T: int, gen: torch.Generator) -> TaskBatch:
    """A batch of task ``name`` (a key of ``TASKS``) with default difficulty, on ``gen.device``."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {name!r}")
    return TASKS[name](batch, T, gen)


# ------------------------------------------------------------------------------------------------
# Language modelling: byte-level Python sources
# ------------------------------------------------------------------------------------------------

TRAIN_PACKAGES = ("torch",)
VAL_PACKAGES = ("triton",)
FALLBACK_VAL_PACKAGES = ("torch/_dynamo",)
DOC_SEPARATOR = b"\x00"


def site_packages() -> Path:
    """The ``site-packages`` directory torch is installed in."""
    return Path(torch.__file__).resolve().parent.parent


def _sources(site: Path, package: str) -> list[Path]:
    root = site / package
    return sorted(root.rglob("*.py")) if root.is_dir() else []


@dataclass
class ByteCorpus:
    """Byte-level corpus, ``train`` and ``val`` as uint8 tensors; ``info`` records the split.

    The split is by whole packages and deterministic: training text is every ``*.py`` file under
    ``site/torch`` (sorted by path, joined by a NUL byte), minus the validation packages;
    validation text is every ``*.py`` under ``site/triton``, or, where triton is not installed,
    under ``site/torch/_dynamo`` (then left out of training).
    """

    train: torch.Tensor
    val: torch.Tensor
    info: dict

    @classmethod
    def from_site_packages(cls, site: Path | None = None,
                           train_packages=TRAIN_PACKAGES, val_packages=None) -> "ByteCorpus":
        site = Path(site) if site is not None else site_packages()
        if val_packages is None:
            present = [p for p in VAL_PACKAGES if (site / p).is_dir()]
            val_packages = tuple(present) or FALLBACK_VAL_PACKAGES
        val_roots = [(site / p).resolve() for p in val_packages]
        val_files = [f for p in val_packages for f in _sources(site, p)]
        train_files = [f for p in train_packages for f in _sources(site, p)
                       if not any(r in f.resolve().parents for r in val_roots)]
        if not train_files or not val_files:
            raise ValueError(f"no *.py sources under {site} for train packages {train_packages} "
                             f"({len(train_files)} files) or val packages {val_packages} "
                             f"({len(val_files)} files)")
        info = {"site": str(site), "train_packages": list(train_packages),
                "val_packages": list(val_packages), "train_files": len(train_files),
                "val_files": len(val_files)}
        corpus = cls(_join(train_files), _join(val_files), info)
        info.update(train_bytes=corpus.train.numel(), val_bytes=corpus.val.numel())
        return corpus

    def save(self, path: Path) -> None:
        """One file: ``torch.save`` of the two tensors and ``info``."""
        torch.save({"train": self.train, "val": self.val, "info": self.info}, path)

    @classmethod
    def load(cls, path: Path) -> "ByteCorpus":
        d = torch.load(path, weights_only=True)
        return cls(d["train"], d["val"], d["info"])


def _join(files: list[Path]) -> torch.Tensor:
    return torch.frombuffer(bytearray(DOC_SEPARATOR.join(f.read_bytes() for f in files)),
                            dtype=torch.uint8)


def lm_windows(data: torch.Tensor, batch: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, T]`` int64 windows of ``data`` (uint8, on ``gen.device``) at random offsets."""
    if data.numel() < T:
        raise ValueError(f"corpus of {data.numel()} bytes is shorter than T={T}")
    start = torch.randint(data.numel() - T + 1, (batch, 1), generator=gen, device=data.device)
    return data[start + torch.arange(T, device=data.device)].long()


def lm_eval_windows(data: torch.Tensor, n: int, T: int) -> torch.Tensor:
    """``[n, T]`` int64 windows at ``n`` evenly spaced offsets (deterministic; they overlap when
    ``n * T`` exceeds the data)."""
    if data.numel() < T:
        raise ValueError(f"corpus of {data.numel()} bytes is shorter than T={T}")
    start = torch.arange(n, device=data.device)[:, None] * (data.numel() - T) // max(n - 1, 1)
    return data[start + torch.arange(T, device=data.device)].long()
