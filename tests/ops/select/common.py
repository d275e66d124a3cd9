"""Inputs and comparisons shared by the Triton selection tests."""
import pytest
import torch


def inputs(B, Tk, Tq, HKV, G, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, HKV * G, D, generator=gen).to(dtype)
    k = torch.randn(B, Tk, HKV, D, generator=gen).to(dtype)
    return q, k


def assert_same(got, want, what=""):
    """Both ``(block_idx, counts)`` selections equal, row by row (the first differing row shown)."""
    (gi, gc), (wi, wc) = got, want
    gi, gc, wi, wc = gi.cpu(), gc.cpu(), wi.cpu(), wc.cpu()
    assert gi.shape == wi.shape and gc.shape == wc.shape, (gi.shape, wi.shape)
    assert gi.dtype == gc.dtype == torch.int32
    bad = ((gi != wi).any(-1) | (gc != wc)).nonzero().tolist()
    if bad:
        b, t, h = bad[0]
        pytest.fail(f"{what}: {len(bad)} (b, t, h) rows differ; first {(b, t, h)}: "
                    f"got {gi[b, t, h].tolist()} (count {int(gc[b, t, h])}), "
                    f"want {wi[b, t, h].tolist()} (count {int(wc[b, t, h])})")


def rows_equal(got, want) -> float:
    """Share of (b, t, h) rows whose block lists and counts are equal."""
    (gi, gc), (wi, wc) = got, want
    same = (gi.cpu() == wi.cpu()).all(-1) & (gc.cpu() == wc.cpu())
    return same.float().mean().item()
