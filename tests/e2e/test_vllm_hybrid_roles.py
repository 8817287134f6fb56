"""A hybrid model (a sliding-window layer beside a full-attention one) under vLLM's hybrid KV
cache manager, split into a prefill engine (kv_producer) and a decode engine (kv_consumer)
on one server: the decode engine loads what the prefill engine stored, every KV cache
group of it, and its output equals a cold run, tokens and logprobs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Literal

import pytest

from lmcache_mp.bench.vllm_engine import (
    EngineProcess,
    EngineSettings,
    Prompt,
    TinyLlama,
    write_model_with,
)
from lmcache_mp.client import CacheClient

from ..utils import fresh_salt, run_server
from .conftest import CHUNK_SIZE
from .test_vllm_engine import cold, retrieves, run, tenant_hits, tokens, wait_stored

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

WINDOW = 48  # tokens: the sliding layer's window, less than a chunk (64)
HYBRID = TinyLlama(sliding_window=WINDOW)  # layer 0 slides, layer 1 attends to everything


@dataclass
class Split:
    admin: CacheClient
    prefill: EngineProcess  # kv_producer: stores, never looks up
    decode: EngineProcess  # kv_consumer: loads, never stores


@pytest.fixture(scope="module")
def split(python, tmp_path_factory) -> Iterator[Split]:
    root = tmp_path_factory.mktemp("hybrid")
    write_model_with(python, root / "model", seed=3, shape=HYBRID)
    with run_server("--chunk-size", str(CHUNK_SIZE), "--cpu-size", "64MiB") as server, \
            ExitStack() as stack:
        def engine(role: Literal["kv_producer", "kv_consumer"]) -> EngineProcess:
            settings = EngineSettings(str(root / "model"), server_url=server.url,
                                      chunk_size=CHUNK_SIZE, cache_name="e2e-hybrid",
                                      kv_role=role)
            return stack.enter_context(EngineProcess(python, settings, root / f"{role}.log"))

        prefill, decode = engine("kv_producer"), engine("kv_consumer")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.wait_ready(), (prefill, decode)))
        admin = stack.enter_context(server.client(admin=True, timeout=10.0))
        yield Split(admin, prefill, decode)


def test_a_decode_engine_loads_the_prefill_engines_prompt_and_gives_the_cold_output(split):
    for engine in (split.prefill, split.decode):  # vLLM's two groups, HMA on
        assert engine.kv_cache["groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    rng = random.Random(31)
    prompt = tokens(3 * CHUNK_SIZE + 20, rng)
    salt = fresh_salt("e2e")
    split.prefill.generate([Prompt(prompt, salt)], max_tokens=1)
    wait_stored(split.admin, salt, 3 * 2)  # 3 chunks, each of both groups

    expected = cold(split.decode, prompt)
    hits, before = tenant_hits(split.admin, salt), retrieves(split.admin)
    loaded = run(split.decode, Prompt(prompt, salt))[0]
    assert retrieves(split.admin) > before, "the decode engine loaded nothing"
    assert tenant_hits(split.admin, salt) - hits == 3  # chunks the LOOKUP found (all groups)
    assert loaded == expected
    # the consumer stored nothing of its own runs, the producer looked nothing up
    assert split.admin.stats().tenants[salt].chunks == 3 * 2
    assert sum(t.chunks for name, t in split.admin.stats().tenants.items()
               if name != salt) == 0
