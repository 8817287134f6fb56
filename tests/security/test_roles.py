"""Spy and tamper: what one engine may see and do to another's state, what needs the admin
token, what a tcp:// endpoint asks of a client, and which start-ups the server refuses.

The outsider is a process running as `nobody` in `nogroup`, which the server lets connect
(--socket-group): it can read the engine token, not the admin token.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmcache_mp.client import CacheClient, LeaseRef, LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import Forbidden, RequestTimeout, Unauthenticated, UnknownInstance
from lmcache_mp.protocol import (
    ROLE_ADMIN,
    ROLE_ENGINE,
    RetrieveRequest,
    StoreRequest,
    UnregisterKVCacheRequest,
)

from ..utils import free_port, run_server
from ..workers import BLOCKS_PER_CHUNK, MLA, MODEL, W2, chunk_blocks, prompt
from .agents import (
    NOBODY,
    Ref,
    connect,
    group_server,
    make,
    new_cache,
    raw_bytes,
    register,
)

# The attackers run as nobody, and the server gives nogroup access: both need root.
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run a process as "
                                                           "nobody, and to chgrp)")
STORED = bytes([StoreStatus.STORED])
CHUNK_BYTES = 512 * 1024  # W2


@pytest.fixture(scope="module")
def server():
    with group_server("--cpu-size", "64MiB") as srv:
        yield srv


def register_here(client: CacheClient, cache):
    return client.register_kv_cache(cache.handles(), model=MODEL, layout=cache.layout,
                                    block_size=cache.block_size)


def call_refused(state, client: str, request):
    """A raw request on the agent's connection; returns the error's class and text."""
    try:
        return f"ANSWERED {state[client].rpc.call(request)}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def read_file(state, path: str) -> str:
    try:
        with open(path) as file:
            return f"READ {len(file.read())} characters"
    except OSError as exc:
        return type(exc).__name__


# ---------------------------------------------------------------------------
# Spying.

def test_an_engine_sees_no_tenant_and_no_other_engines_registrations(server, admin, outsider):
    outsider.run(connect, "spy", server.url, engine="engine-b")
    outsider.run(make, "spy_cache", 2 * BLOCKS_PER_CHUNK, 9, W2)
    spy_id = outsider.run(register, "spy_reg", "spy", "spy_cache")
    assert outsider.do("spy", "store", Ref("spy_reg"), [TransferItem.build(
        "b", prompt(60, 1), chunk_blocks([0]), "tenant-b")]) == [STORED]
    with server.client(engine="engine-a") as engine_a, \
            server.client(engine="engine-a") as engine_a_too, \
            new_cache(2 * BLOCKS_PER_CHUNK, 8, W2) as cache:
        registration = register_here(engine_a, cache)
        assert engine_a.store(registration, [TransferItem.build(
            "a", prompt(61, 2), chunk_blocks([0, 1]), "tenant-a")]) == [STORED * 2]

        spied = outsider.do("spy", "stats")
        assert spied.tenants == {} and [i.instance_id for i in spied.instances] == [spy_id]
        assert spied.chunks >= 3  # aggregates only
        for own in (engine_a.stats(), engine_a_too.stats()):  # the engine's, any connection
            assert own.tenants == {}
            assert [i.instance_id for i in own.instances] == [registration.instance_id]
        full = admin.stats()
        assert {"tenant-a", "tenant-b"} <= set(full.tenants)
        assert full.tenants["tenant-a"].bytes_used == 2 * CHUNK_BYTES
        assert {registration.instance_id, spy_id} <= {i.instance_id for i in full.instances}

        # Tampering with a registration it learnt the id of: it is not its connection's.
        victim_id = registration.instance_id
        item = TransferItem.build("t", prompt(62, 1), chunk_blocks([0]))
        for request in (StoreRequest(victim_id, [item]), RetrieveRequest(victim_id, [item]),
                        UnregisterKVCacheRequest(victim_id)):
            refusal = outsider.run(call_refused, "spy", request)
            assert refusal.startswith(f"UnknownInstance: no KV cache with instance_id "
                                      f"{victim_id}"), refusal
            with pytest.raises(UnknownInstance):  # not even the same engine's other connection
                engine_a_too.rpc.call(request)
        assert engine_a.store(registration, [TransferItem.build(
            "a2", prompt(63, 1), chunk_blocks([0]), "tenant-a")]) == [STORED]
        engine_a.unregister(registration)
    outsider.do("spy", "unregister", Ref("spy_reg"))


# ---------------------------------------------------------------------------
# Admin ops.

ADMIN_CALLS = {
    "QUOTA_SET": ("quota_set", ("tenant-q", 8 * CHUNK_BYTES)),
    "QUOTA_GET": ("quota_get", ("tenant-q",)),
    "QUOTA_LIST": ("quota_list", ()),
    "QUOTA_DELETE": ("quota_delete", ("tenant-q",)),
    "CLEAR": ("clear", ()),
    "CLEAR one salt": ("clear", ("tenant-q",)),
}


def try_admin_ops(state, client: str) -> dict[str, str]:
    outcomes = {}
    for label, (method, args) in ADMIN_CALLS.items():
        try:
            getattr(state[client], method)(*args)
            outcomes[label] = "DONE"
        except Exception as exc:
            outcomes[label] = type(exc).__name__
    return outcomes


def test_admin_ops_need_the_admin_token(server, admin, outsider):
    runtime_dir = server.runtime_dir
    assert outsider.run(read_file, str(runtime_dir / "token")) == "READ 65 characters"
    assert outsider.run(read_file, str(runtime_dir / "admin.token")) == "PermissionError"
    # Its admin=True client finds no admin token it can read, and is an engine.
    assert outsider.run(connect, "wannabe", server.url, admin=True) == ROLE_ENGINE
    assert outsider.run(connect, "engine", server.url,
                        token=(runtime_dir / "token").read_text().strip()) == ROLE_ENGINE
    with pytest.raises(Unauthenticated, match="the token is wrong"):
        outsider.run(connect, "guess", server.url, token="0" * 64)

    with server.client() as engine, new_cache(2 * BLOCKS_PER_CHUNK, 10, W2) as cache:
        registration = register_here(engine, cache)
        hashes = prompt(64, 2)
        assert engine.store(registration, [TransferItem.build(
            "q", hashes, chunk_blocks([0, 1]), "tenant-q")]) == [STORED * 2]
        everything_forbidden = {label: "Forbidden" for label in ADMIN_CALLS}
        assert outsider.run(try_admin_ops, "wannabe") == everything_forbidden
        assert outsider.run(try_admin_ops, "engine") == everything_forbidden
        assert try_admin_ops({"c": engine}, "c") == everything_forbidden
        with pytest.raises(Forbidden, match="CLEAR is an admin op"):
            engine.clear()
        # Nothing happened: no quota, nothing cleared.
        assert admin.quota_list().quotas == []
        assert engine.lookup(MODEL, 1, [LookupItem.build("q", hashes, "tenant-q")]) == [2]

        assert admin.hello().role == ROLE_ADMIN
        assert admin.quota_set("tenant-q", 8 * CHUNK_BYTES).cap == 8 * CHUNK_BYTES
        assert admin.quota_get("tenant-q").bytes_used == 2 * CHUNK_BYTES
        assert [q.cache_salt for q in admin.quota_list().quotas] == ["tenant-q"]
        assert admin.quota_delete("tenant-q").own is False
        assert admin.clear("tenant-q") == 2
        assert engine.lookup(MODEL, 1, [LookupItem.build("q", hashes, "tenant-q")]) == [0]
        engine.unregister(registration)


# ---------------------------------------------------------------------------
# Holds: only the engine that took one can drop it.

def test_another_engine_cannot_release_a_hold(server, admin, outsider):
    salt = "held"
    admin.quota_set(salt, 4 * CHUNK_BYTES)  # so that new chunks press on the held ones
    outsider.run(connect, "other_engine", server.url, engine="engine-x")
    outsider.run(connect, "no_engine", server.url)  # "": an engine of its own
    outsider.run(make, "x_cache", 4 * BLOCKS_PER_CHUNK, None, W2)
    outsider.run(register, "x_reg", "other_engine", "x_cache")
    with server.client(engine="victim") as scheduler, \
            server.client(engine="victim") as worker, \
            server.client(engine="victim") as another_rank, \
            new_cache(8 * BLOCKS_PER_CHUNK, 11, W2) as cache:
        registration = register_here(worker, cache)
        hashes, pressure = prompt(65, 4), prompt(66, 4)
        assert worker.store(registration, [TransferItem.build(
            "w", hashes, chunk_blocks(range(4)), salt)]) == [STORED * 4]
        assert scheduler.lookup(MODEL, 1, [LookupItem.build("req-1", hashes, salt,
                                                            hold=True)]) == [4]
        assert admin.stats().leases_held == 1

        for client in ("other_engine", "no_engine"):
            assert outsider.do(client, "release", [LeaseRef("req-1", salt)]) == 0, client
            assert outsider.do(client, "end_session", "req-1", salt) == 0, client
        # Nor does its own RETRIEVE under the victim's request id release the hold.
        assert outsider.do("other_engine", "retrieve", Ref("x_reg"), [TransferItem.build(
            "req-1", hashes, chunk_blocks(range(4)), salt)]) == [4]
        assert admin.stats().leases_held == 1
        # The hold still protects the chunks: new ones in the salt find no room.
        assert worker.store(registration, [TransferItem.build(
            "p", pressure, chunk_blocks(range(4, 8)), salt)]) == [
            bytes([StoreStatus.OVER_QUOTA] + [StoreStatus.NO_PREFIX] * 3)]
        cache.layers[0].zero_()  # the blocks the RETRIEVE must fill again
        assert worker.retrieve(registration, [TransferItem.build(
            "req-1", hashes, chunk_blocks(range(4)), salt)]) == [4]
        with new_cache(8 * BLOCKS_PER_CHUNK, 11, W2) as truth:
            assert raw_bytes(cache.blocks(chunk_blocks(range(4)))) == \
                raw_bytes(truth.blocks(chunk_blocks(range(4))))
        assert admin.stats().leases_held == 0  # the RETRIEVE released it

        # The same engine on another connection can release; then the pressure evicts.
        assert scheduler.lookup(MODEL, 1, [LookupItem.build("req-2", hashes, salt,
                                                            hold=True)]) == [4]
        assert outsider.do("other_engine", "release", [LeaseRef("req-2", salt)]) == 0
        assert another_rank.release([LeaseRef("req-2", salt)]) == 4
        assert admin.stats().leases_held == 0
        assert worker.store(registration, [TransferItem.build(
            "p", pressure, chunk_blocks(range(4, 8)), salt)]) == [STORED * 4]
        worker.unregister(registration)
    outsider.do("other_engine", "unregister", Ref("x_reg"))
    admin.quota_delete(salt)
    admin.clear(salt)


# ---------------------------------------------------------------------------
# MLA groups: only the leader's engine can join.

@pytest.mark.slow
def test_an_mla_follower_without_the_engine_secret_gets_nothing(server, admin, outsider,
                                                                agents):
    follower = agents("follower")
    num_blocks = 4 * BLOCKS_PER_CHUNK
    for name, agent, engine, seed in (("good", follower, "mla-engine", None),
                                      ("bad", outsider, "not-the-secret", 77)):
        agent.run(connect, name, server.url, engine=engine, mla_follower=True)
        agent.run(make, f"{name}_cache", num_blocks, seed, MLA)
        agent.run(register, f"{name}_reg", name, f"{name}_cache", tp_rank=1, tp_group="tp-0")
    outsider.run(connect, "bad_no_engine", server.url, mla_follower=True)
    outsider.run(make, "bad2_cache", num_blocks, 78, MLA)
    outsider.run(register, "bad2_reg", "bad_no_engine", "bad2_cache", tp_rank=1,
                 tp_group="tp-0")
    untouched = {"bad_cache": outsider.run(blocks_of, "bad_cache", num_blocks),
                 "bad2_cache": outsider.run(blocks_of, "bad2_cache", num_blocks)}

    with server.client(engine="mla-engine") as leader, new_cache(num_blocks, 76, MLA) as cache:
        registration = leader.register_kv_cache(cache.handles(), model=MODEL, layout="mla",
                                                block_size=16, tp_rank=0, tp_group="tp-0")
        hashes = prompt(67, 2)
        assert leader.store(registration, [TransferItem.build(
            "w", hashes, chunk_blocks([0, 1]))]) == [STORED * 2]
        leader.lookup(MODEL, 1, [LookupItem.build("load", hashes, hold=True)])
        assert leader.retrieve(registration, [TransferItem.build(
            "load", hashes, chunk_blocks([2, 3]))]) == [2]
        sent = raw_bytes(cache.blocks(chunk_blocks([0, 1])))
        assert raw_bytes(cache.blocks(chunk_blocks([2, 3]))) == sent

        assert follower.do("good", "wait_for_load", "load", "", 10.0) == 2
        assert follower.run(blocks_of, "good_cache", num_blocks, chunk_blocks([2, 3])) == sent
        for client, cache_name in (("bad", "bad_cache"), ("bad_no_engine", "bad2_cache")):
            with pytest.raises(RequestTimeout):  # the good one's came at once: so would this
                outsider.do(client, "wait_for_load", "load", "", 0.5)
            assert outsider.run(blocks_of, cache_name, num_blocks) == untouched[cache_name]
        pushed = {i.instance_id: i.loads_pushed for i in admin.stats().instances}
        assert pushed[follower.run(instance_of, "good_reg")] == 1
        assert pushed[outsider.run(instance_of, "bad_reg")] == 0
        assert pushed[outsider.run(instance_of, "bad2_reg")] == 0
        leader.unregister(registration)
    follower.do("good", "unregister", Ref("good_reg"))
    outsider.do("bad", "unregister", Ref("bad_reg"))
    outsider.do("bad_no_engine", "unregister", Ref("bad2_reg"))


def blocks_of(state, cache: str, num_blocks: int, block_ids: list[int] | None = None) -> bytes:
    return raw_bytes(state[cache].blocks(list(range(num_blocks)) if block_ids is None
                                         else block_ids))


def instance_of(state, registration: str) -> int:
    return state[registration].instance_id


# ---------------------------------------------------------------------------
# tcp:// endpoints, and unsafe start-ups.

def test_a_tcp_endpoint_serves_only_clients_with_the_token():
    with run_server(url=f"tcp://127.0.0.1:{free_port()}") as server:
        cases = {"no token": "", "a wrong token": "f" * 64,
                 "the admin token's prefix": server.token(admin=True)[:-1]}
        for label, token in cases.items():
            with CacheClient(server.url, token=token, timeout=5) as client:
                with pytest.raises(Unauthenticated):
                    client.lookup(MODEL, 1, [LookupItem.build("r", prompt(1, 1))])
                with pytest.raises(Unauthenticated):
                    client.rpc.call(StoreRequest(1, []))
                assert client.ping() > 0, label  # heartbeats need no session
        with server.client() as engine:
            assert engine.hello().role == ROLE_ENGINE
            assert engine.lookup(MODEL, 1, [LookupItem.build("r", prompt(1, 1))]) == [0]
            with pytest.raises(Forbidden):
                engine.quota_list()
        with server.client(admin=True) as admin:
            assert admin.hello().role == ROLE_ADMIN
            assert admin.quota_list().quotas == []


def start_up(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmcache_mp.server", "--cpu-size", "16MiB",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


UNSAFE_START_UPS = {  # label: (arguments, with {tmp} and {port}; words the refusal says)
    "0.0.0.0 without --token-file": (
        ["--host", "0.0.0.0", "--port", "{port}", "--runtime-dir", "{tmp}/a"], "--token-file"),
    "a runtime dir of another user": (
        ["--runtime-dir", "{tmp}/others"], f"belongs to uid {NOBODY}"),
    "a runtime dir that is a symlink": (
        ["--runtime-dir", "{tmp}/link"], "is not a directory (a symlink?)"),
    "a token file others can read": (
        ["--host", "0.0.0.0", "--port", "{port}", "--runtime-dir", "{tmp}/d",
         "--token-file", "{tmp}/readable-token"], "others could read the token"),
    "a token longer than HELLO carries": (  # it would refuse its own token
        ["--host", "127.0.0.1", "--port", "{port}", "--runtime-dir", "{tmp}/e",
         "--token-file", "{tmp}/long-token"], "use 16 to 256"),
}


@pytest.fixture(scope="module", autouse=True)
def unsafe_start_ups(tmp_path_factory):
    """The refused start-ups, launched with the module: each imports the server (seconds)
    while the other tests run. Yields the directory and the running processes."""
    tmp = tmp_path_factory.mktemp("start-ups")
    (tmp / "others").mkdir()
    os.chown(tmp / "others", NOBODY, NOBODY)
    (tmp / "real").mkdir(mode=0o700)
    (tmp / "link").symlink_to(tmp / "real")
    (tmp / "readable-token").write_text("a" * 32)
    (tmp / "readable-token").chmod(0o644)
    (tmp / "long-token").write_text("b" * 300)
    (tmp / "long-token").chmod(0o600)
    port = str(free_port())
    running = {label: start_up(*[arg.format(tmp=tmp, port=port) for arg in args])
               for label, (args, _) in UNSAFE_START_UPS.items()}
    yield tmp, running
    for process in running.values():
        process.kill()
        process.wait()
        assert process.stdout is not None  # stdout=PIPE
        process.stdout.close()  # communicate() closed it, unless the test did not run


def test_unsafe_start_ups_are_refused(unsafe_start_ups):
    tmp, running = unsafe_start_ups
    outcomes = {}
    for label, process in running.items():
        output, _ = process.communicate(timeout=60)
        outcomes[label] = (process.returncode, UNSAFE_START_UPS[label][1] in output,
                           output[-300:])
    assert {label: outcome[:2] for label, outcome in outcomes.items()} == {
        label: (2, True) for label in UNSAFE_START_UPS}, outcomes
    # Nothing was written into the directories it refused.
    assert os.listdir(tmp / "others") == [] and os.listdir(tmp / "real") == []
