"""Memory a client hands the server: only sealed memfds passed over the fd channel are ever
mapped, so no worker can shrink the server's mapping from under a copy (SIGBUS), and no
name, symlink or made-up ticket makes the server map memory the client does not own.

Every attack runs in its own process, most as `nobody` against a root server that lets
`nogroup` connect; a bystander worker (this test process) checks the server still stores
and retrieves byte for byte.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import stat
import uuid
from dataclasses import replace
from typing import Any

import pytest

from lmcache_mp.client import LookupItem, SharedSegment, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.fdpass import send_fds
from lmcache_mp.protocol import (
    TICKET_BYTES,
    RetrieveReply,
    RetrieveRequest,
    StoreReply,
    StoreRequest,
)

from ..utils import wait_for
from ..workers import BLOCKS_PER_CHUNK, MODEL, W2, chunk_blocks, prompt
from .agents import (
    W1,
    RawClient,
    Ref,
    connect,
    group_server,
    make,
    new_cache,
    open_fds,
    raw_bytes,
    register,
)

# The attackers run as nobody, and the server gives nogroup access: both need root.
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run a process as "
                                                           "nobody, and to chgrp)")
STORED = bytes([StoreStatus.STORED])


@pytest.fixture(scope="module")
def server():
    # 1 GiB: room for the 16 W1 chunks (512 MiB) that one transfer below moves.
    with group_server("--cpu-size", "1GiB", "--worker-timeout", "1.5",
                      "--lease-timeout", "5") as srv:
        yield srv


@pytest.fixture
def worker(server):
    """This process as a worker with a registered W2 cache of two chunks."""
    with server.client(timeout=10) as client, new_cache(2 * BLOCKS_PER_CHUNK, 3, W2) as cache:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        yield client, cache, registration
        client.unregister(registration)


def bystander_round_trip(server, tag: int) -> None:
    """This process as an honest worker: STORE two W2 chunks from one cache, RETRIEVE them
    into another, and compare the bytes."""
    with server.client(timeout=20) as client, \
            new_cache(2 * BLOCKS_PER_CHUNK, 1000 + tag, W2) as source, \
            new_cache(2 * BLOCKS_PER_CHUNK, None, W2) as target:
        sent = client.register_kv_cache(source.handles(), model=MODEL, layout="mha",
                                        block_size=16)
        received = client.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                            block_size=16)
        hashes = prompt(5000 + tag, 2)
        assert client.store(sent, [TransferItem.build(f"by{tag}", hashes, chunk_blocks([0, 1]))]
                            ) == [STORED * 2]
        assert client.lookup(MODEL, 1, [LookupItem.build(f"by{tag}", hashes, hold=True)]) == [2]
        assert client.retrieve(received, [TransferItem.build(
            f"by{tag}", hashes, chunk_blocks([1, 0]))]) == [2]
        assert raw_bytes(target.blocks(chunk_blocks([1, 0]))) == \
            raw_bytes(source.blocks(chunk_blocks([0, 1])))
        assert client.ping() > 0
        client.unregister(sent)
        client.unregister(received)


def maps_of(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


def fd_targets(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return targets


# ---------------------------------------------------------------------------
# Shrinking: the one thing that turned a worker's memory into a server crash.

def errno_name(exc: OSError) -> str:
    assert exc.errno is not None, exc
    return errno.errorcode[exc.errno]


def try_to_resize(state, cache: str) -> dict:
    """A registered worker tries to shrink (and grow) the memfd the server maps."""
    fd = state[cache].segment.fd
    outcomes: dict[str, Any] = {}
    for label, size in (("shrink to 0", 0), ("shrink by a page", os.fstat(fd).st_size - 4096),
                        ("grow", os.fstat(fd).st_size * 2)):
        try:
            os.ftruncate(fd, size)
            outcomes[label] = "resized"
        except OSError as exc:
            outcomes[label] = errno_name(exc)
    outcomes["size"] = os.fstat(fd).st_size
    return outcomes


def shrinkable_fds(size: int) -> dict[str, int]:
    """Descriptors of memory the sender can still shrink after handing them over."""
    fds = {}
    for label, path in (("/dev/shm file", f"/dev/shm/lmcache_mp_attack_{uuid.uuid4().hex}"),
                        ("/tmp file", f"/tmp/lmcache-mp-attack-{uuid.uuid4().hex}")):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        os.ftruncate(fd, size)
        fds[label] = fd
    fds["memfd, unsealed"] = os.memfd_create("attack", os.MFD_ALLOW_SEALING)
    fds["memfd, sealed against growing only"] = os.memfd_create("attack", os.MFD_ALLOW_SEALING)
    for label in ("memfd, unsealed", "memfd, sealed against growing only"):
        os.ftruncate(fds[label], size)
    fcntl.fcntl(fds["memfd, sealed against growing only"], fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fds


def offer_shrinkable_memory(state, url: str, fd_socket: str) -> dict:
    """The outsider: hand the fd channel memory it can shrink, then register it anyway with a
    ticket of its own making, then shrink it (as it would have mid-copy)."""
    size = 16 * 2 * 16 * 2 * 64 * 2 * 4  # a W2 cache of 16 blocks, 4 layers
    outcomes: dict[str, Any] = {}
    with RawClient(url) as raw:
        raw.hello()
        for label, fd in shrinkable_fds(size).items():
            try:
                tickets = send_fds(fd_socket, [fd], timeout=10)
                outcomes[label] = f"TICKETED {tickets}"
            except BadRequest as exc:
                outcomes[label] = str(exc)
            status, reply = raw.call("REGISTER_KV_CACHE", {
                "model": MODEL, "kv_world_size": 1, "kv_worker_id": 0, "layout": "mha",
                "block_size": 16, "layers": [{
                    "kind": "memfd", "ticket": os.urandom(TICKET_BYTES), "offset": 0,
                    "shape": [2, 16, 16, 2, 64], "strides": [32768, 2048, 128, 64, 1],
                    "dtype": "float16", "name": label}]})
            outcomes[label + " / REGISTER"] = (status, reply.get("code"), reply.get("message"))
            os.ftruncate(fd, 0)  # what would have pulled the pages out from under the server
            os.close(fd)
    return outcomes


def test_a_registered_segment_cannot_shrink_and_shrinkable_memory_never_gets_a_ticket(
        server, outsider, worker):
    bystander_round_trip(server, 1)
    # The worker (this process) tries to resize the memfd it registered.
    client, cache, registration = worker
    resized = try_to_resize({"cache": cache}, "cache")
    assert resized == {"shrink to 0": "EPERM", "shrink by a page": "EPERM", "grow": "EPERM",
                       "size": 4 * 2 * 32 * 16 * 2 * 64 * 2}
    assert outsider.run(connect, "c1", server.url) == "engine"

    fd_socket = str(server.runtime_dir / "fd.sock")
    outcomes = outsider.run(offer_shrinkable_memory, server.url, fd_socket)
    for label in ("/dev/shm file", "/tmp file", "memfd, unsealed",
                  "memfd, sealed against growing only"):
        assert outcomes[label] == (
            f"the fd channel at {fd_socket} refused the descriptors: fd 0 is not a memfd sealed "
            f"with F_SEAL_SHRINK; allocate with lmcache_mp.client.SharedSegment"), label
        status, code, message = outcomes[label + " / REGISTER"]
        assert (status, code) == (b"err", "bad_request"), label
        assert "unknown or expired ticket" in message, label

    server.check_alive()
    # The honest worker's registration still works: its STORE copies from its sealed memfd.
    hashes = prompt(11, 2)
    assert client.store(registration, [TransferItem.build("w", hashes, chunk_blocks([0, 1]))]
                        ) == [STORED * 2]
    bystander_round_trip(server, 2)
    outsider.do("c1", "close")


# ---------------------------------------------------------------------------
# Closing the segment, or dying, while the server copies from or into it.

def transfer_then_vanish(state, op: str, hashes: list[bytes], block_ids: list[int],
                         how: str) -> dict:
    """Send a big STORE or RETRIEVE; once the server has it (a STATS on the same connection
    was answered after it), try to shrink the memfd, close the segment (unmap it, close the
    fd) and, with how="kill", SIGKILL this process before the reply comes."""
    client, registration, cache = state["c"], state["reg"], state["cache"]
    request_type = StoreRequest if op == "STORE" else RetrieveRequest
    pending = client.rpc.submit(request_type(registration.instance_id, [TransferItem.build(
        "vanish", hashes, block_ids)]), timeout=60)
    stats = client.stats()  # answered in order: the server has the transfer by then
    # Still copying: a STORE is pending at the server (or, either op, not answered yet).
    report: dict[str, Any] = {"in_flight": stats.pending_stores > 0 or not pending.done(),
                              "name": cache.name}
    try:
        os.ftruncate(cache.segment.fd, 0)
        report["shrink"] = "shrunk"
    except OSError as exc:
        report["shrink"] = errno_name(exc)
    segment = cache.segment
    cache.close()
    segment.mapping.close()  # no views remain: this unmaps it now
    report["unmapped"] = f"/memfd:{report['name']}" not in maps_of(os.getpid())
    report["fd_closed"] = segment.fd == -1
    if how == "kill":
        state["conn"].send(("ok", report))
        os.kill(os.getpid(), signal.SIGKILL)
    report["reply"] = pending.result(60)
    return report


W1_BLOCKS = 16  # a one-chunk W1 cache: 32 MiB
CHUNKS = 16  # W1 chunks per transfer, all from (or into) the same 16 blocks: 512 MiB


def load_chunks(server, hashes: list[bytes], seed: int) -> None:
    """This process stores the W1 chunks a RETRIEVE will read."""
    with server.client(timeout=30) as loader, new_cache(W1_BLOCKS, seed, W1) as source:
        registration = loader.register_kv_cache(source.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        assert loader.store(registration, [TransferItem.build(
            "load", hashes, list(range(W1_BLOCKS)) * len(hashes))]) == [STORED * len(hashes)]
        loader.unregister(registration)


def check_stored(server, hashes: list[bytes], truth: bytes, all_of_them: bool) -> None:
    """Every chunk the server shows of these is the worker's bytes, exactly."""
    with server.client(timeout=30) as reader, new_cache(W1_BLOCKS, None, W1) as target:
        (visible,) = reader.lookup(MODEL, 1, [LookupItem.build("check", hashes)])
        assert visible == len(hashes) if all_of_them else visible <= len(hashes)
        registration = reader.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        for chunk in range(visible):
            target.segment.mapping[:] = bytes(len(truth))
            assert reader.retrieve(registration, [TransferItem.build(
                "check", hashes[chunk:chunk + 1], list(range(W1_BLOCKS)))]) == [1]
            assert target.segment.mapping[:] == truth, f"chunk {chunk}"
        reader.unregister(registration)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["STORE", "RETRIEVE"])
def test_a_worker_that_closes_its_segment_or_dies_mid_transfer_harms_nobody(
        server, admin, agents, op):
    """One worker process: a big transfer during which it closes its segment and carries on;
    then another during which it closes its segment and SIGKILLs itself."""
    worker = agents(op)  # starting up while this process prepares
    pid = server.proc.pid
    admin.ping()  # connected: its descriptor in the server is part of the count
    fds_before = open_fds(pid)
    seed = {"STORE": 31, "RETRIEVE": 33}[op]
    with new_cache(W1_BLOCKS, seed, W1) as source:
        truth = bytes(source.segment.mapping)  # the whole cache: its one chunk, all layers
    block_ids = list(range(W1_BLOCKS)) * CHUNKS
    worker.run(connect, "c", server.url, timeout=30)
    names = []
    for how, tag in (("close", 300), ("kill", 400)):
        hashes = prompt(tag + seed, CHUNKS)
        if op == "RETRIEVE":
            load_chunks(server, hashes, seed)
        worker.run(make, "cache", W1_BLOCKS, seed if op == "STORE" else None, W1)
        worker.run(register, "reg", "c", "cache")
        report = worker.run(transfer_then_vanish, op, hashes, block_ids, how)
        if how == "kill":
            assert worker.wait_exit() == -signal.SIGKILL
        else:
            # The server copied through its own mapping, which the worker's close cannot touch.
            assert report.pop("reply") == (StoreReply([STORED * CHUNKS]) if op == "STORE"
                                           else RetrieveReply([CHUNKS]))
        names.append(report.pop("name"))
        assert report == {"in_flight": True, "shrink": "EPERM", "unmapped": True,
                          "fd_closed": True}, how
        server.check_alive()
        assert admin.ping() > 0
        bystander_round_trip(server, seed + tag)
        if op == "STORE":
            check_stored(server, hashes, truth, all_of_them=how == "close")
        if how == "close":
            worker.do("c", "unregister", Ref("reg"))

    # The dead worker's registration goes at --worker-timeout, and with it the server's
    # mappings of both memfds and every descriptor.
    wait_for(lambda: admin.stats().registrations == 0, timeout=10,
             what="the worker's registration gone")
    wait_for(lambda: not any(f"/memfd:{name}" in maps_of(pid) for name in names), timeout=10,
             what="the worker's memfds unmapped by the server")
    wait_for(lambda: open_fds(pid) <= fds_before, timeout=10, what="no descriptor leaked")
    assert admin.stats().pending_stores == 0


# ---------------------------------------------------------------------------
# Names and symlinks: the server opens nothing by name any more.

def register_by_name(state, url: str, attempts: dict[str, dict]) -> dict:
    """The outsider: REGISTER_KV_CACHE with handles that name memory instead of passing it."""
    outcomes: dict[str, Any] = {}
    with RawClient(url) as raw:
        raw.hello()
        for label, handle in attempts.items():
            status, reply = raw.call("REGISTER_KV_CACHE", {
                "model": MODEL, "kv_world_size": 1, "kv_worker_id": 0, "layout": "mha",
                "block_size": 16, "layers": [handle]})
            outcomes[label] = (status, reply.get("code"), reply.get("message", reply))
        # Whatever it registered, if anything, it now tries to STORE from and RETRIEVE into.
        outcomes["stats"] = raw.call("STATS", {})[1]["instances"]
    return outcomes


def plant_symlink(state, target: str) -> str:
    name = f"lmcache_mp_{uuid.uuid4().hex[:12]}"
    os.symlink(target, f"/dev/shm/{name}")
    state["symlink"] = f"/dev/shm/{name}"
    return name


def remove_symlink(state) -> None:
    os.unlink(state["symlink"])


def test_names_symlinks_and_made_up_tickets_map_nothing(server, admin, outsider, worker,
                                                         tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(64 * 1024))
    secret.chmod(0o600)
    before = secret.read_bytes(), os.stat(secret)
    victim, victim_cache, registration = worker  # this process, with a registered cache
    victim_segment = victim_cache.name
    link = outsider.run(plant_symlink, str(secret))
    stats_before = admin.stats()

    layer = {"offset": 0, "shape": [2, 32, 16, 2, 64], "strides": [65536, 2048, 128, 64, 1],
             "dtype": "float16"}
    attempts = {
        "shm: the victim's segment": {"kind": "shm", "name": victim_segment, **layer},
        "shm: a symlink to a root-only file": {"kind": "shm", "name": link, **layer},
        "shm: a path": {"kind": "shm", "name": f"../../..{secret}", **layer},
        "file: a path": {"kind": "file", "path": str(secret), **layer},
        "memfd: made-up ticket, the victim's name": {
            "kind": "memfd", "ticket": os.urandom(TICKET_BYTES), "name": victim_segment,
            **layer},
        "memfd: made-up ticket, the symlink's name": {
            "ticket": os.urandom(TICKET_BYTES), "name": link, **layer},
        "memfd: no ticket, the victim's name": {"ticket": b"", "name": victim_segment, **layer},
        "memfd: the symlink's name as ticket": {"ticket": link.encode()[:TICKET_BYTES],
                                                "name": link, **layer},
    }
    outcomes = outsider.run(register_by_name, server.url, attempts)
    assert outcomes.pop("stats") == []  # it registered nothing
    for label, (status, code, message) in outcomes.items():
        assert (status, code) == (b"err", "bad_request"), (label, message)
        if label.startswith(("shm", "file")):
            assert "unsupported handle kind" in message and "'memfd'" in message, message
        elif label.startswith("memfd: no ticket"):
            assert f"expected {TICKET_BYTES} bytes from the fd channel" in message, message
        else:
            assert "unknown or expired ticket" in message, message
    outsider.run(remove_symlink)

    server.check_alive()
    pid = server.proc.pid
    assert str(secret) not in maps_of(pid) and str(secret) not in fd_targets(pid)
    assert link not in maps_of(pid) and not any(link in t for t in fd_targets(pid))
    after = admin.stats()
    assert (after.registrations, after.chunks, after.bytes_used) == (
        stats_before.registrations, stats_before.chunks, stats_before.bytes_used)
    assert secret.read_bytes() == before[0]
    assert os.stat(secret).st_mtime_ns == before[1].st_mtime_ns
    # The victim's cache still serves the victim.
    hashes = prompt(21, 2)
    assert victim.store(registration, [TransferItem.build("v", hashes, chunk_blocks([0, 1]))]
                        ) == [STORED * 2]
    bystander_round_trip(server, 3)


# ---------------------------------------------------------------------------
# Descriptors the outsider can open, and tickets.

def unfit_fds() -> dict[str, int]:
    """Descriptors a user without privileges can open that are not sealed memfds."""
    fds = {"/dev/zero": os.open("/dev/zero", os.O_RDWR),
           "a directory": os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)}
    read_end, write_end = os.pipe()
    os.close(write_end)
    fds["a pipe"] = read_end
    fds["a socket"] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).detach()
    no_sealing = os.memfd_create("attack")  # without MFD_ALLOW_SEALING: F_SEAL_SEAL, no SHRINK
    os.ftruncate(no_sealing, 65536)
    fds["memfd without sealing"] = no_sealing
    write_sealed = os.memfd_create("attack", os.MFD_ALLOW_SEALING)
    os.ftruncate(write_sealed, 65536)
    fcntl.fcntl(write_sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    fds["memfd sealed against writes"] = write_sealed
    with SharedSegment(65536) as segment:
        fds["sealed memfd, read-only"] = os.open(f"/proc/self/fd/{segment.fd}", os.O_RDONLY)
    empty = os.memfd_create("attack", os.MFD_ALLOW_SEALING)
    fcntl.fcntl(empty, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    fds["empty sealed memfd"] = empty
    return fds


def offer_unfit_fds(state, fd_socket: str) -> dict[str, str]:
    outcomes: dict[str, Any] = {}
    for label, fd in unfit_fds().items():
        try:
            outcomes[label] = f"TICKETED {send_fds(fd_socket, [fd], timeout=10)}"
        except BadRequest as exc:
            outcomes[label] = str(exc).split("refused the descriptors: ", 1)[1]
        os.close(fd)
    return outcomes


def reuse_a_ticket(state) -> dict:
    """Register its own sealed segment with a ticket, then try that ticket again: from this
    connection, and (handed over) from a second one."""
    client, cache = state["c3"], state["cache3"]
    ticket, = send_fds(client.rpc.server_info.fd_socket, [cache.segment.fd], timeout=10)
    handles = [replace(h, ticket=ticket) for h in cache.handles()]
    first = client.register_kv_cache(handles, model=MODEL, layout="mha", block_size=16)
    outcomes = {"first": first.instance_id > 0}
    for label, other in (("again", client), ("from another connection", state["other"])):
        try:
            other.register_kv_cache(handles, model=MODEL, layout="mha", block_size=16)
            outcomes[label] = "REGISTERED"
        except BadRequest as exc:
            outcomes[label] = str(exc)
    client.unregister(first)
    return outcomes


def test_unfit_descriptors_are_refused_and_tickets_are_single_use(server, outsider):
    fd_socket = str(server.runtime_dir / "fd.sock")
    assert stat.S_IMODE(os.stat(fd_socket).st_mode) == 0o660
    pid = server.proc.pid
    fds_before, targets_before = open_fds(pid), set(fd_targets(pid))
    outcomes = outsider.run(offer_unfit_fds, fd_socket)
    assert outcomes == {
        "/dev/zero": "fd 0 is not a regular file but a character device; send the memfd of "
                     "a lmcache_mp.client.SharedSegment",
        "a directory": "fd 0 is not a regular file but a directory; send the memfd of a "
                       "lmcache_mp.client.SharedSegment",
        "a pipe": "fd 0 is not a regular file but a pipe; send the memfd of a "
                  "lmcache_mp.client.SharedSegment",
        "a socket": "fd 0 is not a regular file but a socket; send the memfd of a "
                    "lmcache_mp.client.SharedSegment",
        "memfd without sealing": "fd 0 is not a memfd sealed with F_SEAL_SHRINK; allocate "
                                 "with lmcache_mp.client.SharedSegment",
        "memfd sealed against writes": "fd 0 is sealed against writes (F_SEAL_WRITE or "
                                       "F_SEAL_FUTURE_WRITE); the server writes retrieved "
                                       "blocks into it",
        "sealed memfd, read-only": "fd 0 is not open for reading and writing",
        "empty sealed memfd": "fd 0 is empty",
    }
    # Every refused descriptor was closed at once: none of them is among the server's.
    kept = [t for t in set(fd_targets(pid)) - targets_before if not t.startswith("socket:")]
    assert kept == []
    wait_for(lambda: open_fds(pid) <= fds_before, what="no descriptor kept")

    outsider.run(connect, "c3", server.url)
    outsider.run(connect, "other", server.url)
    outsider.run(make, "cache3", 2 * BLOCKS_PER_CHUNK, 5, W2)
    outcomes = outsider.run(reuse_a_ticket)
    assert outcomes["first"] is True
    for label in ("again", "from another connection"):
        assert "`layers[0].ticket`: unknown or expired ticket" in outcomes[label], label
    server.check_alive()
    for name in ("c3", "other", "cache3"):  # its connections go, and their descriptors
        outsider.do(name, "close")
    wait_for(lambda: open_fds(pid) <= fds_before, what="no descriptor leaked")
