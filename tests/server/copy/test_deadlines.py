"""budget_ms on the GPU copy path: nothing is queued on the device after a request's deadline.

(The CPU copy path is tested against a real server in tests/server/ops/test_transfers.py.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from lmcache_mp.protocol import RetrieveRequest, StoreRequest, StoreStatus, TransferItem

from ...workers import prompt
from .test_streams import CLIENT, Rig, blocks


async def answer(rig: Rig, pending) -> Any:
    """The reply to a request whose deadline, counted from dispatch, has passed before its
    first copy could be queued; the fake device finishes whatever was queued."""
    task = asyncio.ensure_future(pending)
    time.sleep(0.01)  # the loop is held: the 1 ms budget runs out before the task starts
    while not task.done():
        rig.device.release()
        await asyncio.sleep(0.001)
    return task.result()


def test_gpu_copies_are_never_queued_after_the_budget():
    rig = Rig()
    source_id, _ = rig.register("mha", 1, seed=3)
    target_id, target = rig.register("mha", 2, seed=None)
    hashes, source_blocks = prompt(1, 2), list(range(16, 48))

    def store(budget_ms: int):
        return rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
            source_id, [TransferItem.build("s", hashes, source_blocks)], budget_ms))

    reply = asyncio.run(answer(rig, store(1)))
    assert reply.results == [bytes([StoreStatus.EXPIRED, StoreStatus.NO_PREFIX])]
    assert rig.hits(hashes) == 0 and rig.store.pending == 0
    assert asyncio.run(answer(rig, store(0))).results == [bytes([StoreStatus.STORED] * 2)]

    reply = asyncio.run(answer(rig, rig.dispatcher.handle(CLIENT, "RETRIEVE", RetrieveRequest(
        target_id, [TransferItem.build("r", hashes, list(range(32)))], budget_ms=1))))
    assert reply.retrieved == [0]
    assert not blocks(target, list(range(32)), 1).any()
    rig.store.check_invariants()
