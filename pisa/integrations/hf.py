"""Hugging Face transformers: ``attn_implementation="pisa"`` for Llama-family models.

After ``register()``, any model whose attention modules dispatch through transformers'
``AttentionInterface`` (Llama, Mistral, Qwen2, SmolLM2, ...) runs PISA when loaded or switched with
``attn_implementation="pisa"``, in prefill, chunked prefill and ``generate()`` alike::

    import pisa.integrations.hf as pisa_hf
    pisa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="pisa")
    model.config.pisa_topk = 16            # optional knobs, read at every call (see PISA_DEFAULTS)
    out = model.generate(ids, max_new_tokens=64,
                         past_key_values=pisa_hf.PisaHFCache(model.config, max_cache_len=4096))

transformers hands the attention function ``query [B, HQ, Tq, D]`` and the full keys/values of its
cache ``[B, HKV, Tk, D]`` (post-RoPE). The queries are the last ``Tq`` of the ``Tk`` positions, which
is PISA's bottom-right causal alignment, so one ``pisa_attn`` call serves every phase. With
transformers' default ``DynamicCache`` a decode step re-selects over the whole cache: the pyramid
is rebuilt from the keys each step (O(N) per token). ``PisaHFCache`` instead keeps each layer in
a ``pisa.PisaCache`` whose pyramid is updated in place as tokens arrive, and attention goes through
``pisa_attn_with_kvcache`` (the O(log N) decode path).

Padded batches (zeros in the 2D ``attention_mask``) and packed ones (``DataCollatorWithFlattening``:
``position_ids`` restarting inside a row, or its ``cu_seq_lens_q / _k`` and ``max_length_q / _k``
keyword arguments) run ``pisa_attn_varlen``: the mask function finds the sequences once per
forward (``PackedBatch``, one host sync) and every layer unpads, attends each sequence alone and
pads back (zeros at padding). Other custom masks raise rather than being ignored. Tested with
transformers 5.24.0 (see ``docs/integrations.md``).
"""
from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention.bias import causal_lower_right

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as e:  # transformers 4 has no CacheLayerMixin
    raise ImportError("pisa.integrations.hf needs transformers >= 5: "
                      "pip install 'transformers>=5'") from e

from ..api import pisa_attn, pisa_attn_varlen, pisa_attn_with_kvcache
from ..cache import PisaCache
from ..ops.utils.config import BEAM_LEAF, SCORER, TILE_REDUCE, SelectConfig, resolve_backend
from ..ops.utils.varlen import RowGather, inverse_rows

NAME = "pisa"
# The attribute on the keys PisaCacheLayer.update returns that names their pisa.PisaCache.
_CACHE_ATTR = "_pisa_cache"
# PISA knobs read from the model config as ``config.pisa_<name>`` (e.g. ``config.pisa_topk``).
PISA_DEFAULTS = {"block_size": SelectConfig.block_size, "topk": SelectConfig.topk,
                 "branching": SelectConfig.branching, "beam": None, "beam_leaf": BEAM_LEAF,
                 "beam_ref_len": None, "scorer": SCORER, "selector": SelectConfig.selector,
                 "forced_in_budget": SelectConfig.forced_in_budget,
                 "query_tile": None, "tile_reduce": TILE_REDUCE,
                 "backend": "auto", "layers": None}
# Knobs of the model, not of pisa_attn: ``layers`` (``config.pisa_layers``, ``pisa_layers_of``).
MODEL_KNOBS = ("layers",)


def pisa_knobs(config) -> dict:
    """The ``pisa_attn`` keyword arguments of a model: ``config.pisa_<name>`` or the default."""
    get = _pisa_getter(config)
    return {name: get(name, default)
            for name, default in PISA_DEFAULTS.items() if name not in MODEL_KNOBS}


def _pisa_getter(config):
    """``get(name, default)``: ``config.pisa_<name>``, else ``default``. Eager, the instance's own
    attribute, else the class's: read past transformers' ``__getattribute__`` hooks, which cost
    microseconds a name (most for a name the config lacks: an exception) where a decode step
    reads every knob in every layer, and only ever redirect transformers' own names. Traced,
    ``getattr`` (the compiler reads a config's attributes as constants, not its ``__dict__``)."""
    if torch.compiler.is_compiling():
        return lambda name, default: getattr(config, f"pisa_{name}", default)
    attrs = object.__getattribute__(config, "__dict__")
    known = _class_knobs(type(config))
    return lambda name, default: attrs.get(f"pisa_{name}", known.get(f"pisa_{name}", default))


@functools.cache
def _class_knobs(cls) -> dict:
    """The ``pisa_*`` attributes a config class (or a base) defines."""
    return {k: v for base in reversed(cls.__mro__) for k, v in vars(base).items()
            if k.startswith("pisa_")}


@dataclass(frozen=True)
class PackedBatch:
    """The sequences of a padded or packed batch, found once per forward by ``pisa_mask`` and
    handed to every layer as its ``attention_mask``: ``pisa_attn_varlen``'s arguments over the
    real tokens of the flattened ``[B * Tq]`` queries and ``[B * Tk]`` keys (``rows_q`` /
    ``rows_k``: their flat indices, ``inv_q`` / ``inv_k`` the inverse maps, -1 at padding;
    ``None`` when every token is real, as in packing)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    rows_q: torch.Tensor | None = None
    rows_k: torch.Tensor | None = None
    inv_q: torch.Tensor | None = None
    inv_k: torch.Tensor | None = None

    def host_bounds(self) -> tuple[list[int], list[int]]:
        """``cu_seqlens_q``, ``cu_seqlens_k`` as host lists, read once: the batch is handed to
        every layer, and each dense layer of a hybrid model walks its sequences on the host."""
        bounds = self.__dict__.get("_host_bounds")
        if bounds is None:
            bounds = (self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist())
            object.__setattr__(self, "_host_bounds", bounds)  # frozen: a cache, not a field
        return bounds


def _varlen_forward(query, key, value, packed: PackedBatch, attend, backend: str = "auto"):
    """``attend(q, k, v)`` of the flattened real tokens of ``query [B, HQ, Tq, D]``, ``key, value
    [B, HKV, Tk, D]`` (``[N, H, D]`` each, the sequences of ``packed`` one after another) back in
    the batch's layout: ``[B, Tq, HQ, D]``, zeros at padding. ``backend`` picks the gathers'."""
    B, _, Tq, _ = query.shape
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
               for x in (query, key, value))
    padded = packed.rows_q is not None
    if padded:  # gathers both ways (RowGather): no index_copy, no index_add in the backward
        gather = "triton" if resolve_backend(backend, q) == "triton" else "torch"
        q = RowGather.apply(q, packed.rows_q, packed.inv_q, gather)
        k, v = (RowGather.apply(x, packed.rows_k, packed.inv_k, gather) for x in (k, v))
    o = attend(q, k, v)
    if padded:  # zeros at padding
        o = RowGather.apply(o, packed.inv_q, packed.rows_q, gather)
    return o.view(B, Tq, *o.shape[1:])


def _pisa_varlen(packed: PackedBatch, scaling, knobs):
    """``attend`` for ``_varlen_forward``: ``pisa_attn_varlen`` over the sequences."""
    return lambda q, k, v: pisa_attn_varlen(q, k, v, packed.cu_seqlens_q, packed.cu_seqlens_k,
                                            packed.max_seqlen_q, packed.max_seqlen_k,
                                            scale=scaling, **knobs)


def _kwargs_batch(kwargs) -> PackedBatch | None:
    """transformers' flash-attention keyword arguments of a flattened batch
    (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), when all four are given."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if any(kwargs.get(n) is None for n in names):
        return None
    cu_q, cu_k, max_q, max_k = (kwargs[n] for n in names)
    return PackedBatch(cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))


# The last position_ids read (a weak reference, its version, the batch size) and what they told:
# every layer of a forward gets the same tensor, so reading them syncs once a forward.
_POSITIONS: list = [None, None, None]


def _positions_batch(position_ids, query, key) -> PackedBatch | None:
    """Packed rows told by ``position_ids [B or 1, T]`` alone (a position not one past the
    previous starts a sequence), as transformers' flash attention reads them: with a cache,
    transformers makes no packed-sequence mask. One host sync a forward (``_POSITIONS``); None
    without restarts, with a cache holding earlier tokens, or for one token."""
    T = query.shape[2]
    if position_ids is None or T == 1 or key.shape[2] != T or position_ids.shape[-1] != T:
        return None
    ref, key, seen = _POSITIONS
    key_now = (position_ids._version, query.shape[0])
    if ref is not None and ref() is position_ids and key == key_now:
        return seen
    pos = position_ids.expand(query.shape[0], -1)
    ids = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    seen = _packed_batch(ids) if bool(ids[:, -1].any()) else None
    _POSITIONS[:] = [weakref.ref(position_ids), key_now, seen]
    return seen


def pisa_layers_of(config) -> frozenset[int] | None:
    """``config.pisa_layers``, checked: None (default: every layer runs PISA) or the indices
    (``layer_idx``, in ``[0, num_hidden_layers)``) of the layers that run PISA, the others running
    exact dense attention, SDPA (hybrid models, as MoBA keeps some full-attention layers).
    ``TypeError`` / ``ValueError`` naming ``config.pisa_layers`` otherwise."""
    layers = _pisa_getter(config)("layers", None)
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple, set, frozenset,
                                                                   range)):
        raise TypeError(f"config.pisa_layers must be None or a list of layer indices, got "
                        f"{layers!r} ({type(layers).__name__})")
    layers = tuple(layers)
    return _checked_layers(layers, tuple(map(type, layers)),  # True == 1: the types too
                           getattr(config, "num_hidden_layers", None))


@functools.lru_cache(maxsize=64)
def _checked_layers(layers: tuple, types: tuple, n: int | None) -> frozenset[int]:
    """``pisa_layers_of``'s check of the indices, once per value (and their ``types``): every
    layer of every forward asks."""
    for i in layers:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"config.pisa_layers must hold int layer indices, got {i!r} "
                            f"({type(i).__name__}) in {list(layers)!r}")
        if i < 0 or (n is not None and i >= n):
            raise ValueError(f"config.pisa_layers must hold layer indices in [0, "
                             f"num_hidden_layers={n}), got {i} in {list(layers)!r}")
    return frozenset(layers)


def _runs_pisa(module) -> bool:
    """Whether ``config.pisa_layers`` lets ``module`` (an attention module with ``layer_idx``)
    run PISA."""
    layers = pisa_layers_of(module.config)
    if layers is None:
        return True
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int):
        raise ValueError(f"config.pisa_layers is set but {type(module).__name__} has no int "
                         f"layer_idx (got {idx!r}) to look up")
    return idx in layers


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling) -> torch.Tensor:
    """Dense attention of ``q [B, HQ, Tq, D]`` over ``k, v [B, HKV, Tk, D]`` (``Tq <= Tk``), the
    queries the last ``Tq`` positions (bottom-right causal), with no ``[Tq, Tk]`` mask: SDPA's
    ``is_causal`` for ``Tq == Tk``, none for one query, its lower-right causal bias between
    (which the flash and efficient kernels take as it is). GQA through ``enable_gqa``, K / V
    repeated per query head where no kernel of ``enable_gqa`` takes the call. ``[B, HQ, Tq, D]``."""
    Tq, Tk = q.shape[2], k.shape[2]
    bias = causal_lower_right(Tq, Tk) if 1 < Tq < Tk else None
    gqa = k.shape[1] != q.shape[1]
    # the bias's kernels take equal head counts, as does the only CUDA kernel of fp32 (efficient:
    # enable_gqa would fall back to the math kernel's [Tq, Tk] scores)
    if gqa and (bias is not None or (q.is_cuda and q.dtype == torch.float32)):
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        gqa = False
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, is_causal=1 < Tq == Tk, scale=scaling, enable_gqa=gqa)


def _sdpa_seqs(packed: PackedBatch, scaling):
    """``attend`` for ``_varlen_forward``: dense attention of each sequence alone (the sequence
    bounds read on the host once a forward, ``PackedBatch.host_bounds``; no mask across
    sequences)."""
    def attend(q, k, v):
        cu_q, cu_k = packed.host_bounds()
        outs = []
        for i in range(len(cu_q) - 1):
            if cu_q[i + 1] == cu_q[i]:  # a sequence without queries
                continue
            at_q, at_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            seq = (x[at].transpose(0, 1)[None] for x, at in ((q, at_q), (k, at_k), (v, at_k)))
            outs.append(_causal_sdpa(*seq, scaling)[0].transpose(0, 1))
        return torch.cat(outs) if outs else q.new_zeros(q.shape)
    return attend


def _sdpa_forward(query, key, value, packed, scaling):
    """Dense attention for a layer ``config.pisa_layers`` leaves dense, as transformers' sdpa
    but with no ``[Tq, Tk]`` mask (O(N) memory): each sequence of ``packed`` alone (padded or
    packed batches; zeros at padding), else bottom-right causal over the whole rows (prefill,
    chunked prefill, decode). ``(out [B, Tq, HQ, D], None)``."""
    if packed is not None:
        return _varlen_forward(query, key, value, packed, _sdpa_seqs(packed, scaling)), None
    return _causal_sdpa(query, key, value, scaling).transpose(1, 2), None


def _sdpa_slots(query, key, value, seqlens, scaling) -> torch.Tensor:
    """Dense attention of ``query [B, HQ, Tq, D]`` (the last ``Tq`` positions) over a static
    cache's slots ``key, value [B, HKV, T_max, D]`` of which each sequence holds its first
    ``seqlens[b]`` (an unpadded batch: all equal). Eager (the prompt's forward): the held keys, read
    on the host once. Compiled (a decode step, one query): every slot under a ``[B, 1, 1, T_max]``
    mask of the held ones, the GQA group folded into the query rows (SDPA's mask kernels take no
    ``enable_gqa``). ``[B, Tq, HQ, D]``."""
    B, HQ, Tq, D = query.shape
    if not torch.compiler.is_compiling():
        n = int(seqlens[0])
        return _causal_sdpa(query, key[:, :, :n], value[:, :, :n], scaling).transpose(1, 2)
    if Tq != 1:
        raise ValueError("a compiled step over PisaHFCache(static=True) attends one new token a "
                         f"sequence, got {Tq}")
    HKV = key.shape[1]
    held = torch.arange(key.shape[2], device=key.device) < seqlens[:, None].long()
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, HKV, HQ // HKV, D), key, value, attn_mask=held[:, None, None, :],
        scale=scaling)
    return out.reshape(B, HQ, 1, D).transpose(1, 2)


def pisa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function (the ``AttentionInterface`` signature).

    Arguments:
        module: the calling attention module; its ``config`` carries the PISA knobs. With
            ``config.pisa_layers`` (``pisa_layers_of``) a module whose ``layer_idx`` is not
            listed runs exact dense attention (SDPA, ``_sdpa_forward``: a hybrid model's dense
            layer).
        query: (batch, nheads, seqlen_q, headdim), post-RoPE.
        key, value: (batch, nheads_k, seqlen_k, headdim): the whole cache including the new
            tokens; the queries are its last ``seqlen_q`` positions.
        attention_mask: None (``pisa_mask``'s for unpadded causal batches) or a ``PackedBatch``
            (its for padded or packed ones: ``pisa_attn_varlen``); a user-made 4D mask reaches
            here and is refused.
        scaling: softmax scale, default ``headdim ** -0.5``.
        dropout: must be 0 (attention dropout is not implemented).
        kwargs: ``pisa_cache`` (a ``pisa.PisaCache``, put there by ``PisaHFCache.update``, or
            found on ``key`` when transformers does not hand the attention's kwargs to the
            cache) routes the call through ``pisa_attn_with_kvcache``; ``cu_seq_lens_q / _k`` with
            ``max_length_q / _k`` (all four) mark a flattened batch (``pisa_attn_varlen``), as do
            ``position_ids`` restarting inside a row (read as transformers' flash attention
            does, one host sync a forward, when no mask told the sequences); the rest is ignored.

    Returns:
        (out (batch, seqlen_q, nheads, headdim), None): no attention weights exist to return.
    """
    if attention_mask is not None and not isinstance(attention_mask, PackedBatch):
        raise ValueError("attn_implementation='pisa' got an explicit attention mask "
                         f"{tuple(attention_mask.shape)}; only unpadded causal attention is "
                         "supported (pass a 2D all-ones attention_mask or none)")
    packed = attention_mask if isinstance(attention_mask, PackedBatch) else _kwargs_batch(kwargs)
    if attention_mask is None and packed is None:
        packed = _positions_batch(kwargs.get("position_ids"), query, key)
    if dropout:
        raise ValueError(f"attn_implementation='pisa' has no attention dropout, got {dropout}")
    if not getattr(module, "is_causal", True) or kwargs.get("sliding_window") is not None:
        raise ValueError("attn_implementation='pisa' supports full causal attention only, not "
                         "bidirectional or sliding-window layers")
    cache = kwargs.get("pisa_cache")
    if cache is None:  # transformers that do not pass the attention's kwargs to the cache
        cache = getattr(key, _CACHE_ATTR, None)
    if not _runs_pisa(module):  # config.pisa_layers: a dense layer of a hybrid model
        if cache is not None and key.shape[2] == cache.max_seqlen:  # a static cache's slots
            return _sdpa_slots(query, key, value, cache.cache_seqlens, scaling), None
        return _sdpa_forward(query, key, value, packed, scaling)
    knobs = pisa_knobs(module.config)
    if packed is not None:
        if cache is not None:
            raise ValueError("attn_implementation='pisa' does not support padded or packed "
                             "batches with PisaHFCache; use the default DynamicCache")
        return _varlen_forward(query, key, value, packed, _pisa_varlen(packed, scaling, knobs),
                               knobs["backend"]), None
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


def _packed_ids(mask_function) -> torch.Tensor | None:
    """The ``[B, T]`` sequence ids of transformers' packed-sequence mask, else None: ``and_masks(
    causal, packed_sequence_mask_function(ids))`` where ``causal`` is ``causal_mask_function``
    (transformers 5.17) or ``remap_positions_for_packed_sequence(causal_mask_function, ...)``
    (5.24), recognised by its closures."""
    def cells(fn):
        return {name: cell.cell_contents for name, cell in
                zip(fn.__code__.co_freevars, fn.__closure__ or ())}
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = cells(mask_function).get("mask_functions", ())
    if len(parts) != 2 or not all(callable(p) for p in parts):
        return None
    causal, inner = parts
    remapped = getattr(causal, "__qualname__", "").startswith(
        "remap_positions_for_packed_sequence.") and causal_mask_function in cells(causal).values()
    if not (causal is causal_mask_function or remapped) \
            or not getattr(inner, "__qualname__", "").startswith("packed_sequence_mask_function."):
        return None
    return cells(inner).get("packed_sequence_mask")


def _cu_seqlens(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))


def _packed_batch(ids: torch.Tensor) -> PackedBatch:
    """The sequences of packed rows ``ids [B, T]`` (equal ids: one sequence; a row's first token
    starts one), flattened: every token is real."""
    B, T = ids.shape
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = start.flatten().nonzero().flatten()
    lens = torch.diff(first, append=first.new_tensor([B * T]))
    cu = _cu_seqlens(lens)
    longest = int(lens.max())  # the one host sync of the forward
    return PackedBatch(cu, cu, longest, longest)


def _padded_batch(mask_k: torch.Tensor, q_length: int) -> PackedBatch:
    """The real tokens of a padded batch (``mask_k [B, Tk]`` bool, the queries its last
    ``q_length`` columns): per row one sequence, its real queries the tail of its real keys."""
    mask_q = mask_k[:, -q_length:]
    lens_q, lens_k = mask_q.sum(1), mask_k.sum(1)
    longest = torch.stack([lens_q.max(), lens_k.max()]).tolist()  # the one host sync
    rows_q, rows_k = mask_q.flatten().nonzero().flatten(), mask_k.flatten().nonzero().flatten()
    return PackedBatch(_cu_seqlens(lens_q), _cu_seqlens(lens_k), *longest, rows_q, rows_k,
                       inverse_rows(rows_q, mask_q.numel()), inverse_rows(rows_k, mask_k.numel()))


def pisa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
              kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
              **kwargs) -> PackedBatch | None:
    """transformers mask function (the ``AttentionMaskInterface`` signature): build no mask.

    PISA applies the causal (bottom-right) mask itself, so no ``[Tq, Tk]`` mask is made: None for
    a plain causal batch; a ``PackedBatch`` (its sequences, one host sync) for a padded one
    (zeros in the 2D ``attention_mask``) or a packed one (transformers' packed-sequence mask,
    from ``position_ids`` restarting inside a row). Raises ``ValueError`` for anything it cannot
    honour: a cache whose slots are not exactly the seen tokens (a static cache), padding and
    packing at once, or other combined or custom mask functions. A ``kv_length`` tensor is a
    static ``PisaHFCache``'s (its layers count on the device): None, as its attention reads the
    cache itself.
    """
    if isinstance(kv_length, torch.Tensor):  # PisaHFCache(static=True): the seen tokens
        return _static_mask(mask_function, attention_mask)
    packed = None
    if mask_function is not None and mask_function is not causal_mask_function:
        packed = _packed_ids(mask_function)
        if packed is None:
            raise ValueError("attn_implementation='pisa' supports plain causal masks and packed "
                             "sequences only (no other combined or custom mask functions)")
    if kv_offset != 0 or bool(kv_length != q_offset + q_length):
        raise ValueError(f"attn_implementation='pisa' needs the keys to be exactly the seen "
                         f"tokens ({q_offset} cached + {q_length} new), but the cache gives "
                         f"{kv_length} slots from offset {kv_offset} (a static or sliding cache?); "
                         "use the default DynamicCache or pisa.integrations.hf.PisaHFCache")
    padded = attention_mask is not None and not bool(attention_mask[:, -kv_length:].all())
    if padded and packed is not None:
        raise ValueError("attn_implementation='pisa' does not support padded and packed "
                         "sequences in one batch")
    if padded:
        return _padded_batch(attention_mask[:, -kv_length:].bool(), q_length)
    return None if packed is None else _packed_batch(packed)


def _static_mask(mask_function, attention_mask: torch.Tensor | None) -> None:
    """``pisa_mask`` for a static ``PisaHFCache``, whose layers report the keys seen as a device
    tensor: no mask, and no value read in a compiled step (padding is refused when eager)."""
    if mask_function is not None and mask_function is not causal_mask_function:
        raise ValueError("PisaHFCache(static=True) supports plain causal masks only")
    if attention_mask is not None and not torch.compiler.is_compiling() \
            and not bool(attention_mask.all()):
        raise ValueError("PisaHFCache(static=True) does not support padded batches (zeros in "
                         "attention_mask)")
    return None


def register() -> None:
    """Make ``attn_implementation="pisa"`` available to transformers (idempotent); the version
    check happens at import (transformers 4 lacks ``CacheLayerMixin``)."""
    AttentionInterface.register(NAME, pisa_attention_forward)
    AttentionMaskInterface.register(NAME, pisa_mask)


class PisaCacheLayer(CacheLayerMixin):
    """One layer of ``PisaHFCache``: a ``pisa.PisaCache`` preallocated to ``max_cache_len`` keys,
    created at the first ``update`` (batch size, heads, dtype and device from the keys); with
    ``bounds`` (the config's scorer is "bound") it keeps the key bounds from the first append, so
    no decode step builds them (an O(max_cache_len) pass that a CUDA-graph capture cannot hold).
    ``static``: the compileable form (``PisaHFCache``'s ``static=True``)."""

    def __init__(self, max_cache_len: int, block_size: int = SelectConfig.block_size,
                 branching: int = SelectConfig.branching, bounds: bool = False,
                 static: bool = False):
        super().__init__()
        self.max_cache_len, self.block_size, self.branching = max_cache_len, block_size, branching
        self.bounds, self.is_compileable = bounds, static
        self.pisa: PisaCache | None = None
        # tokens held, on the host: transformers asks for it every step (not static: a compiled
        # step cannot change a host int without a recompile; the cache's device lengths tell)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.pisa = PisaCache(B, self.max_cache_len, H, D, block_size=self.block_size,
                              branching=self.branching, dtype=key_states.dtype,
                              device=key_states.device, bounds=self.bounds)
        self.batch_size, self.device = B, key_states.device
        if self.is_compileable and not torch.compiler.is_compiling():
            # fixed addresses: a CUDA-graphed step reads and writes them in place
            for x in (self.pisa.k_cache, self.pisa.v_cache, self.pisa.sums, self.pisa.mins,
                      self.pisa.maxs, self.pisa.cache_seqlens):
                if x is not None:
                    torch._dynamo.mark_static_address(x)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states, value_states [B, HKV, L, D]`` (keys and pyramid, in place) and
        return views of all held keys and values ``[B, HKV, length, D]``. The attention's keyword
        arguments (``kwargs=``, which transformers 5.24's attention modules pass) get
        ``pisa_cache``, and the returned keys carry it too (releases such as 5.17 pass no
        ``kwargs=``), so that ``pisa_attention_forward`` attends through the cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not self.is_compileable:
            if self.length + new > self.max_cache_len:
                raise ValueError(f"PisaHFCache holds at most max_cache_len={self.max_cache_len} "
                                 f"tokens, {self.length + new} needed")
            self.length += new
        self.pisa.append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        attention_kwargs = kwargs.get("kwargs")
        if isinstance(attention_kwargs, dict):
            attention_kwargs["pisa_cache"] = self.pisa
        # static: every slot, a shape that never changes (the attention reads the cache)
        held = slice(None) if self.is_compileable else slice(0, self.length)
        keys = self.pisa.k_cache[:, held].transpose(1, 2)
        # transformers releases whose attention modules call update(k, v, layer_idx) without their
        # keyword arguments (5.17 among them) hand these very views to the attention function,
        # which finds the cache on them (``_CACHE_ATTR``); without it every step would re-select
        # over the views through pisa_attn, O(N), on top of the cache's own upkeep
        setattr(keys, _CACHE_ATTR, self.pisa)
        return keys, self.pisa.v_cache[:, held].transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int | torch.Tensor, int]:
        """Keys seen after ``query_length`` more: an int, or for a static cache a device tensor
        (what tells ``pisa_mask`` that the slots are a static PISA cache's)."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens held: the host count, or for a static cache the first sequence's device length
        (0-dim, as transformers' ``StaticLayer`` answers; 0 before the first update)."""
        if not self.is_compileable:
            return self.length
        return self.pisa.cache_seqlens[0] if self.is_initialized else 0

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
        static: bool. The compileable form (default False), as transformers' ``StaticCache``:
            ``generate`` then compiles its decode steps (``torch.compile(mode="reduce-overhead")``,
            CUDA graphs; on CUDA by default, ``generation_config.compile_config`` to tune), and a
            compiled step appends and attends through the custom ops ``torch.ops.pisa.write_kv``
            and ``torch.ops.pisa.decode_step`` with no host sync and no recompile per token.
            Its layers return every slot (``[B, HKV, max_cache_len, D]``, a fixed shape) and
            count the tokens on the device; the capacity is then checked on the host on CPU
            (eager) and not on CUDA (a token past it is not written, and its sequence's decode
            step gives NaN rows), padding at the eager prefill only. A hybrid model's dense
            layers (``config.pisa_layers``) attend the held slots: in a compiled step under a
            ``[B, 1, 1, max_cache_len]`` mask.

    Pass it to ``generate(..., past_key_values=PisaHFCache(model.config, max_cache_len))`` (the
    keyword every transformers 5 release takes; 5.2x also names it ``cache``) or to a forward
    call. Unpadded batches only;
    no beam search, cropping or offloading.
    """

    def __init__(self, config, max_cache_len: int, static: bool = False):
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        if not isinstance(static, bool):
            raise TypeError(f"static must be a bool, got {static!r}")
        knobs = pisa_knobs(config)
        bounds = knobs["scorer"] == "bound" and knobs["selector"] in ("pyramid", "auto")
        super().__init__(layers=[PisaCacheLayer(max_cache_len, knobs["block_size"],
                                                knobs["branching"], bounds, static)
                                 for _ in range(config.num_hidden_layers)])


def cache_keyword(model) -> str:
    """The keyword of this transformers' forward for the cache: ``cache`` (5.2x) or
    ``past_key_values`` (5.17)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class PisaGraphDecoder:
    """Greedy decoding of a transformers causal LM (``attn_implementation="pisa"``) over a
    ``PisaHFCache``, where each step is one forward of one token read from, and written to,
    buffers at fixed addresses, so that it can run as one CUDA graph: the decode step at kernel
    speed that ``generate``'s Python loop does not reach (``docs/serving.md``).

    Arguments:
        model: the model, on its device.
        max_cache_len: int. Prompt + new tokens a call may hold.
        cuda_graph: bool. Capture the step in a CUDA graph (CUDA only; default True on CUDA):
            at the first call, after ``warmup`` eager steps (real steps of that sequence); later
            calls with the same batch size replay it. False: every step eager.
        warmup: int. Eager steps before the capture (default 2).

    ``generate(input_ids [B, T] int64, max_new_tokens, on_token=None)`` returns the new tokens
    ``[B, max_new_tokens]``: the argmax of each step's logits, as ``model.generate(...,
    do_sample=False, past_key_values=PisaHFCache(...))`` gives (no end-of-sequence stop, no
    logits processors, no padding). ``on_token(i)``, if given, runs on the host once token ``i``
    (0: the prefill's) is queued, never inside the capture: no sync is made for it (a callback
    that streams or times the tokens synchronises itself). The cache lives with the decoder: its
    buffers, and the graph's, are allocated once.
    """

    def __init__(self, model, max_cache_len: int, cuda_graph: bool | None = None,
                 warmup: int = 2):
        device = next(model.parameters()).device
        cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on CUDA, it is on {device}")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (eager steps before the capture), "
                             f"got {warmup!r}")
        self.model, self.device, self.cuda_graph, self.warmup = model, device, cuda_graph, warmup
        self.cache = PisaHFCache(model.config, max_cache_len)
        self.kw = {cache_keyword(model): self.cache, "use_cache": True, "logits_to_keep": 1}
        self.graph = self.batch = None

    def _buffers(self, B: int, n_new: int) -> None:
        """The step's static inputs and outputs: the token, its position, the tokens so far."""
        if self.batch == B and self.history.shape[1] >= n_new:
            return
        if self.graph is not None:
            raise ValueError(f"this decoder's graph was captured for batch {self.batch} and "
                             f"{self.history.shape[1]} new tokens; make a new decoder for batch "
                             f"{B} and {n_new}")
        self.batch = B
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self.history = torch.zeros(B, n_new, dtype=torch.long, device=self.device)
        self.col = torch.zeros(1, dtype=torch.long, device=self.device)

    def _emit(self, logits: torch.Tensor) -> None:
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        self.ids.copy_(nxt)
        self.history.index_copy_(1, self.col, nxt)
        self.col.add_(1)

    def _step(self) -> None:
        self._emit(self.model(input_ids=self.ids, position_ids=self.pos, **self.kw).logits)
        self.pos.add_(1)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 on_token=None) -> torch.Tensor:
        B, T = input_ids.shape
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if T + max_new_tokens > self.cache.get_max_length():
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceed "
                             f"max_cache_len={self.cache.get_max_length()}")
        self._buffers(B, max_new_tokens)
        self.cache.reset()
        self.col.zero_()
        self.pos.fill_(T)
        notify = on_token if on_token is not None else (lambda i: None)
        self._emit(self.model(input_ids=input_ids.to(self.device), **self.kw).logits)
        notify(0)
        n = 1  # tokens made
        if self.cuda_graph and self.graph is None and max_new_tokens - 1 > self.warmup:
            n = self._capture(notify)
        for i in range(n, max_new_tokens):
            self.graph.replay() if self.graph is not None else self._step()
            notify(i)
        return self.history[:, :max_new_tokens].clone()

    def _capture(self, notify) -> int:
        """``warmup`` eager steps on a side stream, then one step recorded (not run) and
        replayed; returns the tokens made (the prefill's, the steps')."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(1, self.warmup + 1):
                self._step()
                notify(i)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graph = graph
        graph.replay()  # the recorded step: capture runs nothing
        notify(self.warmup + 1)
        return self.warmup + 2
