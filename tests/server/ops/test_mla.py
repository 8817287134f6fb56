"""MLA: only the TP leader stores and retrieves; the server fills every rank of its TP group."""

import secrets

import torch

from ...utils import run_server
from ...workers import (
    MLA,
    Job,
    WorkerProcess,
    chunk_blocks,
    expected_blocks,
    mla_follower_worker,
    mla_leader_worker,
    prompt,
)

NUM_BLOCKS = 8 * 16


def test_a_leaders_retrieve_lands_in_every_rank_and_followers_are_told():
    with run_server("--cpu-size", "64MiB") as server:
        hashes = prompt(200, 3)
        source, targets = chunk_blocks([0, 1, 2]), chunk_blocks([7, 5, 3])
        engine = secrets.token_hex(16)  # leader and follower: ranks of one engine
        follower_job = Job(server.url, NUM_BLOCKS, None, hashes, targets, request_id="gen-1",
                           engine=engine)
        with WorkerProcess(mla_follower_worker, follower_job) as follower, \
                WorkerProcess(mla_leader_worker, Job(server.url, NUM_BLOCKS, 9, hashes, source,
                                                     request_id="gen-1", engine=engine)) as leader:
            refusal = follower.receive()
            assert refusal is not None and "only the TP leader (tp_rank 0) sends STORE" in refusal
            leader.conn.send(targets)
            assert leader.receive() == [3]
            landed, follower_bytes = follower.receive()
            assert landed == 3
            assert torch.equal(follower_bytes, expected_blocks(NUM_BLOCKS, 9, source, MLA))
            with server.client(admin=True) as client:
                stats = client.stats()
            ranks = {i.tp_rank: i for i in stats.instances}
            assert (ranks[0].stores, ranks[0].retrieves, ranks[0].loads_pushed) == (1, 1, 0)
            assert (ranks[1].stores, ranks[1].retrieves, ranks[1].loads_pushed) == (0, 0, 1)
            assert stats.leases_held == 0
            assert leader.finish() == 0 and follower.finish() == 0
