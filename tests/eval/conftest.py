"""Tiny random-weight models saved to disk (safetensors and a byte tokenizer), so the eval
commands run end to end through ``--model PATH``: a Llama (4 query / 2 KV heads) and a
Qwen2-shaped model with a GQA group of 7 (7 query heads on 1 KV head), nothing downloaded."""
import pytest

# name -> (kind, shape): head dim 16 both
TINY = {"llama": ("llama", dict(hidden_size=64, num_heads=4, num_kv_heads=2)),
        "qwen2_gqa7": ("qwen2", dict(hidden_size=112, num_heads=7, num_kv_heads=1))}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """``{name: directory}`` of the ``TINY`` models, saved once a session."""
    pytest.importorskip("transformers", minversion="5.0")
    from pisa.eval.model import save_random_model
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_random_model(str(root / name), kind, seed=i, **shape)
            for i, (name, (kind, shape)) in enumerate(TINY.items())}


@pytest.fixture(params=list(TINY))
def tiny_model_dir(request, tiny_model_dirs):
    return tiny_model_dirs[request.param]
