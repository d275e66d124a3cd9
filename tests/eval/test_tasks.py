"""The synthetic tasks hold what their docstrings promise: answers follow from the row by a plain
reference solver, distractors are near duplicates, facts are spread over the whole row."""
from collections import Counter

import pytest
import torch

from pisa.eval.tasks import (FILLER, KEY, MARK, QRY, SET, TASKS, VOCAB_SIZE, ByteCorpus,
                             lm_eval_windows, lm_windows, make_task)

# (fact marker, key length, answer length) of each task: facts ``marker key value``, questions
# ``QRY key`` followed by the answer
LAYOUT = {"needle_single": (KEY, 4, 4), "needle_multi": (KEY, 4, 4), "assoc_recall": (KEY, 2, 2),
          "var_track": (SET, 2, 2), "aggregate": (MARK, 1, 1)}
UPPER = set(range(ord("A"), ord("Z") + 1))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _questions(row, name):
    """Per ``QRY``: (its position, the key it asks, the positions of its answer)."""
    _, key_len, answer_len = LAYOUT[name]
    out = []
    for q in (i for i, t in enumerate(row) if t == QRY):
        if name == "aggregate":  # ``QRY MARK`` answer
            assert row[q + 1] == MARK, "question layout broken"
        else:
            assert set(row[q + 1:q + 1 + key_len]) <= UPPER, "question layout broken"
        start = q + 1 + key_len
        out.append((q, tuple(row[q + 1:start]), list(range(start, start + answer_len))))
    return out


def _facts(row, marker, key_len, value_len, end):
    """``marker key value`` facts before ``end``: list of (position, key, value)."""
    out = []
    for p in range(end):
        if row[p] == marker:
            assert set(row[p + 1:p + 1 + key_len]) <= UPPER, "fact layout broken"
            out.append((p, tuple(row[p + 1:p + 1 + key_len]),
                        tuple(row[p + 1 + key_len:p + 1 + key_len + value_len])))
    return out


def solve(row, name):
    """The reference solver: answer every question from the facts before it."""
    marker, key_len, n = LAYOUT[name]
    got = []
    for q, key, _ in _questions(row, name):
        if name == "aggregate":
            counts = Counter(row[p + 1] for p in range(q) if row[p] == MARK)
            (top, n1), (_, n2) = counts.most_common(2)
            assert n1 - n2 >= 2, "the winner must lead by the margin"
            got.append([top])
            continue
        facts = {}
        for _, k, v in _facts(row, marker, key_len, n, q):
            assert k not in facts, f"key {k} set twice"
            facts[k] = v
        value = facts[key]
        if name == "var_track":  # the alias names its root, set earlier
            assert not any(chr(t).isdigit() for t in value), "the first hop must be an alias"
            value = facts[value]
            assert all(chr(t).isdigit() for t in value), "two hops must end at digits"
        got.append(list(value))
    return got


@pytest.mark.parametrize("name", sorted(TASKS))
def test_structure_and_reference_solver(name, rng):
    B, T = 4, 1024
    b = make_task(name, B, T, _gen(rng))
    assert b.tokens.shape == b.answer.shape == b.span.shape == (B, T)
    assert b.tokens.dtype == torch.long and b.answer.dtype == torch.bool
    assert int(b.tokens.min()) >= 0 and int(b.tokens.max()) < VOCAB_SIZE
    assert torch.equal(b.answer, b.span >= 0) and int(b.span.max()) == b.n_spans - 1
    for r in range(B):
        row, span = b.tokens[r].tolist(), b.span[r].tolist()
        questions = _questions(row, name)
        assert len(questions) == b.n_spans
        # every answer token belongs to one question, and each question has its own span id
        assert sorted(p for *_, pos in questions for p in pos) == \
            [i for i in range(T) if span[i] >= 0]
        assert all(len({span[p] for p in pos}) == 1 for *_, pos in questions)
        assert sorted(span[pos[0]] for *_, pos in questions) == list(range(b.n_spans))
        truth = [[row[p] for p in pos] for *_, pos in questions]
        assert solve(row, name) == truth
    n_questions = {"needle_single": 1, "needle_multi": 4, "assoc_recall": 32, "var_track": 16,
                   "aggregate": 1}
    assert b.n_spans == n_questions[name]  # the defaults at T = 1024


def test_needle_multi_questions_have_a_near_duplicate_distractor(rng):
    b = make_task("needle_multi", 8, 1024, _gen(rng))
    for r in range(8):
        row = b.tokens[r].tolist()
        questions = _questions(row, "needle_multi")
        facts = _facts(row, KEY, 4, 4, questions[0][0])
        assert len(facts) == 8
        for _, key, _ in questions:
            dist = sorted(sum(a != c for a, c in zip(key, k)) for _, k, _ in facts)
            assert dist[:2] == [0, 1], f"question key {key}: Hamming distances {dist}"


def test_facts_are_spread_over_the_whole_row(rng):
    T = 2048
    b = make_task("needle_single", 256, T, _gen(rng))
    depth = (b.tokens == KEY).float().argmax(1) / T
    assert depth.min() < 0.1 and depth.max() > 0.85 and 0.35 < depth.mean() < 0.65
    # Marks pooled over rows fill every quarter evenly (a single row of ~30 marks may miss one).
    rows = make_task("aggregate", 64, T, _gen(rng + 1)).tokens[:, :-3]  # less the question
    marks = (rows == MARK).nonzero()[:, 1]
    quarters = torch.bincount(marks * 4 // T, minlength=4).float() / len(marks)
    assert ((quarters > 0.2) & (quarters < 0.3)).all(), quarters
    row = make_task("assoc_recall", 1, T, _gen(rng + 2)).tokens[0].tolist()
    where = {k: p for p, k, _ in _facts(row, KEY, 2, 2, T)}
    gaps = [q - where[key] for q, key, _ in _questions(row, "assoc_recall")]
    assert min(gaps) > 0 and max(gaps) > T // 2  # asked after the fact, some from far back


def test_generation_is_deterministic_per_seed_and_filler_is_plain(rng):
    for name in TASKS:
        a, b = make_task(name, 2, 1024, _gen(rng)), make_task(name, 2, 1024, _gen(rng))
        c = make_task(name, 2, 1024, _gen(rng + 1))
        assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    tokens = make_task("assoc_recall", 2, 4096, _gen(rng)).tokens
    allowed = set(FILLER) | {KEY, QRY} | UPPER \
        | set(range(ord("0"), ord("9") + 1))
    assert set(tokens.flatten().tolist()) == allowed


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="too short"):
        make_task("needle_multi", 1, 64, _gen(0))
    with pytest.raises(ValueError, match="task must be one of"):
        make_task("sorting", 1, 1024, _gen(0))


def _site(tmp_path, with_triton=True):
    files = {"torch/a.py": b"alpha\n", "torch/sub/b.py": b"beta\n",
             "torch/_dynamo/c.py": b"gamma\n", "torch/notes.txt": b"skip\n",
             "triton/d.py": b"delta\n"}
    for rel, data in files.items():
        if with_triton or not rel.startswith("triton"):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_bytes(data)
    return tmp_path


def test_corpus_split_by_whole_packages(tmp_path):
    c = ByteCorpus.from_site_packages(_site(tmp_path / "with"))
    # sorted by path ("_" sorts before letters), joined by NUL
    assert bytes(c.train.tolist()) == b"gamma\n\x00alpha\n\x00beta\n"
    assert bytes(c.val.tolist()) == b"delta\n" and c.info["val_packages"] == ["triton"]
    c = ByteCorpus.from_site_packages(_site(tmp_path / "without", with_triton=False))
    assert bytes(c.train.tolist()) == b"alpha\n\x00beta\n"
    assert bytes(c.val.tolist()) == b"gamma\n" and c.info["val_packages"] == ["torch/_dynamo"]
    c.save(tmp_path / "c.pt")
    d = ByteCorpus.load(tmp_path / "c.pt")
    assert torch.equal(c.train, d.train) and torch.equal(c.val, d.val) and c.info == d.info


def test_lm_windows_are_slices_of_the_data(rng):
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    w = lm_windows(data, 5, 64, _gen(rng))
    text = bytes(data.tolist())
    assert w.shape == (5, 64) and all(bytes(r) in text for r in w.tolist())
    e = lm_eval_windows(data, 3, 100)
    assert torch.equal(e[0], data[:100].long()) and torch.equal(e[-1], data[-100:].long())
    with pytest.raises(ValueError, match="shorter than"):
        lm_windows(data, 1, 2000, _gen(rng))
