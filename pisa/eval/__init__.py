"""Selection-quality diagnostics and evaluation data (above the public API)."""
from .metrics import (SelectionScorer, captured_mass, dense_lse, output_rel_error,
                      recall_at_k, selection_report)
from .synthetic import structured_qkv

__all__ = ["SelectionScorer", "captured_mass", "dense_lse", "output_rel_error", "recall_at_k",
           "selection_report", "structured_qkv"]
