"""Tickets bound to their maker: a ticket the fd channel issued serves only sessions of the
uid that sent the descriptor and, asked for with a session's fd_binding, of that
session's engine. A thief of another uid, or of the same uid and another engine, that
learns a ticket registers nothing with it, and the ticket stays the victim's.

The thief runs as `nobody` against a root server that lets `nogroup` connect; the victim
is this test process, whose bytes must come back exact.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from lmcache_mp.client import LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.fdpass import send_fds
from lmcache_mp.protocol import RegisterKVCacheRequest

from ..utils import free_port, run_server
from ..workers import BLOCKS_PER_CHUNK, MODEL, W2, chunk_blocks, prompt
from .agents import NOBODY, RawClient, group_server, new_cache, raw_bytes
from .test_mapped_memory import sparse_memfd

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run a process as "
                                                           "nobody, and to chgrp)")
STORED = bytes([StoreStatus.STORED])
KEPT = "refused, and the ticket kept for the session it serves"


@pytest.fixture(scope="module")
def server():
    with group_server("--cpu-size", "64MiB") as srv:
        yield srv


def register_request(cache, ticket: bytes) -> RegisterKVCacheRequest:
    """The REGISTER_KV_CACHE of the whole cache, naming its segment by `ticket`."""
    return RegisterKVCacheRequest(MODEL, 1, 0, "mha", 16, [
        dataclasses.replace(h, ticket=ticket) for h in cache.handles()])


def wire(request: RegisterKVCacheRequest) -> dict:
    return dataclasses.asdict(request)


def steal(state, url: str, requests: dict[str, dict], binding: bytes) -> dict:
    """The thief, on a session of its own: REGISTER each request (the victim's handles and
    a ticket it learnt), and ask for a ticket of its own memory under the victim's binding."""
    outcomes: dict[str, Any] = {}
    with RawClient(url) as raw:
        hello = raw.hello(engine="thief-engine")
        for label, request in requests.items():
            status, reply = raw.call("REGISTER_KV_CACHE", request)
            outcomes[label] = (status, reply.get("code"), reply.get("message", reply))
        fd = sparse_memfd(4096)
        try:
            outcomes["own memfd, the victim's binding"] = \
                f"TICKETED {send_fds(hello['fd_socket'], [fd], 10, binding)}"
        except BadRequest as exc:
            outcomes["own memfd, the victim's binding"] = str(exc)
        finally:
            os.close(fd)
        outcomes["instances"] = raw.call("STATS", {})[1]["instances"]
    return outcomes


def round_trip(client, registration, cache, tag: int) -> None:
    """STORE two chunks from the cache's blocks 0-1, RETRIEVE them into blocks 3-2: the bytes
    land exact."""
    hashes = prompt(tag, 2)
    assert client.store(registration, [TransferItem.build(
        f"t{tag}", hashes, chunk_blocks([0, 1]))]) == [STORED * 2]
    assert client.lookup(MODEL, 1, [LookupItem.build(f"t{tag}", hashes, hold=True)]) == [2]
    assert client.retrieve(registration, [TransferItem.build(
        f"t{tag}", hashes, chunk_blocks([3, 2]))]) == [2]
    assert raw_bytes(cache.blocks(chunk_blocks([3, 2]))) == \
        raw_bytes(cache.blocks(chunk_blocks([0, 1])))


def test_a_stolen_ticket_registers_nothing_and_stays_the_victims(server, outsider):
    with server.client(engine="victim-engine", timeout=10) as victim, \
            server.client(engine="neighbour-engine", timeout=10) as neighbour, \
            new_cache(4 * BLOCKS_PER_CHUNK, 21, W2) as cache:
        hello = victim.hello()
        (bound,) = send_fds(hello.fd_socket, [cache.segment.fd], 10, hello.fd_binding)
        (unbound,) = send_fds(hello.fd_socket, [cache.segment.fd], 10)  # version 1: a uid's
        outcomes = outsider.run(steal, server.url, {
            "the bound ticket": wire(register_request(cache, bound)),
            "the unbound ticket": wire(register_request(cache, unbound))}, hello.fd_binding)
        assert outcomes.pop("instances") == []  # the thief registered nothing
        assert outcomes == {
            label: (b"err", "bad_request", f"`layers[0].ticket`: another uid sent its memfd; a "
                                           f"ticket serves only sessions of the uid that sent "
                                           f"the descriptor ({KEPT})")
            for label in ("the bound ticket", "the unbound ticket")} | {
            "own memfd, the victim's binding": (
                f"the fd channel at {hello.fd_socket} refused the descriptors: the fd_binding "
                f"belongs to a session of another uid than this sender's ({NOBODY}): send "
                f"your own session's")}
        # The same uid, another engine: the bound ticket is not its either.
        with pytest.raises(BadRequest, match=f"it was issued to a session of another engine; "
                                             rf"a ticket serves only the engine whose "
                                             rf"fd_binding asked for it \({KEPT}\)"):
            neighbour.rpc.call(register_request(cache, bound))
        # Refused every time, and never spent: the victim registers with both, and its bytes
        # go out and come back exact.
        for ticket, tag in ((bound, 70), (unbound, 71)):
            registration = victim.register(register_request(cache, ticket))
            round_trip(victim, registration, cache, tag)
            victim.unregister(registration)
        with pytest.raises(BadRequest, match="unknown or expired ticket"):  # now they are
            victim.rpc.call(register_request(cache, bound))
    server.check_alive()


def test_on_tcp_a_ticket_needs_its_engine_since_the_uid_is_unknown():
    with run_server(url=f"tcp://127.0.0.1:{free_port()}") as server, \
            server.client(engine="tcp-engine", timeout=10) as worker, \
            server.client(engine="tcp-other", timeout=10) as other, \
            new_cache(4 * BLOCKS_PER_CHUNK, 22, W2) as cache:
        hello = worker.hello()
        assert len(hello.fd_binding) == 16
        (unbound,) = send_fds(hello.fd_socket, [cache.segment.fd], 10)
        with pytest.raises(BadRequest, match="it is bound to no engine .* and this session's uid "
                                             r"is unknown \(tcp://\)"):
            worker.rpc.call(register_request(cache, unbound))
        (bound,) = send_fds(hello.fd_socket, [cache.segment.fd], 10, hello.fd_binding)
        with pytest.raises(BadRequest, match="issued to a session of another engine"):
            other.rpc.call(register_request(cache, bound))
        registration = worker.register_kv_cache(  # what CacheClient does by itself
            cache.handles(), model=MODEL, layout="mha", block_size=16)
        round_trip(worker, registration, cache, 72)
        worker.unregister(registration)
