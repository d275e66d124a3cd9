"""PISA: block-sparse attention with log-linear pyramid block selection."""
from .api import pisa_attn, pisa_select
from .layers import PisaAttention

__version__ = "0.1.0"
__all__ = ["pisa_attn", "pisa_select", "PisaAttention", "__version__"]
