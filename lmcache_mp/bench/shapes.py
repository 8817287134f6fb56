"""The KV-cache shapes every benchmark uses (docs/benchmarks.md, "Benchmark workloads").

Torch-free: a dtype is torch's name for it, so that the CLI checks --shape without
importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..sizes import format_size

MiB = 1024**2
DTYPE_BYTES = {"float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVShape:
    """One model's paged KV cache, per rank: what a chunk of it weighs."""

    name: str
    layout: str  # "mha" (K and V per layer) or "mla" (one latent vector per token)
    layers: int
    heads: int  # 1 under MLA
    head_dim: int  # the latent dimension under MLA
    dtype: str  # torch's name: getattr(torch, dtype)
    block_size: int = 16
    chunk_size: int = 256

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def chunk_bytes(self) -> int:
        kv = 2 if self.layout == "mha" else 1
        return (kv * self.layers * self.chunk_size * self.heads * self.head_dim
                * DTYPE_BYTES[self.dtype])

    def describe(self) -> str:
        per_token = (f"{self.heads}×{self.head_dim}" if self.layout == "mha"
                     else str(self.head_dim))
        return (f"{self.name}: {self.layout.upper()} {self.layers} layers, {per_token}, "
                f"{self.dtype}, block {self.block_size}, chunk {self.chunk_size} "
                f"({format_size(self.chunk_bytes)} a chunk)")


SHAPES = {shape.name: shape for shape in (
    KVShape("W1", "mha", 32, 8, 128, "float16"),
    KVShape("W2", "mha", 4, 2, 64, "float16"),
    KVShape("W3", "mla", 32, 1, 576, "bfloat16"),
    KVShape("8KiB", "mha", 1, 1, 8, "float16"),  # the smallest chunks: costs per chunk
)}
