"""The model the vLLM tests' engines are configured with: its config.json, no weights."""

import json

import pytest

LAYERS = 4
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": LAYERS, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)
