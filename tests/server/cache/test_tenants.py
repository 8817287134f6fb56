"""Tenants (cache_salt) against a real server: isolation, caps, reservations, quota changes."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lmcache_mp.client import CacheClient, LeaseRef, LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest

from ...utils import run_server, started_process, wait_for
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    chunk_blocks,
    make_cache,
    prompt,
    run_all,
    store_worker,
)

MiB = 1024**2
CHUNK = 512 * 1024  # W2


@pytest.fixture
def cache():
    with make_cache(8 * BLOCKS_PER_CHUNK, 7) as c:
        yield c


def register(client, cache):
    return client.register_kv_cache(cache.handles(), model=MODEL, layout="mha", block_size=16)


def store(client, registration, salt, hashes, request_id="w"):
    slots = [i % 8 for i in range(len(hashes))]
    (statuses,) = client.store(registration, [TransferItem.build(
        request_id, hashes, chunk_blocks(slots), salt)])
    return list(statuses)


def admin(url, *args):
    return subprocess.run([sys.executable, "-m", "lmcache_mp", "quota", "--url", url,
                           *args], capture_output=True, text=True, timeout=30)


def test_two_tenants_with_the_same_prompt_never_see_each_other(cache):
    with run_server() as server, CacheClient(server.url, admin=True) as client:
        registration = register(client, cache)
        hashes = prompt(1, 3)
        assert store(client, registration, "alice", hashes) == [StoreStatus.STORED] * 3
        assert client.lookup(MODEL, 1, [LookupItem.build("r", hashes, "bob")]) == [0]
        assert client.lookup(MODEL, 1, [LookupItem.build("r", hashes, "")]) == [0]
        before = cache.blocks(chunk_blocks([5, 6, 7])).view(torch.uint8).clone()
        assert client.retrieve(registration, [TransferItem.build(
            "r", hashes, chunk_blocks([5, 6, 7]), "bob")]) == [0]
        assert torch.equal(cache.blocks(chunk_blocks([5, 6, 7])).view(torch.uint8), before)
        assert store(client, registration, "bob", hashes) == [StoreStatus.STORED] * 3

        client.lookup(MODEL, 1, [LookupItem.build("r", hashes, "alice", hold=True)])
        assert client.release([LeaseRef("r", "bob")]) == 0
        assert client.end_session("r", "bob") == 0
        assert client.stats().leases_held == 1
        assert client.clear("bob") == 3
        assert client.lookup(MODEL, 1, [LookupItem.build("q", hashes, "alice")]) == [3]
        tenants = client.stats().tenants
        assert tenants["alice"].chunks == 3
        assert "bob" not in tenants  # it holds nothing any more
        assert client.release([LeaseRef("r", "alice")]) == 3


def test_a_flooding_tenant_over_its_cap_evicts_only_itself_and_is_refused(cache):
    with run_server("--cpu-size", "8MiB", "--quota", "flood=2MiB") as server, \
            CacheClient(server.url, admin=True) as client:
        registration = register(client, cache)
        steady = prompt(10, 4)
        store(client, registration, "steady", steady)
        statuses = store(client, registration, "flood", prompt(11, 8))
        # After the first refused chunk, the rest could never be found: NO_PREFIX.
        assert statuses == ([StoreStatus.STORED] * 4 + [StoreStatus.OVER_QUOTA]
                            + [StoreStatus.NO_PREFIX] * 3)
        for n in range(5):
            store(client, registration, "flood", prompt(20 + n, 2))
        tenants = client.stats().tenants
        assert tenants["flood"].bytes_used <= 2 * MiB
        assert tenants["flood"].refused == 1 and tenants["flood"].evictions == 10
        assert tenants["steady"].evictions == 0
        assert client.lookup(MODEL, 1, [LookupItem.build("s", steady, "steady")]) == [4]


def test_a_tenant_inside_its_reservation_keeps_everything_under_a_flood(cache):
    with run_server("--cpu-size", "4MiB", "--quota", "steady=unlimited:2MiB") as server, \
            CacheClient(server.url, admin=True) as client:
        registration = register(client, cache)
        steady = prompt(30, 4)
        store(client, registration, "steady", steady)
        for n in range(12):
            assert store(client, registration, "flood", prompt(40 + n, 2)) == [
                StoreStatus.STORED] * 2
        assert client.lookup(MODEL, 1, [LookupItem.build("s", steady, "steady")]) == [4]
        stats = client.stats()
        assert stats.tenants["steady"].evictions == 0
        assert stats.tenants["flood"].evictions == 20
        assert stats.bytes_used <= stats.capacity_bytes


def test_quotas_change_at_run_time_through_the_admin_command(cache):
    with run_server("--cpu-size", "8MiB") as server, CacheClient(server.url, admin=True) as client:
        registration = register(client, cache)
        hashes = prompt(50, 6)
        store(client, registration, "t", hashes)
        result = admin(server.url, "set", "t", "1MiB")
        assert result.returncode == 0, result.stderr
        assert "'t': cap 1.0MiB, reserve 0B, using 1.0MiB (own quota)" in result.stdout
        assert client.lookup(MODEL, 1, [LookupItem.build("q", hashes, "t")]) == [2]
        assert client.stats().tenants["t"].evictions == 4
        assert "cap 1.0MiB" in admin(server.url, "get", "t").stdout
        listing = admin(server.url, "list").stdout
        assert "default cap: unlimited" in listing and "'t': cap 1.0MiB" in listing
        assert "(default)" in admin(server.url, "delete", "t").stdout
        assert client.quota_get("t").cap is None

        refused = admin(server.url, "set", "t", "1MiB:2MiB")
        assert refused.returncode == 1 and "exceeds cap" in refused.stderr
        refused = admin(server.url, "set", "t", "unlimited:9MiB")
        assert refused.returncode == 1 and "reservations add up to" in refused.stderr
        refused = admin(server.url, "set", "has space", "1MiB")
        assert refused.returncode == 1 and "cache_salt" in refused.stderr
        with pytest.raises(BadRequest, match="must not be negative"):
            client.quota_set("t", -1)
        assert client.quota_get("t").own is False


def test_the_admin_command_takes_both_quota_forms_and_says_each_error_once():
    with run_server("--cpu-size", "8MiB") as server:
        words: tuple[str, ...]
        for words in (("2MiB", "1MiB"), ("2MiB:1MiB",)):
            result = admin(server.url, "set", "t", *words)
            assert result.returncode == 0, result.stderr
            assert result.stdout == "'t': cap 2.0MiB, reserve 1.0MiB, using 0B (own quota)\n"
        refusals = {
            ("2MiB:1MiB", "1MiB"): "give the reservation once: 2MiB:1MiB 1MiB names it twice; "
                                   "write CAP:RESERVE or CAP RESERVE",
            ("1MiB", "2MiB"): "reservation 2MiB exceeds cap 1MiB",
            ("unlimited", "9MiB"): "quota for 't' refused: reservations add up to 9MiB, more "
                                   "than the 8MiB pool",
        }
        for words, why in refusals.items():
            result = admin(server.url, "set", "t", *words)
            assert (result.returncode, result.stdout) == (1, ""), words
            assert result.stderr == f"lmcache-mp-server quota: error: {why}\n"
        assert "cap 2.0MiB, reserve 1.0MiB" in admin(server.url, "get", "t").stdout
        # A wrong admin token: the refused HELLO is said once, not once per try.
        wrong = subprocess.run(
            [sys.executable, "-m", "lmcache_mp", "quota", "--url", server.url, "list"],
            capture_output=True, text=True, timeout=30,
            env={**os.environ, "LMCACHE_MP_ADMIN_TOKEN": "not-the-admin-token"})
        assert wrong.returncode == 1 and wrong.stdout == ""
        assert wrong.stderr.startswith("lmcache-mp-server quota: error: HELLO: the token is "
                                       "wrong; ")
        assert wrong.stderr.count("\n") == 1 and wrong.stderr.endswith("\n")


def test_the_quota_file_is_reloaded_on_sighup(cache, tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text('[quotas]\n"t" = "4MiB"\n')
    with run_server("--cpu-size", "8MiB", "--quota-file", str(path), "--log-level", "info"
                    ) as server, CacheClient(server.url, admin=True) as client:
        registration = register(client, cache)
        store(client, registration, "t", prompt(60, 6))
        assert client.quota_get("t").cap == 4 * MiB
        path.write_text('[quotas]\n"t" = "1MiB"\n')
        started_process(server).send_signal(signal.SIGHUP)
        wait_for(lambda: client.quota_get("t").cap == MiB, "the reload")
        assert client.stats().tenants["t"].bytes_used == MiB
        path.write_text('[quotas]\n"t" = "1MiB:2MiB"\n')
        started_process(server).send_signal(signal.SIGHUP)
        # Its error in the log says the reload was tried (and refused).
        wait_for(lambda: "quotas not reloaded" in server.output(), "the refusal")
        assert client.quota_get("t").cap == MiB  # the bad file changed nothing


@pytest.mark.parametrize("args,words", [
    (["--quota", "a=lots"], "invalid size"),
    (["--quota", "a=1MiB:2MiB"], "exceeds cap"),
    (["--quota", "a"], "SALT=CAP"),
    (["--default-quota", "-5"], "invalid size"),
    (["--quota", "has space=1MiB"], "cache_salt"),
    (["--cpu-size", "4MiB", "--quota", "a=unlimited:3MiB", "--quota", "b=unlimited:2MiB"],
     "reservations add up to"),
])
def test_bad_quota_flags_stop_the_server_with_a_clear_error(args, words):
    result = subprocess.run([sys.executable, "-m", "lmcache_mp.server", "--url",
                             "ipc:///tmp/lmcache-mp-never.sock", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert words in result.stderr


def test_concurrent_tenants_never_exceed_their_caps_or_the_pool():
    caps = ["t0=2MiB", "t1=1MiB", "t2=3MiB", "t3=1MiB"]
    args = ["--cpu-size", "6MiB"] + [flag for cap in caps for flag in ("--quota", cap)]
    with run_server(*args) as server, CacheClient(server.url, admin=True) as client:
        jobs = [Job(server.url, 8 * BLOCKS_PER_CHUNK, n, prompt(70 + n, 8),
                    chunk_blocks(range(8)), cache_salt=f"t{n}", request_id=f"r{n}")
                for n in range(4)]
        observed = []

        def watch():
            observed.append(client.stats())
            time.sleep(0.01)
        results = run_all(store_worker, jobs, while_waiting=watch)
        observed.append(client.stats())
        limits = {f"t{n}": int(caps[n].split("=")[1][:-3]) * MiB for n in range(4)}
        for stats in observed:
            assert stats.bytes_used <= stats.capacity_bytes
            for salt, tenant in stats.tenants.items():
                assert tenant.bytes_used <= limits[salt]
        # How far each concurrent STORE gets is the scheduler's: the caps (7 MiB) overbook
        # the pool (6 MiB), and a chunk inside another STORE's reservation cannot be
        # evicted. A STORE stops at its cap, or earlier only where the pool was full of such
        # reservations (NO_SPACE), never because of another tenant's cap.
        for n, (statuses,) in enumerate(results):
            stored = statuses.count(StoreStatus.STORED)
            assert statuses[:stored] == bytes(stored)  # a prefix, from the prompt's start
            assert stored <= limits[f"t{n}"] // CHUNK
            if stored < limits[f"t{n}"] // CHUNK:
                assert statuses[stored] == StoreStatus.NO_SPACE
        # One at a time, with no reservation in the way, each prompt fills its cap exactly:
        # what it lacks evicts other tenants' chunks.
        for n, job in enumerate(jobs):
            [(statuses,)] = run_all(store_worker, [job])
            assert (statuses.count(StoreStatus.STORED) + statuses.count(StoreStatus.ALREADY_STORED)
                    == limits[f"t{n}"] // CHUNK), (n, statuses)
            stats = client.stats()
            assert stats.bytes_used <= stats.capacity_bytes
            assert stats.tenants[f"t{n}"].bytes_used == limits[f"t{n}"]
