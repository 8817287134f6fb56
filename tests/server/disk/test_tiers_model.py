"""The CPU pool and the disk tier behave as one index, checked against a simple model.

A hypothesis state machine drives a real server whose pool holds two prompts and whose
disk holds every prompt the test stores: it stores prompts under a few salts, looks them
up with a hold while other prompts are stored (so the held chunks must stay), retrieves
them into a worker's cache in this process and compares every byte, clears salts and caps
one. The model is what an unbounded cache would answer; the server must answer the
same, whichever tier each chunk is in: complete chunks only, salts apart, held chunks
kept, and under a cap a prefix of the prompt (never a later chunk without the earlier).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmcache_mp.client import LookupItem, StoreStatus, TransferItem

from ...utils import run_server, wait_for
from ...workers import BLOCKS_PER_CHUNK, MODEL, W2, chunk_blocks, make_cache, prompt

CHUNKS = 3  # per prompt
CHUNK_BYTES = 512 * 1024
PROMPTS = 6
SALTS = ("a", "b", "c")
NUM_BLOCKS = 2 * CHUNKS * BLOCKS_PER_CHUNK  # a source half and a target half
SOURCE = chunk_blocks(list(range(CHUNKS)))
TARGET = chunk_blocks(list(range(CHUNKS, 2 * CHUNKS)))
RUNS = itertools.count()


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    """A server whose pool holds two prompts (3 MiB) and whose disk holds them all."""
    with run_server("--cpu-size", "3MiB", "--disk-dir", str(tmp_path_factory.mktemp("disk")),
                    "--disk-size", "64MiB", "--disk-prefetch-wait", "30") as server, \
            server.client(admin=True) as admin, server.client() as client, \
            make_cache(NUM_BLOCKS, None) as cache:
        registration = client.register_kv_cache(cache.handles(), model=MODEL,
                                                 layout=W2["layout"],
                                                 block_size=W2["block_size"])
        yield admin, client, cache, registration


def test_the_pool_and_the_disk_answer_as_one_unbounded_index(tiers):
    admin, client, cache, registration = tiers

    class Tiers(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            run = next(RUNS)  # every example gets salts and prompts of its own
            self.salts = {salt: f"run{run}-{salt}" for salt in SALTS}
            self.prompts = [prompt(tag=9000 + 100 * run + p, num_chunks=CHUNKS)
                            for p in range(PROMPTS)]
            self.stored: dict[tuple[str, int], int] = {}  # (salt, prompt) -> seed
            self.cap: dict[str, int] = {}  # salt -> chunks it may keep (on each tier)
            self.seeds = itertools.count(1)

        def fill(self, seed: int) -> None:
            generator = torch.Generator().manual_seed(seed)
            for layer in cache.layers:
                blocks = layer.view(torch.uint8)[:, SOURCE]
                layer.view(torch.uint8)[:, SOURCE] = torch.randint(
                    0, 256, blocks.shape, dtype=torch.uint8, generator=generator)

        @rule(salt=st.sampled_from(SALTS), p=st.integers(0, PROMPTS - 1))
        def store(self, salt: str, p: int) -> None:
            seed = self.stored.get((salt, p), next(self.seeds))
            self.fill(seed)
            item = TransferItem.build("s", self.prompts[p], SOURCE, self.salts[salt])
            (statuses,) = client.store(registration, [item])
            kept = {StoreStatus.STORED, StoreStatus.ALREADY_STORED}
            if salt in self.cap:  # a prompt longer than the cap keeps its first chunks
                kept |= {StoreStatus.OVER_QUOTA, StoreStatus.NO_PREFIX}
            assert set(statuses) <= kept, list(statuses)
            self.stored[(salt, p)] = seed
            wait_for(lambda: admin.stats().disk_queue_chunks == 0, "the disk tier's queue")

        @rule(salt=st.sampled_from(SALTS), p=st.integers(0, PROMPTS - 1),
              flood=st.integers(0, PROMPTS - 1))
        def lookup_hold_then_retrieve(self, salt: str, p: int, flood: int) -> None:
            """A held prompt survives another salt's prompt stored between the LOOKUP and
            the RETRIEVE, though the pool has room for two prompts only."""
            hashes = self.prompts[p]
            (hit,) = client.lookup(MODEL, 1, [LookupItem.build("h", hashes, self.salts[salt],
                                                               hold=True)])
            want = CHUNKS if (salt, p) in self.stored else 0
            if salt in self.cap:
                assert hit <= min(want, self.cap[salt])
            else:
                assert hit == want
            other = SALTS[(SALTS.index(salt) + 1) % len(SALTS)]
            if other not in self.cap:
                self.store(other, flood)
            for layer in cache.layers:
                layer.view(torch.uint8)[:, TARGET] = 0
            (retrieved,) = client.retrieve(registration, [TransferItem.build(
                "h", hashes[:hit], TARGET[:hit * BLOCKS_PER_CHUNK], self.salts[salt])])
            assert retrieved == hit
            if hit:
                blocks = hit * BLOCKS_PER_CHUNK
                landed = cache.blocks(TARGET[:blocks]).view(torch.uint8)
                self.fill(self.stored[(salt, p)])
                assert torch.equal(landed, cache.blocks(SOURCE[:blocks]).view(torch.uint8))

        @rule(salt=st.sampled_from(SALTS))
        def clear(self, salt: str) -> None:
            admin.clear(self.salts[salt])
            self.stored = {key: seed for key, seed in self.stored.items() if key[0] != salt}

        @precondition(lambda self: not self.cap)
        @rule(salt=st.sampled_from(SALTS), chunks=st.integers(1, 2 * CHUNKS))
        def cap_salt(self, salt: str, chunks: int) -> None:
            admin.quota_set(self.salts[salt], chunks * CHUNK_BYTES)
            self.cap[salt] = chunks

        @invariant()
        def disk_and_caps_agree(self) -> None:
            if not hasattr(self, "salts"):
                return
            tenants = admin.stats().tenants
            for salt, chunks in self.cap.items():
                figures = tenants.get(self.salts[salt])
                if figures is not None:
                    assert figures.disk_chunks <= chunks and figures.chunks <= chunks

        def teardown(self) -> None:
            if hasattr(self, "salts"):
                for salt in SALTS:
                    admin.clear(self.salts[salt])
                    admin.quota_delete(self.salts[salt])

    run_state_machine = Tiers.TestCase
    run_state_machine.settings = settings(max_examples=8, stateful_step_count=12,
                                          deadline=None,
                                          suppress_health_check=list(HealthCheck))
    run_state_machine().runTest()
