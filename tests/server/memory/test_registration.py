"""cuda_ipc registration off the event loop: a slow IPC open holds up nobody else's replies.

The Rig of copy/test_streams.py (the server's registry, store and dispatcher on a fake device)
with the server's MappingThread, and an "IPC open" that blocks until the test lets it go:
while it blocks, the loop must serve another client and the registering client's own
other requests. Nothing is timed: the open waits for the test, not for a clock, and a loop
that ran it itself would never get to the other request (the open's bound would expire).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from lmcache_mp.errors import InternalError
from lmcache_mp.protocol import CudaIpcHandle, LookupItem, LookupRequest, RegisterKVCacheRequest
from lmcache_mp.server.memory.cuda_ipc import CudaIpcSupport, MappingThread, SharedAllocations

from ..copy.test_streams import BLOCK, CLIENT, UUID, Rig, answered

OTHER = b"another client"
_BOUND_S = 30.0  # how long the open waits for the test before it gives up


class SlowOpen:
    """An IPC open that blocks until release(); records what the loop did meanwhile."""

    def __init__(self, rig: Rig):
        self.rig, self.started, self.go = rig, threading.Event(), threading.Event()
        self.released_in_time: bool | None = None

    def __call__(self, handle: bytes, index: int):
        self.started.set()
        self.released_in_time = self.go.wait(_BOUND_S)
        return self.rig.open_allocation(handle, index)


def _rig(timeout: float) -> tuple[Rig, SlowOpen, MappingThread]:
    rig = Rig()
    rig.sessions.open(OTHER, "", "another engine")
    slow, thread = SlowOpen(rig), MappingThread(timeout)
    rig.shared = SharedAllocations(slow, thread.close_later)
    rig.registry.cuda_ipc = CudaIpcSupport(rig.shared.open, lambda uuid: 0, rig.copier.new_lane,
                                           thread)
    return rig, slow, thread


def _request(rig: Rig) -> RegisterKVCacheRequest:
    handle = rig.allocation(9, 4096 + 64 * BLOCK * 64 * 2, seed=1)
    return RegisterKVCacheRequest("m", 1, 0, "mla", BLOCK, [CudaIpcHandle(
        handle, 4096, UUID, [64, BLOCK, 64], [BLOCK * 64, 64, 1], "float16")])


def _lookup(rig: Rig, client: bytes) -> int:
    return answered(rig.dispatcher.handle(client, "LOOKUP", LookupRequest(
        "m", 1, [LookupItem.build("q", [b"\x01" * 16])]))).hits[0]


def test_a_slow_ipc_open_holds_up_no_other_reply():
    rig, slow, thread = _rig(timeout=60.0)

    async def scenario():
        registering = asyncio.ensure_future(rig.dispatcher.handle(
            CLIENT, "REGISTER_KV_CACHE", _request(rig)))
        await asyncio.get_running_loop().run_in_executor(None, slow.started.wait)
        # The open is blocked on the mapping thread: the loop answers others meanwhile,
        # the registering client too.
        assert (_lookup(rig, OTHER), _lookup(rig, CLIENT)) == (0, 0)
        assert not registering.done() and len(rig.registry) == 0
        slow.go.set()
        return await registering
    reply = asyncio.run(scenario())
    assert slow.released_in_time  # the open was let go by the test, not by its bound
    assert rig.registry.get(reply.instance_id, CLIENT).lane is not None
    rig.registry.unregister(reply.instance_id)
    thread.shutdown()  # the close ran on the mapping thread, after the open
    assert [entry[0] for entry in rig.log] == ["open", "close"]


def test_a_registration_waits_for_its_mapping_only_so_long_and_closes_a_late_one():
    rig, slow, thread = _rig(timeout=0.05)

    async def scenario():
        with pytest.raises(InternalError, match="did not map the KV cache within 0.05 s"):
            await rig.dispatcher.handle(CLIENT, "REGISTER_KV_CACHE", _request(rig))
    asyncio.run(scenario())
    assert len(rig.registry) == 0 and rig.log == []
    slow.go.set()
    thread.shutdown()  # the late open, then its close
    assert [entry[0] for entry in rig.log] == ["open", "close"] and len(rig.shared) == 0
