"""Launch configurations of the Triton kernels: the tuned defaults, and what a tuning script passes
instead (``launch=``) to the public launchers:

- ``attn.triton.attn_fwd_triton`` / ``attn_bwd_triton``: ``AttnLaunch``;
- ``select.triton.select_pyramid_triton``: ``SelectLaunch``;
- ``select.flat.select_flat_triton``: ``FlatSelectLaunch``;
- ``decode.triton.decode_triton`` takes its knobs as keywords (``num_splits``, ``num_warps``,
  ``num_stages``).

``launch=None`` is the defaults (the module's default instance, read at the call: tests swap it
for one test). Launch knobs change how the work is cut and scheduled, never the result, except
``SelectLaunch.residuals`` (see there). Sweep one with ``dataclasses.replace(AttnLaunch(),
fwd_warps=8)``.
"""
from __future__ import annotations

from dataclasses import dataclass

# Query rows (tokens; qmean tiles: a row a tile) whose (tile, parent) pairs share one leaf-stage
# grid row: chunks keep a group's rows close in memory (cache locality of their gathered rows).
# 1024: 10.2 ms vs 11.4 at 4096 for the default tiles at 128K (select_tune_h200.json).
LEAF_CHUNK = 1024


@dataclass(frozen=True)
class AttnLaunch:
    """Launch knobs of the sparse attention kernels. A program's rows are (query token, GQA head)
    pairs.

    Per-token selections: about ``rows // G`` tokens per tile (``attn.triton._tile_tokens``: a
    power of two, at least 2 tokens and 16 rows), so ``fwd_rows=128`` with ``G=16`` tiles 8
    tokens.

    Tile selections (``tile_*``): a forward / dQ program owns at most ``tile_fwd_rows`` /
    ``tile_dq_rows`` rows of one query tile (a larger tile is split over several programs) and at
    least ``tile_min_rows`` (a smaller tile is padded); a dK/dV step gathers ``tile_dkv_rows``
    rows (several small tiles, or a part of a large one).

    The defaults are the best of ``benchmarks/tuning/tile_tune.py`` on the H200 (config A at 128K,
    ``tile_tune_h200_*.json``): dK/dV wants small steps at 4 warps (32 rows: 31 ms per token,
    30 ms for 16-token tiles, against 52 / 54 ms at 64 rows and 8 warps). The per-token forward
    and dQ keep 64 rows: their programs walk the union of their tokens' selections, which the
    sweep's shared selections do not grow (128-row dQ looked 15% faster there and made the
    backward on real selections no faster, ``train_h200_qt1_128k_tuned.json``)."""

    fwd_rows: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 2
    dq_rows: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    dkv_rows: int = 32
    dkv_warps: int = 4
    dkv_stages: int = 2
    dkv_chunk: int = 2048  # most query tokens one dK/dV program handles; longer lists are split
    tile_fwd_rows: int = 128
    tile_fwd_warps: int = 8
    tile_fwd_stages: int = 2
    tile_dq_rows: int = 64
    tile_dq_warps: int = 4
    tile_dq_stages: int = 2
    tile_dkv_rows: int = 32
    tile_dkv_warps: int = 4
    tile_dkv_stages: int = 2
    # 32, not the 16 rows tl.dot needs: 16-row tiles gave wrong outputs on the H200 (see
    # ``attn.triton._tile_tokens``)
    tile_min_rows: int = 32


@dataclass(frozen=True)
class SelectLaunch:
    """Launch knobs of the pyramid selection kernels (``benchmarks/tuning/select_tune.py`` sweeps them).
    ``walk_stages`` / ``leaf_stages`` drop to 1 where 2 stages would pass
    ``triton_utils.SELECT_STAGE_SMEM`` of shared memory; ``leaf_rows`` (query rows a leaf-stage
    dot) shrinks where the ``[rows, g * C]`` fp32 accumulator would pass 16K elements (128
    registers a thread at 4 warps); ``leaf_chunk`` query tokens share one leaf-stage grid row
    (``LEAF_CHUNK``). ``residuals=False`` drops the 16-bit residuals of the node summaries and of
    ``qmean`` tiles' mean queries against 16-bit inputs (half the bytes the walk and the leaf
    stage move, a third of the walk's products), so near-equal candidates may rank otherwise than
    in fp32: not a pure launch knob."""

    walk_warps: int = 4
    walk_stages: int = 2
    leaf_warps: int = 4
    leaf_stages: int = 2
    leaf_rows: int = 128
    leaf_chunk: int = LEAF_CHUNK
    topk_warps: int = 4
    residuals: bool = True


@dataclass(frozen=True)
class FlatSelectLaunch:
    """Launch knobs of the flat selection scan: a program scores ``rows`` query rows (8 warps of
    16-row MMA tiles sharing each key load), of at most ``max_tiles`` selection rows (fewer where
    a tile has more rows; at least one tile)."""

    rows: int = 128
    max_tiles: int = 16
    warps: int = 8
    stages: int = 3
