from .attention import PisaAttention, apply_rotary
from .schedule import DenseWarmup, set_attn_mode

__all__ = ["PisaAttention", "apply_rotary", "DenseWarmup", "set_attn_mode"]
