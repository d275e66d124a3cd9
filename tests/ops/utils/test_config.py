"""``pisa.ops.utils.config``: defaults, the one block-size table, and resolution of the knobs."""
import math
import re

import pytest
import torch

from pisa.ops.utils.config import (AUTO_CROSSOVER_T, BLOCK_SIZES, DECODE_DEFAULTS, KNOBS,
                                   MAX_FORCED, SelectConfig, check_block_idx,
                                   check_block_idx_values, check_geometry, grown_beams,
                                   pruned_levels, resolve_backend, resolve_config)


def _qk(T=64, D=16):
    return torch.randn(1, T, 4, D), torch.randn(1, T, 2, D)


def test_slots_and_free_budget():
    inside = SelectConfig(topk=6)
    assert inside.slots == 6 and [inside.free_budget(f) for f in (1, 2, 3)] == [5, 4, 3]
    on_top = SelectConfig(topk=6, forced_in_budget=False)
    assert on_top.slots == 6 + MAX_FORCED and on_top.free_budget(3) == 6
    assert SelectConfig(**inside.op_kwargs()) == inside


def test_one_set_of_defaults():
    """Every entry point's knob defaults are ``SelectConfig``'s (``scale`` None: the head dim's;
    ``beam_ref_len`` None), decode's with ``DECODE_DEFAULTS`` on top; ``check_knobs`` and
    ``resolve_config`` default to the same."""
    import inspect

    import pisa
    from pisa.distributed import pisa_attn_cp, pisa_select_cp
    from pisa.ops.utils.config import check_knobs
    want = {**SelectConfig().op_kwargs(), "beam": None, "query_tile": None, "scale": None,
            "beam_ref_len": None}
    for fn in (pisa.pisa_select, pisa.pisa_attn, pisa.pisa_select_varlen, pisa.pisa_attn_varlen,
               pisa_select_cp, pisa_attn_cp, check_knobs):
        params = inspect.signature(fn).parameters
        assert {n: params[n].default for n in KNOBS} == want, fn.__name__
    params = inspect.signature(pisa.pisa_attn_with_kvcache).parameters
    decode = {n: params[n].default for n in KNOBS if n not in ("block_size", "branching")}
    assert decode == {n: v for n, v in {**want, **DECODE_DEFAULTS}.items()
                      if n not in ("block_size", "branching")}
    q, k = _qk(D=64)
    assert resolve_config(q, k, "torch") == SelectConfig()


def test_resolve_fills_defaults():
    q, k = _qk(D=16)
    cfg = resolve_config(q, k, "torch", topk=5)
    assert cfg == SelectConfig(block_size=64, topk=5, branching=2, beam=5, scale=0.25)
    assert resolve_config(q, k, "torch", beam=3, scale=0.5).beam == 3
    assert resolve_config(q, k, "torch", selector="auto").selector == "flat_lse"
    k_long = torch.empty(1, AUTO_CROSSOVER_T, 2, 16, device="meta")
    assert resolve_config(q, k_long, "torch", selector="auto").selector == "pyramid"


@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
def test_one_block_size_table_per_backend(backend):
    """Every power of two inside the backend's range passes, its neighbours outside fail."""
    q, k = _qk()
    lo, hi = BLOCK_SIZES[backend]
    C = lo
    while C <= hi:
        assert resolve_config(q, k, backend, block_size=C).block_size == C
        check_geometry(C, 2, backend)
        C *= 2
    for bad in (lo // 2, hi * 2, lo + 1 if lo > 2 else 3, 48):
        with pytest.raises(ValueError, match=f"block_size must be a power of two in "
                                             rf"\[{lo}, {hi}\] for backend '{backend}'"):
            resolve_config(q, k, backend, block_size=bad)
    for bad in (True, 16.0, "64"):
        with pytest.raises(TypeError, match="block_size must be an int"):
            resolve_config(q, k, backend, block_size=bad)


def test_triton_bounds_are_those_of_every_triton_op():
    """On Triton, 8 fails in selection as it does in attention and decode; 256 fails too."""
    assert BLOCK_SIZES["triton"] == (16, 128) and BLOCK_SIZES["torch"] == (4, 256)
    for C in (8, 256):
        with pytest.raises(ValueError, match="block_size"):
            check_geometry(C, 2, "triton")
        check_geometry(C, 2, "torch")
    check_geometry(4, 2)  # default: the widest (torch) range


@pytest.mark.parametrize("knobs,msg", [
    (dict(branching=1), "branching"), (dict(scorer="max"), "scorer"),
    (dict(selector="random"), "selector"), (dict(topk=2), "topk must be an int >= 3"),
    (dict(topk=0, forced_in_budget=False), ">= 1"), (dict(beam=0), "beam")])
def test_resolve_rejects_bad_knobs(knobs, msg):
    q, k = _qk()
    with pytest.raises(ValueError, match=msg):
        resolve_config(q, k, "torch", **knobs)


def test_resolve_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton on CPU tensors: the interpreter
    q = torch.randn(1, 4, 2, 8)
    assert resolve_backend("auto", q) == "torch"  # a CPU tensor
    assert [resolve_backend(b, q) for b in ("torch", "triton", "naive")] == \
        ["torch", "triton", "naive"]
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", q)


def test_check_block_idx():
    q, k = _qk(T=16)
    sink_only = torch.tensor([0, -1, -1], dtype=torch.int32).expand(1, 16, 2, 3)
    check_block_idx(sink_only, q, k, 8)
    with pytest.raises(TypeError, match="int32"):
        check_block_idx(sink_only.long(), q, k, 8)
    with pytest.raises(ValueError, match=r"\[B, Tq, HKV, S\]"):
        check_block_idx(torch.zeros(1, 16, 4, 3, dtype=torch.int32), q, k, 8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_block_idx([[0]], q, k, 8)


def _valid_selection():
    """``[2, 6, 2, 4]`` over 22 keys in blocks of 4 (6 blocks; queries at positions 16..21, in
    blocks 4 and 5): every row ascending, causal, -1 padded; some rows of -1 only."""
    idx = torch.tensor([0, 2, 4, -1], dtype=torch.int32).repeat(2, 6, 2, 1)
    idx[0, 5, 1] = torch.tensor([1, 3, 4, 5])  # the last query reaches the last block
    idx[1, 2] = -1  # attends to no key: allowed (o = 0, lse = -inf)
    return idx


# (entry, row written there, what the message names)
BAD_ROWS = [
    ((1, 3, 0), [0, 2, 6, -1], "block id = the block count (reads the next head's keys)"),
    ((0, 0, 1), [0, 2, 400, -1], "far out of range"),
    ((0, 4, 0), [-2, 0, 1, -1], "below -1"),
    ((1, 0, 1), [0, 2, 2, -1], "duplicate"),
    ((0, 2, 1), [0, 3, 2, -1], "descending"),
    ((1, 5, 0), [0, -1, 3, -1], "-1 before a valid id"),
    ((0, 1, 0), [0, 2, 5, -1], "future block: query 1 sits at 17, block 5 starts at 20"),
]


@pytest.mark.parametrize("at,row,why", BAD_ROWS, ids=[b[2] for b in BAD_ROWS])
def test_check_block_idx_rejects_bad_values(at, row, why):
    """Range, strict ascending order with -1 only at the end, and causality, each named with the
    first bad (b, t, h) row; valid rows (``-1`` alone included) pass."""
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 22, 2, 16)
    idx = _valid_selection()
    check_block_idx(idx, q, k, 4)
    idx[at] = torch.tensor(row, dtype=torch.int32)
    b, t, h = at
    with pytest.raises(ValueError, match=rf"block_idx\[{b}, {t}, {h}\] = "
                                         rf"{re.escape(str(row))}.*ascending.*\[0, 6\).*causal"):
        check_block_idx(idx, q, k, 4)
    # a second bad row later in the tensor: the first is still the one named
    idx[1, 5, 1] = 7
    with pytest.raises(ValueError, match=rf"block_idx\[{b}, {t}, {h}\]"):
        check_block_idx(idx, q, k, 4)


def test_check_block_idx_values_edge_shapes():
    """Zero-size selections and one-slot rows pass without error; causality is per query."""
    check_block_idx_values(torch.zeros(0, 5, 2, 3, dtype=torch.int32), 10, 4)
    check_block_idx_values(torch.zeros(1, 5, 2, 0, dtype=torch.int32), 10, 4)
    one = torch.tensor([[0], [1], [1], [2]], dtype=torch.int32).view(1, 4, 1, 1)
    check_block_idx_values(one, 12, 4)  # queries at 8..11: blocks <= 2
    check_block_idx_values(one[:, :2], 6, 4)  # queries at 4, 5: blocks <= 1
    with pytest.raises(ValueError, match=r"block_idx\[0, 0, 0\] = \[1\].*ids <= 0"):
        check_block_idx_values(one[:, 1:2], 4, 4)  # one query at position 3: block 0 only


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_resolve_rejects_non_finite_scale(scale):
    """A NaN / Inf scale would turn every row into NaN (or, before, into silent zeros)."""
    q, k = _qk()
    with pytest.raises(ValueError, match="scale must be finite"):
        resolve_config(q, k, "torch", scale=scale)
    assert resolve_config(q, k, "torch", scale=0.0).scale == 0.0


@pytest.mark.parametrize("knobs,name,want", [
    (dict(scale="0.1"), "scale", "a real number or None"), (dict(scale=True), "scale", "a real"),
    (dict(scale=torch.tensor(0.1)), "scale", "a real number"),
    (dict(forced_in_budget="no"), "forced_in_budget", "a bool"),
    (dict(forced_in_budget=1), "forced_in_budget", "a bool"),
    (dict(topk=16.0), "topk", "an int"), (dict(block_size="64"), "block_size", "an int"),
    (dict(beam=True), "beam", "an int"), (dict(beam=2.5), "beam", "an int"),
    (dict(branching=2.0), "branching", "an int")], ids=lambda x: str(x)[:30])
def test_wrong_types_are_type_errors_naming_the_knob(knobs, name, want):
    """No knob goes through ``float()`` / ``bool()``: ``"0.1"`` or ``"no"`` is a ``TypeError``."""
    q, k = _qk()
    with pytest.raises(TypeError, match=f"{name} must be {want}"):
        resolve_config(q, k, "torch", **knobs)


def test_check_knobs_needs_no_tensors():
    """``check_knobs`` is ``resolve_config``'s check without inputs (for objects made before
    them); ``"auto"`` bounds the block size by the widest range."""
    from pisa.ops.utils.config import check_knobs
    check_knobs()
    check_knobs(block_size=256, topk=3, beam=None, scale=1, backend="auto")
    check_knobs(block_size=16, topk=1, forced_in_budget=False, scale=0.5, backend="triton")
    for knobs, exc, msg in [
            (dict(block_size=256, backend="triton"), ValueError, r"\[16, 128\]"),
            (dict(backend="bogus"), ValueError, "backend must be one of"),
            (dict(selector="bogus"), ValueError, "selector"),
            (dict(topk=0), ValueError, "topk"), (dict(scale="0.1"), TypeError, "scale")]:
        with pytest.raises(exc, match=msg):
            check_knobs(**knobs)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    """``backend="triton"`` with CPU tensors: a clear error instead of Triton's "0 active
    drivers", unless ``TRITON_INTERPRET=1`` asks for the CPU interpreter."""
    import pisa.ops.utils.config as config
    q = torch.randn(1, 4, 2, 8)
    monkeypatch.setattr(config, "HAS_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors, got q on cpu.*"
                                         "TRITON_INTERPRET=1"):
        resolve_backend("triton", q)
    assert resolve_backend("auto", q) == "torch" and resolve_backend("torch", q) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", q) == "triton"
    monkeypatch.setattr(config, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="needs Triton"):
        resolve_backend("triton", q)


@pytest.mark.parametrize("q_shape,k_shape,msg", [
    ((1, 8, 0, 16), (1, 8, 2, 16), r"q must have at least one head \(HQ >= 1\)"),
    ((1, 8, 4, 16), (1, 8, 0, 16), r"k must have at least one head \(HKV >= 1\)"),
    ((1, 8, 4, 0), (1, 8, 2, 0), r"q head dim D must be in \[1, 256\], got 0")])
def test_check_qk_rejects_zero_heads_and_head_dims(q_shape, k_shape, msg):
    """Zero heads or a zero head dim are named errors; a zero batch or query length is not (the
    public functions return empty results)."""
    from pisa.ops.utils.config import check_qk
    with pytest.raises(ValueError, match=msg):
        check_qk(torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape))
    check_qk(torch.randn(0, 8, 4, 16), torch.randn(0, 8, 2, 16))
    check_qk(torch.randn(1, 0, 4, 16), torch.randn(1, 8, 2, 16))


def test_v2_knobs_resolve_and_round_trip():
    """``query_tile``, ``beam_leaf`` and ``tile_reduce`` pass through ``resolve_config`` (and
    ``SelectConfig(**cfg.op_kwargs())`` rebuilds it); ``beam_leaf=None`` means ``beam`` at every
    level."""
    q, k = _qk()
    cfg = resolve_config(q, k, "torch", topk=5, scorer="bound", query_tile=16, beam_leaf=9,
                         tile_reduce="lse")
    assert (cfg.query_tile, cfg.beam_leaf, cfg.tile_reduce, cfg.scorer) == (16, 9, "lse", "bound")
    assert SelectConfig(**cfg.op_kwargs()) == cfg
    assert [cfg.beam_at(lvl) for lvl in (2, 3, 4)] == [9, 5, 5]
    plain = resolve_config(q, k, "torch", topk=5, **DECODE_DEFAULTS)
    assert (plain.query_tile, plain.beam_leaf, plain.tile_reduce) == (1, None, "sum")
    assert [plain.beam_at(lvl) for lvl in (2, 3)] == [5, 5]
    assert SelectConfig(beam=7, beam_leaf=None).beam_at(2) == 7


def test_leaf_scorer():
    """Leaves are scored by their exact LSE for flat_lse and the bound scorer."""
    assert SelectConfig(scorer="bound").leaf_scorer == "lse"
    assert SelectConfig(scorer="meanvar").leaf_scorer == "meanvar"
    assert SelectConfig(scorer="meanvar", selector="flat_lse").leaf_scorer == "lse"
    assert SelectConfig(selector="flat_mean").leaf_scorer == "mean"


@pytest.mark.parametrize("knobs,exc,msg", [
    (dict(query_tile=3), ValueError, "query_tile must be a power of two in \\[1, block_size=64\\]"),
    (dict(query_tile=0), ValueError, "query_tile must be a power of two"),
    (dict(query_tile=32, block_size=16), ValueError, "block_size=16"),
    (dict(query_tile=4.0), TypeError, "query_tile must be an int"),
    (dict(query_tile=True), TypeError, "query_tile must be an int"),
    (dict(beam_leaf=0), ValueError, "beam_leaf must be a positive int or None"),
    (dict(beam_leaf=2.0), TypeError, "beam_leaf must be an int"),
    (dict(tile_reduce="max"), ValueError,
     "tile_reduce must be one of \\('sum', 'lse', 'qmean', 'mass'\\)"),
    (dict(scorer="bounds"), ValueError, "scorer must be one of")], ids=lambda x: str(x)[:30])
def test_v2_knob_checks(knobs, exc, msg):
    """Each new knob is checked by ``check_knobs`` (so by ``resolve_config``), naming it."""
    from pisa.ops.utils.config import check_knobs
    with pytest.raises(exc, match=msg):
        check_knobs(**knobs)
    q, k = _qk()
    with pytest.raises(exc, match=msg):
        resolve_config(q, k, "torch", **knobs)
    check_knobs(query_tile=64, beam_leaf=None, tile_reduce="lse", scorer="bound")
    check_knobs(query_tile=16, tile_reduce="qmean")
    check_knobs(query_tile=1, block_size=4, beam_leaf=32)


def test_n_query_tiles_counts_the_aligned_tiles_touched():
    """The formula against a direct count of the tiles of absolute positions ``Tk-Tq .. Tk-1``."""
    from pisa.ops.utils.config import n_query_tiles
    for Qt in (1, 2, 4, 16):
        for Tk in range(0, 40):
            for Tq in range(0, Tk + 1):
                want = len({t // Qt for t in range(Tk - Tq, Tk)})
                assert n_query_tiles(Tq, Tk, Qt) == want, (Tq, Tk, Qt)


def test_grown_beams_scale_with_the_pruned_levels():
    """``beam_ref_len``: past the reference length both beams are multiplied by the ratio of the
    internal levels holding more than ``beam`` nodes (C = 64, g = 2, W = 16: 2 at 8K, 4 at 32K,
    6 at 128K); up to it, or with None, nothing changes; ``beam_leaf=None`` stays None."""
    assert [pruned_levels(T, 64, 2, 16) for T in (8192, 32768, 131072)] == [2, 4, 6]
    assert grown_beams(16, 32, 8192, 8192, 64, 2) == (16, 32)
    assert grown_beams(16, 32, 32768, 8192, 64, 2) == (32, 64)
    assert grown_beams(16, 32, 131072, 8192, 64, 2) == (48, 96)
    assert grown_beams(16, None, 131072, 8192, 64, 2) == (48, None)
    assert grown_beams(16, 32, 4096, 8192, 64, 2) == (16, 32)
    # a reference too short to prune anything counts as one level
    assert grown_beams(16, 32, 32768, 1024, 64, 2) == (64, 128)
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 32768, 2, 16)
    cfg = resolve_config(q, k, "torch", block_size=64, topk=16, beam_leaf=32, beam_ref_len=8192)
    assert (cfg.beam, cfg.beam_leaf) == (32, 64)
    cap = resolve_config(q, None, "torch", block_size=64, topk=16, beam_ref_len=8192,
                         seqlen_k=131072)  # a cache's capacity, a packed batch's longest
    assert cap.beam == 48


@pytest.mark.parametrize("bad,err", [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_beam_ref_len_must_be_a_positive_int(bad, err):
    q, k = _qk()
    with pytest.raises(err, match="beam_ref_len"):
        resolve_config(q, k, "torch", beam_ref_len=bad)


def test_query_tile_none_means_the_default_tile_capped_by_the_block():
    from pisa.ops.utils.config import QUERY_TILE, query_tile_of
    assert query_tile_of(None, 64) == QUERY_TILE == 16
    assert query_tile_of(None, 8) == 8 and query_tile_of(4, 64) == 4
