"""Selection-v3 levers on real attention (issue 25): how much of the per-token exact scan's softmax
mass does each way of sharing work across a 16-token query tile keep?

One dense prefill of SmolLM2-135M (or ``--model``) records every layer's post-RoPE q / k
(``pisa.eval.model.capture_qk``); per layer the exact per-head block LSE ``[T, HQ, N]`` of every
query (a study at 8K: this ``[T, N]`` table is what the library never builds) gives every
selector's captured mass, reported over the mass of the per-token exact top-K (``flat_lse``, the
GQA group's summed block LSE, forced blocks in; C = 64, K = 16). Arms:

- ``defaults``: the library's tiles (16 tokens, mean query, bound scorer, W2 = 32);
  ``qmean_K{20,24,32}``: the same walk with more blocks a tile (W = 16);
- ``cand``: the tile walk's candidate leaves (the defaults with K = 80: every leaf reached);
  ``pick_{exact,mean,bound}``: each token picks its own K among them by its exact block LSE, its
  mean-key logit or its key-bound logit; ``union{16,4}``: blocks in the union of the exact picks
  of a 16- / 4-token (sub)tile (``_mass``: attending that union);
- ``msum_K*``: a tile-shared K ranked by the summed per-row softmax share among the candidates
  (all tokens' rows; ``every2`` / ``every4``: every 2nd / 4th token's rows; ``top{24,32}``: over
  the mean query's best 24 / 32 candidates only); ``msub{1,2,4}``: the same over 1, 2, 4
  sub-tile mean queries.

``--study library`` runs only the library's selections: ``defaults`` and ``mass_K{16,17,18,20}``
(``pisa_select(tile_reduce="mass", topk=K', beam=16)``, the knob built from ``msum``).

``--study decode`` (issue 27, decode's default selection): the per-token walk a decode step runs
(``query_tile=1``; a decode row equals that prefill row, tested) with each scorer and leaf beam:
``decode_{lse,bound}_W2_{16,32}`` (``scorer``; ``beam_leaf`` None = W = 16, or 32), and with
``branching=4`` (``_g4``: half the levels to walk, a cache built with g = 4). Today's decode
default is ``decode_lse_W2_16``; prefill's knobs per token are ``decode_bound_W2_32``.

    python benchmarks/quality/tile_levers.py --length 8192 \
        --json benchmarks/results/select_v3_levers_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import meta, write_result

from pisa import pisa_select
from pisa.ops.select import tiles_to_tokens

K, C, QT = 16, 64, 16
MASS_KS = (16, 17, 18, 20)
# --study decode: (branching, scorer, beam_leaf) of each per-token walk
DECODE_ARMS = [(2, scorer, leaf) for scorer in ("lse", "bound") for leaf in (None, 32)] + \
    [(4, "lse", None), (4, "lse", 32), (4, "bound", 32)]


def block_lse(q, k):
    """``[T, HQ, N]`` exact causal block LSE per head, fp32 (queries in chunks of 512)."""
    T, HQ, D = q.shape
    H, N = k.shape[1], -(-T // C)
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, N * C - T))
    out = torch.empty(T, HQ, N)
    for a in range(0, T, 512):
        e = min(T, a + 512)
        z = torch.einsum("thgd,shd->thgs", q[a:e].view(e - a, H, HQ // H, D), kp) / math.sqrt(D)
        z = z.masked_fill(torch.arange(N * C) > torch.arange(a, e)[:, None, None, None],
                          -math.inf)
        out[a:e] = torch.logsumexp(z.view(e - a, H, HQ // H, N, C), -1).view(e - a, HQ, N)
    return out


def top_mask(score, causal, forced, k):
    """Per row of ``score [R, H, N]``: the forced blocks and the best ``k - |forced|`` causal
    others."""
    s = score.masked_fill(~causal[:, None], -math.inf).masked_fill(forced[:, None], math.inf)
    m = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, s.topk(min(k, s.shape[-1]), -1).indices,
                                                       True)
    return m & causal[:, None]


def layer_levers(q, k, study="levers"):
    """``{arm: mass ratio (or union size)}`` for one layer's ``q [T, HQ, D]``, ``k [T, H, D]``;
    ``study="library"`` measures only the library's own selections (``defaults``, ``mass_K*``)."""
    T, HQ, D = q.shape
    H, N = k.shape[1], -(-T // C)
    G = HQ // H
    bl = block_lse(q, k)
    p = torch.exp(bl - torch.logsumexp(bl, -1, keepdim=True))       # per head's softmax share
    gsc = bl.view(T, H, G, N).sum(2)                                # the group's score
    cur, b = torch.arange(T) // C, torch.arange(N)
    forced = (b == 0) | (b == cur[:, None]) | (b == cur[:, None] - 1)
    causal = b <= cur[:, None]

    def mass(m):
        return float((p.view(T, H, G, N) * m[:, :, None]).sum(-1).mean())

    base = mass(top_mask(gsc, causal, forced, K))
    row = {}

    def add(name, m):
        row[name] = mass(m) / base

    def select(**knobs):
        idx, cnt = pisa_select(q[None], k[None], backend="torch", **knobs)
        idx = tiles_to_tokens(idx, cnt, T, T, knobs.get("query_tile") or QT)[0][0]
        m = torch.zeros(T, H, N + 1, dtype=torch.bool)
        return m.scatter_(-1, torch.where(idx < 0, N, idx.long()), True)[..., :N]

    if study == "decode":
        for g, scorer, leaf in DECODE_ARMS:
            add(f"decode_{scorer}_W2_{leaf or K}" + (f"_g{g}" if g != 2 else ""),
                select(query_tile=1, tile_reduce="sum", scorer=scorer, beam_leaf=leaf,
                       branching=g))
        return row
    add("defaults", select())
    if study == "library":
        for kt in MASS_KS:
            add(f"mass_K{kt}", select(tile_reduce="mass", topk=kt, beam=16))
        return row
    for kt in (20, 24, 32):
        add(f"qmean_K{kt}", select(topk=kt, beam=16))
    cand = select(topk=80, beam=16)
    row["cand_size"] = float(cand.sum(-1).float().mean())
    kb = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, N * C - T)).view(N, C, H, D)
    real = (torch.arange(N * C) < T).view(N, C)[..., None, None]
    kmean = (kb * real).sum(1) / real.sum(1)
    kmax, kmin = kb.masked_fill(~real, -1e9).amax(1), kb.masked_fill(~real, 1e9).amin(1)
    qg = q.view(T, H, G, D) / math.sqrt(D)
    lo, hi = (x.permute(1, 0, 2)[None, :, None] for x in (kmin, kmax))
    cheap = {"exact": gsc, "mean": torch.einsum("thgd,bhd->thb", qg, kmean),
             "bound": torch.maximum(qg[..., None, :] * lo, qg[..., None, :] * hi).sum((-1, 2))}
    for name, sc in cheap.items():
        m = top_mask(sc.masked_fill(~cand, -math.inf), causal, forced, K) & cand \
            | (forced & causal)[:, None]
        add(f"pick_{name}", m)
        if name == "exact":
            for sub in (16, 4):
                u = m.view(-1, sub, H, N).any(1)
                row[f"union{sub}"] = float(u.sum(-1).float().mean())
                add(f"union{sub}_mass", u.repeat_interleave(sub, 0))
    tile = lambda x: x.view(-1, QT, *x.shape[1:])[:, 0]           # noqa: E731 (a tile's row)
    tcaus, tforced = tile(causal), tile(forced)

    def msum(cset, share, rows):
        """Tile-shared top-K by the summed per-row share ``share [T, HQ, N]`` of ``rows``."""
        s = share.view(-1, QT, H, G, N)[:, rows].sum((1, 3)).masked_fill(~tile(cset), -math.inf)
        return {kt: top_mask(s, tcaus, tforced, kt).repeat_interleave(QT, 0) for kt in (16, 20)}

    def shares(cset):
        x = bl.masked_fill(~cset.repeat_interleave(G, 1), -math.inf)
        return torch.exp(x - torch.logsumexp(x, -1, keepdim=True)).nan_to_num(0)

    every = {"": range(QT), "every2_": range(1, QT, 2), "every4_": range(3, QT, 4)}
    for name, rows in every.items():
        for kt, m in msum(cand, shares(cand), list(rows)).items():
            add(f"msum_{name}K{kt}", m)
    for u in (24, 32):
        cu = select(topk=u, beam=16)
        for kt, m in msum(cu, shares(cu), list(range(QT))).items():
            add(f"msum_top{u}_K{kt}", m)
    for nsub in (1, 2, 4):                                          # sub-tile mean queries
        qs = q.view(-1, QT // nsub, HQ, D).mean(1).view(-1, H, G, D) / math.sqrt(D)
        z = torch.einsum("rhgd,bchd->rhgbc", qs, kb).masked_fill(~real[..., 0, 0], -math.inf)
        x = torch.logsumexp(z, -1).masked_fill(~cand.view(-1, QT // nsub, H, N)[:, 0, :, None],
                                               -math.inf)
        s = torch.exp(x - torch.logsumexp(x, -1, keepdim=True)).nan_to_num(0)
        s = s.sum(2).view(-1, nsub, H, N).sum(1).masked_fill(~tile(cand), -math.inf)
        for kt in (16, 20):
            add(f"msub{nsub}_K{kt}", top_mask(s, tcaus, tforced, kt).repeat_interleave(QT, 0))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default: every layer")
    ap.add_argument("--model", default=None, help="as pisa eval's (default: SmolLM2)")
    ap.add_argument("--study", choices=("levers", "library", "decode"), default="levers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pisa.eval.corpus import corpus, token_samples
    from pisa.eval.model import capture_qk, load_model
    torch.manual_seed(0)
    model, tok = load_model(args.model, "cpu", torch.float32)
    ids = token_samples(tok, args.length, 1)[0]
    with torch.no_grad(), capture_qk(model, args.layers and set(args.layers)) as qk:
        model(ids, use_cache=False, logits_to_keep=1)
    rows = []
    for layer in sorted(qk):
        t0 = time.time()
        q, k = (x[0].float() for x in qk.pop(layer))
        got = layer_levers(q, k, args.study)
        print(layer, {a: round(v, 4) for a, v in got.items()}, f"{time.time() - t0:.0f}s",
              flush=True)
        rows += [{"layer": layer, "T": args.length, "arm": a, "value": v} for a, v in got.items()]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    summary = {a: {"mean": sum(v) / len(v), "min": min(v)} for a in arms
               for v in [[r["value"] for r in rows if r["arm"] == a]]}
    for a, s in summary.items():
        print(f"{a:18s} mean {s['mean']:.4f} min {s['min']:.4f}")
    if args.json:
        write_result(args.json, meta("cpu", " ".join(sys.argv), corpus=corpus()[0], K=K, C=C,
                                     query_tile=1 if args.study == "decode" else QT, model=args.model or "SmolLM2-135M-Instruct",
                                     summary=summary), rows)


if __name__ == "__main__":
    main()
