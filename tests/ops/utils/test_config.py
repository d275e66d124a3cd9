"""``pisa.ops.utils.config``: defaults, the one block-size table, and resolution of the knobs."""
import pytest
import torch

from pisa.ops.utils.config import (AUTO_CROSSOVER_T, BLOCK_SIZES, MAX_FORCED, SelectConfig,
                                   check_block_idx, check_geometry, resolve_backend,
                                   resolve_config)


def _qk(T=64, D=16):
    return torch.randn(1, T, 4, D), torch.randn(1, T, 2, D)


def test_slots_and_free_budget():
    inside = SelectConfig(topk=6)
    assert inside.slots == 6 and [inside.free_budget(f) for f in (1, 2, 3)] == [5, 4, 3]
    on_top = SelectConfig(topk=6, forced_in_budget=False)
    assert on_top.slots == 6 + MAX_FORCED and on_top.free_budget(3) == 6
    assert SelectConfig(*inside.astuple()) == inside


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
    for bad in (lo // 2, hi * 2, lo + 1 if lo > 2 else 3, 48, True, 16.0):
        with pytest.raises(ValueError, match=f"block_size must be a power of two in "
                                             rf"\[{lo}, {hi}\] for backend '{backend}'"):
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
    (dict(branching=1), "branching"), (dict(branching=2.0), "branching"),
    (dict(scorer="max"), "scorer"), (dict(selector="random"), "selector"),
    (dict(topk=2), "topk must be an int >= 3"), (dict(topk=0, forced_in_budget=False), ">= 1"),
    (dict(beam=0), "beam"), (dict(beam=2.5), "beam")])
def test_resolve_rejects_bad_knobs(knobs, msg):
    q, k = _qk()
    with pytest.raises(ValueError, match=msg):
        resolve_config(q, k, "torch", **knobs)


def test_resolve_backend():
    q = torch.randn(1, 4, 2, 8)
    assert resolve_backend("auto", q) == "torch"  # a CPU tensor
    assert [resolve_backend(b, q) for b in ("torch", "triton", "naive")] == \
        ["torch", "triton", "naive"]
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", q)


def test_check_block_idx():
    q, k = _qk(T=16)
    check_block_idx(torch.zeros(1, 16, 2, 3, dtype=torch.int32), q, k)
    with pytest.raises(TypeError, match="int32"):
        check_block_idx(torch.zeros(1, 16, 2, 3, dtype=torch.int64), q, k)
    with pytest.raises(ValueError, match=r"\[B, Tq, HKV, S\]"):
        check_block_idx(torch.zeros(1, 16, 4, 3, dtype=torch.int32), q, k)
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_block_idx([[0]], q, k)
