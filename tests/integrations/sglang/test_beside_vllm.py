"""A vLLM engine and an SGLang engine on one server at once, each under its own salt.

The vLLM side is the project's vLLM connector path: its scheduler's SchedulerAdapter here,
its worker's WorkerAdapter in a process of its own (tests/workers.py rank_worker), sharing
the engine's secret. The SGLang side is SGLang's own radix cache with HiCache on
LMCacheMPStorage (radix.py). Both stay registered from the first store to the last load;
each loads its own bytes exactly, neither sees the other's salt, and the server's STATS
count both tenants."""

import secrets
import time

import torch

from lmcache_mp.client import CacheClient, ParallelStrategy, SchedulerAdapter, TransferItem
from lmcache_mp.client import chunk_hashes as vllm_chunk_hashes

from ...workers import (
    MODEL,
    W2,
    Job,
    WorkerProcess,
    chunk_blocks,
    expected_blocks,
    rank_worker,
)
from .radix import PAGE, Engine, prefetch_and_load, same, write_back

NUM_BLOCKS, SEED, CHUNK, CHUNKS, PAGES = 8 * 16, 70, 256, 3, 5
VLLM_SALT, SGLANG_SALT = "vllm-tenant", "sglang-tenant"
HANG_S = 60.0  # ends a hang only


def vllm_lookup(scheduler, request_id, tokens):
    deadline = time.monotonic() + HANG_S
    while (hit := scheduler.lookup(request_id, tokens, VLLM_SALT)) is None:
        assert time.monotonic() < deadline, "no LOOKUP reply"
        time.sleep(0.002)
    return hit


def vllm_step(rank, command, request_id, hashes, blocks):
    """The worker stores or loads one request's chunks; the step ends when it says so."""
    rank.conn.send((command, [TransferItem.build(request_id, hashes, blocks, VLLM_SALT)]))
    rank.conn.send(("finished", {f"{command}:{request_id}"}))
    done, load_errors = rank.receive(HANG_S)
    assert done == {f"{command}:{request_id}"} and load_errors == set()


def test_a_vllm_and_an_sglang_engine_store_and_load_on_one_server_each_under_its_salt(
        server, kit):
    secret = secrets.token_hex(16)
    one_rank = ParallelStrategy(False, 1, 0, 1)
    job = Job(server.url, NUM_BLOCKS, SEED, [], [], shape=W2, parallel=one_rank,
              engine=secret)
    vllm_tokens = [(SEED * 131 + i) % 32000 for i in range(CHUNKS * CHUNK)]
    hashes = vllm_chunk_hashes(vllm_tokens, CHUNK)
    source, target = chunk_blocks([0, 1, 2]), chunk_blocks([6, 4, 5])
    sglang = Engine(server.url, salt=SGLANG_SALT)
    sglang_tokens = kit.sequence(PAGES)
    with WorkerProcess(rank_worker, job) as rank, \
            CacheClient(server.url, engine=secret) as client, \
            server.client(admin=True) as admin:
        assert rank.receive(HANG_S) == "ready"
        scheduler = SchedulerAdapter(client, MODEL, one_rank)
        assert vllm_lookup(scheduler, "v-first", vllm_tokens) == 0
        vllm_step(rank, "store", "v-first", hashes, source)
        scheduler.end_session("v-first", VLLM_SALT)

        written = write_back(kit, sglang, sglang_tokens)
        models = {instance.model for instance in admin.stats().instances}
        assert MODEL in models and any(m.startswith("sglang:") for m in models)

        assert vllm_lookup(scheduler, "v-second", vllm_tokens) == CHUNKS * CHUNK
        vllm_step(rank, "load", "v-second", hashes, target)
        rank.conn.send(("blocks", target))
        assert torch.equal(rank.receive(HANG_S), expected_blocks(NUM_BLOCKS, SEED, source))
        scheduler.end_session("v-second", VLLM_SALT)

        _, matched, loaded = prefetch_and_load(kit, sglang, sglang_tokens, "s-load")
        assert matched == PAGES * PAGE and same(loaded, written.kv)
        # Salts apart: SGLang's pages are not found under vLLM's salt, nor vLLM's chunks
        # under SGLang's.
        stranger = Engine(server.url, salt=VLLM_SALT)
        assert prefetch_and_load(kit, stranger, sglang_tokens, "s-stranger")[1] == 0
        assert scheduler.lookup("v-stranger", vllm_tokens, SGLANG_SALT, wait_s=HANG_S) == 0

        tenants = admin.stats().tenants
        assert (tenants[VLLM_SALT].chunks, tenants[SGLANG_SALT].chunks) == (CHUNKS, PAGES)
        assert (tenants[VLLM_SALT].hits, tenants[SGLANG_SALT].hits) == (CHUNKS, PAGES)
        assert tenants[VLLM_SALT].bytes_used > 0 and tenants[SGLANG_SALT].bytes_used > 0
        rank.conn.send(("exit",))
        rank.process.join(HANG_S)
        assert rank.process.exitcode == 0
