"""A compiled static ``PisaHFCache`` against the eager cache, on the CPU under inductor: how often
greedy tokens part, per dtype, for a hybrid model (one PISA layer, one dense).

The GPU test ``test_gpu_static_cache_generate_is_compiled_and_graphed`` compares the two for the
model here (``tiny_llama``, block 16, top-4, ``pisa_layers=[1]``, a batch of two 200-token
prompts, 40 new tokens). The compiled dense layer attends every slot under a mask, so its sums
round otherwise; in bf16 that moves the sparse layer's queries by about a rounding, which now and
then flips a near-tied block choice, and that step's logits move by ~10x the others'. Per seed:
the step where each sequence's tokens part (40: never) and the largest logit difference before
it, relative to the largest logit.

    python benchmarks/checks/static_cache_rounding.py --json benchmarks/results/static_cache_rounding_cpu.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command, meta, result_row, write_result  # noqa: E402
import pisa.integrations.hf as pisa_hf  # noqa: E402
from pisa.eval.model import tiny_llama  # noqa: E402

NEW = 40


def _greedy(model, prompt, cache, compile_config=None):
    """Greedy ``generate`` over ``cache``: the new tokens ``[B, NEW]`` and logits ``[B, NEW, V]``
    fp32 (``compile_config``: its decode steps compiled, on any device)."""
    model.generation_config.compile_config = compile_config
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), output_logits=True,
                                 return_dict_in_generate=True,
                                 **{pisa_hf.cache_keyword(model): cache})
    finally:
        model.generation_config.compile_config = None
    return out.sequences[:, -NEW:], torch.stack(out.logits, 1).float()


def main() -> None:
    from transformers import CompileConfig
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=25)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    compiled = CompileConfig(backend="inductor", fullgraph=True)
    compiled._compile_all_devices = True  # transformers compiles on accelerators only
    rows = []
    for dtype in args.dtypes:
        parted_seeds = 0
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = tiny_llama(seed=seed, attn_implementation="pisa", block_size=16, topk=4,
                               layers=[1]).to(getattr(torch, dtype))
            prompt = torch.randint(2, 128, (2, 200))
            ref, ref_logits = _greedy(model, prompt, pisa_hf.PisaHFCache(model.config, 512))
            torch._dynamo.reset()
            got, logits = _greedy(model, prompt,
                                  pisa_hf.PisaHFCache(model.config, 512, static=True), compiled)
            diff = (logits - ref_logits).abs().amax(-1) / float(ref_logits.abs().max())
            parts = [int((got[b] != ref[b]).nonzero()[0]) if (got[b] != ref[b]).any() else NEW
                     for b in range(got.shape[0])]
            before = [float(diff[b, :p + 1 if p < NEW else NEW].max()) for b, p in enumerate(parts)]
            parted_seeds += min(parts) < NEW
            rows.append(result_row(
                "static_cache_rounding", "pisa_static_inductor", "torch", B=2, T=200, HQ=4,
                HKV=2, D=16, K=4, C=16, g=2, W=None, dtype=dtype, ms=None, seed=seed,
                parted_at=parts, max_rel_logit_diff=before,
                median_rel_logit_diff=float(diff.median())))
            print(f"{dtype} seed {seed}: tokens part at {parts}; largest logit difference up to "
                  f"there {[f'{x:.2e}' for x in before]} of the largest logit (median "
                  f"{float(diff.median()):.1e})", flush=True)
        print(f"{dtype}: {parted_seeds} of {args.seeds} seeds parted", flush=True)
    write_result(args.json, meta("cpu", command()), rows)


if __name__ == "__main__":
    main()
