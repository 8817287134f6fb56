"""On a GPU: memory CUDA IPC cannot share is refused by the worker, naming what to change.

cudaMalloc memory (torch's default caching allocator) is legacy-IPC capable; memory from a
stream-ordered pool (cudaMallocAsync) or a cuMem mapping (expandable_segments, vLLM's sleep
mode) is not, and cuda_ipc_handles must say so before it exports anything.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lmcache_mp.client.cuda import cuda_ipc_handles
from lmcache_mp.cuda import device_bytes, legacy_ipc_capable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA GPU and cupy"),
]

_EXPANDABLE_WORKER = """
import torch
from lmcache_mp.client.cuda import cuda_ipc_handles
layer = torch.empty(1 << 20, dtype=torch.float16, device="cuda:0")
try:
    cuda_ipc_handles([layer])
except ValueError as exc:
    print("REFUSED", exc)
else:
    print("EXPORTED")
"""


def test_cudamalloc_memory_is_capable_and_pool_memory_is_refused():
    import cupy

    layer = torch.empty(1 << 20, dtype=torch.float16, device="cuda:0")
    with torch.cuda.device(0):
        assert legacy_ipc_capable(layer.data_ptr())
    assert len(cuda_ipc_handles([layer])[0].ipc_handle) == 64
    with cupy.cuda.Device(0):
        pointer = cupy.cuda.runtime.mallocAsync(1 << 20, 0)
        try:
            assert not legacy_ipc_capable(pointer)
            pooled = device_bytes(cupy, pointer, 1 << 20, 0)
            with pytest.raises(ValueError, match="tensor 0 lies in GPU memory that CUDA IPC "
                                                 "cannot share"):
                cuda_ipc_handles([pooled])
            del pooled
        finally:
            cupy.cuda.runtime.freeAsync(pointer, 0)
            cupy.cuda.runtime.deviceSynchronize()


def test_expandable_segments_are_refused_with_the_setting_to_change():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    done = subprocess.run([sys.executable, "-c", _EXPANDABLE_WORKER], env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("REFUSED tensor 0 lies in GPU memory"), done.stdout
    assert "expandable_segments:False" in done.stdout
