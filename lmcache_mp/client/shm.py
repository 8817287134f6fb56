"""Worker KV caches in POSIX shared memory, so the server can copy blocks without the socket."""

from __future__ import annotations

import os
import uuid
from multiprocessing import shared_memory

import torch

from ..protocol import ShmHandle

SEGMENT_PREFIX = "lmcache_mp_"


def layer_shape(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int
                ) -> tuple[int, ...]:
    """vLLM's per-layer shapes: MHA [2, blocks, block_size, heads, head_dim], MLA [blocks, block_size, dim]."""
    if layout == "mha":
        return (2, num_blocks, block_size, heads, head_dim)
    if layout == "mla":
        if heads != 1:
            raise ValueError(f"an MLA cache has one latent vector per token: heads must be 1, got {heads}")
        return (num_blocks, block_size, head_dim)
    raise ValueError(f"layout must be 'mha' or 'mla', got {layout!r}")


class SharedKVCache:
    """A paged KV cache whose layers live back to back in one shared-memory segment.

    The segment is unlinked by close(), and by Python's resource tracker if the process
    dies first. Drop every reference to `layers` before close().
    """

    def __init__(self, layout: str, num_layers: int, num_blocks: int, block_size: int,
                 heads: int, head_dim: int, dtype: torch.dtype = torch.float16):
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        shape = layer_shape(layout, num_blocks, block_size, heads, head_dim)
        elements = 1
        for dim in shape:
            elements *= dim
        layer_bytes = elements * dtype.itemsize
        self._segment = shared_memory.SharedMemory(
            name=f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}",
            create=True, size=layer_bytes * num_layers)
        whole = torch.frombuffer(self._segment.buf, dtype=dtype)
        self.layers: list[torch.Tensor] = list(whole.view(num_layers, *shape).unbind(0))
        self._handles = [
            ShmHandle(name=self._segment.name, offset=i * layer_bytes, shape=list(shape),
                      strides=list(layer.stride()), dtype=str(dtype).removeprefix("torch."))
            for i, layer in enumerate(self.layers)]
        del whole

    @property
    def name(self) -> str:
        return self._segment.name

    def handles(self) -> list[ShmHandle]:
        return list(self._handles)

    def block_dim(self) -> int:
        return 1 if self.layout == "mha" else 0

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the given blocks of every layer, stacked: handy for comparing bytes."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        return torch.stack([layer.index_select(self.block_dim(), ids) for layer in self.layers])

    def close(self) -> None:
        if not self.layers and self._segment.buf is None:
            return
        self.layers = []
        self._segment.close()
        self._segment.unlink()

    def __enter__(self) -> SharedKVCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
