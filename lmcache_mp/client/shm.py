"""Worker KV caches in POSIX shared memory, so the server can copy blocks without the socket."""

from __future__ import annotations

import os
import uuid
from multiprocessing import shared_memory

import torch

from ..protocol import SHM_DIR, ShmHandle

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


def shm_handles(tensors: list[torch.Tensor]) -> list[ShmHandle]:
    """The handle of each CPU tensor whose memory lies in a POSIX shared-memory segment mapped
    into this process: a SharedKVCache layer, any strided view of one, or any other segment
    under /dev/shm. The segment is found through /proc/self/maps (Linux), read once.

    Raises ValueError naming the tensor (by position) and what is wrong: not on the CPU, or
    not in shared memory (plain torch allocations are private to the process, so the server
    cannot map them).
    """
    with open("/proc/self/maps") as maps:
        segments = []
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(SHM_DIR):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                segments.append((start, end, int(fields[2], 16), fields[5].rstrip("\n")))
    handles = []
    for i, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {i} is on {tensor.device}, not in CPU shared memory")
        address = tensor.data_ptr()
        found = [(address - start + file_offset, path) for start, end, file_offset, path
                 in segments if start <= address < end]
        if not found:
            raise ValueError(f"tensor {i} (shape {list(tensor.shape)}) is not in shared memory: "
                             f"its memory is mapped from no file under {SHM_DIR}")
        offset, path = found[0]
        name = path.removeprefix(SHM_DIR)
        if name.endswith(" (deleted)"):
            raise ValueError(f"tensor {i} lies in shared memory {name.removesuffix(' (deleted)')!r}"
                             f", which was unlinked: no other process can open it")
        last = sum((dim - 1) * stride for dim, stride in zip(tensor.shape, tensor.stride()))
        span = (last + 1) * tensor.itemsize
        size = os.stat(path).st_size
        if offset + span > size:
            raise ValueError(f"tensor {i} ends at byte {offset + span} of shared memory {name!r}, "
                             f"which holds {size} bytes")
        handles.append(ShmHandle(name=name, offset=offset, shape=list(tensor.shape),
                                 strides=list(tensor.stride()),
                                 dtype=str(tensor.dtype).removeprefix("torch.")))
    return handles
