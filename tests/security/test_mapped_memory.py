"""What a registration costs the server: only the bytes its layers name are mapped, only
those of them the worker allocated are pre-faulted, a segment much larger than its layers
or on hugetlbfs is refused, and the worker memory registered is bounded per connection
and per uid.

The attacker is a process running as `nobody` against a root server that lets `nogroup`
connect; the server's RssShmem (/proc/PID/status) is what a fault-in on its account would
raise, and a bystander worker (this test process) checks the server still serves byte for
byte.
"""

from __future__ import annotations

import fcntl
import os

import pytest

from lmcache_mp import protocol
from lmcache_mp.errors import BadRequest
from lmcache_mp.fdpass import send_fds
from lmcache_mp.server.memory.registry import SEGMENT_SLACK_BYTES

from .agents import NOBODY, RawClient, group_server
from .test_memory import bystander_round_trip

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run a process as "
                                                           "nobody, and to chgrp)")
MiB, GiB = 1024**2, 1024**3
BLOCK_BYTES = 16 * 256 * 2  # an MLA block of 16 tokens of 256 float16: 8 KiB


@pytest.fixture(scope="module")
def server():
    with group_server("--cpu-size", "64MiB") as srv:
        yield srv


def rss_shmem(pid: int) -> int:
    """Bytes of shared memory mapped into the process's page tables (RssShmem)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/PID/status")


def mla_layer(offset: int, num_blocks: int) -> dict:
    return {"kind": "memfd", "offset": offset, "shape": [num_blocks, 16, 256],
            "strides": [4096, 256, 1], "dtype": "float16", "name": "sparse"}


# Steps the attacker runs.

def open_session(state, name: str, url: str) -> None:
    raw = RawClient(url)
    state[name] = raw
    state[name + "/hello"] = raw.hello()


def sparse_memfd(size: int, written: int = 0, hugetlb: bool = False) -> int:
    """A sealed memfd of `size` bytes of which only the first `written` hold data."""
    fd = os.memfd_create("lmcache-mp-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
                         | (os.MFD_HUGETLB if hugetlb else 0))
    os.ftruncate(fd, size)
    if written:
        os.pwrite(fd, os.urandom(written), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def register_sparse(state, session: str, size: int, layers: list[dict], written: int = 0,
                    then_store: bool = False) -> dict:
    """Register `layers` of a new sparse memfd on the agent's session `session`; with
    `then_store`, STORE the first chunk and unregister. Returns the outcome, and the bytes
    the memfd holds in the end (whoever allocated them)."""
    raw, hello = state[session], state[session + "/hello"]
    fd = sparse_memfd(size, written)
    try:
        (ticket,) = send_fds(hello["fd_socket"], [fd], 10, hello["fd_binding"])
        status, reply = raw.call("REGISTER_KV_CACHE", {
            "model": "sparse-model", "kv_world_size": 1, "kv_worker_id": 0, "layout": "mla",
            "block_size": 16, "layers": [dict(layer, ticket=ticket) for layer in layers]})
        outcome = {"status": status, "reply": reply}
        if status == b"ok" and then_store:
            outcome["store"] = raw.call("STORE", {
                "instance_id": reply["instance_id"], "items": [{
                    "request_id": "sparse", "chunk_hashes": os.urandom(16),
                    "block_ids": b"".join(i.to_bytes(4, "little") for i in range(16))}]})
            outcome["unregister"] = raw.call("UNREGISTER_KV_CACHE",
                                             {"instance_id": reply["instance_id"]})
        outcome["allocated"] = os.fstat(fd).st_blocks * 512
        return outcome
    finally:
        os.close(fd)


def offer_hugetlb(state, session: str) -> str:
    hello = state[session + "/hello"]
    try:
        fd = sparse_memfd(2 * MiB, hugetlb=True)
    except OSError as exc:
        return f"UNSUPPORTED {exc}"
    try:
        return f"TICKETED {send_fds(hello['fd_socket'], [fd], 10, hello['fd_binding'])}"
    except BadRequest as exc:
        return str(exc)
    finally:
        os.close(fd)


def refusal(outcome: dict) -> str:
    """The message of a REGISTER_KV_CACHE that register_sparse saw refused."""
    assert (outcome["status"], outcome["reply"]["code"]) == (b"err", "bad_request"), outcome
    return outcome["reply"]["message"]


def unregister(state, session: str, instance_id: int) -> tuple:
    return state[session].call("UNREGISTER_KV_CACHE", {"instance_id": instance_id})


# ---------------------------------------------------------------------------

def test_only_the_layers_extent_is_mapped_and_only_its_data_is_faulted_in(server, outsider):
    pid = server.proc.pid
    with server.client(admin=True) as admin:
        server.wait_prefault(admin)
    outsider.run(open_session, "sparse", server.url)
    before = rss_shmem(pid)
    # The attack of issue 34: a sparse GiB, sealed, and one 512-byte layer in it.
    tiny = outsider.run(register_sparse, "sparse", GiB, [
        {"kind": "memfd", "offset": 0, "shape": [1, 16, 16], "strides": [256, 16, 1],
         "dtype": "float16", "name": "sparse"}], written=512)
    assert refusal(tiny) == (
        f"`layers[0]`: memfd 'sparse' holds {GiB} bytes, but its layers span 512 (bytes 0 to "
        f"512); a segment may hold at most twice its layers' extent and "
        f"{SEGMENT_SLACK_BYTES} bytes more: size it to the cache")
    assert rss_shmem(pid) - before < MiB and tiny["allocated"] == 4096

    # A sparse 64 MiB cache its layers span whole, of which the worker wrote 1 MiB: taken,
    # stored from, and only that MiB ever faulted in, by anyone.
    cache = outsider.run(register_sparse, "sparse", 64 * MiB,
                         [mla_layer(0, 64 * MiB // BLOCK_BYTES)], written=MiB, then_store=True)
    assert cache["status"] == b"ok", cache
    assert cache["store"] == (b"ok", {"results": [bytes([protocol.StoreStatus.STORED])]})
    assert cache["unregister"] == (b"ok", {})
    assert cache["allocated"] == MiB
    assert rss_shmem(pid) - before < MiB
    bystander_round_trip(server, 30)
    server.check_alive()
    outsider.do("sparse", "close")


def test_a_hugetlbfs_memfd_is_refused_at_the_fd_channel(server, outsider):
    outsider.run(open_session, "huge", server.url)
    outcome = outsider.run(offer_hugetlb, "huge")
    if outcome.startswith("UNSUPPORTED"):
        pytest.skip(f"this kernel makes no hugetlbfs memfds: {outcome}")
    assert outcome.endswith("refused the descriptors: fd 0 is a hugetlbfs memfd (MFD_HUGETLB): "
                            "its pages come from a pool that may be empty when a hole punched "
                            "in it is touched, and the server would die of SIGBUS; use a "
                            "plain memfd (transparent huge pages need no pool)"), outcome
    bystander_round_trip(server, 31)
    outsider.do("huge", "close")


def test_registered_worker_memory_is_bounded_per_connection_and_per_uid(server, outsider):
    per_connection = protocol.MAX_REGISTERED_BYTES_PER_CONNECTION
    per_uid = protocol.MAX_REGISTERED_BYTES_PER_UID
    # Registrations of 3/4 of a connection's share, in sparse memfds that hold no data, so
    # the server faults nothing in: two do not fit on one connection, and a uid's share
    # holds `fitting` of them.
    size = per_connection * 3 // 4
    layer = [mla_layer(0, size // BLOCK_BYTES)]
    fitting = per_uid // size
    pid = server.proc.pid
    before = rss_shmem(pid)
    outsider.run(open_session, "cap0", server.url)
    first = outsider.run(register_sparse, "cap0", size, layer)
    assert first["status"] == b"ok", first
    second = outsider.run(register_sparse, "cap0", size, layer)
    assert refusal(second) == (
        f"`layers`: this connection has {size} bytes of worker memory registered; {size} more "
        f"would pass MAX_REGISTERED_BYTES_PER_CONNECTION ({per_connection}): unregister a "
        f"cache first")
    held = {"cap0": first["reply"]["instance_id"]}  # session -> its registration
    for n in range(1, fitting):
        outsider.run(open_session, f"cap{n}", server.url)
        taken = outsider.run(register_sparse, f"cap{n}", size, layer)
        assert taken["status"] == b"ok", (n, taken)
        held[f"cap{n}"] = taken["reply"]["instance_id"]
    outsider.run(open_session, "over", server.url)
    over = outsider.run(register_sparse, "over", size, layer)
    assert refusal(over) == (
        f"`layers`: uid {NOBODY}'s memfds are registered for {fitting * size} bytes; {size} "
        f"more would pass MAX_REGISTERED_BYTES_PER_UID ({per_uid}): unregister caches of "
        f"that uid first")
    # Another uid's worker is not held back by nobody's share, and an unregistered cache
    # gives its share back.
    bystander_round_trip(server, 32)
    assert outsider.run(unregister, "cap1", held.pop("cap1")) == (b"ok", {})
    again = outsider.run(register_sparse, "over", size, layer)
    assert again["status"] == b"ok", again
    held["over"] = again["reply"]["instance_id"]
    assert rss_shmem(pid) - before < MiB  # terabytes registered, nothing faulted in
    for session, instance_id in held.items():
        assert outsider.run(unregister, session, instance_id) == (b"ok", {})
    server.check_alive()
    for n in range(fitting):
        outsider.do(f"cap{n}", "close")
    outsider.do("over", "close")
