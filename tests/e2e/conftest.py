"""Real vLLM engines (vLLM's CPU build in .venv-engine), each in its own process, and one
server they share: started once for tests/e2e, since an engine takes 10-30 s to start here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from lmcache_mp.bench.vllm_engine import (
    EngineProcess,
    EngineSettings,
    TinyLlama,
    engine_python,
    write_model_with,
)
from lmcache_mp.client import CacheClient
from lmcache_mp.spawn import ServerProcess

from ..utils import run_server

CHUNK_SIZE = 64  # tokens: two of vLLM's CPU blocks (32)
CACHE_NAME = "e2e-tiny-llama"  # the connector's `model`: engines of both seeds share keys
# The reader loads a prefix of at most this many chunks synchronously and a longer one async
# (the connector's sync_load_max_bytes): one engine runs both paths, as a deployment does.
# Prompts stay at a few chunks: one of 721 tokens, loaded, gave the cold run's tokens with
# logprobs ~5e-7 off (vLLM's CPU attention sums the longer context in another order when
# it computes the tail over a loaded prefix), where 5 chunks match exactly.
SYNC_LOAD_MAX_CHUNKS = 4
ENGINE_MODEL = TinyLlama()  # the engines' shape: the defaults, as write_model_with writes them


def kv_bytes_per_token(shape: TinyLlama = ENGINE_MODEL) -> int:
    """K and V of every layer, float32 (the engines' dtype)."""
    return shape.layers * 2 * shape.kv_heads * (shape.hidden // shape.heads) * 4


@pytest.fixture(scope="package")
def python() -> str:
    found = engine_python()
    if found is None and not os.environ.get("CI"):
        pytest.skip("no .venv-engine with vLLM's CPU build: run scripts/bootstrap --vllm "
                    "(scripts/test does), or set LMCACHE_MP_ENGINE_PYTHON")
    assert found is not None, "CI runs scripts/bootstrap --vllm, which makes .venv-engine"
    return found


@pytest.fixture(scope="package")
def models(python, tmp_path_factory) -> dict[int, str]:
    """Two tiny Llamas of the same shape, with the weights of seed 1 and seed 2."""
    root = tmp_path_factory.mktemp("models")
    paths = {seed: root / f"seed{seed}" for seed in (1, 2)}
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(lambda seed: write_model_with(python, paths[seed], seed), paths))
    return {seed: str(path) for seed, path in paths.items()}


@dataclass
class Engines:
    server: ServerProcess
    writer: EngineProcess  # seed 1: computes and stores prefixes
    reader: EngineProcess  # seed 1, another process: loads them (sync up to 4 chunks, else async)
    impostor: EngineProcess  # seed 2 under the same cache name: stores KV of other weights


@pytest.fixture(scope="package")
def engines(python, models, tmp_path_factory) -> Iterator[Engines]:
    logs = tmp_path_factory.mktemp("engine-logs")
    with run_server("--chunk-size", str(CHUNK_SIZE), "--cpu-size", "256MiB") as server, \
            ExitStack() as stack:
        def engine(name: str, seed: int, **options) -> EngineProcess:
            settings = EngineSettings(models[seed], server_url=server.url, chunk_size=CHUNK_SIZE,
                                      cache_name=CACHE_NAME, **options)
            return stack.enter_context(EngineProcess(python, settings, logs / f"{name}.log"))

        sync_load_max_bytes = SYNC_LOAD_MAX_CHUNKS * CHUNK_SIZE * kv_bytes_per_token()
        started = Engines(server, engine("writer", 1),
                          engine("reader", 1, sync_load_max_bytes=sync_load_max_bytes),
                          engine("impostor", 2))
        for process in (started.writer, started.reader, started.impostor):
            process.wait_ready()
        yield started


@pytest.fixture(scope="package")
def admin(engines) -> Iterator[CacheClient]:
    with engines.server.client(admin=True, timeout=10.0) as client:
        yield client
