"""Hugging Face transformers: ``attn_implementation="pisa"`` for Llama-family models.

After ``register()``, any model whose attention modules dispatch through transformers'
``AttentionInterface`` (Llama, Mistral, Qwen2, SmolLM2, ...) runs PISA when loaded or switched with
``attn_implementation="pisa"``, in prefill, chunked prefill and ``generate()`` alike::

    import pisa.integrations.hf as pisa_hf
    pisa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="pisa")
    model.config.pisa_topk = 16            # optional knobs, read at every call (see PISA_DEFAULTS)
    out = model.generate(ids, max_new_tokens=64,
                         cache=pisa_hf.PisaHFCache(model.config, max_cache_len=4096))

transformers hands the attention function ``query [B, HQ, Tq, D]`` and the full keys/values of its
cache ``[B, HKV, Tk, D]`` (post-RoPE). The queries are the last ``Tq`` of the ``Tk`` positions, which
is PISA's bottom-right causal alignment, so one ``pisa_attn`` call serves every phase. With
transformers' default ``DynamicCache`` a decode step re-selects over the whole cache: the pyramid
is rebuilt from the keys each step (O(N) per token). ``PisaHFCache`` instead keeps each layer in
a ``pisa.PisaCache`` whose pyramid is updated in place as tokens arrive, and attention goes through
``pisa_attn_with_kvcache`` (the O(log N) decode path).

Only plain causal attention over unpadded batches is supported: the mask function registered with
the attention raises on padding, packed sequences and custom masks rather than ignoring them.
Tested with transformers 5.24.0 (see ``docs/integrations.md``).
"""
from __future__ import annotations

import torch

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as e:  # transformers 4 has no CacheLayerMixin
    raise ImportError("pisa.integrations.hf needs transformers >= 5: "
                      "pip install 'transformers>=5'") from e

from ..api import pisa_attn, pisa_attn_with_kvcache
from ..cache import PisaCache
from ..ops.utils.config import SelectConfig

NAME = "pisa"
# PISA knobs read from the model config as ``config.pisa_<name>`` (e.g. ``config.pisa_topk``).
PISA_DEFAULTS = {"block_size": SelectConfig.block_size, "topk": SelectConfig.topk,
                 "branching": SelectConfig.branching, "beam": None, "beam_leaf": None,
                 "scorer": SelectConfig.scorer, "selector": SelectConfig.selector,
                 "forced_in_budget": SelectConfig.forced_in_budget,
                 "query_tile": SelectConfig.query_tile, "tile_reduce": SelectConfig.tile_reduce,
                 "backend": "auto"}


def pisa_knobs(config) -> dict:
    """The ``pisa_attn`` keyword arguments of a model: ``config.pisa_<name>`` or the default."""
    return {name: getattr(config, f"pisa_{name}", default)
            for name, default in PISA_DEFAULTS.items()}


def pisa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function (the ``AttentionInterface`` signature).

    Arguments:
        module: the calling attention module; its ``config`` carries the PISA knobs.
        query: (batch, nheads, seqlen_q, headdim), post-RoPE.
        key, value: (batch, nheads_k, seqlen_k, headdim): the whole cache including the new
            tokens; the queries are its last ``seqlen_q`` positions.
        attention_mask: must be None (``pisa_mask`` returns None for unpadded causal batches and
            raises otherwise; a user-made 4D mask reaches here and is refused).
        scaling: softmax scale, default ``headdim ** -0.5``.
        dropout: must be 0 (attention dropout is not implemented).
        kwargs: ``pisa_cache`` (a ``pisa.PisaCache``, put there by ``PisaHFCache.update``) routes
            the call through ``pisa_attn_with_kvcache``; the rest is ignored.

    Returns:
        (out (batch, seqlen_q, nheads, headdim), None): no attention weights exist to return.
    """
    if attention_mask is not None:
        raise ValueError("attn_implementation='pisa' got an explicit attention mask "
                         f"{tuple(attention_mask.shape)}; only unpadded causal attention is "
                         "supported (pass a 2D all-ones attention_mask or none)")
    if dropout:
        raise ValueError(f"attn_implementation='pisa' has no attention dropout, got {dropout}")
    if not getattr(module, "is_causal", True) or kwargs.get("sliding_window") is not None:
        raise ValueError("attn_implementation='pisa' supports full causal attention only, not "
                         "bidirectional or sliding-window layers")
    knobs = pisa_knobs(module.config)
    cache = kwargs.get("pisa_cache")
    if cache is None:
        out = pisa_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        scale=scaling, **knobs)
        return out, None
    # PisaHFCache already appended the new keys (and their pyramid sums) in its update()
    if (cache.block_size, cache.branching) != (knobs["block_size"], knobs["branching"]):
        raise ValueError(f"PisaHFCache was built with block_size={cache.block_size}, branching="
                         f"{cache.branching} but the config asks for {knobs['block_size']}, "
                         f"{knobs['branching']}")
    del knobs["block_size"], knobs["branching"]
    return pisa_attn_with_kvcache(query.transpose(1, 2), cache, scale=scaling, **knobs), None


def pisa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
              kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
              **kwargs) -> None:
    """transformers mask function (the ``AttentionMaskInterface`` signature): build no mask.

    PISA applies the causal (bottom-right) mask itself, so no ``[Tq, Tk]`` mask is made. Raises
    ``ValueError`` for anything it cannot honour: padding (zeros in the 2D ``attention_mask``), a
    cache whose slots are not exactly the seen tokens (a static cache), packed sequences or
    or/and-combined masks.
    """
    if mask_function is not None and mask_function is not causal_mask_function:
        raise ValueError("attn_implementation='pisa' supports plain causal masks only (no packed "
                         "sequences, no combined or custom mask functions)")
    if kv_offset != 0 or bool(kv_length != q_offset + q_length):
        raise ValueError(f"attn_implementation='pisa' needs the keys to be exactly the seen "
                         f"tokens ({q_offset} cached + {q_length} new), but the cache gives "
                         f"{kv_length} slots from offset {kv_offset} (a static or sliding cache?); "
                         "use the default DynamicCache or pisa.integrations.hf.PisaHFCache")
    if attention_mask is not None and not bool(attention_mask[:, -kv_length:].all()):
        raise ValueError("attn_implementation='pisa' does not support padded batches "
                         "(attention_mask has zeros); run sequences of different lengths one "
                         "at a time or pad-free")


def register() -> None:
    """Make ``attn_implementation="pisa"`` available to transformers (idempotent); the version
    check happens at import (transformers 4 lacks ``CacheLayerMixin``)."""
    AttentionInterface.register(NAME, pisa_attention_forward)
    AttentionMaskInterface.register(NAME, pisa_mask)


class PisaCacheLayer(CacheLayerMixin):
    """One layer of ``PisaHFCache``: a ``pisa.PisaCache`` preallocated to ``max_cache_len`` keys,
    created at the first ``update`` (batch size, heads, dtype and device from the keys)."""

    def __init__(self, max_cache_len: int, block_size: int = SelectConfig.block_size,
                 branching: int = SelectConfig.branching):
        super().__init__()
        self.max_cache_len, self.block_size, self.branching = max_cache_len, block_size, branching
        self.pisa: PisaCache | None = None
        self.length = 0  # tokens held, on the host: transformers asks for it every step

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.pisa = PisaCache(B, self.max_cache_len, H, D, block_size=self.block_size,
                              branching=self.branching, dtype=key_states.dtype,
                              device=key_states.device)
        self.batch_size, self.device = B, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states, value_states [B, HKV, L, D]`` (keys and pyramid, in place) and
        return views of all held keys and values ``[B, HKV, length, D]``. The attention's keyword
        arguments (``kwargs=`` of the transformers >= 5 attention modules) get ``pisa_cache`` so
        that ``pisa_attention_forward`` attends through the cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.length + new > self.max_cache_len:
            raise ValueError(f"PisaHFCache holds at most max_cache_len={self.max_cache_len} "
                             f"tokens, {self.length + new} needed")
        self.pisa.append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        self.length += new
        attention_kwargs = kwargs.get("kwargs")
        if isinstance(attention_kwargs, dict):
            attention_kwargs["pisa_cache"] = self.pisa
        return (self.pisa.k_cache[:, :self.length].transpose(1, 2),
                self.pisa.v_cache[:, :self.length].transpose(1, 2))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.pisa.reset()
        self.length = 0

    def offload(self):
        raise NotImplementedError("PisaHFCache does not offload")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PisaHFCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PisaHFCache cannot crop (no assisted decoding)")


class PisaHFCache(Cache):
    """A transformers ``Cache`` whose layers are ``pisa.PisaCache`` objects: decode steps update
    the key pyramid in O(log N) and attend through ``pisa_attn_with_kvcache`` (the fused Triton
    decode kernel on CUDA, ``decode_torch`` on CPU) instead of rebuilding the pyramid from all
    keys each step.

    Arguments:
        config: the model config (``num_hidden_layers``; ``pisa_block_size`` and
            ``pisa_branching`` as the attention reads them).
        max_cache_len: int. Tokens per sequence the cache can hold (prompt + new tokens);
            preallocated at the first forward.

    Pass it to ``generate(..., cache=PisaHFCache(model.config, max_cache_len))`` (``cache`` is
    ``past_key_values`` before transformers 5.2x) or to a forward call. Unpadded batches only;
    no beam search, cropping or offloading.
    """

    def __init__(self, config, max_cache_len: int):
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        knobs = pisa_knobs(config)
        super().__init__(layers=[PisaCacheLayer(max_cache_len, knobs["block_size"],
                                                knobs["branching"])
                                 for _ in range(config.num_hidden_layers)])
