"""The fd channel works as docs/protocol.md says: it takes sealed memfds, refuses everything
else with the documented answers, and its tickets are single-use."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import socket
from pathlib import Path
from typing import Any

import msgpack

from lmcache_mp import protocol
from lmcache_mp.client import SharedKVCache
from lmcache_mp.fdpass import BOUND_FD_CHANNEL_MAGIC, FD_CHANNEL_MAGIC
from lmcache_mp.spawn import ServerProcess

from .document import (
    section,
)
from .wire import (
    call,
    fd_socket,
    hello,
    refused,
    session,
    ticket_for,
    wire_handles,
)

# ---------------------------------------------------------------------------
# The fd channel.

def _fd_channel_request(path: str, fds: list[int], data: bytes = FD_CHANNEL_MAGIC) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(path)
        socket.send_fds(sock, [data], fds)
        reply = sock.recv(4096)
        assert sock.recv(4096) == b"", "one exchange per connection"
    return msgpack.unpackb(reply, raw=False)


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("doc-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_the_fd_channel_works_as_documented(server: ServerProcess, tmp_path: Path) -> None:
    channel = re.sub(r"\s+", " ", " ".join(section("## The fd channel")))
    assert f"exactly the 16 ASCII bytes `{FD_CHANNEL_MAGIC.decode()}`" in channel
    assert len(FD_CHANNEL_MAGIC) == 16 and "`AF_UNIX`, `SOCK_SEQPACKET`" in channel
    assert (f"the 16 ASCII bytes `{BOUND_FD_CHANNEL_MAGIC.decode()}` followed by the "
            f"session's {protocol.BINDING_BYTES}-byte `fd_binding`") in channel
    assert len(BOUND_FD_CHANNEL_MAGIC) == 16
    assert f"each is {protocol.TICKET_BYTES} random bytes" in channel
    path = fd_socket(server)
    with session(server) as sock:
        reply = call(sock, 1, "HELLO", {"protocol_version": 2})
        assert reply["fd_socket"] == path and len(reply["fd_binding"]) == protocol.BINDING_BYTES
    assert os.stat(path).st_mode & 0o777 == 0o600

    good = _memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    shrink_only = _memfd(4096, fcntl.F_SEAL_SHRINK)
    unsealed = _memfd(4096, 0)
    write_sealed = _memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    empty = _memfd(0, fcntl.F_SEAL_SHRINK)
    read_only = os.open(f"/proc/self/fd/{good}", os.O_RDONLY)
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(regular, 4096)
    pipe_r, pipe_w = os.pipe()
    opened = [good, shrink_only, unsealed, write_sealed, empty, read_only, regular, pipe_r, pipe_w]
    try:
        answer = _fd_channel_request(path, [good, shrink_only])
        assert list(answer) == ["tickets"] and len(answer["tickets"]) == 2
        assert all(type(t) is bytes and len(t) == protocol.TICKET_BYTES for t in answer["tickets"])
        for fds, data, why in [
                ([unsealed], FD_CHANNEL_MAGIC, "F_SEAL_SHRINK"),
                ([regular], FD_CHANNEL_MAGIC, "F_SEAL_SHRINK"),
                ([pipe_r], FD_CHANNEL_MAGIC, "pipe"),
                ([write_sealed], FD_CHANNEL_MAGIC, "F_SEAL_WRITE"),
                ([read_only], FD_CHANNEL_MAGIC, "reading and writing"),
                ([empty], FD_CHANNEL_MAGIC, "empty"),
                ([good, unsealed], FD_CHANNEL_MAGIC, "fd 1"),
                ([good], b"lmcache-mp-fds/0", "not an fd channel request"),
                ([good] * (protocol.MAX_FDS_PER_MESSAGE + 1), FD_CHANNEL_MAGIC,
                 "did not all arrive"),
                ([], FD_CHANNEL_MAGIC, "no descriptors")]:
            answer = _fd_channel_request(path, fds, data)
            assert list(answer) == ["error"] and why in answer["error"], (why, answer)

        # A bound ticket serves its engine: another engine's REGISTER is refused, and the
        # ticket stays valid for its own.
        assert "unknown fd_binding" in _fd_channel_request(
            path, [good], BOUND_FD_CHANNEL_MAGIC + bytes(protocol.BINDING_BYTES))["error"]
        assert "spends none of its tickets" in channel
        kv = SharedKVCache("mla", num_layers=2, num_blocks=8, block_size=128, heads=1, head_dim=8)
        try:
            with session(server, engine="fd-engine") as owner, \
                    session(server, engine="fd-other") as other:
                binding = hello(owner, engine="fd-engine", n=1)["fd_binding"]
                (bound,) = _fd_channel_request(path, [kv.segment.fd],
                                               BOUND_FD_CHANNEL_MAGIC + binding)["tickets"]
                register: dict[str, Any] = {
                    "model": "fd-model", "kv_world_size": 1, "kv_worker_id": 0,
                    "layout": "mla", "block_size": 128, "layers": [
                        dict(dataclasses.asdict(h), ticket=bound) for h in kv.handles()]}
                err = refused(other, 2, "REGISTER_KV_CACHE", register)
                assert err["code"] == "bad_request" and "another engine" in err["message"]
                reg = call(owner, 2, "REGISTER_KV_CACHE", register)
                assert call(owner, 3, "UNREGISTER_KV_CACHE",
                            {"instance_id": reg["instance_id"]}) == {}
            register = {"model": "fd-model", "kv_world_size": 1, "kv_worker_id": 0,
                        "layout": "mla", "block_size": 128,
                        "layers": wire_handles(kv, path)}  # both layers: one ticket
            assert len({h["ticket"] for h in register["layers"]}) == 1
            with session(server) as sock:
                reg = call(sock, 2, "REGISTER_KV_CACHE", register)
                err = refused(sock, 3, "REGISTER_KV_CACHE", register)
                assert err["code"] == "bad_request"
                assert err["message"].startswith("`layers[0].ticket`: unknown or expired ticket")
                short = dict(register, layers=[dict(h, ticket=b"x" * 17)
                                               for h in register["layers"]])
                refusal = refused(sock, 4, "REGISTER_KV_CACHE", short)
                assert "expected 16 bytes" in refusal["message"]
                named = dict(register, layers=[dict(h, ticket=ticket_for(path, kv), name="n" * 257)
                                               for h in register["layers"]])
                assert refused(sock, 5, "REGISTER_KV_CACHE", named)["message"] == \
                    f"`layers[0].name`: at most {protocol.MAX_NAME_CHARS} characters, got 257"
                assert call(sock, 6, "UNREGISTER_KV_CACHE",
                            {"instance_id": reg["instance_id"]}) == {}
        finally:
            kv.close()
    finally:
        for fd in opened:
            os.close(fd)
