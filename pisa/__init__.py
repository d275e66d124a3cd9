"""PISA: block-sparse attention with log-linear pyramid block selection."""
import warnings as _warnings

with _warnings.catch_warnings():
    # torch without NumPy (PISA needs none) warns "Failed to initialize NumPy: No module named
    # 'numpy'" when first imported (torch 2.13, from torch/_subclasses/functional_tensor.py), so
    # every `import pisa` of a torch-only install printed it. Only that message is silenced: a
    # broken NumPy (e.g. "_ARRAY_API not found") still warns.
    _warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy: No module named",
                             category=UserWarning)
    import torch as _torch  # noqa: F401

from .api import (pisa_attn, pisa_attn_varlen, pisa_attn_with_kvcache, pisa_select,  # noqa: E402
                  pisa_select_varlen)
from .cache import PagedPisaCache, PisaCache  # noqa: E402
from .layers import PisaAttention  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = ["pisa_attn", "pisa_select", "pisa_attn_varlen", "pisa_select_varlen",
           "pisa_attn_with_kvcache", "PisaCache", "PagedPisaCache", "PisaAttention",
           "__version__"]
