"""``pisa eval ruler``: RULER-style synthetic long-context tasks, generated offline, per arm.

In the spirit of RULER (Hsieh et al., 2024; its task design, written anew here, nothing
downloaded): each sample is one prompt of ``T`` tokens (answer included) built from the model's
own tokenizer, deterministic per ``--seed``:

====================  ==============================================================  ========
task                  the prompt hides ... and asks for                               haystack
====================  ==============================================================  ========
``niah_single_1``     one needle "One of the special magic numbers for KEY is: N."    noise
                      at the depth -> N (7 digits)
``niah_single_2``     the same                                                        corpus
``niah_single_3``     the same with a UUID for N                                      corpus
``niah_multikey``     4 needles of 4 keys (the asked one at the depth, the others     corpus
                      anywhere) -> the asked key's number
``niah_multivalue``   4 needles of one key (the first at the depth) -> all 4 numbers  corpus
``niah_multiquery``   4 needles of 4 keys (the first at the depth) -> all 4 numbers   corpus
``vt``                a chain "VAR A = 12345." "VAR B = VAR A." ... (4 hops,          noise
                      anywhere) -> the 5 variables holding the value
``fwe``               coded words drawn from a Zipf law (alpha 2; the most frequent   none
                      one is "....") -> the 3 most frequent others
====================  ==============================================================  ========

Haystacks: "noise" repeats the passkey filler sentences; "corpus" is lines of the offline
corpus (``pisa.eval.corpus``, from a seeded start line). Needles go between haystack lines at the
line boundary nearest their depth. The prompt ends with an answer prefix ("... mentioned in the
provided text is"); the canonical answer lists the references, ", "-separated.

Scoring (a sample's score is the share of its references answered; RULER's "all" match):
- ``generate`` mode: greedy decoding of up to the answer's tokens + ``--slack``; a reference is
  answered when it appears in the text as a whole word (case-insensitive).
- ``forced`` mode (teacher forcing, one forward per sample, for CPUs): the canonical answer is fed
  after the prompt; a reference is answered when the argmax at each of its tokens is that token.

Needle tasks run ``--samples`` per (length, depth); ``vt`` and ``fwe`` have no depth and run
``--samples`` x (number of depths) per length, so every task gets the same count.

Result file (``--json``): ``{"meta": {...}, "rows": [...]}``, rows in ``pisa.results``'s schema
(op "ruler", impl = the arm) plus ``model``, ``layers``, ``context``, ``device``, ``task``,
``depth`` (None: over all depths), ``mode``, ``samples``, ``metric`` ("score"), ``value``,
``correct`` (the summed sample scores) and ``ms`` (mean per sample); task "average" is the mean of
the per-task scores. ``meta["summary"]`` flags tasks where dense scores below 0.9 (too hard for
the model at that length: not PISA's loss).
"""
from __future__ import annotations

import argparse
import random
import re
import sys
import time
import uuid
from dataclasses import dataclass, field, replace

import torch

from .common import (DEFAULT_ARMS, add_arm_arguments, add_model_arguments,
                     check_common_arguments, eval_row, parse_arms, run_knobs, warn_past_context)
from .passkey import FILLER

NEEDLE = "One of the special magic {kind} for {key} is: {value}.\n"
NIAH_INTRO = ("Some special magic {kind} are hidden within the following text. Make sure to "
              "memorize them. I will quiz you about the {kind} afterwards.\n")
NIAH_ONE = ("\nWhat is the special magic {one} for {keys} mentioned in the provided text? "
            "The special magic {one} for {keys} mentioned in the provided text is")
NIAH_ALL = ("\nWhat are all the special magic {kind} for {keys} mentioned in the provided text? "
            "The special magic {kind} for {keys} mentioned in the provided text are")
VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text.\n"
VT_FIRST = "VAR {name} = {value}.\n"
VT_HOP = "VAR {name} = VAR {prev}.\n"
VT_QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the text "
               "above. Answer: According to the chain of variable assignments in the text above, "
               "{n} variables are assigned the value {value}, they are:")
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. Find "
             "the three most frequently appeared coded words.\n")
FWE_NOISE = "...."
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text? "
                "Answer: According to the coded text above, the three most frequently appeared "
                "words are:")
# Keys are adjective-noun pairs ("amber-harbor"): 1600 of them, ordinary words to the tokenizer.
ADJECTIVES = ("amber", "bitter", "bold", "brave", "bright", "calm", "clever", "cold", "crisp",
              "curious", "damp", "eager", "early", "faint", "fancy", "fierce", "gentle", "giant",
              "golden", "grumpy", "happy", "hollow", "humble", "icy", "jolly", "lazy", "little",
              "lively", "loud", "lucky", "mellow", "misty", "noble", "odd", "proud", "quiet",
              "rapid", "rusty", "silent", "sturdy")
NOUNS = ("anchor", "badger", "basket", "beacon", "breeze", "bridge", "candle", "canyon",
         "castle", "cellar", "comet", "dragon", "falcon", "feather", "garden", "glacier",
         "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "meadow",
         "mirror", "needle", "orchard", "otter", "pebble", "pepper", "pillow", "quarry", "rabbit",
         "ribbon", "saddle", "spider", "temple", "thunder", "violin", "window")
LINE_TOKENS = 64   # corpus lines longer than this are cut: needles go at least this close
POOL_FACTOR = 4    # corpus tokens read per prompt token (so that start lines vary)
FWE_VOCAB = 2000   # coded words ranked by the Zipf law (most draw no occurrence at all)


@dataclass(frozen=True)
class Needles:
    """A needle-in-a-haystack task: ``keys`` needles of distinct keys (``values`` per key), one
    key asked (``queries`` = 1) or all of them."""
    haystack: str = "corpus"
    value: str = "number"       # or "uuid"
    keys: int = 1
    values: int = 1
    queries: int = 1


@dataclass(frozen=True)
class VariableTracking:
    hops: int = 4
    haystack: str = "noise"


@dataclass(frozen=True)
class FrequentWords:
    alpha: float = 2.0
    top: int = 3
    word_len: int = 6


TASKS = {"niah_single_1": Needles(haystack="noise"), "niah_single_2": Needles(),
         "niah_single_3": Needles(value="uuid"), "niah_multikey": Needles(keys=4),
         "niah_multivalue": Needles(values=4), "niah_multiquery": Needles(keys=4, queries=4),
         "vt": VariableTracking(), "fwe": FrequentWords()}
SINGLE_NEEDLE = ("niah_single_1", "niah_single_2", "niah_single_3")
DENSE_BAR = 0.9  # a task where dense scores less is too hard for the model at that length


@dataclass
class Sample:
    """One prompt. ``ids``: the prompt tokens (ending with the answer prefix); ``answers``: the
    references; ``answer_ids``: the canonical answer's tokens, ``spans[i]`` those of
    ``answers[i]``; ``needles``: the ``[start, end)`` token spans of the inserted facts in
    ``ids`` (the asked / first one first); ``haystack``: the span of the filled context;
    ``new_tokens``: the generation budget. ``len(ids) + new_tokens <= T``."""
    task: str
    T: int
    depth: float | None
    ids: list[int]
    answers: list[str]
    answer_ids: list[int]
    spans: list[tuple[int, int]]
    needles: list[tuple[int, int]]
    haystack: tuple[int, int]
    new_tokens: int


class Haystack:
    """Token pieces to fill prompts with, each ``(ids, ends_line)``: "noise" (the filler
    sentences, repeated) or "corpus" (lines of the offline corpus, at least ``POOL_FACTOR *
    tokens`` of them, taken from a seeded start line and wrapping; a line longer than
    ``LINE_TOKENS`` is cut into pieces of which only the last ends the line)."""

    def __init__(self, tokenizer, kind: str, tokens: int):
        if kind == "noise":
            self.pieces = [(ids, True) for ids in
                           _encode(tokenizer, re.findall(r"\S[^.]*\.\s*", FILLER))]
        elif kind == "corpus":
            self.pieces = _corpus_pieces(tokenizer, POOL_FACTOR * tokens)
        else:
            raise ValueError(f"haystack must be 'noise' or 'corpus', got {kind!r}")
        self.kind = kind

    def take(self, n: int, rng: random.Random) -> list[tuple[list[int], bool]]:
        """Pieces holding exactly ``n`` tokens (the last one cut), from a random start line
        (noise: from the first sentence)."""
        starts = [i for i, (_, ends) in enumerate(self.pieces) if not i or self.pieces[i - 1][1]]
        i = rng.choice(starts) if self.kind == "corpus" else 0
        out, total = [], 0
        while total < n:
            ids, ends = self.pieces[i % len(self.pieces)]
            out.append((ids[:n - total], ends and len(ids) <= n - total))
            total += len(out[-1][0])
            i += 1
        return out


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False).input_ids if texts else []


def _corpus_pieces(tokenizer, tokens: int) -> list[tuple[list[int], bool]]:
    """The non-blank lines (newline kept) of the corpus documents, largest first, until they
    hold ``tokens`` tokens, as ``(ids, ends_line)`` pieces of at most ``LINE_TOKENS``."""
    from .corpus import CHARS_PER_TOKEN, corpus

    pieces, total = [], 0
    for path in corpus()[1]:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(CHARS_PER_TOKEN * (tokens - total))
        for ids in _encode(tokenizer, [x for x in text.splitlines(keepends=True) if x.strip()]):
            for s in range(0, len(ids), LINE_TOKENS):
                pieces.append((ids[s:s + LINE_TOKENS], s + LINE_TOKENS >= len(ids)))
                total += len(pieces[-1][0])
        if total >= tokens:
            return pieces
    raise ValueError(f"the corpus ({corpus()[0]}) holds only {total} tokens, {tokens} wanted")


def _leading_special(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before a text by itself (a BOS token for Llama; none for
    SmolLM2 or Qwen2): every prompt starts with them, as the model saw in training."""
    plain = _encode(tokenizer, ["a"])[0]
    full = tokenizer("a").input_ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    return full[:starts[0]] if starts else []


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), n)
    return [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]


def _values(rng: random.Random, kind: str, n: int) -> list[str]:
    """``n`` distinct 7-digit numbers or UUIDs."""
    out: list[str] = []
    while len(out) < n:
        value = (str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuid"
                 else str(rng.randrange(1_000_000, 10_000_000)))
        if value not in out:
            out.append(value)
    return out


def _words(rng: random.Random, n: int, length: int, letters: str) -> list[str]:
    """``n`` distinct random words of ``length`` ``letters``, in the order drawn."""
    out: dict[str, None] = {}
    while len(out) < n:
        out["".join(rng.choice(letters) for _ in range(length))] = None
    return list(out)


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _answer(tokenizer, answers: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """The canonical answer " a1, a2, ..." as tokens and each reference's span in them (each
    piece encoded alone, so the spans are exact)."""
    ids, spans = [], []
    for i, text in enumerate(answers):
        if i:
            ids += _encode(tokenizer, [","])[0]
        piece = _encode(tokenizer, [" " + text])[0]
        spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return ids, spans


def _fill(head: list[int], pieces: list[tuple[list[int], bool]],
          inserts: list[tuple[float, list[int]]], tail: list[int]):
    """``head`` + the haystack ``pieces`` with each ``(depth, ids)`` of ``inserts`` at the line
    boundary (start, end, or after a piece that ends a line) nearest ``depth`` of the haystack's
    tokens (those at one boundary by depth, then in the order given) + ``tail``. Returns
    ``(ids, spans of the inserts in the order given, haystack span)``."""
    total = sum(len(x) for x, _ in pieces)
    bounds, at = {0: 0}, 0  # boundary (pieces before it) -> tokens before it
    for b, (x, ends) in enumerate(pieces, 1):
        at += len(x)
        if ends or b == len(pieces):
            bounds[b] = at
    slot = [min(bounds, key=lambda b: abs(bounds[b] - d * total)) for d, _ in inserts]
    order = sorted(range(len(inserts)), key=lambda i: (slot[i], inserts[i][0]))
    ids, spans, j = list(head), [None] * len(inserts), 0
    for b in range(len(pieces) + 1):
        while j < len(order) and slot[order[j]] == b:
            spans[order[j]] = (len(ids), len(ids) + len(inserts[order[j]][1]))
            ids += inserts[order[j]][1]
            j += 1
        if b < len(pieces):
            ids += pieces[b][0]
    start = len(head)
    return ids + tail, spans, (start, len(ids))


class RulerGenerator:
    """Samples of the tasks for one tokenizer, deterministic per ``seed``: sample ``i`` of
    ``(task, T, depth)`` depends on nothing else (not on the other tasks, lengths or counts)."""

    def __init__(self, tokenizer, seed: int = 0, slack: int = 8):
        self.tokenizer, self.seed, self.slack = tokenizer, seed, slack
        self._haystacks: dict[tuple[str, int], Haystack] = {}
        self.start = _leading_special(tokenizer)

    def haystack(self, kind: str, T: int) -> Haystack:
        """The haystack of prompts of length ``T`` (its corpus pool grows with ``T``)."""
        if (kind, T) not in self._haystacks:
            self._haystacks[kind, T] = Haystack(self.tokenizer, kind, T)
        return self._haystacks[kind, T]

    def enc(self, text: str) -> list[int]:
        return _encode(self.tokenizer, [text])[0]

    def sample(self, task: str, T: int, depth: float | None, i: int) -> Sample:
        if task not in TASKS:
            raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
        rng = random.Random(f"ruler/{self.seed}/{task}/{T}/{depth}/{i}")
        spec = TASKS[task]
        make = {Needles: self._needles, VariableTracking: self._vt,
                FrequentWords: self._fwe}[type(spec)]
        return make(task, spec, T, depth, rng)

    def _budget(self, task, T, fixed, answer_ids) -> tuple[int, int]:
        """``(haystack tokens, generation budget)`` for a prompt of ``fixed`` other tokens."""
        new_tokens = len(answer_ids) + self.slack
        n = T - new_tokens - fixed
        if n < 1:
            raise ValueError(f"T={T} is too short for task {task} ({fixed + new_tokens} tokens "
                             "without any haystack)")
        return n, new_tokens

    def _needles(self, task, spec: Needles, T, depth, rng) -> Sample:
        kind, one = ("UUIDs", "UUID") if spec.value == "uuid" else ("numbers", "number")
        keys = [k for k in _keys(rng, spec.keys) for _ in range(spec.values)]
        values = _values(rng, spec.value, len(keys))
        # the first fact at the depth, the others anywhere; answers (and the keys asked) in the
        # order of the text (ties: the order given, as _fill places them)
        depths = [depth] + [rng.random() for _ in keys[1:]]
        inserts = [(d, self.enc(NEEDLE.format(kind=kind, key=k, value=v)))
                   for d, k, v in zip(depths, keys, values)]
        asked = set(keys[:spec.queries * spec.values])
        order = sorted((i for i, k in enumerate(keys) if k in asked), key=lambda i: depths[i])
        answers = [values[i] for i in order]
        asked_keys = list(dict.fromkeys(keys[i] for i in order))
        question = (NIAH_ONE.format(one=one, keys=asked_keys[0]) if len(answers) == 1
                    else NIAH_ALL.format(kind=kind, keys=_join(asked_keys)))
        return self._assemble(task, T, depth, rng, spec.haystack,
                              NIAH_INTRO.format(kind=kind), inserts, question, answers)

    def _vt(self, task, spec: VariableTracking, T, depth, rng) -> Sample:
        names = _words(rng, spec.hops + 1, 5, "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        value = str(rng.randrange(10_000, 100_000))
        texts = [VT_FIRST.format(name=names[0], value=value)]
        texts += [VT_HOP.format(name=n, prev=p) for p, n in zip(names, names[1:])]
        depths = sorted(rng.random() for _ in texts)  # the chain in order
        inserts = [(d, self.enc(t)) for d, t in zip(depths, texts)]
        return self._assemble(task, T, None, rng, spec.haystack, VT_INTRO, inserts,
                              VT_QUESTION.format(value=value, n=len(names)), names)

    def _assemble(self, task, T, depth, rng, haystack, intro, inserts, question, answers):
        answer_ids, spans = _answer(self.tokenizer, answers)
        head, tail = self.start + self.enc(intro), self.enc(question)
        fixed = len(head) + len(tail) + sum(len(x) for _, x in inserts)
        n, new_tokens = self._budget(task, T, fixed, answer_ids)
        pieces = self.haystack(haystack, T).take(n, rng)
        ids, needles, hay = _fill(head, pieces, inserts, tail)
        return Sample(task, T, depth, ids, answers, answer_ids, spans, needles, hay, new_tokens)

    def _fwe(self, task, spec: FrequentWords, T, depth, rng) -> Sample:
        vocab = [FWE_NOISE] + _words(rng, FWE_VOCAB - 1, spec.word_len,
                                     "abcdefghijklmnopqrstuvwxyz")
        answers = vocab[1:1 + spec.top]
        answer_ids, spans = _answer(self.tokenizer, answers)
        head, tail = self.start + self.enc(FWE_INTRO), self.enc(FWE_QUESTION)
        n, new_tokens = self._budget(task, T, len(head) + len(tail), answer_ids)
        zeta = sum(k ** -spec.alpha for k in range(1, len(vocab) + 1))
        words = n // 2  # a first guess of the words that fit; shrunk until the text does
        for _ in range(20):
            counts = [int(words * k ** -spec.alpha / zeta) for k in range(1, len(vocab) + 1)]
            bag = [w for w, c in zip(vocab, counts) for _ in range(c)]
            rng.shuffle(bag)
            text = self.enc(" " + " ".join(bag))
            ranked = all(counts[k] > counts[k + 1] for k in range(1, spec.top + 1))
            if len(text) <= n and ranked:
                break
            words = int(words * min(0.97, n / len(text)))
        else:
            raise ValueError(f"T={T} is too short for task {task}")
        ids = head + text + tail
        return Sample(task, T, None, ids, answers, answer_ids, spans, [],
                      (len(head), len(head) + len(text)), new_tokens)


def match_score(text: str, answers: list[str]) -> float:
    """Share of ``answers`` found in ``text`` as whole words (case-insensitive)."""
    found = [re.search(rf"(?<![0-9A-Za-z]){re.escape(a)}(?![0-9A-Za-z])", text, re.IGNORECASE)
             for a in answers]
    return sum(f is not None for f in found) / len(answers)


def forced_score(predicted: list[int], sample: Sample) -> float:
    """Share of the references whose every token the argmax ``predicted`` (one per answer token,
    under teacher forcing) gets right."""
    right = [predicted[s:e] == sample.answer_ids[s:e] for s, e in sample.spans]
    return sum(right) / len(right)


def score_sample(model, tokenizer, sample: Sample, mode: str) -> tuple[float, str]:
    """``(score, what the model answered)`` of one sample: greedy decoding (``generate``) or one
    teacher-forced forward (``forced``)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        if mode == "forced":
            ids = torch.tensor([sample.ids + sample.answer_ids[:-1]], device=device)
            logits = model(ids, use_cache=False, logits_to_keep=len(sample.answer_ids)).logits
            predicted = logits[0].argmax(-1).tolist()
            return forced_score(predicted, sample), tokenizer.decode(predicted)
        ids = torch.tensor([sample.ids], device=device)
        out = model.generate(ids, max_new_tokens=sample.new_tokens, do_sample=False,
                             attention_mask=torch.ones_like(ids),
                             pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        return match_score(text, sample.answers), text


@dataclass
class RulerConfig:
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [4096])
    depths: list[float] = field(default_factory=lambda: [0.5])
    samples: int = 1                    # per (task, length, depth); vt / fwe: x len(depths)
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    mode: str = "generate"
    slack: int = 8
    seed: int = 0
    knobs: dict = field(default_factory=dict)   # the run's: block_size, topk, beam, backend
    log: object = field(default_factory=lambda: sys.stderr, repr=False)  # stderr when run


def task_samples(gen: RulerGenerator, task: str, T: int, cfg: RulerConfig) -> list[Sample]:
    """The samples of one task and length: ``cfg.samples`` per depth for needle tasks, as many
    in all (``cfg.samples * len(cfg.depths)``, no depth) for the others."""
    if isinstance(TASKS[task], Needles):
        return [gen.sample(task, T, d, i) for d in cfg.depths for i in range(cfg.samples)]
    return [gen.sample(task, T, None, i) for i in range(cfg.samples * len(cfg.depths))]


def ruler_rows(model, tokenizer, cfg: RulerConfig, fields: dict,
               timings: dict | None = None) -> list[dict]:
    """Rows per (task, T, depth, arm), per (task, T, arm) over depths and the average over tasks
    per (T, arm); ``timings`` (a dict) gets each (T, arm)'s seconds."""
    from .model import arm_fields, set_arm

    arms = parse_arms(cfg.arms, cfg.knobs)
    gen = RulerGenerator(tokenizer, cfg.seed, cfg.slack)
    rows = []
    for T in cfg.lengths:
        samples = {task: task_samples(gen, task, T, cfg) for task in cfg.tasks}
        for arm in arms:
            set_arm(model, arm, **cfg.knobs)
            columns = arm_fields(model, arm)
            t_arm = time.perf_counter()
            per_task = {}
            for task, todo in samples.items():
                scores, t0 = [], time.perf_counter()
                for s in todo:
                    t1 = time.perf_counter()
                    score, said = score_sample(model, tokenizer, s, cfg.mode)
                    scores.append((s.depth, score))
                    print(f"[ruler] T={T} {task} depth={s.depth} {arm.name}: {score:.2f} "
                          f"{said.strip()[:60]!r} (want {', '.join(s.answers)}; "
                          f"{time.perf_counter() - t1:.1f} s)", file=cfg.log, flush=True)
                ms = 1000 * (time.perf_counter() - t0) / len(todo)
                per_task[task] = sum(v for _, v in scores) / len(scores)

                def row(depth, got, task=task, ms=ms):
                    return eval_row("ruler", columns, fields, T, ms, task=task, depth=depth,
                                    mode=cfg.mode, samples=len(got), metric="score",
                                    value=sum(got) / len(got), correct=sum(got))
                depths = sorted({d for d, _ in scores if d is not None})
                rows += [row(d, [v for dd, v in scores if dd == d]) for d in depths]
                rows.append(row(None, [v for _, v in scores]))
            if timings is not None:
                timings[f"T={T}/{arm.name}"] = round(time.perf_counter() - t_arm, 2)
            n = sum(len(x) for x in samples.values())
            rows.append(eval_row("ruler", columns, fields, T, None, task="average", depth=None,
                                 mode=cfg.mode, samples=n, metric="score",
                                 value=sum(per_task.values()) / len(per_task),
                                 correct=None))
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per length: each arm's per-task and average score, and the tasks where dense scores below
    ``DENSE_BAR`` (too hard for the model there: reported as such, not as PISA's loss)."""
    out = {}
    for T in sorted({r["T"] for r in rows}):
        at = [r for r in rows if r["T"] == T and r["depth"] is None]
        by = {}
        for r in at:
            by.setdefault(r["impl"], {})[r["task"]] = r["value"]
        dense = by.get("dense", {})
        out[str(T)] = {"scores": by, "too_hard_for_dense": sorted(
            t for t, v in dense.items() if t != "average" and v < DENSE_BAR)}
    return out


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per (task, T) over all depths, one column per arm."""
    arms = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["task"], r["T"], r["impl"]): r for r in rows if r["depth"] is None}
    lines = ["| task | T | samples | " + " | ".join(arms) + " |",
             "|---|---|---|" + "---|" * len(arms)]
    for task, T in dict.fromkeys((r["task"], r["T"]) for r in rows if r["depth"] is None):
        cells = [by.get((task, T, a)) for a in arms]
        n = next(c["samples"] for c in cells if c is not None)
        lines.append(f"| {task} | {T} | {n} | "
                     + " | ".join("" if c is None else f"{c['value']:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS),
                   help="tasks (default: all)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096],
                   help="prompt lengths T in tokens, answer included")
    p.add_argument("--depths", type=float, nargs="+", default=[0.5],
                   help="relative depths of the (first) needle, e.g. 0.1 0.3 0.5 0.7 0.9")
    p.add_argument("--samples", type=int, default=1,
                   help="samples per (task, length, depth); vt and fwe get as many per length "
                        "in all")
    p.add_argument("--mode", default="generate", choices=["generate", "forced"],
                   help="generate: greedy decoding, references matched in the text; forced: "
                        "one teacher-forced forward, references scored by argmax (CPU)")
    p.add_argument("--slack", type=int, default=8,
                   help="tokens decoding may write beyond the canonical answer's")
    p.add_argument("--seed", type=int, default=0)
    add_arm_arguments(p)
    add_model_arguments(p)


def check_arguments(args: argparse.Namespace) -> None:
    """The flags of this task the shared checks (``pisa.cli.check_flags``) leave:
    ``ValueError("argument --flag: ...")``."""
    if args.slack < 0:
        raise ValueError(f"argument --slack: must be >= 0, got {args.slack}")
    check_common_arguments(args)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from ..results import write_result
    from .corpus import corpus
    from .model import start_eval

    cfg = RulerConfig(tasks=args.tasks, lengths=args.lengths, depths=args.depths,
                      samples=args.samples, arms=args.arms, mode=args.mode, slack=args.slack,
                      seed=args.seed, knobs=run_knobs(args))
    model, tokenizer, info, fields = start_eval("ruler", args, argv)
    warn_past_context(fields, cfg.lengths, "ruler")
    info.update(corpus=corpus()[0], tasks=cfg.tasks, depths=cfg.depths, mode=cfg.mode,
                seed=cfg.seed, slack=cfg.slack)
    rows = []
    for T in cfg.lengths:
        for arm in cfg.arms:  # the file holds every finished (length, arm) if a run is cut short
            rows += ruler_rows(model, tokenizer, replace(cfg, lengths=[T], arms=[arm]), fields,
                               info["timings"])
            info["summary"] = summarize(rows)
            write_result(args.json, info, rows)
    print(format_table(rows))
    for T, s in info["summary"].items():
        if s["too_hard_for_dense"]:
            print(f"T={T}: dense scores below {DENSE_BAR} on {', '.join(s['too_hard_for_dense'])}"
                  " (too hard for the model at this length)")
    if args.json:
        print(f"wrote {args.json}")
    return 0

