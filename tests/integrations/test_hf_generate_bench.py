"""``benchmarks/serving/hf_generate.py`` at a tiny size on the CPU: every arm times prefill and
decode, each PISA arm took the path its name says (``attn_calls``), the PisaHFCache arms (static
too) give the tokens of ``generate`` over a DynamicCache, and ``--profile`` writes its tables."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.0")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "serving" / "hf_generate.py"
LAYERS, NEW = 2, 6


def test_hf_generate_cpu_smoke(tmp_path):
    out = tmp_path / "hf.json"
    # C = 16, K = 4: 64 of the 512 prompt keys attended, so the arms really are sparse
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--lengths", "512", "--layers",
           str(LAYERS), "--hidden", "256", "--new-tokens", str(NEW), "--block-size", "16",
           "--topk", "4", "--warmup-len", "0", "--profile", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # backend "auto" is torch on the CPU either way
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["command"].startswith("python ") and result["meta"]["transformers"]
    assert result["meta"]["update_gets_attention_kwargs"] in (True, False)
    rows = {(r["op"], r["impl"]): r for r in result["rows"]}
    # no graph arm on CPU; pisa_static is eager there (generate compiles on accelerators only)
    arms = ("pisa_cache", "pisa_static", "pisa_cache_loop", "pisa_dynamic", "sdpa")
    assert {impl for op, impl in rows if op == "hf_decode"} == set(arms)
    decode_calls = LAYERS * (NEW - 1)
    for arm in arms:
        prefill, decode = rows["hf_prefill", arm], rows["hf_decode", arm]
        assert prefill["T"] == decode["T"] == 512 and prefill["ms"] > 0
        assert decode["steps"] == NEW - 1 and 0 < decode["ms_min"] <= decode["ms"] \
            <= decode["ms_max"]
        calls = decode["attn_calls"]
        if arm == "sdpa":
            assert calls == {} and decode["K"] is None
            continue
        assert (decode["K"], decode["C"]) == (4, 16)
        kind = "pisa_attn" if arm == "pisa_dynamic" else "with_kvcache"
        assert calls == {kind: {"prefill": LAYERS, "decode": decode_calls}}, arm
        assert decode["tokens_equal"] and decode["agree_prefix"] == NEW, arm
    assert rows["hf_decode", "pisa_static"]["first_logits_maxdiff"] == 0.0
    text = (tmp_path / "hf_profile.txt").read_text()
    for title in ("generate over PisaHFCache", "eager loop over PisaHFCache"):
        assert f"== {title}, 3 decode steps, T=512: top 40 by self CPU time ==" in text
    assert text.count("Self CPU %") == 4 and text.count("top 20 by self device time") == 2
    for name in ("generate", "loop"):
        per_step = rows["profile", f"pisa_cache_{name}"]["per_step"]
        assert per_step["empty"] > 0 and "local_scalar_dense" in per_step
        assert (tmp_path / f"hf_trace_{name}.json.gz").stat().st_size > 0
