"""Triton selection kernels (``pisa/ops/select_triton.py``) against the naive oracle.

Without CUDA the kernels run in the Triton interpreter on tiny fp32/fp16 shapes (the interpreter
mishandles bf16 dots); the GPU section at the end runs bf16 at larger shapes and is skipped without
CUDA. Every selection test hands the kernel output buffers poisoned with a sentinel, so an element
the kernel forgets to write shows up as a mismatch.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from pisa.ops.naive import naive_pyramid, naive_select  # noqa: E402
from pisa.ops.pyramid import build_pyramid_torch  # noqa: E402
from pisa.ops.select_triton import build_pyramid_triton, select_triton  # noqa: E402
from pisa.ops.utils import SelectConfig, cdiv, forced_leaves  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
POISON = 12345


@pytest.fixture(autouse=True, scope="module")
def _fast_interpreter():
    """Make triton 3.6's interpreter usable for these kernels, for this module only (restored after;
    a no-op on GPU or when the interpreter's internals differ).

    - numpy >= 2.4 refuses ``int()`` of a 1-element 1-d array, which is how the interpreter holds
      scalar kernel arguments, so ``range(0, n)`` over a runtime ``n`` fails: read the element.
    - Every call of a nested ``@triton.jit`` helper re-patches the whole language module (~3 ms a
      call, most of the run time here): patch ``triton.language`` and ``triton.language.core``
      once per launch instead.
    - Integer-overflow sanitising doubles the cost of every integer op; the shapes here are tiny.
    - ``tl.sort`` / ``tl.topk`` interpret their bitonic networks element by element in Python
      (~2 s a call): numpy sorts stand in (same results; the GPU section runs Triton's own).
    Also runs torch on one CPU thread: the oracle's tiny fp64 matmuls take ~15 ms each when two
    threads contend for two busy cores (~0.01 ms on one).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield from _interpreter_patched()
    torch.set_num_threads(threads)


def _interpreter_patched():
    if not INTERPRET:
        yield
        return
    try:
        import dataclasses

        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp

        saved = (interp._patch_lang, interp.InterpretedFunction.__call__,
                 interp.interpreter_builder.options, tl.sort, tl.topk)
        patch_tensor = interp._patch_lang_tensor

        def patch_tensor_index(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        def patch_lang_once(fn):
            scope = interp._LangPatchScope()
            for lang in (tl, tl.core):
                interp._patch_builtin(lang, interp.interpreter_builder, scope)
                interp._patch_builtin(lang.tensor, interp.interpreter_builder, scope)
                if lang is tl:
                    interp._patch_builtin(lang.math, interp.interpreter_builder, scope)
                patch_tensor_index(lang.tensor, scope)
                interp._patch_lang_core(lang, scope)
            interp._patch_builtin(tl.core.tensor_descriptor_base, interp.interpreter_builder, scope)
            return scope

        def as_tensor(x, data):
            data = np.ascontiguousarray(data)
            return tl.core.tensor(interp.TensorHandle(data, x.dtype),
                                  tl.block_type(x.dtype, list(data.shape)))

        def np_sort(x, dim=None, descending=False):
            data = np.sort(x.handle.data, axis=-1)
            return as_tensor(x, data[..., ::-1] if getattr(descending, "value", descending)
                             else data)

        def np_topk(x, k, dim=None):
            return as_tensor(x, np.sort(x.handle.data, axis=-1)[..., ::-1][
                ..., :int(getattr(k, "value", k))])

        def call_nested(self, *args, **kwargs):
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:  # the wrapping of the interpreter's own __call__
                raise interp.InterpreterError(repr(e)) from e

        interp._patch_lang = patch_lang_once
        interp.InterpretedFunction.__call__ = call_nested
        interp.interpreter_builder.options = dataclasses.replace(
            interp.interpreter_builder.options, sanitize_overflow=False)
        tl.sort, tl.topk = np_sort, np_topk
    except (ImportError, AttributeError, TypeError):
        yield
        return
    yield
    (interp._patch_lang, interp.InterpretedFunction.__call__, interp.interpreter_builder.options,
     tl.sort, tl.topk) = saved


def _inputs(B, Tk, Tq, HKV, G, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, HKV * G, D, generator=gen).to(dtype)
    k = torch.randn(B, Tk, HKV, D, generator=gen).to(dtype)
    return q, k


def _poisoned(B, Tq, HKV, slots, device):
    return (torch.full((B, Tq, HKV, slots), POISON, dtype=torch.int32, device=device),
            torch.full((B, Tq, HKV), POISON, dtype=torch.int32, device=device))


def _assert_same(got, want, what=""):
    (gi, gc), (wi, wc) = got, want
    gi, gc = gi.cpu(), gc.cpu()
    bad = ((gi != wi).any(-1) | (gc != wc)).nonzero().tolist()
    if bad:
        b, t, h = bad[0]
        pytest.fail(f"{what}: {len(bad)} (b, t, h) rows differ; first {(b, t, h)}: "
                    f"got {gi[b, t, h].tolist()} (count {int(gc[b, t, h])}), "
                    f"want {wi[b, t, h].tolist()} (count {int(wc[b, t, h])})")


def _check_valid(block_idx, counts, Tk, cfg: SelectConfig):
    """Structural invariants any selection must satisfy (for the approximate levers)."""
    B, Tq, HKV, _ = block_idx.shape
    for b in range(B):
        for t in range(Tq):
            t_abs = Tk - Tq + t
            forced = forced_leaves(t_abs, cfg.block_size)
            n_causal = t_abs // cfg.block_size + 1
            for h in range(HKV):
                row = block_idx[b, t, h].tolist()
                n = int(counts[b, t, h])
                chosen = row[:n]
                assert all(x == -1 for x in row[n:]), row
                assert chosen == sorted(set(chosen)), row
                assert set(forced) <= set(chosen), (row, forced)
                assert all(0 <= x < n_causal for x in chosen), row
                # A narrow beam may reach fewer free blocks than the budget.
                assert n <= min(n_causal, len(forced) + cfg.free_budget(len(forced))), (row, n)


# ------------------------------------------------------------------------------------------------
# Pyramid build
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 127, 300])
@pytest.mark.parametrize("C,g", [(4, 2), (8, 4), (4, 3), (16, 2)])
def test_pyramid_build_matches_torch(T, C, g):
    _, k = _inputs(2, T, 1, 3, 1, 16, seed=T)
    k = k.to(DEVICE)
    got = build_pyramid_triton(k, C, g)
    want = build_pyramid_torch(k, C, g)
    assert got.offsets == want.offsets
    assert torch.equal(got.counts, want.counts)
    torch.testing.assert_close(got.means, want.means, rtol=1e-5, atol=1e-6)
    for lvl, (means, counts) in enumerate(naive_pyramid(k.cpu(), C, g), start=1):
        got_means, got_counts = got.level(lvl)
        assert torch.equal(got_counts.cpu().long(), counts)
        torch.testing.assert_close(got_means.cpu().double(), means, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Selection == naive_select
# ------------------------------------------------------------------------------------------------

# (selector, scorer, branching, beam, forced_in_budget, G, Tk, Tq, C, D, topk, HKV, B, dtype)
PYRAMID_CASES = [
    ("lse", 2, 2, True, 4, 127, 16, 4, 16, 6, 1, 1, torch.float32),
    ("lse", 4, 4, False, 1, 300, 12, 8, 32, 5, 1, 1, torch.float32),
    ("lse", 3, 3, True, 1, 100, 12, 4, 16, 6, 1, 1, torch.float32),
    ("lse", 2, 1000, True, 4, 127, 10, 4, 16, 6, 1, 1, torch.float32),
    ("lse", 2, 4, True, 4, 200, 12, 8, 32, 8, 1, 1, torch.float16),
    ("lse", 2, 4, False, 4, 300, 16, 16, 16, 8, 1, 1, torch.float32),
    ("lse", 2, 2, True, 2, 90, 8, 4, 16, 6, 2, 2, torch.float32),
    ("lse", 2, 16, True, 4, 33, 33, 4, 16, 16, 1, 1, torch.float32),
    ("lse", 2, 3, True, 1, 1, 1, 4, 16, 4, 1, 1, torch.float32),
    ("mean", 2, 4, True, 4, 65, 65, 4, 16, 6, 1, 1, torch.float32),
    ("mean", 4, 2, False, 1, 140, 10, 4, 16, 5, 1, 1, torch.float32),
    ("meanvar", 2, 3, True, 1, 63, 20, 4, 16, 6, 2, 1, torch.float32),
    ("meanvar", 4, 2, False, 4, 140, 10, 4, 32, 5, 1, 1, torch.float32),
    ("meanvar", 2, 1000, False, 4, 90, 12, 4, 16, 6, 1, 1, torch.float32),
]


@pytest.mark.parametrize("case", PYRAMID_CASES, ids=lambda c: "-".join(map(str, c[:12])))
def test_pyramid_select_matches_naive(case):
    scorer, g, W, in_budget, G, Tk, Tq, C, D, K, HKV, B, dtype = case
    cfg = SelectConfig(block_size=C, topk=K, branching=g, beam=W, scorer=scorer,
                       selector="pyramid", forced_in_budget=in_budget, scale=D ** -0.5)
    q, k = _inputs(B, Tk, Tq, HKV, G, D, dtype, seed=Tk + W)
    want = naive_select(q, k, cfg)
    out = _poisoned(B, Tq, HKV, cfg.slots, DEVICE)
    got = select_triton(q.to(DEVICE), k.to(DEVICE), cfg, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    _assert_same(got, want, f"pyramid {case}")


# (selector, forced_in_budget, G, Tk, Tq, C, D, topk, HKV, dtype)
FLAT_CASES = [
    (sel, in_budget, G, T, T, C, D, K, 2, torch.float32)
    for sel in ("flat_lse", "flat_mean")
    for (in_budget, G, T, C, D, K) in [
        (True, 4, 1, 4, 16, 6), (True, 1, 63, 4, 16, 6), (False, 4, 65, 8, 32, 5),
        (True, 4, 127, 4, 16, 8), (False, 1, 300, 4, 16, 20), (True, 2, 300, 16, 32, 4),
    ]
] + [
    ("flat_lse", True, 4, 300, 37, 8, 32, 6, 1, torch.float16),
    ("flat_mean", False, 4, 300, 37, 8, 32, 6, 1, torch.float16),
]


@pytest.mark.parametrize("case", FLAT_CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_flat_select_matches_naive(case):
    selector, in_budget, G, Tk, Tq, C, D, K, HKV, dtype = case
    cfg = SelectConfig(block_size=C, topk=K, selector=selector, forced_in_budget=in_budget,
                       scale=D ** -0.5)
    q, k = _inputs(1, Tk, Tq, HKV, G, D, dtype, seed=Tk + K)
    want = naive_select(q, k, cfg)
    out = _poisoned(1, Tq, HKV, cfg.slots, DEVICE)
    got = select_triton(q.to(DEVICE), k.to(DEVICE), cfg, out=out)
    _assert_same(got, want, f"{selector} {case}")


@pytest.mark.parametrize("selector", ["flat_lse", "flat_mean"])
def test_flat_tile_and_warps_keep_the_result(selector):
    q, k = _inputs(1, 200, 37, 2, 2, 16, seed=9)
    q, k = q.to(DEVICE), k.to(DEVICE)
    cfg = SelectConfig(block_size=8, topk=5, selector=selector, scale=0.25)
    want = naive_select(q.cpu(), k.cpu(), cfg)
    for flat_tile, num_warps in [(1, 4), (4, 8), (32, 4)]:
        _assert_same(select_triton(q, k, cfg, flat_tile=flat_tile, num_warps=num_warps), want,
                     f"flat_tile={flat_tile}")


def test_given_pyramid_and_default_outputs():
    """A pyramid built once serves every selector; freshly allocated outputs are fully written."""
    C, g = 4, 2
    q, k = _inputs(1, 90, 9, 2, 2, 16, seed=5)
    q, k = q.to(DEVICE), k.to(DEVICE)
    pyramid = build_pyramid_triton(k, C, g)
    for selector in ("pyramid", "flat_mean"):
        cfg = SelectConfig(block_size=C, topk=6, branching=g, beam=3, selector=selector,
                           scale=0.25)
        _assert_same(select_triton(q, k, cfg, pyramid), naive_select(q.cpu(), k.cpu(), cfg),
                     selector)
    wrong = build_pyramid_triton(k, C, 4)
    with pytest.raises(ValueError, match="offsets"):
        select_triton(q, k, SelectConfig(block_size=C, topk=6, branching=g, scale=0.25), wrong)


@pytest.mark.parametrize("scorer", ["lse", "mean"])
def test_wide_beam_equals_flat(scorer):
    """A beam no level can overflow prunes nothing: the pyramid's leaf stage is the exact flat scan
    (flat_lse under the lse scorer). W = #level-2 nodes runs the walk kernel; W >= #blocks takes the
    flat kernel directly."""
    Tk, Tq, C, g = 110, 16, 4, 2
    q, k = _inputs(1, Tk, Tq, 2, 4, 16, seed=3)
    q, k = q.to(DEVICE), k.to(DEVICE)
    flat = select_triton(q, k, SelectConfig(block_size=C, topk=7, selector="flat_lse", scale=0.25))
    flat = flat[0].cpu(), flat[1].cpu()
    for W in (cdiv(cdiv(Tk, C), g), cdiv(Tk, C)):
        cfg = SelectConfig(block_size=C, topk=7, branching=g, beam=W, scorer=scorer,
                           selector="pyramid", scale=0.25)
        pyr = select_triton(q, k, cfg)
        if scorer == "lse":
            _assert_same(pyr, flat, f"beam={W} vs flat_lse")
        else:
            _assert_same(pyr, naive_select(q.cpu(), k.cpu(), cfg), f"beam={W}, mean scorer")
    if scorer == "lse":
        cfg = SelectConfig(block_size=C, topk=7, branching=g, beam=cdiv(cdiv(Tk, C), g),
                           selector="pyramid", scale=0.25)
        for walk_tile in (4, C):  # the shared walk prunes nothing either
            _assert_same(select_triton(q, k, cfg, walk_tile=walk_tile), flat,
                         f"walk_tile={walk_tile}")


def test_beam_too_wide_for_the_kernel():
    q, k = _inputs(1, 4 * 400, 1, 1, 1, 16)
    cfg = SelectConfig(block_size=4, topk=4, branching=2, beam=300, scale=0.25)
    with pytest.raises(ValueError, match="too wide"):
        select_triton(q.to(DEVICE), k.to(DEVICE), cfg)


# ------------------------------------------------------------------------------------------------
# Variants of the pyramid kernel: the same selections
# ------------------------------------------------------------------------------------------------

# A spread of PYRAMID_CASES (lse / meanvar, g = 2 / 3 / 4, forced in / out of budget, fp16, one
# token; mean is csc's leaf scorer through the fused kernel's helpers).
VARIANT_CASES = [PYRAMID_CASES[i] for i in (1, 2, 4, 8, 12)]


@pytest.mark.parametrize("variant", ["fused_fast", "csc"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: "-".join(map(str, c[:12])))
def test_variant_matches_naive(case, variant):
    scorer, g, W, in_budget, G, Tk, Tq, C, D, K, HKV, B, dtype = case
    cfg = SelectConfig(block_size=C, topk=K, branching=g, beam=W, scorer=scorer,
                       selector="pyramid", forced_in_budget=in_budget, scale=D ** -0.5)
    q, k = _inputs(B, Tk, Tq, HKV, G, D, dtype, seed=Tk + W)
    out = _poisoned(B, Tq, HKV, cfg.slots, DEVICE)
    got = select_triton(q.to(DEVICE), k.to(DEVICE), cfg, variant=variant, out=out)
    _assert_same(got, naive_select(q, k, cfg), f"{variant} {case}")


def test_variants_on_a_deep_pyramid():
    """Nine levels (Tk = 1024, C = 4): the fast walks skip the top levels (at most W causal nodes)
    and score the rest; csc with 2-query dots and 3-query chunks straddles chunk borders."""
    C, Tk, Tq, HKV = 4, 1024, 6, 1
    q, k = _inputs(1, Tk, Tq, HKV, 2, 16, seed=8)
    cfg = SelectConfig(block_size=C, topk=5, branching=2, beam=3, selector="pyramid", scale=0.3)
    want = naive_select(q, k, cfg)
    q, k = q.to(DEVICE), k.to(DEVICE)
    for variant, knobs in [("fused_fast", {}),
                           ("csc", {"leaf_pairs": 2, "leaf_chunk": 3, "num_stages": 1,
                                    "walk_maxnreg": 96})]:
        got = select_triton(q, k, cfg, variant=variant,
                            out=_poisoned(1, Tq, HKV, cfg.slots, DEVICE), **knobs)
        _assert_same(got, want, f"{variant} {knobs}")


def test_input_dtype_means_give_valid_selections():
    """walk_means="input" rounds the walk's means to 16 bits: an approximation, so only valid."""
    C, Tk, Tq = 8, 200, 6
    q, k = _inputs(1, Tk, Tq, 1, 2, 16, torch.float16, seed=4)
    cfg = SelectConfig(block_size=C, topk=6, branching=2, beam=3, selector="pyramid", scale=0.25)
    for variant in ("fused", "csc"):
        bi, cn = select_triton(q.to(DEVICE), k.to(DEVICE), cfg, variant=variant,
                               walk_means="input", out=_poisoned(1, Tq, 1, cfg.slots, DEVICE))
        _check_valid(bi.cpu(), cn.cpu(), Tk, cfg)


# ------------------------------------------------------------------------------------------------
# Levers (approximate by design): valid selections, exact where they must be
# ------------------------------------------------------------------------------------------------

def test_leaf_sub_blocks_of_one_key_is_exact():
    """Sub-blocks of a single key make the sub-block LSE the exact leaf LSE."""
    C = 4
    q, k = _inputs(1, 130, 14, 1, 4, 16, seed=11)
    cfg = SelectConfig(block_size=C, topk=6, branching=2, beam=2, selector="pyramid", scale=0.25)
    got = select_triton(q.to(DEVICE), k.to(DEVICE), cfg, leaf_sub_blocks=C)
    _assert_same(got, naive_select(q, k, cfg), "leaf_sub_blocks=C")


@pytest.mark.parametrize("walk_tile,leaf_sub_blocks", [(4, 0), (1, 2), (8, 4)])
def test_levers_give_valid_selections(walk_tile, leaf_sub_blocks):
    C, Tk, Tq = 8, 260, 24
    q, k = _inputs(1, Tk, Tq, 2, 2, 16, seed=7)
    cfg = SelectConfig(block_size=C, topk=6, branching=2, beam=3, selector="pyramid", scale=0.25)
    bi, cn = select_triton(q.to(DEVICE), k.to(DEVICE), cfg, walk_tile=walk_tile,
                           leaf_sub_blocks=leaf_sub_blocks,
                           out=_poisoned(1, Tq, 2, cfg.slots, DEVICE))
    _check_valid(bi.cpu(), cn.cpu(), Tk, cfg)


def test_fused_fast_levers_equal_fused():
    """The fast walk under the levers (shared tile walk, sub-block leaves) selects what the fused
    kernel's walk does."""
    C, Tk, Tq = 8, 260, 24
    q, k = _inputs(1, Tk, Tq, 2, 2, 16, seed=7)
    q, k = q.to(DEVICE), k.to(DEVICE)
    cfg = SelectConfig(block_size=C, topk=6, branching=2, beam=3, selector="pyramid", scale=0.25)
    want = select_triton(q, k, cfg, walk_tile=8, leaf_sub_blocks=4)
    got = select_triton(q, k, cfg, walk_tile=8, leaf_sub_blocks=4, variant="fused_fast",
                        out=_poisoned(1, Tq, 2, cfg.slots, DEVICE))
    _assert_same(got, (want[0].cpu(), want[1].cpu()), "fused_fast walk_tile=8 sub=4")


def test_rejects_bad_arguments():
    q, k = _inputs(1, 16, 4, 1, 1, 16)
    cfg = SelectConfig(block_size=4, topk=4, scale=0.25)
    with pytest.raises(ValueError, match="walk_tile"):
        select_triton(q, k, cfg, walk_tile=3)
    with pytest.raises(ValueError, match="walk_tile"):
        select_triton(q, k, cfg, walk_tile=8)
    with pytest.raises(ValueError, match="leaf_sub_blocks"):
        select_triton(q, k, cfg, leaf_sub_blocks=3)
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        select_triton(q.double(), k.double(), cfg)
    with pytest.raises(ValueError, match="variant"):
        select_triton(q, k, cfg, variant="flat")
    with pytest.raises(ValueError, match="walk_means"):
        select_triton(q, k, cfg, walk_means="bf16")
    with pytest.raises(ValueError, match="walk_means"):
        select_triton(q, k, cfg, variant="csc", walk_means="fp32")
    with pytest.raises(ValueError, match="walk_tile"):
        select_triton(q, k, cfg, variant="csc", walk_tile=2)
    with pytest.raises(ValueError, match="leaf_pairs"):
        select_triton(q, k, cfg, variant="csc", leaf_pairs=3)
    with pytest.raises(ValueError, match="leaf_chunk"):
        select_triton(q, k, cfg, variant="csc", leaf_chunk=-1)


# ------------------------------------------------------------------------------------------------
# GPU (bf16, larger shapes)
# ------------------------------------------------------------------------------------------------

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(INTERPRET, reason="needs CUDA")(test))


@gpu
@pytest.mark.parametrize("C,g", [(64, 2), (64, 4), (16, 2)])
def test_gpu_pyramid_build(C, g):
    _, k = _inputs(2, 5000, 1, 4, 1, 128, torch.bfloat16)
    k = k.cuda()
    got, want = build_pyramid_triton(k, C, g), build_pyramid_torch(k, C, g)
    assert got.offsets == want.offsets and torch.equal(got.counts, want.counts)
    torch.testing.assert_close(got.means, want.means, rtol=1e-5, atol=1e-5)


@gpu
@pytest.mark.parametrize("selector,scorer,g,in_budget,dtype", [
    ("pyramid", "lse", 2, True, torch.bfloat16), ("pyramid", "lse", 4, False, torch.bfloat16),
    ("pyramid", "mean", 2, True, torch.bfloat16), ("pyramid", "meanvar", 2, True, torch.bfloat16),
    ("pyramid", "lse", 3, True, torch.float32), ("pyramid", "lse", 2, True, torch.float16),
    ("flat_lse", "lse", 2, True, torch.bfloat16), ("flat_mean", "lse", 2, False, torch.bfloat16),
])
def test_gpu_select_matches_naive(selector, scorer, g, in_budget, dtype):
    C, Tk, Tq, HKV, G, D = 64, 2000, 48, 2, 8, 128
    q, k = _inputs(1, Tk, Tq, HKV, G, D, dtype, seed=1)
    cfg = SelectConfig(block_size=C, topk=8, branching=g, beam=8, scorer=scorer,
                       selector=selector, forced_in_budget=in_budget, scale=D ** -0.5)
    got = select_triton(q.cuda(), k.cuda(), cfg, out=_poisoned(1, Tq, HKV, cfg.slots, "cuda"))
    _assert_same(got, naive_select(q, k, cfg), f"gpu {selector} {scorer} g={g}")


@gpu
def test_gpu_levers_run():
    C, Tk, Tq = 64, 4096, 256
    q, k = _inputs(1, Tk, Tq, 2, 16, 128, torch.bfloat16, seed=2)
    cfg = SelectConfig(block_size=C, topk=16, branching=2, beam=16, selector="pyramid",
                       scale=128 ** -0.5)
    for walk_tile, sub in [(4, 0), (1, 4), (16, 4)]:
        bi, cn = select_triton(q.cuda(), k.cuda(), cfg, walk_tile=walk_tile, leaf_sub_blocks=sub)
        _check_valid(bi.cpu(), cn.cpu(), Tk, cfg)


@gpu
@pytest.mark.parametrize("variant", ["fused_fast", "csc"])
@pytest.mark.parametrize("scorer,g,in_budget,dtype", [
    ("lse", 2, True, torch.bfloat16), ("lse", 4, False, torch.bfloat16),
    ("meanvar", 2, True, torch.bfloat16), ("lse", 3, True, torch.float32),
    ("lse", 2, True, torch.float16),
])
def test_gpu_variant_matches_naive(variant, scorer, g, in_budget, dtype):
    C, Tk, Tq, HKV, G, D = 64, 2000, 48, 2, 8, 128
    q, k = _inputs(1, Tk, Tq, HKV, G, D, dtype, seed=1)
    cfg = SelectConfig(block_size=C, topk=8, branching=g, beam=8, scorer=scorer,
                       selector="pyramid", forced_in_budget=in_budget, scale=D ** -0.5)
    got = select_triton(q.cuda(), k.cuda(), cfg, variant=variant,
                        out=_poisoned(1, Tq, HKV, cfg.slots, "cuda"))
    _assert_same(got, naive_select(q, k, cfg), f"gpu {variant} {scorer} g={g} {dtype}")


@gpu
@pytest.mark.parametrize("variant,knobs", [
    ("fused_fast", {}), ("csc", {}), ("csc", {"leaf_chunk": 0, "leaf_pairs": 4}),
    ("csc", {"walk_maxnreg": 96, "leaf_warps": 8, "leaf_stages": 3}),
])
def test_gpu_variant_equals_fused_at_16k(variant, knobs):
    """Default config A shapes: the same selections as the fused kernel (both compute exact fp32
    scores, summed in other orders: only near-ties at rounding level may differ)."""
    T, HQ, HKV, D = 16384, 64, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, T, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, T, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    cfg = SelectConfig(block_size=64, topk=16, branching=2, beam=16, scale=D ** -0.5)
    want = select_triton(q, k, cfg)
    got = select_triton(q, k, cfg, variant=variant, out=_poisoned(1, T, HKV, cfg.slots, "cuda"),
                        **knobs)
    differ = ((got[0] != want[0]).any(-1) | (got[1] != want[1])).float().mean().item()
    assert differ < 1e-3, f"{variant} {knobs}: {differ:.2e} of the (token, head) rows differ"
