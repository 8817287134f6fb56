"""Faults with real processes: workers SIGKILLed in the middle of STOREs, RETRIEVEs and
holds, then the server stopped under load (SIGTERM), or killed (SIGKILL) and restarted.

Afterwards nothing is left behind (holds, registrations, descriptors, socket files), no
client call hung past its timeout, and every chunk a STORE acknowledged as STORED reads
back byte for byte.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from typing import Any

import pytest
import torch

from lmcache_mp import runtime
from lmcache_mp.client import LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.protocol import RetrieveRequest, StoreRequest

from ..utils import run_server, server_process, started_process, wait_for
from ..workers import BLOCKS_PER_CHUNK, MODEL, W2, chunk_blocks, prompt
from .agents import (
    Agent,
    Ref,
    connect,
    make,
    new_cache,
    open_fds,
    raw_bytes,
    register,
)

pytestmark = pytest.mark.slow

SLOTS = 16  # chunk-sized slots in each worker's cache
PER_ROUND = 8  # chunks one STORE carries
CALL_TIMEOUT_S = 2.0  # the workers' client timeout: no call may take longer
WORKER_TIMEOUT_S = 1.5
LEASE_TIMEOUT_S = 2.0
SHUTDOWN_TIMEOUT_S = 5.0
# Past a call's timeout or the shutdown's, what only a hang takes (a loaded machine may
# answer late by seconds).
HANG_S = 30.0
SERVER_ARGS = ["--cpu-size", "128MiB", "--worker-timeout", str(WORKER_TIMEOUT_S),
               "--lease-timeout", str(LEASE_TIMEOUT_S), "--shutdown-timeout",
               str(SHUTDOWN_TIMEOUT_S)]


CYCLE = 8  # rounds after which a worker's hashes repeat: at most 64 chunks each, no eviction


def round_hashes(tag: int, round_: int) -> list[bytes]:
    return prompt(tag * 1000 + round_ % CYCLE, PER_ROUND)


def round_slots(round_: int) -> list[int]:
    """The cache slots round r stores from (and retrieves into, in the worker's inbox)."""
    return [(round_ * PER_ROUND + i) % SLOTS for i in range(PER_ROUND)]


def start_worker(name: str, url: str, seed: int, agent: Agent | None = None) -> Agent:
    agent = agent or Agent(name)
    agent.send(setup_worker, url, seed)
    return agent


@pytest.fixture(scope="module", autouse=True)
def later_workers():
    """Worker processes for the second test, started with the module so that they boot
    while the first test waits for timeouts."""
    agents = {tag: Agent(f"later{tag}") for tag in (0, 1)}
    yield agents
    for agent in agents.values():
        agent.close()


def setup_worker(state, url: str, seed: int) -> None:
    connect(state, "c", url, timeout=CALL_TIMEOUT_S)
    make(state, "cache", SLOTS * BLOCKS_PER_CHUNK, seed, W2)
    make(state, "inbox", SLOTS * BLOCKS_PER_CHUNK, None, W2)
    register(state, "reg", "c", "cache")
    register(state, "inbox_reg", "c", "inbox")


def churn(state, tag: int, rounds: int, die: tuple[str, int] | None = None) -> dict:
    """Round after round: STORE PER_ROUND chunks, LOOKUP them with a hold, RETRIEVE them
    into the inbox and compare the bytes. Reports ("ack", round, [chunks STORED],
    instance_id) as STOREs are acknowledged (the id changes when the client registers again
    with a restarted server). die=(op, round): in that round, once the server holds that
    request (a STATS on the same connection was answered after it), SIGKILL this process.
    Stops early when the test sends "stop". Every call is timed; errors are counted, not
    raised."""
    client, conn, report = state["c"], state["conn"], state["report"]
    registration, inbox = state["reg"], state["inbox_reg"]
    summary: dict[str, Any] = {"rounds": 0, "errors": Counter(), "longest_call": 0.0,
                               "mismatches": []}
    told: list[str] = []

    def stop_asked() -> bool:
        if not told and conn.poll():
            told.append(conn.recv())  # "stop"
        return bool(told)

    def timed(fn, *args):
        if stop_asked():
            return None  # no more calls
        started = time.monotonic()
        try:
            return fn(*args)
        except LMCacheMPError as exc:
            summary["errors"][type(exc).__name__] += 1
            return None
        finally:
            summary["longest_call"] = max(summary["longest_call"], time.monotonic() - started)

    def vanish_during(request) -> None:
        assert die is not None
        pending = client.rpc.submit(request, timeout=30)
        client.stats()
        report(("dying", die[0], not pending.done()))
        os.kill(os.getpid(), signal.SIGKILL)

    for round_ in range(rounds):
        if stop_asked():
            break
        hashes, slots = round_hashes(tag, round_), round_slots(round_)
        store = [TransferItem.build(f"s{round_}", hashes, chunk_blocks(slots))]
        if die == ("STORE", round_):
            vanish_during(StoreRequest(registration.instance_id, store))
        statuses = timed(client.store, registration, store)
        if statuses is not None:
            report(("ack", round_, [i for i, status in enumerate(statuses[0])
                                    if status == StoreStatus.STORED],
                    registration.instance_id))
        hit = timed(client.lookup, MODEL, 1, [LookupItem.build(f"r{round_}", hashes, hold=True)])
        if die == ("LOOKUP", round_):  # with the hold taken, before any RETRIEVE
            report(("dying", "LOOKUP", True))
            os.kill(os.getpid(), signal.SIGKILL)
        load = [TransferItem.build(f"r{round_}", hashes, chunk_blocks(slots))]
        for layer in state["inbox"].layers:  # so that only this RETRIEVE can fill them
            layer.index_fill_(1, torch.tensor(chunk_blocks(slots)), 0)
        if die == ("RETRIEVE", round_):
            vanish_during(RetrieveRequest(inbox.instance_id, load))
        landed = timed(client.retrieve, inbox, load)
        if stop_asked():
            break
        if hit and landed:
            got = chunk_blocks(slots[:landed[0]])
            if raw_bytes(state["inbox"].blocks(got)) != raw_bytes(state["cache"].blocks(got)):
                summary["mismatches"].append(round_)
        summary["rounds"] += 1
    return summary


def expected_chunks(seed: int) -> list[bytes]:
    """Per slot, the bytes a worker seeded with `seed` stores from it."""
    with new_cache(SLOTS * BLOCKS_PER_CHUNK, seed, W2) as cache:
        return [raw_bytes(cache.blocks(chunk_blocks([slot]))) for slot in range(SLOTS)]


def acknowledged(agent: Agent, not_by: int | None = None) -> list[tuple[int, int]]:
    """(round, chunk) of every chunk the agent's STOREs got STORED for, except through
    registration `not_by` (one a killed server had)."""
    return [(report[1], chunk) for report in agent.progress
            if report[0] == "ack" and report[3] != not_by for chunk in report[2]]


def read_back(server, acked: dict[int, list[tuple[int, int]]], seeds: dict[int, int]) -> int:
    """RETRIEVE every acknowledged chunk, one by one, and compare it with its source bytes."""
    checked = 0
    with server.client(timeout=10) as reader, new_cache(BLOCKS_PER_CHUNK, None, W2) as target:
        registration = reader.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        for tag, chunks in acked.items():
            truth = expected_chunks(seeds[tag])
            for round_, chunk in chunks:
                hashes = round_hashes(tag, round_)
                target.layers[0].zero_()
                assert reader.retrieve(registration, [TransferItem.build(
                    "verify", hashes[chunk:chunk + 1], chunk_blocks([0]))]) == [1], \
                    (tag, round_, chunk)
                assert raw_bytes(target.blocks(chunk_blocks([0]))) == \
                    truth[round_slots(round_)[chunk]], (tag, round_, chunk)
                checked += 1
        reader.unregister(registration)
    return checked


def test_killed_workers_leave_nothing_behind_then_sigterm_under_load_drains():
    deaths = {0: ("STORE", 1), 1: ("RETRIEVE", 1), 2: ("LOOKUP", 1), 3: None}
    seeds = {tag: 500 + tag for tag in deaths}
    with run_server(*SERVER_ARGS) as server, server.client(admin=True) as admin:
        pid = started_process(server).pid
        admin.ping()  # connected: its descriptor in the server is part of the count
        fds_before = open_fds(pid)
        workers = {tag: start_worker(f"worker{tag}", server.url, seeds[tag]) for tag in deaths}
        try:
            for worker in workers.values():
                worker.result()
            for tag, worker in workers.items():
                worker.send(churn, tag, 3, deaths[tag])
            for tag, (op, _) in [(tag, death) for tag, death in deaths.items() if death]:
                dying = workers[tag].wait_progress(lambda value: value[0] == "dying")
                assert dying[1] == op
                assert workers[tag].wait_exit() == -signal.SIGKILL
            assert admin.stats().leases_held >= 1  # the hold of worker 2, dead after LOOKUP
            summary = workers[3].result()
            assert summary["rounds"] == 3 and summary["mismatches"] == []
            assert summary["errors"] == Counter()

            # Holds lapse at --lease-timeout, dead workers' registrations at --worker-timeout.
            survivor = workers[3]
            survivor.do("c", "unregister", Ref("reg"))
            survivor.do("c", "unregister", Ref("inbox_reg"))
            survivor.do("c", "close")  # now only the admin client is connected, as before
            wait_for(lambda: admin.stats().leases_held == 0, timeout=LEASE_TIMEOUT_S + 3,
                     what="every hold of a dead worker lapsed")
            wait_for(lambda: admin.stats().registrations == 0, timeout=WORKER_TIMEOUT_S + 3,
                     what="every dead worker's registration dropped")
            wait_for(lambda: open_fds(pid) <= fds_before, timeout=5,
                     what="the server back to its descriptors before the workers came")
            stats = admin.stats()
            assert stats.pending_stores == 0
            acked = {tag: acknowledged(worker) for tag, worker in workers.items()}
            assert all(acked[tag] for tag in deaths), acked  # each acked at least round 0
            # What the STORE that worker 0 died in committed is exact too, if anything.
            (visible,) = admin.lookup(MODEL, 1, [LookupItem.build("v", round_hashes(0, 1))])
            acked[0] += [(1, chunk) for chunk in range(visible)]
            checked = read_back(server, acked, seeds)
            assert checked == sum(len(chunks) for chunks in acked.values())
            assert stats.chunks >= checked

            # Under load: the survivor connects and registers again and churns; SIGTERM.
            survivor.progress.clear()
            survivor.run(connect, "c", server.url, timeout=CALL_TIMEOUT_S)
            survivor.run(register, "reg", "c", "cache")
            survivor.run(register, "inbox_reg", "c", "inbox")
            survivor.send(churn, 3, 10_000)
            survivor.wait_progress(lambda value: value[0] == "ack")
            started_process(server).send_signal(signal.SIGTERM)
            assert started_process(server).wait(SHUTDOWN_TIMEOUT_S + HANG_S) == 0
            assert not (server.runtime_dir / "server.sock").exists()
            assert not (server.runtime_dir / "fd.sock").exists()
            time.sleep(0.5)  # the survivor meets the stopped server
            survivor.conn.send("stop")
            summary = survivor.result(wait=4 * CALL_TIMEOUT_S + 10)
            assert summary["mismatches"] == []
            assert summary["longest_call"] < CALL_TIMEOUT_S + HANG_S, summary  # none hung
            assert set(summary["errors"]) <= {"ShuttingDown", "RequestTimeout",
                                              "ServerUnavailable"}, summary
        finally:
            for worker in workers.values():
                worker.close()


def test_a_killed_server_leaves_its_socket_files_until_cleaned_and_a_restart_serves_again(
        tmp_path, later_workers):
    runtime_dir = tmp_path / "rt"
    server = server_process(None, ["--log-level", "warning", *SERVER_ARGS],
                           runtime_dir=str(runtime_dir))
    server.start()
    workers = {tag: start_worker(f"worker{tag}", server.url, 600 + tag, agent)
               for tag, agent in later_workers.items()}
    try:
        for worker in workers.values():
            worker.result()
        killed_ids = {}
        for tag, worker in workers.items():
            worker.send(churn, tag, 10_000)
            killed_ids[tag] = worker.wait_progress(lambda value: value[0] == "ack")[3]
        started_process(server).kill()
        assert started_process(server).wait(10) == -signal.SIGKILL
        # A killed server unlinks nothing: its socket files are left behind.
        assert (runtime_dir / "server.sock").is_socket() and (runtime_dir / "fd.sock").is_socket()
        time.sleep(CALL_TIMEOUT_S + 0.5)  # the workers' calls time out meanwhile
        runtime.unlink_ipc_endpoint(server.url)
        assert not (runtime_dir / "server.sock").exists()

        # A new server on the same runtime directory replaces the stale fd.sock; the workers
        # carry on without being told: HELLO again, register again.
        restarted = server_process(None, ["--log-level", "warning", *SERVER_ARGS],
                                  runtime_dir=str(runtime_dir))
        restarted.start()
        try:
            for tag, worker in workers.items():
                worker.wait_progress(lambda value, killed=killed_ids[tag]: value[0] == "ack"
                                     and value[3] != killed, wait=30)
                worker.conn.send("stop")
            summaries = [worker.result(wait=30) for worker in workers.values()]
            for summary in summaries:
                assert summary["mismatches"] == []
                assert summary["longest_call"] < CALL_TIMEOUT_S + HANG_S, summary  # none hung
                assert summary["errors"]["RequestTimeout"] >= 1, summary  # it saw the outage
            for tag, worker in workers.items():  # one whole round more: both caches in use
                summary = worker.run(churn, tag, 1)
                assert (summary["rounds"], summary["errors"]) == (1, Counter()), summary
            with restarted.client(admin=True) as admin:
                assert admin.stats().registrations == 4  # both workers, both caches, again
            acked = {tag: acknowledged(worker, not_by=killed_ids[tag])
                     for tag, worker in workers.items()}
            assert read_back(restarted, acked, {0: 600, 1: 601}) == sum(map(len, acked.values()))
            for worker in workers.values():
                worker.do("c", "unregister", Ref("reg"))
                worker.do("c", "unregister", Ref("inbox_reg"))
            with restarted.client(admin=True) as admin:
                assert admin.stats().registrations == 0
        finally:
            assert restarted.close() == 0
        assert not (runtime_dir / "server.sock").exists()
        assert not (runtime_dir / "fd.sock").exists()
    finally:
        for worker in workers.values():
            worker.close()
        server.close()
