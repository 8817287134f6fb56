"""What the vLLM tests share: the model their engines are configured with (its config.json,
no weights), a real server per module, and test_vllm.py's Engines against it."""

import json

import pytest

from ..utils import run_server

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


@pytest.fixture(scope="module")
def server():
    with run_server("--lease-timeout", "30") as srv:
        yield srv


@pytest.fixture
def engines(model_dir, server):
    """make(**Engine options) -> an Engine against the module's server, closed after."""
    from .test_vllm import Engine  # it imports vLLM, for the CPU, its warnings silenced

    made = []

    def make(**kwargs) -> Engine:
        made.append(Engine(model_dir, server.url, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
