"""Registered worker memory is counted as docs/protocol.md says: each registration counts
its memfds' extents against MAX_REGISTERED_BYTES_PER_CONNECTION, so the same memfd
registered twice counts twice (the server maps it twice), and unregistering gives it back."""

from __future__ import annotations

import fcntl
import os
import re

from lmcache_mp import protocol
from lmcache_mp.fdpass import send_fds
from lmcache_mp.spawn import ServerProcess

from .document import section
from .wire import call, fd_socket, refused, session

BLOCK_BYTES = 16 * 256 * 2  # an MLA block of 16 tokens × 256 float16


def sparse_memfd(size: int) -> int:
    """A sealed memfd of `size` bytes that hold no data: the server faults nothing in."""
    fd = os.memfd_create("lmcache-mp-doc-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def test_the_document_says_a_memfd_registered_twice_counts_twice() -> None:
    limits = " ".join(section("## Limits"))
    assert "the same memfd registered twice counts twice (the server maps it twice)" in limits
    register = " ".join(" ".join(section("### `REGISTER_KV_CACHE`")).split())
    assert re.search(r"once per registration: the same memfd registered twice counts twice",
                     register)


def test_the_same_memfd_registered_twice_counts_twice(server: ServerProcess) -> None:
    size = protocol.MAX_REGISTERED_BYTES_PER_CONNECTION * 3 // 4  # two do not fit
    fd = sparse_memfd(size)
    try:
        with session(server) as sock:
            binding = call(sock, 1, "HELLO", {"protocol_version": 2})["fd_binding"]

            def register(n: int) -> dict:
                (ticket,) = send_fds(fd_socket(server), [fd], 10, binding)
                return {"model": "doc-registered-bytes", "kv_world_size": 1, "kv_worker_id": 0,
                        "layout": "mla", "block_size": 16, "layers": [
                            {"kind": "memfd", "ticket": ticket, "offset": 0,
                             "shape": [size // BLOCK_BYTES, 16, 256], "strides": [4096, 256, 1],
                             "dtype": "float16", "name": f"same-{n}"}]}

            first = call(sock, 2, "REGISTER_KV_CACHE", register(1))["instance_id"]
            assert refused(sock, 3, "REGISTER_KV_CACHE", register(2)) == {
                "code": "bad_request",
                "message": f"`layers`: this connection has {size} bytes of worker memory "
                           f"registered; {size} more would pass "
                           f"MAX_REGISTERED_BYTES_PER_CONNECTION "
                           f"({protocol.MAX_REGISTERED_BYTES_PER_CONNECTION}): unregister a "
                           f"cache first"}
            assert call(sock, 4, "UNREGISTER_KV_CACHE", {"instance_id": first}) == {}
            again = call(sock, 5, "REGISTER_KV_CACHE", register(3))["instance_id"]
            assert call(sock, 6, "UNREGISTER_KV_CACHE", {"instance_id": again}) == {}
    finally:
        os.close(fd)
