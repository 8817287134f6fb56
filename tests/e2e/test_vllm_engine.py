"""Real vLLM engines through the connector: a prefix one engine process computed, loaded by
another from the server, gives the greedy tokens and logprobs of a cold run, exactly.

The reader's cold run of a prompt is the same prompt under a salt nobody used before: neither
the server nor vLLM's own prefix cache (which keys blocks by salt too) has anything for it.
"""

from __future__ import annotations

import random
import time

import pytest

from lmcache_mp.bench.vllm_engine import BatchResult, Completion, EngineProcess, Prompt

from ..utils import fresh_salt
from .conftest import CHUNK_SIZE, SYNC_LOAD_MAX_CHUNKS

# the first test also waits for the module's engines to start
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

VOCAB = 1024
MAX_TOKENS = 8


def tokens(count: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def run(engine: EngineProcess, *prompts: Prompt) -> list[Completion]:
    result: BatchResult = engine.generate(list(prompts), max_tokens=MAX_TOKENS)
    return result.completions


def cold(engine: EngineProcess, prompt: list[int]) -> Completion:
    return run(engine, Prompt(prompt, fresh_salt("e2e")))[0]


def wait_stored(admin, salt: str, chunks: int, timeout: float = 30.0) -> None:
    """Stores land after the request's forward pass: wait until the server holds them."""
    deadline = time.monotonic() + timeout
    while True:
        tenant = admin.stats().tenants.get(salt)
        stored = tenant.chunks if tenant else 0
        if stored >= chunks:
            return
        assert time.monotonic() < deadline, f"{salt}: {stored} of {chunks} chunks stored"
        time.sleep(0.05)


def tenant_hits(admin, salt: str) -> int:
    tenant = admin.stats().tenants.get(salt)
    return tenant.hits if tenant else 0


def retrieves(admin) -> int:
    return admin.stats().requests.get("RETRIEVE", 0)


def store_prefix(engine: EngineProcess, admin, prompt: list[int], salt: str) -> None:
    run(engine, Prompt(prompt, salt))
    wait_stored(admin, salt, len(prompt) // CHUNK_SIZE)


@pytest.mark.parametrize("chunks", [SYNC_LOAD_MAX_CHUNKS, SYNC_LOAD_MAX_CHUNKS + 1],
                         ids=["sync", "async"])
def test_loaded_prefix_gives_the_cold_output(engines, admin, chunks):
    """Loaded synchronously (the forward pass of the step that looks the request up reads
    it) or asynchronously (the request waits outside the batch): the cold run's output."""
    rng = random.Random(11 if chunks == SYNC_LOAD_MAX_CHUNKS else 16)
    prompt = tokens(chunks * CHUNK_SIZE + 17, rng)
    salt = fresh_salt("e2e")
    store_prefix(engines.writer, admin, prompt, salt)
    expected = cold(engines.reader, prompt)
    before = retrieves(admin)
    loaded = run(engines.reader, Prompt(prompt, salt))[0]
    assert retrieves(admin) > before, "the reader loaded nothing"
    assert tenant_hits(admin, salt) >= chunks
    assert loaded == expected
    # the writer computed the same, in another process
    assert run(engines.writer, Prompt(prompt, fresh_salt("e2e")))[0] == expected


def test_another_salt_loads_nothing(engines, admin):
    rng = random.Random(12)
    prompt = tokens(4 * CHUNK_SIZE + 5, rng)
    alice, bob = fresh_salt("e2e"), fresh_salt("e2e")
    store_prefix(engines.writer, admin, prompt, alice)
    before = retrieves(admin)
    as_bob = run(engines.reader, Prompt(prompt, bob))[0]
    assert retrieves(admin) == before
    assert tenant_hits(admin, bob) == 0
    as_alice = run(engines.reader, Prompt(prompt, alice))[0]
    assert retrieves(admin) > before
    assert as_alice == as_bob


def test_partial_prefix_loads_the_shared_chunks(engines, admin):
    rng = random.Random(13)
    stored = tokens(6 * CHUNK_SIZE + 9, rng)
    shared = 3 * CHUNK_SIZE
    prompt = stored[:shared] + tokens(2 * CHUNK_SIZE + 30, rng)
    salt = fresh_salt("e2e")
    store_prefix(engines.writer, admin, stored, salt)
    expected = cold(engines.reader, prompt)
    hits, before = tenant_hits(admin, salt), retrieves(admin)
    loaded = run(engines.reader, Prompt(prompt, salt))[0]
    assert retrieves(admin) > before
    assert tenant_hits(admin, salt) - hits == 3  # of the prompt's 5 full chunks
    assert loaded == expected


def test_batch_mixing_sync_and_async_hits_partial_hits_and_misses(engines, admin):
    rng = random.Random(14)
    salt = fresh_salt("e2e")
    whole, partial_source = tokens(4 * CHUNK_SIZE + 3, rng), tokens(4 * CHUNK_SIZE + 40, rng)
    long = tokens((SYNC_LOAD_MAX_CHUNKS + 2) * CHUNK_SIZE + 5, rng)  # loaded async
    for stored in (whole, partial_source, long):
        store_prefix(engines.writer, admin, stored, salt)
    batch = [whole, long, tokens(3 * CHUNK_SIZE + 11, rng),
             partial_source[:2 * CHUNK_SIZE] + tokens(CHUNK_SIZE + 7, rng),
             tokens(2 * CHUNK_SIZE + 50, rng)]
    expected = [cold(engines.reader, prompt) for prompt in batch]
    before = retrieves(admin)
    loaded = run(engines.reader, *(Prompt(prompt, salt) for prompt in batch))
    assert retrieves(admin) > before
    assert loaded == expected


def test_kv_of_other_weights_changes_the_output(engines, admin):
    """The impostor (other weights, same name in the keys) stores a prefix the reader loads:
    if loads were not used, or were recomputed, the reader's output would be the cold one."""
    rng = random.Random(15)
    prompt = tokens(5 * CHUNK_SIZE + 21, rng)
    salt = fresh_salt("e2e")
    store_prefix(engines.impostor, admin, prompt, salt)
    expected = cold(engines.reader, prompt)
    before = retrieves(admin)
    loaded = run(engines.reader, Prompt(prompt, salt))[0]
    assert retrieves(admin) > before
    assert loaded != expected
