"""How far greedy decoding of ``hf_generate.py``'s random-weight model is from a near tie: the
step at which its tokens part when every layer's attention and MLP outputs move by about one
bf16 rounding (each element times ``1 +- 2**-8``, random signs), with dense SDPA attention.

``hf_generate.py`` reports how many of its 32 new tokens each arm shares with the eager
``PisaHFCache`` arm (``tokens = reference``); an arm that computes the same function with other
roundings (inductor's fused kernels under ``torch.compile``) may part early on a model whose top
logits lie close. This measures that closeness on the same model: per noise seed, the shared
prefix, the largest logit difference before the tokens part, the median gap between the top two
logits and the logits' scale.

    python benchmarks/serving/greedy_sensitivity.py --json benchmarks/results/greedy_sensitivity_cpu.json

Rows (``pisa.results`` schema, ``op: "greedy_sensitivity"``, ``impl: "sdpa"``; extra columns
``seed``, ``agree_prefix``, ``new_tokens``, ``max_logit_diff``, ``median_top2_gap``,
``logit_scale``). Default: the model of ``hf_generate.py`` (8 layers, width 2048, 32 / 4 heads
of 64, vocabulary 32000; ``hf_generate.build_model``), bf16, a 512-token random prompt, 32 new
tokens, noise seeds 1-3.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command, meta, result_row, write_result  # noqa: E402
from hf_generate import add_model_args, build_model  # noqa: E402 (this folder)


def _noise(model, seed: int) -> list:
    """Forward hooks moving each element of every layer's attention and MLP output by
    ``+- 2**-8`` of itself (about one bf16 rounding), the signs drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, inputs, out):
        h = out[0] if isinstance(out, tuple) else out
        sign = torch.randint(0, 2, h.shape, generator=gen).to(h.device, h.dtype) * 2 - 1
        h.add_(h * sign * 2 ** -8)
    return [m.register_forward_hook(hook) for layer in model.model.layers
            for m in (layer.self_attn, layer.mlp)]


def _greedy(model, ids, new_tokens: int, seed: int | None):
    """Greedy tokens and their logits ``[new_tokens, vocab]`` fp32, with noise for ``seed``."""
    hooks = [] if seed is None else _noise(model, seed)
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, attention_mask=torch.ones_like(ids),
                                 output_logits=True, return_dict_in_generate=True)
    finally:
        for h in hooks:
            h.remove()
    return out.sequences[0, ids.shape[1]:], torch.stack(out.logits)[:, 0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="noise seeds")
    add_model_args(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    args.lengths = [args.prompt_len]  # what build_model sizes the positions for
    model = build_model(args, args.device, torch.bfloat16)
    ids = torch.randint(2, args.vocab, (1, args.prompt_len), device=args.device)
    ref, ref_logits = _greedy(model, ids, args.new_tokens, None)
    top2 = ref_logits.topk(2, dim=-1).values
    gap, scale = float((top2[:, 0] - top2[:, 1]).median()), float(ref_logits.abs().max())
    rows = []
    for seed in args.seeds:
        tokens, logits = _greedy(model, ids, args.new_tokens, seed)
        parted = (tokens != ref).nonzero()
        agree = int(parted[0]) if len(parted) else args.new_tokens
        diff = float((logits[:agree + 1] - ref_logits[:agree + 1]).abs().max())
        rows.append(result_row(
            "greedy_sensitivity", "sdpa", "sdpa", B=1, T=args.prompt_len, HQ=args.heads,
            HKV=args.kv_heads, D=args.head_dim, K=None, C=None, g=None, W=None,
            dtype="bfloat16", ms=None, seed=seed, agree_prefix=agree,
            new_tokens=args.new_tokens, max_logit_diff=diff, median_top2_gap=gap,
            logit_scale=scale))
        print(f"seed {seed}: tokens agree for {agree} of {args.new_tokens}; largest logit "
              f"difference up to there {diff:.4f} (median top-2 gap {gap:.4f}, logits up to "
              f"{scale:.2f})", flush=True)
    write_result(args.json, meta(args.device, command(), layers=args.layers, hidden=args.hidden,
                                 vocab=args.vocab), rows)


if __name__ == "__main__":
    main()
