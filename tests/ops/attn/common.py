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
