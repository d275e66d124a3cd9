"""PISA: block-sparse attention with log-linear pyramid block selection."""
from .api import pisa_attn, pisa_attn_with_kvcache, pisa_select
from .cache import PisaCache
from .layers import PisaAttention

__version__ = "0.1.0"
__all__ = ["pisa_attn", "pisa_select", "pisa_attn_with_kvcache", "PisaCache", "PisaAttention",
           "__version__"]
