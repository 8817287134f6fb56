"""On a GPU, without CUDA IPC: the dispatcher and the stream copier on real streams in one process.

tests/server/copy/test_streams.py's Rig (the server's registry, store, pool, dispatcher and
StreamCopier) with the real CudaDevice, and "IPC allocations" that are this process's own
CUDA memory: everything of the GPU path but the IPC calls themselves, so gpu_check.sh
still runs it where a sandbox refuses IPC between processes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect

import pytest
import torch

from lmcache_mp.protocol import RetrieveRequest, StoreRequest, StoreStatus, TransferItem
from lmcache_mp.server.copy.device import CudaDevice

from ..server.copy.test_streams import CLIENT, Rig, blocks
from ..workers import prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA GPU and cupy"),
]


class CudaRig(Rig):
    """The Rig on CudaDevice, its worker allocations on cuda:0."""

    def __init__(self):
        # The real Device where the Rig expects its fake: the base class never calls what
        # only the fake has (release(), events), and run() below waits on real streams.
        super().__init__(device=CudaDevice())  # type: ignore[arg-type]

    def allocation(self, tag: int, nbytes: int, seed: int | None) -> bytes:
        handle = super().allocation(tag, nbytes, seed)
        self.memory[handle] = self.memory[handle].to("cuda:0")
        return handle

    def run(self, op: str, request):
        pending = self.dispatcher.handle(CLIENT, op, request)
        assert inspect.iscoroutine(pending), f"{op} is answered at once"
        return asyncio.run(pending)


def test_store_retrieve_and_an_mla_fan_out_on_real_streams():
    rig = CudaRig()
    source_id, source = rig.register("mha", 1, seed=3)
    target_id, target = rig.register("mha", 2, seed=None)
    hashes = prompt(70, 2)
    assert rig.run("STORE", StoreRequest(source_id, [TransferItem.build(
        "w", hashes, list(range(16, 48)))])).results == [bytes([StoreStatus.STORED] * 2)]
    assert rig.run("RETRIEVE", RetrieveRequest(target_id, [TransferItem.build(
        "r", hashes, list(range(63, 31, -1)))])).retrieved == [2]
    assert torch.equal(blocks([t.cpu() for t in target], list(range(63, 31, -1)), 1),
                       blocks([s.cpu() for s in source], list(range(16, 48)), 1))
    leader_id, leader = rig.register("mla", 3, seed=5)
    _, follower = rig.register("mla", 4, seed=None, tp_rank=1)
    mla = prompt(71, 1)
    rig.run("STORE", StoreRequest(leader_id, [TransferItem.build("w", mla, list(range(16)))]))
    assert rig.run("RETRIEVE", RetrieveRequest(leader_id, [TransferItem.build(
        "g", mla, list(range(32, 48)))])).retrieved == [1]
    expected = blocks([layer.cpu() for layer in leader], list(range(16)), 0)
    assert torch.equal(blocks([layer.cpu() for layer in follower], list(range(32, 48)), 0),
                       expected)
    rig.copier.shutdown()
