"""Inputs and references shared by the attention tests (and the selection-transpose test)."""
import math

import torch

from pisa.ops.utils.config import n_query_tiles
from pisa.ops.utils.geometry import cdiv


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def row_blocks(Tq, Tk, C, query_tile=1):
    """The block holding each selection row's first query position ``[rows]``: a row per token
    (``query_tile=1``) or per query tile (a tile lies inside one block)."""
    rows = n_query_tiles(Tq, Tk, query_tile)
    first = (torch.arange(rows) + (Tk - Tq) // query_tile) * query_tile
    return torch.maximum(first, torch.tensor(Tk - Tq)) // C


def random_selection(B, Tq, Tk, H, C, S, *, min_blocks=3, causal=True, seed=0, device=None,
                     query_tile=1):
    """Ascending, -1 padded, unique block lists: forced sink / previous / current blocks first, then
    random past blocks; each row keeps a random count in [min_blocks, S]. A row per query token,
    or per query tile with ``query_tile > 1``."""
    g = torch.Generator().manual_seed(seed)
    nb = cdiv(Tk, C)
    cur = row_blocks(Tq, Tk, C, query_tile)[None, :, None, None]
    R = cur.shape[1]
    blocks = torch.arange(nb)
    score = torch.rand(B, R, H, nb, generator=g)
    if causal:
        forced = (blocks == 0) | (blocks == cur - 1) | (blocks == cur)
        score = torch.where(forced, 2.0, score).masked_fill(blocks > cur, -math.inf)
    top_s, top_i = score.topk(min(S, nb), dim=-1)
    n = torch.randint(min_blocks, S + 1, (B, R, H, 1), generator=g)
    keep = (top_s > -math.inf) & (torch.arange(top_i.shape[-1]) < n)
    idx = torch.where(keep, top_i, nb).sort(-1).values
    idx = torch.nn.functional.pad(idx, (0, S - idx.shape[-1]), value=nb)
    return torch.where(idx == nb, -1, idx).to(torch.int32).to(device or default_device())


def all_blocks(B, Tq, Tk, H, C, device=None, query_tile=1):
    nb = cdiv(Tk, C)
    cur = row_blocks(Tq, Tk, C, query_tile)[:, None]
    idx = torch.where(torch.arange(nb) <= cur, torch.arange(nb), -1)
    return idx[None, :, None, :].expand(B, cur.shape[0], H, nb).to(torch.int32).contiguous().to(
        device or default_device())


def make_qkv(B, Tq, Tk, HQ, HKV, D, dtype, seed=0, device=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, HQ, D, generator=g)
    k = torch.randn(B, Tk, HKV, D, generator=g)
    v = torch.randn(B, Tk, HKV, D, generator=g)
    return [x.to(device=device or default_device(), dtype=dtype).requires_grad_()
            for x in (q, k, v)]


def rel_err(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_lse(lse, ref, tol):
    lse, ref = lse.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.isfinite(lse[finite]).all()
    assert (lse[finite] - ref[finite]).abs().max().item() < tol


def dense_masked_reference(q, k, v, block_idx, C, scale):
    """fp32 masked dense attention (a [Tq, Tk] mask: moderate sizes only)."""
    B, Tq, HQ, D = q.shape
    Tk, HKV = k.shape[1], k.shape[2]
    G, nb = HQ // HKV, cdiv(Tk, C)
    chosen = torch.zeros(B, Tq, HKV, nb + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(block_idx < 0, nb, block_idx).long(), True)
    allowed = chosen[..., :nb].repeat_interleave(C, -1)[..., :Tk]
    t_abs = Tk - Tq + torch.arange(Tq, device=q.device)
    causal = torch.arange(Tk, device=q.device) <= t_abs[:, None]
    allowed = (allowed & causal[None, :, None]).repeat_interleave(G, 2).permute(0, 2, 1, 3)
    s = scale * torch.einsum("bthd,bshd->bhts", q.float(), k.float().repeat_interleave(G, 2))
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", p, v.float().repeat_interleave(G, 2)), lse


def assert_matches_fp32_reference(q, k, v, o, lse, block_idx, C, scale, g=None):
    """A low-precision result ``o, lse`` (and its gradients in ``q, k, v`` for the upstream
    gradient ``g``) against ``dense_masked_reference`` on fp32 copies over the per-token
    ``block_idx``: relative errors under 1e-2 (o), 2e-2 (lse, gradients)."""
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ro, rlse = dense_masked_reference(*ref_in, block_idx, C, scale)
    assert rel_err(o, ro) < 1e-2
    check_lse(lse, rlse, 2e-2)
    g = torch.randn_like(o) if g is None else g
    grads = torch.autograd.grad(o, (q, k, v), g)
    rgrads = torch.autograd.grad(ro, ref_in, g.float())
    for name, x, r in zip("qkv", grads, rgrads):
        assert rel_err(x, r) < 2e-2, (name, rel_err(x, r))


def compare_with_oracle(o, lse, q, k, v, reference, tol, lse_tol, grad_lse=False):
    """A kernel's ``o, lse`` of ``q, k, v`` against ``reference(q64, k64, v64) -> (o, lse)`` on
    fp64 CPU copies: the forward (no NaN: poisoned outputs must all be written), then the
    gradients of ``sum(o * g)`` (plus ``sum(lse * w)`` over finite rows with ``grad_lse``).
    Returns the kernel's gradients."""
    ref_in = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ro, rlse = reference(*ref_in)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert not o.isnan().any() and not lse.isnan().any()
    assert rel_err(o, ro) < tol
    check_lse(lse, rlse, lse_tol)
    g = torch.randn_like(o)
    loss = (o.float() * g.float()).sum()
    rloss = (ro * g.double().cpu()).sum()
    if grad_lse:
        w = torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0)
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0) * w).sum()
        rloss = rloss + (rlse.masked_fill(torch.isneginf(rlse), 0) * w.double().cpu()).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    rgrads = torch.autograd.grad(rloss, ref_in)
    for name, x, r in zip("qkv", grads, rgrads):
        assert x.dtype == q.dtype and not x.isnan().any(), name
        assert rel_err(x, r) < tol * 4, (name, rel_err(x, r))
    return grads
