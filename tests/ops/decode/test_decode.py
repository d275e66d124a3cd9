"""``pisa.ops.decode``: the input checks of a decode step (``check_decode``), the dispatch of
``decode_step`` and chunked prefill against a cache (``prefill_with_cache``)."""
import importlib.util

import pytest
import torch

from pisa.ops.decode import check_decode, decode_step, prefill_with_cache
from pisa.ops.decode.torch_backend import decode_torch
from pisa.ops.utils.config import SelectConfig
from tests.ops.conftest import INTERPRET
from tests.ops.decode.common import filled_cache, make_cache, oracle_rows, pyramid_sums

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.usefixtures("fast_interpreter", "poison_outputs")


def _cfg(C=8, K=5, g=2, W=2, scorer="lse", selector="pyramid", fib=True, D=16):
    return SelectConfig(C, K, g, W, scorer, selector, fib, D ** -0.5)


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_prefill_with_cache_equals_naive_oracle(backend, rng):
    B, T, H, G, D, L = 3, 250, 2, 2, 16, 12
    cfg = _cfg(D=D)
    q = torch.randn(B, L, H * G, D, dtype=torch.float64)
    k, v = torch.randn(2, B, T, H, D, dtype=torch.float64)
    for seqlens in ([L, 130, 250], [170] * B):  # one sequence at a time / all together
        cache = filled_cache(k, v, seqlens, T, cfg.block_size, cfg.branching)
        o, lse = prefill_with_cache(q, *cache[:3], seqlens, cfg, backend)
        want_o, want_lse = oracle_rows(q, k, v, seqlens, cfg)
        torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10, msg=f"seed {rng}")
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_prefill_with_cache_triton(rng):
    """The sums pyramid feeds the Triton selection (fp32; the interpreter on CPU, CUDA on a GPU)."""
    dev = "cpu" if INTERPRET else "cuda"
    B, T, H, G, D, L = 2, 200, 1, 2, 16, 3
    cfg = SelectConfig(16, 4, 2, 2, "lse", "pyramid", True, D ** -0.5)
    q = torch.randn(B, L, H * G, D)
    k, v = torch.randn(2, B, T, H, D)
    seqlens = [90, 200]  # 13 leaves, 5 levels: the walk prunes
    cache = filled_cache(k.to(dev), v.to(dev), seqlens, T, cfg.block_size, cfg.branching)
    o, _ = prefill_with_cache(q.to(dev), *cache[:3], seqlens, cfg, "triton")
    want, _ = oracle_rows(q, k, v, seqlens, cfg)
    torch.testing.assert_close(o.cpu(), want.float(), rtol=2e-4, atol=2e-4, msg=f"seed {rng}")


def _decode_args():
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 40, 2, 16, dtype=torch.float64)
    return [q, *filled_cache(k, v, [5, 30], 40, 8, 2), _cfg()]


BAD = [
    (0, torch.randn(2, 2, 4, 16, dtype=torch.float64), ValueError, r"\[B=2, 1, HQ, D=16\]"),
    (0, torch.randn(2, 1, 3, 16, dtype=torch.float64), ValueError, "multiple of HKV"),
    (0, torch.randn(2, 1, 4, 16), TypeError, "q must be torch.float64"),
    (0, [1.0], TypeError, "q must be a torch.Tensor"),
    (2, torch.zeros(2, 40, 2, 8, dtype=torch.float64), ValueError, "v_cache"),
    (3, torch.zeros(2, 3, 2, 16, dtype=torch.float64), ValueError, "sums must be"),
    (4, torch.zeros(2, dtype=torch.int64), ValueError, "cache_seqlens must be"),
    (5, _cfg(selector="auto"), ValueError, "must be resolved"),
    (5, _cfg(C=6), ValueError, "block_size"),
]


@pytest.mark.parametrize("pos,value,exc,msg", BAD, ids=lambda x: str(x)[:30])
def test_check_decode_rejects_bad_input(pos, value, exc, msg):
    args = _decode_args()
    check_decode(*args)
    args[pos] = value
    with pytest.raises(exc, match=msg):
        check_decode(*args)


def test_check_decode_rejects_what_the_triton_kernel_was_handed():
    """The shape and cache errors a Triton decode step raises (checked once, before dispatch)."""
    cfg = SelectConfig(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    q, k, v, sums, lens = make_cache(1, 64, 1, 2, 16, [40], 16, 2)
    check_decode(q, k, v, sums, lens, cfg)
    with pytest.raises(ValueError, match=r"q must have shape \[B=1, 1"):
        check_decode(q.expand(1, 2, 2, 16), k, v, sums, lens, cfg)
    with pytest.raises(ValueError, match="sums must be"):
        check_decode(q, k, v, sums[:, :-1], lens, cfg)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        check_decode(q, k, v, sums, lens.long(), cfg)


@pytest.mark.parametrize("selector,scorer", [("pyramid", "lse"), ("pyramid", "meanvar"),
                                             ("flat_lse", "lse")])
def test_decode_step_dispatches(selector, scorer, rng):
    """torch: ``decode_torch``; triton: the fused kernel for the pyramid walk with LSE scores,
    the torch path otherwise: the same result either way."""
    cfg = SelectConfig(block_size=16, topk=4, branching=2, beam=2, scorer=scorer,
                       selector=selector, scale=0.25)
    seqlens = [200, 37]
    q, k, v, _, lens = make_cache(2, 256, 2, 2, 16, seqlens, 16, 2, seed=rng)
    sums = pyramid_sums(k, seqlens, 16, 2)
    want = decode_torch(q, k, v, sums, lens, cfg)
    backends = ["torch"] + (["triton"] if HAS_TRITON else [])
    for backend in backends:
        dev = "cuda" if backend == "triton" and not INTERPRET else "cpu"
        o, lse = decode_step(*(x.to(dev) for x in (q, k, v, sums, lens)), cfg, backend)
        torch.testing.assert_close(o.cpu(), want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse.cpu(), want[1], rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN warnings, in the interpreter
def test_decode_propagates_nan_and_keeps_empty_sequences_empty(rng):
    """A NaN query head gives NaN in that head only; a NaN or Inf key the query attends (its own
    block, always selected) gives NaN in every head; an empty sequence (cache_seqlens = 0) still
    gives o = 0, lse = -inf. Torch and Triton (one split, and several merged by the combine
    kernel) alike; before, the Triton rows came out with lse = -inf."""
    cfg = SelectConfig(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    seqlens = [0, 70, 100, 90]
    q, k, v, sums, lens = make_cache(4, 128, 1, 2, 16, seqlens, 16, 2, seed=rng)
    q[1, 0, 1, 3] = float("nan")
    k[2, 97, 0, 2] = float("nan")  # the query's own block (96..99)
    k[3, 89, 0] = float("inf")  # the query's own key
    runs = [lambda: decode_step(q, k, v, sums, lens, cfg, "torch")]
    if HAS_TRITON:
        from pisa.ops.decode.triton import decode_triton
        dev = "cpu" if INTERPRET else "cuda"
        args = [x.to(dev) for x in (q, k, v, sums, lens)]
        runs += [lambda s=s: decode_triton(*args, cfg, num_splits=s) for s in (1, 4)]
    want = torch.tensor([[False, False], [False, True], [True, True], [True, True]])
    for run in runs:
        o, lse = (x.cpu() for x in run())
        assert torch.equal(o[:, 0].isnan().any(-1), want)
        assert torch.equal(lse[..., 0].isnan(), want)
        assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()
        assert torch.isfinite(o[1, 0, 0]).all() and torch.isfinite(lse[1, 0]).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max of NaNs
def test_decode_lengths_out_of_range_give_nan_rows(rng):
    """Caller-owned lengths are not read on the host in a CUDA decode step: a length below 0 or
    above T_max gives NaN rows (torch and Triton, one split and several), the others are as with
    valid lengths; before, they came out clamped and finite."""
    cfg = SelectConfig(block_size=16, topk=4, branching=2, beam=2, scale=0.25)
    q, k, v, sums, _ = make_cache(3, 128, 1, 2, 16, [128, 100, 128], 16, 2, seed=rng)
    lens = torch.tensor([129, 100, -1], dtype=torch.int32)
    runs = [lambda: decode_step(q, k, v, sums, lens, cfg, "torch")]
    if HAS_TRITON:
        from pisa.ops.decode.triton import decode_triton
        dev = "cpu" if INTERPRET else "cuda"
        args = [x.to(dev) for x in (q, k, v, sums, lens)]
        runs += [lambda s=s: decode_triton(*args, cfg, num_splits=s) for s in (1, 4)]
    ok_o, ok_lse = decode_step(q[1:2], k[1:2], v[1:2], sums[1:2], lens[1:2], cfg, "torch")
    for run in runs:
        o, lse = (x.cpu() for x in run())
        assert o[0].isnan().all() and lse[0].isnan().all()
        assert o[2].isnan().all() and lse[2].isnan().all()
        torch.testing.assert_close(o[1:2].float(), ok_o.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[1:2], ok_lse, rtol=1e-4, atol=1e-5)
