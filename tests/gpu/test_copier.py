"""On a GPU: the stream copier's streams are each a lane's own, past torch's pool of 32."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lmcache_mp.server.copy.device import CudaDevice

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA GPU and cupy"),
]


def test_lanes_keep_their_own_streams_past_torchs_pool():
    """Two streams a lane, 40 lanes on one GPU: all distinct. torch.cuda.Stream() would
    hand out its 32 pooled streams again (the control), and two lanes would share one."""
    device = torch.device("cuda", 0)
    ours = [CudaDevice().new_stream(device) for _ in range(80)]
    assert len({stream.cuda_stream for stream in ours}) == 80
    pooled = [torch.cuda.Stream(device=device) for _ in range(40)]
    assert len({stream.cuda_stream for stream in pooled}) < 40
    # Our streams work as torch's: an event recorded on one completes.
    with torch.cuda.stream(ours[-1]):
        torch.ones(4, device=device).sum()
    event = CudaDevice().record(ours[-1])
    event.synchronize()
    assert event.query()
