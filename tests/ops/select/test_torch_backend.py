"""``pisa.ops.select.torch_backend``: the vectorised selection against the fp64 oracle
``pisa.ops.select.naive``, its invariants, and planted needles."""
import pytest
import torch

from pisa.ops.select.naive import naive_select
from pisa.ops.select.torch_backend import select_torch
from pisa.ops.utils.geometry import cdiv
from tests.ops.conftest import per_token_config


def _cfg(C=8, K=6, g=2, W=4, scorer="lse", selector="pyramid", fib=True, D=16):
    return per_token_config(C, K, g, W, scorer, selector, fib, D ** -0.5)


def _qk(B, Tq, Tk, HKV, G, D, dtype=torch.float64):
    return torch.randn(B, Tq, HKV * G, D, dtype=dtype), torch.randn(B, Tk, HKV, D, dtype=dtype)


CASES = [  # Tq, Tk, G, D, C, g, W, K, scorer, selector, forced_in_budget
    (1, 1, 4, 32, 8, 2, 4, 6, "lse", "pyramid", True),
    (63, 63, 1, 32, 4, 2, 3, 5, "meanvar", "pyramid", True),
    (65, 65, 16, 64, 4, 4, 2, 4, "mean", "pyramid", False),
    (127, 127, 4, 32, 4, 2, 4, 6, "lse", "pyramid", True),
    (127, 127, 4, 64, 4, 3, 2, 5, "meanvar", "pyramid", False),
    (100, 300, 4, 32, 8, 2, 4, 6, "lse", "pyramid", True),
    (127, 127, 1, 32, 4, 2, 4, 6, "lse", "flat_lse", True),
    (65, 65, 16, 32, 4, 2, 4, 4, "lse", "flat_mean", False),
    (1000, 1000, 4, 32, 16, 2, 4, 8, "lse", "pyramid", True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_torch_selection_equals_naive(case, rng):
    Tq, Tk, G, D, C, g, W, K, scorer, selector, fib = case
    B, HKV = (1, 1) if Tk >= 300 else (2, 2)
    q, k = _qk(B, Tq, Tk, HKV, G, D)
    cfg = _cfg(C, K, g, W, scorer, selector, fib, D)
    want_idx, want_cnt = naive_select(q, k, cfg)
    got_idx, got_cnt = select_torch(q, k, cfg)
    assert torch.equal(got_idx, want_idx), f"seed {rng}"
    assert torch.equal(got_cnt, want_cnt)


@pytest.mark.parametrize("selector,scorer", [("pyramid", "lse"), ("pyramid", "mean"),
                                             ("pyramid", "meanvar"), ("flat_lse", "lse"),
                                             ("flat_mean", "lse")])
@pytest.mark.parametrize("fib", [True, False])
def test_selection_invariants(selector, scorer, fib, rng):
    Tq, Tk, C, K = 150, 333, 8, 7
    q, k = _qk(2, Tq, Tk, 2, 4, 16, torch.float32)
    cfg = _cfg(C, K, 2, 5, scorer, selector, fib)
    idx, cnt = select_torch(q, k, cfg)
    assert idx.shape == (2, Tq, 2, K if fib else K + 3) and idx.dtype == torch.int32
    t_abs = torch.arange(Tk - Tq, Tk)[None, :, None]
    cur = t_abs // C
    valid = idx >= 0
    assert torch.equal(valid.sum(-1), cnt.long()), "counts are the number of valid entries"
    assert torch.equal(valid, torch.arange(idx.shape[-1]) < cnt[..., None]), "-1 only at the end"
    assert bool(((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]).all()), "strictly ascending"
    assert bool((torch.where(valid, idx, 0) * C <= t_abs[..., None]).all()), "no future block"
    for f in (torch.zeros_like(cur), cur, (cur - 1).clamp_min(0)):
        assert bool((idx == f[..., None]).any(-1).all()), "forced block missing"
    n_causal = cur + 1
    want = torch.minimum(n_causal, torch.tensor(K)) if fib else None
    if fib:
        assert torch.equal(cnt.long(), want.expand_as(cnt)), "budget filled when blocks exist"


@pytest.mark.parametrize("scorer,flat", [("lse", "flat_lse"), ("mean", "flat_mean")])
def test_wide_beam_pyramid_equals_flat(scorer, flat, rng):
    Tk, C = 400, 8
    q, k = _qk(2, Tk, Tk, 2, 4, 16)
    n_blocks = cdiv(Tk, C)
    pyr, _ = select_torch(q, k, _cfg(C, 8, 2, n_blocks, scorer, "pyramid"))
    ref, _ = select_torch(q, k, _cfg(C, 8, 2, n_blocks, "lse", flat))
    assert torch.equal(pyr, ref)


def test_early_tokens_select_every_causal_block(rng):
    C, K = 8, 6
    q, k = _qk(1, 200, 200, 2, 2, 16)
    idx, cnt = select_torch(q, k, _cfg(C, K, 2, K))
    early = torch.arange(200) < K * C
    every = torch.arange(K)[None, :].expand(200, K)
    want = torch.where(every <= (torch.arange(200) // C)[:, None], every, -1).to(torch.int32)
    assert torch.equal(idx[0, early, 0], want[early])
    assert torch.equal(idx[0, early, 1], want[early])


def _needle_case(D=32, C=16, n_blocks=32, needle_block=3, distractor_block=20):
    """One query whose logits we set exactly (scale 1): a needle key with logit 12 inside an
    otherwise near-zero block, and a distractor block whose every key has logit 1.5."""
    T = n_blocks * C
    u = torch.nn.functional.normalize(torch.randn(D, dtype=torch.float64), dim=0)
    noise = torch.randn(T, D, dtype=torch.float64)
    noise -= (noise @ u)[:, None] * u  # orthogonal to u: contributes nothing to the logits
    logit = 0.05 * torch.randn(T, dtype=torch.float64)
    logit[needle_block * C + 5] = 12.0
    logit[distractor_block * C:(distractor_block + 1) * C] = 1.5
    k = (noise + logit[:, None] * u)[None, :, None, :]
    q = u[None, None, None, :].clone()
    return q, k


@pytest.mark.parametrize("selector,scorer,found", [
    ("pyramid", "lse", True), ("flat_lse", "lse", True),
    ("pyramid", "mean", False), ("flat_mean", "lse", False)])
def test_planted_needle(selector, scorer, found, rng):
    """The LSE scorer finds one sharp key far back; mean pooling blurs it (1/C of its logit) and
    prefers a block of uniformly mild keys, which holds ~130x less attention mass."""
    q, k = _needle_case()
    cfg = per_token_config(16, 4, 2, 8, scorer, selector, True, 1.0)  # 1 free slot after 3 forced
    idx, _ = select_torch(q, k, cfg)
    free = [b for b in idx[0, 0, 0].tolist() if b not in (0, 30, 31, -1)]
    assert free == ([3] if found else [20])
    naive_idx, _ = naive_select(q, k, cfg)
    assert torch.equal(idx, naive_idx)
