"""``pisa eval ppl``: position buckets, the loss and agreement against a plain forward, and the
command end to end on tiny saved models (and the other eval commands through ``--model``)."""
import json
import math

import pytest
import torch

from pisa.eval.ppl import PplConfig, bucket_edges

from .common import needs_smollm2


def test_buckets_cover_every_predicted_position_once():
    assert bucket_edges(9, 4) == [1, 3, 5, 7, 9]
    assert bucket_edges(8192, 8) == [1 + 8191 * i // 8 for i in range(9)]
    assert bucket_edges(3, 8) == [1, 2, 3]          # fewer positions than buckets


def test_ppl_rows_match_a_plain_forward_and_show_a_late_loss(rng):
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import tiny_llama
    from pisa.eval.ppl import format_table, ppl_rows
    model = tiny_llama(seed=int(rng))
    docs = {128: [torch.randint(0, 128, (1, 128)) for _ in range(2)]}
    fields = {"model": "tiny", "layers": 2, "HQ": 4, "HKV": 2, "D": 16, "context": 8192,
              "dtype": "float32", "device": "cpu"}
    cfg = PplConfig(lengths=[128], buckets=4, arms=["pisa", "flat_mean"],
                    knobs={"block_size": 8, "topk": 4, "backend": "torch"})
    timings = {}
    rows = ppl_rows(model, docs, cfg, fields, timings)
    val = {(r["impl"], r["lo"], r["hi"], r["metric"]): r["value"] for r in rows}
    assert {r["impl"] for r in rows} == {"pisa", "flat_mean"}  # dense measured, not reported
    assert set(timings) == {"T=128/dense", "T=128/pisa", "T=128/flat_mean"}
    assert {(r["lo"], r["hi"]) for r in rows} == {(1, 128), (1, 32), (32, 64), (64, 96),
                                                  (96, 128)}
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        nll = torch.stack([torch.nn.functional.cross_entropy(model(d).logits[0, :-1], d[0, 1:],
                                                             reduction="none")
                           for d in docs[128]])
        model.set_attn_implementation("pisa")
        sparse = torch.stack([torch.nn.functional.cross_entropy(
            model(d).logits[0, :-1], d[0, 1:], reduction="none") for d in docs[128]])
    for lo, hi in ((1, 128), (96, 128)):
        dense = math.exp(float(nll[:, lo - 1:hi - 1].mean()))
        assert val[("pisa", lo, hi, "ppl_ratio")] * dense == pytest.approx(
            val[("pisa", lo, hi, "ppl")], rel=1e-6)
    # ppl_rows leaves the model on its last arm, flat_mean: a plain forward through it agrees
    assert val[("flat_mean", 1, 128, "ppl")] == pytest.approx(
        math.exp(float(sparse.mean())), rel=1e-4)
    # the first K * C = 32 tokens see every block: the first bucket agrees with dense
    assert val[("pisa", 1, 32, "agreement")] == 1.0 and val[("pisa", 1, 32, "ppl_ratio")] == \
        pytest.approx(1.0, abs=1e-4)
    assert all(0 <= val[(a, 1, 128, "agreement")] <= 1 for a in ("pisa", "flat_mean"))
    assert "| 128 | 96-127 |" in format_table(rows)


@pytest.mark.parametrize("task", ["ppl", "passkey", "recall"])
def test_cli_eval_commands_run_end_to_end_on_tiny_saved_models(task, tiny_model_dir, tmp_path):
    from pisa.cli import main
    out = tmp_path / f"{task}.json"
    common = ["--model", tiny_model_dir, "--device", "cpu", "--block-size", "16", "--topk", "4",
              "--json", str(out)]
    args = {"ppl": ["--lengths", "256", "--buckets", "2", "--arms", "dense", "pisa",
                    "flat_lse"],
            "passkey": ["--lengths", "320", "--new-tokens", "2", "--arms", "dense", "pisa"],
            "recall": ["--lengths", "256", "--layers", "1", "--arms", "pisa", "flat_lse"]}[task]
    assert main(["eval", task] + args + common) == 0
    result = json.loads(out.read_text())
    name = tiny_model_dir.rsplit("/", 1)[1]
    assert result["meta"]["model"] == name and result["meta"]["timings"]["load_s"] >= 0
    timed = {"ppl": {"T=256/dense", "T=256/pisa", "T=256/flat_lse"},
             "passkey": {"T=320/passkey", "T=320/lm"}, "recall": {"T=256"}}[task]
    assert set(result["meta"]["timings"]) == timed | {"load_s"}
    rows = result["rows"]
    assert rows and all(r["model"] == name for r in rows)
    if task == "ppl":
        gqa7 = "qwen2" in name
        assert {(r["impl"], r["HQ"], r["HKV"]) for r in rows} == {
            (a, 7 if gqa7 else 4, 1 if gqa7 else 2) for a in ("dense", "pisa", "flat_lse")}
        assert {(r["lo"], r["hi"]) for r in rows} == {(1, 256), (1, 128), (128, 256)}
        dense = [r for r in rows if r["impl"] == "dense" and r["metric"] == "agreement"]
        assert all(r["value"] == 1.0 for r in dense)
        # the exact block scan keeps more of the loss than nothing: finite, near dense
        assert all(math.isfinite(r["value"]) for r in rows)
    if task == "recall":
        assert {r["selector"] for r in rows} == {"pisa", "flat_lse", "flat_mean"}
        flat_lse = [r for r in rows if r["selector"] == "flat_lse"]
        assert all(r["recall"] == pytest.approx(1.0) for r in flat_lse)  # it is the oracle


@pytest.mark.slow
@needs_smollm2
def test_cli_eval_ppl_on_smollm2(tmp_path):
    from pisa.cli import main
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", "--lengths", "1536", "--buckets", "3", "--device", "cpu",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    val = {(r["impl"], r["lo"], r["hi"], r["metric"]): r["value"] for r in rows}
    # positions < K * C = 1024 attend every block; past them, close to dense
    assert val[("pisa", 1, 512, "agreement")] == val[("pisa", 512, 1024, "agreement")] == 1.0
    assert 0.95 < val[("pisa", 1024, 1536, "ppl_ratio")] < 1.05
    assert val[("dense", 1, 1536, "ppl")] < 30
