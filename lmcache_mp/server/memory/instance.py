"""One registered worker cache mapped into the server: its layers and its torch copies."""

from __future__ import annotations

import logging
import mmap
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...memory import populate
from ...protocol import SKIP_BLOCK
from .cuda_ipc import Allocation
from .geometry import RAW_DTYPES, Geometry, raw
from .host_rows import ROW_WIDTHS, HostRows, rows_view

logger = logging.getLogger(__name__)

# Above this many bytes per block (all layers), one copy_ per block beats index_copy_.
_PER_BLOCK_SCATTER_BYTES = 256 * 1024


@dataclass(eq=False)
class KVCacheInstance:
    """One worker's registered paged KV cache, mapped into this process."""

    instance_id: int
    owner: bytes  # the ZeroMQ identity that registered it
    engine: bytes  # its session's engine: only ranks of the same engine share an MLA group
    model: str
    kv_world_size: int
    kv_worker_id: int
    tp_rank: int
    tp_group: str
    num_blocks: int
    geometry: Geometry
    layers: list[torch.Tensor]
    stacked: torch.Tensor | None  # all layers as one [L, ...] view when their memory allows it
    mappings: list[mmap.mmap]  # its memfds' windows
    last_seen: float
    allocations: list[Allocation] = field(default_factory=list)  # cuda_ipc allocations
    # What of `mappings` holds data, as (mapping, offset, length): all that is pre-faulted.
    prefault: list[tuple[mmap.mmap, int, int]] = field(default_factory=list)
    # Bytes of its memfds' extents, by the uid that sent them: counted against the limits.
    registered: Counter[int] = field(default_factory=Counter)
    lane: Any = None  # its streams.Lane when it lives on a GPU: copies go through the stream copier
    host_rows: HostRows | None = None  # a cache in CPU memory whose strides allow it
    copies_in_flight: int = 0
    closed: bool = False
    stop_watching: Callable[[], None] | None = None  # lets go of its fd channel watch
    stores: int = 0  # STORE requests it sent
    retrieves: int = 0  # RETRIEVE requests it sent
    loads_pushed: int = 0  # LOAD_DONE notices sent to it as an MLA follower
    _populating: threading.Thread | None = None
    # `stacked` as [layers × outer, blocks, row] words, per word width (None: no such view)
    _stacked_rows: dict[int, torch.Tensor | None] = field(default_factory=dict)
    def start_populating(self) -> None:
        """Fault the worker's pages into this process in the background, ahead of the first
        copy: those it allocated only, so that the server allocates none on its account."""
        def run() -> None:
            for mapping, offset, length in self.prefault:
                if not populate(mapping, lambda: self.closed, offset, length):
                    return  # it warned: the kernel cannot, and the next run won't do better
        self._populating = threading.Thread(target=run, name=f"populate-{self.instance_id}",
                                            daemon=True)
        self._populating.start()

    def _as_rows(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`stacked` and a chunk-shaped tensor as [outer, blocks, row] views of the widest
        integers both allow: an index kernel then moves 8-byte words, not 2-byte items
        (~4× faster on W2's 4 KiB blocks). None where strides forbid it. The cache's view is
        made once; a contiguous chunk's costs three views."""
        if self.stacked is None:
            return None
        dim = self.geometry.block_dim + 1
        for width in ROW_WIDTHS:
            if width not in self._stacked_rows:
                self._stacked_rows[width] = rows_view(self.stacked, dim, width)
            stacked = self._stacked_rows[width]
            if stacked is None:
                continue
            rows: torch.Tensor | None
            if chunk.is_contiguous() and chunk.data_ptr() % width == 0:
                rows = (chunk.view(-1).view(RAW_DTYPES[width])
                        .view(stacked.shape[0], chunk.shape[dim], stacked.shape[2]))
            else:
                rows = rows_view(chunk, dim, width)
            if rows is not None:
                return stacked, rows
        return None

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the given blocks of every layer into `out` (a chunk-shaped tensor on the
        cache's device); `block_ids` may be on the CPU. Bytes move, as integers."""
        dim = self.geometry.block_dim
        block_ids = block_ids.to(out.device, non_blocking=True)
        rows = self._as_rows(out)
        if rows is not None:
            torch.index_select(rows[0], 1, block_ids, out=rows[1])
            return
        out = raw(out)
        if self.stacked is not None:
            torch.index_select(raw(self.stacked), dim + 1, block_ids, out=out)
        else:
            for layer, dest in zip(self.layers, out):
                torch.index_select(raw(layer), dim, block_ids, out=dest)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor, has_skips: bool = False
                ) -> None:
        """Copy a chunk-shaped tensor into the given blocks of every layer; with `has_skips`,
        a block id of SKIP_BLOCK leaves that block alone (the engine already holds it)."""
        positions = None
        if has_skips:
            positions = (block_ids != SKIP_BLOCK).nonzero().flatten()
            block_ids = block_ids[positions]
        self.scatter_blocks(block_ids, src, positions)

    def scatter_blocks(self, block_ids: torch.Tensor, src: torch.Tensor,
                       positions: torch.Tensor | None) -> None:
        """Copy blocks `positions` of a chunk-shaped tensor (None: all of them) into blocks
        `block_ids` of every layer; the index tensors may be on any device. Bytes move, as
        integers."""
        dim = self.geometry.block_dim
        home = self.layers[0].device
        src = raw(src)
        if src.device != home:  # a chunk in the GPU tier, read into a cache in CPU memory
            src = src.to(home)
        if positions is not None:
            src = src.index_select(dim + 1, positions.to(src.device, non_blocking=True))
        block_ids = block_ids.to(src.device, non_blocking=True)
        targets = [(raw(self.stacked), src, dim + 1)] if self.stacked is not None else [
            (raw(layer), chunk_layer, dim) for layer, chunk_layer in zip(self.layers, src)]
        per_block = (not src.is_cuda  # one kernel per layer is far cheaper on a GPU
                     and self.geometry.block_bytes >= _PER_BLOCK_SCATTER_BYTES)
        rows = None if per_block else self._as_rows(src)
        if rows is not None:
            rows[0].index_copy_(1, block_ids, rows[1])
            return
        for target, source, block_dim in targets:
            if per_block:  # index_copy_ runs at half the speed of copy_ on large blocks
                for position, block in enumerate(block_ids.tolist()):
                    target.select(block_dim, block).copy_(source.select(block_dim, position))
            else:
                target.index_copy_(block_dim, block_ids, source)

    def unmap(self) -> None:
        if self._populating is not None:
            self._populating.join()
        self.layers = []
        self.stacked = None
        self._stacked_rows.clear()
        self.host_rows = None
        for mapping in self.mappings:
            try:
                mapping.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it
                logger.warning("instance %d: mapping still referenced at unmap", self.instance_id)
        self.mappings = []
        self.lane = None
        for allocation in self.allocations:
            allocation.close()
        self.allocations = []
