"""``pisa eval ruler``: the generator (deterministic, needles where it says), the scorers on
hand-made right and wrong answers, and the command end to end on tiny saved models."""
import json
from collections import Counter

import pytest
import torch

from pisa.eval.ruler import (FWE_NOISE, TASKS, Needles, RulerGenerator, Sample, forced_score,
                             match_score)

from .common import needs_smollm2

T = 1024  # the byte tokenizer spends ~400 tokens on the instructions and needles
NEEDLE_TASKS = [t for t, spec in TASKS.items() if isinstance(spec, Needles)]


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import byte_tokenizer
    return byte_tokenizer()


def _hay_depth(s: Sample, at: int) -> float:
    """Where token ``at`` lies in the haystack, the inserted needles left out."""
    inserted = sum(e - b for b, e in s.needles)
    before = sum(e - b for b, e in s.needles if e <= at)
    return (at - s.haystack[0] - before) / (s.haystack[1] - s.haystack[0] - inserted)


def test_samples_are_deterministic_per_seed_and_independent_of_the_rest(tok):
    a, b = RulerGenerator(tok, seed=3), RulerGenerator(tok, seed=3)
    for task in TASKS:
        first = a.sample(task, T, 0.5, 1)
        b.sample("fwe", 2 * T, None, 0)                   # other draws in between change nothing
        again = b.sample(task, T, 0.5, 1)
        assert (first.ids, first.answers, first.answer_ids) == (again.ids, again.answers,
                                                                  again.answer_ids)
        other = RulerGenerator(tok, seed=4).sample(task, T, 0.5, 1)
        assert other.ids != first.ids and other.answers != first.answers
        assert a.sample(task, T, 0.5, 2).answers != first.answers


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_needles_hold_the_answers_and_the_first_sits_at_its_depth(tok, task, depth):
    s = RulerGenerator(tok).sample(task, T, depth, 0)
    spec = TASKS[task]
    text = tok.decode(s.ids)
    assert T - 8 <= len(s.ids) + s.new_tokens <= T        # the haystack fills the length
    assert s.new_tokens == len(s.answer_ids) + 8
    needles = [tok.decode(s.ids[b:e]) for b, e in s.needles]
    assert len(needles) == spec.keys * spec.values
    assert all(n.startswith("One of the special magic") and n.endswith(".\n") for n in needles)
    # the first needle at its depth, to a line of the haystack (<= 64 tokens) either way
    assert abs(_hay_depth(s, s.needles[0][0]) - depth) < 0.15
    # every answer is in a needle about an asked key, in the order of the text
    assert len(s.answers) == spec.values * spec.queries
    holders = [next(i for i, n in enumerate(needles) if f" {a}." in n) for a in s.answers]
    assert [s.needles[i][0] for i in holders] == sorted(s.needles[i][0] for i in holders)
    question = tok.decode(s.ids[s.haystack[1]:])
    for i in holders:
        key = needles[i].split(" for ")[1].split(" is:")[0]
        assert key in question and text.count(needles[i]) == 1
    if spec.value == "uuid":
        assert all(len(a) == 36 and a.count("-") == 4 for a in s.answers)
    else:
        assert all(a.isdigit() and len(a) == 7 for a in s.answers)
    assert tok.decode(s.answer_ids) == " " + ", ".join(s.answers)
    assert [tok.decode(s.answer_ids[b:e]) for b, e in s.spans] == [" " + a for a in s.answers]


def test_variable_tracking_chains_in_order(tok):
    s = RulerGenerator(tok).sample("vt", T, None, 5)
    lines = [tok.decode(s.ids[b:e]) for b, e in s.needles]
    value = lines[0].split(" = ")[1].rstrip(".\n")
    assert value.isdigit() and lines[0] == f"VAR {s.answers[0]} = {value}.\n"
    for prev, name, line in zip(s.answers, s.answers[1:], lines[1:]):
        assert line == f"VAR {name} = VAR {prev}.\n"
    assert [b for b, _ in s.needles] == sorted(b for b, _ in s.needles)
    assert f"assigned the value {value}" in tok.decode(s.ids[s.haystack[1]:])


def test_frequent_words_are_the_most_frequent(tok):
    s = RulerGenerator(tok).sample("fwe", T, None, 0)
    counts = Counter(tok.decode(s.ids[slice(*s.haystack)]).split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == FWE_NOISE and ranked[1:4] == s.answers
    assert counts[s.answers[2]] > counts[ranked[4]]


def test_prompts_start_as_the_tokenizer_starts_a_text(tok):
    """A tokenizer that puts a BOS token before each text (Llama's) gets it once, first; the
    byte tokenizer (as SmolLM2's and Qwen2's) gets none."""
    from tokenizers import processors

    from pisa.eval.model import byte_tokenizer
    assert RulerGenerator(tok).sample("niah_single_1", T, 0.5, 0).ids[0] != tok.bos_token_id
    bos = byte_tokenizer()
    bos._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos.bos_token_id)])
    for task in ("niah_single_1", "fwe"):
        s = RulerGenerator(bos).sample(task, T, 0.5, 0)
        assert s.ids[0] == bos.bos_token_id and s.ids.count(bos.bos_token_id) == 1
        assert len(s.ids) + s.new_tokens <= T


def test_too_short_a_length_is_refused(tok):
    with pytest.raises(ValueError, match="too short for task niah_multiquery"):
        RulerGenerator(tok).sample("niah_multiquery", 300, 0.5, 0)
    with pytest.raises(ValueError, match="task must be one of"):
        RulerGenerator(tok).sample("qa", T, 0.5, 0)


def test_match_score_counts_whole_word_references():
    assert match_score(" 4417290. Done", ["4417290"]) == 1.0
    assert match_score("The number is 44172901", ["4417290"]) == 0.0       # not a whole word
    assert match_score("x14417290", ["4417290"]) == 0.0
    assert match_score(" 1111111, 2222222 and 9999999", ["1111111", "2222222", "3333333",
                                                          "4444444"]) == 0.5
    assert match_score("they are: qwerty, ASDFGH.", ["asdfgh", "qwerty"]) == 1.0


def test_forced_score_needs_every_token_of_a_reference():
    s = Sample("niah_multivalue", 64, 0.5, [0], ["12", "34"], [5, 1, 2, 9, 5, 3, 4], [(0, 3),
               (4, 7)], [], (0, 1), 10)
    assert forced_score([5, 1, 2, 7, 5, 3, 4], s) == 1.0   # the separator does not count
    assert forced_score([5, 1, 2, 9, 5, 3, 0], s) == 0.5
    assert forced_score([0] * 7, s) == 0.0


def test_teacher_forcing_scores_the_model_own_greedy_answer_right(tok, tiny_model_dirs):
    """Hand-made answers on a real forward: the tiny model's own greedy continuation is right
    under teacher forcing (the argmax positions line up with the answer), one changed token in a
    reference makes it wrong, and decoding it matches."""
    from pisa.eval.model import load_model
    from pisa.eval.ruler import score_sample
    model, tok = load_model(tiny_model_dirs["llama"], "cpu")
    s = RulerGenerator(tok).sample("niah_single_2", 512 + 256, 0.5, 0)
    with torch.no_grad():
        out = model.generate(torch.tensor([s.ids]), max_new_tokens=6, do_sample=False,
                             attention_mask=torch.ones(1, len(s.ids), dtype=torch.long),
                             pad_token_id=tok.eos_token_id)[0, len(s.ids):].tolist()
    s.answer_ids, s.spans = out, [(0, 3), (3, 6)]
    s.answers = [tok.decode(out[:3]), tok.decode(out[3:])]
    assert score_sample(model, tok, s, "forced")[0] == 1.0
    s.answer_ids = out[:4] + [(out[4] + 1) % 256] + out[5:]
    assert score_sample(model, tok, s, "forced")[0] == 0.5


def test_cli_ruler_end_to_end_on_tiny_saved_models(tiny_model_dir, tmp_path):
    from pisa.cli import main
    out = tmp_path / "ruler.json"
    gqa7 = "qwen2" in tiny_model_dir
    assert main(["eval", "ruler", "--model", tiny_model_dir, "--tasks", "niah_multikey", "vt",
                 "--lengths", "1024", "--depths", "0.25", "0.75", "--samples", "1",
                 "--mode", "forced", "--block-size", "16", "--topk", "4",
                 "--arms", "dense", "pisa:query_tile=1", "--device", "cpu",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["mode"] == "forced" and meta["HQ"] == (7 if gqa7 else 4) and meta["layers"] == 2
    assert set(meta["timings"]) == {"load_s", "T=1024/dense", "T=1024/pisa:query_tile=1"}
    assert meta["summary"]["1024"]["scores"].keys() == {"dense", "pisa:query_tile=1"}
    by = {(r["task"], r["depth"], r["impl"]): r for r in rows}
    assert set(by) == {(t, d, a) for a in ("dense", "pisa:query_tile=1") for t, d in (
        ("niah_multikey", 0.25), ("niah_multikey", 0.75), ("niah_multikey", None), ("vt", None),
        ("average", None))}
    for r in rows:
        assert r["op"] == "ruler" and r["T"] == 1024 and r["metric"] == "score"
        assert r["model"] == tiny_model_dir.rsplit("/", 1)[1] and r["context"] == 8192
        assert (r["HQ"], r["HKV"], r["D"]) == ((7, 1, 16) if gqa7 else (4, 2, 16))
        assert 0 <= r["value"] <= 1 and r["dtype"] == "float32" and r["device"] == "cpu"
        assert (r["K"], r["C"]) == ((None, None) if r["impl"] == "dense" else (4, 16))
    assert by[("niah_multikey", None, "dense")]["samples"] == 2
    assert by[("vt", None, "dense")]["samples"] == 2           # samples x depths, no depth
    assert by[("average", None, "dense")]["samples"] == 4
    assert by[("average", None, "dense")]["value"] == pytest.approx(
        (by[("niah_multikey", None, "dense")]["value"] + by[("vt", None, "dense")]["value"]) / 2)


def test_cli_ruler_generates_answers_on_the_gqa7_model(tiny_model_dirs, tmp_path, capsys):
    from pisa.cli import main
    out = tmp_path / "ruler.json"
    assert main(["eval", "ruler", "--model", tiny_model_dirs["qwen2_gqa7"], "--tasks",
                 "niah_single_1", "--lengths", "768", "--mode", "generate", "--slack", "0",
                 "--block-size", "16", "--topk", "4", "--device", "cpu",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["impl"], r["task"], r["mode"], r["samples"]) for r in rows if r["depth"] is None} \
        == {(a, t, "generate", 1) for a in ("dense", "pisa") for t in ("niah_single_1", "average")}
    assert "| niah_single_1 | 768 | 1 |" in capsys.readouterr().out


@pytest.mark.slow
@needs_smollm2
def test_cli_eval_ruler_on_smollm2(tmp_path):
    from pisa.cli import main
    out = tmp_path / "ruler.json"
    assert main(["eval", "ruler", "--tasks", "niah_single_2", "--lengths", "1024",
                 "--mode", "forced", "--arms", "dense", "--device", "cpu",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["model"], r["layers"], r["HQ"], r["HKV"], r["D"]) for r in rows} == {
        ("SmolLM2-135M-Instruct", 30, 9, 3, 64)}
    assert rows[0]["value"] == 1.0  # SmolLM2 finds one needle in 1K tokens
