"""Dense warm-up for training with PISA: switch every ``PisaAttention`` of a model (or a Hugging
Face model's attention implementation) between dense and sparse attention, and a schedule
saying which one a training step runs.

Peers warm sparse attention up densely (DeepSeek's DSA trains dense first); a dense phase lets
the projections (and a layer's gated branches, which run in both modes) learn before the
selection starts dropping blocks. Switching keeps every weight: ``attn`` only picks the core.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..ops.utils.config import check_nonnegative_int
from .attention import ATTN_MODES, PisaAttention


# A Hugging Face model's attention implementation for each mode (``set_attn_mode``).
HF_IMPLEMENTATIONS = {"dense": "sdpa", "pisa": "pisa"}


def set_attn_mode(model: nn.Module, mode: str) -> int:
    """Set ``attn`` of every ``PisaAttention`` in ``model`` (itself included) to ``mode``, or
    switch a Hugging Face model between ``attn_implementation`` "sdpa" and "pisa".

    Arguments:
        model: an ``nn.Module`` holding at least one ``PisaAttention``, or a transformers model
            whose ``config._attn_implementation`` is "pisa" or "sdpa" (``pisa.integrations.hf``
            registered): ``set_attn_implementation`` is called when the mode changes.
        mode: ``"dense"`` (exact causal SDPA with the same weights) or ``"pisa"``.

    Returns:
        int, the number of layers set (a transformers model: ``config.num_hidden_layers``).

    Raises ``ValueError`` for another ``mode``, a model with neither (the switch would silently
    do nothing) or ``mode="dense"`` on a context-parallel layer (``cp_group``: always sparse);
    ``TypeError`` if ``model`` is not a module. Layers are only changed once every one has been
    checked.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ATTN_MODES:
        raise ValueError(f"mode must be one of {ATTN_MODES}, got {mode!r}")
    layers = [m for m in model.modules() if isinstance(m, PisaAttention)]
    if not layers and _hf_switchable(model):
        if model.config._attn_implementation != HF_IMPLEMENTATIONS[mode]:
            model.set_attn_implementation(HF_IMPLEMENTATIONS[mode])
        return model.config.num_hidden_layers
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) holds no PisaAttention layer and is "
                         "not a transformers model running attn_implementation 'pisa' or 'sdpa'")
    if mode == "dense" and any(m.cp_group is not None for m in layers):
        raise ValueError("mode='dense' is not available to context-parallel PisaAttention "
                         "layers (cp_group): they always run pisa_attn_cp")
    for m in layers:
        m.attn = mode
    return len(layers)


def _hf_switchable(model: nn.Module) -> bool:
    """A transformers model that runs "pisa" or "sdpa" and can switch."""
    config = getattr(model, "config", None)
    return callable(getattr(model, "set_attn_implementation", None)) \
        and getattr(config, "_attn_implementation", None) in HF_IMPLEMENTATIONS.values()


@dataclass(frozen=True)
class DenseWarmup:
    """Train densely for the first ``dense_steps`` optimizer steps, then with PISA.

    Arguments:
        dense_steps: int >= 0. Steps ``0 .. dense_steps - 1`` run dense attention. Default 0:
            PISA from the first step (the library's behaviour without a schedule).

    Use in a training loop (``step`` counts from 0)::

        schedule = DenseWarmup(dense_steps=200)
        for step, batch in enumerate(loader):
            schedule.apply(model, step)        # an attribute write per layer: cheap
            loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
    """

    dense_steps: int = 0

    def __post_init__(self):
        check_nonnegative_int("dense_steps", self.dense_steps)

    def mode(self, step: int) -> str:
        """``"dense"`` for ``step < dense_steps``, else ``"pisa"`` (``step``: an int >= 0)."""
        check_nonnegative_int("step", step)
        return "dense" if step < self.dense_steps else "pisa"

    def apply(self, model: nn.Module, step: int) -> str:
        """Set every ``PisaAttention`` of ``model`` (or a transformers model's attention
        implementation) to ``mode(step)`` (``set_attn_mode``); returns that mode."""
        mode = self.mode(step)
        set_attn_mode(model, mode)
        return mode
