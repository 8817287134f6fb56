"""The staging segment the server maps: two halves, each filled while the other is in flight."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import torch

from ...client.memfd import SharedKVCache
from ...protocol import MemfdHandle
from .layers import part_handles, splits
from .pages import PageCodec, runs


class StagingBusy(Exception):
    """Other calls held the staging segment longer than this call would wait for it."""


class Half:
    """Consecutive staging blocks, one page a block, and the STORE or RETRIEVE that names
    them while the server may still read or write them."""

    def __init__(self, first_block: int, slots: np.ndarray):
        self.first_block = first_block
        self.slots = slots  # [pages, canonical page bytes]
        self.in_flight: Future | None = None

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def blocks(self, count: int) -> list[int]:
        return list(range(self.first_block, self.first_block + count))

    def fill(self, codec: PageCodec, pages: list[int]) -> None:
        """Copy host pages into this half's first blocks: one copy per run of consecutive
        pages."""
        for position, first, count in runs(pages):
            np.copyto(self.slots[position:position + count], codec.run(first, count))

    def drain(self, codec: PageCodec, pages: list[int]) -> None:
        """Copy this half's first blocks into host pages."""
        for position, first, count in runs(pages):
            np.copyto(codec.run(first, count), self.slots[position:position + count])

    def settle(self, patience: float) -> None:
        """Wait until the server touches this half no more (what it answered is dropped)."""
        future, self.in_flight = self.in_flight, None
        if future is not None:
            settle(future, patience)


def settle(future: Future, patience: float) -> None:
    """Wait until a STORE's or RETRIEVE's future settles, answered or not: it does by itself
    at its budget plus the client's margin, after which the server touches the memory it
    names no more; `patience` only ends a hang."""
    with contextlib.suppress(Exception):
        future.exception(patience)


class Staging:
    """A sealed memfd registered like a vLLM worker's CPU cache (one layer of `pages`
    blocks of `chunk_size` × width bytes, one SGLang page a block), in two halves so
    that the backend copies one slice of a batch while the server copies the other (one
    half when `pages` is 1).

    A call takes every half that is free, for its whole batch (SGLang's batches are at
    most 128 pages); a call that finds none free (a prefetch during a backup) waits for
    them, at most `patience` seconds."""

    def __init__(self, codec: PageCodec, pages: int, chunk_size: int):
        self.codec = codec
        self.chunk_size = chunk_size
        width = math.ceil(codec.page_bytes / chunk_size)
        self.cache = SharedKVCache("mla", 1, pages, chunk_size, 1, width, torch.uint8)
        slots = codec.slots(self.cache.layers[0].numpy().reshape(pages, -1))
        first = (pages + 1) // 2
        bounds = [(0, first), (first, pages)] if pages > 1 else [(0, pages)]
        self._free = [Half(start, slots[start:end]) for start, end in bounds]
        self._freed = threading.Condition()

    def handles(self) -> list[MemfdHandle]:
        """The page's parts as layers where they split (layers.splits), else one layer."""
        if not splits(self.codec, self.chunk_size):
            return self.cache.handles()
        block_bytes = self.codec.page_bytes  # each part whole rows: no padding
        return part_handles(self.codec, self.cache.name, self.chunk_size,
                            self.cache.num_blocks, self.codec.part_bytes, block_bytes)

    @contextlib.contextmanager
    def halves(self, patience: float) -> Iterator[list[Half]]:
        """The halves free now (once one is), for one batch; given back once the server
        touches them no more. Raises StagingBusy after `patience` seconds without one."""
        with self._freed:
            if not self._freed.wait_for(lambda: self._free, patience):
                raise StagingBusy(f"the staging segment stayed busy for {patience:g} s")
            taken, self._free = self._free, []
        try:
            yield taken
        finally:
            for half in taken:
                half.settle(patience)
            with self._freed:
                self._free += taken
                self._freed.notify_all()

    def close(self) -> None:
        self.cache.close()
