"""A cache in CPU memory as rows of bytes, and the kernels that move them without the GIL."""

from __future__ import annotations

import math

import numpy as np
import torch

from ...protocol import SKIP_BLOCK
from .geometry import RAW_DTYPES, raw


def rows_view(tensor: torch.Tensor, dim: int, width: int) -> torch.Tensor | None:
    """The same memory as [outer, blocks, row] integers of `width` bytes (each block's
    bytes in one row), or None where its strides do not allow such a view."""
    shape = tensor.shape
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:]) * tensor.element_size()
    if inner % width or tensor.data_ptr() % width:
        return None
    try:
        rows = raw(tensor).view(outer, shape[dim], -1)
        return rows.view(RAW_DTYPES[width]) if rows.stride(2) == 1 else None
    except RuntimeError:  # the dimensions around `dim` do not merge without a copy
        return None


ROW_WIDTHS = (8, 4, 2, 1)


class HostRows:
    """A cache in CPU memory as numpy rows: runs of bytes contiguous both in the cache and
    in a chunk (a whole block of one layer's K or V when the layout allows, or its
    innermost dimension, as in vLLM's CPU layout with K and V interleaved). A request's
    copies then move each row with one memmove, from index arrays built once per request,
    with no torch view or op per chunk and block (W2's 512 KiB chunks spent more time on
    views than on their bytes; vLLM's CPU caches took a torch copy per block and layer).

    The rows lie in parts: one for a stacked cache, else one per layer, all of one layout.
    A chunk's bytes hold each part's rows in turn, in the chunk's own order."""

    MIN_ROW_BYTES = 64  # below this, rows cost more than torch's strided copies
    # From here up, scatter() assigns byte rows, else np.put()s void rows: per 2 copy
    # threads on memfd memory, 4 KiB rows 29 vs 19 GB/s, 256-byte rows 10 vs 22 GB/s.
    WIDE_ROW_BYTES = 1024

    def __init__(self, parts: list[np.ndarray], outer: np.ndarray, block_stride: int,
                 inner: np.ndarray, layers_per_part: int = 1):
        """`parts`: each a 1-d array of void rows from the part's first byte. Within a part,
        the row of outer position o, block b and inner position i is outer[o] + b ×
        block_stride + inner[i], and a chunk lists them by (o, block, i); the outer
        positions of a part hold `layers_per_part` layers, one after the other."""
        self.parts = parts
        self.layers_per_part = layers_per_part
        row_bytes = parts[0].dtype.itemsize
        self._byte_rows = ([part.view(np.uint8).reshape(-1, row_bytes) for part in parts]
                           if row_bytes >= self.WIDE_ROW_BYTES else None)
        self._outer = outer.reshape(1, -1, 1, 1)
        self._block_stride = block_stride
        self._inner = inner.reshape(1, 1, 1, -1)
        self._row = parts[0].dtype

    @classmethod
    def of(cls, layers: list[torch.Tensor], stacked: torch.Tensor | None, block_dim: int
           ) -> HostRows | None:
        """The rows of a cache on the CPU (its stacked view if it has one, else its layers,
        when they share one layout); None where its strides allow no rows of at least
        MIN_ROW_BYTES."""
        if not layers or layers[0].is_cuda:
            return None
        tensors, dim = ([stacked], block_dim + 1) if stacked is not None else (layers, block_dim)
        shape, strides = tensors[0].shape, tensors[0].stride()
        if any(t.shape != shape or t.stride() != strides for t in tensors):
            return None
        itemsize = tensors[0].element_size()
        run, last = 1, len(shape)  # the trailing dimensions that merge into one run
        while last > dim + 1 and (shape[last - 1] == 1 or strides[last - 1] == run):
            run *= shape[last - 1]
            last -= 1
        indexed = [d for d in range(last) if shape[d] > 1]
        if run * itemsize < cls.MIN_ROW_BYTES or any(strides[d] % run for d in indexed):
            return None

        def offsets(dims: range) -> np.ndarray:
            """Row offsets of every position of `dims`, in their order."""
            grid = np.zeros(1, dtype=np.int64)
            for d in dims:
                grid = (grid[:, None] + np.arange(shape[d]) * (strides[d] // run)).reshape(-1)
            return grid
        extent = 1 + sum((shape[d] - 1) * (strides[d] // run) for d in indexed)
        row = np.dtype((np.void, run * itemsize))
        parts = [torch.empty(0, dtype=torch.uint8).set_(
            t.untyped_storage(), t.storage_offset() * itemsize, (extent * row.itemsize,), (1,)
        ).numpy().view(row) for t in tensors]
        return cls(parts, offsets(range(dim)), strides[dim] // run, offsets(range(dim + 1, last)),
                   len(layers) if stacked is not None else 1)

    def rows(self, block_ids: np.ndarray) -> np.ndarray:
        """The rows of [chunks, blocks] block ids (checked, none SKIP_BLOCK) as [chunks,
        rows of a part], in the order a chunk's bytes hold them within each part."""
        chunks, blocks = block_ids.shape
        return (self._outer + block_ids[:, None, :, None] * self._block_stride
                + self._inner).reshape(chunks, self._outer.size * blocks * self._inner.size)

    def chunk(self, chunk_bytes: np.ndarray) -> np.ndarray:
        """A chunk's bytes (a slice of the pool) as [parts, rows of a part]."""
        return chunk_bytes.view(self._row).reshape(len(self.parts), -1)

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Copy `rows` of every part into `out` (a chunk() view). np.take moves each row with
        one memmove and releases the GIL; mode "clip" (the ids are checked, so it never
        clips) writes straight into `out`, where the default mode buffers."""
        for part, into in zip(self.parts, out):
            np.take(part, rows, out=into, mode="clip")

    def scatter(self, rows: np.ndarray, src: np.ndarray, layer: int | None = None) -> None:
        """Copy `src` (a chunk() view, or the same rows of each of its parts) into `rows` of
        every part, or of layer `layer` only; as gather(), without the GIL."""
        parts = self._byte_rows if self._byte_rows is not None else self.parts
        if layer is not None:
            which, within = divmod(layer, self.layers_per_part)
            per_layer = len(rows) // self.layers_per_part
            layer_rows = slice(within * per_layer, (within + 1) * per_layer)
            parts, rows, src = [parts[which]], rows[layer_rows], src[which:which + 1, layer_rows]
        for part, rows_of_part in zip(parts, src):
            if self._byte_rows is not None:
                # The row width, not -1: no rows (a chunk whose blocks are all skipped) is
                # an empty copy, where numpy cannot infer a width from nothing.
                part[rows] = rows_of_part.view(np.uint8).reshape(len(rows), part.shape[1])
            else:
                np.put(part, rows, rows_of_part, mode="clip")

    def scatter_skipping(self, block_ids: np.ndarray, src: np.ndarray,
                         layer: int | None = None) -> None:
        """scatter() for one chunk's [blocks] ids, some SKIP_BLOCK: those blocks stay alone."""
        keep = block_ids != SKIP_BLOCK
        per_block = src.reshape(len(self.parts), self._outer.size, len(keep), -1)
        self.scatter(self.rows(block_ids[keep].reshape(1, -1))[0],
                     per_block[:, :, keep].reshape(len(self.parts), -1), layer)
