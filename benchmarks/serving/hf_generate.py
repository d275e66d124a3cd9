"""HF generate where the model sets the pace: prefill and per-token time of a random-weight Llama
with dense (sdpa) attention, PISA over transformers' ``DynamicCache`` and PISA over
``pisa.integrations.hf.PisaHFCache``, after prompts of ``--lengths`` tokens (issue 27, item 1).

The model (default: 8 layers, width 2048, 32 query / 4 KV heads of 64, MLP 4096, vocab 32000,
bf16 on CUDA, fp32 on CPU) is ``pisa.eval.model.random_model``'s, without an end-of-sequence
token, so every run generates exactly ``--new-tokens`` tokens greedily. Arms (``--arms``):

- ``sdpa``: ``generate`` with dense attention over the default ``DynamicCache``.
- ``pisa_dynamic``: ``generate`` with ``attn_implementation="pisa"`` over the ``DynamicCache``
  (``pisa_attn`` re-selects over the whole cache every step).
- ``pisa_cache``: ``generate`` over a ``PisaHFCache`` (``pisa_attn_with_kvcache``: the O(log N)
  decode step on the cache's pyramid).
- ``pisa_static``: ``generate`` over a ``PisaHFCache(static=True)``, whose decode steps
  ``generate`` compiles on CUDA (``torch.compile(mode="reduce-overhead")``: CUDA graphs); the
  warm-up run compiles, a new length may recompile its first step (the median ignores it).
- ``pisa_cache_loop``: the same cache and model without ``generate``:
  ``pisa.integrations.hf.PisaGraphDecoder``'s greedy loop (one prefill forward, then steps of one
  token with static input, position and history buffers; no attention mask, no logits
  processors), eager.
- ``pisa_cache_graph`` (CUDA): that step captured in one CUDA graph after ``--graph-warmup``
  eager steps (real steps of the sequence: a capture runs nothing), then replayed: the floor
  of a captured step, beside ``pisa_static``'s.

Timing (explicit): the device is synchronised and ``time.perf_counter`` read before the call and
after every new token (in ``generate`` by a ``StoppingCriteria`` that synchronises and stamps, in
the loops after each step). ``hf_prefill`` rows: from the call to the first token (prefill plus
the first token's sampling; ``generate``'s setup included). ``hf_decode`` rows: ``ms`` the median
of the intervals between consecutive tokens (``ms_min`` / ``ms_max`` their spread, ``mean_ms``
their mean, ``steps`` their count). Generate synchronises once a step itself (its stopping
check), so the stamps add no sync there. Every arm first runs once at ``--warmup-len`` (kernels
compiled; new lengths compile nothing). ``attn_calls`` counts the integration's calls of
``pisa_attn`` and ``pisa_attn_with_kvcache`` (prefill: more than one query; decode: one) in the
timed run: which path a step took (calls inside a compiled graph are not counted).
``tokens_equal`` / ``agree_prefix`` compare an arm's tokens with the first PISA arm's
(``pisa_cache`` by default), ``first_logits_maxdiff`` the first token's logits (``generate``'s
arms) (random weights give near-tied logits, so different kernels in bf16 may part after a few
tokens; the ``PisaHFCache`` arms run the same kernels and must agree exactly).

``--profile``: ``torch.profiler`` (CPU and CUDA) over 3 decode steps of the ``pisa_cache`` arm
inside ``generate``, and over 3 steps of the eager loop, at the longest length: the
``key_averages`` tables (top 40 by self CPU time; top 20 by self device time) go to
``<json stem>_profile.txt`` next to ``--json``, Chrome traces to ``<json stem>_trace_*.json.gz``,
and per-step counts of host syncs (``aten::_local_scalar_dense``: ``.item()``, ``bool(t)``,
``.tolist()``; ``cudaStreamSynchronize``, ``cudaMemcpy*``) and launches into the JSON's
``profile`` rows. The clock's own ``torch.cuda.synchronize`` is one ``cudaDeviceSynchronize`` a
step.

``--budget-s`` stops starting new (length, arm) runs after that many seconds (the rows done are
saved as they finish). CPU smoke run: ``--device cpu --lengths 512 --layers 2 --hidden 256``.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Results, default_device, peak_gb, reset_peak, result_row  # noqa: E402

import torch  # noqa: E402

import pisa.integrations.hf as pisa_hf  # noqa: E402
from pisa.eval.model import random_model  # noqa: E402

# the graph arm last: a capture that fails (an op that syncs) ends only its own rows
ARMS = ("pisa_cache", "pisa_static", "pisa_cache_loop", "pisa_dynamic", "sdpa",
        "pisa_cache_graph")
PROFILE_STEPS = 3


class Calls:
    """Counts the integration's attention calls by kind (wrapping the functions the attention
    forward looks up in ``pisa.integrations.hf``): ``{"pisa_attn" | "with_kvcache": {"prefill",
    "decode"}}``."""

    def __init__(self):
        self.counts: dict = {}
        for name, key in (("pisa_attn", "pisa_attn"), ("pisa_attn_with_kvcache", "with_kvcache")):
            setattr(pisa_hf, name, self._wrap(getattr(pisa_hf, name), key))

    def _wrap(self, fn, key):
        def counted(q, *args, **kwargs):
            # not while compiling (pisa_static): dynamo would guard on the count's value and
            # recompile every step until its limit, then run eager; compiled steps go uncounted
            if not torch.compiler.is_compiling():
                phase = "decode" if q.shape[1] == 1 else "prefill"
                self.counts.setdefault(key, {}).setdefault(phase, 0)
                self.counts[key][phase] += 1
            return fn(q, *args, **kwargs)
        return counted

    def take(self) -> dict:
        counts, self.counts = self.counts, {}
        return counts


class Clock:
    """A ``StoppingCriteria`` (never stops) that synchronises the device and stamps the time
    after every new token; ``hook(n)`` runs after the n-th stamp (the profiler's start / stop)."""

    def __init__(self, device: str, hook=None):
        self.cuda = device.startswith("cuda")
        self.stamps: list[float] = []
        self.hook = hook
        self._false = None

    def sync(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(self.sync())
        if self.hook is not None:
            self.hook(len(self.stamps))
        if self._false is None or self._false.shape[0] != input_ids.shape[0]:
            self._false = torch.zeros(input_ids.shape[0], dtype=torch.bool,
                                      device=input_ids.device)
        return self._false


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape, seed and PISA knobs on the command line (``build_model`` reads them)."""
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--topk", type=int, default=None, help="config.pisa_topk (default: pisa's)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--branching", type=int, default=None,
                   help="config.pisa_branching: the prompt's pyramid and the cache's (decode "
                        "walks half the levels at 4)")
    p.add_argument("--scorer", default=None)
    p.add_argument("--seed", type=int, default=0)


def build_model(args, device: str, dtype: torch.dtype):
    """The random-weight Llama of the run on ``device`` in ``dtype``, dense (sdpa) attention,
    PISA knobs from the command line on its config."""
    knobs = {k: v for k, v in (("topk", args.topk), ("block_size", args.block_size),
                               ("branching", args.branching), ("scorer", args.scorer))
             if v is not None}
    model = random_model("llama", vocab_size=args.vocab, num_layers=args.layers,
                         hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim, seed=args.seed,
                         eos_token_id=None, **knobs)
    model.config.max_position_embeddings = max(args.lengths) + 4 * args.new_tokens + 64
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def update_gets_kwargs() -> bool | None:
    """Whether this transformers' Llama attention hands its kwargs to ``cache.update`` (5.24
    does, 5.17 does not: then ``PisaHFCache`` finds its cache on the keys instead)."""
    from transformers.models.llama import modeling_llama
    try:
        return "kwargs=kwargs" in inspect.getsource(modeling_llama.LlamaAttention.forward)
    except (OSError, TypeError):  # no source shipped
        return None


def prompt_ids(T: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + T)
    return torch.randint(2, vocab, (1, T), generator=gen).to(device)


def run_generate(model, ids, arm: str, n_new: int, device: str, hook=None) -> dict:
    """One greedy ``generate`` of ``n_new`` tokens: stamps, tokens [B, n_new], logits of the
    first token."""
    kw = {}
    if arm in ("pisa_cache", "pisa_static"):
        kw[pisa_hf.cache_keyword(model)] = pisa_hf.PisaHFCache(model.config, ids.shape[1] + n_new,
                                                       static=arm == "pisa_static")
    from transformers import StoppingCriteriaList
    clock = Clock(device, hook)
    t0 = clock.sync()
    # no end-of-sequence token (build_model): exactly n_new tokens
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                         do_sample=False,
                         stopping_criteria=StoppingCriteriaList([clock]),
                         return_dict_in_generate=True, output_logits=True, **kw)
    return {"t0": t0, "stamps": clock.stamps, "tokens": out.sequences[:, ids.shape[1]:],
            "first_logits": out.logits[0].float()}


def run_loop(model, ids, n_new: int, device: str, graph: bool, warmup: int,
             profile_hook=None) -> dict:
    """``n_new`` tokens by ``PisaGraphDecoder`` (eager, or with the step in a CUDA graph after
    ``warmup >= 1`` eager steps): stamps after the prefill's token and after every step, tokens;
    ``profile_hook(i)`` after token ``i``."""
    decoder = pisa_hf.PisaGraphDecoder(model, ids.shape[1] + n_new + 2, cuda_graph=graph,
                                       warmup=warmup)
    clock = Clock(device)

    def on_token(i):
        clock.stamps.append(clock.sync())
        if profile_hook is not None:
            profile_hook(i)
    t0 = clock.sync()
    tokens = decoder.generate(ids, n_new, on_token)
    out = {"t0": t0, "stamps": clock.stamps, "tokens": tokens}
    if decoder.graph is not None:  # token warmup + 1 was the capture's: replays from there on
        out["replay_stamps"] = clock.stamps[warmup + 1:]
        out["stamps"] = clock.stamps[:1]
    return out


def set_arm(model, arm: str) -> None:
    model.set_attn_implementation("sdpa" if arm == "sdpa" else pisa_hf.NAME)


def run_arm(model, ids, arm: str, args, device: str):
    if arm in ("pisa_cache_loop", "pisa_cache_graph"):
        return run_loop(model, ids, args.new_tokens, device, arm == "pisa_cache_graph",
                        args.graph_warmup)
    return run_generate(model, ids, arm, args.new_tokens, device)


def intervals(run: dict) -> list[float]:
    s = run.get("replay_stamps") or run["stamps"]
    return [(b - a) * 1e3 for a, b in zip(s, s[1:])]


def agreement(run: dict, ref: dict | None) -> dict:
    if ref is None:
        return {}
    a, b = run["tokens"], ref["tokens"]
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).all(0).tolist()
    prefix = same.index(False) if False in same else n
    out = {"tokens_equal": prefix == n, "agree_prefix": prefix}
    if "first_logits" in run and "first_logits" in ref:  # generate's arms
        out["first_logits_maxdiff"] = float((run["first_logits"] - ref["first_logits"])
                                            .abs().max())
    return out


def shape_cols(model, arm: str, dtype: str) -> dict:
    cfg = model.config
    cols = dict(B=1, HQ=cfg.num_attention_heads, HKV=cfg.num_key_value_heads, D=cfg.head_dim,
                dtype=dtype, K=None, C=None, g=None, W=None)
    if arm != "sdpa":
        knobs = pisa_hf.pisa_knobs(cfg)
        cols.update(K=knobs["topk"], C=knobs["block_size"], g=knobs["branching"],
                    W=knobs["beam"] or knobs["topk"])
    return cols


def failure(e: Exception) -> str:
    """An exception for a result row (and stderr): its type, message and the innermost frames,
    which name the op when a CUDA-graph capture meets a host sync."""
    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    return f"{type(e).__name__}: {str(e)[:300]} | {text[-1200:]}"


def note_row(op: str, arm: str, T: int, model, dtype: str, **extra) -> dict:
    """A row of the schema without a time: a skipped or failed run, or a profile's counts."""
    backend = "sdpa" if arm == "sdpa" else "pisa"
    return result_row(op, arm, backend, T=T, **shape_cols(model, arm, dtype), ms=None, **extra)


def profile_counts(prof, steps: int) -> dict:
    """Per-step counts of host syncs and launches from a profile of ``steps`` steps."""
    names = {"aten::_local_scalar_dense": "local_scalar_dense", "aten::item": "item",
             "aten::nonzero": "nonzero", "cudaStreamSynchronize": "stream_sync",
             "cudaDeviceSynchronize": "device_sync", "cudaMemcpyAsync": "memcpy_async",
             "cudaMemcpy": "memcpy", "cudaLaunchKernel": "launch_kernel",
             "cuLaunchKernel": "cu_launch_kernel", "cuLaunchKernelEx": "cu_launch_kernel_ex",
             "cudaMalloc": "malloc", "aten::empty": "empty"}
    out = {v: 0.0 for v in names.values()}
    for e in prof.key_averages():
        if e.key in names:
            out[names[e.key]] = e.count / steps
    return out


def profile_tables(prof, title: str) -> str:
    """The two tables of a profile: top 40 by self CPU time, top 20 by self device time (all
    zero on the CPU)."""
    averages = prof.key_averages()
    return "\n".join([f"== {title}: top 40 by self CPU time ==",
                      averages.table(sort_by="self_cpu_time_total", row_limit=40),
                      f"== {title}: top 20 by self device time ==",
                      averages.table(sort_by="self_device_time_total", row_limit=20)])


def run_profile(model, ids, device: str, out_stem: Path | None) -> list[tuple]:
    """``torch.profiler`` over ``PROFILE_STEPS`` decode steps of ``generate`` over a
    ``PisaHFCache`` and of the eager loop; returns ``(title, counts)`` pairs and writes the
    tables (and traces) next to the JSON."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    texts, results = [], []
    for title, name in (("generate over PisaHFCache", "generate"),
                        ("eager loop over PisaHFCache", "loop")):
        prof = profile(activities=acts)
        # generate: start after the prefill's token, stop after PROFILE_STEPS more; loop: the
        # hook runs before step i and after the last
        if name == "generate":
            def hook(n, prof=prof):
                if n == 1:
                    prof.start()
                elif n == 1 + PROFILE_STEPS:
                    prof.stop()
            run_generate(model, ids, "pisa_cache", PROFILE_STEPS + 1, device, hook)
        else:
            def hook(i, prof=prof):  # after token i: the prefill's, then each step's
                if i == 0:
                    prof.start()
                elif i == PROFILE_STEPS:
                    prof.stop()
            run_loop(model, ids, PROFILE_STEPS + 1, device, False, 1, hook)
        texts.append(profile_tables(prof, f"{title}, {PROFILE_STEPS} decode steps, "
                                          f"T={ids.shape[1]}"))
        results.append((name, profile_counts(prof, PROFILE_STEPS)))
        if out_stem is not None:
            prof.export_chrome_trace(f"{out_stem}_trace_{name}.json.gz")
    text = "\n\n".join(texts)
    if out_stem is not None:
        Path(f"{out_stem}_profile.txt").write_text(text + "\n")
    else:
        print(text)
    return results


def summary(rows: list[dict]) -> str:
    """The run as a markdown table: per length and arm, prefill and per-token ms, the attention
    path, the agreement with the reference arm; failures and skips below it."""
    out = ["| T | arm | prefill ms | per token ms (min-max) | decode path | tokens = ref |",
           "|---|---|---|---|---|---|"]
    prefill = {(r["T"], r["impl"]): r["ms"] for r in rows if r["op"] == "hf_prefill"}
    for r in rows:
        if r["op"] != "hf_decode":
            continue
        path = ", ".join(f"{k} x{v.get('decode', 0)}" for k, v in r["attn_calls"].items())
        agree = "" if "agree_prefix" not in r else \
            f"{r['tokens_equal']} ({r['agree_prefix']})"
        out.append(f"| {r['T']} | {r['impl']} | {prefill[r['T'], r['impl']]:.1f} | "
                   f"{r['ms']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f}) | {path or '-'} | "
                   f"{agree} |")
    out += [f"{r['op']}: {r['impl']} T={r['T']} {r.get('error') or r.get('reason') or ''}"
            for r in rows if r["op"] in ("failed", "skipped")]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="default: cuda when present")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    add_model_args(p)
    p.add_argument("--warmup-len", type=int, default=4096,
                   help="prompt of every arm's untimed first run (capped at the shortest length; "
                        "0: none)")
    p.add_argument("--graph-warmup", type=int, default=2,
                   help="eager steps before the CUDA-graph capture")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no new (length, arm) run after this many seconds")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.new_tokens < 2 + args.graph_warmup:
        p.error(f"--new-tokens must be at least 2 + --graph-warmup = {2 + args.graph_warmup}")
    start = time.perf_counter()
    device = args.device or default_device()
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu)")
    dtype_name = args.dtype or ("bfloat16" if cuda else "float32")
    dtype = getattr(torch, dtype_name)
    arms = [a for a in args.arms if cuda or a != "pisa_cache_graph"]
    import transformers
    res = Results(args.json, device, transformers=transformers.__version__,
                  update_gets_attention_kwargs=update_gets_kwargs(),
                  model=dict(layers=args.layers, hidden=args.hidden, heads=args.heads,
                             kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab,
                             intermediate=2 * args.hidden),
                  new_tokens=args.new_tokens, arms=list(arms),
                  timing="perf_counter after a device sync, after every new token")
    model = build_model(args, device, dtype)
    calls = Calls()
    print(f"[hf_generate] model built in {time.perf_counter() - start:.1f} s; transformers "
          f"{transformers.__version__}, update gets the attention kwargs: "
          f"{res.meta['update_gets_attention_kwargs']}", file=sys.stderr, flush=True)

    warm = prompt_ids(min(args.warmup_len, min(args.lengths)), args.vocab, args.seed, device)
    with torch.no_grad():
        for arm in list(arms) if args.warmup_len > 0 else ():
            set_arm(model, arm)
            t = time.perf_counter()
            try:
                run_arm(model, warm, arm, args, device)
            except Exception as e:  # the arm is dropped, the others run
                res.add(note_row("failed", arm, warm.shape[1], model, dtype_name,
                                 error=failure(e), phase="warm-up"))
                arms.remove(arm)
                continue
            print(f"[hf_generate] warm-up {arm}: {time.perf_counter() - t:.1f} s",
                  file=sys.stderr, flush=True)
        calls.take()
        profiled = False
        for T in sorted(args.lengths):
            ids = prompt_ids(T, args.vocab, args.seed, device)
            ref = None
            for arm in arms:
                if time.perf_counter() - start > args.budget_s:
                    print(f"[hf_generate] budget spent: {arm} at T={T} not run",
                          file=sys.stderr, flush=True)
                    res.add(note_row("skipped", arm, T, model, dtype_name, reason="budget"))
                    continue
                set_arm(model, arm)
                if cuda:
                    torch.cuda.empty_cache()
                reset_peak(device)
                try:
                    run = run_arm(model, ids, arm, args, device)
                except Exception as e:  # one arm's failure (a capture, memory) ends only it
                    res.add(note_row("failed", arm, T, model, dtype_name, error=failure(e)))
                    res.save()
                    continue
                counts = calls.take()
                if ref is None and arm != "sdpa":
                    ref = run
                cols = shape_cols(model, arm, dtype_name)
                backend = "sdpa" if arm == "sdpa" else ("triton" if cuda else "torch")
                common = dict(cache="dynamic" if arm in ("sdpa", "pisa_dynamic") else "pisa",
                              path={"pisa_cache_loop": "loop", "pisa_cache_graph": "graph"}
                              .get(arm, "generate"), attn_calls=counts)
                gap = intervals(run)
                res.add(result_row("hf_prefill", arm, backend, T=T, **cols,
                                   ms=(run["stamps"][0] - run["t0"]) * 1e3,
                                   peak_gb=peak_gb(device), **common))
                res.add(result_row("hf_decode", arm, backend, T=T, **cols,
                                   ms=statistics.median(gap), ms_min=min(gap), ms_max=max(gap),
                                   mean_ms=statistics.fmean(gap), steps=len(gap),
                                   **common, **agreement(run, ref)))
                res.save()
                if args.profile and not profiled and arm == "pisa_cache" \
                        and T == max(args.lengths):
                    stem = Path(args.json).with_suffix("") if args.json else None
                    profiled = True
                    try:
                        for name, per_step in run_profile(model, ids, device, stem):
                            res.add(note_row("profile", f"pisa_cache_{name}", T, model,
                                             dtype_name, steps=PROFILE_STEPS,
                                             per_step=per_step))
                    except Exception as e:
                        res.add(note_row("failed", "pisa_cache", T, model, dtype_name,
                                         error=failure(e), phase="profile"))
                    calls.take()
                    res.save()
    res.meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    res.save()
    print(summary(res.rows), flush=True)
    print(f"[hf_generate] done in {res.meta['elapsed_s']} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
