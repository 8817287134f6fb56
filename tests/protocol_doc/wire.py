"""A real server for the protocol document's tests, and raw connections to it: sessions, calls,
refusals, fd-channel tickets and replays of documented exchanges."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import msgpack
import zmq

from lmcache_mp import protocol, runtime
from lmcache_mp.client import SharedKVCache
from lmcache_mp.fdpass import send_fds
from lmcache_mp.spawn import ServerProcess

from ..utils import rid, run_server
from .document import (
    bind,
)

REPLY_TIMEOUT_MS = 10_000
HELLO_ID = 999  # the request id the helpers' HELLO uses, apart from the tests' own ids


# ---------------------------------------------------------------------------
# A real server, and raw connections to it.

SERVER_CPU_SIZE = "64MiB"  # the pool of every server these tests start


@contextlib.contextmanager
def running_server(*args: str, url: str | None = None) -> Iterator[ServerProcess]:
    """`python -m lmcache_mp.server` with its own runtime directory (its default ipc://
    endpoint unless `url`); SIGTERM at the end must exit 0."""
    with run_server("--cpu-size", SERVER_CPU_SIZE, *args, url=url) as server:
        yield server


def fd_socket(server: ServerProcess) -> str:
    return str(server.runtime_dir / runtime.FD_SOCKET_NAME)


@contextlib.contextmanager
def dealer(url: str, identity: bytes | None = None) -> Iterator[zmq.Socket]:
    """A raw DEALER that has said nothing yet (no session)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(url)
    try:
        yield sock
    finally:
        sock.close()
        context.term()


def exchange(sock: zmq.Socket, frames: list[bytes]) -> tuple[bytes, bytes, Any]:
    sock.send_multipart(frames)
    assert sock.poll(REPLY_TIMEOUT_MS), f"no reply to {frames[:2]}"
    reply = sock.recv_multipart()
    assert len(reply) == 3, reply
    return reply[0], reply[1], msgpack.unpackb(reply[2], raw=False)


def call(sock: zmq.Socket, n: int, op: str, payload: dict[str, Any]) -> Any:
    """Send one request; return the payload of its `ok` reply (an `err` reply fails the test)."""
    got_id, status, reply = exchange(sock, [rid(n), op.encode(), msgpack.packb(payload)])
    assert (got_id, status) == (rid(n), b"ok"), (op, payload, reply)
    return reply


def refused(sock: zmq.Socket, n: int, op: str, payload: Any, raw: bool = False) -> dict:
    """Send one request that must be refused; return its error map."""
    got_id, status, reply = exchange(
        sock, [rid(n), op.encode(), payload if raw else msgpack.packb(payload)])
    assert (got_id, status) == (rid(n), b"err"), (op, reply)
    assert set(reply) == {"code", "message"} and reply["message"], reply
    return reply


def hello(sock: zmq.Socket, token: str = "", engine: str = "", n: int = HELLO_ID,
          client_name: str = "") -> dict:
    """Open the connection's session; returns HELLO's reply."""
    return call(sock, n, "HELLO", {"protocol_version": protocol.PROTOCOL_VERSION,
                                   "client_name": client_name, "token": token, "engine": engine})


@contextlib.contextmanager
def session(server: ServerProcess, admin: bool = False, engine: str = "",
            identity: bytes | None = None) -> Iterator[zmq.Socket]:
    """A raw DEALER that said HELLO: an engine session, or an admin one."""
    with dealer(server.url, identity) as sock:
        reply = hello(sock, server.token(admin=True) if admin else "", engine)
        assert reply["role"] == ("admin" if admin else "engine")
        yield sock


def ticket_for(path: str, kv: SharedKVCache, binding: bytes = b"") -> bytes:
    (ticket,) = send_fds(path, [kv.segment.fd], timeout=5, binding=binding)
    return ticket


def wire_handles(kv: SharedKVCache, path: str) -> list[dict[str, Any]]:
    """kv's layer handles, as a map each, with a fresh ticket for its segment."""
    ticket = ticket_for(path, kv)
    return [dict(dataclasses.asdict(h), ticket=ticket) for h in kv.handles()]


def replay(sock: zmq.Socket, messages: list[tuple[str, bytes, str, Any]]) -> None:
    """Send each `C:` message and check that the reply is exactly the `S:` message after it."""
    assert [m[0] for m in messages] == ["C", "S"] * (len(messages) // 2)
    for (_, request_id, op, request), (_, reply_id, status, expected) in zip(
            messages[0::2], messages[1::2]):
        assert reply_id == request_id
        got_id, got_status, got = exchange(
            sock, [request_id, op.encode(), msgpack.packb(request, use_bin_type=True)])
        assert (got_id, got_status.decode(), got) == (request_id, status, expected), op


def check_reply(op: str, got: Any, expected: Any, bound: dict[str, Any]) -> None:
    """`got` is `expected` once its placeholders are bound; HELLO's server_version is the
    server's own (any str)."""
    if op == "HELLO" and isinstance(got, dict) and "server_version" in got:
        got = dict(got)
        assert isinstance(got.pop("server_version"), str)
        expected = {k: v for k, v in expected.items() if k != "server_version"}
    assert got == bind(expected, got, bound), op


def fixed_identity_dealer(context: zmq.Context, url: str, identity: bytes) -> zmq.Socket:
    """A DEALER with `identity` that the server answers (it ignores an identity still connected)."""
    for attempt in range(20):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(url)
        sock.send_multipart([rid(1000 + attempt), b"PING", msgpack.packb({})])
        if sock.poll(500):
            assert sock.recv_multipart()[1] == b"ok"
            return sock
        sock.close()
    raise AssertionError(f"the server never answered identity {identity!r}")
