"""Scheduler and worker adapters in separate processes against a real server: TP, MLA, PP."""

import secrets
import time

import torch

from lmcache_mp.client import (
    CacheClient,
    ParallelStrategy,
    SchedulerAdapter,
    SharedKVCache,
    TransferItem,
    WorkerAdapter,
    chunk_hashes,
)

from ..utils import ipc_url, run_server
from ..workers import MLA, MODEL, W2, Job, WorkerProcess, chunk_blocks, expected_blocks, rank_worker

NUM_BLOCKS = 8 * 16
SEED = 40


class Ranks:
    """One rank_worker process per rank of a TP × PP world: the ranks of engine `engine`."""

    def __init__(self, url, tp, pp, use_mla, shape, engine):
        self.ranks = [
            WorkerProcess(rank_worker, Job(url, NUM_BLOCKS, SEED, [], [], shape=shape,
                                           parallel=ParallelStrategy(use_mla, tp * pp, r, tp, pp),
                                           engine=engine))
            for r in range(tp * pp)]
        for rank in self.ranks:
            assert rank.receive() == "ready"

    def all(self, *command):
        for rank in self.ranks:
            rank.conn.send(command)

    def finished(self, expected):
        self.all("finished", expected)
        return [rank.receive() for rank in self.ranks]

    def blocks(self, rank, block_ids):
        self.ranks[rank].conn.send(("blocks", block_ids))
        return self.ranks[rank].receive()

    def close(self):
        for rank in self.ranks:
            rank.conn.send(("exit",))
            rank.process.join(30)
            assert rank.process.exitcode == 0
            rank.__exit__()


def tokens(tag, chunks=3):
    return [(tag * 131 + i) % 32000 for i in range(chunks * 256)]


HANG_S = 60.0  # waits for the server end only a hang: how long they take depends on the load


def lookup(scheduler, request_id, token_ids, salt=None):
    deadline = time.monotonic() + HANG_S
    while (hit := scheduler.lookup(request_id, token_ids, salt)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return hit


def flow(server, tp, pp, use_mla, shape):
    """A first request misses and stores; a second with the same prompt hits and loads.
    The scheduler's client and the ranks are one engine: they share its secret, so the
    ranks' RETRIEVEs consume the scheduler's holds and MLA followers join their leader."""
    engine = secrets.token_hex(16)
    ranks = Ranks(server.url, tp, pp, use_mla, shape, engine)
    try:
        with CacheClient(server.url, engine=engine) as client, \
                server.client(admin=True) as admin:
            scheduler = SchedulerAdapter(client, MODEL,
                                         ParallelStrategy(use_mla, tp * pp, 0, tp, pp))
            prompt = tokens(tp * 10 + pp)
            hashes = chunk_hashes(prompt, 256)
            source, target = chunk_blocks([0, 1, 2]), chunk_blocks([6, 4, 5])
            assert lookup(scheduler, "first", prompt) == 0
            ranks.all("store", [TransferItem.build("first", hashes, source)])
            assert all(done == {"store:first"} for done, _ in ranks.finished({"store:first"}))
            scheduler.end_session("first", None)

            assert lookup(scheduler, "second", prompt) == 3 * 256
            assert lookup(scheduler, "other-tenant", prompt, "tenant-b") == 0
            ranks.all("load", [TransferItem.build("second", hashes, target)])
            for done, errors in ranks.finished({"load:second"}):
                assert done == {"load:second"} and errors == set()
            for rank in range(tp * pp):
                # Without MLA each rank loads its own shard; with MLA a rank holds what its
                # TP leader stored.
                owner = rank - rank % tp if use_mla else rank
                assert torch.equal(ranks.blocks(rank, target),
                                   expected_blocks(NUM_BLOCKS, SEED + owner, source, shape))
            scheduler.end_session("second", None)
            stats = client.stats()
            assert len(stats.instances) == tp * pp  # an engine sees its own registrations
            assert stats.instances == admin.stats().instances  # and no other engine has any
            assert stats.leases_held == 0
            return {i.tp_rank * 100 + i.kv_worker_id: i for i in stats.instances}
    finally:
        ranks.close()


def test_tp2_without_mla_every_rank_stores_and_loads_its_own_shard():
    with run_server() as server:
        instances = flow(server, tp=2, pp=1, use_mla=False, shape=W2)
    assert len(instances) == 2
    assert all((i.stores, i.retrieves) == (1, 1) for i in instances.values())


def test_mla_tp2_only_the_leader_sends_and_the_follower_still_gets_the_bytes():
    with run_server() as server:
        instances = flow(server, tp=2, pp=1, use_mla=True, shape=MLA)
    leader, follower = instances[0], instances[100]
    assert (leader.stores, leader.retrieves, leader.loads_pushed) == (1, 1, 0)
    assert (follower.stores, follower.retrieves, follower.loads_pushed) == (0, 0, 1)


def test_mla_tp2_pp2_leaders_of_each_stage_send_for_their_group():
    with run_server() as server:
        instances = flow(server, tp=2, pp=2, use_mla=True, shape=MLA)
    assert len(instances) == 4
    for key, instance in instances.items():
        is_leader = instance.tp_rank == 0
        assert (instance.stores, instance.retrieves) == ((1, 1) if is_leader else (0, 0)), key
        assert instance.loads_pushed == (0 if is_leader else 1)


def test_an_unreachable_server_degrades_to_misses_skips_and_load_errors():
    url = ipc_url()
    parallel = ParallelStrategy(False, 1, 0, 1)
    with SharedKVCache("mha", 4, NUM_BLOCKS, 16, 2, 64) as cache, \
            CacheClient(url, timeout=0.5) as client:
        with run_server(url=url):
            adapter = WorkerAdapter(client, MODEL, parallel, load_timeout=0.5)
            client.rpc.timeout = 10  # a busy machine may take more than 0.5 s to register
            adapter.register_kv_cache(cache)
            client.rpc.timeout = 0.5  # from here on, a server that is gone must cost little
        scheduler = SchedulerAdapter(client, MODEL, parallel)
        prompt = tokens(7)
        hashes = chunk_hashes(prompt, 256)
        assert lookup(scheduler, "r", prompt) == 0
        adapter.start_store([TransferItem.build("r", hashes, chunk_blocks([0, 1, 2]))])
        adapter.start_load([TransferItem.build("r", hashes, chunk_blocks([3, 4, 5]))])
        deadline = time.monotonic() + HANG_S
        stores: set[str] = set()
        loads: set[str] = set()
        while not (stores and loads):
            assert time.monotonic() < deadline
            done_stores, done_loads = adapter.get_finished()
            stores |= done_stores
            loads |= done_loads
            time.sleep(0.01)
        assert adapter.get_block_ids_with_load_errors() == set(chunk_blocks([3, 4, 5]))

        with run_server(url=url):  # it comes back, and so do we, within a few stores
            deadline = time.monotonic() + HANG_S
            attempt = 0
            while lookup(scheduler, f"again-{attempt}", prompt) != 3 * 256:
                assert time.monotonic() < deadline, "the adapter did not recover"
                attempt += 1
                adapter.start_store([TransferItem.build(f"r{attempt}", hashes,
                                                        chunk_blocks([0, 1, 2]))])
                while not adapter.get_finished()[0]:
                    time.sleep(0.01)


def test_a_lookup_is_sent_once_and_its_answer_kept_until_forgotten():
    """vLLM asks about a waiting request every step: one LOOKUP, the same answer after it."""
    with run_server() as server, CacheClient(server.url) as client, \
            server.client(admin=True) as admin:
        scheduler = SchedulerAdapter(client, MODEL, ParallelStrategy(False, 1, 0, 1))
        prompt = tokens(8)
        before = admin.stats().requests.get("LOOKUP", 0)
        answers = [scheduler.lookup("w", prompt, None)]
        deadline = time.monotonic() + HANG_S
        while answers[-1] is None:  # the reply is on its way
            assert time.monotonic() < deadline, "no lookup answer"
            time.sleep(0.005)
            answers.append(scheduler.lookup("w", prompt, None))
        answers += [scheduler.lookup("w", prompt, None) for _ in range(20)]
        assert answers[-21:] == [0] * 21
        assert admin.stats().requests.get("LOOKUP", 0) - before == 1
        scheduler.forget("w")  # consumed: a later lookup (after a preemption) asks again
        assert lookup(scheduler, "w", prompt) == 0
        assert admin.stats().requests.get("LOOKUP", 0) - before == 2
        scheduler.end_session("w", None)
