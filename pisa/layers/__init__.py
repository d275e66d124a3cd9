from .attention import PisaAttention, apply_rotary

__all__ = ["PisaAttention", "apply_rotary"]
