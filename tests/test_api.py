"""The public functions ``pisa_select`` and ``pisa_attn`` (``pisa/api.py``): end to end on CPU,
and the Triton path in bf16 against the fp32 torch backend on CUDA (``gpu``, skipped without it)."""
import pytest
import torch

from pisa import pisa_attn, pisa_select
from pisa.ops.attn.naive import naive_dense_attn
from pisa.ops.utils.config import QUERY_TILE, n_query_tiles

# The per-token selection (the knobs of ``pisa_attn_with_kvcache``'s defaults): the prefill side
# of every "a decode row equals a prefill row" comparison, and the tests about per-token rows.
PER_TOKEN = dict(query_tile=1, scorer="lse", tile_reduce="sum", beam_leaf=None)


def _qkv(B=1, Tq=100, Tk=100, HQ=4, HKV=2, D=16, dtype=torch.float32, grad=False):
    q = torch.randn(B, Tq, HQ, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, Tk, HKV, D, dtype=dtype, requires_grad=grad)
    return q, k, v


def test_queries_within_first_k_blocks_get_dense_causal_attention(rng):
    C, K = 8, 6
    q, k, v = _qkv(Tq=K * C, Tk=K * C, dtype=torch.float64)
    o = pisa_attn(q, k, v, block_size=C, topk=K, backend="torch")
    torch.testing.assert_close(o, naive_dense_attn(q, k, v, 16 ** -0.5)[0],
                               rtol=1e-10, atol=1e-10)



def test_dense_below_runs_exact_dense_attention_up_to_its_length(rng):
    """``dense_below``: self-attention calls of at most that many keys are dense causal attention
    (with gradients, GQA and the scale), longer ones and decode rows stay sparse."""
    C, K, T = 8, 4, 200
    q, k, v = _qkv(Tq=T, Tk=T, dtype=torch.float64, grad=True)
    kw = dict(block_size=C, topk=K, backend="torch", scale=0.2)
    o = pisa_attn(q, k, v, dense_below=T, **kw)
    ref = naive_dense_attn(q, k, v, 0.2)[0]
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    sparse = pisa_attn(q, k, v, **kw)
    assert (sparse - ref).abs().max() > 1e-3, "beyond K blocks the default is sparse"
    torch.testing.assert_close(pisa_attn(q, k, v, dense_below=T - 1, **kw), sparse)
    row = pisa_attn(q[:, -1:], k, v, dense_below=T, **kw)  # decode: seqlen_q != seqlen_k
    torch.testing.assert_close(row, pisa_attn(q[:, -1:], k, v, **kw))


@pytest.mark.parametrize("value, err, msg", [(-1, ValueError, "dense_below must be >= 0"),
                                             (8.0, TypeError, "dense_below must be an int")])
def test_dense_below_rejects_bad_values(value, err, msg):
    with pytest.raises(err, match=msg):
        pisa_attn(*_qkv(), dense_below=value, backend="torch")


def test_dense_below_refuses_return_lse_when_it_would_run_dense():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dense_below=128 would run dense attention"):
        pisa_attn(q, k, v, dense_below=128, return_lse=True, backend="torch")
    o, lse = pisa_attn(q, k, v, dense_below=64, return_lse=True, backend="torch")  # 100 > 64
    assert lse.shape == (1, 4, 100)


def test_decode_row_equals_prefill_row(rng):
    """A single query at the end of the keys (decode) sees what prefill row T-1 sees (per-token
    selection: a query tile's row depends on the other tokens of its tile)."""
    q, k, v = _qkv(Tq=300, Tk=300, dtype=torch.float64)
    kw = dict(block_size=8, topk=6, beam=4, backend="torch", **PER_TOKEN)
    full = pisa_attn(q, k, v, **kw)
    for t in (0, 7, 150, 299):
        row = pisa_attn(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], **kw)
        torch.testing.assert_close(row[:, 0], full[:, t], rtol=1e-12, atol=1e-12)


def test_default_selection_is_16_token_qmean_bound_tiles(rng):
    """The prefill defaults are selection v2: ``pisa_select`` gives a row per 16-token tile
    (``min(16, block_size)``), scored by the bound scorer on the tile's mean query with a leaf
    beam of 32; ``pisa_attn`` attends that selection, and still takes a per-token
    ``block_idx`` (``Tq`` rows) at its default ``query_tile``."""
    from pisa.ops.attn.naive import naive_attn
    from pisa.ops.select import tiles_to_tokens
    from pisa.ops.utils.config import BEAM_LEAF, SCORER, TILE_REDUCE
    assert (QUERY_TILE, SCORER, TILE_REDUCE, BEAM_LEAF) == (16, "bound", "qmean", 32)
    q, k, v = _qkv(Tq=150, Tk=200, dtype=torch.float64)
    kw = dict(block_size=32, topk=4, beam=2, backend="torch")
    idx, cnt = pisa_select(q, k, **kw)
    assert idx.shape == (1, n_query_tiles(150, 200, 16), 2, 4)  # positions 50..199: tiles 3..12
    explicit = pisa_select(q, k, query_tile=16, scorer="bound", tile_reduce="qmean",
                           beam_leaf=32, **kw)
    assert torch.equal(idx, explicit[0]) and torch.equal(cnt, explicit[1])
    assert pisa_select(q, k, **dict(kw, block_size=8))[0].shape[1] == n_query_tiles(150, 200, 8)
    per_tile_tokens, _ = tiles_to_tokens(idx, cnt, 150, 200, 16)
    want = naive_attn(q, k, v, per_tile_tokens, 32, 16 ** -0.5)[0]
    torch.testing.assert_close(pisa_attn(q, k, v, **kw), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pisa_attn(q, k, v, block_idx=idx, **kw), want, rtol=1e-10,
                               atol=1e-10)
    # a per-token selection at the default query_tile: read per token
    tok, _ = pisa_select(q, k, **kw, **PER_TOKEN)
    assert tok.shape == (1, 150, 2, 4)
    torch.testing.assert_close(pisa_attn(q, k, v, block_idx=tok, **kw),
                               naive_attn(q, k, v, tok, 32, 16 ** -0.5)[0], rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(pisa_attn(q, k, v, block_idx=tok, **kw),
                               pisa_attn(q, k, v, **kw, **PER_TOKEN), rtol=1e-10, atol=1e-10)


def test_beam_ref_len_is_the_grown_beams_in_every_entry_point(rng):
    """``beam_ref_len`` resolves to wider beams by the key length (``grown_beams``: 4 / 8 at 256
    keys are 12 / 24 at 1024 for C = 16, g = 2): ``pisa_select``, ``pisa_attn``, the varlen form
    (its longest sequence), a decode step (the cache's capacity) and ``PisaAttention`` give what
    the explicit widths give, and the grown walk keeps more than the fixed one prunes."""
    from pisa import PisaAttention, PisaCache, pisa_attn_varlen, pisa_attn_with_kvcache
    q, k, v = _qkv(Tq=1024, Tk=1024, dtype=torch.float64)
    base = dict(block_size=16, topk=6, beam=4, beam_leaf=8, backend="torch", **{
        n: v for n, v in PER_TOKEN.items() if n != "beam_leaf"})
    grown = dict(base, beam=12, beam_leaf=24)
    ref = dict(base, beam_ref_len=256)
    for a, b in zip(pisa_select(q, k, **ref), pisa_select(q, k, **grown)):
        assert torch.equal(a, b)
    assert not torch.equal(pisa_select(q, k, **ref)[0], pisa_select(q, k, **base)[0])
    torch.testing.assert_close(pisa_attn(q, k, v, **ref), pisa_attn(q, k, v, **grown),
                               rtol=0, atol=0)
    cu = torch.tensor([0, 1024], dtype=torch.int32)
    torch.testing.assert_close(pisa_attn_varlen(q[0], k[0], v[0], cu, cu, 1024, 1024, **ref),
                               pisa_attn_varlen(q[0], k[0], v[0], cu, cu, 1024, 1024, **grown),
                               rtol=0, atol=0)
    cache = PisaCache.from_prefill(k[:, :1023], v[:, :1023], block_size=16, max_seqlen=1024)
    prefill_only = ("block_size", "query_tile", "tile_reduce")
    step = {n: x for n, x in ref.items() if n not in prefill_only}
    want = {n: x for n, x in grown.items() if n not in prefill_only}
    o_ref = pisa_attn_with_kvcache(q[:, -1:], cache, k[:, -1:], v[:, -1:], **step)
    cache = PisaCache.from_prefill(k[:, :1023], v[:, :1023], block_size=16, max_seqlen=1024)
    o_grown = pisa_attn_with_kvcache(q[:, -1:], cache, k[:, -1:], v[:, -1:], **want)
    torch.testing.assert_close(o_ref, o_grown, rtol=0, atol=0)
    layer = PisaAttention(32, 4, 2, **{n: x for n, x in ref.items() if n != "backend"})
    assert layer.pisa_kwargs["beam_ref_len"] == 256


def test_naive_and_torch_backends_agree_through_the_api(rng):
    q, k, v = _qkv(Tq=90, Tk=90, dtype=torch.float64)
    kw = dict(block_size=8, topk=5, beam=3, scorer="meanvar")
    i1, c1 = pisa_select(q, k, backend="naive", **kw)
    i2, c2 = pisa_select(q, k, backend="torch", **kw)
    assert torch.equal(i1, i2) and torch.equal(c1, c2)
    torch.testing.assert_close(pisa_attn(q, k, v, backend="naive", **kw),
                               pisa_attn(q, k, v, backend="torch", **kw))


def test_return_lse_and_precomputed_block_idx(rng):
    """The default selection (8-token tiles at block_size=8) fed back to ``pisa_attn``."""
    q, k, v = _qkv(Tq=64, Tk=64, grad=True)
    idx, counts = pisa_select(q, k, block_size=8, topk=4, forced_in_budget=False)
    assert idx.shape == (1, 8, 2, 7) and counts.shape == (1, 8, 2)
    o, lse = pisa_attn(q, k, v, block_size=8, block_idx=idx, return_lse=True)
    assert lse.shape == (1, 4, 64) and lse.dtype == torch.float32
    o.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("knobs", [dict(query_tile=4), dict(query_tile=8, tile_reduce="lse"),
                                   dict(query_tile=2, tile_reduce="qmean"),
                                   dict(beam_leaf=6, scorer="bound", query_tile=1),
                                   dict(beam_leaf=6), dict()])
def test_selection_v2_knobs_through_the_api(knobs, rng):
    """Tiles, the leaf beam and the bound scorer: the API's torch path equals the oracle, its
    attention equals the per-token attention over each token's tile row, and a tile's row is the
    selection of every token in it."""
    from pisa.ops.attn.naive import naive_attn
    from pisa.ops.select import tiles_to_tokens
    q, k, v = _qkv(Tq=70, Tk=93, dtype=torch.float64)
    kw = dict(block_size=8, topk=5, beam=3, **knobs)
    i1, c1 = pisa_select(q, k, backend="naive", **kw)
    i2, c2 = pisa_select(q, k, backend="torch", **kw)
    qt = knobs.get("query_tile", min(QUERY_TILE, 8))  # the default: 8-token tiles at C=8
    assert i2.shape[1] == n_query_tiles(70, 93, qt)
    assert torch.equal(i1, i2) and torch.equal(c1, c2)
    per_token, _ = tiles_to_tokens(i2, c2, 70, 93, qt)
    want = naive_attn(q, k, v, per_token, 8, 16 ** -0.5)[0]
    torch.testing.assert_close(pisa_attn(q, k, v, backend="torch", **kw), want)
    empty = pisa_select(q[:, :0], k, backend="torch", **kw)[0]
    assert empty.shape == (1, 0, 2, 5)


BAD = [
    (dict(q=torch.randn(2, 8, 4)), ValueError, "q must have shape"),
    (dict(k=torch.randn(1, 16, 3, 16)), ValueError, "multiple of k heads"),
    (dict(k=torch.randn(2, 16, 2, 16)), ValueError, "k batch"),
    (dict(k=torch.randn(1, 16, 2, 32)), ValueError, "k head dim"),
    (dict(v=torch.randn(1, 16, 2, 8)), ValueError, "v shape"),
    (dict(q=torch.randn(1, 17, 4, 16)), ValueError, "Tq <= Tk"),
    (dict(k=torch.randn(1, 16, 2, 16, dtype=torch.float64)), TypeError, "k.dtype"),
    (dict(q=torch.randint(0, 3, (1, 16, 4, 16))), TypeError, "floating-point"),
    (dict(q=torch.randn(1, 16, 16, 4).transpose(2, 3)), ValueError, "contiguous"),
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(block_size=48), ValueError, "block_size"),
    (dict(block_size=512), ValueError, "block_size"),
    (dict(topk=2), ValueError, "topk"),
    (dict(branching=1), ValueError, "branching"),
    (dict(beam=0), ValueError, "beam"),
    (dict(scorer="max"), ValueError, "scorer"),
    (dict(selector="random"), ValueError, "selector"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(block_idx=torch.zeros(1, 16, 2, 4, dtype=torch.int64)), TypeError, "int32"),
    (dict(block_idx=torch.zeros(1, 16, 4, 4, dtype=torch.int32)), ValueError, "block_idx"),
    (dict(q=torch.randn(1, 16, 4, 300), k=torch.randn(1, 16, 2, 300),
          v=torch.randn(1, 16, 2, 300)), ValueError, "head dim"),
    (dict(q=torch.randn(1, 16, 0, 16)), ValueError, r"q must have at least one head \(HQ"),
    (dict(k=torch.randn(1, 16, 0, 16), v=torch.randn(1, 16, 0, 16)), ValueError,
     r"k must have at least one head \(HKV"),
    (dict(q=torch.randn(1, 16, 4, 0), k=torch.randn(1, 16, 2, 0), v=torch.randn(1, 16, 2, 0)),
     ValueError, r"q head dim D must be in \[1, 256\], got 0"),
    (dict(scale="0.1"), TypeError, "scale must be a real number or None"),
    (dict(forced_in_budget="no"), TypeError, "forced_in_budget must be a bool"),
    (dict(topk=16.0), TypeError, "topk must be an int"),
    (dict(block_size="64"), TypeError, "block_size must be an int"),
    (dict(beam=True), TypeError, "beam must be an int"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    (dict(deterministic=None), TypeError, "deterministic must be a bool"),
]


@pytest.mark.parametrize("override,err,msg", BAD, ids=[b[2] for b in BAD])
def test_invalid_input_raises_a_named_error(override, err, msg):
    args = dict(q=torch.randn(1, 16, 4, 16), k=torch.randn(1, 16, 2, 16),
                v=torch.randn(1, 16, 2, 16))
    args.update(override)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(err, match=msg):
        pisa_attn(q, k, v, **args)


@pytest.mark.parametrize("backend,C,ok", [
    ("torch", 4, True), ("torch", 256, True), ("naive", 4, True),
    ("triton", 8, False), ("triton", 256, False)])
def test_block_size_is_bounded_once_per_backend(backend, C, ok, rng):
    """One table (``BLOCK_SIZES``): 8 fails selection on Triton as it fails attention; 256 is a
    torch block size only."""
    q, k, v = _qkv(Tq=16, Tk=16)
    if ok:
        idx, _ = pisa_select(q, k, block_size=C, topk=4, backend=backend)
        # default tiles of min(16, C) tokens: 4 rows at C=4, one at C=256
        assert idx.shape == (1, n_query_tiles(16, 16, min(QUERY_TILE, C)), 2, 4)
        idx, _ = pisa_select(q, k, block_size=C, topk=4, backend=backend, **PER_TOKEN)
        assert idx.shape == (1, 16, 2, 4)
        return
    for call in (lambda: pisa_select(q, k, block_size=C, backend=backend),
                 lambda: pisa_attn(q, k, v, block_size=C, backend=backend)):
        with pytest.raises(ValueError, match=f"for backend '{backend}'"):
            call()


@pytest.mark.parametrize("knobs", [dict(scale="0.1"), dict(forced_in_budget="no"),
                                   dict(topk=16.0), dict(block_size="64"), dict(beam=True)],
                         ids=lambda x: str(x))
def test_pisa_select_refuses_knobs_of_the_wrong_type(knobs):
    q, k, _ = _qkv(Tq=16, Tk=16)
    with pytest.raises(TypeError, match=f"{next(iter(knobs))} must be"):
        pisa_select(q, k, **knobs)


@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
@pytest.mark.parametrize("B,Tq,Tk", [(0, 32, 32), (1, 0, 32), (0, 0, 0), (2, 0, 0)])
@pytest.mark.parametrize("forced_in_budget", [True, False])
@pytest.mark.parametrize("query_tile", [None, 1], ids=["tiles", "per_token"])
def test_zero_size_batch_gives_empty_results(backend, B, Tq, Tk, forced_in_budget, query_tile):
    """``B = 0`` or ``Tq = 0``: empty outputs of the right shapes and dtypes, as torch ops give,
    from selection (a row per 16-token tile by default, per token with ``query_tile=1``),
    attention (with ``lse``) and its backward (zero gradients), on every backend (the shortcut
    is in the public functions, before any kernel)."""
    HQ, HKV, D, K = 4, 2, 16, 4
    q, k, v = _qkv(B=B, Tq=Tq, Tk=Tk, HQ=HQ, HKV=HKV, D=D, grad=True)
    kw = dict(block_size=16, topk=K, forced_in_budget=forced_in_budget, backend=backend,
              query_tile=query_tile)
    slots = K if forced_in_budget else K + 3
    rows = n_query_tiles(Tq, Tk, query_tile or QUERY_TILE)
    assert rows == (Tq if query_tile == 1 else Tq // 16)
    idx, counts = pisa_select(q, k, **kw)
    assert idx.shape == (B, rows, HKV, slots) and idx.dtype == torch.int32
    assert counts.shape == (B, rows, HKV) and counts.dtype == torch.int32
    o, lse = pisa_attn(q, k, v, return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, HQ, Tq) and lse.dtype == torch.float32
    (o.sum() + lse.sum()).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    o2 = pisa_attn(q.detach(), k.detach(), v.detach(), block_idx=idx, **kw)
    assert o2.shape == q.shape
    half = pisa_attn(q.detach().half(), k.detach().half(), v.detach().half(), **kw)
    assert half.dtype == torch.float16 and half.shape == q.shape


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    """Not Triton's "RuntimeError: 0 active drivers" at the first kernel launch."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(Tq=32, Tk=32)
    for call in (lambda: pisa_select(q, k, block_size=16, backend="triton"),
                 lambda: pisa_attn(q, k, v, block_size=16, backend="triton")):
        with pytest.raises(ValueError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
            call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_device_mismatch_is_reported():
    q = torch.randn(1, 16, 4, 16)
    k = torch.randn(1, 16, 2, 16, device="meta")
    with pytest.raises(ValueError, match="is on meta"):
        pisa_select(q, k)


def test_lse_gradient_matches_oracle(rng):
    """Gradients flow through the returned lse too (for users merging partial results)."""
    q, k, v = _qkv(Tq=70, Tk=70, dtype=torch.float64, grad=True)
    idx, _ = pisa_select(q.detach(), k.detach(), block_size=8, topk=5, backend="torch")
    o, lse = pisa_attn(q, k, v, block_size=8, block_idx=idx, return_lse=True, backend="torch")
    o2, lse2 = pisa_attn(q, k, v, block_size=8, block_idx=idx, return_lse=True, backend="naive")
    w = torch.randn_like(lse2)
    g1 = torch.autograd.grad((lse.double() * w).sum() + o.sum(), (q, k, v))
    g2 = torch.autograd.grad((lse2.double() * w).sum() + o2.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_eager_calls_skip_the_custom_ops_dispatch():
    """An eager process (prefill forward + backward, a cache's prefill and decode step) never
    imports ``torch._dynamo``: the custom ops' dispatch, which would, is for tracing
    (``pisa.ops.utils.dispatch.use_op``); its import was seconds of a process's first call."""
    import subprocess
    import sys
    code = (
        "import sys, torch, pisa\n"
        "q, k, v = (torch.randn(1, 300, h, 16, requires_grad=True) for h in (4, 2, 2))\n"
        "pisa.pisa_attn(q, k, v, block_size=16, topk=4).sum().backward()\n"
        "c = pisa.PisaCache(1, 400, 2, 16, block_size=16, dtype=torch.float32)\n"
        "q, k = torch.randn(1, 301, 4, 16), torch.randn(1, 301, 2, 16)\n"
        "pisa.pisa_attn_with_kvcache(q[:, :300], c, k[:, :300], k[:, :300], topk=4)\n"
        "pisa.pisa_attn_with_kvcache(q[:, 300:], c, k[:, 300:], k[:, 300:], topk=4)\n"
        "assert q.grad is None and 'torch._dynamo' not in sys.modules, 'dynamo imported'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_model_compiles_with_fullgraph(rng):
    """Selection and attention are custom ops, so torch.compile traces through pisa_attn."""
    from pisa import PisaAttention
    torch._dynamo.reset()
    layer = PisaAttention(32, 4, 2, block_size=8, topk=4)
    x = torch.randn(1, 64, 32, requires_grad=True)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("at,row,why", [
    ((0, 15, 1), [0, 1, 2, 4], "id = the block count: would read the next head's keys"),
    ((0, 3, 0), [0, 0, -1, -1], "duplicate: would count block 0 twice"),
    ((0, 9, 1), [0, 99999, -1, -1], "far out of range: crashed in the gather"),
    ((0, 2, 0), [0, 1, -1, -1], "future block: query 2 is in block 0"),
    ((0, 12, 0), [3, 1, -1, -1], "descending"),
])
@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_user_block_idx_values_are_checked(at, row, why, backend):
    """``pisa_attn(..., block_idx=...)`` checks the values, not only dtype and shape: a bad row
    is a ValueError naming block_idx and its (b, t, h), before any kernel runs."""
    q, k, v = _qkv(Tq=16, Tk=16)
    idx, _ = pisa_select(q, k, block_size=4, topk=4, **PER_TOKEN)  # rows per token
    pisa_attn(q, k, v, block_size=4, block_idx=idx, backend=backend)  # default tile: accepted
    idx[at] = torch.tensor(row, dtype=torch.int32)
    b, t, h = at
    with pytest.raises(ValueError, match=rf"block_idx\[{b}, {t}, {h}\] = .*expected ascending"):
        pisa_attn(q, k, v, block_size=4, block_idx=idx, backend=backend)


def test_block_idx_check_traces_with_fullgraph(rng):
    """Under torch.compile the value check is an async assert: no graph break, and a bad
    selection still fails."""
    torch._dynamo.reset()
    q, k, v = _qkv(Tq=32, Tk=32)
    idx, _ = pisa_select(q, k, block_size=8, topk=4, **PER_TOKEN)  # rows per token
    f = torch.compile(lambda *a: pisa_attn(*a[:3], block_size=8, block_idx=a[3]),
                      fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v, idx), pisa_attn(q, k, v, block_size=8, block_idx=idx))
    idx[0, 20, 1, 1] = idx[0, 20, 1, 0]
    with pytest.raises(RuntimeError, match="block_idx is not a valid selection"):
        f(q, k, v, idx)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_non_finite_scale_is_rejected(scale):
    q, k, v = _qkv(Tq=16, Tk=16)
    with pytest.raises(ValueError, match="scale must be finite"):
        pisa_attn(q, k, v, block_size=4, topk=4, scale=scale)


@pytest.mark.parametrize("lens,n_new", [([5, 41], 0), ([-1, 5], 0), (41, 0), (-3, 0),
                                         ([38, 0], 3), (38, 3)])
@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_caller_cache_seqlens_out_of_range_raise_on_cpu(lens, n_new, seqlen_q):
    """Caller-owned lengths must lie in [0, max_seqlen - seqlen_new]: on CPU a ValueError naming
    cache_seqlens (on CUDA an async device assert); before, they gave finite output."""
    from pisa import PisaCache, pisa_attn_with_kvcache
    cache = PisaCache(2, 40, 1, 16, block_size=8)
    q = torch.randn(2, seqlen_q, 2, 16)
    kv = [torch.randn(2, n_new, 1, 16) for _ in range(2)] if n_new else [None, None]
    bad = torch.tensor(lens, dtype=torch.int32) if isinstance(lens, list) else lens
    with pytest.raises(ValueError, match=rf"cache_seqlens.*\[0, 40 - {n_new}\]"):
        pisa_attn_with_kvcache(q, cache, *kv, cache_seqlens=bad, topk=4, backend="torch")
    assert not cache.cache_seqlens.any()  # nothing appended
    ok = torch.tensor([40 - n_new, seqlen_q], dtype=torch.int32)
    o = pisa_attn_with_kvcache(q, cache, *kv, cache_seqlens=ok, topk=4, backend="torch")
    assert o.shape == q.shape


# ------------------------------------------------------------------------------------------------
# GPU: the Triton path in bf16 at real sizes
# ------------------------------------------------------------------------------------------------
def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs CUDA")(test))


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@gpu
@pytest.mark.parametrize("T", [4096, 32768])
@pytest.mark.parametrize("G,D", [(4, 64), (16, 128), (4, 128), (16, 64)])
def test_gpu_bf16_outputs_and_grads_match_fp32_reference(T, G, D, rng):
    HKV = 2 if T > 4096 else 4
    q = torch.randn(1, T, HKV * G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx, counts = pisa_select(q, k, backend="triton")
    ref_idx, ref_counts = pisa_select(q.float(), k.float(), backend="torch")
    same = (idx == ref_idx).all(-1).float().mean().item()
    assert same > 0.99, f"triton selection rows equal to the fp32 torch selection: {same:.4f}"
    o = pisa_attn(q, k, v, block_idx=idx, backend="triton")
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = pisa_attn(*ref_in, block_idx=idx, backend="torch")
    assert _rel(o, ref) < 1e-2
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, ref_in, do.float())
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 2e-2


@gpu
def test_gpu_all_blocks_equals_dense_sdpa(rng):
    T, HKV, G, D = 2048, 2, 8, 128
    q = torch.randn(1, T, HKV * G, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    o = pisa_attn(q, k, v, topk=T // 64, backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.repeat_interleave(G, 2).transpose(1, 2).float(),
        v.repeat_interleave(G, 2).transpose(1, 2).float(), is_causal=True).transpose(1, 2)
    assert _rel(o, ref) < 1e-2


@gpu
def test_gpu_deterministic_backward_repeats_bitwise(rng):
    T, HKV, G, D = 8192, 2, 8, 128
    q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HKV * G, HKV, HKV))
    idx, _ = pisa_select(q, k, backend="triton")
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        o = pisa_attn(q, k, v, block_idx=idx, deterministic=True, backend="triton")
        runs.append(torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@gpu
def test_gpu_deterministic_changes_only_the_backward_summation_order(rng):
    """pisa_attn with atomic dK/dV against deterministic=True: the forward is the same kernel, so
    bitwise equal; gradients differ only by summation order."""
    T, HKV, G, D = 16384, 4, 16, 128
    q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (HKV * G, HKV, HKV))
    idx, _ = pisa_select(q, k, backend="triton")
    do = torch.randn_like(q)
    o1, lse1 = pisa_attn(q, k, v, block_idx=idx, return_lse=True, backend="triton")
    g1 = torch.autograd.grad(o1, (q, k, v), do)
    o2, lse2 = pisa_attn(q, k, v, block_idx=idx, return_lse=True, deterministic=True,
                         backend="triton")
    g2 = torch.autograd.grad(o2, (q, k, v), do)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    for a, b in zip(g1, g2):
        assert _rel(a, b) < 1e-3


@gpu
def test_gpu_model_compiles_with_inductor_fullgraph(rng):
    """torch.compile(fullgraph=True) with the default inductor backend over a small PISA model on
    the GPU: same output as eager, and gradients flow."""
    from pisa import PisaAttention
    torch._dynamo.reset()
    layer = torch.nn.Sequential(PisaAttention(256, 8, 2, block_size=64, topk=4),
                                PisaAttention(256, 8, 2, block_size=64, topk=4)).cuda()
    x = torch.randn(2, 2048, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert _rel(compiled, eager) < 2e-2
    compiled.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@gpu
def test_gpu_nan_in_a_key_reaches_the_rows_dense_sdpa_says(rng):
    """bf16 Triton: one NaN key makes exactly the rows that attend it NaN, as dense SDPA (all
    blocks are selected in the first topk * block_size tokens, so there PISA is dense)."""
    T, HKV, G, D = 1024, 2, 4, 64
    q = torch.randn(1, T, HKV * G, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    k[0, 100, 1, 3] = float("nan")
    o, lse = pisa_attn(q, k, v, backend="triton", return_lse=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    assert torch.equal(o.isnan().any(-1), ref.isnan().any(-1))
    assert torch.equal(lse.isnan(), ref.isnan().any(-1).transpose(1, 2))
    assert o[0, :100].isfinite().all() and o[0, 100:, HKV * G // 2:].isnan().all()


@gpu
def test_gpu_decode_with_caller_lengths_replays_in_a_cuda_graph(rng):
    """pisa_attn_with_kvcache with caller-owned cache_seqlens (checked by an async device assert)
    captures in a CUDA graph, and a replay equals the eager step bitwise."""
    from pisa import PisaCache, pisa_attn_with_kvcache
    B, T, HKV, G, D = 2, 4096, 2, 8, 64
    k = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    cache = PisaCache.from_prefill(k, v)
    lens = torch.tensor([T, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, HKV * G, D, device="cuda", dtype=torch.bfloat16)
    want = pisa_attn_with_kvcache(q, cache, cache_seqlens=lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pisa_attn_with_kvcache(q, cache, cache_seqlens=lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pisa_attn_with_kvcache(q, cache, cache_seqlens=lens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@gpu
def test_gpu_new_lengths_compile_nothing(rng):
    """Lengths are runtime values: after one call, forward+backward at lengths of every
    divisibility (and other level counts), and with a batch stride past 2**31 (a q of 256K tokens
    in config A has one), compiles no new kernel variant (each cost seconds)."""
    from pisa.bench import triton_variants

    def call(T, batch_stride=None):
        B, HQ, HKV, D = 2, 16, 4, 64
        if batch_stride is None:
            q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
        else:  # a view into a buffer of more than 2**31 elements
            buf = torch.empty(batch_stride + T * HQ * D, device="cuda", dtype=torch.bfloat16)
            q = buf.as_strided((B, T, HQ, D), (batch_stride, HQ * D, D, 1)).normal_()
        k = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        pisa_attn(q.requires_grad_(), k, v).sum().backward()
        torch.cuda.synchronize()

    call(8192)
    n = triton_variants()
    assert n > 0, "no compiled pisa kernel counted"
    for T in (8256, 9000, 20000, 16385, 40001):
        call(T)
        assert triton_variants() == n, f"T={T} compiled {triton_variants() - n} new variants"
    call(5000, batch_stride=1 << 31)
    assert triton_variants() == n, "a 64-bit batch stride compiled new variants"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kvcache_decode_with_v2_knobs_equals_prefill(backend, rng):
    """Through ``pisa_attn_with_kvcache``: decoding token by token with the bound scorer (bounds
    built lazily from the cache's keys, then kept by the appends) and a wider leaf beam equals
    the prefill rows of ``pisa_attn``."""
    from pisa import PisaCache, pisa_attn_with_kvcache
    q, k, v = _qkv(Tq=80, Tk=80, HQ=4, HKV=2, D=16)
    kw = dict(topk=4, beam=2, beam_leaf=4, scorer="bound", query_tile=1, tile_reduce="sum")
    full = pisa_attn(q, k, v, block_size=16, backend="torch", **kw)
    cache = PisaCache.from_prefill(k[:, :72], v[:, :72], block_size=16, max_seqlen=80)
    assert cache.mins is None
    for t in range(72, 80):
        o = pisa_attn_with_kvcache(q[:, t:t + 1], cache, k[:, t:t + 1], v[:, t:t + 1],
                                   backend=backend, **kw)
        torch.testing.assert_close(o[:, 0], full[:, t], rtol=1e-4, atol=1e-5)
    assert cache.mins is not None


def test_triton_tiles_through_the_api_equal_torch(rng):
    """``pisa_attn`` with query tiles on the Triton kernels (interpreter on CPU): selection and
    attention equal the torch backend's, gradients included."""
    q, k, v = _qkv(Tq=90, Tk=120, HQ=8, HKV=2, D=16, grad=True)
    kw = dict(block_size=16, topk=4, beam=2, beam_leaf=3, query_tile=8, tile_reduce="qmean")
    i_t, _ = pisa_select(q.detach(), k.detach(), backend="triton", **kw)
    i_c, _ = pisa_select(q.detach(), k.detach(), backend="torch", **kw)
    assert torch.equal(i_t, i_c)
    do = torch.randn(1, 90, 8, 16)
    outs = []
    for backend in ("triton", "torch"):
        o = pisa_attn(q, k, v, backend=backend, **kw)
        outs.append((o,) + torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_public_functions_document_their_arguments():
    """``help()`` shows each entry point's arguments, the shared knob texts filled in (a
    docstring built by concatenation is no docstring at all)."""
    import pisa
    import pisa.distributed as dist
    for fn in (pisa.pisa_select, pisa.pisa_attn, pisa.pisa_select_varlen, pisa.pisa_attn_varlen,
               pisa.pisa_attn_with_kvcache, dist.pisa_attn_cp):
        doc = fn.__doc__
        assert doc and "beam_ref_len" in doc and "{_" not in doc, fn.__name__
    for fn in (pisa.pisa_select, pisa.pisa_attn, pisa.pisa_select_varlen, pisa.pisa_attn_varlen):
        assert "block_size: int. Keys per leaf block" in fn.__doc__, fn.__name__
