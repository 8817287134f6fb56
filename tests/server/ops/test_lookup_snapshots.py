"""LOOKUP's snapshot_workers against a real server, its chunks stored by two kv workers in
processes of their own: worker 0's a prompt's run (each chunk after its parent), worker
1's snapshots at some of its chunks' ends (each a root, as the vLLM connector stores a
recurrent state). A hit ends at the last chunk of worker 0's run that worker 1 holds, the
same at once, sliced and held (and the held chunks are what the workers then RETRIEVE,
byte for byte); a LOOKUP that reads back from disk or pulls from L2 brings the run and
the snapshots the tier has, and counts its tiers by the same rule; bad snapshot_workers
are refused, and the server serves on."""

from __future__ import annotations

import secrets
from functools import partial

import pytest

from lmcache_mp.client import CacheClient, LookupItem, ParallelStrategy, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.protocol import LOOKUP_SLICE_PROBES, LookupRequest, pack_worker_ids

from ...redis_servers import redis_server
from ...utils import run_server, wait_for
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    WorkerProcess,
    chunk_blocks,
    expected_blocks,
    prompt,
    rank_worker,
)
from ..cache.test_snapshots import model_hit

NUM_BLOCKS = 12 * BLOCKS_PER_CHUNK
SEED = 70
SNAPSHOT = 1  # the kv worker whose chunks are snapshots


class Workers:
    """The two kv workers of one engine, each a rank_worker process."""

    def __init__(self, url: str, engine: str):
        self.ranks = [WorkerProcess(rank_worker, Job(url, NUM_BLOCKS, SEED, [], [],
                                                     parallel=ParallelStrategy(False, 2, r, 2),
                                                     engine=engine))
                      for r in range(2)]
        for rank in self.ranks:
            assert rank.receive() == "ready"

    def send(self, rank: int, command: str, items: list[TransferItem], request_id: str
             ) -> None:
        """A STORE or RETRIEVE of `items` by one rank, waited for."""
        worker = self.ranks[rank]
        worker.conn.send((command, items))
        worker.conn.send(("finished", {f"{command}:{request_id}"}))
        done, errors = worker.receive()
        assert done == {f"{command}:{request_id}"} and not errors

    def blocks(self, rank: int, block_ids: list[int]):
        self.ranks[rank].conn.send(("blocks", block_ids))
        return self.ranks[rank].receive()

    def close(self) -> None:
        for rank in self.ranks:
            rank.conn.send(("exit",))
            rank.process.join(30)
            assert rank.process.exitcode == 0


def store_pattern(workers: Workers, hashes: list[bytes], run: int, snapshots: set[int],
                  request_id: str) -> None:
    """Worker 0 stores chunks [0, run) of the prompt from slots [0, run); worker 1 the
    chunks `snapshots`, each a root, from the slot of its chunk."""
    workers.send(0, "store", [TransferItem.build(request_id, hashes[:run],
                                                 chunk_blocks(range(run)))], request_id)
    workers.send(SNAPSHOT, "store", [TransferItem.build(request_id, [hashes[c]],
                                                        chunk_blocks([c]))
                                     for c in sorted(snapshots)], request_id)


def lookup(client: CacheClient, hashes: list[bytes], snapshot: list[int], hold: bool = False,
           tiers: bool = False):
    item = LookupItem.build("reader", hashes, hold=hold)
    return client.rpc.call(LookupRequest(MODEL, 2, [item], tiers, pack_worker_ids(snapshot)))


@pytest.fixture
def engine() -> str:
    return secrets.token_hex(8)


def test_a_hit_ends_at_the_last_chunk_of_the_run_a_snapshot_worker_holds(engine):
    with run_server() as server, CacheClient(server.url, timeout=30, engine=engine) as client:
        workers = Workers(server.url, engine)
        try:
            hashes = prompt(tag=5100, num_chunks=6)
            store_pattern(workers, hashes, run=5, snapshots={1, 3, 5}, request_id="w")
            want = model_hit({0: 5}, {SNAPSHOT: {1, 3, 5}})
            assert want == 4
            assert lookup(client, hashes, []).hits == [0]  # chunk 0 has no snapshot
            assert lookup(client, hashes, [SNAPSHOT]).hits == [want]
            assert lookup(client, hashes, [0]).hits == [0]  # worker 1's own run: none
            # sliced: more than LOOKUP_SLICE_PROBES probes named, the same hit
            longer = hashes + prompt(tag=5101, num_chunks=LOOKUP_SLICE_PROBES // 2)
            assert lookup(client, longer, [SNAPSHOT]).hits == [want]
            assert lookup(client, longer, [SNAPSHOT], hold=True).hits == [want]
            assert client.stats().leases_held == 1

            # what the hold leased is what the workers read: worker 0 chunks [0, 4), worker
            # 1 the snapshot at chunk 3, into other slots, byte for byte
            target = chunk_blocks(range(6, 6 + want))
            workers.send(0, "load", [TransferItem.build("reader", hashes[:want], target)],
                         "reader")
            workers.send(SNAPSHOT, "load", [TransferItem.build(
                "reader", [hashes[want - 1]], chunk_blocks([11]))], "reader")
            assert client.stats().leases_held == 0
            assert workers.blocks(0, target).equal(
                expected_blocks(NUM_BLOCKS, SEED, chunk_blocks(range(want))))
            assert workers.blocks(SNAPSHOT, chunk_blocks([11])).equal(
                expected_blocks(NUM_BLOCKS, SEED + SNAPSHOT, chunk_blocks([want - 1])))
        finally:
            workers.close()


@pytest.mark.parametrize(("world", "packed", "says"), [
    (2, pack_worker_ids([2]), "kv worker id 2 is not below kv_world_size 2"),
    (2, pack_worker_ids([65535]), "kv worker id 65535 is not below kv_world_size 2"),
    (2, pack_worker_ids([1, 1]), "a kv worker id is named twice"),
    (2, pack_worker_ids([1, 0]), "every kv worker is named"),
    (1, pack_worker_ids([0]), "every kv worker is named"),
    (2, b"\x01", "`snapshot_workers`: length 1 is not a multiple of 2"),
    (2, pack_worker_ids(list(range(1000))), "2000 bytes, more than 2 kv worker ids"),
])
def test_bad_snapshot_workers_are_refused_and_the_server_serves_on(world, packed, says):
    with run_server() as server, CacheClient(server.url, timeout=30) as client:
        hashes = prompt(tag=5200, num_chunks=2)
        with pytest.raises(BadRequest, match=says):
            client.rpc.call(LookupRequest(MODEL, world, [LookupItem.build("r", hashes)],
                                          snapshot_workers=packed))
        assert client.lookup(MODEL, 2, [LookupItem.build("r", hashes)], None, [1]) == [0]


def disk_written(client: CacheClient, chunks: int) -> bool:
    return client.stats().disk_chunks_written >= chunks


def test_hits_read_back_from_disk_count_their_tiers_by_the_same_rule(tmp_path, engine):
    """A pool of 4 MiB holds 8 chunks of 512 KiB: the prompt's 4 chunks of each worker
    leave memory when two more prompts are stored; the disk tier reads them back."""
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                    "--disk-size", "64MiB", "--disk-prefetch-wait", "30") as server, \
            CacheClient(server.url, timeout=30, engine=engine) as client:
        workers = Workers(server.url, engine)
        try:
            hashes = prompt(tag=5300, num_chunks=4)
            store_pattern(workers, hashes, run=4, snapshots={0, 1, 2, 3}, request_id="a")
            wait_for(partial(disk_written, client, 8), "the prompt on disk")
            for tag in (5301, 5302):
                store_pattern(workers, prompt(tag=tag, num_chunks=4), run=4,
                              snapshots={0, 1, 2, 3}, request_id=f"w{tag}")
            # A chunk the disk tier is writing is held, and the read-back could not evict
            # it to make room: the prompt's chunks need the whole pool.
            wait_for(lambda: client.stats().disk_queue_chunks == 0, "the disk queue")
            reply = lookup(client, hashes, [SNAPSHOT], tiers=True)
            want = model_hit({0: 4}, {SNAPSHOT: {0, 1, 2, 3}})
            assert reply.hits == [want]
            (tiers,) = reply.hit_tiers
            assert tiers[1] > 0 and tiers[2] == 0 and sum(tiers) == want
            assert lookup(client, hashes, [SNAPSHOT], tiers=True).hit_tiers == [[want, 0, 0]]
        finally:
            workers.close()


def run_again_then_snapshots_read_back(client: CacheClient, workers: Workers, again: list[bytes],
                                       hit_tiers: list[int], counter: str) -> None:
    """Worker 0 stores the run of `again` in memory again; its LOOKUP then brings the two
    snapshots back from the tier (`counter`, a STATS field, counts those two alone)."""
    workers.send(0, "store", [TransferItem.build("b", again, chunk_blocks(range(4)))], "b")
    before = getattr(client.stats(), counter)
    reply = lookup(client, again, [SNAPSHOT], tiers=True)
    assert (reply.hits, reply.hit_tiers) == ([4], [hit_tiers])
    assert getattr(client.stats(), counter) - before == 2  # the two snapshots alone


def test_a_read_back_brings_the_run_and_the_snapshots_the_disk_has(tmp_path, engine):
    """After a restart memory is empty and the disk tier holds every chunk stored before:
    a prompt whose snapshots are at chunk 2 only is read back, worker 0's run and worker
    1's chunk 2 (a root), and hits 3; a prompt whose run worker 0 has stored again, in
    memory, and whose snapshots (at chunks 1 and 3) only the disk has, reads those back
    alone and hits 4. Both count as read back from disk."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    sparse, again = prompt(tag=5400, num_chunks=4), prompt(tag=5401, num_chunks=4)
    flags = ("--disk-dir", str(directory), "--disk-size", "64MiB",
             "--disk-prefetch-wait", "30")
    with run_server(*flags, runtime_dir=str(runtime)) as server, \
            CacheClient(server.url, timeout=30) as client:
        workers = Workers(server.url, engine)
        try:
            store_pattern(workers, sparse, run=4, snapshots={2}, request_id="a")
            store_pattern(workers, again, run=4, snapshots={1, 3}, request_id="b")
            wait_for(partial(disk_written, client, 5 + 6), "the prompts on disk")
        finally:
            workers.close()
    with run_server(*flags, runtime_dir=str(runtime)) as server, \
            CacheClient(server.url, timeout=30, engine=engine) as client:
        wait_for(lambda: client.stats().disk_loaded, "the disk index")
        workers = Workers(server.url, engine)
        try:
            reply = lookup(client, sparse, [SNAPSHOT], tiers=True)
            want = model_hit({0: 4}, {SNAPSHOT: {2}})
            assert (want, reply.hits, reply.hit_tiers) == (3, [3], [[0, 3, 0]])

            run_again_then_snapshots_read_back(client, workers, again, [0, 4, 0], "disk_hits")
            assert lookup(client, again, [SNAPSHOT], tiers=True).hit_tiers == [[4, 0, 0]]
        finally:
            workers.close()


def test_a_pull_from_l2_brings_the_run_and_the_snapshots_l2_has(engine):
    """Node A stores both prompts of the test above, and L2 takes them; node B, whose
    memory lacks them (of the second, worker 0 stores the run there again), pulls from L2
    what its LOOKUP counts: the run and the snapshots L2 holds, each a root."""
    sparse, again = prompt(tag=5500, num_chunks=4), prompt(tag=5501, num_chunks=4)
    with redis_server() as redis, \
            run_server("--l2", redis.url) as node_a, \
            run_server("--l2", redis.url, "--l2-prefetch-wait", "20") as node_b, \
            CacheClient(node_a.url, timeout=30) as a, \
            CacheClient(node_b.url, timeout=30, engine=engine) as client:
        writers = Workers(node_a.url, engine)
        try:
            store_pattern(writers, sparse, run=4, snapshots={2}, request_id="a")
            store_pattern(writers, again, run=4, snapshots={1, 3}, request_id="b")
            wait_for(lambda: a.stats().l2_chunks_written >= 5 + 6, "the prompts in L2")
        finally:
            writers.close()
        workers = Workers(node_b.url, engine)
        try:
            reply = lookup(client, sparse, [SNAPSHOT], tiers=True)
            assert (reply.hits, reply.hit_tiers) == ([3], [[0, 0, 3]])

            run_again_then_snapshots_read_back(client, workers, again, [0, 0, 4], "l2_hits")
        finally:
            workers.close()
