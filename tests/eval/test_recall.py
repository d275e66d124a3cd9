"""``pisa eval recall`` machinery on a tiny random Llama and on synthetic attention."""
import json

import pytest
import torch

from pisa.eval import structured_qkv
from pisa.eval.recall import FIELDS, LayerQuality, RecallConfig, random_select, summarize

from .common import needs_smollm2


def test_random_select_is_causal_distinct_sorted_and_keeps_forced_blocks(rng):
    C, K, Tk, Tq = 8, 5, 100, 60
    idx = random_select(2, Tq, Tk, 3, C, K)
    assert idx.shape == (2, Tq, 3, K) and idx.dtype == torch.int32
    for t in range(Tq):
        cur = (Tk - Tq + t) // C
        for row in idx[:, t].reshape(-1, K).tolist():
            real = [b for b in row if b >= 0]
            assert row == real + [-1] * (K - len(real))          # -1 padded at the end
            assert real == sorted(set(real))                      # ascending, distinct
            assert len(real) == min(K, cur + 1) and max(real) == cur
            assert {0, max(cur - 1, 0), cur} <= set(real)         # forced blocks


def test_random_select_draws_differ_between_rows(rng):
    idx = random_select(1, 64, 512, 2, 8, 6)
    assert len({tuple(r) for r in idx[0, -20:, 0].tolist()}) > 1


def test_layer_quality_orders_selectors(rng):
    q, k, _ = structured_qkv(1, 512, 4, 2, 16, block_size=16, seed=int(rng))
    cfg = RecallConfig(block_size=16, topk=6, backend="torch")
    lq = LayerQuality(q, k, cfg)
    exact = lq.measure("pisa", W=16)           # g * W >= 32 leaves: the walk keeps every node
    assert exact["recall"] > 0.99 and abs(exact["mass_ratio"] - 1) < 1e-3
    narrow, rand = lq.measure("pisa", W=2), lq.measure("random")
    flat = lq.measure("flat_mean")
    for r in (narrow, rand, flat):
        assert 0 <= r["recall"] <= 1 and 0 < r["mass"] <= r["mass"] / r["mass_ratio"] + 1e-6
    assert rand["recall"] < narrow["recall"] and rand["mass"] < exact["mass"]
    with pytest.raises(ValueError, match="selector"):
        lq.measure("flat_lse")


def test_capture_records_post_rope_qk_without_changing_the_forward(rng):
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import capture_qk, tiny_llama
    model = tiny_llama(seed=int(rng))
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        ref = model(ids).logits
        with capture_qk(model, {0}) as qk:
            got = model(ids, use_cache=False).logits
        attn = model.model.layers[0].self_attn
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        k_pre = attn.k_proj(x).view(1, 40, 2, -1)
    torch.testing.assert_close(got, ref)
    assert model.config._attn_implementation == "sdpa" and set(qk) == {0}
    q, k = qk[0]
    assert q.shape == (1, 40, 4, 16) and k.shape == (1, 40, 2, 16)
    torch.testing.assert_close(k[:, 0], k_pre[:, 0])              # RoPE is identity at 0
    torch.testing.assert_close(k.norm(dim=-1), k_pre.norm(dim=-1))  # and a rotation after
    assert (k[:, 1:] - k_pre[:, 1:]).abs().max() > 1e-3


def test_recall_rows_schema_and_summary_on_tiny_llama(rng):
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import tiny_llama
    from pisa.eval.recall import format_table, recall_rows
    model = tiny_llama(seed=int(rng))
    cfg = RecallConfig(lengths=[128], block_size=8, topk=4, target=1.01)
    docs = {128: [torch.randint(0, 128, (1, 128)) for _ in range(2)]}
    rows = recall_rows(model, docs, cfg, "tiny")
    assert all(tuple(r) == FIELDS for r in rows)
    widths = sorted({r["W"] for r in rows if r["selector"] == "pisa"})
    assert widths == [4, 8, 16]  # K, 2K, 4K; 16 leaves: W >= 8 is already exact, no wider
    assert {(r["layer"], r["selector"]) for r in rows} == {
        (i, s) for i in (0, 1) for s in ("pisa", "flat_mean", "random")}
    assert all(0 <= r["recall"] <= 1 and 0 < r["mass"] <= 1 + 1e-6 for r in rows)
    s = summarize(rows, target=0.95)["128"]
    assert s["layers"] == 2 and 0 <= s["pisa_ge_flat_mean_share"] <= 1
    assert s["w_target_all"] in (4, 8, 16)
    assert "| 128 | 1 |" in format_table(rows)


def test_recall_arms_of_selection_v2_on_tiny_llama(rng):
    """``--arms``: each named knob set (tiles scored per token) and flat_mean get a row per
    layer; an arm whose budget covers every block captures the oracle's mass exactly."""
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import tiny_llama
    from pisa.eval.gpt import PER_TOKEN
    from pisa.eval.recall import recall_arms, recall_rows, summarize_arms
    model = tiny_llama(seed=int(rng))
    arms = recall_arms(["tile:query_tile=4,beam_leaf=8,tile_reduce=qmean",
                        "bound:scorer=bound,beam=2", "all:topk=16"])
    # a name not of ARMS starts from the per-token walk
    assert arms["tile"] == dict(PER_TOKEN, selector="pyramid", query_tile=4, beam_leaf=8,
                                tile_reduce="qmean")
    cfg = RecallConfig(lengths=[128], block_size=8, topk=4, arms=arms)
    rows = recall_rows(model, {128: [torch.randint(0, 128, (1, 128))]}, cfg, "tiny")
    assert {(r["layer"], r["selector"]) for r in rows} == {
        (i, s) for i in (0, 1) for s in ("tile", "bound", "all", "flat_mean")}
    assert all(0 <= r["recall"] <= 1 and 0 < r["mass_ratio"] <= 1 + 1e-6 for r in rows
               if r["selector"] != "all")
    summary = summarize_arms(rows, arms)["128"]
    assert summary["all"]["min_mass_ratio"] >= 1 - 1e-6  # 16 blocks: every causal block
    assert summary["tile"]["layers"] == 2 and summary["tile"]["knobs"] == arms["tile"]
    with pytest.raises(ValueError, match="--arms"):
        recall_arms(["bad:query_tile"])


@pytest.mark.slow
@needs_smollm2
def test_cli_eval_recall_on_smollm2(tmp_path):
    from pisa.cli import main
    out = tmp_path / "recall.json"
    assert main(["eval", "recall", "--lengths", "512", "--layers", "0", "--device", "cpu",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["summary"]["512"]["layers"] == 1
    assert {r["selector"] for r in result["rows"]} == {"pisa", "flat_mean", "random"}
    assert all(tuple(r) == FIELDS and r["model"] == "SmolLM2-135M-Instruct"
               for r in result["rows"])
