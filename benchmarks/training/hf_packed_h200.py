"""A packed batch through a random-weight Llama with ``attn_implementation="pisa"`` on one GPU.

    python benchmarks/training/hf_packed_h200.py --out benchmarks/results/hf_packed_h200.json

``DataCollatorWithFlattening`` packs ``--docs`` random documents of ragged lengths (up to
``--max-len`` tokens) into one row whose ``position_ids`` restart at each document (with
``return_flash_attn_kwargs``: transformers then hands the attention function ``cu_seq_lens_q/k``,
and the integration runs ``pisa_attn_varlen``). The packed forward's logits are compared with the
documents run one at a time (``max_rel_err``: the largest relative L2 error over documents), and
both are timed (``common.time_ms``), forward and forward + backward (a loss over the logits), with
peak memory. Model (``pisa.eval.model.tiny_llama``): bf16, ``--layers`` layers of width
``--width``, 16 query / 4 KV heads of 128; the library's default PISA knobs. ``--smoke``: tiny
shapes on the CPU (torch backend).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import Results, peak_gb, reset_peak, result_row, time_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import transformers
    from transformers import DataCollatorWithFlattening

    from pisa.eval.model import tiny_llama
    dev, dtype, heads, kv = "cuda", torch.bfloat16, 16, 4
    if args.smoke:
        dev, dtype, heads, kv = "cpu", torch.float32, 4, 2
        args.docs, args.max_len, args.layers, args.width = 3, 300, 2, 64
    model = tiny_llama(vocab_size=32000, num_layers=args.layers, hidden_size=args.width,
                       num_heads=heads, num_kv_heads=kv, attn_implementation="pisa",
                       backend="auto").to(dev, dtype)
    model.config.max_position_embeddings = args.max_len
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.max_len // 8, args.max_len + 1, (args.docs,), generator=gen)
    docs = [torch.randint(2, 32000, (int(n),), generator=gen) for n in lens]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = {k: v.to(dev) if torch.is_tensor(v) else v  # max_length_q / _k are ints
             for k, v in collate([{"input_ids": d.tolist()} for d in docs]).items()
             if k != "labels"}
    docs = [d.to(dev) for d in docs]
    out = Results(args.out, dev, docs=lens.tolist(), layers=args.layers, width=args.width,
                  heads=heads, kv_heads=kv, transformers=transformers.__version__)

    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0].float()
        alone = [model(d[None], use_cache=False).logits[0] for d in docs]  # fp32 per doc below
    errs = [float((packed[s:s + len(a)] - a.float()).norm() / a.float().norm())
            for s, a in zip(torch.tensor([0] + [len(a) for a in alone]).cumsum(0).tolist(), alone)]
    print(f"packed vs one at a time: max relative L2 error {max(errs):.2e} over {len(docs)} docs")

    def fwd_packed():
        return model(**batch, use_cache=False).logits

    def fwd_alone():
        return [model(d[None], use_cache=False).logits for d in docs]

    def fwdbwd(fn):
        def step():
            logits = fn()
            parts = logits if isinstance(logits, list) else [logits]
            sum(x.float().mean() for x in parts).backward()
        return step

    total = int(lens.sum())
    for impl, fn in (("packed", fwd_packed), ("one_at_a_time", fwd_alone)):
        for op, f in (("fwd", fn), ("fwdbwd", fwdbwd(fn))):
            reset_peak(dev)
            with torch.no_grad() if op == "fwd" else torch.enable_grad():
                ms = time_ms(f, dev)
            model.zero_grad(set_to_none=True)
            out.add(result_row(op, f"hf_llama_{impl}", "pisa", B=1, T=total, HQ=heads, HKV=kv,
                               D=args.width // heads, K=16, C=64, g=2, W=16,
                               dtype=str(dtype).removeprefix("torch."), ms=ms,
                               peak_gb=peak_gb(dev), max_rel_err=max(errs)))
    out.save(max_rel_err=max(errs))


if __name__ == "__main__":
    main()
