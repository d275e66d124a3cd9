"""``pisa eval passkey`` machinery: prompts, scoring, and the arms on a tiny random Llama."""
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from pisa.eval.passkey import (DOOR_NEEDLE, DOOR_QUESTION, DOORS, NEEDLE, QUESTION,
                               PasskeyConfig, passkey_prompt, passkey_rows)

from .common import needs_smollm2


class CharTokenizer:
    """One token per ASCII character (vocab 128), enough for the tiny model."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [min(ord(c), 127) for c in text]
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors else ids)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


class Parrot:
    """A stand-in model whose greedy answer is the first number of its prompt (plus noise)."""

    def parameters(self):
        yield torch.zeros(1)

    def set_attn_implementation(self, impl):
        self.arms.append((impl, getattr(self.config, "pisa_selector", None)))

    def __init__(self, preamble=""):
        self.config = SimpleNamespace(_attn_implementation="sdpa")
        self.arms = []
        self.preamble = preamble

    def generate(self, ids, max_new_tokens, **kw):
        key = re.search(r"\d+", CharTokenizer().decode(ids[0])).group()
        answer = torch.tensor([[ord(c) for c in f"{self.preamble} {key}. ok"][:max_new_tokens]])
        return torch.cat([ids, answer], 1)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_hides_the_key_at_depth_and_asks_at_the_end(depth):
    tok = CharTokenizer()
    ids = passkey_prompt(tok, 1000, depth, 12345)
    text = tok.decode(ids[0])
    assert ids.shape[1] <= 1000 and text.endswith(QUESTION)
    at = text.index(NEEDLE.format(key=12345)) / (len(text) - len(QUESTION))
    assert abs(at - depth) < 0.1
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 50, 0.5, 12345)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_multi_key_prompt_names_every_door_and_asks_for_the_first(depth):
    tok = CharTokenizer()
    others = ((0.9, 22222), (0.1, 33333), (depth, 44444))  # one tie with the asked depth
    text = tok.decode(passkey_prompt(tok, 2000, depth, 11111, others)[0])
    assert text.endswith(DOOR_QUESTION.format(door=DOORS[0]))
    for door, key in zip(DOORS, (11111, 22222, 33333, 44444)):
        assert text.count(str(key)) == 1 and DOOR_NEEDLE.format(door=door, key=key) in text
    at = text.index(DOOR_NEEDLE.format(door=DOORS[0], key=11111)) / len(text)
    assert abs(at - depth) < 0.1
    assert text.index("11111") < text.index("44444")  # on a tie the asked needle comes first


def test_multi_key_rows_are_their_own_task():
    cfg = PasskeyConfig(lengths=[400], depths=[0.5], samples=2, keys=3, arms=["dense"])
    rows = passkey_rows(Parrot(), CharTokenizer(), cfg, "parrot")
    assert [(r["task"], r["keys"]) for r in rows] == [("passkey_multi", 3)]
    assert 0.0 <= rows[0]["value"] <= 1.0


def test_passkey_scores_answers_per_arm_and_depth():
    model, cfg = Parrot(), PasskeyConfig(lengths=[300], depths=[0.2, 0.8], samples=2)
    rows = passkey_rows(model, CharTokenizer(), cfg, "parrot")
    assert [(r["arm"], r["depth"]) for r in rows] == [
        (a, d) for d in (0.2, 0.8) for a in ("dense", "pisa", "flat_mean")]
    assert all(r["metric"] == "accuracy" and r["value"] == 1.0 for r in rows)
    assert model.arms[:3] == [("sdpa", None), ("pisa", "pyramid"), ("pisa", "flat_mean")]


def test_arms_run_through_pisa_on_tiny_llama_and_lm_metrics_are_consistent(rng):
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import tiny_llama
    from pisa.eval.passkey import format_table, lm_rows
    model = tiny_llama(seed=int(rng))
    cfg = PasskeyConfig(lengths=[260], depths=[0.5], block_size=8, topk=4, new_tokens=3)
    rows = passkey_rows(model, CharTokenizer(), cfg, "tiny")
    assert all(r["value"] in (0.0, 1.0) for r in rows)
    docs = {96: [torch.randint(0, 128, (1, 96)) for _ in range(2)]}
    rows = lm_rows(model, docs, cfg, "tiny")
    val = {(r["arm"], r["metric"]): r["value"] for r in rows}
    assert val[("dense", "agreement")] == val[("dense", "agreement_tail")] == 1.0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        nll = [torch.nn.functional.cross_entropy(model(d).logits[0, :-1], d[0, 1:])
               for d in docs[96]]
    assert math.isclose(val[("dense", "ppl")], math.exp(float(sum(nll)) / 2), rel_tol=1e-4)
    # the first K * C = 32 positions attend every block: PISA agrees with dense there
    for arm in ("pisa", "flat_mean"):
        assert val[(arm, "agreement")] >= 31 / 95 - 1e-6
        assert math.isfinite(val[(arm, "ppl")]) and math.isfinite(val[(arm, "ppl_tail")])
    assert "| lm | 96 |  | ppl |" in format_table(rows)


@pytest.mark.slow
@needs_smollm2
def test_cli_eval_passkey_on_smollm2(tmp_path):
    from pisa.cli import main
    out = tmp_path / "passkey.json"
    assert main(["eval", "passkey", "--lengths", "512", "--depths", "0.5", "--device", "cpu",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["task"], r["metric"]) for r in rows} == {
        ("passkey", "accuracy"), ("lm", "ppl"), ("lm", "ppl_tail"), ("lm", "agreement"),
        ("lm", "agreement_tail")}
    dense = next(r for r in rows if r["task"] == "passkey" and r["arm"] == "dense")
    assert dense["value"] == 1.0  # SmolLM2 finds a passkey in 512 tokens


def test_the_answer_budget_bounds_what_counts_and_rows_record_it():
    """A model that restates the question before the key ("the pass key. 87209") misses when
    the budget ends inside the digits and hits with room for them; rows carry ``new_tokens``."""
    model = Parrot(preamble=" the pass key.")
    got = {}
    for budget in (16, 20):  # 14 characters of preamble + space: 16 leaves 2 of 5 digits
        cfg = PasskeyConfig(lengths=[300], depths=[0.5], samples=2, arms=["dense"],
                            new_tokens=budget)
        rows = passkey_rows(model, CharTokenizer(), cfg, "parrot")
        got[budget] = rows[0]["value"]
        assert rows[0]["new_tokens"] == budget
    assert got == {16: 0.0, 20: 1.0}
