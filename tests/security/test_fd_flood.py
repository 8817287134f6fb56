"""Flooding the fd channel: another uid's connections that never speak, reopened as fast
as the server closes them, and its watches and tickets held by the thousand, keep no
worker of another uid from registering.

The flooders run as `nobody` against a root server that lets `nogroup` connect; the
worker is this test process (root), registering for real, again and again: every try
must succeed.
"""

from __future__ import annotations

import os
import selectors
import socket

import pytest

from lmcache_mp.client import SharedSegment
from lmcache_mp.errors import BadRequest
from lmcache_mp.fdpass import connect, open_watch, send_fds
from lmcache_mp.protocol import (
    MAX_FDS_PER_MESSAGE,
    MAX_PENDING_TICKETS_PER_UID,
    MAX_WATCHES_PER_UID,
)

from ..workers import BLOCKS_PER_CHUNK, W2
from .agents import NOBODY, group_server, new_cache
from .test_memory import bystander_round_trip

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run a process as "
                                                           "nobody, and to chgrp)")
FLOODERS = 3  # processes
SOCKETS = 64  # connections each keeps open, silent: together more than the channel serves
TRIES = 20  # registrations by the worker while they flood


@pytest.fixture(scope="module")
def server():
    with group_server("--cpu-size", "64MiB") as srv:
        yield srv


def flood(state, path: str, sockets: int) -> dict:
    """Keep `sockets` silent connections to the fd channel, opening a new one whenever the
    server closes one, until the test sends anything down the agent's pipe; then report
    how many it opened and how many the server closed."""
    selector = selectors.DefaultSelector()
    pipe = state["conn"]
    selector.register(pipe.fileno(), selectors.EVENT_READ)
    opened = closed = 0

    def open_one() -> None:
        nonlocal opened
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connect(sock, path, 30)  # waits its turn while the listener's backlog is full
        selector.register(sock, selectors.EVENT_READ)
        opened += 1

    for _ in range(sockets):
        open_one()
    state["report"]("flooding")
    while True:
        for key, _ in selector.select():
            if key.fileobj == pipe.fileno():
                pipe.recv()
                for other in list(selector.get_map().values()):
                    if isinstance(other.fileobj, socket.socket):  # not the pipe's fileno
                        other.fileobj.close()
                selector.close()
                return {"opened": opened, "closed": closed}
            selector.unregister(key.fileobj)
            assert isinstance(key.fileobj, socket.socket)
            key.fileobj.close()  # the server hung up on it: take its place again
            closed += 1
            open_one()


def hoard(state, path: str) -> dict:
    """Open watches, then send descriptors for tickets, until the server refuses; keep them."""
    state["watches"] = watches = []
    try:
        while True:
            watches.append(open_watch(path, 10))
    except BadRequest as exc:
        watch_refusal = str(exc)
    state["segment"] = segment = SharedSegment(4096)
    tickets = 0
    try:
        while True:
            tickets += len(send_fds(path, [segment.fd] * MAX_FDS_PER_MESSAGE, 10))
    except BadRequest as exc:
        ticket_refusal = str(exc)
    return {"watches": len(watches), "watch_refusal": watch_refusal, "tickets": tickets,
            "ticket_refusal": ticket_refusal}


def test_a_worker_registers_every_time_while_another_uid_floods_the_fd_channel(server, agents):
    path = str(server.runtime_dir / "fd.sock")
    flooders = [agents(f"flooder{i}", uid=NOBODY) for i in range(FLOODERS)]
    for flooder in flooders:
        flooder.send(flood, path, SOCKETS)
    for flooder in flooders:
        assert flooder.wait_progress(lambda report: report == "flooding") == "flooding"
    registered = 0
    with server.client(timeout=10) as worker, \
            new_cache(2 * BLOCKS_PER_CHUNK, 7, W2) as cache:
        for _ in range(TRIES):  # each: a watch, a ticket and REGISTER_KV_CACHE
            registration = worker.register_kv_cache(cache.handles(), model="flood-model",
                                                    layout="mha", block_size=16)
            assert registration.instance_id in worker._watches  # its watch got in too
            worker.unregister(registration)
            registered += 1
    bystander_round_trip(server, 40)
    for flooder in flooders:
        flooder.conn.send("stop")
    reports = [flooder.result() for flooder in flooders]
    assert registered == TRIES
    # The flood was real: the server took every flooder's connections, and kept closing them.
    for report in reports:
        assert report["opened"] > SOCKETS and report["closed"] > 0, report
    server.check_alive()


def test_one_uid_cannot_take_every_watch_or_ticket(server, agents):
    path = str(server.runtime_dir / "fd.sock")
    hoarder = agents("hoarder", uid=NOBODY)
    held = hoarder.run(hoard, path)
    assert held["watches"] == MAX_WATCHES_PER_UID
    assert held["watch_refusal"].endswith(f"refused the watch: uid {NOBODY} holds "
                                          f"{MAX_WATCHES_PER_UID} watches already "
                                          f"(MAX_WATCHES_PER_UID): close the ones no "
                                          f"registration uses"), held
    assert held["tickets"] == MAX_PENDING_TICKETS_PER_UID
    assert "(MAX_PENDING_TICKETS_PER_UID)" in held["ticket_refusal"], held
    # This process's uid still gets its watch and its tickets.
    with server.client(timeout=10) as worker, \
            new_cache(2 * BLOCKS_PER_CHUNK, 8, W2) as cache:
        registration = worker.register_kv_cache(cache.handles(), model="flood-model",
                                                layout="mha", block_size=16)
        assert registration.instance_id in worker._watches
        worker.unregister(registration)
    bystander_round_trip(server, 41)
    server.check_alive()
