"""What the ``pisa eval`` tasks share: the arm parser, ``--model``, the loader and ``set_arm``."""
import json

import pytest
import torch

from pisa.eval.common import (ARM_KNOBS, SELECTION_DEFAULTS, Arm, model_name, model_path,
                              parse_arm, parse_arms)
from pisa.eval.gpt import ARMS, PER_TOKEN


def test_named_arms_start_from_their_knobs_and_knobs_go_on_top():
    assert parse_arm("dense") == Arm("dense") and parse_arm("dense").dense
    assert parse_arm("pisa").knobs == SELECTION_DEFAULTS
    assert parse_arm("flat_lse").knobs == dict(SELECTION_DEFAULTS, **ARMS["flat_lse"])
    arm = parse_arm("pisa:query_tile=1,beam_leaf=none,topk=32,scorer=lse,forced_in_budget=false")
    assert arm.name == "pisa:query_tile=1,beam_leaf=none,topk=32,scorer=lse,forced_in_budget=false"
    assert arm.knobs == dict(SELECTION_DEFAULTS, query_tile=1, beam_leaf=None, topk=32,
                             scorer="lse", forced_in_budget=False)
    # a name not of ARMS is a label starting from pisa's knobs (or the base asked for)
    assert parse_arm("wide:beam=64") == Arm("wide", dict(SELECTION_DEFAULTS, beam=64))
    assert parse_arm("wide:beam=64", custom_base="pisa_qt1").knobs == dict(
        SELECTION_DEFAULTS, **PER_TOKEN, beam=64)


@pytest.mark.parametrize("texts, match", [
    (["dense:topk=4"], "dense takes no knobs"),
    (["pisa:topk"], "knob=value"),
    (["pisa:scale=1"], "unknown knob 'scale'"),
    (["pisa:backend=torch"], "unknown knob 'backend'"),
    ([":topk=4"], "name"),
    (["pisa", "pisa"], "named twice"),
    (["pisa:query_tile=3"], "'pisa:query_tile=3': query_tile must be a power of two"),
    (["pisa:topk=2"], "topk must be"),
    (["pisa:scorer=best"], "scorer must be one of"),
])
def test_bad_arms_are_refused_naming_the_flag_and_the_arm(texts, match):
    with pytest.raises(ValueError, match="argument --arms") as e:
        parse_arms(texts, {"block_size": 64, "topk": 16})
    assert match in str(e.value)


def test_arm_knobs_are_checked_on_top_of_the_run_knobs():
    parse_arms(["pisa:query_tile=32"], {"block_size": 64})
    with pytest.raises(ValueError, match="query_tile"):
        parse_arms(["pisa:query_tile=32"], {"block_size": 16})


def test_selection_defaults_are_the_integrations():
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.integrations.hf import MODEL_KNOBS, PISA_DEFAULTS
    assert SELECTION_DEFAULTS == {k: PISA_DEFAULTS[k] for k in SELECTION_DEFAULTS}
    # an arm sets pisa_attn's knobs; the model's (pisa_layers) are not arm knobs
    assert set(ARM_KNOBS) == set(PISA_DEFAULTS) - {"backend", *MODEL_KNOBS}


def test_model_path_takes_a_directory_with_config_or_a_gguf_file(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match="argument --model"):
        model_path(str(tmp_path / "m"))             # no config.json
    (tmp_path / "m" / "config.json").write_text("{}")
    assert model_path(str(tmp_path / "m")) == str(tmp_path / "m")
    (tmp_path / "x.gguf").write_bytes(b"")
    assert model_path(str(tmp_path / "x.gguf")).endswith("x.gguf")
    for bad in (tmp_path / "missing.gguf", tmp_path / "m" / "config.json"):
        with pytest.raises(ValueError, match="argument --model"):
            model_path(str(bad))
    assert model_name(str(tmp_path / "m") + "/") == "m" and model_name("a/b/x.gguf") == "x"
    assert model_name("a/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"


def test_load_model_reads_the_saved_model_and_set_arm_switches_every_knob(tiny_model_dirs):
    from pisa.eval.model import arm_fields, load_model, model_fields, set_arm
    model, tok = load_model(tiny_model_dirs["qwen2_gqa7"], "cpu")
    fields = model_fields(model, "q", "float32", "cpu")
    assert fields == {"model": "q", "layers": 2, "HQ": 7, "HKV": 1, "D": 16, "context": 8192,
                      "dtype": "float32", "device": "cpu"}
    assert tok.decode(tok("héllo 123", add_special_tokens=False).input_ids) == "héllo 123"
    ids = torch.tensor([tok("a long enough text " * 8, add_special_tokens=False).input_ids])
    with torch.no_grad():
        ref = model(ids).logits
        wide = parse_arm("pisa:topk=16,scorer=lse")   # every block of 152 tokens: dense
        set_arm(model, wide, block_size=16, topk=4, backend="torch")
        assert model.config.pisa_topk == 16 and model.config.pisa_scorer == "lse"
        assert arm_fields(model, wide) == {"impl": wide.name, "backend": "torch", "K": 16,
                                           "C": 16, "g": 2, "W": 16}
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)
        set_arm(model, "flat_mean", block_size=16, topk=4)  # nothing of the last arm stays
        assert (model.config.pisa_topk, model.config.pisa_scorer, model.config.pisa_selector,
                model.config.pisa_query_tile) == (4, "bound", "flat_mean", 1)
        assert (model(ids).logits - ref).abs().max() > 1e-3   # sparse past 4 blocks
        set_arm(model, "dense")
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(ids).logits, ref)
    assert json.loads(open(f"{tiny_model_dirs['qwen2_gqa7']}/config.json").read())[
        "num_key_value_heads"] == 1


@pytest.mark.parametrize("argv, flag", [
    (["ruler", "--model", "/nonexistent/model"], "--model"),
    (["ppl", "--model", "/nonexistent/model.gguf"], "--model"),
    (["ruler", "--arms", "dense", "pisa:query_tile=5"], "--arms"),
    (["ppl", "--arms", "pisa:nope=1"], "--arms"),
    (["passkey", "--arms", "dense:topk=4"], "--arms"),
    (["recall", "--arms", "dense"], "--arms"),
    (["ruler", "--depths", "-0.1"], "--depths"),
    (["ruler", "--slack", "-1"], "--slack"),
    (["ruler", "--samples", "0"], "--samples"),
    (["ruler", "--tasks", "qa_1"], "--tasks"),
    (["ppl", "--buckets", "0"], "--buckets"),
    (["ppl", "--lengths", "1"], "--lengths"),
    (["ppl", "--dtype", "float64"], "--dtype"),
    (["ppl", "--block-size", "48"], "--block-size"),
])
def test_bad_eval_flags_are_argparse_errors(argv, flag, capsys):
    from pisa.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *argv, "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: argument {flag}: " in err.strip().splitlines()[-1]
