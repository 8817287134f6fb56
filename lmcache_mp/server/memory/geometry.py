"""What a stored chunk looks like (Geometry), and the dtypes and layouts a cache may have."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# tensor rank of one layer; "state": a recurrent layer's state (Mamba, linear attention),
# one block of `state_size` per chunk, the state after the chunk's last token
LAYOUTS = {"mha": 5, "mla": 3, "state": 2}

DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "uint8", "int8",
    "float8_e4m3fn", "float8_e5m2")}
# Copies move bytes, never values: through an integer view of the same item size, so that
# every dtype takes the same kernels (CUDA has no index_copy_ for float8, for one).
RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory, shape and strides, as integers of the same item size."""
    return tensor.view(RAW_DTYPES[tensor.element_size()])


@dataclass(frozen=True)
class Geometry:
    """What a stored chunk looks like; chunks only move between caches of equal geometry."""

    layout: str
    num_layers: int
    # one block of one layer: (2, block_size, heads, head_dim), (block_size, dim) for MLA,
    # (state_size,) for a state
    block_shape: tuple[int, ...]
    dtype: str
    blocks_per_chunk: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        if self.layout == "mha":
            kv, block_size, *rest = self.block_shape
            return (self.num_layers, kv, self.blocks_per_chunk, block_size, *rest)
        return (self.num_layers, self.blocks_per_chunk, *self.block_shape)

    @property
    def chunk_bytes(self) -> int:
        n = self.itemsize
        for dim in self.chunk_shape:
            n *= dim
        return n

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.chunk_bytes // self.blocks_per_chunk

    @property
    def block_dim(self) -> int:
        """Index of the block dimension in a layer tensor."""
        return 1 if self.layout == "mha" else 0
