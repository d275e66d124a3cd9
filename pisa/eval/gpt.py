"""A small GPT whose attention is a switch: dense, PISA (pyramid selection), a flat selector, or
a peer library's sparse attention (fla's NSA).

Pre-norm decoder blocks: RMSNorm -> ``PisaAttention`` (RoPE, GQA; ``NSAAttention`` for the "nsa"
arm, the same projections and RoPE) -> residual, RMSNorm -> SwiGLU MLP -> residual; final
RMSNorm; the output head is the token embedding (tied).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import PisaAttention
from ..ops.utils.config import BEAM_LEAF, SelectConfig, query_tile_of
from .tasks import VOCAB_SIZE

# arm -> the selection knobs ``pisa_attn`` runs (dense attends to every causal key with SDPA):
# "pisa" the library defaults (selection v2: 16-token tiles, bound scorer, beam_leaf = 2 K),
# "pisa_qt1" the first wave's per-token walk, "pisa_mass" tiles ranked by their tokens' summed
# shares (``tile_reduce="mass"``, selection v3) under a beam of 16 whatever K, the flat selectors
# per token
PER_TOKEN = dict(query_tile=1, scorer="lse", tile_reduce="sum", beam_leaf=None)
ARMS = {"dense": None, "pisa": {}, "pisa_qt1": dict(PER_TOKEN),
        "pisa_mass": dict(tile_reduce="mass", beam=16),
        "flat_mean": dict(selector="flat_mean", query_tile=1),
        "flat_lse": dict(selector="flat_lse", query_tile=1),
        # the training recipes (``docs/training.md``): the defaults plus NSA-style gated branches,
        # a compressed one over the leaf blocks' means and a 2-block sliding window
        "pisa_cmp": dict(compressed=True), "pisa_cmp_win": dict(compressed=True, window=2)}
# PisaAttention's gated branches: an arm with one is never plain dense attention
BRANCHES = ("window", "compressed")
# the arms that select with the library's default walk (their level-2 beam follows ``set_beam``)
DEFAULT_WALK = ("pisa", "pisa_cmp", "pisa_cmp_win")
# Peer arms: another library's sparse attention in the same model. "nsa": fla's NSA
# (``pisa.eval.nsa_arm``; needs fla-core and a GQA group HQ / HKV = 16, 32, ...), ``topk``
# selected blocks of ``block_size`` keys, its gates, compressed branch and sliding window.
PEER_ARMS = ("nsa",)
ARM_NAMES = tuple(ARMS) + PEER_ARMS


def dense_within_budget(arm: str) -> bool:
    """Whether ``arm`` computes dense attention while ``T <= K * C`` (dense and the ``pisa_attn``
    arms: every block fits the budget), so a dense-trained start is its own start (the suite's
    shared stems). NSA is never dense: its gated compressed and window branches add to the
    selected attention at any length, as do the pisa arms' own branches (``BRANCHES``)."""
    return arm in ARMS and not any((ARMS[arm] or {}).get(name) for name in BRANCHES)


@dataclass
class GPTConfig:
    """Model shape and attention arm.

    arm: "dense" | "pisa" | "pisa_qt1" | "pisa_mass" | "flat_mean" | "flat_lse" | "pisa_cmp" |
        "pisa_cmp_win" | "nsa" ("pisa_cmp": the defaults with the compressed branch,
        "pisa_cmp_win": and a 2-block window branch, ``docs/training.md``). The
        sparse arms attend ``topk`` blocks of ``block_size`` keys per query (forced
        sink/previous/current blocks inside the budget); "pisa" finds them with the library's
        default walk (query tiles, bound scorer, ``beam_leaf=32``) at beam ``beam`` (default
        ``topk``), "pisa_qt1" with the first wave's per-token walk (``PER_TOKEN``),
        "pisa_mass" with 16-token tiles ranked by their tokens' summed softmax shares
        (``tile_reduce="mass"``, beam 16), the flat arms by scoring every causal block per
        token (mean key / exact LSE); "nsa" is fla's NSA (``pisa.eval.nsa_arm.NSAAttention``:
        ``topk`` is its ``block_counts``, with ``block_size`` and a 64-token window) and needs
        ``heads / kv_heads`` a power of two >= 16.
    head_dim: per-head width (default ``width // heads``): NSA's group of 16 query heads fits
        width 256 with ``head_dim=16``.
    backend: ``pisa_attn`` backend ("auto": Triton on CUDA, torch on CPU); for "nsa", "auto"
        is fla's ``parallel_nsa`` on CUDA and fla's naive reference on CPU ("triton" / "torch"
        force them).
    attn_kwargs: extra keyword arguments of the sparse arms' attention module, over the arm's
        knobs: ``PisaAttention`` (``pisa_attn`` knobs) for the pisa and flat arms,
        ``NSAAttention`` (e.g. ``window_size``) for "nsa"; refused for "dense".
    """

    vocab_size: int = VOCAB_SIZE
    width: int = 256
    depth: int = 4
    heads: int = 4
    kv_heads: int = 2
    mlp_hidden: int = 768
    head_dim: int | None = None
    rope_theta: float = 10000.0
    arm: str = "dense"
    topk: int = SelectConfig.topk
    block_size: int = SelectConfig.block_size
    beam: int | None = None
    backend: str = "auto"
    attn_kwargs: dict | None = None

    def __post_init__(self):
        if self.arm not in ARM_NAMES:
            raise ValueError(f"arm must be one of {ARM_NAMES}, got {self.arm!r}")
        if self.attn_kwargs is not None and not isinstance(self.attn_kwargs, dict):
            raise TypeError(f"attn_kwargs must be a dict or None, got {self.attn_kwargs!r}")
        if self.attn_kwargs and self.arm == "dense":
            raise ValueError(f"attn_kwargs {sorted(self.attn_kwargs)} apply to the sparse arms; "
                             "the dense arm takes none")


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        extra = cfg.attn_kwargs or {}
        self.attn_norm = nn.RMSNorm(cfg.width)
        if cfg.arm == "nsa":
            from .nsa_arm import NSAAttention  # imports fla: only this arm needs it
            self.attn = NSAAttention(cfg.width, cfg.heads, cfg.kv_heads, head_dim=cfg.head_dim,
                                     rope_theta=cfg.rope_theta, block_size=cfg.block_size,
                                     block_counts=cfg.topk, backend=cfg.backend, **extra)
        else:
            sparse = {} if cfg.arm == "dense" else dict(  # the arm's knobs over the config's
                topk=cfg.topk, block_size=cfg.block_size, beam=cfg.beam, backend=cfg.backend) \
                | ARMS[cfg.arm] | extra
            self.attn = PisaAttention(cfg.width, cfg.heads, cfg.kv_heads, head_dim=cfg.head_dim,
                                      rope_theta=cfg.rope_theta,
                                      attn="dense" if cfg.arm == "dense" else "pisa", **sparse)
        self.mlp_norm = nn.RMSNorm(cfg.width)
        self.mlp = SwiGLU(cfg.width, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """``forward(ids [B, T] int64) -> logits [B, T, vocab_size]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.RMSNorm(cfg.width)
        self.apply(self._init)
        for block in self.blocks:  # residual branches scaled down with depth (GPT-2)
            for out in (block.attn.o_proj, block.mlp.down):
                nn.init.normal_(out.weight, std=0.02 / (2 * cfg.depth) ** 0.5)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def set_sparse(self, sparse: bool) -> None:
        """Sparse arms: attend sparsely (``True``) or densely (``False``, the dense warm-up).
        The dense arm is always dense."""
        if self.cfg.arm != "dense":
            mode = "nsa" if self.cfg.arm == "nsa" else "pisa"
            for block in self.blocks:
                block.attn.attn = mode if sparse else "dense"

    def set_beam(self, beam: int | None) -> None:
        """The pisa arms' walk beam from now on (``None``: ``topk``); the level-2 beam of the
        arms on the default walk (``DEFAULT_WALK``) follows at twice it (its default ratio;
        ``None``: the default); the flat arms ignore it."""
        if self.cfg.arm.startswith("pisa"):
            for block in self.blocks:
                block.attn.pisa_kwargs["beam"] = beam
                if self.cfg.arm in DEFAULT_WALK:
                    block.attn.pisa_kwargs["beam_leaf"] = BEAM_LEAF if beam is None else 2 * beam

    def set_beam_ref_len(self, ref_len: int | None) -> None:
        """The pisa arms' beams grow past ``ref_len`` keys from now on (``beam_ref_len``;
        ``None``: fixed widths); the flat arms ignore it."""
        if self.cfg.arm.startswith("pisa"):
            for block in self.blocks:
                block.attn.pisa_kwargs["beam_ref_len"] = ref_len

    def selection_knobs(self) -> dict:
        """``query_tile`` and ``beam_leaf`` its selection runs with now (``set_beam`` moves the
        "pisa" arm's level-2 beam); None where they do not apply: dense, and the level-2 beam
        of the flat selectors and of the per-token walk (one beam); both None for nsa (fla's flat
        top-k per token)."""
        if self.cfg.arm in ("dense",) + PEER_ARMS:
            return {"query_tile": None, "beam_leaf": None}
        kw = self.blocks[0].attn.pisa_kwargs
        pyramid = kw.get("selector", "pyramid") == "pyramid"
        return {"query_tile": query_tile_of(kw.get("query_tile"), self.cfg.block_size),
                "beam_leaf": kw.get("beam_leaf", BEAM_LEAF) if pyramid else None}

    def set_context_parallel(self, group, layout: str = "zigzag") -> None:
        """Shard the sequence over the ranks of ``group`` from now on (``pisa.distributed``; the
        ``pisa_attn`` arms only): ``forward`` then takes this rank's shard of the ids
        (``pisa.distributed.shard``) and returns its rows of the logits. ``None`` turns it off."""
        if self.cfg.arm == "dense" or self.cfg.arm not in ARMS:
            raise ValueError("context parallelism needs a pisa_attn arm (pisa_attn_cp), got "
                             f"{self.cfg.arm!r}")
        for block in self.blocks:
            block.attn.cp_group, block.attn.cp_layout = group, layout

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)
