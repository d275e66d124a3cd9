"""Serve with PISA: prefill a prompt, then decode token by token against a cache whose key
pyramid is updated in place (O(log N) a token instead of rebuilding it from all keys).

1. Kernel level: a ``pisa.PisaCache`` for one attention layer. The prompt is prefilled in chunks
   and then tokens are decoded one at a time, both through ``pisa.pisa_attn_with_kvcache``
   (which appends the new keys and values, then attends). Every output row is checked against
   ``pisa.pisa_attn`` over the whole sequence at the same knobs: a decode step selects per
   token, so the reference does too (``query_tile=1``).
2. Hugging Face: a tiny random-weight Llama (nothing downloaded) with
   ``attn_implementation="pisa"`` (``pisa.integrations.hf.register()``) generates greedily
   twice, over transformers' default cache (each step re-selects from all keys) and over
   ``PisaHFCache`` (each layer a ``PisaCache``); the two generations must agree. Skipped when
   transformers >= 5 is not installed.

Device: CUDA when available (Triton kernels), else CPU (the torch backend). Prompts are longer
than ``topk * block_size``, so the selection really prunes.

    python examples/serve.py                      # ~10 s on CPU
    python examples/serve.py --prompt 96 --new 8 --json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled checkout

import pisa  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=320, help="prompt tokens (default 320)")
    p.add_argument("--new", type=int, default=32, help="tokens decoded (default 32)")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk (default 128)")
    p.add_argument("--block-size", type=int, default=16, help="C (default 16)")
    p.add_argument("--topk", type=int, default=4, help="K (default 4)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the "
                   "matrices are tiny, and extra threads spin on a busy machine)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = p.parse_args(argv)
    if args.prompt <= args.topk * args.block_size:
        p.error(f"--prompt must exceed --topk x --block-size ({args.topk * args.block_size}) "
                "for the selection to prune")
    return args


def kernel_level(args) -> float:
    """Chunked prefill + decode through a ``PisaCache``; returns the largest difference from
    ``pisa_attn``'s rows, relative to their largest magnitude."""
    B, HQ, HKV, D = 2, 8, 2, 64
    T = args.prompt + args.new
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q, k, v = (torch.randn(B, T, h, D, device=args.device, dtype=dtype) for h in (HQ, HKV, HKV))
    # a decode step selects per token (query_tile=1); pisa_attn_with_kvcache's defaults are the
    # per-token walk (scorer="lse", beam_leaf=None), pisa_attn's the tiled one: name them all
    knobs = dict(topk=args.topk, query_tile=1, scorer="lse", beam_leaf=None)
    cache = pisa.PisaCache(B, T, HKV, D, block_size=args.block_size, dtype=dtype,
                           device=args.device)
    rows = []
    for s in range(0, args.prompt, args.chunk):  # chunked prefill: append, then attend
        e = min(s + args.chunk, args.prompt)
        rows.append(pisa.pisa_attn_with_kvcache(q[:, s:e], cache, k[:, s:e], v[:, s:e],
                                                **knobs))
    for t in range(args.prompt, T):  # decode: one token a step
        rows.append(pisa.pisa_attn_with_kvcache(q[:, t:t + 1], cache, k[:, t:t + 1],
                                                v[:, t:t + 1], **knobs))
    assert cache.cache_seqlens.tolist() == [T] * B  # the cache advanced its own lengths
    got = torch.cat(rows, dim=1)
    ref = pisa.pisa_attn(q, k, v, block_size=args.block_size, **knobs)
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def hf_level(args) -> dict | None:
    """Greedy generation of a tiny random Llama with PISA over transformers' default cache and
    over ``PisaHFCache``; None without transformers >= 5."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        import pisa.integrations.hf as pisa_hf
    except ImportError as e:
        print(f"Hugging Face part skipped: {e}")
        return None
    pisa_hf.register()
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=None,
                         pad_token_id=None)
    config.pisa_block_size, config.pisa_topk = args.block_size, args.topk  # pisa_<knob>
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(args.device).eval()
    model.set_attn_implementation("pisa")
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device=args.device)
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
              attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        start = time.perf_counter()
        default = model.generate(prompt, **kw)
        mid = time.perf_counter()
        cached = model.generate(prompt, past_key_values=pisa_hf.PisaHFCache(
            model.config, max_cache_len=args.prompt + args.new), **kw)
        end = time.perf_counter()
    same = int((cached[0, args.prompt:] == default[0, args.prompt:]).sum())
    print(f"hf: generated {args.new} tokens after a {args.prompt}-token prompt; PisaHFCache "
          f"agrees with the default cache on {same}/{args.new} ({end - mid:.1f} s vs "
          f"{mid - start:.1f} s)")
    return {"tokens": args.new, "same_tokens": same}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(f"device {args.device}; block_size {args.block_size}, topk {args.topk}")
    err = kernel_level(args)
    print(f"kernel: {args.prompt}-token prompt in chunks of {args.chunk}, {args.new} decode "
          f"steps through PisaCache; largest difference from pisa_attn's rows {err:.1e} "
          "(relative to their largest magnitude)")
    hf = hf_level(args)
    # fp32 rows differ by summation order only; bf16 (CUDA) rounds the inputs of both paths
    ok = err <= (2e-2 if args.device == "cuda" else 1e-5) and (hf is None
                                                               or hf["same_tokens"] == args.new)
    result = {"example": "serve", "device": args.device, "kernel_rel_err": err, "hf": hf,
              "ok": ok}
    if args.json:
        print(json.dumps(result))
    if not ok:
        sys.exit("serve: the cached path does not match its reference")
    return result


if __name__ == "__main__":
    main()
