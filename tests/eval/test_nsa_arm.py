"""The trained suite's peer arm "nsa" (issue 26): fla's NSA in the suite's GPT.

Tests that call fla skip without it (``pip install 'pisa[nsa]'``; the ``test`` extra installs
fla-core, so CI runs them); the rest (shape checks, the arm spec, the lazy import) run anyway."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pisa.eval.gpt import GPT, GPTConfig, dense_within_budget
from pisa.eval.nsa_arm import (NSA_DEFAULTS, NSAAttention, check_nsa_shape, mean_pool,
                               sliding_window_attn)
from pisa.layers.attention import PisaAttention

from .test_quality_train import REPO, SCRIPT, _script, site  # noqa: F401  (site: a fixture)

HAS_FLA = importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="needs fla-core (pip install 'pisa[nsa]')")
# the smallest NSA shape: a GQA group of 16 query heads on one KV head of 16
SHAPE = dict(hidden_size=64, num_heads=16, num_kv_heads=1, head_dim=16)
GPT_SHAPE = dict(width=64, heads=16, kv_heads=1, head_dim=16, mlp_hidden=64)


def _naive_module():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.nsa import naive
    return naive


def _loop_mean_pooling(x, chunk_size, cu_seqlens=None):
    """fla's ``mean_pooling`` (a Triton kernel) by a loop: each block's mean, a partial last
    block over its own tokens."""
    assert cu_seqlens is None
    return torch.stack([x[:, s:s + chunk_size].float().mean(1)
                        for s in range(0, x.shape[1], chunk_size)], 1).to(x.dtype)


def _brute_window(q, k, v, causal=True, window_size=(-1, -1)):
    """``flash_attn_func(q, k, v, causal=True, window_size=(left, 0))``: query ``i`` attends keys
    ``i - left .. i`` (GQA: query head ``h`` reads KV head ``h // G``), on a full T x T mask."""
    assert causal and window_size[1] == 0
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & (j >= i - window_size[0])
    k, v = (x.repeat_interleave(G, dim=2).float() for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k) * q.shape[-1] ** -0.5
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", p, v).to(q.dtype)


# ------------------------------------------------------------------------------------------------
# The torch stand-ins of fla's GPU-only pieces
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,window", [(200, 16), (64, 16), (37, 64), (50, 1), (33, 7)])
def test_sliding_window_is_flash_attn_window_semantics(T, window):
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(2, T, 8, 16, generator=gen)
    k, v = (torch.randn(2, T, 2, 16, generator=gen) for _ in range(2))
    torch.testing.assert_close(sliding_window_attn(q, k, v, window),
                               _brute_window(q, k, v, True, (window - 1, 0)),
                               rtol=1e-5, atol=1e-5)
    full = _brute_window(q, k, v, True, (T, 0))  # causal, no window: differs once T > window
    assert (T <= window) == torch.allclose(sliding_window_attn(q, k, v, window), full,
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [64, 70, 15])
def test_mean_pool_averages_each_block_and_the_partial_last_over_its_tokens(T):
    x = torch.randn(2, T, 3, 4)
    got = mean_pool(x, 16)
    assert got.shape == (2, -(-T // 16), 3, 4)
    torch.testing.assert_close(got, _loop_mean_pooling(x, 16))
    torch.testing.assert_close(got[:, -1], x[:, (got.shape[1] - 1) * 16:].mean(1))


# ------------------------------------------------------------------------------------------------
# The arm against fla
# ------------------------------------------------------------------------------------------------

@needs_fla
def test_nsa_arm_forward_on_cpu_equals_fla_naive_nsa_called_directly(monkeypatch):
    """The arm's output equals fla's ``naive_nsa`` (its gates, compression, top-k selection and
    window) on the arm's own projected tensors, followed by ``o_proj``; ``naive_nsa``'s two
    GPU-only pieces (Triton ``mean_pooling``, ``flash_attn_func``) replaced by loop
    references. T = 200: 13 blocks of 16, 4 selected (sparse), a partial last block."""
    naive = _naive_module()
    torch.manual_seed(0)
    attn = NSAAttention(**SHAPE, block_size=16, block_counts=4, window_size=16)
    x = torch.randn(2, 200, 64)
    with torch.no_grad():
        got = attn(x)
        q, k, v = attn.qkv(x)
        g = torch.sigmoid(x @ attn.g_proj.weight.T).view(2, 200, 16, 3)  # per head: cmp slc swa
        monkeypatch.setattr(naive, "mean_pooling", _loop_mean_pooling)
        monkeypatch.setattr(naive, "flash_attn_func", _brute_window)
        o, idx = naive.naive_nsa(q, k, v, g[..., 0], g[..., 1], g[..., 2], block_counts=4,
                                 block_size=16, window_size=16, return_block_indices=True)
        want = attn.o_proj(o.reshape(2, 200, -1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert idx.shape == (2, 200, 1, 4) and (idx[:, 150:] >= 0).all()  # 4 of 10+ blocks taken
    # no window: the arm equals naive_nsa with window_size=0 (and differs from the windowed)
    attn.window_size = 0
    with torch.no_grad():
        no_window = attn(x)
        want0 = attn.o_proj(naive.naive_nsa(q, k, v, g[..., 0], g[..., 1], g[..., 2],
                                            block_counts=4, block_size=16,
                                            window_size=0).reshape(2, 200, -1))
    torch.testing.assert_close(no_window, want0, rtol=1e-5, atol=1e-5)
    assert (no_window - got).abs().max() > 1e-4


@needs_fla
def test_nsa_arm_projects_and_rotates_as_pisa_attention():
    torch.manual_seed(1)
    attn = NSAAttention(**SHAPE)
    pisa = PisaAttention(64, 16, 1, head_dim=16)
    missing = pisa.load_state_dict(attn.state_dict(), strict=False)
    assert missing.unexpected_keys == ["g_proj.weight"] and not missing.missing_keys
    assert attn.g_proj.weight.shape == (3 * 16, 64)  # fla's layer: Linear(width, 3 * HQ)
    x = torch.randn(1, 40, 64)
    for a, b in zip(attn.qkv(x), pisa.qkv(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    attn.attn = pisa.attn = "dense"  # the dense warm-up: SDPA on the same projections
    torch.testing.assert_close(attn(x), pisa(x))


@needs_fla
@pytest.mark.parametrize("branch", [0, 1, 2], ids=["g_cmp", "g_slc", "g_swa"])
def test_each_gate_changes_the_output(branch):
    torch.manual_seed(2)
    attn = NSAAttention(**SHAPE, block_size=16, block_counts=4, window_size=16)
    x = torch.randn(1, 120, 64)
    with torch.no_grad():
        before = attn(x)
        attn.g_proj.weight.view(16, 3, 64)[:, branch] += 0.5  # only this branch's gates
        after = attn(x)
    assert (after - before).abs().max() > 1e-4


@needs_fla
def test_a_gradient_reaches_every_parameter_of_the_nsa_gpt():
    torch.manual_seed(3)
    model = GPT(GPTConfig(depth=2, arm="nsa", topk=4, block_size=16, **GPT_SHAPE))
    ids = torch.randint(0, 264, (2, 100))  # 7 blocks of 16: the selection drops some
    torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1),
                                      ids[:, 1:].flatten()).backward()
    dead = [name for name, p in model.named_parameters()
            if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.selection_knobs() == {"query_tile": None, "beam_leaf": None}


@needs_fla
def test_the_nsa_gpt_switches_to_dense_and_back_and_takes_attn_kwargs():
    torch.manual_seed(4)
    cfg = dict(depth=1, topk=4, block_size=16, **GPT_SHAPE)
    nsa = GPT(GPTConfig(arm="nsa", **cfg)).eval()
    dense = GPT(GPTConfig(arm="dense", **cfg)).eval()
    dense.load_state_dict(nsa.state_dict(), strict=False)
    no_window = GPT(GPTConfig(arm="nsa", attn_kwargs={"window_size": 0}, **cfg)).eval()
    no_window.load_state_dict(nsa.state_dict())
    assert nsa.blocks[0].attn.window_size == NSA_DEFAULTS["window_size"]
    assert no_window.blocks[0].attn.window_size == 0
    ids = torch.randint(0, 264, (1, 96))
    with torch.no_grad():
        sparse = nsa(ids)
        assert (sparse - dense(ids)).abs().max() > 1e-3
        assert (sparse - no_window(ids)).abs().max() > 1e-4
        nsa.set_sparse(False)
        torch.testing.assert_close(nsa(ids), dense(ids))
        nsa.set_sparse(True)
        torch.testing.assert_close(nsa(ids), sparse)
    with pytest.raises(ValueError, match="pisa_attn arm"):
        nsa.set_context_parallel(None)


# ------------------------------------------------------------------------------------------------
# Shapes, knobs and the lazy import (no fla needed)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,match", [
    (dict(heads=4, kv_heads=2), "power of two >= 16, got 4 / 2 = 2"),  # the suite's default
    (dict(heads=24, kv_heads=1, head_dim=16), "power of two >= 16, got 24 / 1 = 24"),
    (dict(heads=16, kv_heads=1, head_dim=8), "head dim in \\[16, 256\\], got 8"),
    (dict(heads=16, kv_heads=1, head_dim=16, block_size=16, topk=16), "next_pow2"),
    (dict(heads=16, kv_heads=1, head_dim=16, block_size=48), "power of two >= 16, got 48"),
])
def test_shapes_fla_cannot_run_are_refused_before_fla_is_imported(shape, match):
    cfg = dict(width=256, depth=1, mlp_hidden=64, arm="nsa", topk=4, block_size=16) | shape
    with pytest.raises(ValueError, match=match):
        GPT(GPTConfig(**cfg))


def test_the_suite_budget_and_the_nsa_shape_pass_the_checks():
    check_nsa_shape(16, 1, 16, NSA_DEFAULTS["block_size"], NSA_DEFAULTS["block_counts"],
                    NSA_DEFAULTS["window_size"])
    check_nsa_shape(64, 4, 128, 64, 32)  # 2 * 32 <= 64
    with pytest.raises(ValueError, match="window_size"):
        check_nsa_shape(16, 1, 16, 64, 16, -1)
    assert not dense_within_budget("nsa") and dense_within_budget("pisa")
    assert dense_within_budget("dense")


def test_attn_kwargs_reach_pisa_attention_and_the_dense_arm_refuses_them():
    cfg = dict(width=32, depth=1, heads=2, kv_heads=1, mlp_hidden=64, topk=4, block_size=16)
    model = GPT(GPTConfig(arm="flat_lse", attn_kwargs={"topk": 3, "dense_below": 99}, **cfg))
    attn = model.blocks[0].attn
    assert attn.pisa_kwargs["topk"] == 3 and attn.pisa_kwargs["selector"] == "flat_lse"
    assert attn.dense_up_to == 99
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['windw'\\]"):
        GPT(GPTConfig(arm="pisa", attn_kwargs={"windw": 4}, **cfg))
    with pytest.raises(ValueError, match="the dense arm takes none"):
        GPTConfig(arm="dense", attn_kwargs={"topk": 2}, **cfg)
    with pytest.raises(TypeError, match="attn_kwargs must be a dict"):
        GPTConfig(arm="pisa", attn_kwargs=[("topk", 2)], **cfg)
    with pytest.raises(ValueError, match="arm must be one of .*'nsa'"):
        GPTConfig(arm="moba")


def test_without_fla_the_arm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.nsa.parallel", None)  # import fails
    with pytest.raises(ImportError, match="pip install 'pisa\\[nsa\\]'.*fla-core"):
        GPT(GPTConfig(depth=1, arm="nsa", topk=4, block_size=16, **GPT_SHAPE))


def test_pisa_runs_without_fla_imported():
    code = ("import sys, torch; from pisa.eval.gpt import GPT, GPTConfig; "
            "m = GPT(GPTConfig(width=32, depth=1, heads=2, kv_heads=1, mlp_hidden=64, "
            "arm='pisa', topk=3, block_size=16)); m(torch.randint(0, 264, (1, 64))); "
            "import pisa, pisa.eval.nsa_arm; "
            "print(sorted(n for n in sys.modules if n == 'fla' or n.startswith('fla.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------
# The suite (benchmarks/quality/quality_train.py)
# ------------------------------------------------------------------------------------------------

def test_arm_specs_parse_and_bad_specs_say_what_is_expected():
    qt = _script()
    assert qt._arm_spec("nsa:16") == ("nsa", 16)
    assert qt._arm_spec("pisa:8") == ("pisa", 8) and qt._arm_spec("dense") == ("dense", None)
    for bad in ("nsa", "nsa:", "nsa:x", "nsa:0", "nsa:-4", "moba:16", "dense:4", "NSA:16"):
        with pytest.raises(ValueError, match=r"arm spec must be 'dense' or "
                                             r"'<pisa\|.*\|nsa>:<K>' with K >= 1"):
            qt._arm_spec(bad)


def test_the_suite_refuses_nsa_in_the_default_shape_and_plans_it_in_the_nsa_shape():
    qt = _script()
    base = ["--arms", "dense", "pisa:16", "nsa:16", "--warmup-arms", "--sweep", "--seeds", "0",
            "--steps", "1000", "--device", "cpu"]
    with pytest.raises(ValueError, match="power of two >= 16, got 4 / 2 = 2.*--heads 16"):
        qt.plan(qt.parse_args(base))
    args = qt.parse_args(base + ["--heads", "16", "--kv-heads", "1", "--head-dim", "16"])
    assert args.head_dim == 16 and qt.parse_args(["--head-dim", "None"]).head_dim is None
    runs = {r["name"]: r for r in qt.plan(args)}
    assert set(runs) == {"dense_sparse_s0", "pisa16_sparse_s0", "nsa16_sparse_s0"}
    assert runs["nsa16_sparse_s0"]["dense_frac"] == 0.0  # never dense: costed sparse
    assert runs["pisa16_sparse_s0"]["dense_frac"] == 0.6
    assert not qt.resumes_stem(runs["nsa16_sparse_s0"])
    assert qt.resumes_stem(runs["pisa16_sparse_s0"]) and qt.resumes_stem(runs["dense_sparse_s0"])
    assert qt.stem_steps(args, list(runs.values())) == 600
    nsa8 = dict(runs["nsa16_sparse_s0"], K=8)  # a smaller nsa K does not shorten the stems
    assert qt.stem_steps(args, list(runs.values()) + [nsa8]) == 600
    assert qt.stem_steps(args, [runs["dense_sparse_s0"], runs["nsa16_sparse_s0"]]) == 0
    argv = qt._child_argv(args, runs["nsa16_sparse_s0"], Path("w"), Path("c"), (1.0, 2.0))
    assert argv[argv.index("--head-dim") + 1] == "16" and argv[argv.index("--arm") + 1] == "nsa"
    unset = qt.parse_args(base)
    argv = qt._child_argv(unset, runs["dense_sparse_s0"], Path("w"), Path("c"), (1.0, 2.0))
    assert qt.parse_args(argv[2:]).head_dim is None  # "None" round-trips


@needs_fla
def test_an_nsa_run_trains_and_evaluates_on_cpu(site, tmp_path):  # noqa: F811
    threads = torch.get_num_threads()
    try:
        rec = _script().main(["--run", "n", "--arm", "nsa", "--topk", "4", "--steps", "2",
                              "--site", str(site), "--out", str(tmp_path), "--train-T", "256",
                              "--test-T", "256", "--block-size", "16", "--width", "32",
                              "--depth", "1", "--heads", "16", "--kv-heads", "1", "--head-dim",
                              "16", "--mlp", "64", "--eval-examples", "1", "--lm-windows", "1",
                              "--lm-past", "128", "--log-every", "1", "--threads", "1",
                              "--device", "cpu", "--curriculum"])
    finally:
        torch.set_num_threads(threads)
    assert rec["status"] == "done" and rec["steps"] == 2 and len(rec["curve"]) == 2
    assert all(math.isfinite(p["loss"]) for p in rec["curve"])
    assert rec["beam_rows"] == [] and rec["rows"]
    for r in rec["rows"]:
        assert r["arm"] == "nsa" and r["K"] == 4 and math.isfinite(r["value"])
        assert (r["query_tile"], r["beam_leaf"]) == (None, None)
    assert json.loads((tmp_path / "n.json").read_text())["rows"] == rec["rows"]


@pytest.mark.slow  # ~1 min of subprocess launches (NSA through fla's naive loop on CPU)
@needs_fla
def test_launcher_trains_nsa_from_step_0_beside_the_stem_runs(site, tmp_path):  # noqa: F811
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "o"
    cmd = [sys.executable, str(SCRIPT), "--launch", "--out", str(out), "--work",
           str(tmp_path / "w"), "--arms", "dense", "pisa:16", "nsa:4", "--warmup-arms",
           "--seeds", "0", "--sweep", "--steps", "4", "--site", str(site), "--time-budget",
           "150", "--eval-reserve", "50", "--merge-reserve", "5", "--train-T", "512",
           "--test-T", "512", "--block-size", "16", "--width", "32", "--depth", "1", "--heads",
           "16", "--kv-heads", "1", "--head-dim", "16", "--mlp", "64", "--eval-examples", "1",
           "--lm-windows", "1", "--lm-past", "256", "--log-every", "1", "--threads", "1",
           "--device", "cpu", "--curriculum", "256:0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta = json.loads((out / "quality_trained.json").read_text())["meta"]
    runs = {r["name"]: r for r in meta["runs"]}
    assert {n: r["status"] for n, r in runs.items()} == dict.fromkeys(
        ["dense_sparse_s0", "pisa16_sparse_s0", "nsa4_sparse_s0"], "done")
    assert all(r["steps"] == 4 and r["train_seconds"] > 0 for r in runs.values())
    assert runs["pisa16_sparse_s0"]["stem"]["steps"] == 2
    assert runs["nsa4_sparse_s0"]["stem"] is None  # from step 0
    assert meta["config"]["head_dim"] == 16


# ------------------------------------------------------------------------------------------------
# GPU (fla's Triton kernels)
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_fla
def test_parallel_nsa_arm_matches_its_naive_path_on_gpu():
    """fla's kernels against its torch reference through the arm, in the suite's NSA shape.
    Sharpened scores (q, k weights x 8) keep top-k near-ties rare; the kernels' TF32 products
    may still flip one on a few tokens, so 99% of the tokens must agree."""
    torch.manual_seed(5)
    attn = NSAAttention(256, 16, 1, head_dim=16).cuda()
    x = torch.randn(2, 1000, 256, device="cuda")  # 16 blocks of 64 (a partial last)
    with torch.no_grad():
        attn.q_proj.weight.mul_(8)
        attn.k_proj.weight.mul_(8)
        fast = attn(x)
        attn.backend = "naive"
        slow = attn(x)
    assert torch.isfinite(fast).all()
    err = (fast - slow).abs().amax(-1)  # per token
    close = err <= 2e-3 + 2e-2 * slow.abs().amax(-1)
    assert close.float().mean() >= 0.99, err.max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_fla
def test_nsa_trains_on_gpu_at_the_suite_nsa_shape(tmp_path):
    """The suite's lengths in the NSA shape on the GPU (bf16, fla's kernels), a few steps: run
    this before spending the suite's minutes on the nsa arm."""
    rec = _script().main(["--run", "g", "--arm", "nsa", "--topk", "16", "--steps", "4",
                          "--log-every", "2", "--test-T", "4096", "16384", "--eval-examples",
                          "4", "--lm-windows", "2", "--device", "cuda", "--curriculum",
                          "256:0.5", "--heads", "16", "--kv-heads", "1", "--head-dim", "16",
                          "--out", str(tmp_path)])
    assert rec["status"] == "done" and rec["steps"] == 4
    assert [p["T"] for p in rec["curve"]] == [256, 4096]
    assert all(math.isfinite(p["loss"]) for p in rec["curve"])
    assert {r["test_T"] for r in rec["rows"]} == {4096, 16384}
    assert all(math.isfinite(r["value"]) for r in rec["rows"])
